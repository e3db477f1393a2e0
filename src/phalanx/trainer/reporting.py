"""The callbacks that report a run: the rank-0 progress bar, the JSONL log that is always written, TensorBoard,
Weights & Biases and MLflow when ``report_to`` asks for them (the trackers are in ``engine/trackers.py``, shared with
the Accelerate front), and the list a Trainer starts with. A *step* is an optimizer step, and the logs say so."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from phalanx.engine.trackers import MLflowTracker, Tracker, WandbTracker, flatten, require, tracker_names
from phalanx.logging import warn_once
from phalanx.trainer.callbacks import DefaultFlowCallback, TrainerCallback
from phalanx.trainer.state import TrainerControl, TrainerState
from phalanx.trainer.tracking import JsonlMetrics, ProgressBar

__all__ = [
    "ProgressCallback",
    "PrinterCallback",
    "JsonlLoggingCallback",
    "TensorBoardCallback",
    "WandbCallback",
    "MLflowCallback",
    "reporting_callbacks",
    "default_callbacks",
]

Control = TrainerControl | None


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


class ProgressCallback(TrainerCallback):
    """A tqdm bar of optimizer steps on the world's rank 0 (nothing elsewhere, nothing with ``disable_tqdm``),
    showing the last logged loss and learning rate, steps per second and the time left; evaluation records are
    printed above it, and evaluation batches get a bar of their own."""

    def __init__(self, max_str_len: int = 100) -> None:
        self.max_str_len = max_str_len
        self.training_bar: ProgressBar | None = None
        self.prediction_bar: ProgressBar | None = None
        self.current_step = 0
        self._postfix: dict[str, Any] = {}
        self._window: tuple[float, int] = (0.0, 0)

    @staticmethod
    def _shows(args: Any, state: TrainerState) -> bool:
        return state.is_world_process_zero and not getattr(args, "disable_tqdm", False)

    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        if self._shows(args, state):
            start = state.global_step
            desc = f"train (resumed at step {start})" if start else "train"
            # A resumed run counts only the steps left, so that tqdm's rate and ETA are true.
            self.training_bar = ProgressBar(total=max(0, state.max_steps - start), desc=desc, unit="step")
        self.current_step = state.global_step
        self._window = (time.perf_counter(), state.global_step)
        self._postfix = {}
        return None

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        if self.training_bar is not None:
            self.training_bar.update(state.global_step - self.current_step, **self._postfix)
        self.current_step = state.global_step
        return None

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        if self.training_bar is None:
            return None
        logs: dict[str, Any] = kwargs.get("logs") or {}
        if "loss" not in logs:  # an evaluation's record: a line above the bar
            shown = {k: (f"{v:.4g}" if isinstance(v, float) else str(v)[: self.max_str_len]) for k, v in logs.items()}
            self.training_bar.write(str(shown))
            return None
        now, since = time.perf_counter(), self._window
        rate = (state.global_step - since[1]) / (now - since[0]) if now > since[0] else 0.0
        self._window = (now, state.global_step)
        self._postfix = {"loss": logs["loss"], "lr": logs.get("learning_rate"), "step_per_s": rate}
        if rate > 0:
            self._postfix["eta"] = _clock(max(0, state.max_steps - state.global_step) / rate)
        return None

    def on_prediction_step(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        loader: Any = kwargs.get("eval_dataloader")
        if self._shows(args, state) and hasattr(loader, "__len__"):
            if self.prediction_bar is None:
                self.prediction_bar = ProgressBar(total=len(loader), desc="eval", unit="batch")
            self.prediction_bar.update(1)
        return None

    def on_evaluate(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        _close(self.prediction_bar)
        self.prediction_bar = None
        return None

    def on_predict(
        self, args: Any, state: TrainerState, control: TrainerControl, metrics: dict[str, Any], **kwargs: Any
    ) -> Control:
        _close(self.prediction_bar)
        self.prediction_bar = None
        return None

    def on_train_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        _close(self.training_bar)
        self.training_bar = None
        return None


def _close(bar: ProgressBar | None) -> None:
    if bar is not None:
        bar.close()


def _plain(value: Any) -> Any:
    """A log value as JSON: tensors and numpy scalars become numbers, anything else unknown becomes its str."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


class JsonlLoggingCallback(TrainerCallback):
    """Appends every logged record to ``output_dir/log.jsonl`` on the world's rank 0, one JSON object per line.

    Each record starts with ``step`` (the optimizer step, as ``state.global_step``), ``step_unit:
    "optimizer_step"`` and ``epoch``, then the logged values; ``time`` is the wall clock.
    """

    FILENAME = "log.jsonl"

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._sink: JsonlMetrics | None = None

    def _open(self, args: Any) -> JsonlMetrics:
        output_dir: Any = getattr(args, "output_dir", None)
        if self.path is None and not output_dir:
            raise ValueError(
                f"JsonlLoggingCallback writes to output_dir/{self.FILENAME}, but output_dir is {output_dir!r} "
                "(set TrainingArguments.output_dir, or pass JsonlLoggingCallback(path=...))"
            )
        self._sink = self._sink or JsonlMetrics(self.path or Path(output_dir) / self.FILENAME)
        return self._sink

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        if not state.is_world_process_zero:
            return None
        logs: dict[str, Any] = kwargs.get("logs") or {}
        record: dict[str, Any] = {"step": state.global_step, "step_unit": "optimizer_step", "epoch": state.epoch}
        record.update({k: _plain(v) for k, v in logs.items() if k not in ("step", "step_unit", "time")})
        self._open(args).log(**record)
        return None

    def on_train_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        # Closed here and reopened (appending) if evaluate() logs after training.
        if self._sink is not None:
            self._sink.close()
            self._sink = None
        return None


class TensorBoardCallback(TrainerCallback):
    """Writes every numeric logged value as a TensorBoard scalar at ``x = optimizer step``, on the world's rank 0.

    Tags group by prefix as HF does: ``eval_loss`` -> ``eval/loss``, ``loss`` -> ``train/loss``. Events go to
    ``log_dir``, else ``args.logging_dir``, else ``output_dir/runs``.
    """

    def __init__(self, log_dir: str | Path | None = None) -> None:
        try:  # fail at construction, not mid-run
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "report_to includes 'tensorboard' but the tensorboard package is not installed "
                "(pip install phalanx[tensorboard], or drop 'tensorboard' from report_to; log.jsonl is written anyway)"
            ) from e
        self._writer_class = SummaryWriter
        self.log_dir = log_dir
        self.writer: Any = None

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        if not state.is_world_process_zero:
            return None
        if self.writer is None:
            where = (
                self.log_dir
                or getattr(args, "logging_dir", None)
                or Path(getattr(args, "output_dir", None) or ".") / "runs"
            )
            self.writer = self._writer_class(log_dir=str(where))
        for key, value in (kwargs.get("logs") or {}).items():
            value = _plain(value)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            prefix, _, rest = key.partition("_")
            tag = f"{prefix}/{rest}" if prefix in ("eval", "test") and rest else f"train/{key}"
            self.writer.add_scalar(tag, value, state.global_step)
        self.writer.flush()
        return None

    def on_train_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        return None


def _run_config(args: Any, model: Any) -> dict[str, Any]:
    """What transformers' trackers store as the run's configuration: the model's config, then the arguments."""
    config: Any = getattr(model, "config", None)
    values = dict(config.to_dict()) if hasattr(config, "to_dict") else {}
    values.update(args.to_dict() if hasattr(args, "to_dict") else dict(vars(args)))
    return values


class _TrackerCallback(TrainerCallback):
    """One tracker's run over a Trainer's life, on the world's rank 0 (nothing on the other ranks).

    The run starts at ``on_train_begin`` (or at the first log, for an ``evaluate()`` before any training) and ends at
    ``on_train_end``, so that each ``train()`` leaves a finished run. A log after that (``evaluate()`` after
    ``train()``) reopens the same run, logs, and ends it again.
    """

    name = ""

    def __init__(self) -> None:
        require(self.name, "report_to", load=False)  # fail at construction, not mid-run; import on rank 0 only
        self.tracker: Tracker | None = None
        self._open = False
        self._training = False

    def _make(self, args: Any, state: TrainerState, model: Any) -> Tracker:
        raise NotImplementedError

    def _reopen(self) -> None:
        raise NotImplementedError

    def _after_start(self) -> None:
        """What each start (or reopening) of the run needs before the first log."""

    def _ensure_open(self, args: Any, state: TrainerState, model: Any) -> Tracker:
        if self.tracker is None:
            self.tracker = self._make(args, state, model)
            self.tracker.start()
            self._after_start()
            self.tracker.store_init_configuration(self._config(args, model))
        elif not self._open:
            self._reopen()
            self._after_start()
        self._open = True
        return self.tracker

    def _config(self, args: Any, model: Any) -> dict[str, Any]:
        return _run_config(args, model)

    def _send(self, tracker: Tracker, logs: dict[str, Any], state: TrainerState) -> None:
        tracker.log(logs, step=state.global_step)

    def _close(self) -> None:
        if self.tracker is not None and self._open:
            self.tracker.finish()
        self._open = False

    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        if state.is_world_process_zero:
            self._ensure_open(args, state, kwargs.get("model"))
            self._training = True
        return None

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        if state.is_world_process_zero:
            self._send(self._ensure_open(args, state, kwargs.get("model")), kwargs.get("logs") or {}, state)
            if not self._training:
                self._close()
        return None

    def on_train_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        if state.is_world_process_zero:
            self._close()
            self._training = False
        return None


# transformers puts these in the W&B run's summary rather than its history: one value per run.
_SUMMARY_ONLY = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos")


def _rewrite(logs: dict[str, Any]) -> dict[str, Any]:
    """transformers' W&B names: ``eval_loss`` -> ``eval/loss``, ``test_x`` -> ``test/x``, ``loss`` -> ``train/loss``."""
    out = {}
    for key, value in logs.items():
        prefix, _, rest = key.partition("_")
        out[f"{prefix}/{rest}" if prefix in ("eval", "test") and rest else f"train/{key}"] = value
    return out


class WandbCallback(_TrackerCallback):
    """Logs to a Weights & Biases run, as transformers' ``WandbCallback``: the project is ``WANDB_PROJECT`` (else
    "huggingface"), the run's name ``args.run_name``, its config the model's config and the arguments; each record
    goes to the history as ``train/loss``, ``eval/loss``... with ``train/global_step`` (the optimizer step) as its x
    axis, and the run's totals (``train_runtime``, ``train_loss``...) go to the summary. A run begun with
    ``wandb.init`` before the Trainer is logged to and left open. ``WANDB_MODE=offline`` writes the run under
    ``wandb/offline-run-*/`` for a later ``wandb sync``. ``WANDB_LOG_MODEL`` and ``WANDB_WATCH`` are not honoured.
    """

    name = "wandb"

    def _make(self, args: Any, state: TrainerState, model: Any) -> Tracker:
        for variable in ("WANDB_LOG_MODEL", "WANDB_WATCH"):
            if os.environ.get(variable, "false").lower() not in ("false", "0", ""):
                warn_once(f"{variable}={os.environ[variable]!r} is not honoured by phalanx's WandbCallback (unset it)")
        init: dict[str, Any] = {"name": args.run_name} if getattr(args, "run_name", None) else {}
        return WandbTracker(os.environ.get("WANDB_PROJECT", "huggingface"), adopt_active_run=True, **init)

    def _reopen(self) -> None:
        assert isinstance(self.tracker, WandbTracker)
        self.tracker.resume()

    def _after_start(self) -> None:
        assert self.tracker is not None
        run = self.tracker.tracker
        run.define_metric("train/global_step")
        run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def _config(self, args: Any, model: Any) -> dict[str, Any]:
        values = _run_config(args, model)
        if model is not None and hasattr(model, "parameters"):
            values["model/num_parameters"] = sum(p.numel() for p in model.parameters())
        return values

    def _send(self, tracker: Tracker, logs: dict[str, Any], state: TrainerState) -> None:
        run = tracker.tracker
        for key in _SUMMARY_ONLY:
            if key in logs:
                run.summary[key] = _plain(logs[key])
        rest = {k: _plain(v) for k, v in logs.items() if k not in _SUMMARY_ONLY}
        tracker.log({**_rewrite(rest), "train/global_step": state.global_step})

    def on_predict(
        self, args: Any, state: TrainerState, control: TrainerControl, metrics: dict[str, Any], **kwargs: Any
    ) -> Control:
        if state.is_world_process_zero:  # transformers' W&B callback logs predict()'s metrics too
            self._send(self._ensure_open(args, state, kwargs.get("model")), metrics, state)
            if not self._training:
                self._close()
        return None


class MLflowCallback(_TrackerCallback):
    """Logs to an MLflow run, as transformers' ``MLflowCallback``: the store is ``MLFLOW_TRACKING_URI`` (MLflow's
    default without it), the experiment ``MLFLOW_EXPERIMENT_NAME`` (else MLflow's default), the run's name
    ``args.run_name``; ``MLFLOW_RUN_ID`` continues a run, ``MLFLOW_NESTED_RUN`` nests it in the active one,
    ``MLFLOW_TAGS`` (a JSON object) tags it. The model's config and the arguments are the run's parameters
    (``MLFLOW_FLATTEN_PARAMS`` flattens nested ones, ``MLFLOW_MAX_LOG_PARAMS`` keeps the first N); each record's
    numbers are metrics at the optimizer step. A run already active is logged to and left open.
    ``HF_MLFLOW_LOG_ARTIFACTS`` (checkpoints as artifacts) is not honoured.
    """

    name = "mlflow"

    def _make(self, args: Any, state: TrainerState, model: Any) -> Tracker:
        if os.environ.get("HF_MLFLOW_LOG_ARTIFACTS", "false").lower() in ("1", "true", "yes", "on"):
            warn_once(
                "HF_MLFLOW_LOG_ARTIFACTS is not honoured by phalanx's MLflowCallback: checkpoints stay in output_dir"
            )
        return MLflowTracker(run_name=getattr(args, "run_name", None), adopt_active_run=True)

    def _reopen(self) -> None:
        pass  # MLflow takes metrics for a finished run by its id

    def _config(self, args: Any, model: Any) -> dict[str, Any]:
        values = _run_config(args, model)
        if os.environ.get("MLFLOW_FLATTEN_PARAMS", "false").lower() in ("1", "true", "yes", "on"):
            values = flatten(values)
        limit = os.environ.get("MLFLOW_MAX_LOG_PARAMS", "")
        return dict(list(values.items())[: int(limit)]) if limit.isdigit() else values


_TRACKER_CALLBACKS: dict[str, type[TrainerCallback]] = {
    "tensorboard": TensorBoardCallback,
    "wandb": WandbCallback,
    "mlflow": MLflowCallback,
}


def reporting_callbacks(args: Any) -> list[TrainerCallback]:
    """The metric sinks ``args.report_to`` asks for beyond the JSONL log, which is always written.

    ``"tensorboard"``, ``"wandb"`` and ``"mlflow"`` need their package (an ImportError that names the pip extra
    otherwise); ``"all"`` takes those installed; ``"none"`` or an empty list adds nothing; any other name is a
    ValueError.
    """
    raw = getattr(args, "report_to", None)
    return [_TRACKER_CALLBACKS[name]() for name in tracker_names(raw, "report_to")]


class PrinterCallback(TrainerCallback):
    """transformers' callback when ``disable_tqdm`` is set: each log record printed on the main process, as it is."""

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        logs = {k: v for k, v in (kwargs.get("logs") or {}).items() if k != "total_flos"}
        if state.is_local_process_zero:
            sys.stdout.write(f"{logs}\n")
            sys.stdout.flush()
        return None


def default_callbacks(args: Any) -> list[TrainerCallback]:
    """Flow, the sinks ``report_to`` asks for, then the progress bar, or with ``disable_tqdm`` a printer of the logs:
    what a Trainer starts with, as in transformers. (The Trainer writes ``log.jsonl`` itself, outside this list, so
    that the list is transformers' own.)"""
    progress = PrinterCallback() if getattr(args, "disable_tqdm", False) else ProgressCallback()
    return [DefaultFlowCallback(), *reporting_callbacks(args), progress]
