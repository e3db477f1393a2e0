"""Hugging Face's learning-rate schedules by name, with transformers' formulas and a state_dict that is plain JSON.

    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=100, num_training_steps=1000)

transformers builds these as ``LambdaLR`` over closures, which a phalanx checkpoint (JSON, nothing pickled) cannot
hold. Here one :class:`WarmupSchedule` computes the factor from plain fields, so ``state_dict()`` is numbers and
strings only. On ``load_state_dict`` the counters come back and the formula stays the one this object was built
with, as a ``LambdaLR`` resumes: a run resumed with a longer ``max_steps`` follows the new schedule from where it was.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from phalanx.config.options import ConfigError
from phalanx.logging import warn_once

if TYPE_CHECKING:
    from phalanx.trainer.arguments import TrainingArguments

__all__ = ["SCHEDULES", "SCHEDULE_KWARGS", "PLATEAU", "WarmupSchedule", "get_scheduler", "warmup_steps_for"]


def _warmup(step: int, warmup: int) -> float:
    return step / max(1, warmup)


def _linear(step: int, warmup: int, total: int, p: dict[str, Any]) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, warmup: int, total: int, p: dict[str, Any]) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * float(p["num_cycles"]) * 2.0 * progress))
    rate = float(p.get("min_lr_rate", 0.0))  # cosine_with_min_lr: the cosine runs from 1 down to the floor
    return max(0.0, factor * (1.0 - rate) + rate)


def _constant(step: int, warmup: int, total: int, p: dict[str, Any]) -> float:
    return 1.0


def _constant_with_warmup(step: int, warmup: int, total: int, p: dict[str, Any]) -> float:
    return _warmup(step, warmup) if step < warmup else 1.0


def _polynomial(step: int, warmup: int, total: int, p: dict[str, Any]) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    # transformers divides by the optimizer's default lr (not each group's): the end lr is absolute for that group.
    lr_init, lr_end, power = float(p["lr_init"]), float(p["lr_end"]), float(p["power"])
    if step > total or total == warmup:  # the second: transformers divides by zero there; the limit is lr_end
        return lr_end / lr_init
    remaining = 1.0 - (step - warmup) / (total - warmup)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def _inverse_sqrt(step: int, warmup: int, total: int, p: dict[str, Any]) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    timescale = int(p["timescale"])
    return 1.0 / math.sqrt((step + timescale - warmup) / timescale)


def _cosine_with_restarts(step: int, warmup: int, total: int, p: dict[str, Any]) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(p["num_cycles"]) * progress) % 1.0))))


def _cosine_warmup_with_min_lr(step: int, warmup: int, total: int, p: dict[str, Any]) -> float:
    # transformers' variant: the warmup starts above 0 (at warmup_lr_rate, or 1/warmup) and the cosine is one step on.
    if step < warmup:
        rate = p.get("warmup_lr_rate")
        if rate is None:
            return (step + 1.0) / max(1.0, warmup)
        return float(rate) + (1.0 - float(rate)) * step / max(1, warmup - 1)
    progress = (step - warmup + 1.0) / max(1.0, total - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * float(p["num_cycles"]) * 2.0 * progress))
    rate = float(p.get("min_lr_rate", 0.0))
    return max(0.0, factor * (1.0 - rate) + rate)


_FACTORS: dict[str, Callable[[int, int, int, dict[str, Any]], float]] = {
    "linear": _linear, "cosine": _cosine, "cosine_with_min_lr": _cosine, "constant": _constant,
    "constant_with_warmup": _constant_with_warmup, "polynomial": _polynomial, "inverse_sqrt": _inverse_sqrt,
    "cosine_with_restarts": _cosine_with_restarts, "cosine_warmup_with_min_lr": _cosine_warmup_with_min_lr,
}  # fmt: skip
PLATEAU = "reduce_lr_on_plateau"
"""torch's ReduceLROnPlateau, which the Trainer steps with the evaluation's metric rather than at every step."""

SCHEDULES: tuple[str, ...] = (*_FACTORS, PLATEAU)
"""The ``lr_scheduler_type`` names phalanx implements, as transformers spells them."""

SCHEDULE_KWARGS: dict[str, dict[str, Any]] = {
    "linear": {}, "cosine": {"num_cycles": 0.5}, "cosine_with_min_lr": {"num_cycles": 0.5, "min_lr": None,
    "min_lr_rate": None}, "constant": {}, "constant_with_warmup": {}, "polynomial": {"lr_end": 1e-7, "power": 1.0},
    "inverse_sqrt": {"timescale": None}, "cosine_with_restarts": {"num_cycles": 1},
    "cosine_warmup_with_min_lr": {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None, "warmup_lr_rate": None},
    PLATEAU: {"mode": "min", "factor": 0.1, "patience": 10, "threshold": 1e-4, "threshold_mode": "rel",
              "cooldown": 0, "min_lr": 0, "eps": 1e-8},
}  # fmt: skip
"""The ``lr_scheduler_kwargs`` each schedule accepts, with transformers' defaults."""

_NEEDS_TOTAL = (
    "linear",
    "cosine",
    "cosine_with_min_lr",
    "polynomial",
    "cosine_with_restarts",
    "cosine_warmup_with_min_lr",
)
# transformers names that phalanx does not implement (yet), so that the error says so rather than "unknown".
_ELSEWHERE = ("warmup_stable_decay", "greedy")


class WarmupSchedule(LRScheduler):
    """One of :data:`SCHEDULES`: ``lr = base_lr * factor(step)``, the factor computed from plain fields.

    ``kind`` is the schedule's name and ``params`` its resolved keyword arguments (numbers only). Build it with
    :func:`get_scheduler`, which checks the arguments as transformers does.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        kind: str,
        num_warmup_steps: int,
        num_training_steps: int | None,
        params: dict[str, Any] | None = None,
        last_epoch: int = -1,
    ) -> None:
        assert kind in _FACTORS, kind
        self.schedule: dict[str, Any] = {
            "kind": kind,
            "num_warmup_steps": int(num_warmup_steps),
            "num_training_steps": None if num_training_steps is None else int(num_training_steps),
            "params": dict(params or {}),
        }
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """The multiplier of each group's initial lr after ``step`` optimizer steps."""
        s = self.schedule
        total = s["num_training_steps"] if s["num_training_steps"] is not None else 0
        return _FACTORS[s["kind"]](step, s["num_warmup_steps"], total, s["params"])

    def get_lr(self) -> list[float | Tensor]:
        f = self.factor(self.last_epoch)
        return [float(base) * f for base in self.base_lrs]

    def _get_closed_form_lr(self) -> list[float | Tensor]:
        return self.get_lr()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The counters resume; the formula is this object's own (see the module docstring).
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "schedule"})
        # Set the groups' lr now, so that the next step runs at the resumed step's lr even when the optimizer's own
        # state is not loaded, or this object's formula differs from the saved one.
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def get_scheduler(
    name: str,
    optimizer: Optimizer,
    num_warmup_steps: int | None = None,
    num_training_steps: int | None = None,
    scheduler_specific_kwargs: dict[str, Any] | None = None,
) -> WarmupSchedule:
    """transformers' ``get_scheduler`` for the seven :data:`SCHEDULES`, as a JSON-serialisable scheduler.

    ``scheduler_specific_kwargs`` is ``TrainingArguments.lr_scheduler_kwargs`` (see :data:`SCHEDULE_KWARGS`).
    """
    name = str(getattr(name, "value", name))
    kwargs = dict(scheduler_specific_kwargs or {})
    check_schedule_kwargs(name, kwargs)
    if name == PLATEAU:  # torch's own: its state is plain numbers already
        return ReduceLROnPlateau(optimizer, **kwargs)  # type: ignore[return-value]
    if name == "constant":
        if num_warmup_steps:
            warn_once(
                f"lr_scheduler_type='constant' has no warmup, so num_warmup_steps={num_warmup_steps} is not "
                "used (as in transformers); use 'constant_with_warmup' to warm up"
            )
        return WarmupSchedule(optimizer, name, 0, num_training_steps)
    if num_warmup_steps is None or num_warmup_steps < 0:
        raise ConfigError(
            f"lr_scheduler_type={name!r} needs num_warmup_steps >= 0; got {num_warmup_steps!r} (pass the "
            "number of warmup steps, 0 for none)"
        )
    if name in _NEEDS_TOTAL and (num_training_steps is None or num_training_steps < 1):
        raise ConfigError(
            f"lr_scheduler_type={name!r} needs num_training_steps >= 1; got {num_training_steps!r} "
            "(pass the number of optimizer steps of the run, e.g. max_steps)"
        )
    params = {k: v for k, v in SCHEDULE_KWARGS[name].items() if v is not None} | kwargs
    lr_init = float(optimizer.defaults["lr"])
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        min_lr = params.pop("min_lr", None)
        params["min_lr_rate"] = float(min_lr) / lr_init if min_lr is not None else float(params["min_lr_rate"])
    elif name == "polynomial":
        if not lr_init > float(params["lr_end"]):
            raise ConfigError(
                f"lr_scheduler_kwargs lr_end={params['lr_end']!r} must be below the initial learning rate "
                f"{lr_init!r} (lower lr_end, or raise learning_rate)"
            )
        params["lr_init"] = lr_init
    elif name == "inverse_sqrt" and params.get("timescale") is None:
        params["timescale"] = num_warmup_steps or 10_000
    return WarmupSchedule(optimizer, name, num_warmup_steps, num_training_steps, params)


def check_schedule_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """An unknown schedule, or a keyword it does not take, is a ConfigError that names it and the choices."""
    if name not in SCHEDULE_KWARGS:
        if name in _ELSEWHERE:
            raise ConfigError(
                f"lr_scheduler_type={name!r} is a transformers schedule that phalanx does not implement; "
                f"use one of: {', '.join(SCHEDULES)}"
            )
        close = difflib.get_close_matches(name, SCHEDULES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown lr_scheduler_type {name!r}; {hint}valid: {', '.join(SCHEDULES)}")
    accepted = SCHEDULE_KWARGS[name]
    for key in kwargs:
        if key not in accepted:
            takes = ", ".join(accepted) or "none"
            raise ConfigError(
                f"lr_scheduler_kwargs key {key!r} is not read by lr_scheduler_type={name!r} (it takes: "
                f"{takes}); remove it or pick the schedule that reads it"
            )
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        given = [k for k in ("min_lr", "min_lr_rate") if kwargs.get(k) is not None]
        if len(given) != 1:
            raise ConfigError(
                f"lr_scheduler_type={name!r} needs exactly one of min_lr or min_lr_rate in "
                f"lr_scheduler_kwargs; got {kwargs!r} (e.g. lr_scheduler_kwargs={{'min_lr_rate': 0.1}})"
            )


def warmup_steps_for(args: TrainingArguments, num_training_steps: int) -> int:
    """Warmup steps as transformers resolves ``warmup_steps``: 1 or more is a count, below 1 a ratio of the run
    (rounded up)."""
    steps = float(args.warmup_steps)
    return int(steps) if steps >= 1 else math.ceil(num_training_steps * steps)
