"""Cross-entropy on logits split over the vocabulary, without gathering them (Megatron's vocab-parallel loss).

    loss = vocab_parallel_cross_entropy(logits_local, target, tp_group)
    with loss_parallel():                     # or F.cross_entropy / nn.CrossEntropyLoss, unchanged
        loss = F.cross_entropy(logits_local.view(-1, logits_local.size(-1)), target.view(-1))

Each rank holds the logits of vocabulary entries ``tp_rank * V/tp ... (tp_rank + 1) * V/tp - 1``. The max is
all-reduced (MAX), then the sum of exponentials, the target's logit and, with label smoothing, the sum of the
logits, in one all-reduce; the loss is the same on every rank and each rank's logits get their own gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.runtime.collective_log import watched

from ._ops import reduce_from_tp
from .plan import last_planned

__all__ = ["loss_parallel", "vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    target: torch.Tensor,
    group: Any,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy`` over the full vocabulary, from this rank's vocabulary shard ``logits_local`` (the last dim)
    and class-index ``target`` (the shape of ``logits_local`` without its last dim). A collective over ``group``."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got {reduction!r}")
    if target.is_floating_point():
        raise ValueError("vocab_parallel_cross_entropy takes class indices as target, not probabilities")
    if tuple(target.shape) != tuple(logits_local.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match the logits' {tuple(logits_local.shape)} without "
            "their last (vocabulary) dim"
        )
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    v_local = logits_local.shape[-1]
    vocab = v_local * tp
    start = rank * v_local
    logits = logits_local.float()

    top = logits.detach().max(dim=-1, keepdim=True).values
    if tp > 1:
        watched(dist.all_reduce, top, op=dist.ReduceOp.MAX, group=group, label="tp loss: max logit")
    shifted = logits - top

    valid = target != ignore_index
    inside = (target >= start) & (target < start + v_local) & valid
    local_target = (target - start).masked_fill(~inside, 0)
    picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * inside

    parts = [shifted.exp().sum(dim=-1), picked]
    if label_smoothing > 0.0:
        parts.append(shifted.sum(dim=-1))
    summed = reduce_from_tp(torch.stack(parts), group)
    log_z = summed[0].log()
    nll = log_z - summed[1]
    if label_smoothing > 0.0:
        smooth = log_z - summed[2] / vocab  # -mean over the vocabulary of log p
        loss = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    else:
        loss = nll
    loss = loss * valid
    if reduction == "none":
        return loss.to(logits_local.dtype)
    total = loss.sum()
    if reduction == "sum":
        return total.to(logits_local.dtype)
    return (total / valid.sum()).to(logits_local.dtype)


_ORIGINAL = F.cross_entropy


def _parallel_cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    report = last_planned()
    if report is None:
        raise RuntimeError("loss_parallel(): no model was planned with apply_tp_plan in this process")
    if report.vocab_size is None:
        raise RuntimeError(
            "loss_parallel(): the last planned model has no head split on the vocabulary (a 'colwise' lm_head, or "
            "one tied to an 'embedding_rowwise' embedding); its logits are whole: call F.cross_entropy outside it"
        )
    if weight is not None or size_average is not None or reduce is not None:
        raise ValueError("loss_parallel(): class weights and the legacy size_average/reduce are not supported")
    logits = input.movedim(1, -1) if input.dim() > 2 else input
    if input.dim() == 1:
        logits, target = input.unsqueeze(0), target.unsqueeze(0)
    local = report.vocab_size // report.tp_size
    if logits.shape[-1] != local:
        raise ValueError(
            f"loss_parallel(): the logits' class dim has {logits.shape[-1]} entries; this rank's vocabulary shard "
            f"has {local} (vocabulary {report.vocab_size} over tp={report.tp_size})"
        )
    out = vocab_parallel_cross_entropy(logits, target, report.group, ignore_index, reduction, label_smoothing)
    return out.squeeze(0) if input.dim() == 1 and reduction == "none" else out


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Inside, ``F.cross_entropy`` (and so ``nn.CrossEntropyLoss``) takes logits whose class dim is this rank's
    vocabulary shard of the last planned model and computes the full-vocabulary loss over its tp group. Only the
    ``torch.nn.functional.cross_entropy`` attribute is replaced: a name imported before (``from
    torch.nn.functional import cross_entropy``) still calls the original."""
    previous = F.cross_entropy
    F.cross_entropy = _parallel_cross_entropy  # type: ignore[assignment]
    try:
        yield
    finally:
        F.cross_entropy = previous
