"""The optimizer and LR schedule that a DeepSpeed config's ``optimizer`` and ``scheduler`` blocks describe.

phalanx builds torch optimizers, and torch ``LRScheduler`` subclasses of its own, that follow DeepSpeed 0.19's rules
(``runtime/engine.py`` and ``runtime/lr_schedules.py``) step for step, so a DeepSpeed JSON config trains the same::

    ds = json.load(open("ds_config.json"))
    optimizer = build_optimizer(ds["optimizer"], model.parameters(), auto_values={"lr": 3e-4})
    schedule = build_scheduler(ds["scheduler"], optimizer, total_num_steps=10_000)
    for note in describe_blocks(ds.get("optimizer"), ds.get("scheduler"), total_num_steps=10_000):
        print(note)  # each value, and whether it came from the file, from "auto", or from DeepSpeed's defaults

A value written as ``"auto"`` (the Hugging Face convention) is filled from ``auto_values``, and ``total_num_steps``
also from the argument of that name. Where DeepSpeed would pass a key on blindly (an unknown key, a string where a
number belongs), phalanx raises a ConfigError that names the key, the value and the fix.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from phalanx.config.options import ConfigError
from phalanx.logging import get_logger

__all__ = [
    "AdamNoBiasCorrection", "BlockNote", "DeepSpeedSchedule", "build_optimizer", "build_scheduler", "describe_blocks",
]  # fmt: skip


class BlockNote(NamedTuple):
    """One resolved value of a block and where it came from (the file, ``auto_values``, a default...)."""

    block: str
    key: str
    value: Any
    source: str

    def __str__(self) -> str:
        return f"{self.block}.{self.key} = {self.value!r} ({self.source})"


_REQUIRED = "<required>"
_BLOCK_KEYS = {"optimizer": ("type", "params", "legacy_fusion"), "scheduler": ("type", "params")}
# An "auto" that auto_values does not name may be filled from a related value, as Hugging Face does.
_AUTO_ALIASES = {"warmup_max_lr": "lr"}
# DeepSpeed's default Adam is FusedAdam, whose weight decay defaults to 0 (torch's AdamW defaults to 0.01).
_FUSED_ADAM_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "bias_correction": True,
    "amsgrad": False,
    "set_grad_none": True,
}
# Keys DeepSpeed takes out of an Adam block before it calls the constructor (the last is for CPU-offload Adam only).
_ADAM_SWITCHES: dict[str, Any] = {"torch_adam": False, "adam_w_mode": True, "fp32_optimizer_states": None}
_REFUSED_OPTIMIZERS = {
    "lamb": "DeepSpeed's FusedLamb kernel",
    "lion": "DeepSpeed's FusedLion kernel",
    "muon": "DeepSpeed's Muon with its auxiliary Adam",
    "muadam": "the mup package",
    "muadamw": "the mup package",
    "musgd": "the mup package",
    "onebitadam": "DeepSpeed's 1-bit compressed communication (phalanx has no 1-bit optimizers)",
    "onebitlamb": "DeepSpeed's 1-bit compressed communication (phalanx has no 1-bit optimizers)",
    "zerooneadam": "DeepSpeed's 0/1 Adam compressed communication (phalanx has no 1-bit optimizers)",
}
_WARMUP: dict[str, Any] = {
    "warmup_min_lr": 0.0,
    "warmup_max_lr": None,
    "warmup_num_steps": 1000,
    "warmup_type": "log",
    "last_batch_iteration": -1,
}
_SCHEDULE_DEFAULTS: dict[str, dict[str, Any]] = {
    "WarmupLR": _WARMUP,
    # DeepSpeed's WarmupDecayLR passes 0.001 on, where WarmupLR's default is the optimizer's lr.
    "WarmupDecayLR": {"total_num_steps": _REQUIRED, **_WARMUP, "warmup_max_lr": 0.001},
    "WarmupCosineLR": {
        "total_num_steps": _REQUIRED,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "OneCycle": {
        "cycle_min_lr": _REQUIRED,
        "cycle_max_lr": _REQUIRED,
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
        "last_batch_iteration": -1,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 1e-3,
        "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False,
        "last_batch_iteration": -1,
    },
}
# Settings given once for all param groups, or as a list with one value per group.
_PER_GROUP = {
    "warmup_min_lr",
    "warmup_max_lr",
    "cycle_min_lr",
    "cycle_max_lr",
    "cycle_min_mom",
    "cycle_max_mom",
    "lr_range_test_min_lr",
}


def _suggest(key: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _open_block(block_name: str, block: Any) -> tuple[str, dict[str, Any]]:
    """The block's type and a copy of its params, after checking its shape."""
    if not isinstance(block, dict):
        raise ConfigError(f'invalid {block_name}: got {block!r} (write {{"type": ..., "params": {{...}}}})')
    valid = _BLOCK_KEYS[block_name]
    for key in (k for k in block if k not in valid):
        raise ConfigError(f"unknown key {block_name}.{key} ({_suggest(key, valid)}the block holds: {valid})")
    name, params = block.get("type"), block.get("params") or {}
    if not isinstance(name, str) or not name:
        raise ConfigError(f'invalid {block_name}.type: got {name!r} (write a type name, e.g. "AdamW", "WarmupLR")')
    if not isinstance(params, dict):
        raise ConfigError(f"invalid {block_name}.params: got {params!r} (write an object of settings)")
    return name, dict(params)


def _fill_autos(block: str, raw: dict[str, Any], auto_values: dict[str, Any], notes: list[BlockNote]) -> None:
    """Replace each ``"auto"`` in ``raw`` with its value from ``auto_values``; note each value and its source."""
    for key, value in raw.items():
        if not (isinstance(value, str) and value.lower() == "auto"):
            notes.append(BlockNote(block, key, value, "config"))
            continue
        source = key if key in auto_values else _AUTO_ALIASES.get(key, key)
        if source not in auto_values:
            fix = "total_num_steps=..." if key == "total_num_steps" else f"auto_values={{{key!r}: ...}}"
            raise ConfigError(
                f'{block}.params.{key} is "auto" and nothing fills it (auto_values has '
                f"{sorted(auto_values)}); write a value in the DeepSpeed config, or pass {fix}"
            )
        raw[key] = auto_values[source]
        notes.append(BlockNote(block, key, raw[key], f'"auto", filled from auto_values[{source!r}]'))


def _check_like_default(block: str, key: str, value: Any, default: Any) -> Any:
    """The value, checked against its default's type (a tuple default wants that many numbers)."""
    where = f"invalid {block}.params.{key}: got {value!r}"
    if isinstance(default, bool) and not isinstance(value, bool):
        raise ConfigError(f"{where} (write true or false)")
    if _is_number(default) and not _is_number(value):
        raise ConfigError(f"{where} (write a number, e.g. {default!r})")
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)) or len(value) != len(default) or not all(map(_is_number, value)):
            raise ConfigError(f"{where} (write {len(default)} numbers, e.g. {list(default)})")
        return tuple(value)
    return value


def _signature_defaults(cls: type) -> tuple[dict[str, Any], list[str]]:
    """A torch optimizer's keyword defaults, and the ones worth showing (not keyword-only implementation switches)."""
    defaults, shown = {}, []
    for p in list(inspect.signature(cls).parameters.values())[1:]:  # past params
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            defaults[p.name] = _REQUIRED if p.default is p.empty else p.default
            if p.kind is not p.KEYWORD_ONLY and p.name not in ("foreach", "amsgrad"):
                shown.append(p.name)
    return defaults, shown


def _take_params(
    type_name: str,
    target: str,
    given: dict[str, Any],
    defaults: dict[str, Any],
    shown: Iterable[str],
    notes: list[BlockNote],
) -> dict[str, Any]:
    """``given`` checked against a constructor's ``defaults``; notes the defaults of the ``shown`` keys left out."""
    for key, value in given.items():
        if key not in defaults:
            raise ConfigError(
                f"unknown key optimizer.params.{key} for type {type_name!r} ({_suggest(key, defaults)}"
                f"{target} takes: {', '.join(sorted(defaults))})"
            )
        given[key] = _check_like_default("optimizer", key, value, defaults[key])
    for key in (k for k in shown if k not in given):
        if defaults[key] is _REQUIRED:
            raise ConfigError(
                f"optimizer.params.{key} is missing and {target} needs it (write it, or write "
                f'"auto" and pass auto_values={{{key!r}: ...}})'
            )
        notes.append(BlockNote("optimizer", key, defaults[key], f"default of {target}"))
    return given


def _resolve_optimizer(
    block: Any, auto_values: dict[str, Any] | None
) -> tuple[type[Optimizer], dict[str, Any], list[BlockNote]]:
    """The torch class, its keyword arguments, and notes, for a DeepSpeed ``optimizer`` block."""
    type_name, given = _open_block("optimizer", block)
    if "max_grad_norm" in given:
        clip = given["max_grad_norm"]
        raise ConfigError(
            f"optimizer.params.max_grad_norm={clip!r} is refused by DeepSpeed as an optimizer "
            f'setting; move it to the top-level "gradient_clipping": {clip!r}'
        )
    notes: list[BlockNote] = []
    _fill_autos("optimizer", given, auto_values or {}, notes)
    lowered = type_name.lower()
    if lowered in ("adam", "adamw"):
        switches = {k: _check_like_default("optimizer", k, given.pop(k, d), d) for k, d in _ADAM_SWITCHES.items()}
        # DeepSpeed: "AdamW" is always decoupled; "Adam" is too, unless adam_w_mode is false.
        decoupled = lowered == "adamw" or switches["adam_w_mode"]
        cls: type[Optimizer] = torch.optim.AdamW if decoupled else torch.optim.Adam
        how = "decoupled weight decay" if decoupled else "L2 weight decay added to the gradient"
        how += ", as DeepSpeed's adam_w_mode defaults to true" if lowered == "adam" and decoupled else ""
        if switches["torch_adam"]:
            defaults, shown = _signature_defaults(cls)
            kwargs = _take_params(type_name, f"torch.optim.{cls.__name__}", given, defaults, shown, notes)
        else:
            target = "DeepSpeed's FusedAdam"
            kwargs = _take_params(type_name, target, given, _FUSED_ADAM_DEFAULTS, (), notes)
            if kwargs.pop("amsgrad", False):
                raise ConfigError(
                    "optimizer.params.amsgrad=true is refused by DeepSpeed's default Adam (FusedAdam); "
                    'add "torch_adam": true to use torch\'s AMSGrad, or remove amsgrad'
                )
            if not kwargs.pop("bias_correction", True):
                # torch's Adam always corrects the moments' bias; FusedAdam's bias_correction=false (BERT's recipe)
                # is this small optimizer instead.
                cls, how = AdamNoBiasCorrection, how + ", no bias correction (FusedAdam's bias_correction=false)"
                kwargs["decoupled"] = decoupled
            kwargs.pop("set_grad_none", None)  # torch's zero_grad() sets grads to None already
            for key in ("lr", "betas", "eps", "weight_decay"):  # written out: torch's AdamW would decay by 0.01
                if key not in kwargs:
                    kwargs[key] = _FUSED_ADAM_DEFAULTS[key]
                    notes.append(BlockNote("optimizer", key, kwargs[key], f"default of {target}"))
        if switches["fp32_optimizer_states"] is not None:
            notes.append(
                BlockNote(
                    "optimizer",
                    "fp32_optimizer_states",
                    switches["fp32_optimizer_states"],
                    "ignored: only DeepSpeed's CPU-offload Adam reads it",
                )
            )
        notes.insert(0, BlockNote("optimizer", "type", f"torch.optim.{cls.__name__}", f"{type_name!r}: {how}"))
        return cls, kwargs, notes
    if lowered in _REFUSED_OPTIMIZERS:
        raise ConfigError(
            f"optimizer.type={type_name!r} is not supported: it needs {_REFUSED_OPTIMIZERS[lowered]}; "
            f'use "Adam", "AdamW", "Adagrad" or a torch.optim name such as "SGD", or pass your '
            f"own optimizer in Python"
        )
    # Like DeepSpeed, any other name is torch.optim's class of that name (Adagrad included), given the params as is.
    optimizers = {
        n.lower(): c
        for n, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, Optimizer) and c is not Optimizer
    }
    if lowered not in optimizers:
        names = sorted(c.__name__ for c in optimizers.values())
        raise ConfigError(
            f"unknown optimizer.type {type_name!r} ({_suggest(type_name, names)}supported: {', '.join(names)})"
        )
    cls = optimizers[lowered]
    defaults, shown = _signature_defaults(cls)
    kwargs = _take_params(type_name, f"torch.optim.{cls.__name__}", given, defaults, shown, notes)
    notes.insert(0, BlockNote("optimizer", "type", f"torch.optim.{cls.__name__}", repr(type_name)))
    return cls, kwargs, notes


class AdamNoBiasCorrection(Optimizer):
    """DeepSpeed's FusedAdam with ``bias_correction: false``: Adam whose moments are used as they are, not divided by
    ``1 - beta**step``. ``decoupled`` is FusedAdam's ``adam_w_mode`` (weight decay applied to the weights, as AdamW;
    otherwise added to the gradient, as Adam's L2)::

        m = b1 m + (1 - b1) g        v = b2 v + (1 - b2) g^2
        p -= lr (m / (sqrt(v) + eps) + wd p)          (decoupled; else g += wd p first)
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = True,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "decoupled": decoupled}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if group["decoupled"] or wd == 0 else p.grad.add(p, alpha=wd)
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                if group["decoupled"] and wd != 0:
                    p.mul_(1 - lr * wd)
                p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)
        return loss


def build_optimizer(block: dict[str, Any], params: Any, auto_values: dict[str, Any] | None = None) -> Optimizer:
    """The torch optimizer that DeepSpeed builds for ``block`` (``{"type": ..., "params": {...}}``) over ``params``.

    ``auto_values`` fills the params written as ``"auto"``, by key (e.g. ``{"lr": 3e-4, "weight_decay": 0.0}``).
    """
    cls, kwargs, _ = _resolve_optimizer(block, auto_values)
    try:
        return cls(params, **kwargs)
    except (ValueError, TypeError) as err:
        raise ConfigError(
            f"torch.optim.{cls.__name__} refused the DeepSpeed optimizer params {kwargs}: {err} "
            f"(fix that value in optimizer.params)"
        ) from err


class DeepSpeedSchedule(LRScheduler):
    """A DeepSpeed LR schedule as a torch ``LRScheduler``, whose ``state_dict()`` holds only numbers, strings, lists.

    DeepSpeed counts ``last_batch_iteration`` from -1 before the first step; torch's constructor takes one step, so
    ``last_epoch`` starts at 0. Here ``last_batch_iteration == last_epoch - 1``, and the optimizer sees DeepSpeed's
    lr at every step. ``settings`` holds the resolved params, per-group values as lists.
    """

    def __init__(self, optimizer: Optimizer, settings: dict[str, Any]) -> None:
        self.settings = settings
        start = settings["last_batch_iteration"]
        if start != -1:
            # Resuming: torch needs initial_lr. DeepSpeed leaves the lr alone until the next step; we set the
            # schedule's value at `start`, which is what the interrupted run had.
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        super().__init__(optimizer, last_epoch=start)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's index of the last batch seen (-1 before the first)."""
        return self.last_epoch - 1

    def get_lr(self) -> list[float | torch.Tensor]:
        return list(self.lrs_at(self.last_epoch - 1))

    def lrs_at(self, iteration: int) -> list[float]:
        """Each param group's lr once DeepSpeed's ``step()`` has set ``last_batch_iteration = iteration``."""
        raise NotImplementedError


def _warmup_gamma(settings: dict[str, Any], iteration: int) -> float:
    """The warmup's fraction done (log or linear), 1 after it."""
    warmup = max(2, settings["warmup_num_steps"])  # DeepSpeed's floor: log(1) = 0 would divide by zero
    if iteration >= warmup:
        return 1.0
    if settings["warmup_type"] == "log":
        return (1.0 / math.log(warmup)) * math.log(iteration + 1)
    return iteration / warmup


class WarmupLR(DeepSpeedSchedule):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps, then flat."""

    def _gamma(self, iteration: int) -> float:
        return _warmup_gamma(self.settings, iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        lows, highs = self.settings["warmup_min_lr"], self.settings["warmup_max_lr"]
        if iteration < 0:
            return list(lows)
        gamma = self._gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(lows, highs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay back to warmup_min_lr at total_num_steps."""

    def _gamma(self, iteration: int) -> float:
        total, warmup = self.settings["total_num_steps"], max(2, self.settings["warmup_num_steps"])
        if iteration < warmup:
            return _warmup_gamma(self.settings, iteration)
        return max(0.0, float(total - iteration) / float(max(1.0, total - warmup)))


class WarmupCosineLR(DeepSpeedSchedule):
    """A ratio of each group's lr: warmup_min_ratio up to 1, then a cosine down to cos_min_ratio at total_num_steps.

    The lr is 0 before the first step: DeepSpeed's value at ``last_batch_iteration=-1``.
    """

    def lrs_at(self, iteration: int) -> list[float]:
        s = self.settings
        if iteration < 0:
            return [0.0 for _ in s["org_lrs"]]
        warmup = max(2, s["warmup_num_steps"])
        if iteration < warmup:
            ratio = s["warmup_min_ratio"] + _warmup_gamma(s, iteration) * (1.0 - s["warmup_min_ratio"])
        else:
            progress = min(1.0, (iteration - warmup + 1) / max(1, s["total_num_steps"] - warmup))
            ratio = max(0.0, s["cos_min_ratio"] + (1.0 - s["cos_min_ratio"]) * ((1 + math.cos(math.pi * progress)) / 2))
        return [lr * ratio for lr in s["org_lrs"]]


class OneCycle(DeepSpeedSchedule):
    """One cycle from cycle_min_lr up to cycle_max_lr and back, then optional decay; beta1 moves the other way.

    As in DeepSpeed, cycling momentum sets each group's betas to ``(momentum, 0.99)``: beta2 becomes 0.99.
    """

    def _cycle(self, iteration: int) -> tuple[float, float]:
        """Where ``iteration`` is: (scale in the cycle from 0 to 1, decay steps past the cycle; < 1 in it)."""
        s = self.settings
        first, second = float(s["cycle_first_step_size"]), float(s["cycle_second_step_size"])
        total, batch = first + second, iteration + 1
        x, ratio = 1.0 + batch / total - math.floor(1 + batch / total), first / total
        scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        stairs = s["cycle_first_stair_count"] if x <= ratio else s["cycle_second_stair_count"]
        if stairs > 0:  # from the whole batch offset, as DeepSpeed does, not from the float scale
            offset = batch % total
            position = offset * stairs / first if offset <= first else (total - offset) * stairs / second
            scale = math.floor(position) / stairs
        return scale, iteration - total + 1

    def _decay_factor(self, past: float, rate_key: str) -> float | None:
        """1 + rate * decay intervals, or None where DeepSpeed skips the decay (a rate or a step size of 0)."""
        s = self.settings
        if s["decay_step_size"] == 0 or s[rate_key] == 0:
            return None
        return 1 + s[rate_key] * (past / s["decay_step_size"])

    def lrs_at(self, iteration: int) -> list[float]:
        lows, highs = self.settings["cycle_min_lr"], self.settings["cycle_max_lr"]
        scale, past = self._cycle(iteration)
        if past < 1:
            return [low + (high - low) * scale for low, high in zip(lows, highs)]
        factor = self._decay_factor(past, "decay_lr_rate")
        return list(lows) if factor is None else [low / factor for low in lows]

    def momenta_at(self, iteration: int) -> list[float]:
        """Each group's beta1 at ``iteration`` (cycle_min_mom before the first step, as DeepSpeed's constructor)."""
        lows, highs = self.settings["cycle_min_mom"], self.settings["cycle_max_mom"]
        if iteration < 0:
            return list(lows)
        scale, past = self._cycle(iteration)
        if past < 1:
            return [high - (high - low) * scale for low, high in zip(lows, highs)]
        factor = self._decay_factor(past, "decay_mom_rate")
        return list(highs) if factor is None else [high * factor for high in highs]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.settings["cycle_momentum"]:
            for group, momentum in zip(self.optimizer.param_groups, self.momenta_at(self.last_epoch - 1)):
                group["betas"] = (momentum, 0.99)


class LRRangeTest(DeepSpeedSchedule):
    """lr_range_test_min_lr * (1 + step_rate * steps / step_size), continuous or in stairs."""

    def lrs_at(self, iteration: int) -> list[float]:
        s = self.settings
        interval = (iteration + 1) / s["lr_range_test_step_size"]
        interval = math.floor(interval) if s["lr_range_test_staircase"] else interval
        return [low * (1 + s["lr_range_test_step_rate"] * interval) for low in s["lr_range_test_min_lr"]]


_SCHEDULES: dict[str, type[DeepSpeedSchedule]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}


def _check_settings(name: str, s: dict[str, Any]) -> None:
    """DeepSpeed's rules, and types (DeepSpeed turns an unknown warmup_type into "log" with a warning; we refuse)."""

    def need(ok: bool, key: str, fix: str) -> None:
        if not ok:
            raise ConfigError(f"invalid scheduler.params.{key} for {name}: got {s[key]!r} ({fix})")

    for key, value in s.items():
        default = _SCHEDULE_DEFAULTS[name][key]
        if key in _PER_GROUP:
            values = value if isinstance(value, (list, tuple)) else [value]
            need(
                all(map(_is_number, values)) or (value is None and default is None),
                key,
                "write a number, or a list with one number per param group",
            )
        elif isinstance(default, bool):
            need(isinstance(value, bool), key, "write true or false")
        elif _is_number(default) or default is None or key == "total_num_steps":
            need(_is_number(value) or (value is None and default is None), key, "write a number")
    need(_is_whole(s["last_batch_iteration"], -1), "last_batch_iteration", "write -1 to start, or the last batch index")
    if "warmup_num_steps" in s:
        # 0 is DeepSpeed's "no warmup" from before 0.19.6: its log warmup then runs over its floor of 2 steps.
        need(_is_whole(s["warmup_num_steps"], 0), "warmup_num_steps", "write a whole number of steps, 0 or more")
        need(s["warmup_type"] in ("log", "linear"), "warmup_type", 'use "log" or "linear"')
    if "total_num_steps" in s:
        need(s["total_num_steps"] >= 0, "total_num_steps", "write the number of optimizer steps in the run")
        if s["total_num_steps"] < s["warmup_num_steps"]:
            get_logger().warning(
                f"scheduler {name}: total_num_steps={s['total_num_steps']} is less than "
                f"warmup_num_steps={s['warmup_num_steps']}, so the warmup never finishes"
            )
    if name == "OneCycle":
        need(s["cycle_first_step_size"] > 0, "cycle_first_step_size", "write a positive number of steps")
        need(
            s["cycle_second_step_size"] is None or s["cycle_second_step_size"] >= 0,
            "cycle_second_step_size",
            "write a number of steps >= 0, or leave it out to mirror cycle_first_step_size",
        )
        for key in ("cycle_first_stair_count", "cycle_second_stair_count"):
            need(s[key] is None or _is_whole(s[key], 0), key, "write 0 (no stairs) or more")
        need(s["decay_step_size"] >= 0, "decay_step_size", "write 0 (no decay) or a positive number of steps")
    if name == "LRRangeTest":
        need(_is_whole(s["lr_range_test_step_size"], 1), "lr_range_test_step_size", "write a positive whole number")


def _resolve_scheduler(
    block: Any, optimizer: Optimizer | None, total_num_steps: int | None, auto_values: dict[str, Any] | None
) -> tuple[type[DeepSpeedSchedule], dict[str, Any], list[BlockNote]]:
    """The schedule class, its settings and notes; per-group values become lists when ``optimizer`` is given."""
    type_name, settings = _open_block("scheduler", block)
    name = {n.lower(): n for n in _SCHEDULES}.get(type_name.lower())
    if name is None:
        raise ConfigError(
            f"unknown scheduler.type {type_name!r} ({_suggest(type_name, _SCHEDULES)}supported: "
            f"{', '.join(_SCHEDULES)}; for a torch.optim.lr_scheduler class, build it in Python)"
        )
    notes = [BlockNote("scheduler", "type", name, "phalanx's port of deepspeed.runtime.lr_schedules")]
    if total_num_steps is not None and str(settings.get("total_num_steps")).lower() == "auto":
        del settings["total_num_steps"]  # filled below from the argument, as when it is left out
    _fill_autos("scheduler", settings, dict(auto_values or {}), notes)
    defaults = _SCHEDULE_DEFAULTS[name]
    for key in settings:
        if key not in defaults:
            raise ConfigError(
                f"unknown key scheduler.params.{key} for {name} ({_suggest(key, defaults)}"
                f"{name} takes: {', '.join(defaults)})"
            )
    for key in (k for k in defaults if k not in settings):
        default = defaults[key]
        if key == "total_num_steps" and total_num_steps is not None:
            default, source = total_num_steps, "the total_num_steps argument"
        elif default is _REQUIRED:
            fix = "total_num_steps" if key == "total_num_steps" else f"auto_values={{{key!r}: ...}}"
            raise ConfigError(
                f'scheduler.params.{key} is missing and {name} needs it (write it, or write "auto" and pass {fix})'
            )
        elif key in ("cycle_second_step_size", "cycle_second_stair_count"):
            default, source = settings[key.replace("second", "first")], "DeepSpeed's default: the first half's"
        else:
            source = "DeepSpeed's default" + (": the optimizer's lr" if default is None else "")
        settings[key] = default
        if default is not None or optimizer is None:
            notes.append(BlockNote("scheduler", key, default, source))
    _check_settings(name, settings)
    if optimizer is not None:
        groups, current = optimizer.param_groups, [float(g["lr"]) for g in optimizer.param_groups]
        if settings.get("warmup_max_lr", 0) is None:
            settings["warmup_max_lr"] = current
            notes.append(BlockNote("scheduler", "warmup_max_lr", current, "DeepSpeed's default: the optimizer's lr"))
        if name == "WarmupCosineLR":
            settings["org_lrs"] = current
        if settings.get("cycle_momentum") and "betas" not in optimizer.defaults:
            settings["cycle_momentum"] = False
            why = f"DeepSpeed turns it off: {type(optimizer).__name__} has no betas"
            notes.append(BlockNote("scheduler", "cycle_momentum", False, why))
        for key in _PER_GROUP & settings.keys():
            value = settings[key]
            if isinstance(value, (list, tuple)) and len(value) != len(groups):
                raise ConfigError(
                    f"invalid scheduler.params.{key}: got {len(value)} values for {len(groups)} param "
                    f"groups (write one number for all groups, or one per group)"
                )
            settings[key] = list(value) if isinstance(value, (list, tuple)) else [value] * len(groups)
    return _SCHEDULES[name], settings, notes


def build_scheduler(
    block: dict[str, Any],
    optimizer: Optimizer,
    total_num_steps: int | None = None,
    auto_values: dict[str, Any] | None = None,
) -> DeepSpeedSchedule:
    """The LR schedule DeepSpeed builds for ``block`` over ``optimizer``; call ``step()`` after each optimizer step.

    ``total_num_steps`` fills WarmupDecayLR's and WarmupCosineLR's total_num_steps when it is ``"auto"`` or absent;
    ``auto_values`` fills other ``"auto"`` values by key (warmup_max_lr also from ``"lr"``).
    """
    cls, settings, _ = _resolve_scheduler(block, optimizer, total_num_steps, auto_values)
    return cls(optimizer, settings)


def describe_blocks(
    optimizer_block: dict[str, Any] | None = None,
    scheduler_block: dict[str, Any] | None = None,
    *,
    total_num_steps: int | None = None,
    auto_values: dict[str, Any] | None = None,
) -> list[BlockNote]:
    """Each value the blocks resolve to and its source, without building anything (for ``phalanx config``).

    Raises the ConfigError that building would. Values that depend on the optimizer's param groups (WarmupLR's
    default warmup_max_lr) show as None.
    """
    notes: list[BlockNote] = []
    if optimizer_block is not None:
        notes += _resolve_optimizer(optimizer_block, auto_values)[2]
    if scheduler_block is not None:
        notes += _resolve_scheduler(scheduler_block, None, total_num_steps, auto_values)[2]
    return notes
