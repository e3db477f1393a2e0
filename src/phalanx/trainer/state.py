"""The Trainer's state and control flags, in Hugging Face's shapes, so that ``trainer_state.json`` reads the same.

    state = TrainerState(max_steps=1000, logging_steps=10)
    state.save_to_json("out/checkpoint-1000/trainer_state.json")   # the layout transformers writes
    state = TrainerState.load_from_json("out/checkpoint-1000/trainer_state.json")

A *step* here is always an optimizer step: with ``gradient_accumulation_steps=4`` one step consumes four
micro-batches on every rank. ``TrainerControl`` holds the switches that callbacks flip to ask the loop for a log,
an evaluation, a save, or a stop; the loop clears them at the boundaries named by its ``_new_*`` methods.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from phalanx.logging import warn_once

__all__ = [
    "TrainerState",
    "TrainerControl",
    "ExportableState",
    "arguments_that_differ",
    "TrainerStateHolder",
    "TRAINER_STATE_NAME",
    "metric_key",
    "greater_is_better",
    "improves",
    "record_best_metric",
    "strategy_of",
]

TRAINER_STATE_NAME = "trainer_state.json"


@runtime_checkable
class ExportableState(Protocol):
    """An object whose settings and counters go into ``trainer_state.json`` under ``stateful_callbacks``.

    ``state()`` returns ``{"args": {...constructor arguments...}, "attributes": {...counters...}}``, plain JSON.
    """

    def state(self) -> dict[str, Any]: ...


def _export(callbacks: Any) -> dict[str, Any]:
    """``stateful_callbacks`` as HF stores it: class name -> state, or a list of states for repeated classes."""
    if callbacks is None:
        return {}
    if isinstance(callbacks, dict):
        return callbacks
    exported: dict[str, Any] = {}
    for cb in callbacks:
        if not isinstance(cb, ExportableState):
            raise TypeError(
                f"stateful_callbacks takes objects with a state() method (ExportableState); got {type(cb).__name__} "
                "(give it state() returning {'args': ..., 'attributes': ...}, or leave it out of stateful_callbacks)"
            )
        name, st = type(cb).__name__, cb.state()
        if name not in exported:
            exported[name] = st
        elif isinstance(exported[name], list):
            exported[name].append(st)
        else:
            exported[name] = [exported[name], st]
    return exported


@dataclass
class TrainerState:
    """What the Trainer knows about its run; saved beside every checkpoint as ``trainer_state.json``.

    The field names, defaults and JSON layout are Hugging Face's, so their tools read our files and ours read theirs.
    """

    epoch: float = 0.0
    """The epoch reached; the fraction is the part of the current epoch done."""
    global_step: int = 0
    """Optimizer steps completed (not micro-batches)."""
    max_steps: int = 0
    """Optimizer steps this run will take."""
    logging_steps: int = 500
    """Log every this many optimizer steps (resolved from a ratio by :meth:`compute_steps`)."""
    eval_steps: int = 500
    """Evaluate every this many optimizer steps."""
    save_steps: int = 500
    """Save a checkpoint every this many optimizer steps."""
    train_batch_size: int | None = None
    """The per-device training batch size."""
    num_train_epochs: int = 0
    """Epochs this run will take."""
    num_input_tokens_seen: int = 0
    """Input tokens consumed so far, over all ranks, when the Trainer counts them."""
    total_flos: float = 0.0
    """Floating-point operations done so far (a float, so that it never overflows)."""
    log_history: list[dict[str, Any]] = field(default_factory=list)
    """Every record logged so far, oldest first; each carries ``step`` (an optimizer step)."""
    best_metric: float | None = None
    """The best value of ``metric_for_best_model`` seen so far."""
    best_global_step: int | None = None
    """The optimizer step at which ``best_metric`` was reached."""
    best_model_checkpoint: str | None = None
    """The checkpoint directory holding the best model, once it is saved."""
    is_local_process_zero: bool = True
    """Whether this process is rank 0 of its machine."""
    is_world_process_zero: bool = True
    """Whether this process is rank 0 of the whole run: the one that logs and writes shared files."""
    is_hyper_param_search: bool = False
    """Whether the run is a trial of a hyper-parameter search."""
    trial_name: str | None = None
    """The search trial's name, when there is one."""
    trial_params: dict[str, str | float | int | bool] | None = None
    """The search trial's parameters, when there is one."""
    stateful_callbacks: Any = field(default_factory=dict)
    """Callbacks' exported state by class name (a dict); a list of :class:`ExportableState` given here is converted
    on construction, as HF does, hence the loose type."""

    def __post_init__(self) -> None:
        if self.log_history is None:  # HF's own files never hold null here, but older ones did
            self.log_history = []
        self.stateful_callbacks = _export(self.stateful_callbacks)

    def save_to_json(self, json_path: str | os.PathLike[str]) -> None:
        """Write the state as HF does (sorted keys, indent 2, trailing newline), atomically: a crash while writing
        leaves the previous file whole."""
        text = json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"
        path = Path(json_path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load_from_json(cls, json_path: str | os.PathLike[str]) -> TrainerState:
        """Read a ``trainer_state.json`` written by us or by transformers. Keys this version does not know (from a
        newer writer) are dropped with a warning rather than failing the resume."""
        path = Path(json_path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(
                f"{path} is not valid JSON ({e}); it should be a trainer_state.json (delete or restore it)"
            ) from e
        if not isinstance(data, dict):
            raise ValueError(f"{path} should hold a JSON object of TrainerState fields; got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            warn_once(f"{path}: ignoring keys that TrainerState does not know: {unknown}")
        return cls(**{k: v for k, v in data.items() if k in known})

    def compute_steps(self, args: Any, max_steps: int) -> None:
        """Take ``logging_steps``, ``eval_steps`` and ``save_steps`` from ``args``; a value below 1 is a fraction of
        ``max_steps`` (rounded up), as in HF. ``None`` keeps the current value."""
        for kind in ("logging", "eval", "save"):
            value = getattr(args, f"{kind}_steps", None)
            if value is None:
                continue
            if value <= 0:
                raise ValueError(
                    f"{kind}_steps must be > 0 (an interval in optimizer steps, or a fraction of max_steps below 1); "
                    f"got {value} (use {kind}_strategy='no' to turn it off)"
                )
            setattr(self, f"{kind}_steps", math.ceil(max_steps * value) if value < 1 else int(value))


@dataclass
class TrainerControl:
    """The switches callbacks set to steer the loop.

    ``should_training_stop`` stays set until a new ``train()``; ``should_epoch_stop`` until the next epoch;
    the other three are cleared at the start of every optimizer step.
    """

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False

    def state(self) -> dict[str, Any]:
        return {"args": dataclasses.asdict(self), "attributes": {}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TrainerControl:
        return cls(**state["args"])


# ------------------------------------------------------------------------------------------------ best metric
def strategy_of(args: Any, name: str, allowed: tuple[str, ...]) -> str:
    """``args.<name>`` as a plain string (HF's str enums included), checked against ``allowed``."""
    raw = getattr(args, name, "no")
    value = str(getattr(raw, "value", raw))
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}; got {raw!r}")
    return value


def metric_key(args: Any) -> str:
    """The key ``metric_for_best_model`` names in evaluation metrics: ``"f1"`` -> ``"eval_f1"``, as in HF."""
    name = getattr(args, "metric_for_best_model", None)
    if not name:
        raise ValueError(
            "metric_for_best_model is not set; it names the evaluation metric that decides the best model "
            "(set metric_for_best_model='loss', or 'accuracy' with greater_is_better=True)"
        )
    return name if name.startswith("eval_") else f"eval_{name}"


def greater_is_better(args: Any) -> bool:
    """``args.greater_is_better``, or HF's default when it is None: lower is better for a loss, higher otherwise."""
    value = getattr(args, "greater_is_better", None)
    if value is None:
        return metric_key(args) != "eval_loss"
    return bool(value)


def improves(args: Any, value: float, best: float | None, threshold: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` in the direction ``args`` asks for, by more than ``threshold``."""
    if best is None:
        return True
    better = value > best if greater_is_better(args) else value < best
    return better and abs(value - best) > threshold


def record_best_metric(args: Any, state: TrainerState, metrics: dict[str, Any]) -> bool:
    """Update ``state.best_metric`` / ``best_global_step`` from an evaluation's metrics; return whether it is a new
    best. The Trainer calls this after ``on_evaluate`` (HF's order), so callbacks see the previous best there.
    Does nothing and returns False when ``metric_for_best_model`` is not set."""
    if getattr(args, "metric_for_best_model", None) is None:
        return False
    key = metric_key(args)
    if key not in metrics:
        raise KeyError(
            f"metric_for_best_model={args.metric_for_best_model!r} looks for {key!r} in the evaluation metrics, "
            f"which hold {sorted(metrics)} (set metric_for_best_model to one of them, or return it from "
            "compute_metrics)"
        )
    value = float(metrics[key])
    if math.isnan(value) or not improves(args, value, state.best_metric):
        return False
    state.best_metric = value
    if strategy_of(args, "save_strategy", ("no", "steps", "epoch", "best")) != "no":
        state.best_global_step = state.global_step
    return True


def arguments_that_differ(args: Any, state: TrainerState) -> list[str]:
    """The step counts and batch size of ``args`` that differ from those a checkpoint's state was saved with, as
    transformers lists them on a resume: ``"save_steps: 10 (from args) != 5 (from trainer_state.json)"``."""
    return [
        f"{name}: {mine} (from args) != {saved} (from trainer_state.json)"
        for name, mine, saved in (
            ("logging_steps", args.logging_steps, state.logging_steps),
            ("eval_steps", args.eval_steps, state.eval_steps),
            ("save_steps", args.save_steps, state.save_steps),
            ("per_device_train_batch_size", args.per_device_train_batch_size, state.train_batch_size),
        )
        if mine is not None and saved is not None and mine != saved
    ]


class TrainerStateHolder:
    """Puts the TrainerState inside the engine's atomic checkpoint, so that a resume finds it with the weights."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"trainer_state": dataclasses.asdict(self.trainer.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = dict(state["trainer_state"])
        for key in ("is_local_process_zero", "is_world_process_zero"):
            saved[key] = getattr(self.trainer.state, key)
        self.trainer.state = TrainerState(**saved)
