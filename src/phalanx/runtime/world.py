"""Process-group start-up from the environment, and a clean teardown at exit.

The world comes from whichever launcher started us:
- ``phalanx launch`` / torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``;
- ``phalanx.spawn``: the same, plus ``PHALANX_INIT_METHOD`` (a ``file://`` store, no network);
- SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, the first host of ``SLURM_STEP_NODELIST``;
- Open MPI (``mpirun``): ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
- a plain ``python train.py``: world size 1, no process group.
"""

from __future__ import annotations

import atexit
import datetime
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.logging import get_logger

__all__ = [
    "WorldInfo",
    "detect_world",
    "init_distributed",
    "pick_device",
    "teardown",
    "seed_everything",
    "script_failed",
]


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str
    """Which launcher set the world: ``torchrun``, ``spawn``, ``slurm``, ``mpi`` or ``single``."""
    init_method: str | None
    """The c10d init method, or None for a single process without a process group."""


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key} must be an integer; got {env[key]!r}") from None


def first_slurm_host(nodelist: str) -> str:
    """``node[03-05,7],gpu1`` -> ``node03``: the first host of a SLURM node list."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, bracket = m.group(1), m.group(3)
    if bracket is None:
        return prefix
    first = bracket.split(",")[0].split("-")[0]
    return prefix + first


def detect_world(env: Mapping[str, str] | None = None) -> WorldInfo:
    env = os.environ if env is None else env
    if dist.is_initialized():
        # The script started its own process group (e.g. mp.spawn + init_process_group): it is the world.
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        return WorldInfo(rank, world, local_rank, world, "existing", "existing")
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        if "PHALANX_INIT_METHOD" in env:
            return WorldInfo(rank, world, local_rank, local_world, "spawn", env["PHALANX_INIT_METHOD"])
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise ValueError(
                f"RANK={rank} and WORLD_SIZE={world} are set but MASTER_ADDR/MASTER_PORT are not "
                "(start the script with `phalanx launch` or torchrun, which set all four)"
            )
        return WorldInfo(rank, world, local_rank, local_world, "torchrun", "env://")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        local_world = _int(env, "SLURM_NTASKS_PER_NODE") if env.get("SLURM_NTASKS_PER_NODE", "").isdigit() else world
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        addr = env.get("MASTER_ADDR") or (first_slurm_host(nodelist) if nodelist else "127.0.0.1")
        # A port derived from the job id keeps two jobs on one node apart without coordination.
        port = env.get("MASTER_PORT") or str(15000 + int(env.get("SLURM_JOB_ID", "0")) % 10000)
        return WorldInfo(rank, world, local_rank, local_world, "slurm", f"tcp://{addr}:{port}")
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else world
        if local_world != world and "MASTER_ADDR" not in env:
            raise ValueError(
                f"mpirun spans several nodes (world size {world}, {local_world} per node) but MASTER_ADDR is not "
                "set (export MASTER_ADDR=<address of the node running rank 0>, e.g. with mpirun -x MASTER_ADDR)"
            )
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), env.get("MASTER_PORT", "29500")
        return WorldInfo(rank, world, local_rank, local_world, "mpi", f"tcp://{addr}:{port}")
    return WorldInfo(0, 1, 0, 1, "single", None)


def pick_device(kind: str, local_rank: int) -> torch.device:
    """``auto`` is the CUDA device of the local rank when CUDA is present, else the CPU."""
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but CUDA is not available (use device='cpu' or 'auto')")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: this node has {count} CUDA device(s) "
            f"(launch at most {count} processes per node, or use device='cpu')"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


_FAILED = False
_TEARDOWN_BARRIER_S = 30


def _mark_failure(exc_type, exc, tb):  # type: ignore[no-untyped-def]
    global _FAILED
    _FAILED = True
    _previous_excepthook(exc_type, exc, tb)


_previous_excepthook = sys.excepthook


def init_distributed(world: WorldInfo, device: torch.device, timeout_s: float) -> None:
    """Create the default process group (NCCL on CUDA, gloo otherwise) unless one exists already."""
    if world.init_method is None or dist.is_initialized():
        return  # one process, or the script made its own group (and tears it down itself)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # binds NCCL to our GPU at start-up rather than guessing later
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if world.init_method == "env://" and restart is not None and os.environ.get(ENV_STORE_PER_ATTEMPT) == "1":
        kwargs["store"] = _attempt_store(world, timeout_s, restart)
    else:
        kwargs["init_method"] = world.init_method
    dist.init_process_group(
        backend=backend,
        rank=world.rank,
        world_size=world.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    global _previous_excepthook
    if sys.excepthook is not _mark_failure:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _mark_failure
    atexit.register(teardown)
    get_logger().debug(f"process group up: {backend}, rank {world.rank}/{world.world_size} via {world.source}")


ENV_STORE_PER_ATTEMPT = "PHALANX_STORE_PER_ATTEMPT"


def _attempt_store(world: WorldInfo, timeout_s: float, restart: str) -> Any:
    """The launcher's store, under a prefix of its own for each attempt of the worker group.

    Under the static rendezvous (``phalanx launch`` without ``--rdzv-endpoint``, which sets ENV_STORE_PER_ATTEMPT),
    torchrun keeps one store across restarts (``--max-restarts``): without a prefix, the ranks of a restarted group
    read the previous attempt's keys (each rank's gloo address) and connect to processes that are gone. The c10d
    rendezvous makes a new store for every round, where the restart counts of nodes that joined at different times
    differ, so it gets no prefix.
    """
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world.world_size,
        is_master=not agent_hosts_it and world.rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        multi_tenant=True,
    )
    return dist.PrefixStore(f"phalanx/attempt_{restart}/", store)


def script_failed() -> bool:
    """Whether the script ended with an uncaught exception (known once it has: at exit)."""
    return _FAILED


def teardown() -> None:
    """Barrier then destroy the process group on a clean exit.

    The barrier keeps gloo from aborting when one rank leaves while a peer still talks to it. After an
    uncaught exception we skip it: the peers may sit in another collective, and waiting for them would
    turn one rank's error into a hang. The launcher then ends the other ranks.
    """
    if not dist.is_initialized():
        return
    try:
        if not _FAILED and dist.get_backend() == "gloo":
            # Bounded: a rank that left early (sys.exit, a return) while its peers sit in another
            # collective must not keep this process for the whole collective timeout.
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=_TEARDOWN_BARRIER_S))
    except RuntimeError as e:
        get_logger().warning(f"ranks did not all reach the end of the script together: {e}")
    finally:
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's and (when installed) NumPy's generators."""
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
