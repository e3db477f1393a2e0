"""What ``engine.prepare`` returns for an optimizer and a scheduler, and how it recognises and wraps the rest.

A prepared optimizer behaves like the user's: ``step``, ``zero_grad``, ``param_groups``, ``state_dict``. It steps
only at the end of an accumulation window, through the loss scaler, and tells the strategy (which gathers
parameters or consumes gradients then). A prepared scheduler steps once per real optimizer step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from phalanx.config.dialects.dummies import DummyOptim, DummyScheduler
from phalanx.engine.data import map_tensors
from phalanx.engine.precision import Precision

if TYPE_CHECKING:
    from phalanx.engine.engine import Engine

__all__ = ["PreparedOptimizer", "PreparedScheduler", "kind_of", "autocast_forward"]


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepping only at the end of an accumulation window and through loss scaling."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: Engine) -> None:
        # Deliberately no super().__init__: state and param_groups stay the wrapped optimizer's own.
        self.optimizer = optimizer
        self._engine = engine
        self.schedulers: list[PreparedScheduler] = []

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("phalanx optimizers do not take a closure (step without one; LBFGS is not supported)")
        if self._engine.sync_gradients:
            self._engine._optimizer_step(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._engine.sync_gradients:
            self._engine.strategy.zero_grad(self.optimizer, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    def __getattr__(self, name: str) -> Any:
        # Anything else (custom optimizer attributes) comes from the wrapped optimizer.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("add parameter groups before engine.prepare: the strategy has already laid out gradients")

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """The user's LR scheduler, stepping once per optimizer step that really happened.

    Micro-batches inside an accumulation window and fp16 steps skipped for overflow do not count, and
    the world size does not either: after K optimizer steps the LR is the same on 1 rank or 64.
    """

    def __init__(self, scheduler: LRScheduler, engine: Engine) -> None:
        self.scheduler = scheduler
        self._engine = engine
        # A scheduler built on the optimizer that prepare returned counts the steps of the optimizer inside it.
        target = scheduler.optimizer
        self._optimizer = target.optimizer if isinstance(target, PreparedOptimizer) else target
        for opt in engine._optimizers:
            if opt.optimizer is self._optimizer:
                opt.schedulers.append(self)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._engine._consume_step(self._optimizer):
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[Any]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


def kind_of(obj: Any) -> str:
    if isinstance(obj, nn.Module):
        return "model"
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(b, nn.Module) for b in obj):
        return "model"  # a list of blocks (pipeline stages are cut between them)
    if isinstance(obj, (torch.optim.Optimizer, DummyOptim)):
        return "optimizer"
    if isinstance(obj, (LRScheduler, DummyScheduler)) or _scheduler_like(obj):
        return "scheduler"
    if isinstance(obj, DataLoader):
        return "loader"
    raise TypeError(
        f"engine.prepare does not know what to do with a {type(obj).__name__}; it takes nn.Module, "
        "torch.optim.Optimizer, torch.utils.data.DataLoader and LR schedulers"
    )


def _scheduler_like(obj: Any) -> bool:
    """A scheduler that is not torch's class (transformers' GreedyLR, say): it drives an optimizer's param_groups and
    has step and a state to checkpoint. Accelerate takes any such object too."""
    has = all(callable(getattr(obj, m, None)) for m in ("step", "state_dict", "load_state_dict"))
    return has and hasattr(getattr(obj, "optimizer", None), "param_groups")


def autocast_forward(module: nn.Module, precision: Precision) -> None:
    """Run ``module.forward`` under autocast and hand back fp32 outputs, so losses are computed in fp32."""
    forward = module.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with precision.autocast():
            out = forward(*args, **kwargs)
        return map_tensors(out, lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t)

    module.forward = autocast_forward  # type: ignore[method-assign]
