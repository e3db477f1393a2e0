"""Which optimizers the zero strategies can shard: only those whose update of each element depends on that element
alone, since each rank steps its slice of a flat buffer on its own."""

from __future__ import annotations

import torch

__all__ = ["check_optimizer"]

# torch.optim classes whose update of each element depends only on that element's gradient and state.
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam", "ASGD", "Rprop"}
NOT_ELEMENTWISE = {
    "LBFGS": "runs a line search over the whole parameter vector with a closure",
    "SparseAdam": "needs sparse gradients",
    "Adafactor": "keeps factored row and column statistics of each whole tensor",
    "Muon": "orthogonalises each whole weight matrix",
    "Lamb": "scales each tensor's update by a trust ratio of whole-tensor norms",
    "LAMB": "scales each tensor's update by a trust ratio of whole-tensor norms",
    "Lars": "scales each tensor's update by a trust ratio of whole-tensor norms",
    "LARS": "scales each tensor's update by a trust ratio of whole-tensor norms",
    "Shampoo": "preconditions each whole tensor with matrix statistics",
}


def check_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool, whole: str = "strategy='ddp'") -> None:
    """Refuse optimizers whose update is not elementwise: a shard's update would silently differ. ``whole`` is the
    setting that keeps the optimizer state whole, for the error."""
    cls = type(optimizer)
    name = cls.__name__
    fix = f"use {whole} for {name}"
    if name in NOT_ELEMENTWISE:
        raise ValueError(
            f"zero strategies cannot shard {name}: it {NOT_ELEMENTWISE[name]}, but ZeRO steps each rank's "
            f"slice of a flat buffer on its own, which is exact only for elementwise optimizers such as SGD, "
            f"Adam and AdamW ({fix})"
        )
    if cls.__module__.startswith("torch.optim") and name in ELEMENTWISE:
        return
    if not allow_untested:
        raise ValueError(
            f"zero strategies have not been checked with {cls.__module__}.{name}. ZeRO steps each rank's slice of a "
            "flat buffer on its own, which is exact only when every element's update depends on its own gradient "
            "and state alone (SGD, Adam, AdamW). If that holds for this optimizer, pass "
            f"zero_allow_untested_optimizer=True; if it uses per-tensor norms or shapes, {fix}"
        )
