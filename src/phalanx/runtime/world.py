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
    local_rank_known: bool = True
    """False when the launcher gave no local rank and none could be derived: ``local_rank`` then holds the global
    rank, a stand-in that :func:`pick_device` does not take for a GPU index."""
    local_world_known: bool = True
    """False when the launcher gave no count of processes per node: ``local_world_size`` then holds the world size."""


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


def _local(
    env: Mapping[str, str], rank: int, world: int, rank_key: str, size_key: str, *, blocks: bool
) -> dict[str, Any]:
    """WorldInfo's ``local_rank``, ``local_world_size``, ``local_rank_known`` and ``local_world_known`` (keyword
    arguments) from the launcher's variables.

    Without a local rank, ``rank % local_world_size`` is it where the launcher fills each node with a block of
    consecutive ranks (``blocks``: torchrun does; mpirun's ``--map-by node`` does not). Otherwise the global rank
    stands in, marked unknown: on a second node it is no local rank, and :func:`pick_device` must not trust it.
    """
    local_world = _int(env, size_key) if size_key in env else None
    if rank_key in env:
        local_rank, rank_known = _int(env, rank_key), True
    elif local_world and blocks:
        local_rank, rank_known = rank % local_world, True
    else:
        local_rank, rank_known = rank, False
    return dict(
        local_rank=local_rank,
        local_world_size=local_world or world,
        local_rank_known=rank_known,
        local_world_known=local_world is not None,
    )


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    """This node's task count: ``SLURM_NTASKS_PER_NODE`` (set by ``--ntasks-per-node``), else this node's entry of
    ``SLURM_STEP_TASKS_PER_NODE`` (``8(x2),4``: two nodes of 8 then one of 4), which srun always sets."""
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        return int(env["SLURM_NTASKS_PER_NODE"])
    counts: list[int] = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if len(set(counts)) == 1:
        return counts[0]
    node = env.get("SLURM_NODEID", "")
    return counts[int(node)] if node.isdigit() and int(node) < len(counts) else None


def detect_world(env: Mapping[str, str] | None = None) -> WorldInfo:
    env = os.environ if env is None else env
    if dist.is_initialized():
        # The script started its own process group (e.g. mp.spawn + init_process_group): it is the world.
        rank, world = dist.get_rank(), dist.get_world_size()
        local = _local(env, rank, world, "LOCAL_RANK", "LOCAL_WORLD_SIZE", blocks=True)
        return WorldInfo(rank=rank, world_size=world, source="existing", init_method="existing", **local)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _local(env, rank, world, "LOCAL_RANK", "LOCAL_WORLD_SIZE", blocks=True)
        if "PHALANX_INIT_METHOD" in env:
            return WorldInfo(
                rank=rank, world_size=world, source="spawn", init_method=env["PHALANX_INIT_METHOD"], **local
            )
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise ValueError(
                f"RANK={rank} and WORLD_SIZE={world} are set but MASTER_ADDR/MASTER_PORT are not "
                "(start the script with `phalanx launch` or torchrun, which set all four)"
            )
        return WorldInfo(rank=rank, world_size=world, source="torchrun", init_method="env://", **local)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        per_node = _slurm_tasks_per_node(env)
        # srun sets SLURM_LOCALID in every step; without it, no guess (`--distribution=cyclic` deals ranks round-robin).
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else rank
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        addr = env.get("MASTER_ADDR") or (first_slurm_host(nodelist) if nodelist else "127.0.0.1")
        # A port derived from the job id keeps two jobs on one node apart without coordination.
        port = env.get("MASTER_PORT") or str(15000 + int(env.get("SLURM_JOB_ID", "0")) % 10000)
        return WorldInfo(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            local_world_size=per_node or world,
            source="slurm",
            init_method=f"tcp://{addr}:{port}",
            local_rank_known="SLURM_LOCALID" in env,
            local_world_known=per_node is not None,
        )
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _local(env, rank, world, "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", blocks=False)
        if local["local_world_size"] != world and "MASTER_ADDR" not in env:
            raise ValueError(
                f"mpirun spans several nodes (world size {world}, {local['local_world_size']} per node) but "
                "MASTER_ADDR is not set (export MASTER_ADDR=<address of the node running rank 0>, e.g. with "
                "mpirun -x MASTER_ADDR)"
            )
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), env.get("MASTER_PORT", "29500")
        return WorldInfo(rank=rank, world_size=world, source="mpi", init_method=f"tcp://{addr}:{port}", **local)
    return WorldInfo(0, 1, 0, 1, "single", None)


# How each launcher's processes learn their local rank, for the error when none did.
_LOCAL_RANK_FIX = {
    "slurm": "start them with srun, which sets SLURM_LOCALID",
    "mpi": "start them with mpirun, which sets OMPI_COMM_WORLD_LOCAL_RANK",
}


def pick_device(kind: str, world: WorldInfo) -> torch.device:
    """The device of this process, and the current CUDA device set to it: the one place a GPU is chosen from a rank.

    ``auto`` is a GPU when CUDA is present, else the CPU. A process that sees one GPU uses it whatever its local
    rank (``srun --gpus-per-task=1`` and Kubernetes narrow CUDA_VISIBLE_DEVICES to one GPU per process); with N
    visible and at most N processes per node, local rank r takes GPU r, as torchrun, Accelerate and DeepSpeed do.
    """
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but CUDA is not available (use device='cpu' or 'auto')")
    index = _gpu_index(world, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _gpu_index(world: WorldInfo, visible: int) -> int:
    if visible == 1:
        return 0
    one_each = (
        "give each process one GPU (a CUDA_VISIBLE_DEVICES of its own, or `srun --gpus-per-task=1`), "
        "or use device='cpu'"
    )
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    sees = f"{visible} GPUs" + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")
    if not world.local_rank_known:
        if world.world_size <= visible:
            # Whichever node a process runs on, its global rank is then a GPU there that no peer on it takes.
            return world.rank
        fix = _LOCAL_RANK_FIX.get(world.source, "set LOCAL_RANK, or LOCAL_WORLD_SIZE to derive it, as torchrun does")
        raise RuntimeError(
            f"each process needs a GPU of its own, and this one cannot tell which of its {visible} visible GPUs it "
            f"is: the launcher gave no local rank, and the global rank {world.rank} of {world.world_size} processes "
            f"is no GPU index ({fix}; or {one_each})"
        )
    per_node = world.local_world_size if world.local_world_known else None
    if world.local_rank >= visible or (per_node is not None and per_node > visible):
        # Every rank refuses, not only those past the last GPU, which would leave the others waiting for them.
        count = f"{per_node} processes per node" if per_node is not None else "more processes per node than GPUs"
        raise RuntimeError(
            f"each process needs a GPU of its own: {count}, and local rank {world.local_rank} sees {sees} "
            f"(launch at most {visible} processes per node, or {one_each})"
        )
    return world.local_rank


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
