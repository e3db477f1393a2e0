"""Tokens to their experts' ranks and back: the all-to-all dispatch and combine of expert parallelism.

A mixture-of-experts layer routes each token to ``top_k`` of ``E`` experts. Under expert parallelism ep rank r holds
experts ``[r * E/ep, (r + 1) * E/ep)``; the experts module's forward (the model's own, called on local experts) is
wrapped so that each (token, expert) pair travels to the rank that holds the expert and its output travels back:

1. the pairs are sorted by expert (a stable sort: each expert's tokens stay in token order), and each rank tells
   every other how many pairs it sends to each of its experts (one small all-to-all);
2. one host sync reads those counts: ``all_to_all_single`` needs its split sizes on the host, as Megatron's
   dispatcher does (one per layer and step);
3. the tokens and their routing weights (one more column) go out by ``all_to_all_single`` with variable splits;
4. the receiving rank runs the model's own experts forward on them, each row with its one local expert and its
   weight, so the weight is applied exactly where and how the model applies it;
5. the outputs come back by the reverse all-to-all and are summed per token with ``index_add_``, in expert order,
   as the model's forward sums them.

Dropless by default: every pair is computed. With a capacity factor ``c``, each expert takes at most
``ceil(c * tokens * top_k / E)`` pairs from each rank (the first ones, in token order); the rest add nothing, and
are counted (``dispatch_stats(model)``) and the first drop is logged, with the fix.

Every all-to-all has its backward (the reverse exchange), and every rank of the ep group runs each one in the same
order: a rank with no tokens for anyone still takes part, with empty tensors, in the forward and in the backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from phalanx.logging import warn_once
from phalanx.runtime.collective_log import watched

__all__ = ["DispatchStats", "ExpertGroup", "dispatch_combine", "dispatch_elements", "dispatch_stats"]


@dataclass
class DispatchStats:
    """What this rank's dispatches routed and dropped, summed over layers and steps. The counts reach the host with
    the split sizes, which the all-to-alls need there anyway: no sync of their own."""

    routed: int = 0  # (token, expert) pairs computed
    dropped: int = 0  # pairs over an expert's capacity (moe_capacity_factor), which add nothing
    sent: int = 0  # pairs sent to another rank
    calls: int = 0

    def read(self) -> dict[str, int]:
        return {"routed": self.routed, "dropped": self.dropped, "sent": self.sent, "calls": self.calls}


@dataclass
class ExpertGroup:
    """One experts module's place in expert parallelism."""

    group: Any
    size: int
    rank: int
    num_experts: int  # the whole layer's
    capacity_factor: float | None = None
    stats: DispatchStats = field(default_factory=DispatchStats)
    label: str = "experts"

    @property
    def local(self) -> int:
        return self.num_experts // self.size


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with variable splits; the backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, label: str
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.label = (out_splits, in_splits), group, label
        return _exchange(x, out_splits, in_splits, group, label)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.label + " (backward)"), None, None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, label: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    watched(dist.all_to_all_single, out, x, out_splits, in_splits, group=group, label=label)
    return out


class _Join(torch.autograd.Function):
    """``y`` unchanged, made to depend on ``inputs``: when the experts computed nothing from them (no rows arrived),
    their all-to-all's backward must still run on this rank, with zero gradients, because its peers run theirs."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in inputs]
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return (grad, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes))


def dispatch_combine(
    eg: ExpertGroup,
    local_forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    params: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The experts' output for ``hidden`` ([T, H]) routed by ``top_k_index``/``top_k_weights`` ([T, k]), with the
    experts spread over ``eg``'s ranks; ``local_forward(x, index, weights)`` is the model's own experts forward on
    this rank's experts (``index`` in ``0 .. E/ep - 1``); ``params``, the experts' weights, get a zero gradient when no
    token reaches them."""
    tokens, k = top_k_index.shape
    n_exp, ep, local = eg.num_experts, eg.size, eg.local
    flat = top_k_index.reshape(-1)
    valid = (flat >= 0) & (flat < n_exp)  # some models route padding to a slot past the last expert
    key = torch.where(valid, flat, torch.full_like(flat, n_exp))
    order = torch.argsort(key, stable=True)
    # Counted by scatter_add, not bincount, which reads its max on the host (a sync on CUDA).
    counts = torch.zeros(n_exp + 1, dtype=torch.long, device=flat.device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:n_exp]
    dropped = None
    if eg.capacity_factor is not None:
        capacity = max(1, math.ceil(eg.capacity_factor * tokens * k / n_exp))
        kept = counts.clamp(max=capacity)
        dropped = (counts - kept).sum()
        # A pair past its expert's capacity moves to the end with the invalid ones (a second stable sort, no
        # boolean indexing, which would sync): the kept pairs stay first, in expert and then token order.
        starts = torch.cumsum(counts, 0) - counts
        sorted_key = key[order]
        position = torch.arange(order.numel(), device=flat.device) - starts[sorted_key.clamp(max=n_exp - 1)]
        over = (sorted_key >= n_exp) | (position >= capacity)
        order = order[torch.argsort(over.to(torch.uint8), stable=True)]
        counts = kept
    recv_counts = torch.empty_like(counts)
    watched(dist.all_to_all_single, recv_counts, counts, group=eg.group, label=f"{eg.label}: counts")
    lost = (dropped if dropped is not None else counts.new_zeros(()))[None]
    sizes = torch.cat([counts.view(ep, local).sum(1), recv_counts.view(ep, local).sum(1), lost]).tolist()  # the sync
    send_splits, recv_splits = sizes[:ep], sizes[ep : 2 * ep]
    _count(eg, send_splits, int(sizes[-1]))
    pairs = order[: sum(send_splits)]
    token_of = torch.div(pairs, k, rounding_mode="floor")
    # The tokens and their weights travel together, as one more column in the wider of their dtypes (exact both
    # ways): one all-to-all, whose backward every rank runs at the same point.
    wire = torch.promote_types(hidden.dtype, top_k_weights.dtype)
    send = torch.cat([hidden[token_of].to(wire), top_k_weights.reshape(-1)[pairs].to(wire)[:, None]], dim=1)
    got = _AllToAll.apply(send, recv_splits, send_splits, eg.group, f"{eg.label}: tokens")
    x, w = got[:, :-1].to(hidden.dtype), got[:, -1].to(top_k_weights.dtype)
    local_ids = torch.arange(local, device=flat.device).repeat(ep)
    ids = torch.repeat_interleave(local_ids, recv_counts, output_size=sum(recv_splits))
    y = local_forward(x, ids[:, None], w[:, None])
    if not sum(recv_splits) and torch.is_grad_enabled():
        # No token reached this rank's experts. Their weights still get a gradient (zeros), as the whole stacked
        # weight of one process does when any of its experts is used, so that the strategies see every expert weight
        # in every backward (an unused parameter is an error there); and the received (empty) tokens and weights
        # stay in the graph, so that their all-to-alls' backwards run here when the peers run theirs.
        trainable = [p for p in params or [] if p.requires_grad]
        if trainable:
            y = y + sum(p.reshape(-1)[:1].sum() for p in trainable) * 0.0
        if x.requires_grad or w.requires_grad:
            y = _Join.apply(y, x, w)
    back = _AllToAll.apply(y, send_splits, recv_splits, eg.group, f"{eg.label}: outputs")
    out = torch.zeros_like(hidden)
    return out.index_add(0, token_of, back.to(out.dtype))


def _count(eg: ExpertGroup, send_splits: list[int], dropped: int) -> None:
    st = eg.stats
    st.calls += 1
    st.routed += sum(send_splits)
    st.sent += sum(send_splits) - send_splits[eg.rank]
    st.dropped += dropped
    if dropped:
        warn_once(
            f"moe_capacity_factor={eg.capacity_factor:g}: {dropped} of the {dropped + sum(send_splits)} (token, "
            f"expert) pairs of this rank went over their expert's capacity in {eg.label} and were dropped (they add "
            "nothing to their tokens' outputs), and more may follow; dispatch_stats(model) counts them. Raise "
            "moe_capacity_factor, or leave it unset to compute every pair (dropless)"
        )


def dispatch_stats(model: Any) -> dict[str, int]:
    """This rank's dispatch counts over every experts module of ``model`` (summed over layers and steps): pairs
    routed, dropped by the capacity factor, sent to other ranks, and dispatch calls."""
    out = {"routed": 0, "dropped": 0, "sent": 0, "calls": 0}
    seen: set[int] = set()
    for m in model.modules():
        eg = getattr(m, "_phalanx_ep_group", None)
        if isinstance(eg, ExpertGroup) and id(eg.stats) not in seen:
            seen.add(id(eg.stats))
            for k, v in eg.stats.read().items():
                out[k] += v
    return out


def dispatch_elements(tokens: int, top_k: int, hidden: int, ep: int) -> float:
    """Elements of activations one rank sends to other ranks per direction per layer with uniform routing: each of
    its ``tokens * top_k`` pairs leaves the rank with probability ``(ep - 1) / ep``. (The dispatch adds one column,
    the routing weight, to each token it sends: ``hidden + 1`` there, ``hidden`` for the outputs that come back.)"""
    return tokens * top_k * hidden * (ep - 1) / ep
