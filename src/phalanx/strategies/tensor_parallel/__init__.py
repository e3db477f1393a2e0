"""Tensor parallelism (Megatron-style) on c10d: layers split in place by a plan, in transformers' plan syntax.

    from phalanx.strategies.tensor_parallel import apply_tp_plan, loss_parallel
    report = apply_tp_plan(model, None, tp_group, sequence_parallel=False, seed=0)
    with loss_parallel():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())

See docs/tensor-parallel.md for the styles, sequence parallelism, the RNG tracker and the errors.
"""

from __future__ import annotations

from ._ops import SequenceLengthError, defer_grad_sums
from .loss import loss_parallel, vocab_parallel_cross_entropy
from .params import (
    ReplicatedGradError,
    TPParam,
    check_replicated_grads,
    tp_gather_full,
    tp_grad_norm_sq,
    tp_param_info,
    tp_slice_of,
)
from .plan import TPReport, apply_tp_plan, last_planned, resolve_plan
from .rng import TPRngTracker
from .styles import EXPERT_STYLES, STYLES, TPPlanError

__all__ = [
    "EXPERT_STYLES",
    "STYLES",
    "ReplicatedGradError",
    "SequenceLengthError",
    "TPParam",
    "TPPlanError",
    "TPReport",
    "TPRngTracker",
    "apply_tp_plan",
    "check_replicated_grads",
    "defer_grad_sums",
    "last_planned",
    "loss_parallel",
    "resolve_plan",
    "tp_gather_full",
    "tp_grad_norm_sq",
    "tp_param_info",
    "tp_slice_of",
    "vocab_parallel_cross_entropy",
]
