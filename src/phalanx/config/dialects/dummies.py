"""Placeholders for the optimizer and scheduler that a DeepSpeed config's ``optimizer`` / ``scheduler`` blocks describe.

As in Accelerate, a script passes ``DummyOptim(model.parameters())`` and ``DummyScheduler(optimizer)`` to
``engine.prepare``, which returns the real ones, built from the blocks with DeepSpeed's semantics. A script that
passes its own optimizer while the config also has an optimizer block gets an error: two sources for one thing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from phalanx.config.options import ConfigError

__all__ = ["DummyOptim", "DummyScheduler", "realise_optimizer", "realise_scheduler", "config_blocks"]


class DummyOptim:
    """Stands for the DeepSpeed config's optimizer block. ``lr``, ``weight_decay`` and any other keyword (e.g.
    ``betas``, ``eps``) fill its ``"auto"`` values."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.0, **kwargs: Any) -> None:
        self.params = list(params)
        self.lr, self.weight_decay, self.kwargs = lr, weight_decay, kwargs
        self.realised: torch.optim.Optimizer | None = None


class DummyScheduler:
    """Stands for the DeepSpeed config's scheduler block; ``total_num_steps``, ``warmup_num_steps`` and any other
    keyword (e.g. ``warmup_max_lr``) fill its ``"auto"`` values."""

    def __init__(
        self, optimizer: Any, total_num_steps: int | None = None, warmup_num_steps: int = 0, **kwargs: Any
    ) -> None:
        self.optimizer = optimizer
        self.total_num_steps, self.warmup_num_steps, self.kwargs = total_num_steps, warmup_num_steps, kwargs


def config_blocks(path: str | None) -> dict[str, Any]:
    """The ``optimizer`` and ``scheduler`` blocks of the DeepSpeed config at ``path`` (none without one)."""
    if not path:
        return {}
    from phalanx.config.dialects.deepspeed import read_deepspeed

    data = read_deepspeed(path)
    return {k: data[k] for k in ("optimizer", "scheduler") if k in data}


def realise_optimizer(optimizer: Any, deepspeed: str | None) -> torch.optim.Optimizer:
    """The optimizer the script meant: its own, or the one the config's block describes for a DummyOptim."""
    blocks = config_blocks(deepspeed)
    if isinstance(optimizer, DummyOptim):
        if "optimizer" not in blocks:
            raise ConfigError(
                f"DummyOptim stands for the optimizer block of a DeepSpeed config, but "
                f"{repr(deepspeed) if deepspeed else 'no DeepSpeed config is set'}"
                f'{" has none" if deepspeed else ""}: pass a torch optimizer, or add an "optimizer" block'
            )
        from phalanx.config.dialects.deepspeed_blocks import build_optimizer

        auto = {**optimizer.kwargs, "lr": optimizer.lr, "weight_decay": optimizer.weight_decay}
        optimizer.realised = build_optimizer(blocks["optimizer"], optimizer.params, auto_values=auto)
        return optimizer.realised
    if "optimizer" in blocks:
        raise ConfigError(
            f"the DeepSpeed config {deepspeed!r} has an optimizer block ({blocks['optimizer'].get('type')!r}) and the "
            f"script passes its own {type(optimizer).__name__} to engine.prepare: two sources for one optimizer. "
            "Drop the block, or pass phalanx.DummyOptim(model.parameters()) to use it"
        )
    return optimizer


def realise_scheduler(scheduler: Any, deepspeed: str | None) -> Any:
    """The LR scheduler the script meant: its own, or the one the config's block describes for a DummyScheduler."""
    blocks = config_blocks(deepspeed)
    if isinstance(scheduler, DummyScheduler):
        if "scheduler" not in blocks:
            raise ConfigError(
                "DummyScheduler stands for the scheduler block of a DeepSpeed config, but "
                f"{repr(deepspeed) + ' has none' if deepspeed else 'no DeepSpeed config is set'}: pass a torch LR "
                'scheduler, or add a "scheduler" block'
            )
        optimizer = scheduler.optimizer
        if isinstance(optimizer, DummyOptim):
            if optimizer.realised is None:
                raise ConfigError("DummyScheduler's DummyOptim was not prepared: pass both to the same engine.prepare")
            optimizer = optimizer.realised
        elif hasattr(optimizer, "optimizer") and isinstance(optimizer.optimizer, torch.optim.Optimizer):
            optimizer = optimizer.optimizer  # a prepared optimizer: the scheduler drives the user's own
        from phalanx.config.dialects.deepspeed_blocks import build_scheduler

        # Accelerate's fill: the warmup from 0 to the optimizer's lr, over at least one step (DeepSpeed refuses 0).
        auto = {
            "warmup_min_lr": 0.0,
            "lr": float(optimizer.defaults["lr"]),
            **scheduler.kwargs,
            "warmup_num_steps": max(1, int(scheduler.warmup_num_steps or 0)),
            "total_num_steps": scheduler.total_num_steps,
        }
        return build_scheduler(
            blocks["scheduler"],
            optimizer,
            total_num_steps=scheduler.total_num_steps,
            auto_values={k: v for k, v in auto.items() if v is not None},
        )
    if "scheduler" in blocks:
        raise ConfigError(
            f"the DeepSpeed config {deepspeed!r} has a scheduler block ({blocks['scheduler'].get('type')!r}) and the "
            f"script passes its own {type(scheduler).__name__} to engine.prepare: two sources for one schedule. "
            "Drop the block, or pass phalanx.DummyScheduler(optimizer) to use it"
        )
    return scheduler
