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
from phalanx.logging import get_logger, warn_once

if TYPE_CHECKING:
    from phalanx.trainer.arguments import TrainingArguments

__all__ = [
    "SCHEDULES", "SCHEDULE_KWARGS", "PLATEAU", "GREEDY", "GreedyLR", "WarmupSchedule", "get_scheduler",
    "warmup_steps_for",
]  # fmt: skip


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


_SHAPES: dict[str, Callable[[float], float]] = {  # progress in [0, 1] -> the rising (warmup) factor
    "linear": lambda x: x,
    "cosine": lambda x: 0.5 * (1.0 - math.cos(math.pi * x)),
    "1-sqrt": lambda x: 1.0 - math.sqrt(1.0 - x),
}


def _warmup_stable_decay(step: int, warmup: int, total: int, p: dict[str, Any]) -> float:
    # Warm up, hold at the peak for num_stable_steps, decay over num_decay_steps, then stay at min_lr_ratio.
    floor, stable, decay = float(p["min_lr_ratio"]), int(p["num_stable_steps"]), int(p["num_decay_steps"])
    if step < warmup:
        return max(0.0, _SHAPES[p["warmup_type"]](step / max(1, warmup)) * (1.0 - floor) + floor)
    if step < warmup + stable:
        return 1.0
    if step >= warmup + stable + decay:
        return floor
    progress = (step - warmup - stable) / max(1, decay)
    if p["decay_type"] == "cosine":
        down = 0.5 * (1.0 + math.cos(math.pi * float(p["num_cycles"]) * 2.0 * progress))
    else:  # linear and 1-sqrt fall as the warmup shape rises, mirrored
        down = 1.0 - (progress if p["decay_type"] == "linear" else math.sqrt(progress))
    return max(0.0, down * (1.0 - floor) + floor)


_FACTORS: dict[str, Callable[[int, int, int, dict[str, Any]], float]] = {
    "linear": _linear, "cosine": _cosine, "cosine_with_min_lr": _cosine, "constant": _constant,
    "constant_with_warmup": _constant_with_warmup, "polynomial": _polynomial, "inverse_sqrt": _inverse_sqrt,
    "cosine_with_restarts": _cosine_with_restarts, "cosine_warmup_with_min_lr": _cosine_warmup_with_min_lr,
    "warmup_stable_decay": _warmup_stable_decay,
}  # fmt: skip
PLATEAU = "reduce_lr_on_plateau"
"""torch's ReduceLROnPlateau, which the Trainer steps with the evaluation's metric rather than at every step."""
GREEDY = "greedy"
""":class:`GreedyLR`, stepped on the evaluation's metric too."""

SCHEDULES: tuple[str, ...] = (*_FACTORS, PLATEAU, GREEDY)
"""The ``lr_scheduler_type`` names phalanx implements, as transformers spells them."""

SCHEDULE_KWARGS: dict[str, dict[str, Any]] = {
    "linear": {}, "cosine": {"num_cycles": 0.5}, "cosine_with_min_lr": {"num_cycles": 0.5, "min_lr": None,
    "min_lr_rate": None}, "constant": {}, "constant_with_warmup": {}, "polynomial": {"lr_end": 1e-7, "power": 1.0},
    "inverse_sqrt": {"timescale": None}, "cosine_with_restarts": {"num_cycles": 1},
    "cosine_warmup_with_min_lr": {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None, "warmup_lr_rate": None},
    PLATEAU: {"mode": "min", "factor": 0.1, "patience": 10, "threshold": 1e-4, "threshold_mode": "rel",
              "cooldown": 0, "min_lr": 0, "eps": 1e-8},
    "warmup_stable_decay": {"num_decay_steps": None, "num_stable_steps": None, "warmup_type": "linear",
                            "decay_type": "cosine", "min_lr_ratio": 0.0, "num_cycles": 0.5},
    GREEDY: {"mode": "min", "factor": 0.95, "patience": 10, "threshold": 1e-6, "threshold_mode": "abs",
             "cooldown": 0, "warmup": 0, "min_lr": 1e-3, "max_lr": 1.0, "eps": 1e-8, "verbose": False,
             "smooth": False, "window_size": 50, "reset_start": 500},
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
    if name == GREEDY:
        return GreedyLR(optimizer, **kwargs)  # type: ignore[return-value]
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
    elif name == "warmup_stable_decay":
        _settle_stable_steps(params, num_warmup_steps, num_training_steps)
    elif name == "inverse_sqrt" and params.get("timescale") is None:
        params["timescale"] = num_warmup_steps or 10_000
    return WarmupSchedule(optimizer, name, num_warmup_steps, num_training_steps, params)


def _settle_stable_steps(params: dict[str, Any], warmup: int, total: int | None) -> None:
    """warmup_stable_decay's plateau: num_stable_steps if given, else what num_training_steps leaves after the warmup
    and the decay (transformers' rule)."""
    for key in ("warmup_type", "decay_type"):
        if params[key] not in _SHAPES:
            raise ConfigError(f"lr_scheduler_kwargs {key}={params[key]!r} is not one of {', '.join(_SHAPES)}")
    if params.get("num_decay_steps") is None:
        raise ConfigError(
            "lr_scheduler_type='warmup_stable_decay' needs lr_scheduler_kwargs num_decay_steps (the steps of the final "
            "decay), e.g. lr_scheduler_kwargs={'num_decay_steps': 100}"
        )
    if params.get("num_stable_steps") is None:
        if total is None:
            raise ConfigError(
                "lr_scheduler_type='warmup_stable_decay' needs num_training_steps (max_steps) or lr_scheduler_kwargs "
                "num_stable_steps, to know how long the plateau lasts"
            )
        params["num_stable_steps"] = total - warmup - int(params["num_decay_steps"])
    elif total is not None:
        warn_once(
            f"warmup_stable_decay: num_stable_steps={params['num_stable_steps']} is used and the run's length "
            f"({total} steps) is not, as in transformers; the decay ends at step "
            f"{warmup + int(params['num_stable_steps']) + int(params['num_decay_steps'])}"
        )


def check_schedule_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """An unknown schedule, or a keyword it does not take, is a ConfigError that names it and the choices."""
    if name not in SCHEDULE_KWARGS:
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


class GreedyLR:
    """transformers' ``greedy`` schedule (GreedyLR, arXiv 2512.14527), stepped with a metric as ReduceLROnPlateau is.

    After more than ``patience`` evaluations that improve on the best by more than ``threshold``, each group's lr is
    divided by ``factor`` (up to ``max_lr``), then ``warmup`` evaluations pass unjudged; after more than ``patience``
    that do not, it is multiplied by ``factor`` (down to ``min_lr``), then ``cooldown`` pass unjudged. Changes below
    ``eps`` are not made. Once every group sits at ``min_lr`` for ``reset_start`` more reductions, the lrs, the best
    and the counters start over. ``smooth`` judges the mean of the last ``window_size`` metrics instead of the last.
    The arithmetic follows transformers' class, so a run gives the same rates; the state is plain numbers.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        mode: str = "min",
        factor: float = 0.95,
        patience: int = 10,
        threshold: float = 1e-6,
        threshold_mode: str = "abs",
        cooldown: int = 0,
        warmup: int = 0,
        min_lr: float | list[float] = 1e-3,
        max_lr: float | list[float] = 1.0,
        eps: float = 1e-8,
        verbose: bool = False,
        smooth: bool = False,
        window_size: int = 50,
        reset_start: int = 500,
    ) -> None:
        groups = len(optimizer.param_groups)
        if not factor < 1.0:
            raise ConfigError(f"GreedyLR factor must be below 1 (it divides the lr on improvement); got {factor!r}")
        if mode not in ("min", "max") or threshold_mode not in ("rel", "abs"):
            raise ConfigError(f"GreedyLR mode must be min or max and threshold_mode rel or abs; got {mode!r}, "
                              f"{threshold_mode!r}")  # fmt: skip
        bounds = {}
        for name, value in (("min_lr", min_lr), ("max_lr", max_lr)):
            listed = list(value) if isinstance(value, (list, tuple)) else [value] * groups
            if len(listed) != groups:
                raise ConfigError(f"GreedyLR {name} has {len(listed)} values for {groups} parameter groups")
            bounds[name] = [float(v) for v in listed]
        self.optimizer = optimizer
        self.mode, self.factor, self.patience, self.threshold = mode, float(factor), int(patience), float(threshold)
        self.threshold_mode, self.cooldown, self.warmup, self.eps = threshold_mode, int(cooldown), int(warmup), eps
        self.verbose, self.smooth, self.window_size = verbose, smooth, int(window_size)
        self.min_lrs, self.max_lrs = bounds["min_lr"], bounds["max_lr"]
        self.reset_start = self.reset_start_original = int(reset_start)
        self._init_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self._last_lr = list(self._init_lrs)
        self._window: list[float] = []
        self.last_epoch = 0
        self._start_over()

    def _start_over(self) -> None:
        self.best = math.inf if self.mode == "min" else -math.inf
        self.num_bad_epochs = self.num_good_epochs = self.cooldown_counter = self.warmup_counter = 0
        self.reset_start = self.reset_start_original
        self._window = []

    def _improves(self, value: float) -> bool:
        rel = self.threshold_mode == "rel"
        if self.mode == "min":
            return value < (self.best * (1.0 - self.threshold) if rel else self.best - self.threshold)
        return value > (self.best * (1.0 + self.threshold) if rel else self.best + self.threshold)

    def step(self, metrics: float, epoch: int | None = None) -> None:
        value = float(metrics)
        if self.smooth:
            self._window = [*self._window, value][-self.window_size :]
            value = sum(self._window) / len(self._window)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        if self.cooldown_counter > 0:  # a pause after a cut: nothing is judged
            self.cooldown_counter -= 1
            self.num_bad_epochs = self.num_good_epochs = 0
        elif self.warmup_counter > 0:  # a pause after a raise
            self.warmup_counter -= 1
            self.num_bad_epochs = self.num_good_epochs = 0
        else:
            if self._improves(value):
                self.best, self.num_bad_epochs, self.num_good_epochs = value, 0, self.num_good_epochs + 1
            else:
                self.num_bad_epochs, self.num_good_epochs = self.num_bad_epochs + 1, 0
            if self.num_good_epochs > self.patience:
                self._scale(up=True)
                self.warmup_counter, self.num_good_epochs = self.warmup, 0
            elif self.num_bad_epochs > self.patience:
                self._scale(up=False)
                self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        self._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]

    def _scale(self, up: bool) -> None:
        for i, group in enumerate(self.optimizer.param_groups):
            old = float(group["lr"])
            new = min(old / self.factor, self.max_lrs[i]) if up else max(old * self.factor, self.min_lrs[i])
            if (new - old if up else old - new) > self.eps:
                group["lr"] = new
                if self.verbose:
                    get_logger().info("GreedyLR: group %d lr %.4e -> %.4e", i, old, new)
        if up:
            self.reset_start = self.reset_start_original
        elif all(float(g["lr"]) <= m for g, m in zip(self.optimizer.param_groups, self.min_lrs)):
            self.reset_start -= 1
            if self.reset_start <= 0:  # stuck at the floor: back to the start
                for group, lr in zip(self.optimizer.param_groups, self._init_lrs):
                    group["lr"] = lr
                self._start_over()

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    _FIELDS = ("mode", "factor", "patience", "threshold", "threshold_mode", "cooldown", "warmup", "eps", "verbose",
               "smooth", "window_size", "min_lrs", "max_lrs", "reset_start", "reset_start_original", "best",
               "num_bad_epochs", "num_good_epochs", "cooldown_counter", "warmup_counter", "last_epoch", "_last_lr",
               "_init_lrs")  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers, under transformers' keys (a transformers scheduler.pt of a GreedyLR loads here)."""
        state = {key: getattr(self, key) for key in self._FIELDS}
        if self.smooth:
            state["_streaming_avg"] = {"window_size": self.window_size, "values": list(self._window)}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in self._FIELDS:
            if key in state_dict:
                setattr(self, key, state_dict[key])
        self._window = list(state_dict.get("_streaming_avg", {}).get("values", self._window))
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
