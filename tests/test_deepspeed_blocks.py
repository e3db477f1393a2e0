"""DeepSpeed ``optimizer`` / ``scheduler`` blocks: hand-written formulas, torch's optimizers, and DeepSpeed itself.

The oracle tests call DeepSpeed's own code (``DeepSpeedEngine._configure_basic_optimizer``, ``_scheduler_from_config``
and ``deepspeed.runtime.lr_schedules``) and skip where deepspeed is not importable. Keep it out of phalanx's venv::

    python -m venv /tmp/ds-venv && /tmp/ds-venv/bin/pip install ... deepspeed   # see shared/PEERS.md
    /tmp/ds-venv/bin/pip install --no-deps -e . && /tmp/ds-venv/bin/python -m pytest tests/test_deepspeed_blocks.py
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx.config.dialects.deepspeed_blocks import (
    BlockNote,
    DeepSpeedSchedule,
    build_optimizer,
    build_scheduler,
    describe_blocks,
)
from phalanx.config.options import ConfigError

STEPS = 50


# --------------------------------------------------------------------------------------------------- helpers


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(make_optimizer: Callable[[Any], torch.optim.Optimizer], steps: int = 5) -> list[torch.Tensor]:
    """Parameters after ``steps`` optimizer steps on fixed data, from the same seed every time."""
    model = _model()
    optimizer = make_optimizer(model.parameters())
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 4, generator=data), torch.randn(16, 3, generator=data)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _assert_same_params(ours: list[torch.Tensor], reference: list[torch.Tensor], atol: float = 1e-7) -> None:
    moved = max((a - b).abs().max().item() for a, b in zip(ours, _train(lambda p: torch.optim.SGD(p, lr=0.0))))
    assert moved > 1e-3, "the parameters hardly moved, so the comparison proves nothing"
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def _optimizer(lr: float = 0.05, kind: str = "sgd", groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr)


def _lrs(optimizer: torch.optim.Optimizer, schedule: Any, steps: int = STEPS) -> list[list[float]]:
    """The lr of each group in use at each optimizer step (the schedule steps after the optimizer, as DeepSpeed)."""
    out = []
    for _ in range(steps):
        out.append([float(g["lr"]) for g in optimizer.param_groups])
        optimizer.step()
        schedule.step()
    return out


def _deepspeed() -> Any:
    """DeepSpeed's modules, or a skip. It is installed in a separate venv only (see the module docstring)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.runtime import lr_schedules
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
        from deepspeed.runtime.engine import DeepSpeedEngine
    except (ImportError, RuntimeError, OSError, AttributeError) as err:  # or an accelerator that fails to load
        pytest.skip(f"deepspeed is not importable here ({type(err).__name__}: {err}); see shared/PEERS.md")

    class ConfigOnlyEngine:
        """Just enough of a DeepSpeedEngine for its own methods to read an optimizer and a scheduler block."""

        get_optimizer_configuration = DeepSpeedEngine.get_optimizer_configuration
        zenflow = False
        has_moe_layers = False

        def __init__(self, config: dict[str, Any]) -> None:
            self.config = copy.deepcopy(config)

        def optimizer_name(self) -> str:  # as DeepSpeedConfig: its own names in lower case, torch's as written
            name = self.config["optimizer"]["type"]
            return name.lower() if name.lower() in DEEPSPEED_OPTIMIZERS else name

        def optimizer_params(self) -> dict[str, Any]:
            return self.config["optimizer"].get("params", {})

        def scheduler_name(self) -> str:
            return self.config["scheduler"]["type"]

        def scheduler_params(self) -> dict[str, Any]:
            return self.config["scheduler"].get("params", {})

        def zero_use_cpu_optimizer(self) -> bool:
            return False

        def bf16_optimizer_states(self) -> bool:
            return False

        def build_optimizer(self, params: Any) -> torch.optim.Optimizer:
            return DeepSpeedEngine._configure_basic_optimizer(self, params)

        def build_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
            return DeepSpeedEngine._scheduler_from_config(self, optimizer)

    return ConfigOnlyEngine, lr_schedules


# -------------------------------------------------------------------------------------- schedules: formulas

LOG10 = math.log(10)


def _cosine(k: int) -> float:
    """WarmupCosineLR below at DeepSpeed iteration k: lr 0.05, ratios 0.1 -> 1 (linear, 10 steps) -> 0.01 at 40."""
    if k < 0:
        return 0.0
    if k < 10:
        return 0.05 * (0.1 + (k / 10) * 0.9)
    progress = min(1.0, (k - 9) / 30)
    return 0.05 * (0.01 + 0.99 * (1 + math.cos(math.pi * progress)) / 2)


def _one_cycle(k: int) -> float:
    """OneCycle below: 0.01 -> 0.1 over 10 steps, back over 10, then 0.01 / (1 + 0.5 * (k - 19) / 5)."""
    if k >= 20:
        return 0.01 / (1 + 0.5 * ((k - 19) / 5))
    x = ((k + 1) / 20) % 1.0
    scale = x / 0.5 if x <= 0.5 else 2 * (1 - x)
    return 0.01 + 0.09 * scale


SCHEDULES: dict[str, tuple[dict[str, Any], Callable[[int], float]]] = {
    "warmup-log": (
        {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 10}},
        lambda k: 0.001 if k < 0 else 0.001 + 0.009 * (math.log(k + 1) / LOG10 if k < 10 else 1.0),
    ),
    "warmup-linear": (
        {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 10, "warmup_type": "linear"},
        },
        lambda k: 0.001 if k < 0 else 0.001 + 0.009 * min(1.0, k / 10),
    ),
    "warmup-default-max": (  # warmup_max_lr left out: the optimizer's lr (0.05)
        {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}},
        lambda k: 0.0 if k < 0 else 0.05 * min(1.0, k / 10),
    ),
    "warmup-decay": (
        {
            "type": "WarmupDecayLR",
            "params": {
                "total_num_steps": 40,
                "warmup_min_lr": 0.001,
                "warmup_max_lr": 0.01,
                "warmup_num_steps": 10,
                "warmup_type": "linear",
            },
        },
        lambda k: 0.001 if k < 0 else 0.001 + 0.009 * (k / 10 if k < 10 else max(0.0, (40 - k) / 30)),
    ),
    "warmup-decay-log": (
        {"type": "WarmupDecayLR", "params": {"total_num_steps": 30, "warmup_num_steps": 10}},  # max_lr: 0.001
        lambda k: 0.0 if k < 0 else 0.001 * (math.log(k + 1) / LOG10 if k < 10 else max(0.0, (30 - k) / 20)),
    ),
    "warmup-cosine": (
        {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": 40,
                "warmup_min_ratio": 0.1,
                "cos_min_ratio": 0.01,
                "warmup_num_steps": 10,
                "warmup_type": "linear",
            },
        },
        _cosine,
    ),
    "one-cycle": (
        {
            "type": "OneCycle",
            "params": {
                "cycle_min_lr": 0.01,
                "cycle_max_lr": 0.1,
                "cycle_first_step_size": 10,
                "decay_lr_rate": 0.5,
                "decay_step_size": 5,
            },
        },
        _one_cycle,
    ),
    "one-cycle-stairs": (  # 10 up in 2 stairs of 5, 5 down in 1 stair, no decay
        {
            "type": "OneCycle",
            "params": {
                "cycle_min_lr": 0.01,
                "cycle_max_lr": 0.1,
                "cycle_first_step_size": 10,
                "cycle_second_step_size": 5,
                "cycle_first_stair_count": 2,
                "cycle_second_stair_count": 1,
            },
        },
        lambda k: (
            0.01
            if k >= 15
            else 0.01
            + 0.09
            * (math.floor((k + 1) % 15 * 2 / 10) / 2 if (k + 1) % 15 <= 10 else math.floor((15 - (k + 1) % 15) / 5))
        ),
    ),
    "range-test": (
        {
            "type": "LRRangeTest",
            "params": {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 5, "lr_range_test_step_rate": 2.0},
        },
        lambda k: 0.01 * (1 + 2.0 * (k + 1) / 5),
    ),
    "range-test-stairs": (
        {
            "type": "LRRangeTest",
            "params": {
                "lr_range_test_min_lr": 0.01,
                "lr_range_test_step_size": 5,
                "lr_range_test_step_rate": 2.0,
                "lr_range_test_staircase": True,
            },
        },
        lambda k: 0.01 * (1 + 2.0 * math.floor((k + 1) / 5)),
    ),
}


@pytest.mark.parametrize("case", SCHEDULES)
def test_schedule_matches_the_formula(case: str) -> None:
    block, formula = SCHEDULES[case]
    optimizer = _optimizer()
    schedule = build_scheduler(block, optimizer)
    assert isinstance(schedule, torch.optim.lr_scheduler.LRScheduler) and isinstance(schedule, DeepSpeedSchedule)
    lrs = _lrs(optimizer, schedule)
    # The lr at optimizer step n is DeepSpeed's value at last_batch_iteration = n - 1.
    for n in (0, 1, 2, 5, 9, 10, 11, 12, 15, 19, 20, 21, 25, 30, 39, 40, 41, 49):
        assert lrs[n][0] == pytest.approx(formula(n - 1), rel=1e-12, abs=1e-15), f"{case} at step {n}"
    assert schedule.last_batch_iteration == STEPS - 1


def test_warmup_cosine_starts_at_zero_and_ends_at_the_floor() -> None:
    optimizer = _optimizer(lr=0.05)
    lrs = _lrs(optimizer, build_scheduler(SCHEDULES["warmup-cosine"][0], optimizer))
    assert lrs[0] == [0.0]  # DeepSpeed's first step runs at lr 0
    assert lrs[1][0] == pytest.approx(0.005)  # warmup_min_ratio * lr
    assert lrs[41][0] == lrs[49][0] == pytest.approx(0.05 * 0.01)  # cos_min_ratio * lr, held


def test_one_cycle_cycles_beta1_and_sets_beta2_to_0_99() -> None:
    optimizer = _optimizer(kind="adam")
    schedule = build_scheduler(
        {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10}},
        optimizer,
    )
    betas = []
    for _ in range(30):
        betas.append(optimizer.param_groups[0]["betas"])
        optimizer.step()
        schedule.step()
    assert betas[0] == (0.8, 0.99)  # cycle_min_mom before the first step, as DeepSpeed's constructor sets it
    assert betas[1] == pytest.approx((0.9 - 0.1 * 0.1, 0.99))  # iteration 0 is batch 1 of 10 up: scale 0.1
    assert betas[10] == pytest.approx((0.8, 0.99))  # the lr peak is the momentum trough
    assert betas[6] == pytest.approx((0.9 - 0.1 * 0.6, 0.99))
    assert betas[25] == pytest.approx((0.9, 0.99))  # after the cycle, without decay: cycle_max_mom


def test_one_cycle_leaves_sgd_momentum_alone() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.5)
    block = {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}}
    schedule = build_scheduler(block, optimizer)
    _lrs(optimizer, schedule, steps=6)
    assert optimizer.param_groups[0]["momentum"] == 0.5 and "betas" not in optimizer.param_groups[0]
    assert schedule.settings["cycle_momentum"] is False  # as DeepSpeed: SGD has no betas to cycle


def test_per_group_values() -> None:
    optimizer = _optimizer(groups=2)
    block = {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": [0.0, 0.001],
            "warmup_max_lr": [0.01, 0.1],
            "warmup_num_steps": 4,
            "warmup_type": "linear",
        },
    }
    lrs = _lrs(optimizer, build_scheduler(block, optimizer), steps=8)
    assert lrs[0] == [0.0, 0.001]
    assert lrs[3] == pytest.approx([0.01 * 2 / 4, 0.001 + 0.099 * 2 / 4])
    assert lrs[7] == pytest.approx([0.01, 0.1])


def test_state_dict_is_json_and_resumes_the_sequence() -> None:
    block = SCHEDULES["one-cycle"][0]
    optimizer = _optimizer(kind="adam")
    whole = _lrs(optimizer, build_scheduler(block, optimizer), steps=40)

    first = _optimizer(kind="adam")
    schedule = build_scheduler(block, first)
    _lrs(first, schedule, steps=17)
    saved = json.loads(json.dumps(schedule.state_dict()))  # plain numbers, strings and lists only
    assert saved["last_epoch"] == 17 and saved["settings"]["cycle_max_lr"] == [0.1]

    second = _optimizer(kind="adam")
    resumed = build_scheduler(block, second)
    resumed.load_state_dict(saved)
    second.param_groups[0]["lr"] = first.param_groups[0]["lr"]  # the optimizer's own state_dict carries the lr
    assert _lrs(second, resumed, steps=23) == whole[17:]


def test_last_batch_iteration_starts_mid_schedule() -> None:
    block = {
        "type": "WarmupLR",
        "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 10, "warmup_type": "linear", "last_batch_iteration": 4},
    }
    optimizer = _optimizer()
    lrs = _lrs(optimizer, build_scheduler(block, optimizer), steps=10)
    assert lrs[0][0] == pytest.approx(0.01 * 4 / 10) and lrs[1][0] == pytest.approx(0.01 * 5 / 10)
    assert lrs[6][0] == lrs[9][0] == pytest.approx(0.01)


# -------------------------------------------------------------------------------------------- optimizers

OPTIMIZERS: dict[str, tuple[dict[str, Any], Callable[[Any], torch.optim.Optimizer]]] = {
    # DeepSpeed's "Adam" is AdamW (decoupled decay) unless adam_w_mode is false.
    "adam-default-w-mode": (
        {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}},
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    ),
    "adam-l2": (
        {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}},
        lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1),
    ),
    "adam-lowercase-betas": (
        {"type": "adam", "params": {"lr": 0.02, "betas": [0.8, 0.95], "eps": 1e-6}},
        lambda p: torch.optim.AdamW(p, lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
    ),
    # "AdamW" is decoupled whatever adam_w_mode says.
    "adamw-ignores-w-mode": (
        {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.2, "adam_w_mode": False}},
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.2),
    ),
    # FusedAdam's weight decay defaults to 0, not torch AdamW's 0.01 ...
    "adamw-no-decay": (
        {"type": "AdamW", "params": {"lr": 0.01}},
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.0),
    ),
    # ... but with torch_adam DeepSpeed calls torch's AdamW, whose default is 0.01.
    "adamw-torch-adam": (
        {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        lambda p: torch.optim.AdamW(p, lr=0.01),
    ),
    "adam-torch-amsgrad": (
        {
            "type": "Adam",
            "params": {"lr": 0.01, "torch_adam": True, "adam_w_mode": False, "amsgrad": True, "weight_decay": 0.05},
        },
        lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=0.05),
    ),
    "sgd-momentum": (
        {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}},
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    ),
    "adagrad": (
        {"type": "Adagrad", "params": {"lr": 0.1, "lr_decay": 0.01}},
        lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01),
    ),
}


@pytest.mark.parametrize("case", OPTIMIZERS)
def test_optimizer_equals_torch(case: str) -> None:
    block, reference = OPTIMIZERS[case]
    ours = _train(lambda p: build_optimizer(block, p))
    _assert_same_params(ours, _train(reference))
    assert type(build_optimizer(block, _model().parameters())) is type(reference(_model().parameters()))


def test_the_weight_decay_default_matters() -> None:
    # Guards the test above: AdamW with torch's default decay ends elsewhere than DeepSpeed's AdamW without one.
    ours = _train(lambda p: build_optimizer({"type": "AdamW", "params": {"lr": 0.01}}, p))
    torch_default = _train(lambda p: torch.optim.AdamW(p, lr=0.01))
    assert max((a - b).abs().max().item() for a, b in zip(ours, torch_default)) > 1e-6


# ------------------------------------------------------------------------------------------------- "auto"


def test_auto_values_fill_the_optimizer() -> None:
    block = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto"}}
    optimizer = build_optimizer(
        block, _model().parameters(), auto_values={"lr": 3e-4, "weight_decay": 0.01, "betas": [0.9, 0.95]}
    )
    assert optimizer.defaults["lr"] == 3e-4 and optimizer.defaults["weight_decay"] == 0.01
    assert optimizer.defaults["betas"] == (0.9, 0.95)
    notes = describe_blocks(block, auto_values={"lr": 3e-4, "weight_decay": 0.01, "betas": [0.9, 0.95]})
    assert BlockNote("optimizer", "lr", 3e-4, "\"auto\", filled from auto_values['lr']") in notes
    assert ("eps", 1e-8, "default of DeepSpeed's FusedAdam") in [(n.key, n.value, n.source) for n in notes]
    assert notes[0].key == "type" and notes[0].value == "torch.optim.AdamW"


def test_auto_values_fill_the_schedule() -> None:
    block = {
        "type": "WarmupDecayLR",
        "params": {
            "total_num_steps": "auto",
            "warmup_max_lr": "auto",
            "warmup_min_lr": "auto",
            "warmup_num_steps": "auto",
        },
    }
    auto = {"lr": 0.02, "warmup_min_lr": 0.0, "warmup_num_steps": 5}
    optimizer = _optimizer()
    schedule = build_scheduler(block, optimizer, total_num_steps=25, auto_values=auto)
    assert schedule.settings["total_num_steps"] == 25 and schedule.settings["warmup_max_lr"] == [0.02]
    lrs = _lrs(optimizer, schedule, steps=30)
    assert lrs[6][0] == pytest.approx(0.02) and lrs[26][0] == 0.0
    sources = {n.key: n.source for n in describe_blocks(None, block, total_num_steps=25, auto_values=auto)}
    assert sources["total_num_steps"] == "the total_num_steps argument"
    assert sources["warmup_max_lr"] == "\"auto\", filled from auto_values['lr']"
    assert sources["warmup_type"] == "DeepSpeed's default"


def test_total_num_steps_left_out_comes_from_the_argument() -> None:
    block = {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}}
    schedule = build_scheduler(block, _optimizer(), total_num_steps=100)
    assert schedule.settings["total_num_steps"] == 100
    notes = describe_blocks(None, block, total_num_steps=100)
    assert BlockNote("scheduler", "total_num_steps", 100, "the total_num_steps argument") in notes


def test_describe_shows_what_adam_means() -> None:
    adam = describe_blocks({"type": "Adam", "params": {"lr": 0.001, "weight_decay": 0.1}})
    assert adam[0].value == "torch.optim.AdamW" and "adam_w_mode defaults to true" in adam[0].source
    l2 = describe_blocks({"type": "Adam", "params": {"lr": 0.001, "adam_w_mode": False}})
    assert l2[0].value == "torch.optim.Adam" and "L2" in l2[0].source
    assert str(adam[1]) == "optimizer.lr = 0.001 (config)"


# ------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "block, auto, words",
    [
        ({"type": "AdamX", "params": {}}, None, ["unknown optimizer.type 'AdamX'", "did you mean 'Adam"]),
        (
            {"type": "AdamW", "params": {"weight_decy": 0.1}},
            None,
            ["optimizer.params.weight_decy", "did you mean 'weight_decay'", "FusedAdam takes"],
        ),
        ({"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}, None, ["momentun", "did you mean 'momentum'"]),
        (
            {"type": "Adam", "params": {"lr": "auto"}},
            {"weight_decay": 0.0},
            ['optimizer.params.lr is "auto"', "auto_values={'lr': ...}"],
        ),
        ({"type": "Adam", "params": {"lr": "auto"}}, None, ['optimizer.params.lr is "auto"']),
        ({"type": "Lamb", "params": {"lr": 0.01}}, None, ["'Lamb' is not supported", "FusedLamb"]),
        ({"type": "Adam", "params": {"amsgrad": True}}, None, ["amsgrad", '"torch_adam": true']),
        ({"type": "Adam", "params": {"max_grad_norm": 1.0}}, None, ["max_grad_norm", "gradient_clipping"]),
        ({"type": "Adam", "params": {"lr": "3e-4"}}, None, ["invalid optimizer.params.lr: got '3e-4'", "number"]),
        ({"type": "Adam", "params": {"betas": [0.9]}}, None, ["optimizer.params.betas", "2 numbers"]),
        ({"type": "Adam", "parms": {}}, None, ["unknown key optimizer.parms", "did you mean 'params'"]),
        ({"type": "SGD", "params": {"lr": -1.0}}, None, ["torch.optim.SGD refused", "Invalid learning rate"]),
    ],
)
def test_optimizer_errors(block: dict[str, Any], auto: dict[str, Any] | None, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        build_optimizer(block, _model().parameters(), auto_values=auto)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    "block, words",
    [
        (
            {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
            ["scheduler.params.total_num_steps is missing", "WarmupDecayLR needs it", "pass total_num_steps"],
        ),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}},
            ['scheduler.params.total_num_steps is "auto"'],
        ),
        (
            {"type": "WarmupLinearLR", "params": {}},
            ["unknown scheduler.type 'WarmupLinearLR'", "did you mean", "WarmupLR, WarmupDecayLR"],
        ),
        (
            {"type": "WarmupLR", "params": {"warmup_steps": 10}},
            ["scheduler.params.warmup_steps", "did you mean 'warmup_num_steps'"],
        ),
        ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, ["warmup_type", "'cosine'", '"linear"']),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 100.0}}, ["warmup_num_steps", "100.0", "whole number"]),
        ({"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}}, ["2 values for 1 param groups"]),
        ({"type": "WarmupLR", "params": {"warmup_max_lr": "0.1"}}, ["warmup_max_lr", "'0.1'", "number"]),
        ({"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}, ["cycle_min_lr is missing"]),
        (
            {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 0}},
            ["cycle_first_step_size", "positive"],
        ),
        ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}, ["lr_range_test_step_size"]),
    ],
)
def test_scheduler_errors(block: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        build_scheduler(block, _optimizer())
    for word in words:
        assert word in str(err.value)


def test_describe_raises_what_building_would() -> None:
    with pytest.raises(ConfigError, match="total_num_steps is missing"):
        describe_blocks(None, {"type": "WarmupDecayLR", "params": {}})


# --------------------------------------------------------------------------------------- DeepSpeed itself


@pytest.mark.parametrize("case", SCHEDULES)
def test_schedule_matches_deepspeed(case: str) -> None:
    engine, _ = _deepspeed()
    block = SCHEDULES[case][0]
    kind = "adam" if block["type"] == "OneCycle" else "sgd"
    ours_optimizer, ds_optimizer = _optimizer(kind=kind, groups=2), _optimizer(kind=kind, groups=2)
    ours, theirs = build_scheduler(block, ours_optimizer), engine({"scheduler": block}).build_scheduler(ds_optimizer)
    for step in range(STEPS):
        for a, b in zip(ours_optimizer.param_groups, ds_optimizer.param_groups):
            # Bit for bit: the same arithmetic in the same order.
            assert (a["lr"], a.get("betas")) == (b["lr"], b.get("betas")), f"{case} at step {step}"
        for optimizer, schedule in ((ours_optimizer, ours), (ds_optimizer, theirs)):
            optimizer.step()
            schedule.step()
    assert ours.last_batch_iteration == theirs.last_batch_iteration == STEPS - 1


def test_resumed_schedule_matches_deepspeed() -> None:
    _, lr_schedules = _deepspeed()
    params = {"total_num_steps": 30, "warmup_num_steps": 10, "warmup_max_lr": 0.01, "last_batch_iteration": 6}
    ours_optimizer, ds_optimizer = _optimizer(), _optimizer()
    ours = build_scheduler({"type": "WarmupDecayLR", "params": params}, ours_optimizer)
    theirs = lr_schedules.WarmupDecayLR(ds_optimizer, **params)
    for _ in range(30):  # DeepSpeed leaves the lr alone until its first step, so compare after each step
        for optimizer, schedule in ((ours_optimizer, ours), (ds_optimizer, theirs)):
            optimizer.step()
            schedule.step()
        assert ours_optimizer.param_groups[0]["lr"] == ds_optimizer.param_groups[0]["lr"]


# The cases where DeepSpeed calls torch; the others go to its FusedAdam.
TORCH_PATH = [case for case in OPTIMIZERS if "torch" in case or case in ("sgd-momentum", "adagrad")]


@pytest.mark.parametrize("case", TORCH_PATH)
def test_optimizer_matches_deepspeed(case: str) -> None:
    engine, _ = _deepspeed()
    block = OPTIMIZERS[case][0]
    theirs = _train(lambda p: engine({"optimizer": block}).build_optimizer(p))
    _assert_same_params(_train(lambda p: build_optimizer(block, p)), theirs)


def _fused_adam_is_built() -> bool:
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return any(name.endswith(".so") for name in os.listdir(_get_build_directory("fused_adam", False)))
    except (ImportError, OSError):
        return False


@pytest.mark.parametrize("case", [c for c in OPTIMIZERS if c not in TORCH_PATH])
def test_fused_adam_matches_deepspeed(case: str) -> None:
    engine, _ = _deepspeed()
    if not _fused_adam_is_built():
        pytest.skip(
            "DeepSpeed's FusedAdam CPU op is not built; build it once (about 3 min on 2 cores) with "
            "DS_ACCELERATOR=cpu python -c 'from deepspeed.ops.op_builder import FusedAdamBuilder as B; "
            "B().load()'"
        )
    block = OPTIMIZERS[case][0]
    built = engine({"optimizer": block}).build_optimizer(_model().parameters())
    assert type(built).__name__ == "FusedAdam"
    theirs = _train(lambda p: engine({"optimizer": block}).build_optimizer(p))
    # FusedAdam's CPU kernel orders the same arithmetic differently, so allow float32 rounding.
    _assert_same_params(_train(lambda p: build_optimizer(block, p)), theirs, atol=1e-6)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_without_bias_correction_follows_fused_adam_s_formula(adam_w_mode: bool) -> None:
    """BERT's recipe (FusedAdam with bias_correction false), against the formula written out in float64."""
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.99, 1e-6, 0.01
    block = {"type": "Adam", "params": {"lr": lr, "betas": [b1, b2], "eps": eps, "weight_decay": wd,
                                        "bias_correction": False, "adam_w_mode": adam_w_mode}}  # fmt: skip
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(5, dtype=torch.float64))
    opt = build_optimizer(block, [p])
    assert type(opt).__name__ == "AdamNoBiasCorrection"
    w, m, v = p.detach().clone(), torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for _ in range(3):
        g = torch.randn(5, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        g = g if adam_w_mode else g + wd * w
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (v.sqrt() + eps) + (wd * w if adam_w_mode else 0))
        torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-12)
    notes = [str(n) for n in describe_blocks(block)]
    assert any("no bias correction" in n for n in notes), notes
