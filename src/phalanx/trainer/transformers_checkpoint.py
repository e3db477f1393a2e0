"""Resuming from a ``checkpoint-N/`` that transformers' Trainer wrote, so that a run can move to phalanx mid-way.

    trainer = phalanx.Trainer(model, args, train_dataset=data)       # the same model, arguments and data
    trainer.train(resume_from_checkpoint="out/checkpoint-500")       # written by transformers.Trainer

What is read, and how:

- the weights, from ``model.safetensors`` (or its shards and index), each rank only the slices it holds; a
  checkpoint written under DeepSpeed (``global_stepN/``) or FSDP (``pytorch_model_fsdp_0/`` and ``optimizer_0/``)
  has its weights and moments read from those instead, by parameter name (checkpoint/foreign/);
- ``optimizer.pt``: the moments and step of every parameter, and the hyperparameters of each group. transformers'
  file numbers the parameters in the order of the optimizer's groups; phalanx names them by the optimizer it built
  (the same groups, in the same order, as transformers builds them) and loads them under any strategy;
- ``scheduler.pt``: the schedule's counters (``last_epoch``, the last rates);
- ``rng_state.pth`` (``rng_state_<rank>.pth`` on several processes): Python's, numpy's and torch's generators;
- ``trainer_state.json``: the step, epoch, logs and best metric; and from the step, where the data goes on: the
  same epoch and batch at which transformers itself would go on (it skips the batches of the epoch already seen).

The three ``.pt``/``.pth`` files are pickles. They are read with ``torch.load(weights_only=True)``, which rebuilds
tensors and plain containers only (numpy's generator state is allowed by name) and runs no code: the one place phalanx
reads a pickle, because that is the only form transformers writes them in. ``training_args.bin`` is never read (it
would need full unpickling); the arguments of this run apply, and those that differ from the checkpoint's are named
once. phalanx writes no pickles, so transformers cannot resume from a phalanx checkpoint: the direction is one way.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phalanx.checkpoint.foreign import detect, load_foreign
from phalanx.checkpoint.format import MANIFEST, CheckpointError
from phalanx.logging import warn_once
from phalanx.strategies.deferred_init import mark_loaded
from phalanx.trainer.state import TrainerState

__all__ = [
    "is_transformers_checkpoint",
    "latest_transformers_checkpoint",
    "resume_from_transformers",
    "resume_from_foreign",
]

TRAINER_STATE = "trainer_state.json"
_NAME = re.compile(r"checkpoint-(\d+)")


def is_transformers_checkpoint(path: str | Path) -> bool:
    """A directory with transformers' ``trainer_state.json`` and no phalanx manifest."""
    p = Path(path)
    return (p / TRAINER_STATE).is_file() and not (p / MANIFEST).is_file()


def latest_transformers_checkpoint(output_dir: str | Path) -> Path | None:
    """The ``checkpoint-N`` under ``output_dir`` with the largest N that transformers wrote (``resume=True``)."""
    found = [
        (int(m.group(1)), p)
        for p in Path(output_dir).glob("checkpoint-*")
        if (m := _NAME.fullmatch(p.name)) and is_transformers_checkpoint(p)
    ]
    return max(found)[1] if found else None


def _load(path: Path) -> Any:
    """A transformers ``.pt``/``.pth`` file through ``torch.load(weights_only=True)`` (see the module docstring)."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the reason torch gives is the useful part
        raise CheckpointError(
            f"{path} could not be read with torch.load(weights_only=True), which phalanx insists on for a pickle "
            f"({type(e).__name__}: {e}); resume from a checkpoint with safe contents, or start from its weights "
            "(model.from_pretrained(dir)) without resuming"
        ) from None


def _optimizer_state(saved: dict[str, Any], order: list[list[str]], path: Path) -> dict[str, dict[str, Any]]:
    """transformers' optimizer ``state_dict()`` (parameters numbered across the groups) as {parameter name: state},
    ``order`` being the names in the groups of the optimizer this Trainer built."""
    groups = saved.get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(names) for names in order]:
        raise CheckpointError(
            f"{path} holds an optimizer with groups of {[len(g['params']) for g in groups]} parameters; this Trainer's "
            f"has {[len(names) for names in order]}: resume with the same model, optimizer and weight-decay grouping"
        )
    by_index = {i: name for g, names in zip(groups, order) for i, name in zip(g["params"], names)}
    return {by_index[i]: dict(state) for i, state in saved.get("state", {}).items() if i in by_index}


def place_data(trainer: Any, step: int, per_epoch: int) -> None:
    """Where the data goes on after ``step`` optimizer steps: the same epoch and batch at which transformers itself
    would go on (it skips the batches of the epoch already seen)."""
    epoch, step_in_epoch = divmod(step, max(1, per_epoch))
    loader = trainer._train_loader
    samples = step_in_epoch * trainer.args.gradient_accumulation_steps * loader.total_batch_size
    loader.load_state_dict({"epoch": epoch, "samples_done": samples, "seed": loader.state_dict()["seed"]})


def resume_from_foreign(trainer: Any, path: Path, per_epoch: int) -> None:
    """Another tool's checkpoint with no ``trainer_state.json`` (a DeepSpeed or DCP folder): the weights, moments and
    step from it (``engine.load_state``), and the data placed after that step as transformers would place it."""
    trainer.engine.load_state(path)
    trainer.state.global_step = trainer.engine.global_step
    place_data(trainer, trainer.engine.global_step, per_epoch)


def resume_from_transformers(trainer: Any, path: Path, per_epoch: int) -> None:
    """Load everything transformers' Trainer saved at ``path`` into the prepared ``trainer`` (every rank calls it);
    ``per_epoch`` is the number of optimizer steps in an epoch, which places the data."""
    engine = trainer.engine
    optimizer_file = path / "optimizer.pt"
    state = None
    layout = detect(path)  # written under DeepSpeed (global_stepN/) or FSDP (pytorch_model_fsdp_0/, optimizer_0/)
    if layout is not None:
        parts, view = engine._parts(), engine._tp.state_view(engine.strategy)
        load_foreign(path, layout, parts, view, engine.topology, engine.device, weights_and_optimizer_only=True)
        for model in parts.models:
            mark_loaded(engine.unwrap_model(model))
    elif optimizer_file.is_file():
        saved = _load(optimizer_file)
        state = _optimizer_state(saved, trainer._optimizer_order, optimizer_file)
        inner = trainer.optimizer.optimizer  # the prepared optimizer's own groups: the hyperparameters go there
        for group, hyper in zip(inner.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in hyper.items() if k != "params"})
    else:
        warn_once(f"{path} has no optimizer.pt: the optimizer starts afresh from the checkpoint's weights")
    if layout is None:
        engine.load_model(path, optimizer_state=state)  # the weights, and the moments with them, under any strategy
    scheduler_file = path / "scheduler.pt"
    if scheduler_file.is_file():
        saved = _load(scheduler_file)
        ours = trainer.lr_scheduler.state_dict()
        trainer.lr_scheduler.load_state_dict({k: v for k, v in saved.items() if k in ours and k != "schedule"})
    else:
        warn_once(f"{path} has no scheduler.pt: the schedule starts again from its first step")
    if (path / "scaler.pt").is_file():
        warn_once(f"{path}/scaler.pt (fp16's loss scale) is not read: phalanx's scaler starts from its initial scale")

    loaded = TrainerState.load_from_json(path / TRAINER_STATE)
    loaded.is_local_process_zero, loaded.is_world_process_zero = engine.is_local_main_process, engine.is_main_process
    trainer.state = loaded
    engine.global_step = loaded.global_step
    place_data(trainer, loaded.global_step, per_epoch)

    rng_file = path / (f"rng_state_{engine.rank}.pth" if engine.world_size > 1 else "rng_state.pth")
    if rng_file.is_file():
        rng = _load(rng_file)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.random.set_rng_state(rng["cpu"])
        if torch.cuda.is_available() and "cuda" in rng:
            cuda = rng["cuda"]
            torch.cuda.set_rng_state(cuda if isinstance(cuda, torch.Tensor) else cuda[torch.cuda.current_device()])
    else:
        warn_once(f"{path} has no {rng_file.name}: random generators (dropout) follow this run's seed instead")
