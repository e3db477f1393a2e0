"""Nothing silent at the door: when two sources of a setting disagree, or a call cannot do what the user meant, phalanx
says so once, with the fix (issue: the front door). Each test is one row of what a new user ran into."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.config import ENV_CONFIG_JSON, resolve_config
from phalanx.launch import SpawnError

from _common import OddNet, make_data


def test_an_engine_argument_overriding_the_launcher_is_reported():
    handed = json.dumps({"values": {"strategy": "zero3", "seed": 5}, "origins": {"strategy": "cli", "seed": "cli"}})
    env = {ENV_CONFIG_JSON: handed}
    cfg = resolve_config(env=env, cli={"strategy": "ddp", "seed": 5}, cli_origin="argument")
    assert cfg.engine.strategy == "ddp"  # the argument still wins, as documented
    assert len(cfg.overrides) == 1, cfg.overrides  # seed agrees: only strategy is reported
    line = cfg.overrides[0]
    assert "Engine(strategy='ddp')" in line and "strategy='zero3'" in line and "command line" in line

    file_cfg = resolve_config(env={"PHALANX_GRAD_ACCUM_STEPS": "4"}, cli={"grad_accum_steps": 2}, cli_origin="argument")
    assert any("PHALANX_GRAD_ACCUM_STEPS" in o for o in file_cfg.overrides)
    same = resolve_config(env=env, cli={"strategy": "zero3"}, cli_origin="argument")
    assert same.overrides == []


def test_the_engine_warns_once_about_the_override(monkeypatch, capsys):
    monkeypatch.setenv(ENV_CONFIG_JSON, json.dumps({"values": {"strategy": "zero2"}, "origins": {"strategy": "cli"}}))
    phalanx.Engine(strategy="ddp")
    err = capsys.readouterr().err
    assert err.count("overrides strategy='zero2'") == 1, err


def test_accumulation_setting_without_accumulate_warns(capsys):
    engine = phalanx.Engine(grad_accum_steps=2)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    for _ in range(3):
        engine.backward(model(torch.randn(8, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    err = capsys.readouterr().err
    assert err.count("grad_accum_steps=2 (from argument) has no effect") == 1, err
    assert "engine.accumulate()" in err

    engine = phalanx.Engine(grad_accum_steps=2)  # the same loop inside accumulate(): no warning
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    for _ in range(4):
        with engine.accumulate():
            engine.backward(model(torch.randn(8, 4)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
    assert "has no effect" not in capsys.readouterr().err


def _backward_without_prepare() -> str:
    engine = phalanx.Engine()
    model = OddNet()
    x, y = make_data(8)
    try:
        engine.backward(F.mse_loss(model(x), y))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_backward_on_an_unprepared_model_on_two_ranks_is_refused(run_ranks):
    for message in run_ranks(_backward_without_prepare, 2):
        assert "no model was passed to engine.prepare" in message and "diverge" in message, message


def test_backward_on_one_process_without_prepare_still_works():
    engine = phalanx.Engine()
    model = nn.Linear(3, 1)
    engine.backward(model(torch.ones(2, 3)).sum())
    assert model.weight.grad is not None


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_meta_built_model_gets_a_clear_error(strategy):
    engine = phalanx.Engine(strategy=strategy)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"meta device \(0\.weight, 0\.bias, 1\.weight and 1 more\).*strategy="):
        engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _scheduler_before_prepare(strategy: str) -> dict:
    engine = phalanx.Engine(strategy=strategy)
    torch.manual_seed(0)
    model = OddNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # built before prepare
    model, optimizer, scheduler = engine.prepare(model, optimizer, scheduler)
    x, y = make_data(8, seed=engine.rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            engine.backward(F.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return {"warnings": [str(w.message) for w in caught], "lr": optimizer.param_groups[0]["lr"]}


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_no_spurious_scheduler_warning_from_our_optimizer_wrapping(run_ranks, strategy):
    for out in run_ranks(_scheduler_before_prepare, 2, strategy):
        assert not [w for w in out["warnings"] if "has been overridden" in w], out["warnings"]
        assert out["lr"] == pytest.approx(1.0 * 0.5**3)  # the scheduler still counts each real step


def test_spawn_names_the_rank_that_died(run_ranks):
    with pytest.raises(SpawnError, match="rank 1 exited with code 3"):
        run_ranks(_die_on_rank_1, 2)


def _die_on_rank_1() -> None:
    import os
    import time

    engine = phalanx.Engine()
    if engine.rank == 1:
        os._exit(3)
    time.sleep(0.5)
    engine.wait()  # rank 0 fails here once rank 1 is gone; rank 1 is the one to name
