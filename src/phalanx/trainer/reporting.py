"""The callbacks that report a run: the rank-0 progress bar, the JSONL log that is always written, TensorBoard when
``report_to`` asks for it, and the list a Trainer starts with. A *step* is an optimizer step, and the logs say so."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from phalanx.trainer.callbacks import DefaultFlowCallback, TrainerCallback
from phalanx.trainer.state import TrainerControl, TrainerState
from phalanx.trainer.tracking import JsonlMetrics, ProgressBar

__all__ = [
    "ProgressCallback",
    "PrinterCallback",
    "JsonlLoggingCallback",
    "TensorBoardCallback",
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


def reporting_callbacks(args: Any) -> list[TrainerCallback]:
    """The metric sinks ``args.report_to`` asks for beyond the JSONL log, which is always written.

    ``"tensorboard"`` needs the package (a clear ImportError otherwise); ``"all"`` takes what is installed;
    ``"none"`` or an empty list adds nothing. Other integrations (wandb, mlflow) are not built in.
    """
    raw = getattr(args, "report_to", None)
    names = set([] if raw is None else [raw] if isinstance(raw, str) else raw) - {"none", "jsonl"}
    if names - {"tensorboard", "all"}:
        raise ValueError(
            f"report_to={raw!r} names {sorted(names - {'tensorboard', 'all'})}, which phalanx does not report to; "
            "it supports 'tensorboard' and 'all' "
            "(log.jsonl in output_dir is always written; add other sinks as a callback)"
        )
    try:
        return [TensorBoardCallback()] if names else []
    except ImportError:
        if "tensorboard" in names:
            raise
        return []  # "all" takes only what is installed


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
