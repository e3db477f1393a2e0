"""Every collective phalanx issues leaves an entry; the hang watchdog and the desync check read them.

    work = watched(dist.all_reduce, flat, group=group, async_op=True, label="ddp bucket 3")

An entry holds the group's sequence number, the op, the payload (elements and dtype), phalanx's own label for it and
the user's ``file:line`` that led to it. It is open from the call until the collective is done: until the call
returns; for ``async_op=True`` until ``wait()``; on NCCL, where a call returns once the work is queued, until the
device has finished it (the watchdog asks the work). Recording costs a few microseconds per collective and nothing
when the log is off (one process, or ``hang_timeout_s=0`` without ``debug_collectives``).

With ``debug_collectives``, each collective is preceded by a small all-gather of its fingerprint (sequence number, op,
elements, dtype) over the same ranks, and ranks that disagree stop at once with :class:`CollectiveMismatchError`
naming each rank's call, before any wrong bytes are reduced.

Under ``phalanx launch`` and ``phalanx.spawn`` each rank also keeps its last entries in a small ring file that the
launcher reads after the rank has ended (:class:`Ring`): a fixed-size file mapped into memory and written in place,
so that an entry costs no system call, and survives the process whatever kills it (SIGKILL, SIGABRT from native code:
the pages belong to the file, not to the process). :func:`ring_report` composes the launcher's report from the
rings: each rank's last collectives, and the first point where the ranks of a group disagree.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import struct
import sys
import sysconfig
import tempfile
import time
import weakref
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from phalanx.runtime import nccl_rules

__all__ = [
    "ENV_RING_DIR",
    "LOG",
    "CollectiveError",
    "CollectiveLog",
    "CollectiveMismatchError",
    "Entry",
    "Ring",
    "format_site",
    "read_rings",
    "ring_directory",
    "ring_report",
    "watched",
]

ENV_RING_DIR = "PHALANX_COLLECTIVE_RING_DIR"
"""Set by ``phalanx launch`` and ``phalanx.spawn`` for their ranks: the directory of the ranks' ring files."""


class CollectiveError(RuntimeError):
    """A collective failed; the message says which one, where it was called, and what the other ranks were doing."""


class CollectiveMismatchError(CollectiveError):
    """Ranks of one group called different collectives at the same point of their sequence (``debug_collectives``)."""


_PHALANX = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package, from runtime/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB = sysconfig.get_paths()["stdlib"]
_SITE = sysconfig.get_paths()["purelib"]


def _library(filename: str) -> bool:
    """Frames we look through to find the user's line: phalanx, torch and Python's standard library."""
    if filename.startswith((_PHALANX, _TORCH, "<frozen")):
        return True
    return filename.startswith(_STDLIB) and not filename.startswith(_SITE)


def _user_frame(depth: int = 2) -> tuple[str, int] | None:
    frame: Any = sys._getframe(depth)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _library(filename):
            return filename, frame.f_lineno
        frame = frame.f_back
    return None  # no user code on this thread's stack (an autograd thread on a GPU)


def format_site(site: tuple[str, int] | None) -> str:
    if site is None:
        return "no user frame (autograd's thread)"
    filename, line = site
    try:
        rel = os.path.relpath(filename)
        filename = rel if not rel.startswith("..") else filename
    except ValueError:
        pass
    return f"{filename}:{line}"


_DTYPES: dict[Any, int] = {}


def _code(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class Entry:
    """One collective on one rank. ``group``: the global ranks of its process group; ``seq``: its place in that
    group's sequence (0 for point-to-point); ``peer``: the other rank of a send or a receive."""

    __slots__ = ("done", "dtype", "group", "label", "numel", "op", "peer", "seq", "site", "slot", "t0", "work")

    def __init__(
        self,
        group: tuple[int, ...],
        seq: int,
        op: str,
        numel: int,
        dtype: Any,
        label: str | None,
        site: tuple[str, int] | None,
        peer: int | None,
    ) -> None:
        self.group, self.seq, self.op, self.numel, self.dtype = group, seq, op, numel, dtype
        self.label, self.site, self.peer = label, site, peer
        self.t0 = time.monotonic()
        self.work: Any = None
        self.done = False
        self.slot = 0  # its record's number in the ring file (0: none)

    def fingerprint(self) -> tuple[int, int, int, int, int, int]:
        """What every rank of the group must agree on: the place in the sequence, the op, the payload, phalanx's
        label, and the line that called it (so that a skipped collective is caught even when the next one has the
        same shape)."""
        site = f"{os.path.basename(self.site[0])}:{self.site[1]}" if self.site else ""
        return self.seq, _code(self.op), self.numel, _code(str(self.dtype)), _code(self.label or ""), _code(site)

    def as_dict(self, now: float) -> dict[str, Any]:
        return {
            "group": list(self.group),
            "seq": self.seq,
            "op": self.op,
            "numel": self.numel,
            "dtype": str(self.dtype or ""),
            "label": self.label,
            "site": format_site(self.site),
            "age": round(now - self.t0, 1),
            "open": not self.done,
            "peer": self.peer,
        }


def describe(e: dict[str, Any], world: int) -> str:
    """``all_reduce #812 of ranks 0-3 (ddp bucket 3, 6291456 x float32 = 24.0 MiB)``. ``e["group"]``: the ranks, or
    their text already (a ring file's record)."""
    if e["peer"] is not None:
        return f"{e['op']} {'to' if e['op'] == 'send' else 'from'} rank {e['peer']} ({_payload(e)})"
    group = e["group"] if isinstance(e["group"], str) else ranks_text(e["group"], world)
    return f"{e['op']} #{e['seq']} of {group} ({_payload(e)})"


def _payload(e: dict[str, Any]) -> str:
    """``ddp bucket 3, 6291456 x float32 = 24.0 MiB``."""
    size = _ITEM_BYTES.get(e["dtype"], 4) * e["numel"]
    what = f"{e['numel']} x {e['dtype'].removeprefix('torch.')} = {_fmt_bytes(size)}" if e["numel"] else "no payload"
    return f"{e['label']}, {what}" if e["label"] else what


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def ranks_text(ranks: list[int] | tuple[int, ...], world: int) -> str:
    ranks = list(ranks)
    if len(ranks) == world and world > 2:
        return f"all {world} ranks"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


_ITEM_BYTES = {
    str(d): torch.empty(0, dtype=d).element_size()
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.int8,
        torch.bool,
    )
}


# ------------------------------------------------------------------------------------------- the ring file
# A header, then _CAPACITY records of 256 bytes. A record is written whole by one pack_into (a copy into the mapped
# page: no system call), with its number (the stamp) last; then the header's count. A reader trusts the records up to
# the count whose stamps match their number, and leaves out the oldest slot, which a writer killed mid-copy may have
# half overwritten.
_MAGIC = b"phxring1"
# magic, rank, pid, record size, capacity, optimizer steps (at 24), count (at 32), host
_HEADER = struct.Struct("<8siiIIQQ64s")
_COUNT = struct.Struct("<Q")
_STEPS_AT, _COUNT_AT = 24, 32
_HEAD_BYTES = 128
# seq, t0, t1, state, line, peer, group crc, group size, step, numel, dtype, op, label, group text, file, stamp
_RECORD = struct.Struct("<qddB3xIiIIIq12s16s40s40s84sQ")
_END = struct.Struct("<dB")  # t1 and state, at 16: what finishing an entry writes
_CAPACITY = 1024
OPEN, DONE, FAILED = 0, 1, 2


class Ring:
    """This rank's last ``capacity`` entries in a file mapped into memory (see the module docstring and the layout
    above). Written from the collective's own thread; read by the launcher, after the rank has ended or while it
    runs (the straggler watch)."""

    def __init__(self, path: str, rank: int, capacity: int = _CAPACITY) -> None:
        if capacity < 2:
            raise ValueError(f"a ring's capacity must be >= 2 records (the oldest is never read); got {capacity}")
        size = _HEAD_BYTES + capacity * _RECORD.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.capacity = path, capacity
        host = socket.gethostname().encode()[:64]
        _HEADER.pack_into(self.mm, 0, _MAGIC, rank, os.getpid(), _RECORD.size, capacity, 0, 0, host)
        self.count = 0
        self._numbers = itertools.count(1)
        self.steps = 0
        """Optimizer steps this rank has taken (:func:`_stepped`): each record says in which step it was called."""
        # op, label, dtype, file -> the bytes written for it
        self._ops: dict[Any, bytes] = {}
        self._labels: dict[Any, bytes] = {}
        self._dtypes: dict[Any, bytes] = {}
        self._files: dict[Any, bytes] = {}

    @staticmethod
    def _keep(table: dict[Any, bytes], key: Any, text: str, width: int) -> bytes:
        b = text.encode(errors="replace")
        b = b if len(b) <= width else b[-width:]  # a long path keeps its end: the file's name
        if len(table) > 4096:  # labels made with f-strings could grow it without end
            table.clear()
        table[key] = b
        return b

    def put(self, e: Entry, group: tuple[int, int, bytes]) -> int:
        """Write ``e`` as open; returns its number (its ``slot``). Texts are encoded once each, then looked up."""
        op = self._ops.get(e.op)
        if op is None:
            op = self._keep(self._ops, e.op, e.op, 16)
        label = self._labels.get(e.label)
        if label is None:
            label = self._keep(self._labels, e.label, e.label or "", 40)
        dtype = self._dtypes.get(e.dtype)
        if dtype is None:
            dtype = self._keep(self._dtypes, e.dtype, str(e.dtype or "").removeprefix("torch."), 12)
        file: bytes | None = b""
        line = 0
        if e.site is not None:
            file, line = self._files.get(e.site[0]), e.site[1]
            if file is None:
                file = self._keep(self._files, e.site[0], format_site((e.site[0], 0))[:-2], 84)
        n = next(self._numbers)  # atomic under the GIL: a collective on another thread (autograd's) takes another
        self.count = max(self.count, n)
        at = _HEAD_BYTES + (n - 1) % self.capacity * _RECORD.size
        peer = -1 if e.peer is None else e.peer
        _RECORD.pack_into(
            self.mm, at, e.seq, e.t0, 0.0, OPEN, line, peer, group[0], group[1], self.steps, e.numel, dtype, op,
            label, group[2], file, n
        )  # fmt: skip
        _COUNT.pack_into(self.mm, _COUNT_AT, self.count)
        return n

    def end(self, slot: int, failed: bool) -> None:
        if slot > self.count - self.capacity:  # not overwritten since
            at = _HEAD_BYTES + (slot - 1) % self.capacity * _RECORD.size
            _END.pack_into(self.mm, at + 16, time.monotonic(), FAILED if failed else DONE)

    def stepped(self) -> None:
        self.steps += 1
        _COUNT.pack_into(self.mm, _STEPS_AT, self.steps)

    def clear(self) -> None:
        self.count = self.steps = 0
        self._numbers = itertools.count(1)
        _COUNT.pack_into(self.mm, _COUNT_AT, 0)
        _COUNT.pack_into(self.mm, _STEPS_AT, 0)


def _cstr(b: bytes) -> str:
    return b.rstrip(b"\0").decode(errors="replace")


def read_ring(path: str, after: int = 0) -> dict[str, Any] | None:
    """A ring file's header and its records numbered above ``after`` (oldest first), or None when the file is not
    a ring (yet). Each record is a dict as :meth:`Entry.as_dict` gives, with ``t0``/``t1`` (the writer's
    ``time.monotonic()``, one clock for every process of a machine), ``state``, ``step`` (the optimizer steps the rank
    had taken when it called) and ``n`` (its number)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if len(data) < _HEAD_BYTES or data[:8] != _MAGIC:
        return None
    _, rank, pid, record_size, capacity, steps, count, host = _HEADER.unpack_from(data, 0)
    if record_size != _RECORD.size or len(data) < _HEAD_BYTES + capacity * record_size:
        return None
    records = []
    for n in range(max(after + 1, count - capacity + 2, 1), count + 1):
        fields = _RECORD.unpack_from(data, _HEAD_BYTES + (n - 1) % capacity * record_size)
        if fields[-1] != n:  # being overwritten as we read
            continue
        seq, t0, t1, state, line, peer, gcrc, gsize, step, numel, dtype, op, label, gtext, file, _ = fields
        file_text = _cstr(file)
        records.append(
            {
                "n": n,
                "seq": seq,
                "t0": t0,
                "t1": t1,
                "state": state,
                "op": _cstr(op),
                "numel": numel,
                "dtype": ("torch." + _cstr(dtype)) if dtype.strip(b"\0") else "",
                "label": _cstr(label) or None,
                "group": _cstr(gtext),
                "group_key": (gcrc, gsize),
                "step": step,
                "peer": None if peer < 0 else peer,
                "site": f"{file_text}:{line}" if file_text else format_site(None),
            }
        )
    return {"rank": rank, "pid": pid, "host": _cstr(host), "count": count, "steps": steps, "records": records}


def ring_directory() -> str:
    """A new private directory for a job's ring files: in ``/dev/shm`` (memory) where there is one."""
    shm = "/dev/shm"
    return tempfile.mkdtemp(prefix="phalanx-ring-", dir=shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None)


def read_rings(directory: str) -> dict[int, dict[str, Any]]:
    """Every rank's ring in ``directory`` (those of this machine), by rank."""
    out: dict[int, dict[str, Any]] = {}
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if name.startswith("rank-") and name.endswith(".ring"):
            ring = read_ring(os.path.join(directory, name))
            if ring is not None:
                out[ring["rank"]] = ring
    return out


def _call(r: dict[str, Any]) -> tuple[Any, ...]:
    return r["op"], r["numel"], r["dtype"], r["label"], r["site"]


def disagreement(rings: dict[int, dict[str, Any]], world: int) -> str | None:
    """The first place where the ranks of a group called different collectives, as one sentence, or None: the
    lowest sequence number, in any group, that two rings hold with different calls (op, size, label, line)."""
    calls: dict[tuple[Any, int], dict[int, dict[str, Any]]] = {}
    for rank, ring in rings.items():
        for r in ring["records"]:
            if r["peer"] is None and r["seq"] > 0:
                calls.setdefault((r["group_key"], r["seq"]), {})[rank] = r
    found = None
    for (_, seq), by_rank in calls.items():
        if len(by_rank) > 1 and len({_call(r) for r in by_rank.values()}) > 1:
            first = min(r["t0"] for r in by_rank.values())
            if found is None or (seq, first) < found[:2]:
                found = (seq, first, by_rank)
    if found is None:
        return None
    by_rank = found[2]
    kinds: dict[tuple[Any, ...], list[int]] = {}
    for rank in sorted(by_rank):
        kinds.setdefault(_call(by_rank[rank]), []).append(rank)
    parts = []
    for ranks in sorted(kinds.values(), key=len):  # the odd one out first
        r = by_rank[ranks[0]]
        parts.append(f"{ranks_text(ranks, world)} called {r['op']} ({_payload(r)}) at {r['site']}")
    some = next(iter(by_rank.values()))
    return (
        f"the ranks disagree at collective #{found[0]} of {some['group']}: " + ", while ".join(parts) + ". Every rank "
        "of a group must issue the same collectives in the same order: look for a branch that depends on the rank or "
        "on the data (debug_collectives=True stops such a call before any bytes move)"
    )


_STATE_TEXT = {OPEN: "in it when the rank ended", DONE: "done", FAILED: "failed"}


def ring_report(rings: dict[int, dict[str, Any]], world: int, last: int = 3, who: str = "phalanx launch") -> str:
    """Each rank's last ``last`` collectives, newest first, then where the ranks disagree (if they do). ``who``
    begins the lines: the launcher's name."""
    lines = [f"{who}: each rank's last collectives (its collective log, read after it ended):"]
    for rank in sorted(rings):
        ring = rings[rank]
        records = ring["records"][-last:][::-1]
        if not records:
            lines.append(f"  rank {rank} (pid {ring['pid']}): no collective yet")
            continue
        for i, r in enumerate(records):
            head = f"  rank {rank} (pid {ring['pid']}):" if i == 0 else " " * len(f"  rank {rank} (pid {ring['pid']}):")
            lines.append(f"{head} {describe(r, world)} at {r['site']}, {_STATE_TEXT.get(r['state'], '?')}")
    found = disagreement(rings, world)
    if found:
        lines.append(f"{who}: {found}.")
    return "\n".join(lines)


class CollectiveLog:
    """This process's collectives: a sequence number per group, the open entries and the recent ones."""

    def __init__(self) -> None:
        self.on = False
        self.recent: deque[Entry] = deque(maxlen=64)
        self.open: dict[int, Entry] = {}
        self.seq: dict[tuple[int, ...], int] = {}
        self._groups: dict[int, tuple[tuple[int, ...], bool, tuple[int, int, bytes]]] = {}
        """id(group) -> (ranks, polled: NCCL, what the ring writes of the group: crc of its ranks, size, text)"""
        self.ring: Ring | None = None
        """This rank's ring file, under ``phalanx launch`` and ``phalanx.spawn``."""
        self._key = 0
        self.precheck: Callable[[Entry, Any], None] | None = None
        """Set by the watchdog under ``debug_collectives``: compares this call with the group's before it runs."""
        self.explain: Callable[[Entry, BaseException], str] | None = None
        """Set by the watchdog: what the other ranks were doing when this collective failed."""
        self.blocked: Entry | None = None
        """The entry whose call or ``wait()`` the main thread is inside now (the one to name in a report)."""

    def reset(self) -> None:
        """A new process group: sequence numbers start again, and the groups of the old one are forgotten."""
        self.recent.clear()
        self.open.clear()
        self.seq.clear()
        self._groups.clear()
        self.blocked = None
        if self.ring is not None:
            self.ring.clear()

    def open_ring(self, directory: str, rank: int) -> None:
        """Keep this rank's last entries in ``directory/rank-<rank>.ring`` too (the launcher reads it), and count the
        optimizer steps there (the launcher's straggler watch compares the ranks step by step)."""
        global _STEP_HOOK
        self.ring = Ring(os.path.join(directory, f"rank-{rank}.ring"), rank)
        if _STEP_HOOK is None:
            _STEP_HOOK = register_optimizer_step_post_hook(_stepped)

    def _group(self, group: Any) -> tuple[tuple[int, ...], bool, tuple[int, int, bytes]]:
        known = self._groups.get(id(group))
        if known is None:
            g = group if group is not None else dist.group.WORLD
            ranks = tuple(dist.get_process_group_ranks(g))
            text = ranks_text(ranks, dist.get_world_size()).encode()
            ring = (_code(",".join(map(str, ranks))), len(ranks), text if len(text) <= 40 else text[:37] + b"...")
            known = self._groups[id(group)] = (ranks, dist.get_backend(g) == "nccl", ring)
        return known

    def begin(self, op: str, group: Any, payload: Any, label: str | None, peer: int | None) -> tuple[Entry, bool]:
        ranks, polled, ring_group = self._group(group)
        if peer is None:
            seq = self.seq.get(ranks, 0) + 1
            self.seq[ranks] = seq
        else:
            seq = 0
        if isinstance(payload, torch.Tensor):
            entry = Entry(ranks, seq, op, payload.numel(), payload.dtype, label, _user_frame(3), peer)
        else:
            entry = Entry(ranks, seq, op, 0, None, label, _user_frame(3), peer)
        self._key += 1
        if len(self.open) > 256:  # NCCL entries close when polled: poll here too, should the watchdog not
            self.sweep()
        # No lock on the hot path: under the GIL, one append or one dict store is atomic, and the watchdog's
        # readers copy with list(), which runs no Python code in between.
        self.recent.append(entry)
        self.open[self._key] = entry
        entry.work = self._key  # replaced by the work when there is one to poll
        if self.ring is not None:
            entry.slot = self.ring.put(entry, ring_group)
        return entry, polled

    def finish(self, entry: Entry, key: int, failed: bool = False) -> None:
        entry.done = True
        entry.work = None  # a finished NCCL work holds its tensors: let them go
        self.open.pop(key, None)
        if entry.slot and self.ring is not None:
            self.ring.end(entry.slot, failed)

    def sweep(self) -> None:
        """Close entries whose device work has completed (NCCL: the host never waits for them itself)."""
        entries = list(self.open.items())
        for key, e in entries:
            w = e.work
            if isinstance(w, torch.cuda.Event):
                if w.query():
                    self.finish(e, key)
            elif w is not None and not isinstance(w, int):
                works = w if isinstance(w, list) else [w]
                if all(x.is_completed() for x in works):
                    self.finish(e, key)

    def settle(self, entry: Entry, key: int, device_work: bool) -> None:
        """A polled (NCCL) collective was waited for: the stream waits, the device finishes later. Keep an event on the
        stream, not the work: a work holds its output tensors (activations under tp) until it is swept."""
        if device_work:
            event = torch.cuda.Event()
            event.record()
            entry.work = event
        else:
            self.finish(entry, key)

    def oldest_open(self) -> Entry | None:
        entries = list(self.open.values())
        return min(entries, key=lambda e: e.t0) if entries else None

    def snapshot(self) -> tuple[list[Entry], list[Entry], dict[tuple[int, ...], int]]:
        return list(self.open.values()), list(self.recent), dict(self.seq)


LOG = CollectiveLog()
_STEP_HOOK: Any = None
_FIRST_OPTIMIZER: list[Any] = []  # a weak reference to the optimizer whose steps are counted


def _stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After every ``optimizer.step()`` in this process (torch's global hook): count the steps of one optimizer,
    the first that steps, so that a model with two optimizers counts each step once."""
    ring = LOG.ring
    if ring is None:
        return
    first = _FIRST_OPTIMIZER[0]() if _FIRST_OPTIMIZER else None
    if first is None:
        _FIRST_OPTIMIZER[:] = [weakref.ref(optimizer)]
    elif first is not optimizer:
        return
    ring.stepped()


class WatchedWork:
    """An async collective's work: ``wait()`` closes its entry (on NCCL, hands it to an event: see ``settle``).
    ``pending``: the works of one entry still to be waited for (a batch of sends and receives), shared by them."""

    __slots__ = ("_device_work", "_entry", "_key", "_pending", "_work")

    def __init__(
        self, work: Any, entry: Entry, key: int, device_work: bool | None = None, pending: list[int] | None = None
    ) -> None:
        self._work, self._entry, self._key = work, entry, key
        self._device_work, self._pending = device_work, pending

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        LOG.blocked = self._entry
        try:
            out = self._work.wait(*args, **kwargs)
        except RuntimeError as e:
            LOG.finish(self._entry, self._key, failed=True)
            _raise_explained(self._entry, e)
        finally:
            LOG.blocked = None
        self._work = _WAITED
        if self._pending is not None:
            self._pending[0] -= 1
            if self._pending[0] > 0:
                return out
        if self._device_work is None:
            LOG.finish(self._entry, self._key)
        else:
            LOG.settle(self._entry, self._key, self._device_work)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _Waited:
    """What a waited work is replaced by, so that the wrapper keeps no output tensor alive."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_WAITED = _Waited()


def _raise_explained(entry: Entry, error: BaseException) -> None:
    """Re-raise ``error`` (its type kept, so that callers' ``except`` clauses still match) with a note that says which
    collective failed, from where, and which ranks no longer answer."""
    explain = LOG.explain
    if (
        explain is not None
        and not isinstance(error, torch.OutOfMemoryError)
        and not getattr(error, "_phalanx_noted", False)
    ):
        note = explain(entry, error)
        error._phalanx_noted = True  # type: ignore[attr-defined]
        if hasattr(error, "add_note"):  # Python 3.11+: printed under the traceback
            error.add_note(note)
        else:
            raise CollectiveError(note) from error
    raise error


_P2P = {"isend": "dst", "irecv": "src", "send": "dst", "recv": "src"}
_OP_NAMES: dict[Any, str] = {}
# c10d functions without async_op (or, for barrier, whose NCCL work the host must wait for): called as they are.
_NO_ASYNC = {dist.barrier, dist.all_gather_object, dist.broadcast_object_list, dist.batch_isend_irecv}


def watched(fn: Callable[..., Any], *args: Any, label: str | None = None, **kwargs: Any) -> Any:
    """Call the c10d function ``fn`` with ``args``/``kwargs`` and log it (see the module docstring)."""
    if nccl_rules.enabled():
        nccl_rules.check(fn.__name__, args, kwargs)
    if not LOG.on:
        return fn(*args, **kwargs)
    op = _OP_NAMES.get(fn)
    if op is None:
        op = _OP_NAMES[fn] = fn.__name__.removesuffix("_single").removesuffix("_into_tensor").removesuffix("_tensor")
    peer = kwargs.get(_P2P[op]) if op in _P2P else None
    if peer is not None and op[0] == "i":
        op = op[1:]
    payload = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else (args[0] if args else None)
    if fn is dist.batch_isend_irecv:  # point-to-point: no place in a group's sequence, no fingerprint to compare
        op, peer, payload = "send/recv", args[0][0].peer, args[0][0].tensor
    entry, polled = LOG.begin(op, kwargs.get("group"), payload, label, peer)
    key: int = entry.work
    if LOG.precheck is not None and peer is None:
        LOG.precheck(entry, kwargs.get("group"))
    asked_async = kwargs.get("async_op", False)
    device_work = isinstance(payload, torch.Tensor) and payload.is_cuda
    try:
        if polled and not asked_async and peer is None and fn not in _NO_ASYNC:
            # NCCL: queue it, make the stream wait (what a synchronous call does), and let the watchdog poll it.
            kwargs["async_op"] = True
            work = fn(*args, **kwargs)
            work.wait()
            LOG.settle(entry, key, device_work)
            return None
        LOG.blocked = entry
        out = fn(*args, **kwargs)
    except RuntimeError as e:
        LOG.finish(entry, key, failed=True)
        _raise_explained(entry, e)
    finally:
        LOG.blocked = None
    if polled and out is not None:
        # The log holds the work only until the caller waits for it (then an event): it holds the output tensors.
        entry.work = out
        if isinstance(out, list):
            pending = [len(out)]
            return [WatchedWork(w, entry, key, device_work, pending) for w in out]
        return WatchedWork(out, entry, key, device_work)
    if asked_async or op in ("send", "recv") and fn.__name__.startswith("i"):
        return WatchedWork(out, entry, key)
    LOG.finish(entry, key)
    return out
