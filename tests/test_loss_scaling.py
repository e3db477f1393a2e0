"""fp16 loss scaling with DeepSpeed's knobs (window, hysteresis, minimum, static scale), as a DeepSpeed fp16 block
asks for; the defaults stay torch's GradScaler."""

from __future__ import annotations

import pytest
import torch

from phalanx.engine.precision import LossScaling, Precision, _ScaleSchedule

F, T = False, True
OVERFLOWS = [F, F, F, F, F, T, T, F, F, F, T, T, T, T, T, T]


def test_the_schedule_follows_deepspeeds_rules():
    # Worked by hand: double after every 2 clean steps that follow the step after the last overflow; the first
    # overflow is absorbed by the hysteresis (2), later ones halve until a growth restores it; never below 2.
    schedule = _ScaleSchedule(LossScaling(init=8.0, window=2, hysteresis=2, min=2.0))
    assert [schedule.next(o) for o in OVERFLOWS] == [8, 8, 16, 16, 32, 32, 16, 16, 16, 32, 32, 16, 8, 4, 2, 2]


def test_the_schedule_matches_deepspeed_when_installed(tmp_path, monkeypatch):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler", reason="DeepSpeed is not installed")
    import deepspeed.comm

    # DeepSpeed's scaler asks its own comm layer for the rank, to log.
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    deepspeed.comm.init_distributed(
        "gloo", auto_mpi_discovery=False, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    ours = _ScaleSchedule(LossScaling(init=8.0, window=2, hysteresis=2, min=2.0))
    theirs = loss_scaler.DynamicLossScaler(
        init_scale=8.0,
        scale_window=2,
        min_scale=2.0,
        delayed_shift=2,
        consecutive_hysteresis=False,
        raise_error_at_min_scale=False,  # DeepSpeed would stop the run at the minimum; we keep skipping
    )
    for overflow in OVERFLOWS * 3:
        theirs.update_scale(overflow)
        assert ours.next(overflow) == theirs.cur_scale


def _step(precision: Precision, model: torch.nn.Linear, opt: torch.optim.Optimizer, poison: bool) -> bool:
    with precision.autocast():
        loss = model(torch.ones(2, 4)).sum()
    precision.scale_loss(loss).backward()
    if poison:
        model.weight.grad[0, 0] = float("inf")
    skipped = precision.step(opt)
    precision.update()
    opt.zero_grad()
    return skipped


def test_precision_applies_hysteresis_and_skips_overflowed_steps():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision("fp16-mixed", torch.device("cpu"), LossScaling(init=1024.0, window=1000, hysteresis=2))
    before = model.weight.detach().clone()
    assert _step(precision, model, opt, poison=True)  # skipped ...
    assert torch.equal(model.weight, before) and precision.loss_scale == 1024.0  # ... and the scale survives it
    assert _step(precision, model, opt, poison=True)
    assert precision.loss_scale == 512.0  # the second overflow halves it
    assert not _step(precision, model, opt, poison=False)
    assert not torch.equal(model.weight, before)
    state = precision.state_dict()
    fresh = Precision("fp16-mixed", torch.device("cpu"), LossScaling(init=1024.0, window=1000, hysteresis=2))
    fresh.load_state_dict(state)
    assert fresh.schedule is not None and fresh.schedule.state_dict() == precision.schedule.state_dict()


def test_static_scale_never_moves():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision("fp16-mixed", torch.device("cpu"), LossScaling(static=128.0))
    assert _step(precision, model, opt, poison=True)
    assert not _step(precision, model, opt, poison=False)
    assert precision.loss_scale == 128.0


def test_torchs_policy_is_the_default():
    assert Precision("fp16-mixed", torch.device("cpu")).schedule is None
