"""Experiment trackers: Weights & Biases, MLflow and TensorBoard behind Accelerate's tracker interface (``start``,
``store_init_configuration``, ``log``, ``finish`` and ``tracker``, the library's own run), shared by the Trainer's
``report_to`` and the Accelerate front's ``log_with``.

    tracker = make_tracker("mlflow", "my-experiment", run_name="lr-1e-3")    # on the main process only
    tracker.start()
    tracker.store_init_configuration({"lr": 1e-3})
    tracker.log({"loss": 0.42}, step=10)
    tracker.finish()

The libraries are optional extras (``pip install phalanx[wandb]``, ``phalanx[mlflow]``), imported when a tracker is
made, never when phalanx is. Each reads its own environment, as under transformers and Accelerate:
``WANDB_MODE=offline`` writes ``wandb/offline-run-*/`` without a network, ``MLFLOW_TRACKING_URI`` picks MLflow's store
(``file:./mlruns``, ``sqlite:///mlflow.db``, a server). Nothing here talks to other ranks: callers make and call
trackers on the main process only.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import os
import re
import time
from typing import Any, ClassVar

from phalanx.logging import warn_once

__all__ = [
    "Tracker",
    "WandbTracker",
    "MLflowTracker",
    "TensorBoardTracker",
    "TRACKERS",
    "EXTRAS",
    "installed_trackers",
    "tracker_names",
    "require",
    "make_tracker",
    "Trackers",
    "BlankTracker",
    "scalar",
    "flatten",
]

# Tracker name -> (the module that must import, the pip extra that installs it).
EXTRAS: dict[str, tuple[str, str]] = {
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "tensorboard": ("tensorboard", "tensorboard"),
}
_TRUE = {"1", "true", "yes", "on"}


def installed_trackers() -> list[str]:
    """The trackers whose library is installed, in a fixed order (what ``"all"`` means)."""
    return [name for name, (module, _) in EXTRAS.items() if importlib.util.find_spec(module) is not None]


def tracker_names(value: Any, where: str) -> list[str]:
    """``value`` as a list of tracker names: None, "none" or [] -> [], "all" -> those installed, a name -> [name].

    Names may be Accelerate's ``LoggerType`` members; duplicates are dropped. ``where`` names the argument in errors,
    e.g. ``"report_to"``. An unknown name is a ValueError that lists the names phalanx knows.
    """
    raw = [] if value is None else [value] if isinstance(value, str) else list(value)
    names: list[str] = []
    for item in raw:
        name = str(getattr(item, "value", item)).lower()
        if name in ("none", "jsonl"):  # log.jsonl is always written; "jsonl" is accepted for it
            continue
        if name == "all":
            found = installed_trackers()
        elif name in EXTRAS:
            found = [name]
        else:
            close = difflib.get_close_matches(name, [*EXTRAS, "all", "none"], n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"{where}={value!r} names {name!r}, a tracker phalanx does not report to; {hint}it reports to "
                f"{', '.join(repr(n) for n in EXTRAS)}, 'all' (those installed) or 'none' "
                "(log.jsonl in output_dir is always written; add another sink as a callback)"
            )
        names += [n for n in found if n not in names]
    return names


def require(name: str, where: str | None = None, load: bool = True) -> Any:
    """Import the library of tracker ``name`` (with ``load=False`` only check that it is installed, which imports
    nothing: what the ranks that never log do), or raise an ImportError that names the pip extra and ``where``, the
    argument that asked for it (e.g. ``"report_to"``)."""
    module, extra = EXTRAS[name]
    try:
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"no module named {module!r}")
        return importlib.import_module(module) if load else None
    except ImportError as e:
        asked = f"{where} includes {name!r}" if where else f"the {name!r} tracker was asked for"
        drop = f", or drop {name!r} from {where}" if where else ""
        raise ImportError(
            f"{asked}, but the {module} package is not installed (pip install phalanx[{extra}]{drop})"
        ) from e


def scalar(value: Any) -> float | None:
    """A logged value as a number (a one-element tensor or numpy value is read), or None when it is not one."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "numel", lambda: 1)() == 1:
        try:
            value = value.item()
        except (TypeError, ValueError):
            return None
    if isinstance(value, (bool, int, float)):
        return float(value)
    return None


class Tracker:
    """Accelerate's ``GeneralTracker`` interface. ``name`` is what ``get_tracker(name)`` finds; ``tracker`` is the
    library's run. A tracker that ``start`` attached to a run someone else began (``owns_run`` False) leaves that run
    open at ``finish``."""

    name: ClassVar[str] = ""
    requires_logging_directory: ClassVar[bool] = False
    main_process_only: ClassVar[bool] = True
    owns_run: bool = False

    def start(self) -> None:
        raise NotImplementedError

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        raise NotImplementedError

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    @property
    def tracker(self) -> Any:
        raise NotImplementedError


class WandbTracker(Tracker):
    """A Weights & Biases run: ``wandb.init(project=run_name, **kwargs)``, as Accelerate's ``WandBTracker``.

    ``run_name`` is the project (Accelerate's naming); ``kwargs`` go to ``wandb.init`` (``name``, ``tags``, ``dir``,
    ``mode``...). With ``adopt_active_run``, a run the user began with ``wandb.init`` is logged to and left open, as
    transformers' callback does. ``WANDB_MODE=offline`` writes the run under ``wandb/offline-run-*/`` for a later
    ``wandb sync``.
    """

    name = "wandb"

    def __init__(self, run_name: str | None, adopt_active_run: bool = False, **kwargs: Any) -> None:
        self._wandb = require("wandb")
        self.project, self.init_kwargs, self.adopt_active_run = run_name, kwargs, adopt_active_run
        self.run: Any = None

    def start(self) -> None:
        if self.adopt_active_run and self._wandb.run is not None:
            self.run, self.owns_run = self._wandb.run, False
            return
        self.run, self.owns_run = self._wandb.init(project=self.project, **self.init_kwargs), True

    def resume(self) -> None:
        """Reopen the finished run (same id) to log more to it, as ``wandb.init(id=..., resume="allow")``."""
        assert self.run is not None, "start() first"
        self.init_kwargs = {**self.init_kwargs, "id": self.run.id, "resume": "allow"}
        self.start()

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        if self.run is not None and self.owns_run:
            self.run.finish()


class MLflowTracker(Tracker):
    """An MLflow run, as Accelerate's ``MLflowTracker``: the environment's ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID``
    (continue that run), ``MLFLOW_TAGS`` (a JSON object) and ``MLFLOW_NESTED_RUN`` win over the arguments, and MLflow
    reads ``MLFLOW_TRACKING_URI`` itself.

    Metrics and parameters are written through ``MlflowClient.log_batch`` to this run's id, synchronously, so they are
    in the store when ``log`` returns and a log after ``finish`` still lands in this run. Values that are not numbers
    are left out of the metrics, with a warning once per key; parameters longer than MLflow's limit are left out too.
    With ``adopt_active_run``, a run already active (``mlflow.start_run`` by the user) is logged to and left open, as
    transformers' callback does.
    """

    name = "mlflow"

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | str | None = None,
        nested_run: bool | str = False,
        run_name: str | None = None,
        description: str | None = None,
        adopt_active_run: bool = False,
    ) -> None:
        self._mlflow = require("mlflow")
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        raw_tags = os.environ.get("MLFLOW_TAGS", tags)
        if isinstance(raw_tags, str):
            try:
                raw_tags = json.loads(raw_tags)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"MLflow tags {raw_tags!r} (MLFLOW_TAGS, or tags=) are not a JSON object ({e}); "
                    'write them as \'{"key": "value"}\''
                ) from None
        self.tags = raw_tags
        nested = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.nested_run = str(nested).lower() in _TRUE if isinstance(nested, str) else bool(nested)
        self.logging_dir, self.run_name, self.description = logging_dir, run_name, description
        self.adopt_active_run = adopt_active_run
        self.active_run: Any = None
        self._client: Any = None

    def start(self) -> None:
        mlflow = self._mlflow
        active = mlflow.active_run()
        if self.adopt_active_run and active is not None and not self.nested_run and self.run_id is None:
            self.active_run, self.owns_run = active, False
        else:
            experiment_id = None
            if self.experiment_name:
                found = mlflow.get_experiment_by_name(self.experiment_name)
                experiment_id = (
                    found.experiment_id
                    if found is not None
                    else mlflow.create_experiment(
                        self.experiment_name,
                        artifact_location=None if self.logging_dir is None else str(self.logging_dir),
                    )
                )
            self.active_run = mlflow.start_run(
                run_id=self.run_id,
                experiment_id=experiment_id,
                run_name=self.run_name,
                nested=self.nested_run,
                tags=self.tags,
                description=self.description,
            )
            self.owns_run = True
        self.run_id = self.active_run.info.run_id
        self._client = mlflow.tracking.MlflowClient()

    @property
    def tracker(self) -> Any:
        return self.active_run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = []
        for key, value in values.items():
            if len(str(value)) > MAX_PARAM_VAL_LENGTH:
                warn_once(f"MLflow: parameter {key!r} is left out: its value is over {MAX_PARAM_VAL_LENGTH} characters")
            else:
                params.append(Param(key, str(value)))
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            try:
                self._client.log_batch(self.run_id, params=params[i : i + MAX_PARAMS_TAGS_PER_BATCH])
            except self._mlflow.exceptions.MlflowException as e:
                # A continued run (MLFLOW_RUN_ID, a resume) whose arguments changed: MLflow keeps the first values.
                warn_once(f"MLflow kept the run's earlier parameters: {e}")

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        metrics = []
        for key, value in values.items():
            number = scalar(value)
            if number is None:
                warn_once(f"MLflow: {key!r} is not logged: its value {value!r} is not a number (metrics are numbers)")
                continue
            # MLflow refuses some characters in metric names (transformers replaces them the same way).
            metrics.append(Metric(re.sub(r"[^0-9A-Za-z_\-. :/]", "_", key), number, now, step or 0))
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])

    def finish(self) -> None:
        if self.active_run is None or not self.owns_run:
            return
        active = self._mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            self._mlflow.end_run()
        else:
            self._client.set_terminated(self.run_id)


class TensorBoardTracker(Tracker):
    """TensorBoard event files under ``logging_dir/run_name``, as Accelerate's ``TensorBoardTracker``: numbers as
    scalars, strings as text, a dict as grouped scalars; the configuration as hparams."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.logging_dir = os.path.join(logging_dir, run_name)
        self._writer_class, self.writer_kwargs = SummaryWriter, kwargs
        self.writer: Any = None

    def start(self) -> None:
        self.writer = self._writer_class(self.logging_dir, **self.writer_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        kept = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()}
        self.writer.add_hparams(kept, metric_dict={}, run_name=".")
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            elif (number := scalar(value)) is not None:
                self.writer.add_scalar(key, number, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


TRACKERS: dict[str, type[Tracker]] = {"wandb": WandbTracker, "mlflow": MLflowTracker, "tensorboard": TensorBoardTracker}


def make_tracker(name: str, project: str, logging_dir: str | None = None, /, **kwargs: Any) -> Tracker:
    """Tracker ``name`` for ``project`` as Accelerate's ``init_trackers`` makes it: wandb's project, MLflow's
    experiment, TensorBoard's folder under ``logging_dir``; ``kwargs`` are the tracker's own (``init_kwargs[name]``,
    where wandb's ``name=`` is the run's name: hence the positional-only arguments)."""
    cls = TRACKERS[name]
    if cls.requires_logging_directory:
        if logging_dir is None:
            raise ValueError(
                f"the {name!r} tracker writes under a logging directory, and none was given "
                "(pass project_dir=... or ProjectConfiguration(logging_dir=...) to the Accelerator)"
            )
        return cls(project, logging_dir, **kwargs)  # type: ignore[call-arg]
    return cls(project, **kwargs)  # type: ignore[call-arg]


class BlankTracker:
    """What Accelerate's ``get_tracker`` gives on a process that runs no tracker: calls on it do nothing."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tracker = None

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class Trackers:
    """The trackers of one Accelerator, as Accelerate's ``log_with``, ``init_trackers``, ``log``, ``get_tracker`` and
    ``end_training`` use them. ``requests`` are names (checked when made: an unknown name or a missing library fails
    on every rank before any run starts) and tracker objects with Accelerate's methods; ``started`` holds the runs
    that ``start`` began. The caller calls ``start`` and ``log`` on the main process only."""

    def __init__(self, log_with: Any, where: str, logging_dir: str | None) -> None:
        items = [] if log_with is None else list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
        self.requests: list[Any] = []
        for item in items:
            if isinstance(item, str) or not hasattr(item, "log"):
                for name in tracker_names(item, where):
                    require(name, where, load=False)  # imported by start(), on the main process only
                    if name not in self.requests:
                        self.requests.append(name)
            else:
                self.requests.append(item)
        if "tensorboard" in self.requests and logging_dir is None:
            raise ValueError(
                f"{where} includes 'tensorboard', which writes under a logging directory, and none was given "
                "(pass project_dir=..., or project_config=ProjectConfiguration(logging_dir=...))"
            )
        self.logging_dir = logging_dir
        self.started: list[Any] = []

    def start(self, project: str, config: dict[str, Any] | None, init_kwargs: dict[str, Any] | None) -> None:
        init_kwargs = init_kwargs or {}
        for request in self.requests:
            tracker = (
                make_tracker(request, project, self.logging_dir, **init_kwargs.get(request, {}))
                if isinstance(request, str)
                else request
            )
            tracker.start()
            if config is not None:
                tracker.store_init_configuration(config)
            self.started.append(tracker)

    def log(self, values: dict[str, Any], step: int | None, log_kwargs: dict[str, Any] | None) -> None:
        for tracker in self.started:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def get(self, name: str, unwrap: bool) -> Any:
        if not self.started:
            return BlankTracker(name)
        for tracker in self.started:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(
            f"get_tracker({name!r}): no started tracker has that name; the started ones are "
            f"{[t.name for t in self.started]} (name it in log_with=..., then call init_trackers)"
        )

    def finish(self) -> None:
        started = list(self.started)
        self.started.clear()
        for tracker in started:
            tracker.finish()


def flatten(values: dict[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Nested dicts as one level, keys joined by ``sep`` (transformers' ``MLFLOW_FLATTEN_PARAMS``)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(flatten(value, name, sep))
        else:
            out[name] = value
    return out
