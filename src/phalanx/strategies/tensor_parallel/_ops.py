"""The conjugate autograd ops of Megatron-style tensor parallelism, on c10d through the collective log.

Each op is a pair: what the forward does over the tp group, and its adjoint in the backward.

| op                    | forward                               | backward                               |
|-----------------------|---------------------------------------|----------------------------------------|
| ``copy_to_tp``        | identity                              | all-reduce                             |
| ``reduce_from_tp``    | all-reduce                            | identity                               |
| ``gather_last``       | all-gather along the last dim         | this rank's chunk of the last dim      |
| ``split_last``        | this rank's chunk of the last dim     | all-gather along the last dim          |
| ``gather_seq``        | all-gather along the sequence         | reduce-scatter along the sequence      |
| ``reduce_scatter_seq``| reduce-scatter along the sequence     | all-gather along the sequence          |
| ``split_seq``         | this rank's chunk of the sequence     | all-gather along the sequence          |

The sequence dim is the one before the hidden dim: dim 1 of a batch-first ``(batch, seq, hidden)`` activation, dim 0
of a ``(seq, hidden)`` one (``seq_dim``). A group of one rank makes every op the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.collective_log import watched

__all__ = [
    "SequenceLengthError",
    "defer_grad_sums",
    "copy_to_tp",
    "gather_last",
    "gather_seq",
    "reduce_from_tp",
    "reduce_scatter_seq",
    "seq_dim",
    "split_last",
    "split_seq",
]

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class SequenceLengthError(ValueError):
    """Sequence parallelism splits the sequence into equal chunks, one per tp rank: the length must divide."""


def seq_dim(t: torch.Tensor) -> int:
    """The sequence dim of an activation: the one before the hidden (last) dim."""
    return max(t.dim() - 2, 0)


def _size(group: Any) -> int:
    return int(dist.get_world_size(group))


def _all_reduce(t: torch.Tensor, group: Any, label: str) -> torch.Tensor:
    t = t.contiguous()
    watched(dist.all_reduce, t, group=group, label=label)
    return t


def _all_gather(t: torch.Tensor, dim: int, group: Any, label: str) -> torch.Tensor:
    n = _size(group)
    moved = t.movedim(dim, 0).contiguous()
    out = moved.new_empty((n * moved.shape[0], *moved.shape[1:]))
    watched(_ALL_GATHER, out, moved, group=group, label=label)
    return out.movedim(0, dim)


def _reduce_scatter(t: torch.Tensor, dim: int, group: Any, label: str) -> torch.Tensor:
    n = _size(group)
    _check_divides(t, dim, n)
    moved = t.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // n, *moved.shape[1:]))
    watched(_REDUCE_SCATTER, out, moved, group=group, label=label)
    return out.movedim(0, dim)


def _chunk(t: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    n = _size(group)
    return t.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _check_divides(t: torch.Tensor, dim: int, n: int) -> None:
    if t.shape[dim] % n:
        raise SequenceLengthError(
            f"sequence parallelism splits the sequence (dim {dim} of shape {tuple(t.shape)}) over {n} tp ranks: "
            f"{t.shape[dim]} is not a multiple of {n}; pad the sequence to "
            f"{-(-t.shape[dim] // n) * n} tokens, or set sequence_parallel=False"
        )


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group, "tp: input gradient"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x.clone(), group, "tp: partial sums")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, x.dim() - 1, group, "tp: gather output")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _chunk(grad, grad.dim() - 1, ctx.group), None


class _SplitLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        if x.shape[-1] % _size(group):
            raise ValueError(
                f"cannot split the last dim of shape {tuple(x.shape)} over {_size(group)} tp ranks: "
                f"{x.shape[-1]} is not a multiple of {_size(group)}"
            )
        return _chunk(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, grad.dim() - 1, ctx.group, "tp: gather input gradient"), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group, "sp: gather sequence")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group, "sp: reduce-scatter gradient"), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group, "sp: reduce-scatter sequence")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group, "sp: gather gradient"), None, None


class _SplitSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        _check_divides(x, dim, _size(group))
        return _chunk(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group, "sp: gather gradient"), None, None


def _trivial(group: Any) -> bool:
    return _size(group) == 1


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward, all-reduce backward: the input of a split region (its gradient is a partial sum)."""
    if _trivial(group) or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    out: torch.Tensor = _CopyToTP.apply(x, group)
    return out


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce forward, identity backward: the partial sums that leave a split region."""
    if _trivial(group):
        return x
    out: torch.Tensor = _ReduceFromTP.apply(x, group)
    return out


def gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather along the last dim forward, this rank's chunk backward."""
    if _trivial(group):
        return x
    out: torch.Tensor = _GatherLast.apply(x, group)
    return out


def split_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's chunk of the last dim forward, all-gather backward."""
    if _trivial(group):
        return x
    out: torch.Tensor = _SplitLast.apply(x, group)
    return out


def gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather along the sequence forward, reduce-scatter backward (the input of a column-parallel layer)."""
    if _trivial(group):
        return x
    out: torch.Tensor = _GatherSeq.apply(x, group, seq_dim(x))
    return out


def reduce_scatter_seq(x: torch.Tensor, group: Any, dim: int | None = None) -> torch.Tensor:
    """Reduce-scatter along the sequence forward, all-gather backward (the output of a row-parallel layer)."""
    if _trivial(group):
        return x
    out: torch.Tensor = _ReduceScatterSeq.apply(x, group, seq_dim(x) if dim is None else dim)
    return out


def split_seq(x: torch.Tensor, group: Any, dim: int | None = None) -> torch.Tensor:
    """This rank's chunk of the sequence forward, all-gather backward."""
    if _trivial(group):
        return x
    d = seq_dim(x) if dim is None else dim
    if not x.is_floating_point():  # token ids: no gradient to carry
        _check_divides(x, d, _size(group))
        return _chunk(x, d, group)
    out: torch.Tensor = _SplitSeq.apply(x, group, d)
    return out


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group, "tp: replicated parameter gradient"), None


_DEFERRED: dict[int, set[int]] = {}  # id of a tp group -> ids of the parameters whose gradient sums wait


class _MarkGrad(torch.autograd.Function):
    """Identity both ways; the backward notes that the parameter got a gradient whose tp sum is now due."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, pending: set[int], key: int) -> torch.Tensor:
        ctx.pending, ctx.key = pending, key
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.pending.add(ctx.key)
        return grad, None, None


def defer_grad_sums(group: Any) -> set[int]:
    """From now on :func:`sum_grad` over ``group`` communicates nothing in the backward: the backward adds the
    parameter's id to the returned set, and the caller sums those parameters' gradients over ``group`` itself once
    they are complete, then empties the set (the Engine does it in one coalesced all-reduce per step, after the
    data-parallel reduction; both are sums, so the order does not matter). Only gradients that arrived since the
    last sum are summed: a forward without a backward, or a second model's backward, never sums one twice."""
    return _DEFERRED.setdefault(id(group), set())


def sum_grad(p: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward, all-reduce backward, on a parameter: the gradient of a replicated parameter whose uses on
    this rank see part of the data (a sequence shard, a subset of heads) is summed over the ranks that share it.
    Over a group given to :func:`defer_grad_sums`, the sum is left to whoever deferred it."""
    if group is None or _trivial(group) or not (torch.is_grad_enabled() and p.requires_grad):
        return p
    deferred = _DEFERRED.get(id(group))
    if deferred is not None:
        marked: torch.Tensor = _MarkGrad.apply(p, deferred, id(p))
        return marked
    out: torch.Tensor = _SumGrad.apply(p, group)
    return out
