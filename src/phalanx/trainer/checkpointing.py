"""The Trainer's checkpoints: resuming from its own, transformers' or another tool's, and writing its own
(synchronously or on the save's thread), with trainer_state.json and the rotation, as transformers does."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

from phalanx.checkpoint.foreign import detect
from phalanx.logging import warn_once
from phalanx.trainer.callbacks import restore_callback_states
from phalanx.trainer.rotation import rotate_checkpoints, sorted_checkpoints
from phalanx.trainer.state import ExportableState, TrainerState, arguments_that_differ
from phalanx.trainer.transformers_checkpoint import (
    is_transformers_checkpoint,
    latest_transformers_checkpoint,
    resume_from_foreign,
    resume_from_transformers,
)

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


def resume_trainer(trainer: Trainer, resume: str | bool, per_epoch: int) -> None:
    """Load ``resume`` (a path, or True for the newest checkpoint in output_dir) into the Trainer: its own
    checkpoint, transformers' ``checkpoint-N/``, or another tool's run (checkpoint/foreign/), then say which
    arguments differ from the checkpoint's and restore the callbacks' states."""
    if resume is True:
        found = sorted_checkpoints(trainer.output_dir)
        theirs = latest_transformers_checkpoint(trainer.output_dir) if not found else None
        if not found and theirs is None:
            raise ValueError(
                f"No valid checkpoint found in output directory ({trainer.args.output_dir}): resume_from_checkpoint="
                "True looks there for a complete checkpoint-<step> (train without it to start fresh, or give the "
                "checkpoint's path)"
            )
        resume = str(found[-1][1] if found else theirs)
    if not Path(str(resume)).is_dir():
        raise ValueError(
            f"Can't find a valid checkpoint at {resume}: resume_from_checkpoint names a checkpoint-<step> "
            "directory that does not exist (give an existing one, or True for the latest in output_dir)"
        )
    if is_transformers_checkpoint(path := str(resume)):  # written by transformers' Trainer: read as it is
        resume_from_transformers(trainer, Path(path), per_epoch)
    elif detect(path) is not None:  # another tool's checkpoint, without a Trainer's state (checkpoint/foreign/)
        resume_from_foreign(trainer, Path(path), per_epoch)
    else:
        trainer.engine.load_state(path)  # the TrainerState comes back with it (TrainerStateHolder)
    differ = arguments_that_differ(trainer.args, trainer.state)
    if differ:  # as transformers warns: this run follows its own arguments
        warn_once(f"arguments that differ from the checkpoint's ({resume}): " + "; ".join(differ))
    if trainer.args.restore_callback_states_from_checkpoint:
        saved = trainer.state.stateful_callbacks or {}
        trainer.control = restore_callback_states(trainer.callback_handler, trainer.control, saved)


def save_trainer_checkpoint(trainer: Trainer, new_best: bool) -> None:
    """Write ``checkpoint-<step>`` (model files included, so that from_pretrained loads it), trainer_state.json and
    the rotation; with ``save_async`` the write and what follows it happen on the save's thread."""
    path = Path(trainer.output_dir) / f"checkpoint-{trainer.state.global_step}"
    if new_best:
        trainer.state.best_model_checkpoint = str(path)
    # The control and the callbacks that export state (EarlyStoppingCallback's counter, say), as HF saves them.
    exportable = [
        cb for cb in [*trainer.callback_handler.callbacks, trainer.control] if isinstance(cb, ExportableState)
    ]
    trainer.state.stateful_callbacks = TrainerState(stateful_callbacks=exportable).stateful_callbacks
    if trainer.args.save_async:  # written on a thread; trainer_state.json and the rotation follow on rank 0
        saving = trainer.engine.save_state(path, model_files=True, async_save=True)
        state, limit, best = (
            copy.deepcopy(trainer.state),
            trainer.args.save_total_limit,
            trainer.state.best_model_checkpoint,
        )

        def after(saved: Path) -> None:
            state.save_to_json(saved / "trainer_state.json")
            rotate_checkpoints(trainer.output_dir, limit, best)

        if trainer.engine.is_main_process:
            saving.when_saved(after)
        return
    trainer.engine.save_state(path, model_files=True)  # model.safetensors + config.json: from_pretrained loads it
    if trainer.engine.is_main_process:
        trainer.state.save_to_json(path / "trainer_state.json")  # for tools that read HF's file
        rotate_checkpoints(trainer.output_dir, trainer.args.save_total_limit, trainer.state.best_model_checkpoint)
    trainer.engine.wait_for_everyone()
