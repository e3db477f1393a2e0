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
from multiprocessing.connection import Connection, wait
from typing import Any

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


def _spawn_entry(
    fn: Callable[..., Any],
    rank: int,
    nprocs: int,
    init_method: str,
    args: tuple[Any, ...],
    threads: int,
    conn: Connection,
    environ: dict[str, str] | None = None,
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
    gloo_on_loopback(os.environ)
    import torch

    torch.set_num_threads(threads)
    try:
        result = fn(*args)
    except BaseException:
        conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
        conn.close()
        # Leave at once: peers may wait in a collective, and a clean teardown would wait with them.
        os._exit(1)
    from phalanx.runtime.world import teardown

    teardown()
    # Plain pickle copies tensors by value; Connection.send would share them by file descriptor, which
    # dies with this process before the parent reads it.
    conn.send_bytes(pickle.dumps((True, result)))
    conn.close()


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
    procs, readers = [], []
    try:
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_spawn_entry,
                args=(fn, rank, nprocs, init_method, tuple(args), threads, writer, environ),
                daemon=False,
            )
            p.start()
            writer.close()
            procs.append(p)
            readers.append(reader)
        return _collect(procs, readers, timeout)
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


def _collect(procs: list[Any], readers: list[Connection], timeout: float | None, grace_s: float = 3.0) -> list[Any]:
    """Each rank's result, in rank order. When ranks fail, the one named is the cause: a rank that died without a
    word (killed, ``os._exit``, a crash) before one that raised, since its peers then fail in their collectives
    with errors of their own ("Connection reset by peer"). Failures are gathered for ``grace_s`` after the first,
    so that a dead rank's exit is seen even when a peer's error arrives first."""
    results: dict[int, Any] = {}
    raised: dict[int, str] = {}
    died: dict[int, int] = {}
    quiet_since: dict[int, float] = {}  # ranks that exited with code 0 and had nothing to read yet
    deadline = None if timeout is None else time.monotonic() + timeout
    first_failure: float | None = None
    open_readers = dict(enumerate(readers))
    while len(results) + len(raised) + len(died) < len(procs):
        now = time.monotonic()
        if first_failure is not None and now - first_failure >= grace_s:
            break
        if deadline is not None and now >= deadline:
            running = [r for r in range(len(procs)) if r not in results]
            raise TimeoutError(f"spawned ranks {running} did not finish within {timeout} s")
        running_sentinels = [p.sentinel for p in procs if p.exitcode is None]  # an exited one stays ready: leave it out
        wait([*open_readers.values(), *running_sentinels], timeout=0.2 if first_failure or quiet_since else 1.0)
        for rank, reader in list(open_readers.items()):
            if not reader.poll():
                continue
            del open_readers[rank]
            try:
                # Our own child's return value over an anonymous pipe we created: no file, no peer, no checkpoint.
                ok, payload = pickle.loads(reader.recv_bytes())
            except EOFError:
                continue  # closed without a word: the exit code below tells what happened
            if ok:
                results[rank] = payload
            else:
                raised[rank] = payload
        for rank, p in enumerate(procs):
            # A rank sends its result before it exits, so an exited rank with nothing left to read has failed. A
            # clean exit (code 0) with nothing to read yet gets a moment more: its result may still be on the way.
            pending = rank in open_readers and open_readers[rank].poll()
            if rank not in results and rank not in raised and p.exitcode is not None and not pending:
                if p.exitcode == 0 and rank in open_readers and now - quiet_since.setdefault(rank, now) < grace_s:
                    continue
                died[rank] = p.exitcode
        if (raised or died) and first_failure is None:
            first_failure = time.monotonic()
    if died:
        rank = min(died)
        others = sorted(set(died) - {rank}) + sorted(raised)
        also = f" (then ranks {others} failed too)" if others else ""
        raise SpawnError(rank, f"rank {rank} exited with code {died[rank]} before returning a result{also}")
    if raised:
        rank = next(iter(raised))  # the first to report: the others may only echo it
        raise SpawnError(rank, f"rank {rank} failed:\n{raised[rank]}")
    return [results[r] for r in range(len(procs))]
