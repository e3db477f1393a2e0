"""Data-parallel replicas: what ddp, zero and the pipeline's stages do alike when a model is prepared.

Every replica must hold the same architecture, start from the first replica's weights and buffers, and keep
its buffers (BatchNorm statistics and the like) equal to the first replica's, as torch DDP does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import CommStats, broadcast_coalesced

__all__ = [
    "group_rank0",
    "check_same_model",
    "replicate_from_first",
    "check_trainable",
    "check_prepared_once",
    "optimizer_list",
]


def group_rank0(group: Any) -> int:
    """The global rank of the first member of ``group`` (the source of broadcasts)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def check_same_model(model: nn.Module, group: Any, device: torch.device) -> None:
    """Refuse replicas that differ in shape before any broadcast could pair mismatched tensors."""
    shapes = [tuple(p.shape) for p in model.parameters()] + [tuple(b.shape) for b in model.buffers()]
    signature = torch.tensor([len(shapes), sum(hash(s) % 1_000_003 for s in shapes)], dtype=torch.long, device=device)
    lo, hi = signature.clone(), signature.clone()
    watched(dist.all_reduce, lo, op=dist.ReduceOp.MIN, group=group)
    watched(dist.all_reduce, hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise RuntimeError(
            f"the model passed to engine.prepare differs between ranks (this rank: {int(signature[0])} tensors); "
            "build the same architecture on every rank before prepare"
        )


def replicate_from_first(
    model: nn.Module,
    group: Any,
    device: torch.device,
    stats: CommStats,
    broadcast_buffers: bool,
    skip: Iterable[torch.Tensor] = (),
) -> None:
    """Check that the replicas in ``group`` hold the same model, give them the first replica's parameters (but those
    in ``skip``, which the caller broadcasts itself) and buffers, and, with ``broadcast_buffers``, broadcast the
    buffers again before each training forward. Call it on every rank of ``group``, with more than one rank."""
    check_same_model(model, group, device)
    skipped = set(skip)
    src = group_rank0(group)
    broadcast_coalesced(
        [t.data for t in model.parameters() if t not in skipped] + list(model.buffers()),
        src=src,
        group=group,
        stats=stats,
    )
    if broadcast_buffers and any(True for _ in model.buffers()):

        def hook(module: nn.Module, args: Any) -> None:
            if module.training and torch.is_grad_enabled():
                with torch.no_grad():
                    broadcast_coalesced(list(module.buffers()), src=src, group=group, stats=stats)

        model.register_forward_pre_hook(hook)


def check_trainable(model: nn.Module, what: str) -> None:
    """Refuse a model with nothing to train: ``what`` is what the strategy would do with it ("reduce", "shard")."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} has no parameter with requires_grad=True, so there is nothing to train "
            f"or {what} (unfreeze some parameters, or do not pass this model to engine.prepare)"
        )


def check_prepared_once(model: nn.Module, prepared: Any) -> None:
    """``prepared``: the ids of models this strategy already wrapped."""
    if id(model) in prepared:
        raise ValueError(f"{type(model).__name__} was already passed to engine.prepare; prepare each model once")


def optimizer_list(optimizers: Any) -> list[torch.optim.Optimizer]:
    """``None``, one optimizer or a sequence of them, as a list of the optimizers themselves (unwrapping the
    Engine's ``PreparedOptimizer``)."""
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    return [getattr(o, "optimizer", o) for o in optimizers]
