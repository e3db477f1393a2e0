"""The tensor-parallel layers, made in place from the user's modules.

A planned module keeps its object, its parameter names and its attributes: its class is swapped for a subclass that
adds the tensor-parallel forward (``_ColwiseLinear`` over ``nn.Linear``, ``_Forked`` over an attention module), so
``q_proj.weight`` stays ``q_proj.weight``, ``isinstance(m, nn.Linear)`` still holds and the state dict keys do not
change. The parameters themselves are replaced by this rank's pieces (``plan.py`` does that).

Each layer reads its settings from attributes set by ``plan.py``: ``_tp_group`` (the tp process group), ``_tp_sp``
(sequence parallelism), ``_tp_inputs`` (the cache that lets q, k and v share one gather of their common input).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._ops import (
    copy_to_tp,
    gather_last,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
    split_last,
    split_seq,
    sum_grad,
)
from .rng import TPRngTracker

__all__ = ["InputCache", "swap_class"]

_CLASSES: dict[tuple[type, type], type] = {}


def swap_class(module: nn.Module, mixin: type) -> None:
    """Give ``module`` the class ``mixin + type(module)`` (one class per pair, made once)."""
    base = type(module)
    cls = _CLASSES.get((mixin, base))
    if cls is None:
        cls = _CLASSES[(mixin, base)] = type(f"{mixin.__name__.lstrip('_')}{base.__name__}", (mixin, base), {})
    module.__class__ = cls


class InputCache:
    """The last input of the split region and what entering the region made of it (a gather along the sequence, or
    the identity whose backward all-reduces): q, k and v, or gate and up, take the same tensor, so they share one
    collective forward and one backward. Cleared after each forward of the planned model."""

    def __init__(self) -> None:
        self.key: tuple[torch.Tensor, int, bool, bool] | None = None
        self.value: torch.Tensor | None = None

    def enter(self, x: torch.Tensor, group: Any, sp: bool) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        key = self.key
        if key is not None and key[0] is x and key[1] == x._version and key[2] == grad and key[3] == sp:
            assert self.value is not None
            return self.value
        out = gather_seq(x, group) if sp else copy_to_tp(x, group)
        self.key, self.value = (x, x._version, grad, sp), out
        return out

    def clear(self) -> None:
        self.key = self.value = None


def _enter(module: Any, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = module._tp_inputs.enter(x, module._tp_group, module._tp_sp)
    return out


def _leave(module: Any, y: torch.Tensor) -> torch.Tensor:
    return reduce_scatter_seq(y, module._tp_group) if module._tp_sp else reduce_from_tp(y, module._tp_group)


class _TPLayer(nn.Module):
    """The attributes every tensor-parallel layer reads (set by plan.py)."""

    _tp_group: Any
    _tp_sp: bool
    _tp_inputs: InputCache


class _ColwiseLinear(_TPLayer, nn.Linear):
    """Weight and bias are this rank's rows of the out dim. ``_tp_local``: no collective on the input (4.5x
    ``local_colwise``); ``_tp_gather_output``: all-gather the output features; ``_tp_kv_group``: the ranks that hold
    the same replicated kv heads, over which the weight's gradient is summed."""

    _tp_local: bool
    _tp_gather_output: bool
    _tp_kv_group: Any

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input if self._tp_local else _enter(self, input)
        weight: torch.Tensor = self.weight
        bias: torch.Tensor | None = self.bias
        if self._tp_kv_group is not None:
            weight = sum_grad(weight, self._tp_kv_group)
            bias = sum_grad(bias, self._tp_kv_group) if bias is not None else None
        y = F.linear(x, weight, bias)
        return gather_last(y, self._tp_group) if self._tp_gather_output else y


class _RowwiseLinear(_TPLayer, nn.Linear):
    """Weight is this rank's columns of the in dim; the bias (replicated) is added once, after the reduction.
    ``_tp_split_input``: the input is replicated, take this rank's features first; ``_tp_local``: no reduction
    (4.5x ``local_rowwise``: an enclosing 'gather' module reduces, so only tp rank 0 adds the bias)."""

    _tp_local: bool
    _tp_split_input: bool

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input
        if self._tp_split_input:
            x = split_last(x, self._tp_group)
        y = F.linear(x, self.weight)
        if self.bias is None:
            return y if self._tp_local else _leave(self, y)
        if self._tp_local:
            on_first = 1.0 if torch.distributed.get_rank(self._tp_group) == 0 else 0.0
            return y + sum_grad(self.bias, self._tp_group) * on_first
        y = _leave(self, y)
        return y + (sum_grad(self.bias, self._tp_group) if self._tp_sp else self.bias)


class _VocabEmbedding(_TPLayer, nn.Embedding):
    """Rows ``_tp_start ... _tp_stop - 1`` of the vocabulary; other ids look up zeros, and the ranks' partial rows
    are all-reduced (reduce-scattered along the sequence under sequence parallelism)."""

    _tp_start: int
    _tp_stop: int
    _tp_padding: int | None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        outside = (input < self._tp_start) | (input >= self._tp_stop)
        local = (input - self._tp_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self._tp_padding)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return _leave(self, out)


class _ColumnEmbedding(_TPLayer, nn.Embedding):
    """Columns of the hidden dim; the looked-up pieces are all-gathered (and split along the sequence under sequence
    parallelism)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = gather_last(F.embedding(input, self.weight, self.padding_idx), self._tp_group)
        return split_seq(out, self._tp_group) if self._tp_sp else out


class _SequenceEmbedding(_TPLayer, nn.Embedding):
    """A replicated embedding of positions: under sequence parallelism each rank looks up its chunk of the ids
    (split along their last dim), and the weight's gradient is summed over tp."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._tp_sp:
            return super().forward(input)
        ids = split_seq(input, self._tp_group, dim=input.dim() - 1)
        return F.embedding(ids, sum_grad(self.weight, self._tp_group), self.padding_idx)


class _Forked(_TPLayer):
    """The module computes on sharded activations: its forward draws from this tp rank's RNG stream."""

    _tp_tracker: TPRngTracker

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._tp_tracker.fork():
            return super().forward(*args, **kwargs)


class _GradSynced(_TPLayer):
    """The module's own replicated parameters see part of the data on each rank: during its forward they are
    replaced by views whose backward sums the gradient over ``_tp_sync_group``."""

    _tp_synced: tuple[str, ...]
    _tp_sync_group: Any

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params: dict[str, Any] = self._parameters
        saved = {name: params[name] for name in self._tp_synced}
        for name, p in saved.items():
            params[name] = sum_grad(p, self._tp_sync_group)
        try:
            return super().forward(*args, **kwargs)
        finally:
            params.update(saved)


def _first(out: Any, fn: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (fn(out[0]), *out[1:])
    raise TypeError(f"a tensor-parallel reduction expects a tensor (or a tuple starting with one), got {type(out)}")


class _AllReduceOutput(_TPLayer):
    """transformers' ``all_reduce``: the module's output is a partial sum; all-reduce it (reduce-scatter it along
    the sequence under sequence parallelism)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _first(super().forward(*args, **kwargs), lambda y: _leave(self, y))


class _GatherRegion(_TPLayer):
    """transformers 4.5x ``gather`` around ``local_*`` layers: the input enters the split region (its gradient
    all-reduced, or gathered along the sequence) and the output leaves it (all-reduced or reduce-scattered)."""

    def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        x = _enter(self, input)
        return _first(super().forward(x, *args, **kwargs), lambda y: _leave(self, y))


class _MlaKvAProj(_TPLayer):
    """transformers' ``mla_kv_a_proj``: the last ``_tp_rope`` features of the output go to attention on this rank's
    heads directly, so their gradient is a partial sum: all-reduced in the backward."""

    _tp_rope: int

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        rope = self._tp_rope
        passed, rotary = out.split([out.shape[-1] - rope, rope], dim=-1)
        return torch.cat([passed, copy_to_tp(rotary, self._tp_group)], dim=-1)


class _MoeTPExperts(_TPLayer):
    """An experts module whose every expert holds this rank's piece of each weight (``moe_tp_experts``): the tokens
    and their routing weights enter the split region (identity forward, gradients summed over tp backward, so the
    router's gradient is whole), and the mixture of partial expert outputs is all-reduced."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        x = copy_to_tp(hidden_states, self._tp_group)
        w = copy_to_tp(top_k_weights, self._tp_group)
        return reduce_from_tp(super().forward(x, top_k_index, w), self._tp_group)


MIXINS = {
    "moe_experts": _MoeTPExperts,
    "colwise": _ColwiseLinear,
    "rowwise": _RowwiseLinear,
    "vocab": _VocabEmbedding,
    "column_embedding": _ColumnEmbedding,
    "sequence_embedding": _SequenceEmbedding,
    "forked": _Forked,
    "grad_synced": _GradSynced,
    "all_reduce": _AllReduceOutput,
    "gather": _GatherRegion,
    "mla": _MlaKvAProj,
}
