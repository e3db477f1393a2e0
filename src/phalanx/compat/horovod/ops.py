"""The Horovod dialect's tensor collectives: ``allreduce``, ``allgather``, ``broadcast`` and gradient compression.

They run on c10d. Horovod matches collectives across ranks by name, so ranks may issue them in different orders;
c10d matches them by order, so every rank must call them in the same order (the usual case). ``name`` is accepted
and not used. ``allreduce``, ``allgather`` and ``broadcast`` are differentiable, with Horovod's gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.compat.horovod.adasum import adasum_allreduce_
from phalanx.compat.horovod.coordinator import agree
from phalanx.compat.horovod.world import (
    Average,
    HvdWorld,
    ReduceOp,
    Sum,
    check_op,
    check_root,
    current,
    rank,
)
from phalanx.runtime.collective_log import watched

__all__ = [
    "Compressor", "NoneCompressor", "FP16Compressor", "Compression", "check_compression",
    "allreduce", "allreduce_", "allgather", "broadcast", "broadcast_", "c10d_op", "scale_", "to_comm_device",
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
    device = world.comm_device
    if tensor.device == device and tensor.is_contiguous():
        return tensor
    return tensor.to(device, copy=True).contiguous()


_WIDENED = {torch.int16: torch.int32, torch.uint16: torch.int32}  # dtypes gloo does not reduce, and what carries them


def _wire(tensor: torch.Tensor, world: HvdWorld) -> torch.Tensor:
    """The tensor a collective can take: on its device, contiguous, and (on gloo) in a dtype gloo knows."""
    wire = to_comm_device(tensor, world)
    if wire.dtype in _WIDENED and dist.get_backend() == "gloo":
        wire = wire.to(_WIDENED[wire.dtype])  # the sum wraps on the way back, as int16 arithmetic would
    return wire


def _reduce_(
    tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float, world: HvdWorld, where: str = "hvd.allreduce"
) -> None:
    """All-reduce ``tensor`` in place; Average sums and then divides, like Horovod (gloo has no average)."""
    n = world.info.world_size
    if world.distributed:
        agree("hvd.allreduce", tensor, op=op, scales=(prescale, postscale))
    if op is ReduceOp.Average:
        postscale = postscale / n
    with torch.no_grad():
        scale_(tensor, prescale)
        if world.distributed and op is ReduceOp.Adasum:
            adasum_allreduce_(tensor, _wire(tensor, world))
        elif world.distributed:
            wire = _wire(tensor, world)
            watched(dist.all_reduce, wire, op=c10d_op(op), label=where)
            if wire is not tensor:
                tensor.copy_(wire)
        scale_(tensor, postscale)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        out = tensor.clone()
        _reduce_(out, op, prescale, postscale, current("hvd.allreduce"))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # The output on every rank depends on every rank's input, so the gradient is reduced the same way.
        out = grad.clone()
        _reduce_(out, ctx.op, ctx.prescale, ctx.postscale, current("hvd.allreduce (backward)"))
        return out, None, None, None


def _resolve_op(op: Any, average: Any, where: str) -> ReduceOp:
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
) -> torch.Tensor:
    """A new tensor: ``tensor`` combined over all ranks (averaged unless ``op`` says otherwise). Differentiable for
    Average and Sum."""
    where = "hvd.allreduce"
    reduce_op = _resolve_op(op, average, where)
    current(where)
    compressor = check_compression(compression, where)
    if tensor.requires_grad and torch.is_grad_enabled() and reduce_op not in (Average, Sum):
        raise ValueError(
            f"{where}: op=hvd.{reduce_op.name} has no gradient, and the tensor requires one (detach() it, or use "
            "hvd.Average or hvd.Sum)"
        )
    wire, ctx = compressor.compress(tensor)
    out = _Allreduce.apply(wire, reduce_op, float(prescale_factor), float(postscale_factor))
    return compressor.decompress(out, ctx)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Like :func:`allreduce`, in place; returns ``tensor``."""
    where = "hvd.allreduce_"
    reduce_op = _resolve_op(op, average, where)
    _reduce_(tensor, reduce_op, float(prescale_factor), float(postscale_factor), current(where))
    return tensor


def _gather(tensor: torch.Tensor, world: HvdWorld) -> tuple[torch.Tensor, list[int]]:
    """Every rank's tensor, concatenated along dim 0 in rank order, and each rank's first dimension."""
    if not world.distributed:
        return tensor.clone(), [tensor.shape[0]]
    agree("hvd.allgather", tensor, first_dim_may_differ=True)
    counts = torch.tensor([tensor.shape[0]], dtype=torch.int64)
    everyone = [torch.empty_like(counts) for _ in range(world.info.world_size)]
    watched(dist.all_gather, everyone, counts, label="hvd.allgather sizes")
    sizes = [int(c) for c in everyone]
    wire = _wire(tensor, world)
    if wire.shape[0] < max(sizes):  # all_gather needs equal sizes: pad, then cut each rank's rows back out
        wire = torch.cat([wire, wire.new_zeros((max(sizes) - wire.shape[0], *wire.shape[1:]))])
    parts = [torch.empty_like(wire) for _ in sizes]
    watched(dist.all_gather, parts, wire)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)]).to(tensor.device, tensor.dtype), sizes


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        out, sizes = _gather(tensor, current("hvd.allgather"))
        ctx.offset, ctx.rows = sum(sizes[: rank()]), tensor.shape[0]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # Horovod's gradient: the average over ranks of the gathered gradient, cut to this rank's rows.
        out = grad.clone()
        _reduce_(out, Average, 1.0, 1.0, current("hvd.allgather (backward)"))
        return (out.narrow(0, ctx.offset, ctx.rows),)


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order; the first dimension may differ by rank."""
    current("hvd.allgather")
    if tensor.dim() == 0:
        raise ValueError(f"hvd.allgather: got a 0-dimensional tensor ({tensor!r}); gather tensor.reshape(1) instead")
    return _Allgather.apply(tensor)


def _broadcast_(tensor: torch.Tensor, root_rank: int, world: HvdWorld) -> None:
    if not world.distributed:
        return
    agree("hvd.broadcast", tensor, root=root_rank)
    with torch.no_grad():
        wire = _wire(tensor, world)
        watched(dist.broadcast, wire, src=root_rank, label="hvd.broadcast")
        if wire is not tensor:
            tensor.copy_(wire)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int) -> torch.Tensor:
        ctx.root_rank = root_rank
        out = tensor.clone()
        _broadcast_(out, root_rank, current("hvd.broadcast"))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # Horovod's gradient: averaged over ranks, and only the root's input receives it.
        out = grad.clone()
        _reduce_(out, Average, 1.0, 1.0, current("hvd.broadcast (backward)"))
        if rank() != ctx.root_rank:
            out.zero_()
        return out, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor`` (same shape and dtype on every rank)."""
    current("hvd.broadcast")
    return _Broadcast.apply(tensor, check_root(root_rank, "hvd.broadcast"))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns ``tensor``."""
    world = current("hvd.broadcast_")
    _broadcast_(tensor, check_root(root_rank, "hvd.broadcast_"), world)
    return tensor
