"""The rest of Horovod's tensor operations: ``alltoall``, ``reducescatter``, the grouped forms, ``barrier``, and the
asynchronous forms with ``poll`` and ``synchronize``.

The asynchronous forms complete the operation when it is issued (c10d matches collectives by order, so one that
waited for a later ``synchronize`` could cross another rank's next collective); the handle then gives its result, as
Horovod's does, and ``poll`` says it is done. Each operation is checked across ranks first, as the others are.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from phalanx.compat.horovod.coordinator import agree
from phalanx.compat.horovod.ops import (
    Compression,
    allgather,
    allreduce,
    allreduce_,
    broadcast,
    broadcast_,
    to_comm_device,
)
from phalanx.compat.horovod.world import Average, Sum, check_op, current
from phalanx.runtime.collective_log import watched

__all__ = [
    "barrier", "alltoall", "reducescatter", "grouped_allreduce", "grouped_allgather", "grouped_reducescatter",
    "allreduce_async", "allreduce_async_", "allgather_async", "broadcast_async", "broadcast_async_", "poll",
    "synchronize", "HorovodInternalError", "HostsUpdatedInterrupt",
]  # fmt: skip


class HorovodInternalError(RuntimeError):
    """Horovod's error for a collective that failed (a rank died, the network broke); elastic runs restore from the
    last commit on it."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's signal that the set of hosts changed (elastic runs)."""


def barrier(process_set: Any = None) -> None:
    """Wait until every rank reaches this point."""
    world = current("hvd.barrier")
    _no_process_sets(process_set, "hvd.barrier")
    if world.distributed:
        watched(dist.barrier, label="hvd.barrier")


def _no_process_sets(process_set: Any, where: str) -> None:
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
        raise ValueError(f"{where}: process sets other than the global one are not supported by phalanx.horovod yet")


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> Any:
    """Rank r sends rows ``splits[j]`` of ``tensor`` (along dimension 0; equal parts without ``splits``) to rank j,
    and receives every rank's rows for it, concatenated in rank order. With ``splits``, also returns how many rows
    came from each rank."""
    world = current("hvd.alltoall")
    _no_process_sets(process_set, "hvd.alltoall")
    n = world.info.world_size
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(
                f"hvd.alltoall: the first dimension ({tensor.shape[0]}) must divide by the number of ranks ({n}) "
                "when no splits are given; pass splits="
            )
        sizes = [tensor.shape[0] // n] * n
    else:
        sizes = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(sizes) != n or sum(sizes) != tensor.shape[0] or min(sizes) < 0:
            raise ValueError(
                f"hvd.alltoall: splits={sizes} must give {n} non-negative row counts that add up to the first "
                f"dimension ({tensor.shape[0]})"
            )
    if not world.distributed:
        out = tensor.clone()
        return out if splits is None else (out, torch.tensor(sizes, dtype=torch.int32))
    agree("hvd.alltoall", tensor, first_dim_may_differ=True)
    counts = torch.tensor(sizes, dtype=torch.int64)
    received = torch.empty_like(counts)
    watched(dist.all_to_all_single, received, counts, label="hvd.alltoall sizes")
    wire = to_comm_device(tensor, world)
    out = wire.new_empty((int(received.sum()), *wire.shape[1:]))
    watched(dist.all_to_all_single, out, wire, received.tolist(), sizes, label="hvd.alltoall")  # out splits, in
    out = out.to(tensor.device)
    return out if splits is None else (out, received.to(torch.int32))


def _rows_of(total: int, n: int, r: int) -> tuple[int, int]:
    """Horovod's split of ``total`` rows over ``n`` ranks: the first ``total % n`` ranks get one row more."""
    base, extra = divmod(total, n)
    return r * base + min(r, extra), base + (1 if r < extra else 0)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = None,
    op: Any = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """``tensor`` combined over the ranks (averaged by default), and this rank's part of it along dimension 0 (the
    first ``rows % size`` ranks get one row more)."""
    world = current("hvd.reducescatter")
    _no_process_sets(process_set, "hvd.reducescatter")
    reduce_op = check_op(op, "hvd.reducescatter")
    if reduce_op not in (Average, Sum):
        raise ValueError(f"hvd.reducescatter: op=hvd.{reduce_op.name} is not supported; use hvd.Average or hvd.Sum")
    # An all-reduce, then this rank's rows: gloo has no reduce-scatter, and the result is the same.
    total = allreduce(
        tensor,
        compression=compression if compression is not None else Compression.none,
        op=reduce_op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )
    start, rows = _rows_of(tensor.shape[0], world.info.world_size, world.info.rank)
    return total.narrow(0, start, rows).clone()


def grouped_allreduce(tensors: list[torch.Tensor], average: Any = None, name: str | None = None, **kwargs: Any) -> Any:
    """:func:`allreduce` of each tensor, as one group; returns the list of results."""
    return [allreduce(t, average=average, **kwargs) for t in tensors]


def grouped_allreduce_(tensors: list[torch.Tensor], average: Any = None, name: str | None = None, **kwargs: Any) -> Any:
    return [allreduce_(t, average=average, **kwargs) for t in tensors]


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None, process_set: Any = None) -> Any:
    _no_process_sets(process_set, "hvd.grouped_allgather")
    return [allgather(t) for t in tensors]


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None, **kwargs: Any) -> Any:
    return [reducescatter(t, **kwargs) for t in tensors]


_HANDLES: dict[int, Any] = {}
_NEXT = itertools.count(1)


def _handle(result: Any) -> int:
    handle = next(_NEXT)
    _HANDLES[handle] = result
    return handle


def allreduce_async(tensor: torch.Tensor, average: Any = None, name: str | None = None, **kwargs: Any) -> int:
    return _handle(allreduce(tensor, average=average, **kwargs))


def allreduce_async_(tensor: torch.Tensor, average: Any = None, name: str | None = None, **kwargs: Any) -> int:
    return _handle(allreduce_(tensor, average=average, **kwargs))


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> int:
    _no_process_sets(process_set, "hvd.allgather_async")
    return _handle(allgather(tensor))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> int:
    _no_process_sets(process_set, "hvd.broadcast_async")
    return _handle(broadcast(tensor, root_rank))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> int:
    _no_process_sets(process_set, "hvd.broadcast_async_")
    return _handle(broadcast_(tensor, root_rank))


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` is done (always, here: see the module's docstring)."""
    if handle not in _HANDLES:
        raise ValueError(f"hvd.poll: {handle!r} is not a handle of an operation in flight (synchronize() ended it?)")
    return True


def synchronize(handle: int) -> Any:
    """The result of the operation of ``handle``; the handle ends."""
    if handle not in _HANDLES:
        raise ValueError(f"hvd.synchronize: {handle!r} is not a handle of an operation in flight")
    return _HANDLES.pop(handle)
