"""transformers' conventions, which the Trainer reads models and arguments by: where a model's loss is in its
outputs, which batch keys hold labels, which parameters weight decay spares, and which optimizer ``optim`` names."""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "decay_parameter_names",
    "find_labels",
    "loss_of",
    "get_num_trainable_parameters",
    "get_learning_rates",
    "get_optimizer_group",
]


def decay_parameter_names(model: nn.Module) -> list[str]:
    """transformers' ``get_parameter_names(model, [nn.LayerNorm], forbidden name patterns)``: the names of the
    parameters outside every ``LayerNorm`` whose lower-cased names match no pattern."""
    patterns = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]

    def names(module: nn.Module) -> list[str]:
        out = []
        for name, child in module.named_children():
            out += [
                f"{name}.{n}"
                for n in names(child)
                if not isinstance(child, nn.LayerNorm) and not any(p.search(f"{name}.{n}".lower()) for p in patterns)
            ]
        return out + [k for k in module._parameters if not any(p.search(k.lower()) for p in patterns)]

    return names(model)


def find_labels(model: nn.Module) -> list[str]:
    """The batch keys that hold labels when ``label_names`` is not given, as transformers finds them: the forward's
    parameters whose names contain "label" (a question-answering model's ``start_positions`` and ``end_positions``
    too); ``["labels"]`` for a module whose forward names none."""
    params = inspect.signature(model.forward).parameters
    qa = "QuestionAnswering" in type(model).__name__
    found = [p for p in params if "label" in p or (qa and p in ("start_positions", "end_positions"))]
    return found or ["labels"]


def loss_of(outputs: Any) -> torch.Tensor:
    """The loss a model returned, as HF's Trainer reads it: a dict's (or ``ModelOutput``'s) ``loss``, a tuple's first
    element."""
    if isinstance(outputs, Mapping):
        if outputs.get("loss") is None:
            raise ValueError(
                f"the model returned no loss, only {', '.join(map(str, outputs.keys()))}: put the labels in the batch "
                "(a 'labels' key, or label_names) for a model that computes its loss, or pass "
                "compute_loss_func=lambda outputs, labels, num_items_in_batch: ..."
            )
        return outputs["loss"]
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        if outputs[0].dim() != 0:
            raise ValueError(
                f"the model returned a tuple whose first element has shape {tuple(outputs[0].shape)}: a tuple output "
                "must start with the loss (a scalar), as in transformers; return (loss, logits, ...), or pass "
                "compute_loss_func=lambda outputs, labels, num_items_in_batch: ..."
            )
        return outputs[0]
    if getattr(outputs, "loss", None) is not None:
        return outputs.loss
    raise ValueError(
        f"the model returned no loss ({type(outputs).__name__}): return a dict or ModelOutput with 'loss', or a "
        "tuple that starts with it, or pass compute_loss_func=lambda outputs, labels, num_items_in_batch: ..."
    )


# Trainer methods, as transformers keeps them beside its Trainer (trainer_pt_utils) and binds them to it.
def get_num_trainable_parameters(self: Any) -> int:
    """The elements of the model's trainable parameters (counted before any strategy shards them)."""
    return self._trainable


def get_learning_rates(self: Any) -> list[float]:
    """The learning rate of each of the optimizer's parameter groups."""
    if self.optimizer is None:
        raise ValueError("the Trainer has no optimizer yet: call train() (or create_optimizer()) first")
    return [group["lr"] for group in self.optimizer.param_groups]


def get_optimizer_group(self: Any, param: Any = None) -> Any:
    """The optimizer's parameter group that holds ``param``, or every group's parameters. Under the zero strategies
    the groups hold each rank's flat slices, not the model's parameters."""
    if self.optimizer is None:
        raise ValueError("the Trainer has no optimizer yet: call train() (or create_optimizer()) first")
    if param is not None:
        for group in self.optimizer.param_groups:
            if any(param is p for p in group["params"]):
                return group
    return [group["params"] for group in self.optimizer.param_groups]
