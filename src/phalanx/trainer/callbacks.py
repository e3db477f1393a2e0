"""Trainer callbacks with Hugging Face's events and signatures, and the ones every run uses.

    trainer = Trainer(model, args, ..., callbacks=[MyCallback, EarlyStoppingCallback(early_stopping_patience=3)])

Every event is called as ``(args, state, control, **kwargs)`` with ``model``, ``processing_class``, ``optimizer``,
``lr_scheduler``, ``train_dataloader`` and ``eval_dataloader`` among the kwargs, and may return a
:class:`TrainerControl`, which then replaces the one the next callback receives. ``args`` is duck-typed: anything
with TrainingArguments' field names works. A *step* is an optimizer step everywhere, and the logs say so."""

from __future__ import annotations

import math
from typing import Any

from phalanx.logging import get_logger, warn_once
from phalanx.trainer.state import TrainerControl, TrainerState, improves, metric_key, strategy_of

__all__ = [
    "TrainerCallback",
    "CallbackHandler",
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "restore_callback_states",
]

_INTERVALS = ("no", "steps", "epoch")
_SAVES = ("no", "steps", "epoch", "best")
Control = TrainerControl | None


class TrainerCallback:
    """Override the events you need; each may change ``control`` and return it. The base class does nothing."""

    def on_init_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """After the Trainer is constructed."""

    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """At the start of ``train()``, after a resumed state is loaded."""

    def on_train_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """At the end of ``train()``."""

    def on_epoch_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """At the start of an epoch."""

    def on_epoch_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """At the end of an epoch."""

    def on_step_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """Before the first micro-batch of an optimizer step."""

    def on_pre_optimizer_step(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """After gradients are reduced and clipped, before the optimizer steps: the place to inspect gradients."""

    def on_optimizer_step(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """After the optimizer steps, before gradients are zeroed."""

    def on_substep_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """After each micro-batch of an accumulation window except the last."""

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """After an optimizer step; ``state.global_step`` already counts it."""

    def on_evaluate(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """After an evaluation; its results are in ``kwargs["metrics"]``."""

    def on_predict(
        self, args: Any, state: TrainerState, control: TrainerControl, metrics: dict[str, Any], **kwargs: Any
    ) -> Control:
        """After ``predict()``, with its metrics."""

    def on_save(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """After a checkpoint is complete on disk."""

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """After a record is logged; it is in ``kwargs["logs"]``."""

    def on_push_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """Before a push to the Hub (transformers' event; phalanx does not push, so it never fires)."""

    def on_prediction_step(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        """After each evaluation or prediction batch."""


class CallbackHandler(TrainerCallback):
    """Calls its callbacks in the order they were added, with the Trainer's objects as keyword arguments."""

    def __init__(
        self,
        callbacks: list[Any] | tuple[Any, ...] = (),
        model: Any = None,
        processing_class: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
    ) -> None:
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks:
            self.add_callback(cb)
        self.model, self.processing_class, self.optimizer, self.lr_scheduler = (
            model,
            processing_class,
            optimizer,
            lr_scheduler,
        )
        self.train_dataloader: Any = None  # set by the Trainer when it builds them
        self.eval_dataloader: Any = None
        if not any(isinstance(cb, DefaultFlowCallback) for cb in self.callbacks):
            get_logger().warning(
                "no DefaultFlowCallback among the callbacks [%s]: nothing will decide when to log, evaluate, save or "
                "stop (add it with add_callback(DefaultFlowCallback))",
                self.callback_list,
            )

    def add_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> None:
        """Append a callback; a class is instantiated with no arguments."""
        cb = callback() if isinstance(callback, type) else callback
        if not all(callable(getattr(cb, event, None)) for event in ("on_step_end", "on_log")):
            raise TypeError(
                f"callbacks must be TrainerCallback subclasses or instances; got {cb!r} (subclass TrainerCallback)"
            )
        if any(type(c) is type(cb) for c in self.callbacks):
            warn_once(
                f"adding a second {type(cb).__name__}; the callbacks are now "
                f"[{self.callback_list}, {type(cb).__name__}]"
            )
        self.callbacks.append(cb)

    def pop_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> TrainerCallback | None:
        """Remove and return the first callback of that class, or that very instance; None if there is none."""
        for cb in self.callbacks:
            if isinstance(cb, callback) if isinstance(callback, type) else cb is callback:
                self.callbacks.remove(cb)
                return cb
        return None

    def remove_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> None:
        """Like :meth:`pop_callback`; removing an instance that is not there is an error."""
        if self.pop_callback(callback) is None and not isinstance(callback, type):
            raise ValueError(f"{callback!r} is not among the callbacks [{self.callback_list}]; nothing was removed")

    @property
    def callback_list(self) -> str:
        return ", ".join(type(cb).__name__ for cb in self.callbacks)

    def call_event(
        self, event: str, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        for cb in self.callbacks:
            result = getattr(cb, event)(
                args,
                state,
                control,
                model=self.model,
                processing_class=self.processing_class,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                train_dataloader=self.train_dataloader,
                eval_dataloader=self.eval_dataloader,
                **kwargs,
            )
            if result is not None:
                control = result
        return control

    # The handler clears the flags an event answers before its callbacks run, so each decision is made afresh.
    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        control._new_training()
        return self.call_event("on_train_begin", args, state, control, **kwargs)

    def on_epoch_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        control._new_epoch()
        return self.call_event("on_epoch_begin", args, state, control, **kwargs)

    def on_step_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        control._new_step()
        return self.call_event("on_step_begin", args, state, control, **kwargs)

    def on_evaluate(
        self,
        args: Any,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TrainerControl:  # type: ignore[override]
        control.should_evaluate = False
        return self.call_event("on_evaluate", args, state, control, metrics=metrics, **kwargs)

    def on_predict(
        self, args: Any, state: TrainerState, control: TrainerControl, metrics: dict[str, Any], **kwargs: Any
    ) -> TrainerControl:
        return self.call_event("on_predict", args, state, control, metrics=metrics, **kwargs)

    def on_save(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        control.should_save = False
        return self.call_event("on_save", args, state, control, **kwargs)

    def on_log(
        self, args: Any, state: TrainerState, control: TrainerControl, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> TrainerControl:  # type: ignore[override]
        control.should_log = False
        return self.call_event("on_log", args, state, control, logs=logs if logs is not None else {}, **kwargs)

    # The rest only dispatch.
    def on_init_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        return self.call_event("on_init_end", args, state, control, **kwargs)

    def on_train_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        return self.call_event("on_train_end", args, state, control, **kwargs)

    def on_epoch_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        return self.call_event("on_epoch_end", args, state, control, **kwargs)

    def on_pre_optimizer_step(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        return self.call_event("on_pre_optimizer_step", args, state, control, **kwargs)

    def on_optimizer_step(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        return self.call_event("on_optimizer_step", args, state, control, **kwargs)

    def on_substep_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        return self.call_event("on_substep_end", args, state, control, **kwargs)

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        return self.call_event("on_step_end", args, state, control, **kwargs)

    def on_prediction_step(
        self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        return self.call_event("on_prediction_step", args, state, control, **kwargs)

    def on_push_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        return self.call_event("on_push_begin", args, state, control, **kwargs)


def _every(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


class DefaultFlowCallback(TrainerCallback):
    """Decides when to log, evaluate, save and stop from the logging / eval / save strategies, as HF does.

    ``steps``: every ``state.<kind>_steps`` optimizer steps; ``epoch``: at each epoch end; ``no``: never.
    ``logging_first_step`` logs after step 1; evaluation waits for ``eval_delay``. At ``max_steps`` training stops,
    with a last evaluation and save under ``steps``. ``save_strategy="best"`` saves after an evaluation whose
    ``metric_for_best_model`` beats ``state.best_metric`` (which the Trainer then updates: ``record_best_metric``).
    """

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        step = state.global_step
        logging, evaluation = (
            strategy_of(args, "logging_strategy", _INTERVALS),
            strategy_of(args, "eval_strategy", _INTERVALS),
        )
        saving, delay = strategy_of(args, "save_strategy", _SAVES), getattr(args, "eval_delay", 0) or 0
        if step == 1 and getattr(args, "logging_first_step", False):
            control.should_log = True
        if logging == "steps" and _every(step, state.logging_steps):
            control.should_log = True
        eval_due = evaluation == "steps" and delay <= step
        if eval_due and _every(step, state.eval_steps):
            control.should_evaluate = True
        if saving == "steps" and _every(step, state.save_steps):
            control.should_save = True
        if state.max_steps > 0 and step >= state.max_steps:
            control.should_training_stop = True
            control.should_evaluate = control.should_evaluate or eval_due
            control.should_save = control.should_save or saving == "steps"
        return control

    def on_epoch_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        if strategy_of(args, "logging_strategy", _INTERVALS) == "epoch":
            control.should_log = True
        if (
            strategy_of(args, "eval_strategy", _INTERVALS) == "epoch"
            and (getattr(args, "eval_delay", 0) or 0) <= state.epoch
        ):
            control.should_evaluate = True
        if strategy_of(args, "save_strategy", _SAVES) == "epoch":
            control.should_save = True
        return control

    def on_evaluate(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        if strategy_of(args, "save_strategy", _SAVES) != "best":
            return control
        metrics, key = kwargs.get("metrics") or {}, metric_key(args)
        # An evaluate() with another metric_key_prefix (a test set) has no say in which checkpoint is best.
        if key in metrics and not math.isnan(value := float(metrics[key])) and improves(args, value, state.best_metric):
            control.should_save = True
        return control


class EarlyStoppingCallback(TrainerCallback):
    """Stops training once ``metric_for_best_model`` has failed to beat the best value by more than
    ``early_stopping_threshold`` on ``early_stopping_patience`` evaluations in a row.

    It compares against ``state.best_metric``, which the Trainer updates after each evaluation's callbacks, so it
    needs ``metric_for_best_model`` and an ``eval_strategy`` other than "no"; without ``load_best_model_at_end`` the
    run still stops, but keeps its last weights rather than the best (a warning says so).
    """

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float | None = 0.0) -> None:
        if (
            isinstance(early_stopping_patience, bool)
            or not isinstance(early_stopping_patience, int)
            or early_stopping_patience < 1
        ):
            raise ValueError(
                f"early_stopping_patience counts evaluations without improvement and must be an int >= 1; "
                f"got {early_stopping_patience!r}"
            )
        threshold = 0.0 if early_stopping_threshold is None else float(early_stopping_threshold)
        if not threshold >= 0.0:
            raise ValueError(
                "early_stopping_threshold is the least improvement that counts and must be >= 0; "
                f"got {early_stopping_threshold!r}"
            )
        self.early_stopping_patience, self.early_stopping_threshold = early_stopping_patience, threshold
        self.early_stopping_patience_counter = 0

    def check_metric_value(self, args: Any, state: TrainerState, control: TrainerControl, metric_value: float) -> None:
        if improves(args, metric_value, state.best_metric, self.early_stopping_threshold):
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1

    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        if getattr(args, "metric_for_best_model", None) is None:
            raise ValueError(
                "EarlyStoppingCallback needs metric_for_best_model to know what improving means; got None "
                "(set metric_for_best_model='loss', or the name of a metric compute_metrics returns)"
            )
        if strategy_of(args, "eval_strategy", _INTERVALS) == "no":
            raise ValueError(
                "EarlyStoppingCallback needs evaluations to watch; got eval_strategy='no' "
                "(set eval_strategy='steps' with eval_steps, or 'epoch')"
            )
        if not getattr(args, "load_best_model_at_end", False):
            warn_once(
                "EarlyStoppingCallback without load_best_model_at_end=True: training stops early, but the model "
                "keeps its last weights, not the best ones"
            )
        return None

    def on_evaluate(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Control:
        metrics, key = kwargs.get("metrics") or {}, metric_key(args)
        if key not in metrics:
            warn_once(
                f"EarlyStoppingCallback looks for {key!r} (from metric_for_best_model) but the evaluation returned "
                f"{sorted(metrics)}; this evaluation does not count towards early stopping"
            )
            return None
        self.check_metric_value(args, state, control, float(metrics[key]))
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True
        return control

    def state(self) -> dict[str, Any]:
        return {
            "args": {
                "early_stopping_patience": self.early_stopping_patience,
                "early_stopping_threshold": self.early_stopping_threshold,
            },
            "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter},
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EarlyStoppingCallback:
        cb = cls(**state["args"])
        cb.early_stopping_patience_counter = int(state["attributes"]["early_stopping_patience_counter"])
        return cb


def restore_callback_states(handler: CallbackHandler, control: TrainerControl, saved: dict[str, Any]) -> TrainerControl:
    """transformers' ``restore_callback_states_from_checkpoint``: each saved state (``stateful_callbacks``) given back
    to a new callback of its class, in place of the one the handler holds; the control's too, which is returned.
    Saved classes this run does not have are named once."""
    missing = []
    present: list[Any] = [*handler.callbacks, control]
    for name, states in saved.items():
        same = [cb for cb in present if type(cb).__name__ == name]
        if not same:
            missing.append(name)
            continue
        for callback, data in zip(same, states if isinstance(states, list) else [states]):
            fresh = type(callback)(**data.get("args", {}))
            for attribute, value in data.get("attributes", {}).items():
                setattr(fresh, attribute, value)
            if isinstance(callback, TrainerControl):
                control = fresh
            else:
                handler.remove_callback(callback)
                handler.add_callback(fresh)
    if missing:
        warn_once(f"the checkpoint holds the state of callbacks this run does not have; not used: {', '.join(missing)}")
    return control
