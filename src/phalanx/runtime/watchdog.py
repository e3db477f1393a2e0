"""The hang watchdog: a rank stuck in a collective ends the job within seconds, with one message naming who is missing.

    engine = phalanx.Engine(hang_timeout_s=120)      # or PHALANX_HANG_TIMEOUT_S=120, or hang_timeout_s: 120 in YAML

Every rank runs one daemon thread beside its training loop. About once a second it answers requests for its state
through the rendezvous store the job already has (the launcher's, or the ``file://`` store of ``phalanx.spawn``) and
checks this rank's oldest open collective (see :mod:`phalanx.collective_log`). When that collective has been waited
on for ``hang_timeout_s``, the first rank to notice asks every rank for its state: its open collectives, its
sequence number in each group, its main thread's Python stack. It waits up to ``ANSWER_S`` for the answers, prints
one report, and every rank leaves with exit code ``HANG_EXIT_CODE``, for example::

    phalanx watchdog: ranks 0, 2, 3 have waited 62 s in all_reduce #812 of all 4 ranks (ddp bucket 3, ...),
    called from train.py:57.
      rank 1 has not reached it (its last collective there is #811); it is at data.py:88 in read.

The default timeout is 300 s on CPU (gloo) and 600 s on CUDA (NCCL); ``hang_timeout_s=0`` turns the watchdog off.
When a collective fails instead (a peer's connection closed: it died), the error says which ranks no longer answer.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from phalanx.logging import get_logger
from phalanx.runtime import nccl_rules
from phalanx.runtime.collective_log import (
    ENV_RING_DIR,
    LOG,
    CollectiveMismatchError,
    Entry,
    _library,
    describe,
    format_site,
    ranks_text,
)
from phalanx.runtime.world import ENV_STORE_PER_ATTEMPT, script_failed

__all__ = ["ANSWER_S", "HANG_EXIT_CODE", "Watchdog", "default_hang_timeout", "start_watchdog"]

HANG_EXIT_CODE = 86
"""Every rank of a job the watchdog stopped exits with this code; ``phalanx launch`` recognises it."""
ANSWER_S = 10.0
"""How long the reporting rank waits for the other ranks' states. A rank that does not answer is gone, or its main
thread holds Python's lock in native code (the watchdog thread of a live process answers within a second)."""
_EXPLAIN_S = 5.0  # the same, when a collective has failed rather than hung


def default_hang_timeout(device_type: str) -> float:
    """300 s on CPU, 600 s on CUDA.

    The watchdog must not fire on a rank that is only slow. The longest legitimate waits are skews between ranks:
    one rank writing a larger checkpoint shard or doing rank-0-only work (evaluation, logging) while the others wait
    at the next collective; a data loader's first batch. On CPU these take seconds to a few minutes. On CUDA,
    ``torch.compile`` and autotuning on one rank (a recompile for a new shape) can take several minutes more, and a
    NCCL collective's entry stays open until the device has run it. Both stay well under ``timeout_s`` (1800 s),
    where c10d itself would give up with a message that names no rank.
    """
    return 600.0 if device_type == "cuda" else 300.0


def _stack_of_main_thread() -> list[dict[str, Any]]:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return []
    return [
        {"site": format_site((fs.filename, fs.lineno or 0)), "func": fs.name, "library": _library(fs.filename)}
        for fs in traceback.extract_stack(frame)
    ]


def _where(stack: list[dict[str, Any]]) -> str:
    if not stack:
        return "somewhere its main thread's stack could not be read"
    user = next((f for f in reversed(stack) if not f["library"]), None)
    inner = stack[-1]
    if user is None:
        return f"at {inner['site']} in {inner['func']}"
    text = f"at {user['site']} in {user['func']}"
    return text if user is inner else f"{text} (inside {inner['site']} in {inner['func']})"


def _group_key(ranks: Any) -> str:
    return ",".join(map(str, ranks))


class Watchdog:
    """One rank's watchdog thread and its side of the store protocol (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        hang_timeout_s: float,
        mirrors: dict[tuple[int, ...], Any],
        device: torch.device | None = None,
    ) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.device = device or torch.device("cpu")
        """Where a fingerprint goes for a group with no gloo mirror (a kv sub-group, a Horovod process set)."""
        self.hang_timeout_s = hang_timeout_s
        self.poll_s = min(1.0, max(0.1, hang_timeout_s / 10)) if hang_timeout_s > 0 else 1.0
        self.mirrors = mirrors  # ranks -> gloo group for the fingerprint exchange (debug_collectives)
        self.answered = 0
        self.reporting = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.world_group = dist.group.WORLD
        self._broken = False

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.hang_timeout_s > 0:
            self._thread = threading.Thread(target=self._run, name="phalanx-watchdog", daemon=True)
            self._thread.start()

    def stop(self, failed: bool = False) -> None:
        """The script is ending: leave a last state so that a peer still waiting learns that this rank has left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            final = {**self.state(), "finished": True, "failed": failed}
            self.store.set(f"final/{self.rank}", json.dumps(final))
        except Exception:  # noqa: BLE001 - the store may be gone at exit; there is nothing left to tell
            pass

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.poll_s):
            try:
                self._tick()
                failures = 0
            except Exception as e:  # noqa: BLE001 - the watchdog must never take the training process down itself
                failures += 1
                if failures == 5:
                    get_logger().warning(
                        f"phalanx watchdog on rank {self.rank}: the rendezvous store does not answer ({e}); hangs "
                        "will not be reported with their cause from now on (collectives still time out after timeout_s)"
                    )
                    return

    def _tick(self) -> None:
        if self.store.check(["report"]):
            self._leave()
        asked = int(self.store.add("ask", 0))
        if asked > self.answered:
            self._answer(asked)
        LOG.sweep()
        oldest = LOG.oldest_open()
        if oldest is None or self.reporting or time.monotonic() - oldest.t0 < self.hang_timeout_s:
            return
        self.reporting = True
        if int(self.store.add("reporter", 1)) == 1:
            blocked = LOG.blocked
            self._report(blocked if blocked is not None and not blocked.done else oldest)
        # another rank writes the report; the next tick sees it and leaves

    def _leave(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)

    # ------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        now = time.monotonic()
        open_, recent, seq = LOG.snapshot()
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "open": [e.as_dict(now) for e in sorted(open_, key=lambda e: (e is not LOG.blocked, e.t0))[:8]],
            "recent": [e.as_dict(now) for e in recent],
            "seq": {_group_key(k): v for k, v in seq.items()},
            "stack": _stack_of_main_thread(),
        }

    def _answer(self, n: int) -> None:
        # One key per rank, overwritten: an answer to a later request serves every earlier one too (ranks that fail
        # together each ask at once, and each must get everyone's answer).
        self.store.set(f"state/{self.rank}", json.dumps({**self.state(), "ask": n}))
        self.answered = max(self.answered, n)

    def _collect(self, n: int, wait_s: float) -> dict[int, dict[str, Any]]:
        states: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + wait_s
        while True:
            for r in range(self.world):
                if r in states:
                    continue
                if self.store.check([f"final/{r}"]):
                    states[r] = json.loads(self.store.get(f"final/{r}"))
                elif self.store.check([f"state/{r}"]):
                    st = json.loads(self.store.get(f"state/{r}"))
                    if st["ask"] >= n:
                        states[r] = st
            if len(states) == self.world or time.monotonic() > deadline:
                return states
            time.sleep(0.05)

    def _ask_everyone(self, wait_s: float) -> dict[int, dict[str, Any]]:
        n = int(self.store.add("ask", 1))
        self._answer(n)
        return self._collect(n, wait_s)

    # ------------------------------------------------------------ reports
    def _report(self, oldest: Entry) -> None:
        waited = oldest.as_dict(time.monotonic())
        try:
            states = self._ask_everyone(ANSWER_S)
            text = compose_hang_report(waited, self.rank, states, self.world, self.hang_timeout_s)
        except Exception as e:  # noqa: BLE001 - the job must still end, with what is known
            text = (
                f"phalanx watchdog: rank {self.rank} has waited {waited['age']:.0f} s in "
                f"{describe(waited, self.world)}, called from {waited['site']} "
                f"(the other ranks' states could not be gathered: {e})"
            )
        try:
            self.store.set("report", text)
        finally:
            sys.stderr.write(text + "\n")
            self._leave()

    def explain_failure(self, entry: Entry, error: BaseException) -> str:
        """The message for a collective that raised: which one, from where, and which ranks no longer answer."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        first = re.sub(r"^\[[^\]]*:\d+\]\s*", "", first).split(". This is typically")[
            0
        ]  # gloo's source line and advice
        head = f"{describe(entry.as_dict(time.monotonic()), self.world)} failed on rank {self.rank}: {first}"
        head += f"; called from {format_site(entry.site)}"
        try:
            states = self._ask_everyone(_EXPLAIN_S)
        except Exception as e:  # noqa: BLE001 - the store went with the failing peer
            return f"{head}. The rendezvous store does not answer either ({e}): the process that hosts it has gone."
        lines = [head + "."]
        for r in entry.group if entry.peer is None else (entry.peer,):
            if r == self.rank:
                continue
            st = states.get(r)
            if st is None:
                lines.append(
                    f"  rank {r} did not answer within {_EXPLAIN_S:.0f} s: its process has gone (killed by a "
                    "signal or by the kernel's out-of-memory killer?) or is stuck in native code"
                )
            elif st.get("finished"):
                lines.append(
                    f"  rank {r} has left: {'it failed with an error' if st['failed'] else 'it finished the script'}"
                )
        if len(lines) == 1:
            lines.append("  every rank of the group still answers; the cause is in the error above")
        return "\n".join(lines)

    def precheck(self, entry: Entry, group: Any) -> None:
        """``debug_collectives``: all ranks of the group compare this call's fingerprint before it runs."""
        mirror = self.mirrors.get(entry.group)
        # A group with no gloo mirror exchanges the fingerprint over itself: on NCCL, from the device.
        mine = torch.tensor(entry.fingerprint(), dtype=torch.int64, device="cpu" if mirror else self.device)
        everyone = [torch.empty_like(mine) for _ in entry.group]
        if nccl_rules.enabled():  # not through watched(): this is watched's own check
            nccl_rules.check("all_gather", (everyone, mine), {"group": mirror or group})
        dist.all_gather(everyone, mine, group=mirror or group)
        everyone = [t.cpu() for t in everyone]
        mine = mine.cpu()
        if all(torch.equal(t, mine) for t in everyone):
            return
        key = f"call/{_group_key(entry.group)}/{entry.seq}/"
        self.store.set(key + str(self.rank), json.dumps(entry.as_dict(time.monotonic())))
        lines = [
            f"{ranks_text(entry.group, self.world)} called different collectives at the same point "
            "(debug_collectives stopped them before any bytes were exchanged):"
        ]
        for r, fp in zip(entry.group, everyone):
            try:
                self.store.wait([key + str(r)], datetime.timedelta(seconds=ANSWER_S))
                call = json.loads(self.store.get(key + str(r)))
                lines.append(f"  rank {r}: {describe(call, self.world)}, called from {call['site']}")
            except Exception:  # noqa: BLE001 - a rank that did not say: show its fingerprint
                lines.append(f"  rank {r}: collective #{int(fp[0])} (it did not say which)")
        lines.append(
            "Every rank of a group must issue the same collectives in the same order: look for a branch "
            "that depends on the rank or on the data (an expert unused on one rank, a rank-0-only call)"
        )
        raise CollectiveMismatchError("\n".join(lines))


def compose_hang_report(
    waited: dict[str, Any], me: int, states: dict[int, dict[str, Any]], world: int, hang_timeout_s: float
) -> str:
    """The one message of a hang: who waits where, and for each missing rank where it is instead."""
    group, seq, p2p = waited["group"], waited["seq"], waited["peer"] is not None

    def same(e: dict[str, Any]) -> bool:
        return all(e[k] == waited[k] for k in ("group", "seq", "peer", "op", "numel", "dtype", "label"))

    def waits_in_it(st: dict[str, Any]) -> bool:
        return any(same(e) for e in st.get("open", []))

    waiting = (
        [me] if p2p else [r for r in group if r in states and not states[r].get("finished") and waits_in_it(states[r])]
    )
    if me not in waiting:
        waiting.append(me)
    waiting.sort()
    verb = "has" if len(waiting) == 1 else "have"
    lines = [
        f"phalanx watchdog: {ranks_text(waiting, world)} {verb} waited {waited['age']:.0f} s in "
        f"{describe(waited, world)}, called from {waited['site']}."
    ]
    others = [waited["peer"]] if p2p else [r for r in group if r not in waiting]
    stacks = []
    for r in others:
        st = states.get(r)
        if st is None:
            lines.append(
                f"  rank {r} did not answer within {ANSWER_S:.0f} s: its process has gone (killed by a signal, or "
                "by the kernel's out-of-memory killer?) or its main thread is stuck in native code"
            )
            continue
        last = st["seq"].get(_group_key(group), 0)
        if st.get("finished"):
            if st.get("failed"):
                lines.append(
                    f"  rank {r} has left: it failed with an error (above) after collective #{last} of this group"
                )
            else:
                lines.append(
                    f"  rank {r} has left: it finished the script after collective #{last} of this group, "
                    f"{seq - last} fewer than rank {me} has called: it ran fewer steps or batches (uneven "
                    "data, or a `break`/`continue` that depends on the rank)"
                )
            continue
        same_seq = [e for e in st["recent"] if e["group"] == group and e["seq"] == seq and not p2p]
        if same_seq and not same(same_seq[0]):
            call = same_seq[0]
            line = (
                f"  rank {r} called {describe(call, world)} from {call['site']} at that point instead: the ranks "
                "disagree on the order of collectives (a branch that depends on the rank or on the data?)"
            )
        elif p2p:
            line = f"  rank {r} has not posted the matching {'receive' if waited['op'] == 'send' else 'send'}"
        elif last < seq:
            line = f"  rank {r} has not reached it (its last collective of this group is #{last})"
        else:
            line = f"  rank {r} is past it (collective #{last} of this group)"
        if st["open"] and same_seq and st["open"][0]["seq"] == seq and st["open"][0]["group"] == group:
            line += f"; it waits there since {st['open'][0]['age']:.0f} s"
        elif st["open"]:
            e = st["open"][0]
            line += f"; it waits in {describe(e, world)} since {e['age']:.0f} s, called from {e['site']}"
        else:
            line += f"; it is {_where(st['stack'])}"
        lines.append(line + ".")
        user = [f for f in st["stack"] if not f["library"]] or st["stack"]
        if user:
            stacks.append(f"  rank {r}'s stack (innermost last):")
            stacks += [f"    {f['site']} in {f['func']}" for f in user[-6:]]
    lines += stacks
    lines.append(
        f"The job stops here (hang_timeout_s={hang_timeout_s:g}). If that rank was only slow, raise hang_timeout_s; "
        "0 turns the watchdog off."
    )
    return "\n".join(lines)


_ACTIVE: Watchdog | None = None
_INCARNATION = 0


def _mirrors(topology: Any) -> dict[tuple[int, ...], Any]:
    """gloo groups over the same ranks as each NCCL group, for the fingerprint exchange (every rank creates all)."""
    out: dict[tuple[int, ...], Any] = {tuple(range(topology.world_size)): dist.new_group(backend="gloo")}
    for ranks in getattr(topology, "groups_by_ranks", {}):  # the mesh's axes, in the order they were made
        out[ranks] = dist.new_group(list(ranks), backend="gloo")
    for group in out.values():
        nccl_rules.host_group(group)
    return out


def start_watchdog(
    rank: int, world: int, device_type: str, hang_timeout_s: float | None, debug: bool, topology: Any
) -> Watchdog | None:
    """Start this process's watchdog (once per process group) and switch the collective log on. Collective when
    ``debug`` is set on NCCL (it creates gloo groups)."""
    global _ACTIVE, _INCARNATION
    if world < 2 or not dist.is_initialized():
        return None
    if _ACTIVE is not None and _ACTIVE.world_group is dist.group.WORLD:
        return _ACTIVE
    if _ACTIVE is not None:  # a new process group in this process: the old one's watchdog and log are over
        _ACTIVE._stop.set()
        _ACTIVE = None
        LOG.reset()
    timeout = default_hang_timeout(device_type) if hang_timeout_s is None else hang_timeout_s
    if timeout <= 0 and not debug:
        return None
    try:
        base = dist.distributed_c10d._get_default_store()
    except Exception as e:  # noqa: BLE001 - a process group made without a store (rare): no watchdog
        get_logger().warning(f"the hang watchdog is off: the process group has no rendezvous store to use ({e})")
        return None
    with contextlib.suppress(Exception):  # a connection of its own, where the store can make one
        base = base.clone()  # type: ignore[attr-defined]
    _INCARNATION += 1
    # Under the static rendezvous every node restarts together, and the store outlives an attempt: keep attempts
    # apart. Under the c10d rendezvous (ENV_STORE_PER_ATTEMPT "0") each round has a new store, and the nodes' restart
    # counts may differ.
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if os.environ.get(ENV_STORE_PER_ATTEMPT) != "0" else "-"
    store = dist.PrefixStore(f"phalanx/watchdog/{restart}/{_INCARNATION}/", base)
    mirrors = _mirrors(topology) if debug and dist.get_backend() != "gloo" else {}
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    dog = Watchdog(store, rank, world, timeout, mirrors, device)
    LOG.on = True
    ring_dir = os.environ.get(ENV_RING_DIR)  # set by phalanx launch and phalanx.spawn: they read the ring at the end
    if ring_dir:
        try:
            LOG.open_ring(ring_dir, rank)
        except OSError as e:
            get_logger().warning(
                f"rank {rank} keeps no collective ring file in {ring_dir} ({e}); a crash's report will not name its "
                "last collectives"
            )
    LOG.explain = dog.explain_failure if timeout > 0 else None  # with no thread, nobody would answer
    LOG.precheck = dog.precheck if debug else None
    dog.start()
    _ACTIVE = dog

    atexit.register(lambda: dog.stop(failed=script_failed()))
    return dog
