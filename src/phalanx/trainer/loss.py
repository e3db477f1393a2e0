"""How the Trainer counts a micro-batch's loss: the items (labels that are not -100, shifted for a causal LM) that
normalise the whole window over every rank, and a mean loss turned into the sum over those items. The Trainer's
``compute_loss`` and ``training_step`` (which may be overridden, as in Hugging Face's Trainer) use them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["IGNORE_INDEX", "items_of", "as_sum"]

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
