"""The Horovod dialect's tensor collectives: ``allreduce``, ``allgather``, ``broadcast``, gradient compression,
and the handles of asynchronous operations (``poll``, ``synchronize``).

Each operation is queued on its process set's coordinator, matched across ranks by name (unnamed ones by a
counter, so ranks issuing them in the same order match), checked, and started on c10d (see coordinator.py).
``allreduce``, ``allgather`` and ``broadcast`` are differentiable, with Horovod's gradients.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from phalanx.compat.horovod.adasum import adasum_allreduce_
from phalanx.compat.horovod.coordinator import Coordinator, Op, digest_of
from phalanx.compat.horovod.process_sets import coordinator_of
from phalanx.compat.horovod.world import (
    Average,
    HvdWorld,
    ReduceOp,
    Sum,
    check_op,
    check_root,
    current,
)
from phalanx.runtime.collective_log import watched
from phalanx.runtime.nccl_rules import to_wire

__all__ = [
    "Compressor", "NoneCompressor", "FP16Compressor", "Compression", "check_compression",
    "allreduce", "allreduce_", "allgather", "broadcast", "broadcast_", "c10d_op", "scale_", "to_comm_device",
    "wire", "run", "handle_of", "poll", "synchronize", "allreduce_op", "allgather_op", "broadcast_op", "resolve_op",
]  # fmt: skip


class Compressor:
    """How a tensor travels: ``compress`` gives the wire tensor and what ``decompress`` needs to undo it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """The tensor travels as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (half the bytes) and come back in their own dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """``hvd.Compression.none`` (the default) or ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def check_compression(compression: Any, where: str) -> Any:
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(
            f"{where}: compression={compression!r} has no compress/decompress methods (use hvd.Compression.none, "
            "hvd.Compression.fp16, or a class with static compress(tensor) -> (tensor, ctx) and "
            "decompress(tensor, ctx))"
        )
    return compression


_C10D_OPS = {
    ReduceOp.Average: dist.ReduceOp.SUM, ReduceOp.Sum: dist.ReduceOp.SUM, ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX, ReduceOp.Product: dist.ReduceOp.PRODUCT,
}  # fmt: skip


def c10d_op(op: ReduceOp) -> Any:
    return _C10D_OPS[op]


def scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiply in place; integer tensors are scaled in float64 and truncated toward zero, as Horovod does."""
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        tensor.copy_((tensor.double() * factor).trunc())


def to_comm_device(tensor: torch.Tensor, world: HvdWorld) -> torch.Tensor:
    """``tensor`` itself when collectives can take it, else a contiguous copy on the device they need."""
    out = tensor.to(world.comm_device)  # the tensor itself when it is there already
    return out if out.is_contiguous() else out.contiguous()


def wire(tensor: torch.Tensor, world: HvdWorld) -> torch.Tensor:
    """The tensor a collective can take: on its device, contiguous, and in a dtype both gloo and NCCL carry (int16
    and uint16 widened to int32, uint32 to int64, on every backend: NCCL has none of them, gloo does not reduce
    int16). The result wraps on the way back, as arithmetic in the tensor's own dtype would."""
    out = to_wire(to_comm_device(tensor, world))
    return out if out.is_contiguous() else out.contiguous()


def run(coord: Coordinator, op: Op) -> Any:
    """Queue ``op`` and wait for its result (a synchronous Horovod call)."""
    return coord.wait(coord.submit(op))


_HANDLES: dict[int, tuple[Coordinator, Op]] = {}
_NEXT_HANDLE = itertools.count(1)


def handle_of(coord: Coordinator, op: Op) -> int:
    """Queue ``op`` and return Horovod's integer handle for ``poll`` and ``synchronize``."""
    coord.submit(op)
    handle = next(_NEXT_HANDLE)
    _HANDLES[handle] = (coord, op)
    return handle


def _handle(handle: Any, where: str) -> tuple[Coordinator, Op]:
    if handle not in _HANDLES:
        raise ValueError(f"{where}: {handle!r} is not a handle of an operation in flight (synchronize() ended it?)")
    return _HANDLES[handle]


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` is done. An operation not started yet is offered to the other ranks
    first (one coordinator round, which waits for theirs)."""
    coord, op = _handle(handle, "hvd.poll")
    return coord.poll(op)


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its result; the handle ends."""
    coord, op = _handle(handle, "hvd.synchronize")
    try:
        return coord.wait(op)
    finally:
        _HANDLES.pop(handle, None)


def allreduce_op(
    coord: Coordinator,
    tensor: torch.Tensor,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    world: HvdWorld,
    name: str | None = None,
) -> Op:
    """An all-reduce of ``tensor`` in place over the set; Average sums and then divides, like Horovod (gloo has no
    average)."""
    kind = "hvd.allreduce"
    if op is ReduceOp.Average:
        postscale = postscale / coord.size
    if op is ReduceOp.Adasum and not tensor.is_floating_point():
        raise ValueError(f"hvd.Adasum combines floating-point tensors; got {tensor.dtype} (use hvd.Sum)")
    digest, text = digest_of(kind, [tensor], op=op, scales=(prescale, postscale))
    state: dict[str, torch.Tensor] = {}

    def launch(sizes: list[int]) -> tuple[list[Any], Any]:
        with torch.no_grad():
            scale_(tensor, prescale)
            if coord.size == 1:
                works: list[Any] = []
            elif op is ReduceOp.Adasum:
                adasum_allreduce_(tensor, wire(tensor, world), coord.group, coord.size)
                works = []
            else:
                state["wire"] = w = wire(tensor, world)
                works = [watched(dist.all_reduce, w, op=c10d_op(op), group=coord.group, async_op=True, label=kind)]

        def finish() -> torch.Tensor:
            with torch.no_grad():
                w = state.get("wire")
                if w is not None and w is not tensor:
                    tensor.copy_(w)
                scale_(tensor, postscale)
            return tensor

        return works, finish

    def plan() -> list[tuple[int, str, str]]:
        w = wire(tensor, world)
        return [(w.numel(), str(w.dtype).removeprefix("torch."), c10d_op(op).name)]

    return Op(kind, name or coord.auto_name(kind), digest, text, launch, plan=None if op is ReduceOp.Adasum else plan)


def _reduce_(
    tensor: torch.Tensor,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    world: HvdWorld,
    process_set: Any = None,
    name: str | None = None,
    where: str = "hvd.allreduce",
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``process_set`` and wait for it."""
    coord = coordinator_of(process_set, where)
    return run(coord, allreduce_op(coord, tensor, op, prescale, postscale, world, name))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float, process_set: Any, name: Any
    ) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale, ctx.process_set = op, prescale, postscale, process_set
        return _reduce_(tensor.clone(), op, prescale, postscale, current("hvd.allreduce"), process_set, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # The output on every rank depends on every rank's input, so the gradient is reduced the same way.
        world = current("hvd.allreduce (backward)")
        out = _reduce_(grad.clone(), ctx.op, ctx.prescale, ctx.postscale, world, ctx.process_set)
        return out, None, None, None, None, None


def resolve_op(op: Any, average: Any, where: str) -> ReduceOp:
    if op is not None and average is not None:
        raise ValueError(
            f"{where}: got both op={op!r} and average={average!r} (pass only op; average is Horovod's old spelling)"
        )
    if average is not None:
        return Average if average else Sum
    return check_op(Average if op is None else op, where)


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """A new tensor: ``tensor`` combined over the ranks of ``process_set`` (all by default), averaged unless ``op``
    says otherwise. Differentiable for Average and Sum."""
    where = "hvd.allreduce"
    reduce_op = resolve_op(op, average, where)
    current(where)
    compressor = check_compression(compression, where)
    if tensor.requires_grad and torch.is_grad_enabled() and reduce_op not in (Average, Sum):
        raise ValueError(
            f"{where}: op=hvd.{reduce_op.name} has no gradient, and the tensor requires one (detach() it, or use "
            "hvd.Average or hvd.Sum)"
        )
    coordinator_of(process_set, where)  # a rank outside the set fails here, before anything is queued
    compressed, ctx = compressor.compress(tensor)
    out = _Allreduce.apply(compressed, reduce_op, float(prescale_factor), float(postscale_factor), process_set, name)
    return compressor.decompress(out, ctx)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> torch.Tensor:
    """Like :func:`allreduce`, in place; returns ``tensor``."""
    where = "hvd.allreduce_"
    reduce_op = resolve_op(op, average, where)
    world = current(where)
    return _reduce_(tensor, reduce_op, float(prescale_factor), float(postscale_factor), world, process_set, name, where)


def allgather_op(coord: Coordinator, tensor: torch.Tensor, world: HvdWorld, name: str | None = None) -> Op:
    """Every set rank's ``tensor``, concatenated along dim 0 in rank order (first dimensions may differ)."""
    kind = "hvd.allgather"
    if tensor.dim() == 0:
        raise ValueError(f"{kind}: got a 0-dimensional tensor ({tensor!r}); gather tensor.reshape(1) instead")
    digest, text = digest_of(kind, [tensor], first_dim_may_differ=True)

    def launch(sizes: list[int]) -> tuple[list[Any], Any]:
        if coord.size == 1:
            out = tensor.detach().clone()
            return [], lambda: out
        w = wire(tensor.detach(), world)
        if w.shape[0] < max(sizes):  # all_gather needs equal sizes: pad, then cut each rank's rows back out
            w = torch.cat([w, w.new_zeros((max(sizes) - w.shape[0], *w.shape[1:]))])
        parts = [torch.empty_like(w) for _ in sizes]
        work = watched(dist.all_gather, parts, w, group=coord.group, async_op=True, label=kind)
        return [work], lambda: torch.cat([p[:s] for p, s in zip(parts, sizes)]).to(tensor.device, tensor.dtype)

    return Op(kind, name or coord.auto_name(kind), digest, text, launch, first_dim=tensor.shape[0])


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, process_set: Any, name: Any) -> torch.Tensor:
        world = current("hvd.allgather")
        coord = coordinator_of(process_set, "hvd.allgather")
        op = allgather_op(coord, tensor, world, name)
        out = run(coord, op)
        ctx.process_set, ctx.rows, ctx.offset = process_set, tensor.shape[0], sum(op.sizes[: coord.index])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # Horovod's gradient: the average over ranks of the gathered gradient, cut to this rank's rows.
        world = current("hvd.allgather (backward)")
        out = _reduce_(grad.clone(), Average, 1.0, 1.0, world, ctx.process_set)
        return out.narrow(0, ctx.offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order; the first dimension may differ by rank."""
    current("hvd.allgather")
    coordinator_of(process_set, "hvd.allgather")
    if tensor.dim() == 0:
        raise ValueError(f"hvd.allgather: got a 0-dimensional tensor ({tensor!r}); gather tensor.reshape(1) instead")
    return _Allgather.apply(tensor, process_set, name)


def broadcast_op(
    coord: Coordinator, tensor: torch.Tensor, root_rank: int, world: HvdWorld, name: str | None = None
) -> Op:
    """Overwrite ``tensor`` in place with ``root_rank``'s (a global rank, which must be in the set)."""
    kind = "hvd.broadcast"
    if root_rank not in coord.ranks:
        raise ValueError(
            f"{kind}: root_rank={root_rank} is not in the process set (ranks {coord.ranks}); root_rank is a global "
            "rank of one of the set's members"
        )
    digest, text = digest_of(kind, [tensor], root=root_rank)
    state: dict[str, torch.Tensor] = {}

    def launch(sizes: list[int]) -> tuple[list[Any], Any]:
        works: list[Any] = []
        if coord.size > 1:
            state["wire"] = w = wire(tensor.detach(), world)
            works = [watched(dist.broadcast, w, src=root_rank, group=coord.group, async_op=True, label=kind)]

        def finish() -> torch.Tensor:
            w = state.get("wire")
            if w is not None and w is not tensor:
                with torch.no_grad():
                    tensor.copy_(w)
            return tensor

        return works, finish

    return Op(kind, name or coord.auto_name(kind), digest, text, launch)


def _broadcast_(tensor: torch.Tensor, root_rank: int, world: HvdWorld, process_set: Any, name: Any) -> torch.Tensor:
    coord = coordinator_of(process_set, "hvd.broadcast")
    return run(coord, broadcast_op(coord, tensor, root_rank, world, name))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, process_set: Any, name: Any) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _broadcast_(tensor.clone(), root_rank, current("hvd.broadcast"), process_set, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # Horovod's gradient: averaged over ranks, and only the root's input receives it.
        world = current("hvd.broadcast (backward)")
        out = _reduce_(grad.clone(), Average, 1.0, 1.0, world, ctx.process_set)
        if world.info.rank != ctx.root_rank:
            out.zero_()
        return out, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor`` (same shape and dtype on every rank)."""
    current("hvd.broadcast")
    coordinator_of(process_set, "hvd.broadcast")
    return _Broadcast.apply(tensor, check_root(root_rank, "hvd.broadcast"), process_set, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns ``tensor``."""
    world = current("hvd.broadcast_")
    return _broadcast_(tensor, check_root(root_rank, "hvd.broadcast_"), world, process_set, name)
