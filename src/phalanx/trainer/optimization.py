"""transformers' optimizer and schedule builders of the Trainer, as functions of the Trainer (``self``) that the
Trainer class binds as its methods: ``create_optimizer``, ``create_scheduler`` and ``create_optimizer_and_scheduler``.
Each builds once: a given or built object stays, as in transformers."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.config.dialects.dummies import DummyOptim, DummyScheduler, config_blocks
from phalanx.trainer.schedules import get_scheduler

__all__ = ["create_optimizer", "create_scheduler", "create_optimizer_and_scheduler"]


def create_optimizer(self: Any) -> Any:
    """The optimizer ``optim`` names (``optimizer_cls_and_kwargs`` when given), with the arguments' learning rate
    and, for AdamW, betas and eps; weight decay spares biases and norm weights as transformers' does. A DeepSpeed
    config with an ``optimizer`` block builds that block instead (its ``"auto"`` lr and weight_decay from the
    arguments), as HF's Trainer does."""
    if self.optimizer is not None:
        return self.optimizer  # as transformers: built once (or given through optimizers=)
    if "optimizer" in config_blocks(self.engine.config.deepspeed):
        self.optimizer = DummyOptim(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.args.learning_rate,
            weight_decay=self.args.weight_decay,
            betas=[self.args.adam_beta1, self.args.adam_beta2],
            eps=self.args.adam_epsilon,
        )
        return self.optimizer
    if self.optimizer_cls_and_kwargs is not None:
        cls, kwargs = self.optimizer_cls_and_kwargs
    else:
        cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
    decay = set(self.get_decay_parameter_names(self.model))
    named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    self.optimizer = cls(groups, **kwargs)
    return self.optimizer


def create_optimizer_and_scheduler(self: Any, num_training_steps: int) -> None:
    """Build the optimizer and the schedule (each unless given), as transformers' method of that name."""
    if self.optimizer is None:
        self.optimizer = self.create_optimizer()
    if self.lr_scheduler is None:
        self.lr_scheduler = self.create_scheduler(num_training_steps, self.optimizer)


def create_scheduler(self: Any, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
    """The ``lr_scheduler_type`` schedule (once, as transformers: a given or built one stays), or a DeepSpeed
    config's ``scheduler`` block (its ``"auto"`` steps from the run's length and warmup)."""
    if self.lr_scheduler is not None:
        return self.lr_scheduler
    optimizer = optimizer if optimizer is not None else self.optimizer
    warmup = self.args.get_warmup_steps(num_training_steps)
    if "scheduler" in config_blocks(self.engine.config.deepspeed):
        # transformers fills these "auto" values so: the peak is the learning rate, the floor 0.
        self.lr_scheduler = DummyScheduler(
            optimizer,
            total_num_steps=num_training_steps,
            warmup_num_steps=warmup,
            warmup_max_lr=self.args.learning_rate,
            warmup_min_lr=0.0,
        )
        return self.lr_scheduler
    kwargs = self.args.lr_scheduler_kwargs
    self.lr_scheduler = get_scheduler(
        self.args.lr_scheduler_type,
        optimizer,
        warmup,
        num_training_steps,
        kwargs if isinstance(kwargs, dict) else None,
    )
    return self.lr_scheduler
