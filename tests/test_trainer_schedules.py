"""The seven Hugging Face LR schedules: hand-computed values, transformers' own schedulers, JSON state and resume."""

from __future__ import annotations

import json
import math

import pytest
import torch

from phalanx.checkpoint.format import from_json, to_json
from phalanx.config.settings import ConfigError
from phalanx.trainer.arguments import TrainingArguments
from phalanx.trainer.schedules import PLATEAU, SCHEDULES, WarmupSchedule, get_scheduler, warmup_steps_for

LR = 0.1


def _optimizer(lrs: tuple[float, ...] = (LR,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def _lrs(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[list[float]]:
    """The lr of every group before each optimizer step, for ``steps`` steps."""
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in scheduler.optimizer.param_groups])
        scheduler.optimizer.step()
        scheduler.step()
    return out


# (name, warmup, total, kwargs, {step: factor of the initial lr}), each factor worked out by hand from the formula.
CASES = [
    ("linear", 4, 10, None, {0: 0.0, 2: 0.5, 4: 1.0, 7: 0.5, 10: 0.0, 12: 0.0}),
    ("cosine", 2, 10, None, {1: 0.5, 2: 1.0, 6: 0.5, 10: 0.0}),
    ("cosine", 2, 10, {"num_cycles": 1.0}, {6: 0.0, 10: 1.0, 4: 0.5}),
    ("cosine_with_min_lr", 2, 10, {"min_lr_rate": 0.1}, {2: 1.0, 6: 0.55, 10: 0.1}),
    ("cosine_with_min_lr", 2, 10, {"min_lr": 0.01}, {2: 1.0, 6: 0.55, 10: 0.1}),
    ("constant", 0, 10, None, {0: 1.0, 5: 1.0, 50: 1.0}),
    ("constant_with_warmup", 4, None, None, {0: 0.0, 1: 0.25, 4: 1.0, 40: 1.0}),
    # lr_init 0.1, lr_end 0.01, power 2: at step 6, (0.09 * 0.5**2 + 0.01) / 0.1 = 0.325; from step 10, 0.01 / 0.1.
    ("polynomial", 2, 10, {"lr_end": 0.01, "power": 2.0}, {1: 0.5, 2: 1.0, 6: 0.325, 10: 0.1, 13: 0.1}),
    ("polynomial", 0, 10, None, {5: ((0.1 - 1e-7) * 0.5 + 1e-7) / 0.1, 10: 1e-6}),
    ("inverse_sqrt", 4, None, None, {2: 0.5, 4: 1.0, 12: 1 / math.sqrt(3)}),
    ("inverse_sqrt", 4, None, {"timescale": 10}, {4: 1 / math.sqrt(1.0 + 0 / 10), 10: 1 / math.sqrt(1.6)}),
    ("inverse_sqrt", 0, None, None, {0: 1.0, 30_000: 0.5}),  # timescale defaults to 10_000 without warmup
]


@pytest.mark.parametrize("name,warmup,total,kwargs,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_hand_computed_factors(name, warmup, total, kwargs, expected):
    scheduler = get_scheduler(name, _optimizer(), warmup, total, kwargs)
    assert isinstance(scheduler, WarmupSchedule)
    for step, factor in expected.items():
        assert scheduler.factor(step) == pytest.approx(factor, rel=1e-12, abs=1e-15), step
    if max(expected) <= 20:
        lrs = _lrs(scheduler, max(expected) + 1)
        for step, factor in expected.items():
            assert lrs[step][0] == pytest.approx(LR * factor, rel=1e-12, abs=1e-15), step


def test_polynomial_divides_by_the_default_lr_for_every_group():
    # transformers' quirk, kept: lr_end is measured against optimizer.defaults["lr"], not each group's lr.
    scheduler = get_scheduler("polynomial", _optimizer((0.1, 0.2)), 0, 10, {"lr_end": 0.01})
    lrs = _lrs(scheduler, 11)
    assert lrs[10] == pytest.approx([0.01, 0.02])


@pytest.mark.parametrize(
    "name,warmup,total,kwargs", [c[:4] for c in CASES], ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_same_lrs_as_transformers(name, warmup, total, kwargs):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (a test extra)")
    ours = get_scheduler(name, _optimizer((LR, 0.3)), warmup, total, kwargs)
    theirs = transformers.get_scheduler(name, _optimizer((LR, 0.3)), warmup, total, kwargs)
    steps = 16 if total is None else total + 4
    torch.testing.assert_close(
        torch.tensor(_lrs(ours, steps), dtype=torch.float64),
        torch.tensor(_lrs(theirs, steps), dtype=torch.float64),
        rtol=1e-12,
        atol=0,
    )


@pytest.mark.parametrize("name", [s for s in SCHEDULES if s != PLATEAU])  # torch's own ReduceLROnPlateau aside
def test_state_dict_is_json_and_resume_continues_the_sequence(name):
    kwargs = {"min_lr_rate": 0.2} if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr") else None
    straight = _lrs(get_scheduler(name, _optimizer(), 3, 12, kwargs), 12)
    first = get_scheduler(name, _optimizer(), 3, 12, kwargs)
    head = _lrs(first, 5)
    saved = json.loads(json.dumps(to_json(first.state_dict(), "scheduler0", None)))  # as a checkpoint holds it
    assert saved["last_epoch"] == 5 and saved["schedule"]["kind"] == name
    resumed = get_scheduler(name, _optimizer(), 3, 12, kwargs)
    resumed.load_state_dict(from_json(saved, None))
    assert head + _lrs(resumed, 7) == straight


def test_resume_keeps_the_formula_it_was_built_with():
    # As a LambdaLR does: a run resumed with a longer max_steps follows its new length from the saved step.
    first = get_scheduler("linear", _optimizer(), 0, 10)
    _lrs(first, 5)
    longer = get_scheduler("linear", _optimizer(), 0, 20)
    longer.load_state_dict(first.state_dict())
    assert longer.last_epoch == 5 and longer.schedule["num_training_steps"] == 20
    assert _lrs(longer, 1)[0][0] == pytest.approx(LR * 15 / 20)


def test_errors_name_the_value_and_the_fix():
    with pytest.raises(ConfigError, match=r"lr_end=0.5 must be below the initial learning rate 0.1"):
        get_scheduler("polynomial", _optimizer(), 0, 10, {"lr_end": 0.5})
    with pytest.raises(ConfigError, match="lr_scheduler_type='linear' needs num_training_steps >= 1; got None"):
        get_scheduler("linear", _optimizer(), 0, None)
    with pytest.raises(ConfigError, match="needs num_warmup_steps >= 0; got -2"):
        get_scheduler("cosine", _optimizer(), -2, 10)
    with pytest.raises(
        ConfigError, match="lr_scheduler_kwargs key 'num_cycles' is not read by lr_scheduler_type='linear'"
    ):
        get_scheduler("linear", _optimizer(), 0, 10, {"num_cycles": 2})
    with pytest.raises(ConfigError, match="needs exactly one of min_lr or min_lr_rate"):
        get_scheduler("cosine_with_min_lr", _optimizer(), 0, 10, {"min_lr": 0.01, "min_lr_rate": 0.1})
    with pytest.raises(ConfigError, match="unknown lr_scheduler_type 'liner'; did you mean 'linear'?"):
        get_scheduler("liner", _optimizer(), 0, 10)


def test_warmup_steps_for_the_arguments():
    assert warmup_steps_for(TrainingArguments(warmup_steps=100), 1000) == 100
    assert warmup_steps_for(TrainingArguments(warmup_steps=0.1), 1000) == 100
    assert warmup_steps_for(TrainingArguments(warmup_steps=0.1), 1001) == 101  # rounded up, as transformers
    assert warmup_steps_for(TrainingArguments(warmup_steps=0.999), 3) == 3
    args = TrainingArguments(lr_scheduler_type="cosine", warmup_steps=0.25, lr_scheduler_kwargs={"num_cycles": 0.5})
    scheduler = get_scheduler(
        args.lr_scheduler_type, _optimizer(), warmup_steps_for(args, 8), 8, args.lr_scheduler_kwargs
    )
    assert [round(lr[0] / LR, 6) for lr in _lrs(scheduler, 3)] == [0.0, 0.5, 1.0]
