"""``phalanx.spawn``: run a function on N processes of this machine, from a notebook or a test, and get each rank's
result back.

    results = phalanx.spawn(train, nprocs=2, args=(config,))

The ranks rendezvous through a ``file://`` store (no port is opened) and use gloo on loopback. A rank that raises
ends the others and raises :class:`SpawnError` naming it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from phalanx.runtime.collective_log import ENV_RING_DIR, ring_directory

__all__ = ["spawn", "SpawnError", "gloo_on_loopback"]


class SpawnError(RuntimeError):
    """A spawned rank failed; ``rank`` is the first that did."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


# ------------------------------------------------------------------------------------------- launch
# Variables read once, when a process starts or a library loads (glibc's malloc, the dynamic linker, Python itself,
# OpenMP and MKL): a rank forked from a forkserver has the server's, so a call whose values differ from the server's
# starts fresh interpreters instead. OMP_NUM_THREADS is set for each rank anyway.
_EXEC_TIME_PREFIXES = ("MALLOC_", "GLIBC_", "LD_", "PYTHON", "OMP_", "KMP_", "MKL_", "GOMP_")
_forkserver_environ: dict[str, str] | None = None  # the environment the forkserver started with


def _exec_time(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(_EXEC_TIME_PREFIXES) and k != "OMP_NUM_THREADS"}


def gloo_on_loopback(env: Any) -> None:
    """A one-machine job: gloo's pair sockets listen on loopback too, not on the hostname's address."""
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _put(directory: str, rank: int, kind: str, data: bytes) -> None:
    """A rank's result (``ok``) or traceback (``err``), written whole or not at all (a temporary name, a rename)."""
    path = os.path.join(directory, f"rank-{rank}.{kind}")
    with open(path + ".part", "wb") as f:
        f.write(data)
    os.replace(path + ".part", path)


def _spawn_entry(
    fn: Callable[..., Any],
    rank: int,
    nprocs: int,
    init_method: str,
    args: tuple[Any, ...],
    threads: int,
    results_dir: str,
    environ: dict[str, str] | None = None,
    ring_dir: str | None = None,
) -> None:
    if environ is not None:  # forkserver: the server's environment is as old as the server; take the caller's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nprocs),
        PHALANX_INIT_METHOD=init_method,
        OMP_NUM_THREADS=str(threads),
    )
    if ring_dir is not None:
        os.environ[ENV_RING_DIR] = ring_dir
    gloo_on_loopback(os.environ)
    import torch

    torch.set_num_threads(threads)
    if os.environ.get("PHALANX_NCCL_RULES") == "1":  # before fn makes any tensor: the marks start here
        from phalanx.runtime import nccl_rules

        nccl_rules.enable()
    try:
        result = fn(*args)
    except BaseException:
        _put(results_dir, rank, "err", traceback.format_exc().encode())
        # Leave at once: peers may wait in a collective, and a clean teardown would wait with them.
        os._exit(1)
    from phalanx.runtime.world import teardown

    teardown()
    # A file in the call's private directory, not a pipe: it does not depend on a file descriptor that the
    # function's libraries could close or reuse. Plain pickle copies tensors by value.
    _put(results_dir, rank, "ok", pickle.dumps(result))


def spawn(
    fn: Callable[..., Any],
    nprocs: int = 2,
    args: Sequence[Any] = (),
    threads_per_proc: int | None = None,
    timeout: float | None = None,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(*args)`` on ranks 0..nprocs-1 and return their results in rank order.

    ``fn`` must be importable by name (defined in a module, not in a notebook cell), because the spawn
    start method starts fresh interpreters. When a rank raises, the others are stopped and
    :class:`SpawnError` names the rank and shows its traceback.

    ``start_method`` is ``"spawn"`` (a fresh interpreter per rank, which imports torch again: about 2 s each) or
    ``"forkserver"`` (POSIX only: one server process imports torch and phalanx once, and each rank is forked from
    it, in milliseconds). Either way a rank sees the caller's environment, working directory and ``sys.path`` as
    they are at the call; where the call changed a variable that only takes effect when a process starts
    (``MALLOC_*``, ``GLIBC_TUNABLES``, ``LD_*``, ``PYTHON*``, ``OMP_*``), that call starts fresh interpreters
    instead, so that the setting holds, and says so once. ``"fork"`` is refused: forking a process that has run
    torch copies its thread pools and locks mid-use.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1; got {nprocs}")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(
            f"start_method must be 'spawn' or 'forkserver'; got {start_method!r}. 'fork' copies a process that has "
            "run torch, with its thread pools and locks mid-use; 'forkserver' starts as fast and is safe"
        )
    if start_method not in mp.get_all_start_methods():
        raise ValueError(f"start_method {start_method!r} is not available on {sys.platform}; use 'spawn'")
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    if (
        getattr(fn, "__module__", None) == "__main__"
        and not hasattr(module, "__file__")
        or getattr(fn, "__name__", "") == "<lambda>"
    ):
        raise ValueError(
            f"phalanx.spawn needs a function that new processes can import; {fn!r} lives in an interactive "
            "session or is a lambda. Put it in a .py file next to the notebook and import it from there"
        )
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise ValueError(f"phalanx.spawn cannot send {fn!r} to new processes: {e}") from None
    threads = threads_per_proc or max(1, (os.cpu_count() or 1) // nprocs)
    global _forkserver_environ
    environ = None
    if start_method == "forkserver":
        environ = dict(os.environ)
        if _forkserver_environ is None:
            _forkserver_environ = environ
        else:
            now, then = _exec_time(environ), _exec_time(_forkserver_environ)
            changed = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
            if changed:
                from phalanx.logging import warn_once

                warn_once(
                    f"phalanx.spawn: {', '.join(changed)} changed since the forkserver started, and a forked rank "
                    "would keep the old value, so these ranks start as fresh interpreters (start_method='spawn')"
                )
                start_method, environ = "spawn", None
    ctx: Any = mp.get_context(start_method)  # SpawnContext or ForkServerContext
    if start_method == "forkserver":
        # Takes effect when the server starts, the first time. torch imports torch._dynamo at a process's first
        # optimizer.step() (its step is wrapped to stay out of compilation), which costs each fresh rank about
        # 1.5 s; imported once in the server, the forked ranks have it. The import starts no thread.
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "phalanx"])
    tmpdir = tempfile.mkdtemp(prefix="phalanx-spawn-")
    init_method = f"file://{tmpdir}/store"
    results_dir = os.path.join(tmpdir, "results")
    os.mkdir(results_dir)
    ring_dir = ring_directory()  # each rank's last collectives, for the error when one fails
    procs = []
    try:
        for rank in range(nprocs):
            p = ctx.Process(
                target=_spawn_entry,
                args=(fn, rank, nprocs, init_method, tuple(args), threads, results_dir, environ, ring_dir),
                daemon=False,
            )
            p.start()
            procs.append(p)
        try:
            return _collect(procs, results_dir, timeout)
        except SpawnError as e:
            report = _ring_report(ring_dir, nprocs, e.rank)
            if report is None:
                raise
            raise SpawnError(e.rank, f"{e}\n{report}") from None
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmpdir, ignore_errors=True)
        shutil.rmtree(ring_dir, ignore_errors=True)


def _ring_report(ring_dir: str, nprocs: int, failed: int) -> str | None:
    """The ranks' last collectives when the failed rank ended in one (it died there, or the collective raised) or the
    ranks disagree (as ``phalanx launch``'s ``collective_report``)."""
    from phalanx.runtime.collective_log import DONE, disagreement, read_rings, ring_report

    rings = read_rings(ring_dir)
    last = rings[failed]["records"][-1:] if failed in rings else []
    in_collective = bool(last) and last[0]["state"] != DONE
    return (
        ring_report(rings, nprocs, who="phalanx.spawn")
        if in_collective or (rings and disagreement(rings, nprocs))
        else None
    )


def _collect(procs: list[Any], results_dir: str, timeout: float | None, grace_s: float = 3.0) -> list[Any]:
    """Each rank's result, in rank order, read from its file once it has exited. When ranks fail, the one named is
    the cause: a rank that died without a word (killed, ``os._exit``, a crash) before one that raised, since its peers
    then fail in their collectives with errors of their own ("Connection reset by peer"). Failures are gathered for
    ``grace_s`` after the first, so that a dead rank's exit is seen even when a peer's error arrives first."""
    results: dict[int, Any] = {}
    raised: dict[int, tuple[int, str]] = {}  # rank -> (when its error was written, the traceback)
    died: dict[int, int] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    first_failure: float | None = None
    while len(results) + len(raised) + len(died) < len(procs):
        now = time.monotonic()
        if first_failure is not None and now - first_failure >= grace_s:
            break
        if deadline is not None and now >= deadline:
            running = [r for r in range(len(procs)) if r not in results]
            raise TimeoutError(f"spawned ranks {running} did not finish within {timeout} s")
        wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.2 if first_failure else 1.0)
        for rank, p in enumerate(procs):
            if rank in results or rank in raised or rank in died or p.exitcode is None:
                continue
            path = os.path.join(results_dir, f"rank-{rank}")
            if p.exitcode == 0 and os.path.exists(path + ".ok"):
                # Our own child's return value, in the private directory this call made: no peer wrote it.
                with open(path + ".ok", "rb") as f:
                    results[rank] = pickle.loads(f.read())
            elif os.path.exists(path + ".err"):
                with open(path + ".err", "rb") as f:
                    raised[rank] = (os.fstat(f.fileno()).st_mtime_ns, f.read().decode(errors="replace"))
            else:  # a rank writes its result or its error before it exits: with neither, it died
                died[rank] = p.exitcode
        if (raised or died) and first_failure is None:
            first_failure = time.monotonic()
    if died:
        rank = min(died)
        others = sorted(set(died) - {rank}) + sorted(raised)
        also = f" (then ranks {others} failed too)" if others else ""
        raise SpawnError(rank, f"rank {rank} exited with code {died[rank]} before returning a result{also}")
    if raised:
        rank = min(raised, key=lambda r: raised[r][0])  # the first to fail: the others may only echo it
        raise SpawnError(rank, f"rank {rank} failed:\n{raised[rank][1]}")
    return [results[r] for r in range(len(procs))]
