"""How the Trainer counts a micro-batch's loss: the items (labels that are not -100, shifted for a causal LM) that
normalise the whole window over every rank, and a mean loss turned into the sum over those items. The Trainer's
``compute_loss`` and ``training_step`` (which may be overridden, as in Hugging Face's Trainer) use them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["IGNORE_INDEX", "items_of", "as_sum", "LabelSmoother"]

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
