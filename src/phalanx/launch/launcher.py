"""Start training processes: ``phalanx launch`` (a thin layer over torch.distributed.run) and ``spawn``.

    phalanx launch -n 2 train.py --lr 3e-4
    python -m phalanx.launch -n 2 train.py
    phalanx launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -n 8 train.py
    phalanx launch --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port 29500 -n 2 train.py   # both nodes
                                                                   # on this machine: a rehearsal of a multi-node job
    phalanx launch --nnodes 1:2 --rdzv-endpoint 10.0.0.1:29500 --max-restarts 3 --resume-from ckpt -n 8 train.py
                        # elastic: on each machine; a lost machine costs a restart, and the rest go on from ckpt

Ctrl-C (SIGINT) or SIGTERM stops every rank of this node and ends with one line, exit code 130 or 143.

``spawn(fn, nprocs=N, args=...)`` runs ``fn`` on N local processes from a notebook or a test, with the
spawn start method and a ``file://`` store (no network), and returns each rank's result.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import errno
import ipaddress
import logging
import os
import shutil
import signal
import socket
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from phalanx.checkpoint.resume import ENV_LAUNCH_ID, restart_summary
from phalanx.config.settings import ENV_CONFIG_JSON, LaunchConfig, PhalanxConfig, config_to_env
from phalanx.launch.spawn import SpawnError, gloo_on_loopback, spawn
from phalanx.runtime.collective_log import (
    DONE,
    ENV_RING_DIR,
    disagreement,
    read_rings,
    ring_directory,
    ring_report,
)
from phalanx.runtime.world import ENV_STORE_PER_ATTEMPT

__all__ = ["launch", "spawn", "SpawnError", "LaunchError", "StragglerWatch", "collective_report", "torchrun_args"]


class LaunchError(RuntimeError):
    """The launch could not start: the message says which input was wrong and how to fix it."""


def _is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _bind(addr: str, port: int) -> socket.socket:
    """Bind a listening socket, turning a busy port into an error that says what to do."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if os.name == "posix" and port != 0:
        # A fixed --master-port that the last run left in TIME_WAIT (run again at once) is free; a listener still
        # holds it against this. Port 0 goes without, so that the system never hands out a port someone else binds.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr if addr != "localhost" else "127.0.0.1", port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise LaunchError(
                f"master port {port} on {addr} is busy (another process listens there); pass another "
                "--master-port, or leave it out on a single node to get a free one"
            ) from None
        raise LaunchError(f"cannot listen on {addr}:{port} for the rendezvous: {e}") from None
    return sock


def torchrun_args(cfg: PhalanxConfig, script: str, script_args: Sequence[str], module: bool = False) -> list[str]:
    """The torch.distributed.run argument list for a resolved launch config."""
    lc = cfg.launch
    nnodes = f"{lc.min_nodes}:{lc.nnodes}" if lc.min_nodes is not None else str(lc.nnodes)
    args = [f"--nproc-per-node={lc.nproc_per_node}", f"--nnodes={nnodes}", f"--max-restarts={lc.max_restarts}"]
    if lc.rdzv_endpoint is not None:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={lc.rdzv_endpoint}"]
    else:
        args += [f"--node-rank={lc.node_rank}", f"--master-addr={lc.master_addr}", f"--master-port={lc.master_port}"]
    if module:
        args.append("--module")
    return args + [script, *script_args]


def _check_script(script: str, module: bool) -> None:
    if module:
        import importlib.util

        if importlib.util.find_spec(script.split(":")[0]) is None:
            raise LaunchError(f"module {script!r} cannot be found (check the name, or that its package is installed)")
        return
    if not Path(script).is_file():
        raise LaunchError(
            f"training script {script!r} does not exist (check the path; it is relative to {os.getcwd()})"
        )


def mesh_text(cfg: PhalanxConfig) -> str:
    """The device mesh ``cfg`` asks for on the launcher's ranks and each rank's coordinates (the first 16 ranks on
    a larger mesh). Raises ``ConfigError`` naming every degree when they do not fit."""
    from phalanx.config.mesh import Mesh

    return Mesh.of(cfg.engine, cfg.launch.nproc_per_node * cfg.launch.nnodes, cfg.origins).describe_ranks()


def launch(cfg: PhalanxConfig, script: str, script_args: Sequence[str] = (), module: bool = False) -> int:
    """Run ``script`` on ``cfg.launch.nproc_per_node`` processes via torch.distributed.run; returns the exit code."""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    _check_script(script, module)
    lc = cfg.launch
    from phalanx.config.mesh import Mesh

    mesh = Mesh.of(cfg.engine, lc.nproc_per_node * lc.nnodes, cfg.origins)  # checks it before any process starts
    if sum(s > 1 for s in mesh.sizes) > 1:  # a mesh of more than one axis: say where each rank sits
        sys.stderr.write(f"phalanx: {mesh.describe_ranks()}\n")
    os.environ[ENV_CONFIG_JSON] = config_to_env(cfg)
    # On loopback every node runs on this machine: the store and gloo listen on loopback only.
    on_loopback = lc.rdzv_endpoint is None and _is_loopback(lc.master_addr)
    endpoint_on_loopback = lc.rdzv_endpoint is not None and _is_loopback(lc.rdzv_endpoint.rpartition(":")[0] or "?")
    if "OMP_NUM_THREADS" not in os.environ:
        # One process per core share: oversubscribed OpenMP pools slow every rank down.
        here = lc.nproc_per_node * (lc.nnodes if on_loopback else 1)
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // here))
    if on_loopback or endpoint_on_loopback:
        gloo_on_loopback(os.environ)
        if lc.nnodes > 1:
            what = f"rdzv_endpoint {lc.rdzv_endpoint}" if endpoint_on_loopback else f"master_addr {lc.master_addr}"
            sys.stderr.write(
                f"phalanx launch: {what} is loopback, so all {lc.nnodes} nodes must run on this machine (a rehearsal "
                "of a multi-node job); give a network address to span machines\n"
            )
    store = None
    if lc.rdzv_endpoint is None and lc.node_rank == 0:
        sock = _bind(lc.master_addr, lc.master_port)
        lc.master_port = sock.getsockname()[1]
        if on_loopback:
            # torchrun's own store would listen on every interface. Ours listens on loopback only, and
            # torchrun's static rendezvous (multi_tenant) reuses the server already open on this port.
            store = dist.TCPStore(
                lc.master_addr,
                lc.master_port,
                None,
                True,
                timeout=datetime.timedelta(seconds=cfg.engine.timeout_s),
                wait_for_workers=False,
                multi_tenant=True,
                master_listen_fd=sock.fileno(),
            )
        else:
            sock.close()  # only checked that the port is free; torchrun binds it itself

    # torchrun handles SIGQUIT only: SIGINT, SIGTERM and SIGHUP are _Stopper's.
    run_args = get_args_parser().parse_args(
        ["--signals-to-handle=SIGQUIT", *torchrun_args(cfg, script, script_args, module)]
    )
    stopper = _Stopper(lc)
    os.environ[ENV_LAUNCH_ID] = uuid.uuid4().hex  # which lines of resume_from's record are this run's
    os.environ[ENV_STORE_PER_ATTEMPT] = "1" if lc.rdzv_endpoint is None else "0"
    ring_dir = os.environ[ENV_RING_DIR] = ring_directory()  # each rank's last collectives, read here
    watch = StragglerWatch(ring_dir, lc.nproc_per_node * lc.nnodes)
    watch.start()
    try:
        with stopper:
            if lc.rdzv_endpoint is None and lc.node_rank > 0:
                _wait_for_node_0(lc, cfg.engine.timeout_s)
            run(run_args)
    except SignalException as e:
        sig = stopper.signal or signal.Signals(e.sigval)  # e.sigval: a signal torchrun handled itself
        sys.stderr.write(stopper.line(sig) + "\n")
        return 128 + sig.value
    except ChildFailedError as e:
        report = collective_report(read_rings(ring_dir), e.failures, lc.nproc_per_node * lc.nnodes)
        if report:
            sys.stderr.write(report + "\n")
        sys.stderr.write(failure_summary(e.failures) + "\n")
        first = _cause(e.failures)[1]
        return first.exitcode if first.exitcode > 0 else 1
    finally:
        summary = watch.stop()
        if summary:
            sys.stderr.write(summary + "\n")
        shutil.rmtree(ring_dir, ignore_errors=True)
        os.environ.pop(ENV_RING_DIR, None)
        del store
        if cfg.engine.resume_from is not None:
            summary = restart_summary(cfg.engine.resume_from, os.environ[ENV_LAUNCH_ID], lc.max_restarts)
            if summary:
                sys.stderr.write(summary + "\n")
    return 0


# torchrun stops the ranks that are still running with SIGTERM (SIGKILL after its grace period); any other signal
# came from elsewhere: the kernel's out-of-memory killer, a `kill -9`, a crash in native code (SIGSEGV, SIGABRT).
_STOPPING_SIGNALS = (-signal.SIGTERM.value, -signal.SIGINT.value, -signal.SIGHUP.value)


def _cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank whose failure caused the others. In order: a rank killed by a signal that torchrun does not send (its
    peers then fail in their collectives, with errors of their own); the watchdog's report; the first error in time."""
    from phalanx.runtime.watchdog import HANG_EXIT_CODE

    def first_of(ranks: list[int]) -> int:
        return min(ranks, key=lambda r: (failures[r].timestamp, r))

    hung = [r for r, f in failures.items() if f.exitcode == HANG_EXIT_CODE]
    own = [r for r, f in failures.items() if f.exitcode > 0]
    first_own = min((failures[r].timestamp for r in own), default=None)
    # A signal after a rank's own error is more likely its consequence (NCCL's watchdog aborting, a late SIGKILL).
    killed = [
        r
        for r, f in failures.items()
        if f.exitcode < 0 and f.exitcode not in _STOPPING_SIGNALS and (first_own is None or f.timestamp <= first_own)
    ]
    for ranks in (killed, hung, own, list(failures)):
        if ranks:
            return first_of(ranks), failures[first_of(ranks)]
    raise AssertionError("a ChildFailedError holds at least one failure")


def failure_summary(failures: dict[int, Any]) -> str:
    """One line for the launcher's end: which rank failed and how, and which ranks were stopped after it."""
    from phalanx.runtime.watchdog import HANG_EXIT_CODE

    rank, first = _cause(failures)
    others = sorted(r for r in failures if r != rank)
    stopped = f" Stopped the other ranks: {', '.join(map(str, others))}." if others else ""
    if first.exitcode < 0:
        sig = (
            signal.Signals(-first.exitcode).name
            if -first.exitcode in signal.Signals._value2member_map_
            else first.exitcode
        )
        why = (
            "the kernel's out-of-memory killer (see `dmesg`) or a `kill -9`"
            if first.exitcode == -signal.SIGKILL.value
            else "a crash in native code"
            if first.exitcode in (-signal.SIGSEGV.value, -signal.SIGABRT.value, -signal.SIGBUS.value)
            else "a signal from outside phalanx"
        )
        after = (
            " The other ranks' errors above followed from it." if any(f.exitcode > 0 for f in failures.values()) else ""
        )
        return f"phalanx launch: rank {rank} (pid {first.pid}) was killed by {sig}: {why}.{after}{stopped}"
    if first.exitcode == HANG_EXIT_CODE:
        return f"phalanx launch: the hang watchdog stopped the job; its report is above.{stopped}"
    return f"phalanx launch: rank {rank} failed (exit code {first.exitcode}); its traceback is above.{stopped}"


def collective_report(rings: dict[int, dict[str, Any]], failures: dict[int, Any], world: int) -> str | None:
    """Each rank's last collectives, read from its ring after the job failed, when they help: when the rank that
    caused the failure was killed by a signal (a crash in native code, as gloo's abort on a mismatched collective),
    when its last collective failed or was still open, or when the ranks disagree. Not after the hang watchdog's
    report (it has said all this), unless the ranks disagree."""
    from phalanx.runtime.watchdog import HANG_EXIT_CODE

    if not rings:
        return None
    rank, first = _cause(failures)
    disagree = disagreement(rings, world) is not None
    killed = first.exitcode < 0 and first.exitcode not in _STOPPING_SIGNALS
    last = rings[rank]["records"][-1:] if rank in rings else []
    in_collective = bool(last) and last[0]["state"] != DONE
    if first.exitcode == HANG_EXIT_CODE and not disagree:
        return None
    return ring_report(rings, world) if disagree or killed or in_collective else None


class StragglerWatch:
    """Names a rank of this machine that keeps the others waiting, while the job runs, from the ranks' ring files.

    Each rank's ring holds, for each collective, when it was called (``time.monotonic()``: one clock for every process
    of a machine, so no clock offsets between the ranks compared) and in which optimizer step. For each collective of
    a rank's largest group that every rank of this machine in that group has called, a rank's arrival is how long
    after the first of them it came, and its arrival in a step the latest of its collectives there. Its lag in a step
    is how much later than the median of the other ranks it arrived. A rank is late in a step when its lag is the
    largest and above ``LATE_SHARE`` of the step's time; it is named once it was late in ``LATE_IN`` of the last
    ``OF_LAST`` steps, and named again only after it stopped being late (at most ``CLEARED_AT`` of the last
    ``OF_LAST``) and came back, or when another rank takes its place.

    Why these numbers: a rank late by 5% of every step costs the whole job 5% (every rank waits for it): on 1000
    devices, the work of 50. Measured against the others' median, not the first to come, the ordinary spread of
    arrivals (the OS scheduler, a data loader's jitter) cancels, and a 5% lag stands out of it even on a loaded
    machine (``tests/test_stragglers.py``: four ranks on two busy cores). Six of ten steps names a rank that is slow by
    habit, and not one that paused once (a checkpoint write, an evaluation, Python's garbage collector), within ten
    steps of it becoming slow. The first ``WARMUP_STEPS`` steps are left out (allocations, compilation). Nothing runs
    on the ranks for this but two writes to their own memory per collective and one per step: no collective, no store
    round trip, no system call.

    Across machines each launcher compares its own machine's ranks: the other ranks of a straggler's machine wait for
    it too, so it is named there; a machine whose ranks are all slow together is not (their lateness shows only as
    the other machines' wait).
    """

    POLL_S = 0.1
    LATE_SHARE = 0.05
    LATE_IN, OF_LAST, CLEARED_AT = 6, 10, 2
    WARMUP_STEPS = 2

    def __init__(self, ring_dir: str, world: int) -> None:
        self.ring_dir, self.world = ring_dir, world
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        """A fresh start: the job's first attempt, or a restart (a ring with a new pid)."""
        self.after: dict[int, int] = {}  # rank -> the last record read
        self.pids: dict[int, int] = {}
        self.hosts: dict[int, str] = {}
        self.members: dict[Any, set[int]] = {}  # group key -> this machine's ranks that called in it
        self.largest: dict[int, Any] = {}  # rank -> its largest group's key
        self.pending: dict[tuple[Any, int], dict[int, tuple[float, int]]] = {}  # (group, seq) -> rank -> (t0, step)
        self.lag: dict[int, dict[int, float]] = {}  # rank -> step -> its largest lag in that step
        self.begins: dict[int, dict[int, float]] = {}  # rank -> step -> its first call's time in that step
        self.step_of: dict[int, int] = {}  # rank -> the step of its newest record
        self.decided = self.WARMUP_STEPS - 1  # steps up to this one are counted
        self.history: collections.deque[int | None] = collections.deque(maxlen=self.OF_LAST)
        self.named: int | None = None
        self.totals: dict[int, list[float]] = {}  # rank -> [steps, summed step time, summed lag, late steps]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="phalanx-straggler-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.POLL_S):
            try:
                self.poll(announce=True)
            except Exception as e:  # noqa: BLE001 - a diagnostic must never end the launcher
                sys.stderr.write(f"phalanx launch: the straggler watch stopped ({type(e).__name__}: {e})\n")
                return

    def stop(self) -> str | None:
        """Stop watching, read what the ranks wrote last, and return the per-rank summary (None: nothing to sum)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self.poll(announce=False)
        return self.summary()

    def poll(self, announce: bool) -> None:
        with self._lock:
            for rank, ring in read_rings(self.ring_dir).items():
                self._read(rank, ring)
            self._match()
            self._decide(announce)

    def _read(self, rank: int, ring: dict[str, Any]) -> None:
        if self.pids.get(rank, ring["pid"]) != ring["pid"] or ring["count"] < self.after.get(rank, 0):
            self._reset()  # a restart, or a new process group: the ranks start over
        self.pids[rank], self.hosts[rank] = ring["pid"], ring["host"]
        after = self.after.get(rank, 0)
        for r in ring["records"]:
            if r["n"] <= after:
                continue
            self.step_of[rank] = r["step"]
            if r["peer"] is not None or r["seq"] <= 0:
                continue
            key = r["group_key"]
            self.members.setdefault(key, set()).add(rank)
            if rank not in self.largest or key[1] > self.largest[rank][1]:
                self.largest[rank] = key
            self.pending.setdefault((key, r["seq"]), {})[rank] = (r["t0"], r["step"])
        if ring["records"]:
            self.after[rank] = ring["records"][-1]["n"]

    def _match(self) -> None:
        for (key, seq), calls in list(self.pending.items()):
            members = self.members[key]
            if len(members) < 2 or any(self.largest.get(r) != key for r in members):
                if len(self.pending) > 100_000:
                    del self.pending[(key, seq)]
                continue
            if len(calls) < len(members):
                continue
            del self.pending[(key, seq)]
            first = min(t0 for t0, _ in calls.values())
            for rank, (t0, step) in calls.items():
                lags = self.lag.setdefault(rank, {})
                lags[step] = max(lags.get(step, 0.0), t0 - first)
                starts = self.begins.setdefault(rank, {})
                starts[step] = min(starts.get(step, t0), t0)

    def _decide(self, announce: bool) -> None:
        ranks = [r for r in self.lag if r in self.step_of]
        if len(ranks) < 2:
            return
        done = min(self.step_of[r] for r in ranks) - 1  # every rank is past it, and has begun the one after
        for step in range(self.decided + 1, done + 1):
            arrivals = {r: self.lag[r][step] for r in ranks if step in self.lag[r]}
            times = [
                self.begins[r][step + 1] - self.begins[r][step]
                for r in arrivals
                if step + 1 in self.begins.get(r, {}) and step in self.begins[r]
            ]
            if len(arrivals) < 2 or not times:
                continue
            step_s = statistics.median(times)
            # Against the median of the others, not the first to come: the ordinary spread of arrivals cancels.
            lags = {
                r: max(0.0, t - statistics.median([v for j, v in arrivals.items() if j != r]))
                for r, t in arrivals.items()
            }
            slowest = max(lags, key=lambda r: lags[r])
            late = slowest if lags[slowest] > self.LATE_SHARE * step_s else None
            self.history.append(late)
            for r, lag in lags.items():
                t = self.totals.setdefault(r, [0, 0.0, 0.0, 0])
                t[0] += 1
                t[1] += step_s
                t[2] += lag
                t[3] += r == late
            self._name(step, step_s, lags, announce)
        self.decided = max(self.decided, done)
        for table in (self.lag, self.begins):  # keep a few steps back: the step after is read for the step time
            for per_step in table.values():
                for old in [s for s in per_step if s < self.decided - 2]:
                    del per_step[old]

    def _name(self, step: int, step_s: float, lags: dict[int, float], announce: bool) -> None:
        counts = collections.Counter(r for r in self.history if r is not None)
        top, times = counts.most_common(1)[0] if counts else (None, 0)
        if times >= self.LATE_IN and top != self.named:
            self.named = top
            if announce and top is not None:
                recent = [lags[top]] if top in lags else []
                lag_ms = (recent[0] if recent else 0.0) * 1e3
                sys.stderr.write(
                    f"phalanx launch: rank {top} (host {self.hosts.get(top, '?')}, pid {self.pids.get(top, '?')}) "
                    f"is a straggler: it reached the collectives last, {lag_ms:.1f} ms ({lag_ms / (step_s * 1e3):.0%} "
                    f"of a {step_s * 1e3:.1f} ms step) after the other ranks, in {times} of the last {self.OF_LAST} "
                    f"steps (at step {step}); every other rank waits for it. Look at its data loading, its share "
                    "of the machine (other processes, CPU affinity), its device's clocks and temperature\n"
                )
        elif self.named is not None and counts.get(self.named, 0) <= self.CLEARED_AT:
            if announce:
                sys.stderr.write(
                    f"phalanx launch: rank {self.named} is no longer late (at step {step}: late in "
                    f"{counts.get(self.named, 0)} of the last {self.OF_LAST} steps)\n"
                )
            self.named = None

    def summary(self) -> str | None:
        """One line per rank: its mean step time, mean lag, and in how many steps it was the late one (None: fewer
        than ``OF_LAST`` steps were compared, or fewer than two ranks)."""
        if len(self.totals) < 2 or max(t[0] for t in self.totals.values()) < self.OF_LAST:
            return None  # too short a run to say anything
        steps = max(int(t[0]) for t in self.totals.values())
        lines = [
            f"phalanx launch: per-rank summary over {steps} steps (this machine's ranks; lag: how much later than the "
            "other ranks' median it reached each step's collectives):",
            "  rank  host              step ms   lag ms   lag/step  late steps",
        ]
        shown = sorted(self.totals, key=lambda r: (-self.totals[r][3], r))[:16]
        for r in sorted(shown):
            n, step_sum, lag_sum, late = self.totals[r]
            step_ms, lag_ms = step_sum / n * 1e3, lag_sum / n * 1e3
            lines.append(
                f"  {r:<5} {self.hosts.get(r, '?')[:16]:<16} {step_ms:8.1f} {lag_ms:8.2f} {lag_ms / step_ms:9.1%} "
                f"{int(late):11d}"
            )
        if len(self.totals) > len(shown):
            lines.append(f"  ({len(self.totals) - len(shown)} more ranks, none late more often)")
        return "\n".join(lines)


def _wait_for_node_0(lc: LaunchConfig, timeout_s: float) -> None:
    """Wait, in Python (where Ctrl-C works), until node 0's rendezvous store answers; torchrun's client would wait
    inside C++ for 15 minutes, deaf to Ctrl-C."""
    start = time.monotonic()
    said = False
    while True:
        try:
            with socket.create_connection((lc.master_addr, lc.master_port), timeout=2):
                return
        except OSError:
            pass
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise LaunchError(
                f"node 0's rendezvous at {lc.master_addr}:{lc.master_port} did not answer within {timeout_s:.0f} s "
                "(start node 0 with --node-rank 0 and the same --master-addr and --master-port, or check that this "
                "machine can reach that address)"
            )
        if waited > 5 and not said:
            sys.stderr.write(
                f"phalanx launch: node {lc.node_rank} waits for node 0 at {lc.master_addr}:{lc.master_port} (start "
                "it with --node-rank 0 and the same --master-addr and --master-port)\n"
            )
            said = True
        time.sleep(0.5)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TORCH_HANDLES = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # torchrun sets it from --signals-to-handle; put back after
_HANDLER_GRACE_S = 3.0


def _children() -> list[int] | None:
    """This process's children (the ranks torchrun started), or None where the system does not say (not Linux)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    pids: list[int] = []
    for task in tasks:
        with contextlib.suppress(OSError):
            pids += map(int, Path(f"/proc/self/task/{task}/children").read_text().split())
    return pids


def _end(pids: list[int], timeout_s: float = 30.0) -> None:
    """SIGTERM to each rank's process group (torchrun starts each in a session of its own), SIGKILL after timeout_s."""

    def send(pid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pid, sig)
        except OSError:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)

    for pid in pids:
        send(pid, signal.SIGTERM)
    pending, deadline = set(pids), time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    pending.discard(pid)
            except ChildProcessError:
                pending.discard(pid)
        time.sleep(0.1)
    for pid in pending:
        send(pid, signal.SIGKILL)


class _Stopper:
    """SIGINT (Ctrl-C), SIGTERM and SIGHUP stop this node's ranks quietly, with one line (see :meth:`line`).

    torchrun's own handler passes the signal on to the ranks (a SIGINT makes each print a KeyboardInterrupt
    traceback), logs two lines per rank, and leaves a traceback of its own. Ours asks torchrun's agent to end the
    ranks with SIGTERM, which Python does not turn into an exception, with the agent's logs silenced.

    Python runs a handler only between bytecodes, and the agent can wait inside C++ for many minutes (node 0's
    rendezvous waits for the other nodes). A watchdog thread hears each signal through ``signal.set_wakeup_fd``; when
    the handler has not run within a few seconds, it ends this node's ranks itself and exits.
    """

    def __init__(self, lc: LaunchConfig) -> None:
        self.lc = lc
        self.signal: signal.Signals | None = None
        self.had_ranks = True
        self._lock = threading.Lock()
        self._closed = False
        self._silenced: dict[str, int] = {}
        self._previous: dict[int, Any] = {}

    def line(self, sig: signal.Signals) -> str:
        how = "Ctrl-C" if sig == signal.SIGINT else sig.name
        if not self.had_ranks:
            return f"phalanx launch: interrupted ({how}) before any rank of this node started"
        if self.lc.rdzv_endpoint is not None:
            return f"phalanx launch: interrupted ({how}); stopped this node's {self.lc.nproc_per_node} ranks"
        first = self.lc.node_rank * self.lc.nproc_per_node
        ranks = ", ".join(map(str, range(first, first + self.lc.nproc_per_node)))
        return f"phalanx launch: interrupted ({how}); stopped ranks {ranks}"

    def _claim(self, signum: int) -> bool:
        """The first signal is acted on once, by the handler or by the watchdog; later ones are ignored."""
        with self._lock:
            if self.signal is not None:
                return False
            self.signal = signal.Signals(signum)
            children = _children()
            self.had_ranks = children is None or bool(children)
            return True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if not self._claim(signum):
            return  # already stopping: the agent kills ranks that outlive its timeout
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("torch.distributed.elastic"):
                self._silenced[name] = logging.getLogger(name).level
                logging.getLogger(name).setLevel(logging.ERROR)
        raise SignalException(f"phalanx launch got {signal.Signals(signum).name}", sigval=signal.SIGTERM)

    def _watch(self, fd: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as wakeups:
            while data := wakeups.read(64):
                ours = [s for s in data if s in {int(x) for x in _STOP_SIGNALS}]
                deadline = time.monotonic() + _HANDLER_GRACE_S
                while ours and self.signal is None and not self._closed and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not ours or self._closed or _children() is None or not self._claim(ours[0]):
                    continue
                # The main thread is inside C++ and cannot run the handler: end what exists, and leave.
                assert self.signal is not None
                _end(_children() or [])
                shutil.rmtree(os.environ.get(ENV_RING_DIR) or "/nonexistent", ignore_errors=True)
                sys.stdout.flush()
                sys.stderr.write(self.line(self.signal) + "\n")
                sys.stderr.flush()
                os._exit(128 + self.signal.value)

    def __enter__(self) -> _Stopper:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only: torchrun's handling stays
        self._torch_handles = os.environ.get(_TORCH_HANDLES)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in _STOP_SIGNALS}
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="phalanx-stopper", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._previous:
            return
        self._closed = True
        signal.set_wakeup_fd(self._previous_wakeup)
        os.close(self._write_fd)  # the watchdog reads the end of the pipe and returns
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._torch_handles is None:
            os.environ.pop(_TORCH_HANDLES, None)
        else:
            os.environ[_TORCH_HANDLES] = self._torch_handles
        for name, level in self._silenced.items():
            logging.getLogger(name).setLevel(level)
