"""Hugging Face's LR schedules: hand-computed values, transformers' own schedulers, JSON state and resume; the two that
step on a metric (reduce_lr_on_plateau, greedy) apart."""

from __future__ import annotations

import json
import math

import pytest
import torch

from phalanx.checkpoint.format import from_json, to_json
from phalanx.config.settings import ConfigError
from phalanx.trainer.arguments import TrainingArguments
from phalanx.trainer.schedules import (
    GREEDY,
    PLATEAU,
    SCHEDULES,
    GreedyLR,
    WarmupSchedule,
    get_scheduler,
    warmup_steps_for,
)

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
    # warmup 2, then 10 - 2 - 4 = 4 stable steps, then a half-cosine over 4 steps down to 0.
    ("warmup_stable_decay", 2, 10, {"num_decay_steps": 4}, {1: 0.5, 2: 1.0, 5: 1.0, 6: 1.0, 8: 0.5, 10: 0.0}),
    # the same run with a linear decay to a floor of 0.2: each factor is 0.2 + 0.8 x the plain one.
    ("warmup_stable_decay", 2, 10, {"num_decay_steps": 4, "decay_type": "linear", "min_lr_ratio": 0.2},
     {1: 0.6, 4: 1.0, 8: 0.6, 10: 0.2, 12: 0.2}),
    ("warmup_stable_decay", 2, None, {"num_decay_steps": 4, "num_stable_steps": 2, "warmup_type": "1-sqrt",
     "decay_type": "1-sqrt"}, {1: 1 - math.sqrt(0.5), 2: 1.0, 3: 1.0, 5: 0.5, 8: 0.0}),
    ("warmup_stable_decay", 4, None, {"num_decay_steps": 2, "num_stable_steps": 0, "warmup_type": "cosine"},
     {2: 0.5, 4: 1.0, 5: 0.5, 6: 0.0}),
]  # fmt: skip


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


@pytest.mark.parametrize("name", [s for s in SCHEDULES if s not in (PLATEAU, GREEDY)])  # they step on a metric
def test_state_dict_is_json_and_resume_continues_the_sequence(name):
    kwargs = {"min_lr_rate": 0.2} if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr") else None
    kwargs = {"num_decay_steps": 4} if name == "warmup_stable_decay" else kwargs
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


def _metrics() -> list[float]:
    """An evaluation metric that falls, stalls and climbs, with noise: every branch of GreedyLR is taken."""
    g = torch.Generator().manual_seed(0)
    trend = [1.0 - 0.04 * i for i in range(20)] + [0.2] * 20 + [0.2 + 0.03 * i for i in range(20)]
    return [t + 0.01 * float(torch.randn((), generator=g)) for t in trend] * 2


GREEDY_CASES = [
    {"patience": 1, "factor": 0.5},
    {"patience": 2, "cooldown": 2, "warmup": 1, "threshold_mode": "rel", "threshold": 0.01, "min_lr": 0.01,
     "max_lr": 0.3},
    {"mode": "max", "smooth": True, "window_size": 3, "patience": 1, "reset_start": 2, "min_lr": [0.05, 0.02],
     "factor": 0.5},
]  # fmt: skip


@pytest.mark.parametrize("kwargs", GREEDY_CASES, ids=["plain", "rel-cooldown-warmup", "max-smooth-reset"])
def test_greedy_same_lrs_as_transformers(kwargs):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (a test extra)")
    ours = get_scheduler(GREEDY, _optimizer((LR, 0.3)), 0, 10, kwargs)
    theirs = transformers.get_scheduler(GREEDY, _optimizer((LR, 0.3)), 0, 10, scheduler_specific_kwargs=kwargs)
    assert isinstance(ours, GreedyLR)
    seen = set()
    for metric in _metrics():
        ours.step(metric)
        theirs.step(metric)
        lrs = [g["lr"] for g in ours.optimizer.param_groups]
        assert lrs == pytest.approx([g["lr"] for g in theirs.optimizer.param_groups], rel=1e-12)
        assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), rel=1e-12)
        seen.add(tuple(lrs))
    assert len(seen) > 3  # the rates did move, up and down
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert set(mine) == set(reference)  # transformers' keys: a scheduler.pt of theirs loads here
    if "_streaming_avg" in mine:  # the window of the last metrics
        assert mine.pop("_streaming_avg")["values"] == pytest.approx(reference.pop("_streaming_avg")["values"])
    for key, value in reference.items():
        assert mine[key] == (value if isinstance(value, str) else pytest.approx(value, rel=1e-12)), key


def test_greedy_state_is_json_and_resume_continues():
    kwargs = {"patience": 1, "cooldown": 1, "smooth": True, "window_size": 4}
    metrics = _metrics()[:50]
    straight = get_scheduler(GREEDY, _optimizer(), 0, None, kwargs)
    expected = []
    for m in metrics:
        straight.step(m)
        expected.append(straight.get_last_lr()[0])
    first = get_scheduler(GREEDY, _optimizer(), 0, None, kwargs)
    for m in metrics[:25]:
        first.step(m)
    saved = json.loads(json.dumps(to_json(first.state_dict(), "scheduler0", None)))
    resumed = get_scheduler(GREEDY, _optimizer(), 0, None, kwargs)
    resumed.load_state_dict(from_json(saved, None))
    assert resumed.optimizer.param_groups[0]["lr"] == expected[24]  # the groups take the saved rate at once
    tail = []
    for m in metrics[25:]:
        resumed.step(m)
        tail.append(resumed.get_last_lr()[0])
    assert expected[:25] + tail == pytest.approx(expected) and len(set(expected)) > 2


def test_metric_schedules_need_an_evaluation_and_wsd_its_decay():
    for name in (PLATEAU, GREEDY):
        with pytest.raises(ConfigError, match=f"lr_scheduler_type='{name}' steps on each evaluation's metric"):
            TrainingArguments(lr_scheduler_type=name)
        assert TrainingArguments(lr_scheduler_type=name, eval_strategy="epoch").metric_for_best_model == "loss"
    with pytest.raises(ConfigError, match="GreedyLR factor must be below 1"):
        get_scheduler(GREEDY, _optimizer(), 0, None, {"factor": 1.5})
    with pytest.raises(ConfigError, match="needs lr_scheduler_kwargs num_decay_steps"):
        get_scheduler("warmup_stable_decay", _optimizer(), 0, 10)
    with pytest.raises(ConfigError, match="decay_type='square' is not one of linear, cosine, 1-sqrt"):
        get_scheduler("warmup_stable_decay", _optimizer(), 0, 10, {"num_decay_steps": 2, "decay_type": "square"})
