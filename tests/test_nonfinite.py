"""on_nonfinite: a NaN injected on one rank is caught before the optimizer steps, on every rank at once; under
'skip' nobody steps and the replicas stay equal; under 'ignore' the weights go bad and save_state refuses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _common import OddNet, make_data

import phalanx
from phalanx.checkpoint.format import CheckpointError
from phalanx.engine.nonfinite import NonFiniteError

BAD_STEP = 3


def _run(strategy: str, mode: str, where: str, tmp: str, clip: bool = True) -> dict:
    """5 steps of 4 samples per rank; at step 3 rank 1 poisons its loss (where='loss') or fc2.weight's gradient.
    With ``clip`` the guard reads the clipping's global norm; without, it reads the gradients."""
    engine = phalanx.Engine(strategy=strategy, on_nonfinite=mode, seed=0, max_grad_norm=1.0 if clip else None)
    torch.manual_seed(0)
    net = OddNet()
    model, opt = engine.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    sched = engine.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)))
    x, y = make_data(40)
    out: dict = {"error": None, "skipped": []}
    for step in range(1, 6):
        lo = (step - 1) * 8 + engine.rank * 4
        poison = step == BAD_STEP and engine.rank == 1
        handle = None
        if poison and where == "grad":
            handle = engine.unwrap_model(model).fc2.weight.register_hook(lambda g: g * float("nan"))
        loss = F.mse_loss(model(x[lo : lo + 4]), y[lo : lo + 4])
        if poison and where == "loss":
            loss = loss * float("nan")
        before = {k: v.clone() for k, v in engine.get_state_dict(model).items()}
        engine.backward(loss)
        if handle is not None:
            handle.remove()
        try:
            opt.step()
        except NonFiniteError as e:
            out["error"] = str(e)
            out["unchanged"] = all(torch.equal(v, engine.get_state_dict(model)[k]) for k, v in before.items())
            return out
        sched.step()
        opt.zero_grad()
        if engine.step_was_skipped:
            out["skipped"].append(step)
            out["unchanged"] = all(torch.equal(v, engine.get_state_dict(model)[k]) for k, v in before.items())
    out["state"] = engine.get_state_dict(model)
    out["lr_steps"] = sched.scheduler.last_epoch if hasattr(sched, "scheduler") else sched.last_epoch
    out["global_step"] = engine.global_step
    try:
        engine.save_state(f"{tmp}/ck")
        out["saved"] = True
    except CheckpointError as e:
        out["saved"] = str(e)
    return out


@pytest.mark.parametrize("strategy,clip", [("ddp", True), ("zero2", True), ("ddp", False), ("zero3", False)])
@pytest.mark.parametrize("where", ["loss", "grad"])
def test_raise_names_the_step_the_rank_and_the_parameter_on_every_rank(run_ranks, tmp_path, strategy, clip, where):
    for rank, out in enumerate(run_ranks(_run, 2, strategy, "raise", where, str(tmp_path), clip)):
        msg = out["error"]
        assert msg is not None, f"rank {rank} did not raise"
        assert f"non-finite values at optimizer step {BAD_STEP} on" in msg
        assert out["unchanged"], "the weights changed at the poisoned step"
        if where == "loss":
            assert (
                "rank 1 (loss and gradients)" in msg
            )  # the loss is rank 1's own; the reduced gradients are everyone's
        else:
            # A gradient is named where it is held after the reduction: every replica under ddp, its shard's owner
            # under zero2.
            assert ("rank 0 (gradients), rank 1 (gradients)" if strategy == "ddp" else "(gradients)") in msg
            assert "fc2.weight" in msg.split("first parameters with non-finite gradients:")[1]


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_skip_leaves_the_weights_and_the_schedule_and_the_replicas_agree(run_ranks, tmp_path, strategy):
    ranks = run_ranks(_run, 2, strategy, "skip", "grad", str(tmp_path))
    for out in ranks:
        assert out["error"] is None and out["skipped"] == [BAD_STEP] and out["unchanged"]
        assert out["lr_steps"] == 4  # 5 optimizer steps, one skipped: the schedule counts 4
        assert out["global_step"] == 5 and out["saved"] is True
        assert all(torch.isfinite(v).all() for v in out["state"].values())
    assert all(torch.equal(ranks[0]["state"][k], ranks[1]["state"][k]) for k in ranks[0]["state"])


def test_ignore_steps_into_the_nan_and_save_state_refuses_it(run_ranks, tmp_path):
    for out in run_ranks(_run, 2, "ddp", "ignore", "loss", str(tmp_path)):
        assert out["error"] is None and out["skipped"] == []
        assert not all(torch.isfinite(v).all() for v in out["state"].values())
        assert isinstance(out["saved"], str) and "non-finite values (NaN or inf) in model/" in out["saved"]
    assert not (tmp_path / "ck").exists()


def test_one_process_raises_and_bf16_is_guarded_too():
    for precision in ("fp32", "bf16-mixed"):
        engine = phalanx.Engine(seed=0, precision=precision)
        net = torch.nn.Linear(3, 1)
        model, opt = engine.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        before = net.weight.detach().clone()
        engine.backward(model(torch.ones(2, 3)).sum() * float("inf"))
        with pytest.raises(NonFiniteError, match=r"optimizer step 1 on rank 0 \(loss and gradients\).*rank 0: weight"):
            opt.step()
        assert torch.equal(net.weight, before)


def test_the_option_is_checked():
    with pytest.raises(phalanx.config.options.ConfigError, match="on_nonfinite"):
        phalanx.Engine(on_nonfinite="warn")


def _pipeline_run(clip: bool) -> str | None:
    from _common import pipe_loss, pipe_model

    engine = phalanx.Engine(strategy="pipeline", pp_size=2, seed=0, max_grad_norm=1.0 if clip else None)
    torch.manual_seed(7)
    model = engine.prepare(pipe_model())
    engine.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    if engine.rank == 1:  # the last stage poisons one of its gradients
        next(model.parameters()).register_hook(lambda g: g * float("inf"))
    x, y = make_data(8)
    try:
        engine.train_step((x, y), pipe_loss)
    except NonFiniteError as e:
        return str(e)
    return None


@pytest.mark.parametrize("clip", [True, False])
def test_pipeline_stages_stop_together(run_ranks, clip):
    for msg in run_ranks(_pipeline_run, 2, clip):
        assert msg is not None and "non-finite values at optimizer step 1 on" in msg
        # The stage that holds the NaN is named, with its parameter; with clipping, the global norm tells both stages.
        assert ("rank 0 (gradients), rank 1 (gradients)" if clip else "on rank 1 (gradients)") in msg
        assert "first parameters with non-finite gradients: rank 1:" in msg


def test_an_explicit_on_nonfinite_under_fp16_says_the_loss_scaler_decides(capsys):
    phalanx.Engine(precision="fp16-mixed", on_nonfinite="skip")
    assert "on_nonfinite='skip' (argument) does not apply under precision='fp16-mixed'" in capsys.readouterr().err
    phalanx.Engine(precision="fp16-mixed")  # the default: nothing to say
    assert "on_nonfinite" not in capsys.readouterr().err
