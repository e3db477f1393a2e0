"""Trainer callbacks and checkpoint rotation, single process: the flow callback's decisions over simulated runs, the
handler's order and control merging, early stopping, rotation that keeps the best and the newest, rank-0 JSONL."""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.checkpoint.format import FORMAT, MANIFEST
from phalanx.trainer.callbacks import CallbackHandler, DefaultFlowCallback, EarlyStoppingCallback, TrainerCallback
from phalanx.trainer.reporting import JsonlLoggingCallback, ProgressCallback, default_callbacks, reporting_callbacks
from phalanx.trainer.rotation import checkpoints_to_delete, rotate_checkpoints, sorted_checkpoints
from phalanx.trainer.state import TrainerControl, TrainerState, record_best_metric


@dataclass
class Args:
    """A stand-in for TrainingArguments with the fields the callbacks read."""

    output_dir: str | None = "out"
    logging_strategy: Any = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    eval_strategy: Any = "no"
    eval_steps: float | None = None
    eval_delay: float = 0
    save_strategy: Any = "steps"
    save_steps: float = 500
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    load_best_model_at_end: bool = False
    disable_tqdm: bool = False
    report_to: Any = "none"


@dataclass
class Run:
    log: list[int] = field(default_factory=list)
    eval: list[int] = field(default_factory=list)
    save: list[int] = field(default_factory=list)
    state: TrainerState = field(default_factory=TrainerState)


def simulate(
    args: Args,
    steps_per_epoch: int,
    epochs: int,
    max_steps: int | None = None,
    metrics: list[float] | None = None,
    callbacks: tuple[Any, ...] = (),
) -> Run:
    """HF's training loop, reduced to its callback calls: which steps log, evaluate and save."""
    run, control = Run(), TrainerControl()
    state = run.state
    state.max_steps = max_steps if max_steps is not None else steps_per_epoch * epochs
    state.compute_steps(args, state.max_steps)
    handler = CallbackHandler([DefaultFlowCallback, *callbacks])
    scores = iter(metrics or [])

    def maybe_log_save_evaluate() -> None:
        nonlocal control
        if control.should_log:
            run.log.append(state.global_step)
            control = handler.on_log(args, state, control, logs={"loss": 1.0})
        if control.should_evaluate:
            run.eval.append(state.global_step)
            result = {f"eval_{args.metric_for_best_model or 'loss'}": next(scores, 1.0)}
            control = handler.on_evaluate(args, state, control, metrics=result)
            record_best_metric(args, state, result)  # after on_evaluate, as the Trainer does
        if control.should_save:
            run.save.append(state.global_step)
            control = handler.on_save(args, state, control)

    control = handler.on_train_begin(args, state, control)
    for epoch in range(epochs):
        control = handler.on_epoch_begin(args, state, control)
        for i in range(steps_per_epoch):
            control = handler.on_step_begin(args, state, control)
            state.global_step += 1
            state.epoch = epoch + (i + 1) / steps_per_epoch
            control = handler.on_step_end(args, state, control)
            maybe_log_save_evaluate()
            if control.should_epoch_stop or control.should_training_stop:
                break
        control = handler.on_epoch_end(args, state, control)
        maybe_log_save_evaluate()
        if control.should_training_stop:
            break
    handler.on_train_end(args, state, control)
    return run


class Interval(str, enum.Enum):  # HF passes str enums; plain strings work too
    STEPS = "steps"
    EPOCH = "epoch"


def test_flow_steps_with_final_eval_and_save_at_max_steps() -> None:
    args = Args(logging_steps=2, eval_strategy=Interval.STEPS, eval_steps=3, save_steps=4)
    run = simulate(args, steps_per_epoch=4, epochs=5, max_steps=10)
    assert run.log == [2, 4, 6, 8, 10]
    assert run.eval == [3, 6, 9, 10]  # 10 is not on the interval: the last step evaluates anyway
    assert run.save == [4, 8, 10]
    assert run.state.global_step == 10


def test_flow_epoch_strategies() -> None:
    args = Args(logging_strategy=Interval.EPOCH, eval_strategy="epoch", save_strategy="epoch")
    run = simulate(args, steps_per_epoch=3, epochs=2)
    assert run.log == run.eval == run.save == [3, 6]


def test_flow_no_strategies_and_logging_first_step() -> None:
    run = simulate(Args(logging_strategy="no", save_strategy="no", logging_first_step=True), 4, 3)
    assert (run.log, run.eval, run.save, run.state.global_step) == ([1], [], [], 12)
    run = simulate(Args(logging_steps=5, logging_first_step=True, save_strategy="no"), 4, 3)
    assert run.log == [1, 5, 10]


def test_flow_ratios_eval_delay_and_max_steps_mid_epoch() -> None:
    args = Args(logging_steps=0.25, eval_strategy="steps", eval_steps=2, eval_delay=5, save_steps=0.5)
    run = simulate(args, steps_per_epoch=10, epochs=3, max_steps=8)
    assert (run.log, run.eval, run.save) == ([2, 4, 6, 8], [6, 8], [4, 8])
    assert run.state.global_step == 8 and run.state.epoch == pytest.approx(0.8)  # stopped inside the first epoch


def test_flow_save_best_only_on_a_new_best() -> None:
    args = Args(eval_strategy="epoch", save_strategy="best", metric_for_best_model="loss", logging_strategy="no")
    run = simulate(args, steps_per_epoch=2, epochs=5, metrics=[3.0, 2.0, 2.5, 1.0, 1.0])
    assert run.eval == [2, 4, 6, 8, 10]
    assert run.save == [2, 4, 8]
    assert (run.state.best_metric, run.state.best_global_step) == (1.0, 8)


def test_flow_rejects_unknown_strategy() -> None:
    with pytest.raises(ValueError, match="save_strategy must be one of .*got 'sometimes'"):
        simulate(Args(save_strategy="sometimes"), 2, 1)


class Recorder(TrainerCallback):
    def __init__(self, name: str, calls: list[tuple[str, str]], replace: bool = False) -> None:
        self.name, self.calls, self.replace = name, calls, replace
        self.seen: list[Any] = []

    def on_step_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl | None:
        self.calls.append((self.name, "on_step_end"))
        self.seen.append((control, kwargs))
        return TrainerControl(should_save=True) if self.replace else None

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl | None:
        self.calls.append((self.name, "on_log"))
        self.seen.append((control.should_log, kwargs["logs"]))
        return None


def test_handler_order_kwargs_and_control_merging() -> None:
    calls: list[tuple[str, str]] = []
    first, second, third = Recorder("a", calls, replace=True), Recorder("b", calls), Recorder("c", calls)
    handler = CallbackHandler([DefaultFlowCallback, first, second], model="M", optimizer="O", lr_scheduler="S")
    handler.add_callback(third)
    state, control = TrainerState(global_step=1, max_steps=10), TrainerControl(should_log=True)
    out = handler.on_step_end(Args(), state, control, extra=1)
    assert calls == [("a", "on_step_end"), ("b", "on_step_end"), ("c", "on_step_end")]
    # The first returned a new control: the later ones receive it, and the handler returns it.
    assert second.seen[0][0] is out and third.seen[0][0] is out and out is not control and out.should_save
    assert first.seen[0][0] is control
    kwargs = second.seen[0][1]
    assert (kwargs["model"], kwargs["optimizer"], kwargs["lr_scheduler"], kwargs["extra"]) == ("M", "O", "S", 1)
    assert kwargs["train_dataloader"] is None and kwargs["eval_dataloader"] is None
    # on_log clears should_log before the callbacks run.
    handler.on_log(Args(), state, TrainerControl(should_log=True), logs={"loss": 2.0})
    assert second.seen[-1] == (False, {"loss": 2.0})


def test_handler_resets_at_boundaries() -> None:
    handler, args, state = CallbackHandler([DefaultFlowCallback]), Args(), TrainerState(max_steps=100)
    control = TrainerControl(True, True, True, True, True)
    control = handler.on_step_begin(args, state, control)
    assert (control.should_log, control.should_evaluate, control.should_save) == (False, False, False)
    assert control.should_epoch_stop and control.should_training_stop
    control = handler.on_epoch_begin(args, state, control)
    assert not control.should_epoch_stop and control.should_training_stop
    control = handler.on_train_begin(args, state, control)
    assert not control.should_training_stop
    control.should_save = True
    assert not handler.on_save(args, state, control).should_save


def test_handler_add_pop_remove() -> None:
    handler = CallbackHandler([DefaultFlowCallback, ProgressCallback])
    extra = EarlyStoppingCallback()
    handler.add_callback(extra)
    assert [type(c).__name__ for c in handler.callbacks] == [
        "DefaultFlowCallback",
        "ProgressCallback",
        "EarlyStoppingCallback",
    ]
    assert handler.pop_callback(extra) is extra
    assert handler.pop_callback(EarlyStoppingCallback) is None
    popped = handler.pop_callback(ProgressCallback)
    assert isinstance(popped, ProgressCallback) and handler.callback_list == "DefaultFlowCallback"
    handler.remove_callback(ProgressCallback)  # a class that is not there: nothing to do
    with pytest.raises(ValueError, match="not among the callbacks"):
        handler.remove_callback(extra)
    handler.remove_callback(DefaultFlowCallback)
    assert handler.callbacks == []
    with pytest.raises(TypeError, match="TrainerCallback"):
        handler.add_callback(object())  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- early stopping
def _evaluate(cb: EarlyStoppingCallback, args: Args, values: list[float]) -> list[bool]:
    state, stops, key = TrainerState(), [], f"eval_{args.metric_for_best_model}"
    cb.on_train_begin(args, state, TrainerControl())
    for step, value in enumerate(values, 1):
        state.global_step = step
        control = TrainerControl()
        cb.on_evaluate(args, state, control, metrics={key: value})
        record_best_metric(args, state, {key: value})
        stops.append(control.should_training_stop)
    return stops


def test_early_stopping_patience_and_threshold() -> None:
    args = Args(
        eval_strategy="epoch", metric_for_best_model="accuracy", greater_is_better=True, load_best_model_at_end=True
    )
    cb = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.1)
    # +0.05 is below the threshold (1 strike), +0.15 resets, then +0.01 twice: stop on the second.
    assert _evaluate(cb, args, [0.5, 0.55, 0.7, 0.71, 0.72]) == [False, False, False, False, True]
    assert EarlyStoppingCallback.from_state(cb.state()).early_stopping_patience_counter == 2
    # A lower-is-better loss with patience 1 stops at the first evaluation that is not better.
    loss = Args(eval_strategy="steps", metric_for_best_model="loss")
    assert _evaluate(EarlyStoppingCallback(), loss, [3.0, 2.0, 2.0]) == [False, False, True]


def test_early_stopping_in_a_run_and_missing_metric() -> None:
    args = Args(eval_strategy="epoch", metric_for_best_model="loss", logging_strategy="no", save_strategy="no")
    run = simulate(args, 2, 10, metrics=[3.0, 2.0, 2.5, 2.4, 1.0], callbacks=(EarlyStoppingCallback(2),))
    assert run.eval == [2, 4, 6, 8] and run.state.global_step == 8
    cb, control = EarlyStoppingCallback(), TrainerControl()
    cb.on_evaluate(args, TrainerState(best_metric=1.0), control, metrics={"test_loss": 9.0})  # another prefix: ignored
    assert cb.early_stopping_patience_counter == 0 and not control.should_training_stop


def test_early_stopping_errors() -> None:
    with pytest.raises(ValueError, match="metric_for_best_model"):
        EarlyStoppingCallback().on_train_begin(Args(eval_strategy="epoch"), TrainerState(), TrainerControl())
    with pytest.raises(ValueError, match="eval_strategy='no'"):
        EarlyStoppingCallback().on_train_begin(Args(metric_for_best_model="loss"), TrainerState(), TrainerControl())
    with pytest.raises(ValueError, match="early_stopping_patience.*got 0"):
        EarlyStoppingCallback(0)
    with pytest.raises(ValueError, match="early_stopping_threshold.*got -0.5"):
        EarlyStoppingCallback(1, -0.5)


# -------------------------------------------------------------------------------------------------- rotation
def _ckpts(*steps: int) -> list[tuple[int, str]]:
    return [(s, f"out/checkpoint-{s}") for s in steps]


def _kept(steps: list[int], limit: int | None, best: int | None) -> list[int]:
    doomed = set(checkpoints_to_delete(_ckpts(*steps), limit, f"out/checkpoint-{best}" if best else None))
    return [s for s in steps if f"out/checkpoint-{s}" not in doomed]


def test_rotation_keeps_best_and_newest() -> None:
    # transformers #15089: save_total_limit=2 with an old best kept rotating the best away; here best and newest stay.
    assert _kept([1, 2, 3, 4, 5], 2, best=2) == [2, 5]
    assert _kept([1, 2, 3, 4, 5], 3, best=2) == [2, 4, 5]
    # transformers #35070: save_total_limit=1 and a best that is not the newest keeps both (HF's end of train()
    # would then delete the newest; we never do).
    assert _kept([1, 2, 3, 4, 5], 1, best=3) == [3, 5]
    assert _kept([1, 2, 3, 4, 5], 1, best=5) == [5]
    assert _kept([1, 2, 3], 2, best=None) == [2, 3]
    assert _kept([1, 2, 3], 5, best=1) == [1, 2, 3]
    assert _kept([1, 2, 3], None, best=None) == [1, 2, 3]
    assert _kept([1, 2, 3], 1, best=7) == [3]  # a best that is not among them protects nothing


def test_rotation_orders_by_step_and_normalises_the_best_path() -> None:
    found = [(100, "o/checkpoint-100"), (9, "o/checkpoint-9"), (10, "o/checkpoint-10")]
    assert checkpoints_to_delete(found, 1) == ["o/checkpoint-9", "o/checkpoint-10"]  # not string order
    assert checkpoints_to_delete(found, 1, best_checkpoint=str(Path("o/checkpoint-9").absolute()) + "/") == [
        "o/checkpoint-10"
    ]
    with pytest.raises(ValueError, match="save_total_limit must be None .* got 0"):
        checkpoints_to_delete(found, 0)


def _fake_checkpoint(d: Path, complete: bool = True) -> Path:
    d.mkdir(parents=True)
    if complete:
        (d / MANIFEST).write_text(json.dumps({"format": FORMAT, "saved_at": time.time()}))
    return d


def test_sorted_checkpoints_skips_incomplete_and_rotate_deletes(tmp_path: Path) -> None:
    for step in (3, 20, 100):
        _fake_checkpoint(tmp_path / f"checkpoint-{step}")
    _fake_checkpoint(tmp_path / "checkpoint-200", complete=False)  # no manifest: a save that never finished
    _fake_checkpoint(tmp_path / ".checkpoint-300.partial")  # staging
    _fake_checkpoint(tmp_path / ".checkpoint-7.old")  # the crash left only the old copy: it counts as step 7
    _fake_checkpoint(tmp_path / ".checkpoint-20.old")  # checkpoint-20 exists: the .old does not count
    _fake_checkpoint(tmp_path / "best")
    (tmp_path / "checkpoint-400").write_text("not a directory")
    found = sorted_checkpoints(tmp_path)
    assert [(s, p.name) for s, p in found] == [
        (3, "checkpoint-3"),
        (7, ".checkpoint-7.old"),
        (20, "checkpoint-20"),
        (100, "checkpoint-100"),
    ]
    assert sorted_checkpoints(tmp_path / "missing") == []
    deleted = rotate_checkpoints(tmp_path, 2, best_checkpoint=tmp_path / "checkpoint-3")
    assert [p.name for p in deleted] == [".checkpoint-7.old", "checkpoint-20"]
    assert [p.name for _, p in sorted_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-100"]
    assert (tmp_path / "checkpoint-200").exists()  # incomplete ones are not ours to judge
    assert not (tmp_path / ".checkpoint-20.old").exists()  # deleting step 20 took its stale copy too


def test_rotation_matches_hf_during_training(tmp_path: Path) -> None:
    """While training, HF's current rotation keeps the same set; the difference is at the end of its train()."""
    trainer_utils = pytest.importorskip("transformers.trainer_utils")
    for limit, best in [(2, 2), (3, 2), (1, 3), (1, 5), (2, None)]:
        root = tmp_path / f"l{limit}b{best}"
        for step in range(1, 6):
            _fake_checkpoint(root / f"checkpoint-{step}")
        best_path = str(root / f"checkpoint-{best}") if best else None
        ours = [
            s
            for s, _ in sorted_checkpoints(root)
            if str(root / f"checkpoint-{s}")
            not in {str(p) for p in checkpoints_to_delete(sorted_checkpoints(root), limit, best_path)}
        ]
        trainer_utils.rotate_checkpoints(str(root), save_total_limit=limit, best_model_checkpoint=best_path)
        assert [s for s, _ in sorted_checkpoints(root)] == ours, (limit, best)


# ------------------------------------------------------------------------------------------------ reporting
def test_jsonl_written_by_world_rank_zero_only(tmp_path: Path) -> None:
    args = Args(output_dir=str(tmp_path / "r0"))
    cb, control = JsonlLoggingCallback(), TrainerControl()
    state = TrainerState(global_step=4, epoch=0.5)
    cb.on_log(args, state, control, logs={"loss": torch.tensor(0.25), "learning_rate": 1e-3, "grad_norm": 1.5})
    state.global_step = 8
    cb.on_train_end(args, state, control)
    cb.on_log(args, state, control, logs={"eval_loss": 0.5, "eval_runtime": 1.0})  # after training: appended
    records = [json.loads(line) for line in (tmp_path / "r0" / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["step_unit"], r["epoch"]) for r in records] == [
        (4, "optimizer_step", 0.5),
        (8, "optimizer_step", 0.5),
    ]
    assert (records[0]["loss"], records[0]["learning_rate"], records[1]["eval_loss"]) == (0.25, 1e-3, 0.5)
    assert all("time" in r for r in records)
    # Another rank: no file, nothing opened.
    other = Args(output_dir=str(tmp_path / "r1"))
    off_zero = TrainerState(global_step=4, is_world_process_zero=False, is_local_process_zero=True)
    JsonlLoggingCallback().on_log(other, off_zero, control, logs={"loss": 0.25})
    assert not (tmp_path / "r1").exists()
    with pytest.raises(ValueError, match="output_dir is None"):
        JsonlLoggingCallback().on_log(Args(output_dir=None), state, control, logs={"loss": 1.0})


def test_progress_bar_on_rank_zero_only(capsys: pytest.CaptureFixture[str]) -> None:
    args, control = Args(), TrainerControl()
    for shown, state, a in [
        (True, TrainerState(max_steps=4), args),
        (False, TrainerState(max_steps=4, is_world_process_zero=False), args),
        (False, TrainerState(max_steps=4), Args(disable_tqdm=True)),
    ]:
        cb = ProgressCallback()
        cb.on_train_begin(a, state, control)
        assert (cb.training_bar is not None) == shown
        state.global_step = 2
        cb.on_step_end(a, state, control)
        cb.on_log(a, state, control, logs={"loss": 0.5, "learning_rate": 2e-4})
        cb.on_log(a, state, control, logs={"eval_loss": 0.25})
        if shown:
            assert cb._postfix["loss"] == 0.5 and cb._postfix["lr"] == 2e-4 and "eta" in cb._postfix
            assert cb.training_bar is not None and cb.training_bar.n == 2
        cb.on_train_end(a, state, control)
        assert cb.training_bar is None
    assert "eval_loss" in capsys.readouterr().err


def test_report_to() -> None:
    assert reporting_callbacks(Args(report_to="none")) == reporting_callbacks(Args(report_to=[])) == []
    with pytest.raises(ValueError, match="'comet_ml'.*does not report to"):
        reporting_callbacks(Args(report_to=["comet_ml"]))
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install phalanx\[tensorboard\]"):
            reporting_callbacks(Args(report_to="tensorboard"))
        assert "TensorBoardCallback" not in [type(c).__name__ for c in reporting_callbacks(Args(report_to="all"))]
    else:
        assert [type(c).__name__ for c in reporting_callbacks(Args(report_to="tensorboard"))] == ["TensorBoardCallback"]
    names = [type(c).__name__ for c in default_callbacks(Args())]
    assert names == ["DefaultFlowCallback", "ProgressCallback"]  # transformers' list; log.jsonl is the Trainer's own
    assert [type(c).__name__ for c in default_callbacks(Args(disable_tqdm=True))][-1] == "PrinterCallback"


def test_the_handler_dispatches_every_event_a_callback_can_have() -> None:
    events = sorted(name for name in vars(TrainerCallback) if name.startswith("on_"))
    assert "on_push_begin" in events and "on_pre_optimizer_step" in events  # transformers' full set

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.seen: list[str] = []

        def __getattribute__(self, name: str) -> Any:
            if name.startswith("on_"):
                return lambda *a, **k: object.__getattribute__(self, "seen").append(name)
            return object.__getattribute__(self, name)

    recorder = Recorder()
    handler = CallbackHandler([DefaultFlowCallback, recorder])
    for event in events:
        kwargs = {"metrics": {}} if event in ("on_evaluate", "on_predict") else {}
        getattr(handler, event)(Args(), TrainerState(), TrainerControl(), **kwargs)
    assert recorder.seen == events
