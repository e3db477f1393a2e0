"""How the Trainer computes and counts a micro-batch's loss: the model's own loss or ``compute_loss_func``, the
items (labels that are not -100, shifted for a causal LM) that normalise the whole window over every rank, and the
logging window's sum. Mixed into :class:`phalanx.trainer.Trainer`; ``compute_loss`` and ``training_step`` may be
overridden there as in Hugging Face's Trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from phalanx.collective_log import watched
from phalanx.engine import Engine
from phalanx.trainer.arguments import TrainingArguments

__all__ = ["LossMixin", "IGNORE_INDEX", "items_of"]

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


def _as_sum(mean: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """A micro-batch's mean loss times its item count. With no real label the mean is 0/0 (NaN): the sum is then 0,
    and its backward still reaches every parameter (with zero gradients), so the ranks' reductions stay in step and
    the non-finite guard sees no NaN that adds nothing."""
    return torch.where(n > 0, mean, torch.zeros_like(mean)) * n


class LossMixin:
    """The loss of one micro-batch, its backward, and the logging window (mixed into the Trainer)."""

    args: TrainingArguments
    engine: Engine
    compute_loss_func: Callable[..., Any] | None
    _causal: bool
    _window: torch.Tensor
    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | None = None) -> Any:  # fmt: skip
        """The mean loss of one micro-batch: the model's own (``labels`` in the batch), or ``compute_loss_func(outputs,
        labels, num_items_in_batch=...)``. A ``(inputs, labels)`` batch calls ``model(inputs)``."""
        labels = self._labels(inputs)
        if isinstance(inputs, Mapping):
            outputs = model(**inputs)
        elif isinstance(inputs, (tuple, list)) and len(inputs) == 2:
            outputs = model(inputs[0])
        else:
            outputs = model(inputs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif isinstance(outputs, Mapping) and outputs.get("loss") is not None:
            loss = outputs["loss"]
        elif getattr(outputs, "loss", None) is not None:
            loss = outputs.loss
        else:
            raise ValueError(
                f"the model returned no loss ({type(outputs).__name__}): put labels in the batch (a 'labels' key) for a "
                "model that computes its loss, or pass compute_loss_func=lambda outputs, labels, num_items_in_batch: ..."
            )
        return (loss, outputs) if return_outputs else loss

    def _labels(self, inputs: Any) -> Any:
        if isinstance(inputs, Mapping):
            names = self.args.label_names or ["labels"]
            return inputs.get(names[0])
        if isinstance(inputs, (tuple, list)) and len(inputs) == 2:
            return inputs[1]
        return None

    def training_step(self, model: nn.Module, inputs: Any) -> torch.Tensor:
        """Backward of one micro-batch; returns ``[loss sum, items]`` on the device (for the logged mean)."""
        n = items_of(self._labels(inputs), self._causal)
        loss = self.compute_loss(model, inputs, num_items_in_batch=n)
        if n is None:  # no labels to count: each micro-batch's mean weighs the same
            self.engine.backward(loss)
            return torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=loss.device)])
        # The mean over this micro-batch's n items, as a sum: the engine divides by the window's items on all ranks.
        self.engine.backward(_as_sum(loss, n), items=n)
        return torch.stack([_as_sum(loss.detach(), n).double(), n.double()])

    def _stage_loss(self, model: nn.Module, inputs: Any) -> Any:
        """One micro-batch's loss under the pipeline, as (sum, items) when labels can be counted. It returns on the
        last stage only (the model call ends the others' turn), so only there does it add to the logging window:
        summed over all ranks, the window holds every data-parallel replica's items once."""
        n = items_of(self._labels(inputs), self._causal)
        loss = self.compute_loss(model, inputs, num_items_in_batch=n)
        one = torch.ones((), dtype=torch.float64, device=loss.device)
        if n is None:  # no labels to count: each micro-batch's mean weighs the same
            self._window += torch.stack([loss.detach().double(), one])
            return loss
        self._window += torch.stack([_as_sum(loss.detach(), n).double(), n.double()])
        return _as_sum(loss, n), n

    def _reduce_window(self, window: torch.Tensor) -> torch.Tensor:
        """The window summed over the data-parallel ranks; under the pipeline over every rank (only the last stages
        hold a loss, and each replica's once)."""
        if self.engine.strategy.drives_backward and dist.is_initialized():
            total = window.clone()
            watched(dist.all_reduce, total)
            return total
        return self.engine.reduce(window, "sum")
