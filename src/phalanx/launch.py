"""Start training processes: ``phalanx launch`` (a thin layer over torch.distributed.run) and ``spawn``.

    phalanx launch -n 2 train.py --lr 3e-4
    python -m phalanx.launch -n 2 train.py
    phalanx launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -n 8 train.py

``spawn(fn, nprocs=N, args=...)`` runs ``fn`` on N local processes from a notebook or a test, with the
spawn start method and a ``file://`` store (no network), and returns each rank's result.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Sequence

from phalanx.config import ENV_CONFIG_JSON, PhalanxConfig, config_to_env

__all__ = ["launch", "spawn", "SpawnError", "LaunchError", "torchrun_args"]


class LaunchError(RuntimeError):
    """The launch could not start: the message says which input was wrong and how to fix it."""


class SpawnError(RuntimeError):
    """A spawned rank failed; ``rank`` is the first that did."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


# ------------------------------------------------------------------------------------------- launch
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


def _gloo_on_loopback(env: Any) -> None:
    """A one-machine job: gloo's pair sockets listen on loopback too, not on the hostname's address."""
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")


def torchrun_args(cfg: PhalanxConfig, script: str, script_args: Sequence[str], module: bool = False) -> list[str]:
    """The torch.distributed.run argument list for a resolved launch config."""
    lc = cfg.launch
    args = [f"--nproc-per-node={lc.nproc_per_node}", f"--nnodes={lc.nnodes}", f"--max-restarts={lc.max_restarts}"]
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
        raise LaunchError(f"training script {script!r} does not exist (check the path; it is relative to {os.getcwd()})")


def launch(cfg: PhalanxConfig, script: str, script_args: Sequence[str] = (), module: bool = False) -> int:
    """Run ``script`` on ``cfg.launch.nproc_per_node`` processes via torch.distributed.run; returns the exit code."""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    _check_script(script, module)
    lc = cfg.launch
    os.environ[ENV_CONFIG_JSON] = config_to_env(cfg)
    if "OMP_NUM_THREADS" not in os.environ:
        # One process per core share: oversubscribed OpenMP pools slow every rank down.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // lc.nproc_per_node))

    local_only = lc.rdzv_endpoint is None and lc.nnodes == 1 and _is_loopback(lc.master_addr)
    if local_only:
        _gloo_on_loopback(os.environ)
    store = None
    if lc.rdzv_endpoint is None and lc.node_rank == 0:
        sock = _bind(lc.master_addr, lc.master_port)
        lc.master_port = sock.getsockname()[1]
        if local_only:
            # torchrun's own store would listen on every interface. Ours listens on loopback only, and
            # torchrun's static rendezvous (multi_tenant) reuses the server already open on this port.
            store = dist.TCPStore(
                lc.master_addr, lc.master_port, None, True, timeout=datetime.timedelta(seconds=cfg.engine.timeout_s),
                wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.fileno(),
            )
        else:
            sock.close()  # only checked that the port is free; torchrun binds it itself

    run_args = get_args_parser().parse_args(torchrun_args(cfg, script, script_args, module))
    try:
        run(run_args)
    except ChildFailedError as e:
        # The first failure in time is the cause; ranks that torchrun then stopped fail with a signal.
        rank, first = e.get_first_failure()
        own_errors = {r: f for r, f in e.failures.items() if f.exitcode > 0}
        if first.exitcode < 0 and own_errors:  # killed by a signal: torchrun stopping it, not its own error
            rank = min(own_errors, key=lambda r: (own_errors[r].timestamp, r))
            first = own_errors[rank]
        stopped = sorted(r for r in e.failures if r != rank)
        sys.stderr.write(
            f"phalanx launch: rank {rank} failed (exit code {first.exitcode}); its traceback is above. "
            + (f"Stopped the other ranks: {', '.join(map(str, stopped))}.\n" if stopped else "\n")
        )
        return first.exitcode if first.exitcode > 0 else 1
    finally:
        del store
    return 0


# -------------------------------------------------------------------------------------------- spawn
def _spawn_entry(
    fn: Callable[..., Any], rank: int, nprocs: int, init_method: str, args: tuple[Any, ...], threads: int, conn: Connection
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs),
        PHALANX_INIT_METHOD=init_method, OMP_NUM_THREADS=str(threads),
    )
    _gloo_on_loopback(os.environ)
    import torch

    torch.set_num_threads(threads)
    try:
        result = fn(*args)
    except BaseException:
        conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
        conn.close()
        # Leave at once: peers may wait in a collective, and a clean teardown would wait with them.
        os._exit(1)
    from phalanx.runtime import teardown

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
) -> list[Any]:
    """Run ``fn(*args)`` on ranks 0..nprocs-1 and return their results in rank order.

    ``fn`` must be importable by name (defined in a module, not in a notebook cell), because the spawn
    start method starts fresh interpreters. When a rank raises, the others are stopped and
    :class:`SpawnError` names the rank and shows its traceback.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1; got {nprocs}")
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    if getattr(fn, "__module__", None) == "__main__" and not hasattr(module, "__file__") or getattr(fn, "__name__", "") == "<lambda>":
        raise ValueError(
            f"phalanx.spawn needs a function that new processes can import; {fn!r} lives in an interactive "
            "session or is a lambda. Put it in a .py file next to the notebook and import it from there"
        )
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise ValueError(f"phalanx.spawn cannot send {fn!r} to new processes: {e}") from None
    threads = threads_per_proc or max(1, (os.cpu_count() or 1) // nprocs)
    ctx = mp.get_context("spawn")
    tmpdir = tempfile.mkdtemp(prefix="phalanx-spawn-")
    init_method = f"file://{tmpdir}/store"
    procs, readers = [], []
    try:
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_spawn_entry, args=(fn, rank, nprocs, init_method, tuple(args), threads, writer), daemon=False
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


def _collect(procs: list[Any], readers: list[Connection], timeout: float | None) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    open_readers = dict(enumerate(readers))
    while len(results) < len(procs):
        if deadline is not None and time.monotonic() >= deadline:
            running = [r for r in range(len(procs)) if r not in results]
            raise TimeoutError(f"spawned ranks {running} did not finish within {timeout} s")
        wait([*open_readers.values(), *(p.sentinel for p in procs)], timeout=1.0)
        for rank, reader in list(open_readers.items()):
            if not reader.poll():
                continue
            del open_readers[rank]
            try:
                # Our own child's return value over an anonymous pipe we created: no file, no peer, no checkpoint.
                ok, payload = pickle.loads(reader.recv_bytes())
            except EOFError:
                continue  # closed without a word: the exit code below tells what happened
            if not ok:
                raise SpawnError(rank, f"rank {rank} failed:\n{payload}")
            results[rank] = payload
        for rank, p in enumerate(procs):
            # A rank sends its result before it exits, so an exited rank with nothing left to read has failed.
            pending = rank in open_readers and open_readers[rank].poll()
            if rank not in results and p.exitcode is not None and not pending:
                raise SpawnError(rank, f"rank {rank} exited with code {p.exitcode} before returning a result")
    return [results[r] for r in range(len(procs))]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m phalanx.launch ...`` is ``phalanx launch ...``."""
    from phalanx.cli import main as cli_main

    return cli_main(["launch", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
