"""What the Trainer hands back, with transformers' names and shapes: ``EvalPrediction`` (what ``compute_metrics``
receives), ``TrainOutput`` and ``PredictionOutput``; and metrics made plain JSON."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["EvalPrediction", "TrainOutput", "PredictionOutput", "plain"]


class EvalPrediction:
    """What ``compute_metrics`` receives, as Hugging Face's: every sample's predictions and labels, in dataset order,
    as numpy arrays (a tuple of them for several model outputs or several ``label_names``). It unpacks as
    ``predictions, labels = eval_pred``; ``inputs`` and ``losses`` join the unpacking when ``include_for_metrics``
    asks for them."""

    def __init__(self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None) -> None:
        self.predictions, self.label_ids, self.inputs, self.losses = predictions, label_ids, inputs, losses
        self.elements: tuple[Any, ...] = (predictions, label_ids)
        if inputs is not None:
            self.elements += (inputs,)
        if losses is not None:
            self.elements += (losses,)

    def __iter__(self) -> Any:
        return iter(self.elements)

    def __getitem__(self, index: int) -> Any:
        if index < 0 or index >= len(self.elements):
            raise IndexError("tuple index out of range")
        return self.elements[index]

    def __len__(self) -> int:
        return len(self.elements)


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


class PredictionOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float]


def plain(value: Any) -> Any:
    """A metric as JSON holds it: numpy scalars and 0-d tensors as Python numbers (HF's denumpify_detensorize)."""
    if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0:
        return value.item()
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    return value
