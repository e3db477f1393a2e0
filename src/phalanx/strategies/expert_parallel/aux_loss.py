"""The router's load-balancing loss over the whole batch of every data-parallel rank, as an option.

A mixture-of-experts model adds ``coef * E * sum_i f_i * P_i`` to its loss (Switch Transformer, eqs. 4-6;
transformers' ``load_balancing_loss_func``): ``f_i`` is the share of (token, expert) assignments that go to expert
i and ``P_i`` the mean router probability of expert i, over the tokens the model saw. Under data parallelism each
rank sees its own tokens, so by default the loss is a per-rank statistic, as Megatron's ``aux_loss`` is: each
rank's is a function of its micro-batch alone, and its gradient is averaged with the others'.

With ``moe_aux_loss="global"`` (Megatron's ``global_aux_loss``), ``f`` and ``P`` are counted over the tokens of every
rank of the group (the data-parallel ranks, and the context-parallel ones, whose tokens differ): the assignment
counts, probability sums and token counts are summed by one all-reduce per loss. The probability sums carry the
gradient; the all-reduce's backward sums the upstream gradient over the ranks, so that after the data-parallel
average every rank's router gets the gradient of the one global loss. Every rank then reports the same aux loss,
equal to one process's on the whole batch.

A transformers model computes the loss with its modeling module's ``load_balancing_loss_func``:
:func:`use_global_aux_loss` replaces that function in the module by one that computes the global loss while a model
that asked for it runs its forward (its group is set for the call), and the model's own otherwise, so that other
models of that module in the process keep theirs.
"""

from __future__ import annotations

import contextvars
import functools
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from phalanx.runtime.collective_log import watched

__all__ = ["global_load_balancing_loss", "has_aux_loss", "use_global_aux_loss"]


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward; all-reduce (sum) of the gradient backward: every rank's loss depends on every rank's
    sums, so each rank's part gets the gradient of all of them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        watched(dist.all_reduce, out, group=group, label="moe: global aux loss sums")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        watched(dist.all_reduce, out, group=ctx.group, label="moe: global aux loss sums (backward)")
        return out, None


def global_load_balancing_loss(
    gate_logits: Any,
    num_experts: int | None = None,
    top_k: int = 2,
    attention_mask: torch.Tensor | None = None,
    *,
    group: Any = None,
) -> torch.Tensor | int:
    """transformers' ``load_balancing_loss_func`` with its counts summed over ``group``'s ranks (see the module's
    docstring); the same arguments and result, as one process on every rank's tokens would compute it."""
    if gate_logits is None or not isinstance(gate_logits, tuple) or num_experts is None:
        return 0
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in gate_logits:
        weights = F.softmax(logits.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        keep = torch.ones(weights.shape[0], device=device) if mask is None else mask
        counts = counts.scatter_add(0, chosen.reshape(-1), keep.repeat_interleave(top_k))
        probs = probs + (weights.float() * keep[:, None]).sum(0)
        rows = rows + keep.sum()
    with torch.no_grad():
        counted = torch.cat([counts, rows[None]])
        watched(dist.all_reduce, counted, group=group, label="moe: global aux loss counts")
    probs = _SumOverRanks.apply(probs, group)
    total = counted[-1]
    return torch.sum((counted[:-1] / total) * (probs / total)) * num_experts


def has_aux_loss(model: nn.Module) -> bool:
    """Whether ``model``'s modeling module has transformers' ``load_balancing_loss_func`` (a transformers MoE)."""
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None) is not None


_GROUP: contextvars.ContextVar[tuple[Any] | None] = contextvars.ContextVar("phalanx_global_aux", default=None)


def use_global_aux_loss(model: nn.Module, group: Any) -> bool:
    """Make ``model`` compute its load-balancing loss over ``group``'s ranks; False when the model has no transformers
    ``load_balancing_loss_func`` (it is not a transformers MoE model)."""
    module = sys.modules.get(type(model).__module__)
    current = getattr(module, "load_balancing_loss_func", None)
    if module is None or current is None:
        return False
    if not getattr(current, "_phalanx_global", False):
        original = current

        @functools.wraps(original)
        def load_balancing_loss_func(
            gate_logits: Any, num_experts: Any = None, top_k: int = 2, attention_mask: Any = None
        ) -> Any:
            chosen = _GROUP.get()
            if chosen is None:  # a model that did not ask for the global loss
                return original(gate_logits, num_experts, top_k, attention_mask)
            return global_load_balancing_loss(gate_logits, num_experts, top_k, attention_mask, group=chosen[0])

        load_balancing_loss_func._phalanx_global = True  # type: ignore[attr-defined]
        module.load_balancing_loss_func = load_balancing_loss_func  # type: ignore[attr-defined]
    forward = model.forward

    @functools.wraps(forward)
    def forward_with_group(*args: Any, **kwargs: Any) -> Any:
        token = _GROUP.set((group,))
        try:
            return forward(*args, **kwargs)
        finally:
            _GROUP.reset(token)

    model.forward = forward_with_group  # type: ignore[method-assign]
    return True
