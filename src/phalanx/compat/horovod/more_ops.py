"""The rest of Horovod's tensor operations: ``alltoall``, ``reducescatter``, the grouped forms, ``barrier``, the
asynchronous forms, and the sparse all-reduce.

An asynchronous form only queues its operation on the coordinator; ``poll`` and ``synchronize`` (or any later
synchronous call) run the round that starts it, so a burst of them is checked in one round. The grouped forms queue
every member and wait for them together (one round), unless a member needs a gradient, which they then carry as the
single operations do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.compat.horovod.coordinator import (
    Coordinator,
    HorovodInternalError,
    Op,
    digest_of,
)
from phalanx.compat.horovod.ops import (
    Compression,
    allgather,
    allgather_op,
    allreduce,
    allreduce_op,
    broadcast_op,
    check_compression,
    handle_of,
    resolve_op,
    run,
    wire,
)
from phalanx.compat.horovod.process_sets import coordinator_of
from phalanx.compat.horovod.world import Average, HvdWorld, ReduceOp, Sum, check_op, check_root, current
from phalanx.runtime.collective_log import watched

__all__ = [
    "barrier", "alltoall", "reducescatter", "grouped_allreduce", "grouped_allreduce_", "grouped_allgather",
    "grouped_reducescatter", "allreduce_async", "allreduce_async_", "allgather_async", "broadcast_async",
    "broadcast_async_", "reducescatter_async", "alltoall_async", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_allgather_async", "grouped_reducescatter_async", "sparse_allreduce_async",
    "HorovodInternalError", "HostsUpdatedInterrupt",
]  # fmt: skip


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's signal that the set of hosts changed (elastic runs)."""


def barrier(process_set: Any = None) -> None:
    """Wait until every rank of ``process_set`` (all by default) reaches this point."""
    current("hvd.barrier")
    coord = coordinator_of(process_set, "hvd.barrier")
    digest, text = digest_of("hvd.barrier", [])
    # The round that starts it is the barrier: it is ready only once every rank has queued it.
    run(coord, Op("hvd.barrier", coord.auto_name("hvd.barrier"), digest, text, lambda sizes: ([], lambda: None)))


# -- alltoall ------------------------------------------------------------------------------------------------------
def _splits(tensor: torch.Tensor, splits: Any, n: int) -> list[int]:
    if splits is None:
        if tensor.dim() == 0 or tensor.shape[0] % n:
            raise ValueError(
                f"hvd.alltoall: the first dimension ({tensor.shape[0] if tensor.dim() else 'none'}) must divide by the "
                f"number of ranks ({n}) when no splits are given; pass splits="
            )
        return [tensor.shape[0] // n] * n
    if isinstance(splits, torch.Tensor) and splits.dtype != torch.int32:
        raise ValueError(f"hvd.alltoall: splits must hold 32-bit integers, as in Horovod; got {splits.dtype}")
    sizes = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(sizes) != n or sum(sizes) != tensor.shape[0] or min(sizes) < 0:
        raise ValueError(
            f"hvd.alltoall: splits={sizes} must give {n} non-negative row counts that add up to the first "
            f"dimension ({tensor.shape[0]})"
        )
    return sizes


def _alltoall_op(coord: Coordinator, tensor: torch.Tensor, sizes: list[int], world: HvdWorld, name: Any) -> Op:
    kind = "hvd.alltoall"
    digest, text = digest_of(kind, [tensor], first_dim_may_differ=True)

    def launch(_: list[int]) -> tuple[list[Any], Callable[[], Any]]:
        if coord.size == 1:
            out = tensor.detach().clone()
            return [], lambda: (out, torch.tensor(sizes, dtype=torch.int32))
        counts = torch.tensor(sizes, dtype=torch.int64, device=coord.device)
        received = torch.empty_like(counts)
        watched(dist.all_to_all_single, received, counts, group=coord.group, label=f"{kind} sizes")
        w = wire(tensor.detach(), world)
        out = w.new_empty((int(received.sum()), *w.shape[1:]))
        work = watched(
            dist.all_to_all_single, out, w, received.tolist(), sizes, group=coord.group, async_op=True, label=kind
        )
        return [work], lambda: (out.to(tensor.device, tensor.dtype), received.to("cpu", torch.int32))

    return Op(
        kind, name or coord.auto_name(kind), digest, text, launch, first_dim=tensor.shape[0] if tensor.dim() else 0
    )


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, sizes: list[int], process_set: Any, name: Any) -> Any:
        coord = coordinator_of(process_set, "hvd.alltoall")
        out, received = run(coord, _alltoall_op(coord, tensor, sizes, current("hvd.alltoall"), name))
        ctx.process_set, ctx.received = process_set, received.tolist()
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[Any, ...]:
        # The rows went from rank i to rank j; their gradients go back from j to i.
        coord = coordinator_of(ctx.process_set, "hvd.alltoall (backward)")
        back, _counts = run(coord, _alltoall_op(coord, grad.contiguous(), ctx.received, current("hvd.alltoall"), None))
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> Any:
    """Rank r sends rows ``splits[j]`` of ``tensor`` (along dimension 0; equal parts without ``splits``) to rank j,
    and receives every rank's rows for it, concatenated in rank order. With ``splits``, also returns how many rows
    came from each rank."""
    current("hvd.alltoall")
    coord = coordinator_of(process_set, "hvd.alltoall")
    sizes = _splits(tensor, splits, coord.size)
    out, received = _Alltoall.apply(tensor, sizes, process_set, name)
    return out if splits is None else (out, received)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> int:
    world = current("hvd.alltoall_async")
    coord = coordinator_of(process_set, "hvd.alltoall_async")
    return handle_of(coord, _alltoall_op(coord, tensor, _splits(tensor, splits, coord.size), world, name))


# -- reducescatter -------------------------------------------------------------------------------------------------
def _rows_of(total: int, n: int, r: int) -> tuple[int, int]:
    """Horovod's split of ``total`` rows over ``n`` ranks: the first ``total % n`` ranks get one row more."""
    base, extra = divmod(total, n)
    return r * base + min(r, extra), base + (1 if r < extra else 0)


def _reducescatter_op(
    coord: Coordinator, tensor: torch.Tensor, op: Any, scales: tuple[float, float], world: HvdWorld, name: Any
) -> Op:
    kind, where = "hvd.reducescatter", "hvd.reducescatter"
    reduce_op = check_op(op, where)
    if reduce_op is ReduceOp.Adasum:  # a RuntimeError, as Horovod raises it
        raise NotImplementedError(
            f"{where}: op=hvd.Adasum is not supported by reducescatter; use hvd.Average or hvd.Sum"
        )
    if reduce_op not in (Average, Sum):
        raise ValueError(f"{where}: op=hvd.{reduce_op.name} is not supported; use hvd.Average or hvd.Sum")
    if tensor.dim() == 0:
        raise ValueError(f"{where}: got a 0-dimensional tensor ({tensor!r}); it scatters rows (reshape(1) it)")
    # An all-reduce, then this rank's rows: gloo has no reduce-scatter, and the result is the same.
    inner = allreduce_op(coord, tensor.detach().clone(), reduce_op, scales[0], scales[1], world, name or "-")
    start, rows = _rows_of(tensor.shape[0], coord.size, coord.index)

    def launch(sizes: list[int]) -> tuple[list[Any], Callable[[], Any]]:
        works, finish = inner.launch(sizes)
        return works, lambda: finish().narrow(0, start, rows).clone()

    text = inner.text.replace("allreduce", "reducescatter")
    return Op(kind, name or coord.auto_name(kind), inner.digest ^ 0x5C, text, launch, plan=inner.plan)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: Any, scales: Any, process_set: Any, name: Any) -> torch.Tensor:
        coord = coordinator_of(process_set, "hvd.reducescatter")
        ctx.op, ctx.process_set = op, process_set
        return run(coord, _reducescatter_op(coord, tensor, op, scales, current("hvd.reducescatter"), name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # Horovod's gradient: every rank's rows gathered back, scaled as an all-reduce of the gradient would be.
        coord = coordinator_of(ctx.process_set, "hvd.reducescatter (backward)")
        out = run(coord, allgather_op(coord, grad.contiguous(), current("hvd.reducescatter (backward)")))
        return (out * coord.size if check_op(ctx.op, "") is Sum else out), None, None, None, None


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
    current("hvd.reducescatter")
    coordinator_of(process_set, "hvd.reducescatter")
    compressor = check_compression(compression if compression is not None else Compression.none, "hvd.reducescatter")
    wire_tensor, ctx = compressor.compress(tensor)
    scales = (float(prescale_factor), float(postscale_factor))
    return compressor.decompress(_Reducescatter.apply(wire_tensor, op, scales, process_set, name), ctx)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    world = current("hvd.reducescatter_async")
    coord = coordinator_of(process_set, "hvd.reducescatter_async")
    scales = (float(prescale_factor), float(postscale_factor))
    return handle_of(coord, _reducescatter_op(coord, tensor, op, scales, world, name))


# -- grouped forms -------------------------------------------------------------------------------------------------
def _member(name: Any, i: int) -> Any:
    return None if name is None else f"{name}.{i}"


def _together(coord: Coordinator, ops: list[Op]) -> list[Any]:
    """Queue every op, then wait for each: one round starts them all."""
    for o in ops:
        coord.submit(o)
    return [coord.wait(o) for o in ops]


def _needs_grad(tensors: list[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _allreduce_ops(
    tensors: list[torch.Tensor], in_place: bool, where: str, **kwargs: Any
) -> tuple[Coordinator, list[Op]]:
    world = current(where)
    coord = coordinator_of(kwargs.get("process_set"), where)
    reduce_op = resolve_op(kwargs.get("op"), kwargs.get("average"), where)
    scales = (float(kwargs.get("prescale_factor", 1.0)), float(kwargs.get("postscale_factor", 1.0)))
    name = kwargs.get("name")
    names = [name] if kwargs.get("single") else [_member(name, i) for i in range(len(tensors))]
    ops = [
        allreduce_op(coord, t if in_place else t.detach().clone(), reduce_op, *scales, world, n)
        for n, t in zip(names, tensors)
    ]
    return coord, ops


def grouped_allreduce(tensors: list[torch.Tensor], average: Any = None, name: str | None = None, **kwargs: Any) -> Any:
    """:func:`allreduce` of each tensor, as one group; returns the list of results."""
    compression = kwargs.get("compression", Compression.none)
    if _needs_grad(tensors) or compression is not Compression.none:
        return [allreduce(t, average=average, name=_member(name, i), **kwargs) for i, t in enumerate(tensors)]
    coord, ops = _allreduce_ops(tensors, False, "hvd.grouped_allreduce", average=average, name=name, **kwargs)
    return _together(coord, ops)


def grouped_allreduce_(tensors: list[torch.Tensor], average: Any = None, name: str | None = None, **kwargs: Any) -> Any:
    coord, ops = _allreduce_ops(tensors, True, "hvd.grouped_allreduce_", average=average, name=name, **kwargs)
    return _together(coord, ops)


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None, process_set: Any = None) -> Any:
    if _needs_grad(tensors):
        return [allgather(t, name=_member(name, i), process_set=process_set) for i, t in enumerate(tensors)]
    world = current("hvd.grouped_allgather")
    coord = coordinator_of(process_set, "hvd.grouped_allgather")
    return _together(coord, [allgather_op(coord, t, world, _member(name, i)) for i, t in enumerate(tensors)])


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None, **kwargs: Any) -> Any:
    return [reducescatter(t, name=_member(name, i), **kwargs) for i, t in enumerate(tensors)]


# -- asynchronous forms --------------------------------------------------------------------------------------------
def allreduce_async(
    tensor: torch.Tensor,
    average: Any = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> int:
    """Queue an all-reduce of a copy of ``tensor``; ``synchronize(handle)`` returns the result."""
    coord, ops = _allreduce_ops(
        [tensor], False, "hvd.allreduce_async", average=average, name=name, op=op, process_set=process_set, single=1,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
    )  # fmt: skip
    return handle_of(coord, ops[0])


def allreduce_async_(
    tensor: torch.Tensor,
    average: Any = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> int:
    """Queue an all-reduce of ``tensor`` in place."""
    coord, ops = _allreduce_ops(
        [tensor], True, "hvd.allreduce_async_", average=average, name=name, op=op, process_set=process_set, single=1,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
    )  # fmt: skip
    return handle_of(coord, ops[0])


def grouped_allreduce_async(tensors: list[torch.Tensor], average: Any = None, name: Any = None, **kwargs: Any) -> Any:
    coord, ops = _allreduce_ops(tensors, False, "hvd.grouped_allreduce_async", average=average, name=name, **kwargs)
    return [handle_of(coord, o) for o in ops]


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: Any = None, name: Any = None, **kwargs: Any) -> Any:
    coord, ops = _allreduce_ops(tensors, True, "hvd.grouped_allreduce_async_", average=average, name=name, **kwargs)
    return [handle_of(coord, o) for o in ops]


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> int:
    world = current("hvd.allgather_async")
    coord = coordinator_of(process_set, "hvd.allgather_async")
    return handle_of(coord, allgather_op(coord, tensor, world, name))


def grouped_allgather_async(tensors: list[torch.Tensor], name: Any = None, process_set: Any = None) -> Any:
    return [allgather_async(t, _member(name, i), process_set) for i, t in enumerate(tensors)]


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: Any = None, **kwargs: Any) -> Any:
    return [reducescatter_async(t, _member(name, i), **kwargs) for i, t in enumerate(tensors)]


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> int:
    """Queue a broadcast into a copy of ``tensor``."""
    world = current("hvd.broadcast_async")
    coord = coordinator_of(process_set, "hvd.broadcast_async")
    root = check_root(root_rank, "hvd.broadcast_async")
    return handle_of(coord, broadcast_op(coord, tensor.detach().clone(), root, world, name))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> int:
    world = current("hvd.broadcast_async_")
    coord = coordinator_of(process_set, "hvd.broadcast_async_")
    return handle_of(coord, broadcast_op(coord, tensor, check_root(root_rank, "hvd.broadcast_async_"), world, name))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Any, process_set: Any = None) -> Callable[[], Any]:
    """Reduce a sparse tensor as Horovod does: gather every rank's indices and values (one all-gather each); the
    returned function waits and gives the sparse sum (divided by the set's size for Average)."""
    where = "hvd.sparse_allreduce_async"
    world = current(where)
    coord = coordinator_of(process_set, where)
    reduce_op = check_op(op, where)
    if reduce_op not in (Average, Sum):
        raise ValueError(f"{where}: op=hvd.{reduce_op.name} is not supported for sparse tensors; use Average or Sum")
    t = tensor.coalesce()
    indices = coord.submit(allgather_op(coord, t.indices().t().contiguous(), world, f"{name}.indices"))
    values = coord.submit(allgather_op(coord, t.values(), world, f"{name}.values"))

    def result() -> torch.Tensor:
        idx, val = coord.wait(indices), coord.wait(values)
        if reduce_op is ReduceOp.Average:
            val = val / coord.size
        return torch.sparse_coo_tensor(idx.t(), val, t.shape, check_invariants=False)

    return result
