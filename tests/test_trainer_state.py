"""TrainerState / TrainerControl: HF's trainer_state.json layout both ways, resets, and the best-metric bookkeeping.

Where transformers is importable (the test venv with the ``transformers`` extra), the fields, defaults and files are
compared with its own TrainerState; the hard-coded key list is checked everywhere.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from phalanx.trainer.callbacks import EarlyStoppingCallback
from phalanx.trainer.state import TrainerControl, TrainerState, improves, metric_key, record_best_metric

# transformers 5.x trainer_callback.TrainerState, in its order, with its defaults ({} / [] after __post_init__).
HF_DEFAULTS: dict[str, Any] = {
    "epoch": 0, "global_step": 0, "max_steps": 0, "logging_steps": 500, "eval_steps": 500, "save_steps": 500,
    "train_batch_size": None, "num_train_epochs": 0, "num_input_tokens_seen": 0, "total_flos": 0,
    "log_history": [], "best_metric": None, "best_global_step": None, "best_model_checkpoint": None,
    "is_local_process_zero": True, "is_world_process_zero": True, "is_hyper_param_search": False,
    "trial_name": None, "trial_params": None, "stateful_callbacks": {},
}  # fmt: skip


def _filled() -> TrainerState:
    return TrainerState(
        epoch=1.5,
        global_step=30,
        max_steps=40,
        logging_steps=5,
        eval_steps=10,
        save_steps=10,
        train_batch_size=8,
        num_train_epochs=2,
        num_input_tokens_seen=12345,
        total_flos=6.5e12,
        log_history=[
            {"loss": 0.75, "learning_rate": 1e-4, "epoch": 0.5, "step": 10},
            {"eval_loss": 0.5, "eval_f1": 0.8, "epoch": 1.0, "step": 20},
        ],
        best_metric=0.8,
        best_global_step=20,
        best_model_checkpoint="out/checkpoint-20",
        is_local_process_zero=True,
        is_world_process_zero=False,
        trial_name="t0",
        trial_params={"lr": 0.1},
        stateful_callbacks=[TrainerControl(should_save=True), EarlyStoppingCallback(3, 0.01)],
    )


def test_fields_and_defaults_are_hfs() -> None:
    fields = [f.name for f in dataclasses.fields(TrainerState)]
    assert fields == list(HF_DEFAULTS)
    assert dataclasses.asdict(TrainerState()) == HF_DEFAULTS


def test_json_round_trip_and_layout(tmp_path: Path) -> None:
    state = _filled()
    path = tmp_path / "trainer_state.json"
    state.save_to_json(path)
    text = path.read_text()
    # HF's layout: sorted keys, two-space indent, a trailing newline.
    assert text == json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"
    assert sorted(json.loads(text)) == sorted(HF_DEFAULTS)
    back = TrainerState.load_from_json(path)
    assert back == state
    assert back.stateful_callbacks["EarlyStoppingCallback"]["args"] == {
        "early_stopping_patience": 3,
        "early_stopping_threshold": 0.01,
    }
    assert back.stateful_callbacks["TrainerControl"]["args"]["should_save"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["trainer_state.json"]  # no temporary left behind


def test_stateful_callbacks_of_one_class_become_a_list() -> None:
    state = TrainerState(stateful_callbacks=[EarlyStoppingCallback(1), EarlyStoppingCallback(2)])
    assert [s["args"]["early_stopping_patience"] for s in state.stateful_callbacks["EarlyStoppingCallback"]] == [1, 2]
    with pytest.raises(TypeError, match="state\\(\\)"):
        TrainerState(stateful_callbacks=[object()])


def test_load_tolerates_unknown_keys_and_rejects_non_objects(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"global_step": 7, "a_future_field": 1, "log_history": None}))
    state = TrainerState.load_from_json(path)
    assert state.global_step == 7 and state.log_history == []
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        TrainerState.load_from_json(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        TrainerState.load_from_json(path)


def test_compute_steps_resolves_ratios() -> None:
    state = TrainerState()
    state.compute_steps(SimpleNamespace(logging_steps=0.1, eval_steps=None, save_steps=25), max_steps=95)
    assert (state.logging_steps, state.eval_steps, state.save_steps) == (10, 500, 25)
    with pytest.raises(ValueError, match="save_steps must be > 0.*got 0"):
        state.compute_steps(SimpleNamespace(logging_steps=1, eval_steps=1, save_steps=0), max_steps=10)


def test_control_resets() -> None:
    control = TrainerControl(True, True, True, True, True)
    control._new_step()
    assert (control.should_save, control.should_evaluate, control.should_log) == (False, False, False)
    assert control.should_training_stop and control.should_epoch_stop
    control._new_epoch()
    assert not control.should_epoch_stop and control.should_training_stop
    control._new_training()
    assert control == TrainerControl()
    assert TrainerControl.from_state(TrainerControl(should_log=True).state()) == TrainerControl(should_log=True)


def test_best_metric_bookkeeping() -> None:
    args = SimpleNamespace(metric_for_best_model="f1", greater_is_better=True, save_strategy="epoch")
    state = TrainerState(global_step=10)
    assert metric_key(args) == "eval_f1"
    assert record_best_metric(args, state, {"eval_f1": 0.5}) and (state.best_metric, state.best_global_step) == (
        0.5,
        10,
    )
    state.global_step = 20
    assert not record_best_metric(args, state, {"eval_f1": 0.4}) and state.best_global_step == 10
    assert not record_best_metric(args, state, {"eval_f1": float("nan")}) and state.best_metric == 0.5
    with pytest.raises(KeyError, match="eval_f1.*eval_accuracy"):
        record_best_metric(args, state, {"eval_accuracy": 0.9})
    # Loss: lower is better when greater_is_better is left None, and "eval_" is added once.
    loss = SimpleNamespace(metric_for_best_model="eval_loss", greater_is_better=None, save_strategy="no")
    assert improves(loss, 0.9, 1.0) and not improves(loss, 1.1, 1.0) and not improves(loss, 0.95, 1.0, threshold=0.1)
    state = TrainerState(global_step=3)
    assert record_best_metric(loss, state, {"eval_loss": 2.0}) and state.best_global_step is None  # save_strategy="no"
    assert not record_best_metric(SimpleNamespace(metric_for_best_model=None), state, {"eval_loss": 1.0})


def test_hf_reads_ours_and_we_read_hfs(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_state_cls = transformers.TrainerState
    assert [f.name for f in dataclasses.fields(hf_state_cls)] == list(HF_DEFAULTS)
    assert dataclasses.asdict(hf_state_cls()) == dataclasses.asdict(TrainerState())
    ours = _filled()
    ours.save_to_json(tmp_path / "ours.json")
    theirs = hf_state_cls.load_from_json(str(tmp_path / "ours.json"))
    assert dataclasses.asdict(theirs) == dataclasses.asdict(ours)
    theirs.save_to_json(str(tmp_path / "theirs.json"))
    assert (tmp_path / "theirs.json").read_text() == (tmp_path / "ours.json").read_text()  # byte for byte
    assert TrainerState.load_from_json(tmp_path / "theirs.json") == ours
    hf_control = transformers.TrainerControl(should_evaluate=True)
    assert hf_control.state() == TrainerControl(should_evaluate=True).state()
