"""Horovod's process sets on c10d: ``hvd.ProcessSet``, ``add_process_set``, ``remove_process_set`` and
``global_process_set``, each set backed by a torch process group and its own :class:`Coordinator`.

    even = hvd.add_process_set([0, 2])          # on every rank, in the same order (torch's new_group is collective)
    if hvd.rank() in (0, 2):
        hvd.allreduce(t, process_set=even)      # reduces over ranks 0 and 2 only

As in Horovod, a set's ranks are sorted, ``root_rank`` stays a global rank, ``process_set.rank()`` is the rank
within the set, a rank outside the set that calls an operation on it gets a ``ValueError``, and no two sets may
hold the same ranks. ``hvd.init(process_sets=[...])`` registers static sets; ``add_process_set`` works at any time
(Horovod's dynamic sets, without needing ``HOROVOD_DYNAMIC_PROCESS_SETS``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from phalanx.compat.horovod.coordinator import Coordinator

__all__ = [
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "setup_process_sets",
    "clear_process_sets", "coordinator_of", "Registered",
]  # fmt: skip


class ProcessSet:
    """A set of ranks that run collectives together; pass it as ``process_set=`` to an operation."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Any) -> None:
        if isinstance(ranks_or_comm, Iterable) and not isinstance(ranks_or_comm, (str, bytes)):
            ranks = list(ranks_or_comm)
            if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
                raise ValueError(
                    f"ProcessSet({ranks!r}): a process set is a list of integer ranks (or, in Horovod, an mpi4py "
                    "communicator, which phalanx does not run on)"
                )
            self.ranks = sorted(ranks)
        else:
            raise ValueError(
                f"ProcessSet({ranks_or_comm!r}): phalanx runs on c10d, not MPI; build the set from a list of ranks"
            )

    def _invalidate(self) -> None:
        self.process_set_id = None

    def _registered(self) -> Registered | None:
        return _SETS.get(self.process_set_id) if self.process_set_id is not None else None

    def size(self) -> int | None:
        """The number of ranks in the set, or None if it is not registered."""
        reg = self._registered()
        return None if reg is None else reg.coordinator.size

    def rank(self) -> int | None:
        """This process's rank within the set (None outside it, or if it is not registered)."""
        reg = self._registered()
        return None if reg is None or reg.coordinator.index < 0 else reg.coordinator.index

    def included(self) -> bool | None:
        """Whether this process belongs to the set (None if the set has no ranks yet)."""
        if self.ranks is None:
            return None
        return _MY_RANK in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclass
class Registered:
    """A registered set: its torch group (None for the default group) and its coordinator."""

    process_set: ProcessSet
    group: Any
    coordinator: Coordinator


_SETS: dict[int, Registered] = {}
_NEXT_ID = 1
_MY_RANK = 0
_WORLD_SIZE = 1
_DEVICE: Any = None


def setup_process_sets(rank: int, world_size: int, distributed: bool, static: Any, device: Any = None) -> None:
    """Register the global set and ``hvd.init(process_sets=...)``'s static sets (collective when distributed);
    ``device``: where collectives take tensors."""
    global _NEXT_ID, _MY_RANK, _WORLD_SIZE, _DEVICE
    _SETS.clear()
    _NEXT_ID, _MY_RANK, _WORLD_SIZE, _DEVICE = 1, rank, world_size, device
    everyone = list(range(world_size))
    global_process_set.ranks = everyone
    group = dist.group.WORLD if distributed else None
    _SETS[0] = Registered(global_process_set, group, Coordinator(group, everyone, rank, device))
    if static is None or static == "dynamic":
        return
    if isinstance(static, ProcessSet) or not isinstance(static, (list, tuple)):
        raise ValueError(
            f"hvd.init(process_sets={static!r}): pass a list of hvd.ProcessSet objects, or 'dynamic' (then add "
            "them with hvd.add_process_set)"
        )
    for ps in static:
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"hvd.init(process_sets=...): {ps!r} is not a hvd.ProcessSet (use hvd.ProcessSet(ranks))")
        if ps.ranks == everyone:  # Horovod gives the global set's id to a copy of it
            ps.process_set_id = 0
            continue
        _register(ps, "hvd.init(process_sets=...)")


def clear_process_sets() -> None:
    """``hvd.shutdown()``: every set but the global one is invalid afterwards."""
    for pid, reg in list(_SETS.items()):
        if pid != 0:
            reg.process_set._invalidate()
    _SETS.clear()


def _register(ps: ProcessSet, where: str) -> ProcessSet:
    global _NEXT_ID
    assert ps.ranks is not None
    outside = [r for r in ps.ranks if not 0 <= r < _WORLD_SIZE]
    if not ps.ranks or outside or len(set(ps.ranks)) != len(ps.ranks):
        raise ValueError(
            f"{where}: ranks {ps.ranks} must be distinct ranks of this world, 0 to {_WORLD_SIZE - 1}, and at least one"
        )
    for reg in _SETS.values():
        if reg.process_set.ranks == ps.ranks:
            raise ValueError(
                f"{where}: a process set with ranks {ps.ranks} exists already ({reg.process_set}); Horovod refuses "
                "duplicates too (reuse that one, or remove it first with hvd.remove_process_set)"
            )
    # new_group is collective over the whole world: every rank calls add_process_set in the same order.
    group = dist.new_group(ps.ranks) if dist.is_initialized() and _WORLD_SIZE > 1 else None
    ps.process_set_id = _NEXT_ID
    _NEXT_ID += 1
    coordinator = Coordinator(group, ps.ranks, _MY_RANK, _DEVICE)
    coordinator.world = _SETS[0].coordinator
    _SETS[ps.process_set_id] = Registered(ps, group, coordinator)
    return ps


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a set of ranks (a ``hvd.ProcessSet`` or a list of ranks) and return it. Call it on every rank, with
    the same sets in the same order."""
    if not _SETS:
        raise ValueError("hvd.add_process_set needs the world, but hvd.init() has not been called (call it first)")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None and ps.process_set_id in _SETS:
        raise ValueError(f"hvd.add_process_set: {ps} is registered already")
    return _register(ps, "hvd.add_process_set")


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set; False for the global set or one that is not registered. Call it on every rank."""
    pid = getattr(process_set, "process_set_id", None)
    if pid is None or pid == 0 or pid not in _SETS:
        return False
    _SETS.pop(pid)
    process_set._invalidate()
    return True


def coordinator_of(process_set: Any, where: str) -> Coordinator:
    """The coordinator of ``process_set`` (None: the global set), or Horovod's error for a rank outside it."""
    if process_set is None:
        process_set = global_process_set
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{where}: process_set={process_set!r} is not a hvd.ProcessSet (use hvd.add_process_set)")
    reg = _SETS.get(process_set.process_set_id) if process_set.process_set_id is not None else None
    if reg is None:
        raise ValueError(
            f"{where}: {process_set} is not registered (add it with hvd.add_process_set on every rank, or it was "
            "removed or hvd.shutdown() ran since)"
        )
    if reg.coordinator.index < 0:
        raise ValueError(
            f"{where}: this rank ({_MY_RANK}) is not in process set {process_set.process_set_id} (ranks "
            f"{reg.coordinator.ranks}); call operations on a set only from its ranks"
        )
    return reg.coordinator
