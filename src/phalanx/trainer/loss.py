"""How the Trainer counts a micro-batch's loss: the items (labels that are not -100, shifted for a causal LM) that
normalise the whole window over every rank, and a mean loss turned into the sum over those items. The Trainer's
``compute_loss`` and ``training_step`` (which may be overridden, as in Hugging Face's Trainer) use them.

Under context parallelism (cp_size or sp_size) the prepared loader hands each rank its chunk of every sequence, with
``shift_labels``: the labels shifted over the whole sequence before the cut, since the target of a chunk's last token
sits on another rank. Those are counted as they are (:func:`shift_labels_of`), the model's loss and the label
smoother read them, and evaluation puts each batch's loss and outputs back together over the cp ranks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import all_reduce
from phalanx.strategies.context_parallel.layout import positions
from phalanx.trainer.nested import nested_map

__all__ = [
    "IGNORE_INDEX", "items_of", "as_sum", "LabelSmoother", "shift_labels_of", "check_cut_loss", "whole_prediction",
]  # fmt: skip

IGNORE_INDEX = -100


def items_of(labels: Any, causal: bool) -> torch.Tensor | None:
    """Labels that count in the loss: not -100, one position shifted for a causal LM (its loss predicts the next).
    A 0-d tensor on the labels' device, so that counting costs no host sync."""
    if not isinstance(labels, torch.Tensor):
        return None
    if labels.is_floating_point():
        return torch.tensor(labels.numel(), device=labels.device)
    if causal and labels.dim() >= 2:
        labels = labels[..., 1:]
    return (labels != IGNORE_INDEX).sum()


def shift_labels_of(inputs: Any) -> torch.Tensor | None:
    """The batch's ``shift_labels`` (labels already shifted over the whole sequence), if it has them."""
    found = inputs.get("shift_labels") if isinstance(inputs, Mapping) else None
    return found if isinstance(found, torch.Tensor) else None


def check_cut_loss(model: Any, forward_params: set[str] | None, loss_func: Callable | None, setting: str) -> None:
    """Refuse, under context parallelism, a loss that would shift this rank's chunk of the labels itself (and so
    lose the targets at the chunk's bounds, which sit on other ranks): a model whose forward takes no
    ``shift_labels``, or a ``compute_loss_func`` without a ``shift_labels`` keyword."""
    if loss_func is not None:
        try:
            takes = "shift_labels" in inspect.signature(loss_func).parameters
        except (TypeError, ValueError):
            takes = False
        if not takes:
            raise ValueError(
                f"{setting}: compute_loss_func(outputs, labels, num_items_in_batch) would get this rank's chunk of "
                "the labels, whose targets at the chunk's bounds sit on other ranks. Give it a shift_labels keyword: "
                "phalanx passes the labels shifted over the whole sequence, aligned with the logits (no shift "
                "inside), as transformers' ForCausalLMLoss(logits, labels, vocab_size, shift_labels=...) takes them"
            )
    elif forward_params is not None and "shift_labels" not in forward_params:
        raise ValueError(
            f"{setting}: {type(model).__name__}.forward takes no shift_labels, so its loss would shift this rank's "
            "chunk of the labels and lose the targets at the chunk's bounds (they sit on other ranks). Take "
            "shift_labels in forward (the labels shifted over the whole sequence, aligned with the logits: no shift), "
            "or pass compute_loss_func with a shift_labels keyword"
        )


def whole_prediction(cp: Any, loss: Any, n: torch.Tensor | None, outputs: Any, labels: Any) -> tuple[Any, Any, Any]:
    """One evaluation batch's ``(loss, outputs, labels)`` over the whole sequence, from the cp ranks' chunks: the
    loss is the mean over every rank's items (each rank's mean without items), and every tensor laid out along the
    sequence (dim 1 of this rank's length) is gathered from the ranks and put back in order of position."""
    if loss is not None:
        if n is None:
            loss = loss.detach().float().clone()
            all_reduce(loss, "mean", group=cp.group)
        else:
            total = torch.stack([as_sum(loss.detach().double(), n), n.double()])
            all_reduce(total, "sum", group=cp.group)
            loss = (total[0] / total[1].clamp(min=1)).to(loss.dtype)
    local = cp.seq_len // cp.size

    def whole(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2 or t.shape[1] != local:
            return t
        parts = [torch.empty_like(t) for _ in range(cp.size)]
        watched(dist.all_gather, parts, t.contiguous(), group=cp.group)
        out = t.new_empty((t.shape[0], cp.seq_len, *t.shape[2:]))
        for rank, part in enumerate(parts):
            out[:, positions(cp.kind, cp.size, rank, cp.seq_len, t.device)] = part
        return out

    return loss, nested_map(outputs, whole), nested_map(labels, whole)


def as_sum(mean: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """A micro-batch's mean loss times its item count. With no real label the mean is 0/0 (NaN): the sum is then 0,
    and its backward still reaches every parameter (with zero gradients), so the ranks' reductions stay in step and
    the non-finite guard sees no NaN that adds nothing."""
    return torch.where(n > 0, mean, torch.zeros_like(mean)) * n


class LabelSmoother:
    """transformers' label smoothing over a model's logits: ``(1 - epsilon)`` of the negative log-likelihood plus
    ``epsilon`` of the mean over the classes, both over the labels that are not -100 (``num_items_in_batch`` of them,
    when given)."""

    def __init__(self, epsilon: float = 0.1, ignore_index: int = IGNORE_INDEX) -> None:
        self.epsilon, self.ignore_index = epsilon, ignore_index

    def __call__(
        self, model_output: Any, labels: torch.Tensor, shift_labels: bool = False, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        logits = model_output["logits"] if isinstance(model_output, dict) else model_output[0]
        if shift_labels:  # a causal LM's logits at position i predict the label at i + 1
            logits, labels = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
        log_probs = -torch.nn.functional.log_softmax(logits, dim=-1)
        if labels.dim() == log_probs.dim() - 1:
            labels = labels.unsqueeze(-1)
        padding = labels.eq(self.ignore_index)
        nll = log_probs.gather(dim=-1, index=torch.clamp(labels, min=0))
        smoothed = log_probs.sum(dim=-1, keepdim=True, dtype=torch.float32)
        nll.masked_fill_(padding, 0.0)
        smoothed.masked_fill_(padding, 0.0)
        if num_items_in_batch is None:
            count: Any = padding.numel() - padding.long().sum()
        else:
            count = num_items_in_batch.to(nll.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        return (1 - self.epsilon) * (nll.sum() / count) + self.epsilon * (
            smoothed.sum() / (count * log_probs.shape[-1])
        )
