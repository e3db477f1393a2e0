"""The Horovod dialect's world: ``hvd.init()`` and the questions a script asks of it (rank, size, local rank).

Horovod keeps its world in the process, so this module does too: ``init()`` starts the process group through
phalanx's runtime (the launcher's environment decides the world, as for ``phalanx.Engine``) and remembers it here.
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.compat.horovod.process_sets import clear_process_sets, setup_process_sets
from phalanx.config.mesh import Mesh
from phalanx.config.settings import resolve_config
from phalanx.logging import configure_logging
from phalanx.runtime.topology import Topology
from phalanx.runtime.watchdog import start_watchdog
from phalanx.runtime.world import (
    WorldInfo,
    detect_world,
    init_distributed,
    pick_device,
    teardown,
)

__all__ = [
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
    "cuda_built", "rocm_built",
]  # fmt: skip


class ReduceOp(enum.IntEnum):
    """How values from the ranks combine. The numbers are Horovod's, so code that stored them keeps working."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum,
                                           ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)  # fmt: skip


def check_op(op: Any, where: str, allowed: tuple[ReduceOp, ...] = tuple(ReduceOp)) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`, or an error that names it and what to use."""
    try:
        value = ReduceOp(op)
    except (ValueError, TypeError):
        names = ", ".join(f"hvd.{o.name}" for o in allowed)
        raise ValueError(f"{where}: op={op!r} is not a reduction (use one of {names})") from None
    if value not in allowed:
        names = ", ".join(f"hvd.{o.name}" for o in allowed)
        raise ValueError(f"{where}: op=hvd.{value.name} is not supported here (use one of {names})")
    return value


@dataclass(frozen=True)
class HvdWorld:
    """What ``hvd.init()`` found: the world, the device collectives run on, and whether we made the group."""

    info: WorldInfo
    device: torch.device
    owns_group: bool

    @property
    def distributed(self) -> bool:
        return self.info.world_size > 1 and dist.is_initialized()

    @property
    def comm_device(self) -> torch.device:
        """Where a tensor must be for a collective: NCCL only takes CUDA tensors, gloo takes CPU ones."""
        if self.distributed and dist.get_backend() == "nccl":
            return self.device
        return torch.device("cpu")


_WORLD: HvdWorld | None = None
_KEPT: list[Any] = []  # the rendezvous store of a group hvd.shutdown() ended, and how many groups it has served


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the world that the launcher started (``phalanx launch``, torchrun, ``srun``, ``mpirun``, ``phalanx.spawn``,
    or a plain ``python script.py`` for one process). Calling it again does nothing. ``process_sets``: a list of
    ``hvd.ProcessSet`` to register (Horovod's static sets), or "dynamic"."""
    global _WORLD
    if comm is not None:
        raise ValueError(
            f"hvd.init(comm={comm!r}): phalanx does not run on MPI communicators; start the script with "
            "`phalanx launch -n N script.py`, torchrun or mpirun and call hvd.init() with no arguments"
        )
    if _WORLD is not None:
        return
    config = resolve_config().engine
    world = detect_world()
    configure_logging(world.rank, config.log_all_ranks)
    device = pick_device(config.device, world)
    existed = dist.is_initialized()
    if _KEPT and not existed and world.init_method is not None:
        _reinit(world, device, config.timeout_s)
    else:
        init_distributed(world, device, config.timeout_s)
    start_watchdog(
        world.rank,
        world.world_size,
        device.type,
        config.hang_timeout_s,
        config.debug_collectives,
        Topology(Mesh(world.world_size, dp_replicate=world.world_size), world.rank),
    )
    _WORLD = HvdWorld(world, device, owns_group=not existed and world.init_method is not None)
    setup_process_sets(world.rank, world.world_size, _WORLD.distributed, process_sets, _WORLD.comm_device)


def _reinit(world: WorldInfo, device: torch.device, timeout_s: float) -> None:
    """``init -> shutdown -> init``: a new group over the first group's store, under a prefix of its own. A second
    rendezvous on the launcher's address would race the old store's server for the port and read the old group's
    keys (the hang Horovod's test_horovod_reinit showed)."""
    store, generation = _KEPT
    _KEPT[1] = generation + 1
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore(f"phalanx/hvd-init/{generation}/", store),
        rank=world.rank,
        world_size=world.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def shutdown() -> None:
    """Leave the world; ``init()`` may be called again afterwards. A process group the script made itself is kept."""
    global _WORLD
    clear_process_sets()
    if _WORLD is not None and _WORLD.owns_group and dist.is_initialized():
        if not _KEPT:
            _KEPT.extend([dist.distributed_c10d._get_default_store(), 1])
        teardown()
    _WORLD = None


def is_initialized() -> bool:
    return _WORLD is not None


class NotInitializedError(RuntimeError, ValueError):
    """A call before ``hvd.init()``; a ``ValueError``, as Horovod raises it (and a ``RuntimeError``, as phalanx did)."""


def current(what: str) -> HvdWorld:
    """The world, or an error saying that ``hvd.init()`` must come first."""
    if _WORLD is None:
        raise NotInitializedError(f"{what} needs the world, but hvd.init() has not been called (call hvd.init() first)")
    return _WORLD


def check_root(root_rank: Any, what: str) -> int:
    n = size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < n:
        raise ValueError(f"{what}: root_rank={root_rank!r} is not a rank of this world (use 0 to {n - 1})")
    return root_rank


def size() -> int:
    return current("hvd.size()").info.world_size


def rank() -> int:
    return current("hvd.rank()").info.rank


def local_rank() -> int:
    return current("hvd.local_rank()").info.local_rank


def local_size() -> int:
    return current("hvd.local_size()").info.local_world_size


def cross_size() -> int:
    """The number of nodes (every node runs ``local_size()`` ranks)."""
    return size() // local_size()


def cross_rank() -> int:
    """This rank's node, counting from 0."""
    return rank() // local_size()


def is_homogeneous() -> bool:
    return size() % local_size() == 0


def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    world = current("hvd.gloo_enabled()")
    return world.distributed and dist.get_backend() == "gloo"


def gloo_built() -> bool:
    return dist.is_gloo_available()


def nccl_built() -> bool:
    return dist.is_nccl_available()


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return torch.version.hip is not None
