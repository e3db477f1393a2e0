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
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime import nccl_rules

__all__ = ["LOG", "CollectiveError", "CollectiveLog", "CollectiveMismatchError", "Entry", "format_site", "watched"]


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

    __slots__ = ("done", "dtype", "group", "label", "numel", "op", "peer", "seq", "site", "t0", "work")

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
    """``all_reduce #812 of ranks 0-3 (ddp bucket 3, 6291456 x float32 = 24.0 MiB)``."""
    size = _ITEM_BYTES.get(e["dtype"], 4) * e["numel"]
    what = f"{e['numel']} x {e['dtype'].removeprefix('torch.')} = {_fmt_bytes(size)}" if e["numel"] else "no payload"
    label = f"{e['label']}, " if e["label"] else ""
    if e["peer"] is not None:
        return f"{e['op']} {'to' if e['op'] == 'send' else 'from'} rank {e['peer']} ({label}{what})"
    return f"{e['op']} #{e['seq']} of {ranks_text(e['group'], world)} ({label}{what})"


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


class CollectiveLog:
    """This process's collectives: a sequence number per group, the open entries and the recent ones."""

    def __init__(self) -> None:
        self.on = False
        self.recent: deque[Entry] = deque(maxlen=64)
        self.open: dict[int, Entry] = {}
        self.seq: dict[tuple[int, ...], int] = {}
        self._groups: dict[int, tuple[tuple[int, ...], bool]] = {}  # id(group) -> (ranks, polled: NCCL)
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

    def _group(self, group: Any) -> tuple[tuple[int, ...], bool]:
        known = self._groups.get(id(group))
        if known is None:
            g = group if group is not None else dist.group.WORLD
            ranks = tuple(dist.get_process_group_ranks(g))
            known = self._groups[id(group)] = (ranks, dist.get_backend(g) == "nccl")
        return known

    def begin(self, op: str, group: Any, payload: Any, label: str | None, peer: int | None) -> tuple[Entry, bool]:
        ranks, polled = self._group(group)
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
        return entry, polled

    def finish(self, entry: Entry, key: int) -> None:
        entry.done = True
        entry.work = None  # a finished NCCL work holds its tensors: let them go
        self.open.pop(key, None)

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
            LOG.finish(self._entry, self._key)
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
        LOG.finish(entry, key)
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
