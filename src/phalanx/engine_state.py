"""What the Engine saves and restores: the user's module, its whole state dict, checkpoints, the exported model,
and where the run is in epochs.

    engine.save_state("ckpt/step-1000")        # resumable on any world size, under any strategy
    engine.load_state("ckpt/step-1000")
    for epoch in range(engine.epoch, num_epochs): ...
    engine.save_model("out/model")             # model.safetensors (+ config.json): from_pretrained loads it

:class:`EngineState` is mixed into :class:`phalanx.Engine`; it reads the Engine's strategy and what it prepared.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx.config import EngineConfig
from phalanx.data import PreparedDataLoader
from phalanx.deferred_init import mark_loaded
from phalanx.engine_collectives import EngineCollectives
from phalanx.guards import as_prepared
from phalanx.precision import Precision
from phalanx.prepared import PreparedOptimizer, PreparedScheduler
from phalanx.resume import Resumer
from phalanx.strategies.base import Strategy

if TYPE_CHECKING:
    from phalanx.checkpoint import TrainingParts

__all__ = ["EngineState"]


class EngineState(EngineCollectives):
    """The user's module and its state, checkpoints and the exported model (mixed into the Engine)."""

    config: EngineConfig
    strategy: Strategy
    precision: Precision
    global_step: int
    _models: list[nn.Module]
    _optimizers: list[PreparedOptimizer]
    _schedulers: list[PreparedScheduler]
    _prepared_loaders: list[PreparedDataLoader]
    _checkpointed: list[Any]
    _resumer: Resumer
    _micro_steps: int
    _in_accumulate: bool

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's own module, without anything phalanx wrapped around it. Under zero3 its parameters hold only
        this rank's shard between forwards: its ``state_dict()`` (and a transformers ``save_pretrained`` without
        ``state_dict=``) is refused; use ``engine.save_model`` or ``engine.get_state_dict`` on every rank. A
        ``torch.compile`` of the prepared model unwraps to the same module."""
        return self.strategy.unwrap_model(as_prepared(model, self._models))

    def get_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unsharded state dict, on CPU, on every rank, under every strategy. A collective: every rank
        calls it (e.g. ``unwrapped.save_pretrained(d, state_dict=engine.get_state_dict(model))`` on every rank).
        Tied keys share one tensor, as in ``model.state_dict()``, so that transformers saves a tied weight once."""
        model = as_prepared(model, self._models)
        state = self.strategy.full_state_dict(model)
        for key, held_as in self.strategy.state_dict_keys(model).items():
            if key != held_as and key in state and held_as in state:
                state[key] = state[held_as]
        return state

    @property
    def epoch(self) -> int:
        """The epoch the run is in, counting from 0: the passes completed over the first prepared DataLoader.

        It is the loader's own epoch, which ``save_state``/``load_state`` restore on any world size: after a resume
        in the middle of epoch 3 it is 3, and the loader goes on from where that epoch stopped, so that
        ``for epoch in range(engine.epoch, num_epochs): for batch in loader: ...`` resumes exactly. It moves to
        the next epoch when a pass over the loader ends (or ``loader.set_epoch`` sets it). With several loaders it
        follows the first one prepared (prepare the training loader first); with none prepared it is an error.
        """
        if not self._prepared_loaders:
            raise RuntimeError(
                "engine.epoch counts passes over the first prepared DataLoader, and no DataLoader was prepared; pass "
                "the training loader to engine.prepare, or count epochs in your own loop"
            )
        return self._prepared_loaders[0].global_sampler.epoch

    # ------------------------------------------------------------ checkpoints
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` (anything with ``state_dict()`` and ``load_state_dict()``) with
        ``save_state``/``load_state``, in the order registered. Their state is saved from rank 0, as JSON and tensors."""
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(
                    f"register_for_checkpointing needs objects with state_dict() and load_state_dict(); "
                    f"{type(obj).__name__} has {'neither' if not hasattr(obj, 'state_dict') else 'not both'}"
                )
            self._checkpointed.append(obj)
        self._resume_if_ready()

    def save_state(self, output_dir: str | os.PathLike[str], keep_last: int | None = None) -> Path:
        """Save everything needed to resume: models and optimizer state (each rank its shards, in parallel),
        schedulers, the loss scaler, loader positions, every rank's RNG, ``global_step`` and registered objects.

        Every rank must call it, at the end of an accumulation window. The directory appears only once it is
        complete; ``keep_last=k`` then deletes all but the k most recent checkpoints beside it. Loads on any world
        size and under any strategy (``load_state``); ``phalanx checkpoint consolidate`` makes a plain state dict.
        """
        from phalanx.checkpoint import save_checkpoint

        if self._micro_steps != 0 or self._in_accumulate:
            raise RuntimeError(
                f"engine.save_state was called inside an accumulation window (after micro-batch {self._micro_steps} of "
                f"grad_accum_steps={self.config.grad_accum_steps}), where gradients are partial and are not saved; "
                "call it after the window's optimizer.step()"
            )
        return save_checkpoint(output_dir, self._parts(), self.strategy, self.topology, self.device, keep_last)

    def load_state(self, input_dir: str | os.PathLike[str] | None, verify: bool = True) -> None:
        """Resume from a ``save_state`` checkpoint, saved on any world size under any strategy. Prepare the same
        models, optimizers, schedulers and loaders (and register the same objects) first. Every rank must call it.

        Everything is checked on every rank before anything is loaded: the format version, every file and (with
        ``verify``) every checksum, names and shapes against the model. On the same world size each rank gets its
        own RNG state back; on another, RNG is reseeded from (seed, global_step, rank).
        """
        from phalanx.checkpoint import CheckpointError, load_checkpoint

        if input_dir is None:
            raise CheckpointError(
                "engine.load_state got None instead of a checkpoint directory (latest_checkpoint(parent) returns None "
                "when the parent holds no complete checkpoint: start from scratch then)"
            )
        counters = load_checkpoint(input_dir, self._parts(), self.strategy, self.topology, self.device, verify)
        for m in self._models:
            mark_loaded(self.unwrap_model(m))
        self.global_step = counters.get("global_step", 0)
        self._resumer.done = True  # loaded once (by resume_from or by the script itself): never another on top

    def _prepared_counts(self) -> dict[str, int]:
        return {"models": len(self._models), "optimizers": len(self._optimizers), "schedulers": len(self._schedulers),
                "loaders": len(self._prepared_loaders), "objects": len(self._checkpointed)}  # fmt: skip

    def _resume_if_ready(self) -> None:
        """``resume_from``: load the newest checkpoint there once everything it holds is prepared (see resume.py)."""
        r = self._resumer
        if r.done:
            return
        r.look(self.rank, self._share_from_rank0)
        if not r.done and r.pending is not None and r.ready(self._prepared_counts()):
            self.load_state(r.pending)
            r.loaded(self.rank, self.world_size, self.global_step)

    def _share_from_rank0(self, text: str) -> str:
        from phalanx.comm import all_gather_bytes

        return all_gather_bytes(text.encode(), self.device)[0].decode()

    def _check_resumed(self) -> None:
        """Before the first backward: a checkpoint that ``resume_from`` found must have been loaded by now."""
        self._resume_if_ready()  # objects prepared one by one (prepare_model, ...) did not ask yet
        r = self._resumer
        if r.done or r.pending is None:
            return
        raise RuntimeError(
            f"resume_from={r.directory}: its newest checkpoint {r.pending.name} holds state for objects not prepared "
            f"yet ({r.missing(self._prepared_counts())}), so it was not loaded, and training would start from step 0 "
            "instead of resuming. Prepare (and register_for_checkpointing) everything the checkpoint was saved with "
            "before the first backward"
        )

    def load_model(self, path: str | os.PathLike[str], model: nn.Module | None = None) -> None:
        """Load weights only into a prepared model (the only one, or ``model``): the optimizer, schedulers, loaders,
        counters and RNG stay as they are. Every rank must call it; each reads only the slices it holds.

        ``path`` is a ``save_state`` checkpoint (saved on any world size under any strategy), a ``.safetensors``
        file, or a directory that ``save_model`` or transformers' ``save_pretrained`` wrote (``model.safetensors``,
        or shards with ``model.safetensors.index.json``). Names and shapes are checked on every rank before anything
        is read; a tied weight may be stored under any of its names; pickles (``pytorch_model.bin``) are refused.
        """
        from phalanx.model_files import load_weights

        if model is None:
            if len(self._models) != 1:
                raise TypeError(f"engine.load_model(path) needs one prepared model; {len(self._models)} are prepared: "
                                "pass model=")  # fmt: skip
            model = self._models[0]
        model = as_prepared(model, self._models)
        index = next((i for i, m in enumerate(self._models) if model is m or model is self.unwrap_model(m)), None)
        if index is None:
            raise ValueError("engine.load_model(model=...) got a model that engine.prepare did not return")
        load_weights(self.strategy, self._models[index], path, index, self.device)
        mark_loaded(self.unwrap_model(self._models[index]))

    def save_model(self, *args: Any, metadata: dict[str, str] | None = None) -> Path:
        """``save_model(save_directory)`` or ``save_model(model, save_directory)``: the whole model in a directory that
        loads back; returns the path of its ``model.safetensors``. Every rank must call it; rank 0 writes.

        A transformers model is written by its own ``save_pretrained`` with the gathered weights, so that
        ``from_pretrained(save_directory)`` loads it: ``config.json``, ``model.safetensors`` with each tied weight
        once, as transformers writes them. Any other module: ``model.safetensors`` with every ``state_dict()`` key,
        tied ones included, and the metadata ``{"format": "pt"}`` plus ``metadata`` (load it with
        ``model.load_state_dict(safetensors.torch.load_file(path))``), and ``config.json`` when the module has a
        ``config`` with ``save_pretrained`` or ``to_json_file``.
        """
        from phalanx.pretrained import write_model_dir

        if len(args) == 2 and isinstance(args[0], nn.Module):
            model, directory = args
        elif len(args) == 1 and len(self._models) == 1:
            model, directory = self._models[0], args[0]
        else:
            raise TypeError(
                f"use engine.save_model(save_directory) with one prepared model, or engine.save_model(model, "
                f"save_directory); got {len(args)} argument(s) with {len(self._models)} prepared model(s)"
            )
        state = self.get_state_dict(model)
        return write_model_dir(state, self.unwrap_model(model), Path(directory), metadata, self.is_main_process, self.device)

    def _parts(self) -> TrainingParts:
        from phalanx.checkpoint import TrainingParts

        return TrainingParts(
            models=list(self._models),
            optimizers=[o.optimizer for o in self._optimizers],
            schedulers=list(self._schedulers),
            loaders=list(self._prepared_loaders),
            objects=list(self._checkpointed),
            precision=self.precision,
            counters={"global_step": self.global_step},
            seed=self.config.seed,
        )
