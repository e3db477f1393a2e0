"""The Engine's state calls: ``save_state``/``load_state`` (with ``resume_from``), ``register_for_checkpointing``,
``wait_for_checkpoint``, ``load_model`` and ``save_model``. ``phalanx/checkpoint`` does the work; this is the part
of ``Engine`` that hands it the prepared objects (a base class of ``Engine``, kept apart for the file's length)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch import nn

from phalanx.checkpoint.async_save import AsyncSave
from phalanx.checkpoint.foreign import detect, load_foreign
from phalanx.checkpoint.format import CheckpointError
from phalanx.checkpoint.model_files import load_weights
from phalanx.checkpoint.pretrained import model_files_writer, write_model_dir
from phalanx.checkpoint.state import (
    TrainingParts,
    load_checkpoint,
    save_checkpoint,
    save_checkpoint_async,
    wait_for_async_save,
)
from phalanx.engine.guards import check_checkpointable, prepared_index, save_model_arguments
from phalanx.runtime.comm import all_gather_bytes
from phalanx.strategies.deferred_init import mark_loaded

if TYPE_CHECKING:
    from phalanx.checkpoint.resume import Resumer
    from phalanx.config.settings import EngineConfig
    from phalanx.engine.data import PreparedDataLoader, PreparedIterableLoader
    from phalanx.engine.precision import Precision
    from phalanx.engine.prepared import PreparedOptimizer, PreparedScheduler
    from phalanx.engine.tensor_parallel import TensorParallelState
    from phalanx.runtime.topology import Topology
    from phalanx.strategies.base import Strategy


class StateCalls:
    """``Engine``'s checkpoint calls (``Engine`` derives from this class; ``self`` is always an ``Engine``)."""

    if TYPE_CHECKING:  # what these calls read of the Engine (engine.py sets them)
        config: EngineConfig
        device: torch.device
        topology: Topology
        strategy: Strategy
        precision: Precision
        global_step: int
        _tp: TensorParallelState
        _resumer: Resumer
        _checkpointed: list[Any]
        _models: list[nn.Module]
        _optimizers: list[PreparedOptimizer]
        _schedulers: list[PreparedScheduler]
        _prepared_loaders: list[PreparedDataLoader | PreparedIterableLoader]
        _micro_steps: int
        _in_accumulate: bool

        @property
        def rank(self) -> int: ...
        @property
        def world_size(self) -> int: ...
        @property
        def is_main_process(self) -> bool: ...
        def unwrap_model(self, model: nn.Module) -> nn.Module: ...
        def get_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]: ...

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` (anything with ``state_dict()`` and ``load_state_dict()``) with
        ``save_state``/``load_state``, in the order registered. Their state is saved from rank 0, as JSON and
        tensors."""
        for obj in objects:
            check_checkpointable(obj)
            self._checkpointed.append(obj)
        self._resume_if_ready()

    @overload
    def save_state(
        self,
        output_dir: str | os.PathLike[str],
        keep_last: int | None = None,
        model_files: bool = False,
        async_save: Literal[False] = False,
    ) -> Path: ...

    @overload
    def save_state(
        self,
        output_dir: str | os.PathLike[str],
        keep_last: int | None = None,
        model_files: bool = False,
        *,
        async_save: Literal[True],
    ) -> AsyncSave: ...

    def save_state(
        self,
        output_dir: str | os.PathLike[str],
        keep_last: int | None = None,
        model_files: bool = False,
        async_save: bool = False,
    ) -> Path | AsyncSave:
        """Save everything needed to resume: models and optimizer state (each rank its shards, in parallel),
        schedulers, the loss scaler, loader positions, every rank's RNG, ``global_step`` and registered objects.

        Every rank must call it, at the end of an accumulation window. The directory appears only once it is
        complete; ``keep_last=k`` then deletes all but the k most recent checkpoints beside it. Loads on any world
        size and under any strategy (``load_state``); ``phalanx checkpoint consolidate`` makes a plain state dict.
        ``model_files=True`` also writes the (one) model as ``save_model`` does, ``model.safetensors`` and
        ``config.json``, streamed from the shards, so that ``from_pretrained(output_dir)`` loads the checkpoint.

        ``async_save=True`` returns once this rank's shards are copied to host memory and writes them on a thread
        while training goes on; it returns an ``AsyncSave``, a ``Future`` of the path. The next save waits for it and
        raises on every rank if it failed (``wait_for_checkpoint``); see ``phalanx/checkpoint/async_save.py``.
        """
        if self._micro_steps != 0 or self._in_accumulate:
            raise RuntimeError(
                f"engine.save_state was called inside an accumulation window (after micro-batch {self._micro_steps} of "
                f"grad_accum_steps={self.config.grad_accum_steps}), where gradients are partial and are not saved; "
                "call it after the window's optimizer.step()"
            )
        also_write = model_files_writer(self._models, self.unwrap_model) if model_files else None
        view, timeout_s = self._tp.state_view(self.strategy), self.config.timeout_s
        args = (output_dir, self._parts(), view, self.topology, self.device, keep_last, also_write)
        return save_checkpoint_async(*args, timeout_s) if async_save else save_checkpoint(*args)

    def wait_for_checkpoint(self) -> Path | None:
        """Wait for this process's asynchronous save to be in place; return its path (None if there was none). Every
        rank calls it; if the save failed on any rank, every rank raises the same ``CheckpointError`` naming them."""
        return wait_for_async_save(self.device)

    def load_state(self, input_dir: str | os.PathLike[str] | None, verify: bool = True) -> None:
        """Resume from a ``save_state`` checkpoint, saved on any world size under any strategy. Prepare the same
        models, optimizers, schedulers and loaders (and register the same objects) first. Every rank must call it.

        Everything is checked on every rank before anything is loaded: the format version, every file and (with
        ``verify``) every checksum, names and shapes against the model. On the same world size each rank gets its
        own RNG state back; on another, RNG is reseeded from (seed, global_step, rank).

        Also reads another tool's checkpoint (torch DCP of FSDP2/torchtitan, Accelerate ``save_state``, DeepSpeed ZeRO
        1/2/3) by parameter name, saying once what does not carry over: see docs/foreign-checkpoints.md.
        """
        if input_dir is None:
            raise CheckpointError(
                "engine.load_state got None instead of a checkpoint directory (latest_checkpoint(parent) returns None "
                "when the parent holds no complete checkpoint: start from scratch then)"
            )
        view, parts = self._tp.state_view(self.strategy), self._parts()
        if (foreign := detect(input_dir)) is not None:  # another tool's run: weights and moments by name
            counters = {"global_step": load_foreign(input_dir, foreign, parts, view, self.topology, self.device) or 0}
        else:
            counters = load_checkpoint(input_dir, parts, view, self.topology, self.device, verify)
        for m in self._models:
            mark_loaded(self.unwrap_model(m))
        self.global_step = counters.get("global_step", 0)
        self._resumer.done = True  # loaded once (by resume_from or by the script itself): never another on top

    def _prepared_counts(self) -> dict[str, int]:
        objects: tuple[list[Any], ...] = (self._models, self._optimizers, self._schedulers)
        objects += (self._prepared_loaders, self._checkpointed)
        return dict(zip(("models", "optimizers", "schedulers", "loaders", "objects"), map(len, objects)))

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

    def load_model(
        self,
        path: str | os.PathLike[str],
        model: nn.Module | None = None,
        optimizer_state: dict[str, dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """Load weights only into a prepared model (the only one, or ``model``): the optimizer, schedulers, loaders,
        counters and RNG stay as they are. Every rank must call it; each reads only the slices it holds.
        ``optimizer_state`` ({parameter name: {"exp_avg": tensor, ...}}, whole tensors) is loaded with the weights
        into the prepared optimizers, each rank taking its share: how a torch optimizer's ``state_dict()`` (after
        mapping its indices to names) moves into a sharded run.

        ``path`` is a ``save_state`` checkpoint (saved on any world size under any strategy), a ``.safetensors``
        file, or a directory that ``save_model`` or transformers' ``save_pretrained`` wrote (``model.safetensors``,
        or shards with ``model.safetensors.index.json``). Names and shapes are checked on every rank before anything
        is read; a tied weight may be stored under any of its names; pickles (``pytorch_model.bin``) are refused.
        """
        index = prepared_index(model, self._models, self.unwrap_model)
        optimizers = [o.optimizer for o in self._optimizers] if optimizer_state is not None else None
        view = self._tp.state_view(self.strategy)
        load_weights(view, self._models[index], path, index, self.device, optimizers, optimizer_state)
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
        model, directory = save_model_arguments(args, self._models)
        state = self.get_state_dict(model)
        return write_model_dir(
            state, self.unwrap_model(model), Path(directory), metadata, self.is_main_process, self.device
        )

    def _parts(self) -> TrainingParts:
        return TrainingParts(
            models=list(self._models),
            optimizers=[o.optimizer for o in self._optimizers],
            schedulers=list(self._schedulers),
            loaders=list(self._prepared_loaders),
            objects=list(self._checkpointed),
            precision=self.precision,
            counters={"global_step": self.global_step},
            seed=self.config.seed,
            rng_trackers=self._tp.trackers(),
        )
