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
import os
import socket
import sys
from pathlib import Path
from typing import Sequence

from phalanx.config import ENV_CONFIG_JSON, PhalanxConfig, config_to_env
from phalanx.spawn import SpawnError, gloo_on_loopback, spawn  # SpawnError, spawn: their old home, kept for users

__all__ = ["launch", "spawn", "SpawnError", "LaunchError", "torchrun_args"]


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
        gloo_on_loopback(os.environ)
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


if __name__ == "__main__":
    # ``python -m phalanx.launch ...`` is ``phalanx launch ...``. This block runs only when the file is the program,
    # never on import, so the CLI it calls (which imports this module) makes no import cycle.
    from phalanx.cli import main

    sys.exit(main(["launch", *sys.argv[1:]]))
