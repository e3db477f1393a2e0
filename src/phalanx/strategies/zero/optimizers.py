"""Which optimizers the zero strategies can shard, and how.

- *Elementwise* optimizers (SGD, Adam, AdamW, ...): the update of each element depends on that element alone, so
  each rank steps its slice of a flat buffer on its own.
- *Tensor-wise* optimizers (torch's Muon and Adafactor, and any optimizer that declares ``tensorwise = True``, as a
  LAMB or LARS would): the update of each element depends on its whole tensor (an orthogonalisation, factored
  statistics, a trust ratio of norms). Each whole parameter is stepped on one owner rank (``tensorwise.py``).

The rest is refused with the reason and the fix.
"""

from __future__ import annotations

import torch

__all__ = ["check_optimizer", "is_tensorwise", "TENSORWISE_ATTRIBUTE"]

# torch.optim classes whose update of each element depends only on that element's gradient and state.
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam", "ASGD", "Rprop"}
# torch.optim classes whose update needs each whole tensor: stepped on the tensor's owner rank.
TENSORWISE = {"Muon", "Adafactor"}
TENSORWISE_ATTRIBUTE = "tensorwise"
"""An optimizer (its class, or the instance) with ``tensorwise = True`` is stepped whole tensor by whole tensor."""

_TRUST_RATIO = "scales each tensor's update by a trust ratio of whole-tensor norms"
NOT_ELEMENTWISE = {
    "LBFGS": "runs a line search over the whole parameter vector with a closure",
    "SparseAdam": "needs sparse gradients",
    "Lamb": _TRUST_RATIO,
    "LAMB": _TRUST_RATIO,
    "Lars": _TRUST_RATIO,
    "LARS": _TRUST_RATIO,
    "Shampoo": "preconditions each whole tensor with matrix statistics",
}
_PER_TENSOR = {"Lamb", "LAMB", "Lars", "LARS", "Shampoo"}  # would be exact stepped whole: say how to declare it


def is_tensorwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether each of ``optimizer``'s parameters must be stepped whole: torch's Muon and Adafactor (and their
    subclasses), or an optimizer that says so with ``tensorwise = True``. Stepping whole is exact for any optimizer
    whose update of a tensor needs no other tensor, elementwise ones included."""
    if getattr(optimizer, TENSORWISE_ATTRIBUTE, False) is True:
        return True
    torch_classes = tuple(c for c in (getattr(torch.optim, n, None) for n in sorted(TENSORWISE)) if isinstance(c, type))
    return isinstance(optimizer, torch_classes)


def check_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool, whole: str = "strategy='ddp'") -> None:
    """Refuse optimizers that neither update elementwise nor are stepped whole (:func:`is_tensorwise`): a shard's
    update would silently differ. ``whole`` is the setting that keeps the optimizer state whole, for the error."""
    if is_tensorwise(optimizer):
        return
    cls = type(optimizer)
    name = cls.__name__
    fix = f"use {whole} for {name}"
    declare = (
        f"If {name}'s update of a tensor needs only that whole tensor, declare it tensor-wise (class attribute "
        "tensorwise = True): each whole parameter is then stepped on one owner rank; or "
    )
    if name in NOT_ELEMENTWISE:
        how = declare + fix if name in _PER_TENSOR else fix
        raise ValueError(
            f"zero strategies cannot shard {name}: it {NOT_ELEMENTWISE[name]}, but ZeRO steps each rank's "
            f"slice of a flat buffer on its own, which is exact only for elementwise optimizers such as SGD, "
            f"Adam and AdamW, and for tensor-wise ones stepped whole on an owner rank (Muon, Adafactor). {how}"
        )
    if cls.__module__.startswith("torch.optim") and name in ELEMENTWISE:
        return
    if not allow_untested:
        raise ValueError(
            f"zero strategies have not been checked with {cls.__module__}.{name}. ZeRO steps each rank's slice of a "
            "flat buffer on its own, which is exact only when every element's update depends on its own gradient "
            "and state alone (SGD, Adam, AdamW). If that holds for this optimizer, pass "
            f"zero_allow_untested_optimizer=True; if it uses per-tensor norms or shapes, declare it tensor-wise "
            f"(class attribute tensorwise = True: each whole parameter is stepped on one owner rank), or {fix}"
        )
