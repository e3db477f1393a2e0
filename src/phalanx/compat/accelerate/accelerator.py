"""Accelerate's ``Accelerator`` on phalanx's Engine, with Accelerate's semantics where the Engine's differ.

    from phalanx.accelerate import Accelerator          # was: from accelerate import Accelerator
    from phalanx.accelerate.utils import set_seed        # was: from accelerate.utils import set_seed

Where they differ, the Engine keeps its own way and this front does as Accelerate does:
- A prepared LR scheduler steps ``num_processes`` times per optimizer step (once with ``split_batches``), because
  Accelerate's examples size their schedules from the unsharded loader. The Engine steps it once.
- A ``DummyScheduler``'s ``total_num_steps`` is divided by the number of processes, as Accelerate divides it.
- The prepared loaders split, pad and shuffle as Accelerate's: a short last batch is padded to ``batch_size`` on
  every process (or left short, ``even_batches=False``); a shuffled order comes from one generator seeded at
  ``prepare`` from the global RNG (so ``set_seed`` reaches it) and drawn on epoch after epoch; each pass draws its
  workers' seed from the global RNG, as a torch DataLoader does.
- Making an Accelerator leaves the global RNGs as they were (the Engine seeds them).
- ``join_uneven_inputs`` makes the processes that ran out of batches stand in for the others' reductions (join.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.checkpoint.async_save import AsyncSave
from phalanx.compat.accelerate.folders import automatic_folder, latest_automatic, same_folder_everywhere
from phalanx.compat.accelerate.join import UnevenInputsJoin, joined_models
from phalanx.compat.accelerate.loaders import accelerate_loader_rules, keep_global_rngs
from phalanx.compat.accelerate.operations import pad_across_processes
from phalanx.compat.accelerate.utils import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    fsdp_plugin_options,
    parallelism_options,
)
from phalanx.config.dialects.dummies import DummyScheduler
from phalanx.config.dialects.names import precision_from_accelerate, strategy_from_zero_stage
from phalanx.config.options import ConfigError
from phalanx.engine import collectives
from phalanx.engine.data import PreparedDataLoader, PreparedIterableLoader, map_tensors
from phalanx.engine.engine import Engine
from phalanx.engine.prepared import PreparedScheduler, autocast_forward
from phalanx.engine.trackers import Trackers
from phalanx.logging import warn_once
from phalanx.runtime.collective_log import watched
from phalanx.runtime.world import seed_everything
from phalanx.strategies.ddp import DDPStrategy

__all__ = ["Accelerator", "AcceleratedScheduler", "GradientState"]

_FSDP_STRATEGIES = {"FULL_SHARD": "zero3", "1": "zero3", "SHARD_GRAD_OP": "zero2", "2": "zero2", "NO_SHARD": "ddp",
                    "3": "ddp"}  # fmt: skip


class AcceleratedScheduler(PreparedScheduler):
    """Steps the scheduler as Accelerate does: after each real optimizer step, ``num_processes`` times (once with
    ``split_batches``); during accumulation only ``_step_count`` moves (``adjust_scheduler``)."""

    def __init__(self, scheduler: Any, engine: Accelerator) -> None:
        super().__init__(scheduler, engine)
        self._accelerator = engine

    def step(self, *args: Any, **kwargs: Any) -> None:
        acc = self._accelerator
        if not acc.step_scheduler_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not acc._consume_step(self._optimizer):  # accumulating, or the step was skipped
            if (
                not acc.sync_gradients
                and acc.gradient_state.adjust_scheduler
                and hasattr(self.scheduler, "_step_count")
            ):
                self.scheduler._step_count += 1
            return
        for _ in range(1 if acc.split_batches else acc.num_processes):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR stops at its total
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)


class Accelerator(Engine):
    """``accelerate.Accelerator``'s constructor and methods over phalanx's strategies (see the module's docstring)."""

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = False,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: DeepSpeedPlugin | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | None = None,
        project_config: Any = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[Any] | None = None,
        parallelism_config: Any = None,
        **unsupported: Any,
    ) -> None:
        if unsupported:
            raise TypeError(
                f"Accelerator({', '.join(sorted(unsupported))}=...): phalanx.accelerate does not take "
                f"{'this argument' if len(unsupported) == 1 else 'these arguments'} (Megatron-LM, dynamo, "
                "and several DeepSpeed plugins are not supported); remove it"
            )
        loader_config = dataloader_config or DataLoaderConfiguration(split_batches=split_batches)
        if loader_config.split_batches or split_batches:
            raise ConfigError(
                "Accelerator(split_batches=True): phalanx splits each global batch of batch_size x num_processes; "
                "divide your DataLoader's batch_size by the number of processes and leave split_batches False"
            )
        if loader_config.data_seed is not None and not loader_config.use_seedable_sampler:
            warn_once(
                f"DataLoaderConfiguration(data_seed={loader_config.data_seed}) is not used without "
                "use_seedable_sampler=True, as in Accelerate: the shuffled order comes from the global RNG (set_seed); "
                "pass use_seedable_sampler=True for an order drawn from data_seed + epoch"
            )
        plugin = gradient_accumulation_plugin or GradientAccumulationPlugin(num_steps=gradient_accumulation_steps)
        if gradient_accumulation_plugin is not None and gradient_accumulation_steps != 1:
            raise ValueError("Accelerator: pass gradient_accumulation_steps or gradient_accumulation_plugin, not both")
        options: dict[str, Any] = {"grad_accum_steps": plugin.num_steps or 1}
        if mixed_precision is not None:
            options["precision"] = precision_from_accelerate(mixed_precision)
        if cpu:
            options["device"] = "cpu"
        options.update(_plugin_options(deepspeed_plugin, fsdp_plugin))
        notes: list[str] = []
        options.update(parallelism_options(parallelism_config, notes))  # the mesh sizes, cp_size and sp_size
        for handler in kwargs_handlers or []:
            options.update(_handler_options(handler))
        if not device_placement:
            warn_once("Accelerator(device_placement=False) is not used: phalanx places models and batches itself")
        if rng_types and set(rng_types) - {"generator"}:
            warn_once(
                f"Accelerator(rng_types={rng_types}): phalanx does not synchronise the global RNGs at each epoch; the "
                "data order is the same on every rank without it (its generator is process 0's, from prepare)"
            )
        if not plugin.sync_with_dataloader:
            warn_once(
                "GradientAccumulationPlugin(sync_with_dataloader=False) is not used: phalanx always ends the "
                "accumulation window at the end of the DataLoader"
            )
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.project_dir = project_dir
        # Checked before the process group starts: an unknown name or a missing library fails here, on every rank.
        logs_to = self.project_configuration.logging_dir or self.project_configuration.project_dir
        self._trackers = Trackers(log_with, "Accelerator(log_with=...)", logs_to)
        self.log_with, self.trackers = self._trackers.requests, self._trackers.started  # Accelerate's attributes
        with keep_global_rngs():  # Accelerate's Accelerator() does not seed; a set_seed before it must hold
            super().__init__(**options)
        for note in notes:
            warn_once(note)
        self.parallelism_config = parallelism_config
        if self._origins.get("seed", "default") != "default":
            seed_everything(self.config.seed)  # a seed given to phalanx (flag, file, environment) still seeds
        kind = _distributed_type(self, deepspeed_plugin is not None, fsdp_plugin is not None)
        self.state = _State(self, kind, (deepspeed_plugin, fsdp_plugin))
        self.split_batches = False
        self._forward_unsynced = False  # the last forward ran under no_sync (torch DDP's rule for its backward)
        self._triggered = False  # trigger_sync_in_backward: the next backward reduces
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.dataloader_config = loader_config
        self.rng_types = rng_types
        self.gradient_state = GradientState(self, plugin)
        self._join: UnevenInputsJoin | None = None

    # ------------------------------------------------------------------------------------------- who and how
    @property
    def mixed_precision(self) -> str:
        return {"fp32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16"}.get(self.config.precision, "no")

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type  # type: ignore[no-any-return]

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    # ------------------------------------------------------------------------------------------- pickling
    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # Process groups, hooks and threads do not travel: the copy (e.g. in a DataLoader worker, through a
        # collate_fn that reads accelerator.mixed_precision) answers who and how the run is, and nothing more.
        keep = ("config", "_origins", "world", "device", "state", "dataloader_config", "split_batches",
                "step_scheduler_with_optimizer", "rng_types", "project_configuration")  # fmt: skip
        return _unpickled_accelerator, ({k: self.__dict__[k] for k in keep},)

    def __getattr__(self, name: str) -> Any:
        if self.__dict__.get("_unpickled") and not name.startswith("__"):
            raise AttributeError(
                f"this Accelerator was unpickled (it has no {name!r}), and a copy only tells who and how the run is "
                "(state, distributed_type, mixed_precision, num_processes, process_index, device, ...); prepare, "
                "train and save with the Accelerator of the process that made it"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.grad_accum_steps

    def end_training(self) -> None:
        """Accelerate's end of training: the trackers finish their runs (on the main process); then phalanx waits for
        every process (Accelerate destroys the process group instead)."""
        self._trackers.finish()
        self.wait_for_everyone()

    # ------------------------------------------------------------------------------------------- prepare
    def prepare(self, *objects: Any, device_placement: list[bool] | None = None, **kwargs: Any) -> Any:
        return super().prepare(*objects, **kwargs)

    def prepare_loader(self, loader: Any) -> PreparedDataLoader | PreparedIterableLoader:
        prepared = super().prepare_loader(loader)
        if isinstance(prepared, PreparedIterableLoader) and prepared is not loader:
            if self.dataloader_config.dispatch_batches:  # one reader's batches: the stream read whole, as it reads
                prepared.read_whole_stream(loader)
        if isinstance(prepared, PreparedDataLoader) and prepared is not loader:
            accelerate_loader_rules(
                prepared, loader, self.dataloader_config, self.topology.data_group, self.topology.data_size
            )
        return prepared

    def prepare_model(  # type: ignore[override]
        self, model: Any, device_placement: bool | None = None, evaluation_mode: bool = False, param_init_fn: Any = None
    ) -> nn.Module:
        """Accelerate's ``prepare_model``; with ``evaluation_mode=True`` the model is only placed on the device, with
        the precision's autocast, and not spread over the processes (for inference), as Accelerate leaves it."""
        if evaluation_mode:
            model = model.to(self.device)
            if self.precision.compute_dtype is not None:
                autocast_forward(model, self.precision)
            return model  # type: ignore[no-any-return]
        prepared = super().prepare_model(model, param_init_fn)
        reducer = self.strategy.reducer_of(prepared) if isinstance(self.strategy, DDPStrategy) else None
        if reducer is not None:
            reducer.reduce_again = True  # torch DDP's rule: backward twice without zero_grad reduces both
        prepared.register_forward_pre_hook(self._note_forward)
        # Ahead of the strategy's own hooks (the buffers' broadcast): the join announces what follows.
        prepared.register_forward_pre_hook(self._notify_join, prepend=True)
        return prepared

    def _notify_join(self, module: nn.Module, args: Any) -> None:
        if self._join is not None:
            self._join.notify(module)

    def _note_forward(self, module: nn.Module, args: Any) -> None:
        # As in torch DDP, a forward run under no_sync() leaves its backward unreduced, wherever that backward runs.
        # It holds until the next forward outside no_sync(), or trigger_sync_in_backward().
        if torch.is_grad_enabled():
            self._forward_unsynced = self._no_sync_depth > 0

    def backward(self, loss: Any, **kwargs: Any) -> None:  # type: ignore[override]
        triggered, self._triggered = self._triggered, False
        if self._forward_unsynced and not triggered and self._no_sync_depth == 0:
            with super().no_sync():
                super().backward(loss, **kwargs)
        else:
            super().backward(loss, **kwargs)

    def _short_window(self, accum: int, window_len: int) -> float:
        # Accelerate divides every loss by gradient_accumulation_steps, a short last window's too.
        return 1.0

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        if isinstance(scheduler, DummyScheduler):
            if scheduler.total_num_steps is not None:  # Accelerate's rule: the total of the unsharded loader
                scheduler = DummyScheduler(
                    scheduler.optimizer,
                    total_num_steps=math.ceil(scheduler.total_num_steps / self.num_processes),
                    warmup_num_steps=scheduler.warmup_num_steps,
                    **scheduler.kwargs,
                )
            return super().prepare_scheduler(scheduler)  # DeepSpeed's schedule steps once per optimizer step
        prepared = AcceleratedScheduler(scheduler, self)
        self._schedulers.append(prepared)
        return prepared

    # ------------------------------------------------------------------------------------------- the loop
    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """Accelerate's ``accumulate``; with ``GradientAccumulationPlugin(sync_each_batch=True)`` every micro-batch
        reduces its gradients (less memory, more communication), as Accelerate's does: the sum is the same."""
        with super().accumulate(*models):
            if not (self.gradient_state.sync_each_batch and self.use_distributed) or self.sync_gradients:
                yield
                return
            if not isinstance(self.strategy, DDPStrategy):
                warn_once(
                    f"GradientAccumulationPlugin(sync_each_batch=True) is not used under strategy="
                    f"{self.strategy.name!r}: its micro-batches accumulate unreduced (strategy='ddp' reduces each)"
                )
                yield
                return
            reducers = self.strategy.reducers
            held = [r.require_sync for r in reducers]
            for r in reducers:
                r.require_sync = True  # undo accumulate's no_sync for this micro-batch
            try:
                yield
            finally:
                for r, before in zip(reducers, held):
                    r.require_sync = before

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module | None = None) -> Iterator[None]:  # type: ignore[override]
        """Accelerate's form takes the model; backward inside only accumulates local gradients."""
        with super().no_sync():
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module | None = None) -> Iterator[None]:
        """The next backward reduces the gradients, even inside ``accumulate`` before the window's end."""
        previous = self.sync_gradients
        self.sync_gradients, self._triggered = True, True
        try:
            yield
        finally:
            self.sync_gradients = previous

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Accelerate's join: with ``even_batches=False`` (here, or the loaders' setting), the processes whose
        loaders run out first stand in for the others' gradient reductions until every process has left the block,
        and every replica then takes the model of the last one to finish (see join.py). ``even_batches`` here
        overrides the prepared map-style loaders' for the block. Accelerate joins on GPUs only; phalanx joins on
        CPUs too."""
        kind = self.state.distributed_type
        if kind not in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
            if kind != DistributedType.NO:
                warnings.warn(
                    "Joining uneven inputs is only supported for multi-GPU (and, in phalanx, multi-CPU) data "
                    f"parallelism, as in Accelerate; this run is {kind.value}, so join_uneven_inputs has no effect",
                    UserWarning,
                    stacklevel=3,
                )
            yield
            return
        overridden = []
        if even_batches is not None:
            iterable = False
            for loader in self._prepared_loaders:
                if not isinstance(loader, PreparedDataLoader):
                    iterable = True
                    continue
                overridden.append((loader.global_sampler, loader.global_sampler.even_batches))
                loader.global_sampler.even_batches = even_batches
            if iterable:
                warnings.warn(
                    "Overriding even_batches is only supported for map-style datasets, yet some dataloaders given "
                    "were iterable (phalanx, as Accelerate, leaves them as they are)",
                    UserWarning,
                    stacklevel=3,
                )
        else:
            even_batches = self.dataloader_config.even_batches
        try:
            if even_batches:
                yield  # every process has the same number of batches: nothing to join, as in Accelerate
                return
            models = joined_models(joinables, self._models, self._optimizers)
            if self.topology.ep_size > 1:
                raise ValueError(
                    f"join_uneven_inputs cannot stand in for a finished process under expert parallelism (ep_size="
                    f"{self.topology.ep_size}): its peers' next MoE layer waits for its tokens in an all-to-all, "
                    "and its experts are not the others'; keep even_batches=True (every process the same number of "
                    "batches), or train with ep_size=1"
                )
            if not isinstance(self.strategy, DDPStrategy):
                warn_once(
                    f"join_uneven_inputs stands in for finished processes under strategy='ddp' only; this run is "
                    f"{self.strategy.name!r}, so nothing is joined, and a process that runs out of batches first "
                    "leaves the others waiting (keep even_batches=True, or train with strategy='ddp')"
                )
                yield
                return
            self._join = UnevenInputsJoin(self, models)
            self._nonfinite.local = True  # the non-finite check exchanges nothing while ranks stand in
            try:
                yield
                self._join.finish()
            finally:
                self._join = None
                self._nonfinite.local = False
        finally:
            for sampler, value in overridden:
                sampler.even_batches = value

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:  # type: ignore[override]
        """Accelerate's: the processes' data in sample order without the last batch's padding; with
        ``use_gather_object`` (a list of any picklable items) gathered as objects, never as tensors."""
        if not use_gather_object:
            return super().gather_for_metrics(input_data)
        if not isinstance(input_data, list):
            raise TypeError(
                f"gather_for_metrics(use_gather_object=True) takes a list of picklable items; got a "
                f"{type(input_data).__name__} (wrap it in a list)"
            )
        parts: list[Any] = [input_data]
        if self.topology.data_size > 1:
            parts = [None] * self.topology.data_size
            watched(dist.all_gather_object, parts, input_data, group=self.topology.data_group)
        flat = [item for part in parts for item in part]
        return flat[: self._loaders.trim(len(flat))]

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:  # type: ignore[override]
        """Accelerate's ``reduce``: every tensor in ``tensor`` (nested lists, tuples, dicts) summed over the processes
        by default (the Engine's ``reduce`` averages), or ``mean``/``max``/``min``; ``none`` sums too, as Accelerate's
        code does. ``scale`` applies on XLA only, in Accelerate and here."""
        if reduction not in ("sum", "mean", "max", "min", "none"):
            raise ValueError(f"reduce(reduction={reduction!r}): use 'sum', 'mean', 'max' or 'none'")
        op = "sum" if reduction == "none" else reduction
        return map_tensors(tensor, lambda t: Engine.reduce(self, t, op).to(t.dtype))

    @contextlib.contextmanager
    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """Accelerate's: ``buffers`` cut in place along ``buffer_seq_dims`` over the cp (or sp) ranks for the block,
        restored after it but for ``no_restore_buffers``; a no-op that warns once without cp, as in Accelerate. On a
        batch the prepared loader cut already, see ``ContextParallel.buffers``."""
        cp = self.context_parallel
        if cp is None:
            warn_once(
                "maybe_context_parallel has no effect: context parallelism is not enabled (set cp_size or sp_size "
                "above 1, e.g. Accelerator(parallelism_config=ParallelismConfig(cp_size=2)))"
            )
            yield
            return
        with cp.buffers(buffers, buffer_seq_dims, no_restore_buffers):
            yield

    def unwrap_model(  # type: ignore[override]
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module:
        """The user's module (Accelerate's arguments are taken; phalanx's autocast is not a wrapper to keep)."""
        return super().unwrap_model(model)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The full state dict, on every process (a collective), as Accelerate's."""
        return super().get_state_dict(model)

    def autocast(self, autocast_handler: Any = None) -> Any:  # type: ignore[override]
        """The configured precision's autocast (an ``AutocastKwargs`` handler is not used)."""
        if autocast_handler is not None:
            warn_once("accelerator.autocast(autocast_handler=...) is not used: phalanx's autocast is the precision's")
        return super().autocast()

    def clear(self, *objects: Any) -> list[None]:
        """Accelerate's alias of ``free_memory``."""
        return self.free_memory(*objects)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Every tensor padded along ``dim`` to the largest size any process holds (before ``gather``)."""
        return pad_across_processes(tensor, dim, pad_index, pad_first)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (an fp16 overflow, or on_nonfinite='skip')."""
        return self.step_was_skipped

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide fp16 gradients by the loss scale now (once per step), e.g. before clipping them yourself."""
        self.finish_gradient_sync()
        for opt in self._optimizers if optimizer is None else [optimizer]:
            self.precision.unscale_(getattr(opt, "optimizer", opt))

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp each gradient to [-clip_value, clip_value], once the gradients are reduced and unscaled."""
        if self.strategy.shards_gradients:
            raise RuntimeError(
                f"clip_grad_value_ needs whole gradients on every process; under strategy={self.strategy.name!r} each "
                "holds a shard (as Accelerate refuses it under DeepSpeed and FSDP): use clip_grad_norm_"
            )
        if not self.sync_gradients:
            return  # inside an accumulation window the gradients are partial: clip at its last micro-batch
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ------------------------------------------------------------------------------------------- who runs what
    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    def on_process(self, function: Any = None, process_index: int | None = None) -> Any:
        """Decorator: run ``function`` on process ``process_index`` only (elsewhere it returns None)."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        if process_index is None:
            raise ValueError("on_process needs process_index=..., the process that runs the function")
        return _only_if(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Any = None, local_process_index: int | None = None) -> Any:
        """Decorator: run ``function`` on the process of this local index on each machine only."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        if local_process_index is None:
            raise ValueError("on_local_process needs local_process_index=..., the process that runs the function")
        return _only_if(function, lambda: self.local_process_index == local_process_index)

    def on_main_process(self, function: Any) -> Any:
        """Decorator: run ``function`` on the main process only."""
        return _only_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Any) -> Any:
        """Decorator: run ``function`` on the first process of each machine only."""
        return _only_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Any) -> Any:
        """Decorator: run ``function`` on the last process only."""
        return _only_if(function, lambda: self.is_last_process)

    # ------------------------------------------------------------------------------------------- trackers
    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None, init_kwargs: Any = None) -> None:
        """Start a run in each tracker of ``log_with``, on the main process only, as Accelerate does.

        ``project_name`` is W&B's project, MLflow's experiment and TensorBoard's folder under ``logging_dir``;
        ``init_kwargs[name]`` are that tracker's own arguments (``{"wandb": {"name": "run-1", "tags": ["a"]}}`` go to
        ``wandb.init``, ``{"mlflow": {"run_name": "run-1"}}`` to the MLflow run), and ``config`` is stored as each run's
        configuration (W&B's config, MLflow's parameters, TensorBoard's hparams).
        """
        if self.is_main_process:
            self._trackers.start(project_name, config, init_kwargs)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: Any = None) -> None:
        """Send ``values`` at ``step`` to every started tracker, on the main process only, as Accelerate does;
        ``log_kwargs[name]`` go to that tracker's ``log`` (``{"wandb": {"commit": False}}``)."""
        if self.is_main_process:
            self._trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called ``name`` (with ``unwrap``, the library's own run: ``wandb``'s ``Run``,
        MLflow's ``ActiveRun``, TensorBoard's ``SummaryWriter``). A process that started none (every process but the
        main one) gets a blank tracker whose calls do nothing, as in Accelerate."""
        return self._trackers.get(name, unwrap)

    # ------------------------------------------------------------------------------------------- state
    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    def save_state(  # type: ignore[override]
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> Path | AsyncSave:
        """Accelerate's ``save_state``: into ``output_dir``, which every process must name alike; without it, into
        ``project_dir/checkpoints/checkpoint_<i>`` under ``ProjectConfiguration(automatic_checkpoint_naming=True)``,
        keeping ``total_limit`` of them. ``safe_serialization`` changes nothing: phalanx writes its own format.
        The Engine's ``keep_last``, ``model_files`` and ``async_save`` are taken too."""
        keep_last, model_files = kwargs.pop("keep_last", None), kwargs.pop("model_files", False)
        async_save = bool(kwargs.pop("async_save", False))
        if kwargs:
            warn_once(f"save_state({', '.join(sorted(kwargs))}=...) is not used by phalanx.accelerate")
        automatic = output_dir is None or self.project_configuration.automatic_checkpoint_naming
        if automatic and output_dir is not None:
            warn_once(
                f"save_state({str(output_dir)!r}): under automatic_checkpoint_naming Accelerate saves into "
                "project_dir/checkpoints/checkpoint_<i> whatever folder is named, and so does phalanx.accelerate"
            )
        if automatic:
            output_dir = automatic_folder(self.project_configuration, "save_state")
            keep_last = self.project_configuration.total_limit
        assert output_dir is not None
        same_folder_everywhere("save_state", output_dir, self.device)
        saved: Path | AsyncSave = (
            super().save_state(output_dir, keep_last, model_files, async_save=True)
            if async_save
            else super().save_state(output_dir, keep_last, model_files)
        )
        if automatic:
            self.project_configuration.iteration += 1
        return saved

    def load_state(  # type: ignore[override]
        self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: Any = None, **kwargs: Any
    ) -> None:
        """Accelerate's ``load_state``: from ``input_dir``, or the newest of ``project_dir/checkpoints`` under
        automatic checkpoint naming (the next save then takes the following number)."""
        verify = kwargs.pop("verify", True)
        if input_dir is None:
            input_dir = latest_automatic(self.project_configuration)
        same_folder_everywhere("load_state", input_dir, self.device)
        super().load_state(input_dir, verify)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        from phalanx.compat.accelerate.utils import skip_first_batches

        return skip_first_batches(dataloader, num_batches)


class _State:
    """Accelerate's ``AcceleratorState``: who this process is and how the run is distributed (plain values, so that
    it pickles and compares as Accelerate's does)."""

    def __init__(self, accelerator: Accelerator, distributed_type: DistributedType, plugins: tuple[Any, Any]) -> None:
        self.num_processes = accelerator.num_processes
        self.process_index = accelerator.process_index
        self.local_process_index = accelerator.local_process_index
        self.device = accelerator.device
        self.distributed_type = distributed_type
        self.mixed_precision = accelerator.mixed_precision
        self.backend = dist.get_backend() if dist.is_initialized() else None
        self.debug = False
        self.deepspeed_plugin, self.fsdp_plugin = plugins

    def __repr__(self) -> str:  # Accelerate's, which scripts log: logger.info(accelerator.state)
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (
            f"Distributed environment: {self.distributed_type}{backend}\nNum processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
            f"Device: {self.device}\n\nMixed precision type: {self.mixed_precision}\n"
        )

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    def wait_for_everyone(self) -> None:
        if dist.is_initialized():
            collectives.barrier()

    def destroy_process_group(self, group: Any = None) -> None:
        """The end of the run's collectives, as Accelerate's: the process group is torn down."""
        if dist.is_initialized():
            dist.destroy_process_group(group)


def _only_if(function: Any, runs: Any) -> Any:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs) if runs() else None

    return wrapper


def _unpickled_accelerator(values: dict[str, Any]) -> Accelerator:
    accelerator = Accelerator.__new__(Accelerator)
    accelerator.__dict__.update(values, _unpickled=True)
    return accelerator


class GradientState:
    """Accelerate's ``GradientState``: whether this backward reduces, and where the loader is."""

    def __init__(self, engine: Engine, plugin: GradientAccumulationPlugin) -> None:
        self._engine = engine
        self.num_steps = plugin.num_steps or 1
        self.adjust_scheduler = plugin.adjust_scheduler
        self.sync_with_dataloader = plugin.sync_with_dataloader
        self.sync_each_batch = plugin.sync_each_batch
        self.plugin_kwargs = {"num_steps": self.num_steps, "adjust_scheduler": self.adjust_scheduler,
                              "sync_with_dataloader": self.sync_with_dataloader}  # fmt: skip

    @property
    def sync_gradients(self) -> bool:
        return self._engine.sync_gradients

    @property
    def end_of_dataloader(self) -> bool:
        return self._engine.end_of_dataloader

    @property
    def active_dataloader(self) -> Any:
        return self._engine._loaders.active

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    @staticmethod
    def _reset_state() -> None:
        """Accelerate's state is one per process; here each Accelerator has its own, so there is nothing to reset."""


def _distributed_type(engine: Engine, deepspeed: bool, fsdp: bool) -> DistributedType:
    """Accelerate's name for this run: how it was asked for (a DeepSpeed config or plugin, an FSDP plugin), else
    by the device."""
    if engine.num_processes == 1:
        return DistributedType.NO
    if deepspeed or engine.config.deepspeed:
        return DistributedType.DEEPSPEED
    if fsdp:
        return DistributedType.FSDP
    return DistributedType.MULTI_GPU if engine.device.type == "cuda" else DistributedType.MULTI_CPU


def _plugin_options(ds: DeepSpeedPlugin | None, fsdp: FullyShardedDataParallelPlugin | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if ds is not None and fsdp is not None:
        raise ValueError("Accelerator: pass deepspeed_plugin or fsdp_plugin, not both")
    if ds is not None:
        if ds.hf_ds_config is not None:
            if not isinstance(ds.hf_ds_config, (str, bytes)) and not hasattr(ds.hf_ds_config, "__fspath__"):
                raise ConfigError(
                    "DeepSpeedPlugin(hf_ds_config=...) takes the path of a DeepSpeed JSON here; write the dict to a "
                    "file and pass its path"
                )
            options["config_file"] = str(ds.hf_ds_config)
        if ds.zero_stage is not None or ds.hf_ds_config is None:  # else the file's stage (its "auto": 2)
            options["strategy"] = strategy_from_zero_stage(2 if ds.zero_stage is None else ds.zero_stage)
        devices = {ds.offload_optimizer_device, ds.offload_param_device} - {None, "none"}
        if devices:
            options["offload"] = "disk" if "nvme" in devices else "cpu"
        if ds.gradient_clipping:
            options["max_grad_norm"] = float(ds.gradient_clipping)
        elif ds.hf_ds_config is None:  # Accelerate writes "auto" into the config it builds, then fills 1.0
            options["max_grad_norm"] = float(os.environ.get("ACCELERATE_GRADIENT_CLIPPING", "1.0"))
        if ds.gradient_accumulation_steps:
            options["grad_accum_steps"] = int(ds.gradient_accumulation_steps)
    if fsdp is not None:
        how = fsdp.sharding_strategy
        if fsdp.reshard_after_forward is not None:
            how = "FULL_SHARD" if fsdp.reshard_after_forward in (True, "FULL_SHARD") else "SHARD_GRAD_OP"
        name = str(getattr(how, "name", how if how is not None else "FULL_SHARD")).upper()
        if name not in _FSDP_STRATEGIES:
            raise ConfigError(
                f"FullyShardedDataParallelPlugin(sharding_strategy={how!r}): phalanx shards over all ranks "
                "(FULL_SHARD -> zero3, SHARD_GRAD_OP -> zero2) and has no hybrid sharding"
            )
        options["strategy"] = _FSDP_STRATEGIES[name]
        if fsdp.cpu_offload not in (None, False) and getattr(fsdp.cpu_offload, "offload_params", True):
            options["offload"] = "cpu"
        options.update(fsdp_plugin_options(fsdp))
    return options


def _handler_options(handler: Any) -> dict[str, Any]:
    if isinstance(handler, DistributedDataParallelKwargs):
        if handler.comm_hook is not None or handler.static_graph:
            warn_once("DistributedDataParallelKwargs(comm_hook, static_graph) are not used by phalanx's reducer")
        return {"find_unused_parameters": handler.find_unused_parameters, "bucket_mb": float(handler.bucket_cap_mb)}
    if isinstance(handler, GradScalerKwargs):
        return {"loss_scale_init": handler.init_scale, "loss_scale_window": handler.growth_interval}
    if isinstance(handler, InitProcessGroupKwargs):
        if handler.backend not in (None, "nccl", "gloo") or handler.init_method is not None:
            warn_once(
                f"InitProcessGroupKwargs(backend={handler.backend!r}, init_method={handler.init_method!r}) is not "
                "used: phalanx picks gloo on CPUs and NCCL on GPUs, and its launcher sets the rendezvous"
            )
        return {"timeout_s": handler.timeout.total_seconds()} if handler.timeout is not None else {}
    warn_once(f"Accelerator(kwargs_handlers=[{type(handler).__name__}(...)]) is not used by phalanx")
    return {}
