"""Accelerate's ``Accelerator`` on phalanx's Engine, with Accelerate's semantics where the Engine's differ.

    from phalanx.accelerate import Accelerator          # was: from accelerate import Accelerator
    from phalanx.accelerate.utils import set_seed        # was: from accelerate.utils import set_seed

Where they differ, the Engine keeps its own way and this front does as Accelerate does:
- A prepared LR scheduler steps ``num_processes`` times per optimizer step (once with ``split_batches``), because
  Accelerate's examples size their schedules from the unsharded loader. The Engine steps it once.
- A ``DummyScheduler``'s ``total_num_steps`` is divided by the number of processes, as Accelerate divides it.
- ``set_seed`` before ``prepare`` sets the data order of the prepared loaders.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.compat.accelerate.utils import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    seed_set,
)
from phalanx.config.dialects.dummies import DummyScheduler
from phalanx.config.dialects.names import precision_from_accelerate, strategy_from_zero_stage
from phalanx.config.options import ConfigError
from phalanx.engine.engine import Engine
from phalanx.engine.prepared import PreparedScheduler
from phalanx.logging import warn_once

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
        **unsupported: Any,
    ) -> None:
        if unsupported:
            raise TypeError(
                f"Accelerator({', '.join(sorted(unsupported))}=...): phalanx.accelerate does not take "
                f"{'this argument' if len(unsupported) == 1 else 'these arguments'} (Megatron-LM, dynamo, "
                "parallelism_config and several DeepSpeed plugins are not supported); remove it"
            )
        loader_config = dataloader_config or DataLoaderConfiguration(split_batches=split_batches)
        if loader_config.split_batches or split_batches:
            raise ConfigError(
                "Accelerator(split_batches=True): phalanx splits each global batch of batch_size x num_processes; "
                "divide your DataLoader's batch_size by the number of processes and leave split_batches False"
            )
        if not loader_config.even_batches:
            warn_once(
                "DataLoaderConfiguration(even_batches=False): phalanx's prepared loaders always give every process "
                "the same number of batches (the last one padded and trimmed by gather_for_metrics)"
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
        for handler in kwargs_handlers or []:
            options.update(_handler_options(handler))
        if not device_placement:
            warn_once("Accelerator(device_placement=False) is not used: phalanx places models and batches itself")
        if rng_types and set(rng_types) - {"generator"}:
            warn_once(
                f"Accelerator(rng_types={rng_types}): phalanx does not synchronise the global RNGs at each epoch; the "
                "data order is the same on every rank without it (it comes from the seed)"
            )
        if not plugin.sync_with_dataloader:
            warn_once(
                "GradientAccumulationPlugin(sync_with_dataloader=False) is not used: phalanx always ends the "
                "accumulation window at the end of the DataLoader"
            )
        for name, value in (("log_with", log_with), ("project_dir", project_dir), ("project_config", project_config)):
            if value is not None:
                warn_once(f"Accelerator({name}=...) is not used: phalanx's trackers are the Trainer's report_to")
        super().__init__(**options)
        self.split_batches = False
        self._forward_unsynced = False  # the last forward ran under no_sync (torch DDP's rule for its backward)
        self._triggered = False  # trigger_sync_in_backward: the next backward reduces
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.dataloader_config = loader_config
        self.rng_types = rng_types
        self.gradient_state = GradientState(self, plugin)
        self.distributed_type = _distributed_type(self, deepspeed_plugin is not None, fsdp_plugin is not None)
        self.state = _State(self)

    # ------------------------------------------------------------------------------------------- who and how
    @property
    def mixed_precision(self) -> str:
        return {"fp32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16"}.get(self.config.precision, "no")

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.grad_accum_steps

    def end_training(self) -> None:
        """Accelerate's end of training (its trackers finish); phalanx waits for every process."""
        self.wait_for_everyone()

    # ------------------------------------------------------------------------------------------- prepare
    def prepare(self, *objects: Any, device_placement: list[bool] | None = None, **kwargs: Any) -> Any:
        out = super().prepare(*objects, **kwargs)
        seed = self.dataloader_config.data_seed if self.dataloader_config.data_seed is not None else seed_set()
        if seed is not None:
            for obj in out if isinstance(out, tuple) else (out,):
                if hasattr(obj, "global_sampler"):
                    obj.global_sampler.seed = seed  # set_seed reaches the data order, as in Accelerate
        return out

    def prepare_model(self, model: Any, param_init_fn: Any = None) -> nn.Module:  # type: ignore[override]
        prepared = super().prepare_model(model, param_init_fn)
        prepared.register_forward_pre_hook(self._note_forward)
        return prepared

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
        """Accelerate joins processes whose loaders run out at different times; phalanx's prepared loaders give
        every process the same number of batches, so there is nothing to join."""
        if self.state.distributed_type not in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
            warnings.warn(
                "join_uneven_inputs is only supported for multi-GPU (and multi-CPU) data parallelism, as in "
                f"Accelerate; this run is {self.state.distributed_type.value}, so nothing is joined",
                UserWarning,
                stacklevel=3,
            )
        if even_batches is False:
            warn_once(
                "join_uneven_inputs(even_batches=False): phalanx's prepared loaders always give every process the "
                "same number of batches (the last one padded and trimmed by gather_for_metrics)"
            )
        yield

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        from phalanx.compat.accelerate.utils import skip_first_batches

        return skip_first_batches(dataloader, num_batches)


class _State:
    """Accelerate's ``AcceleratorState``: who this process is and how the run is distributed."""

    def __init__(self, accelerator: Accelerator) -> None:
        self._accelerator = accelerator
        self.debug = False

    def __getattr__(self, name: str) -> Any:
        if name in ("num_processes", "process_index", "local_process_index", "device", "distributed_type",
                    "mixed_precision", "is_main_process", "is_local_main_process", "use_distributed"):  # fmt: skip
            return getattr(self._accelerator, name)
        raise AttributeError(f"AcceleratorState has no attribute {name!r} in phalanx.accelerate")

    def wait_for_everyone(self) -> None:
        self._accelerator.wait_for_everyone()

    def destroy_process_group(self, group: Any = None) -> None:
        """The end of the run's collectives, as Accelerate's: the process group is torn down."""
        if dist.is_initialized():
            dist.destroy_process_group(group)


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
    return options


def _handler_options(handler: Any) -> dict[str, Any]:
    if isinstance(handler, DistributedDataParallelKwargs):
        if handler.comm_hook is not None or handler.static_graph:
            warn_once("DistributedDataParallelKwargs(comm_hook, static_graph) are not used by phalanx's reducer")
        return {"find_unused_parameters": handler.find_unused_parameters, "bucket_mb": float(handler.bucket_cap_mb)}
    if isinstance(handler, GradScalerKwargs):
        return {"loss_scale_init": handler.init_scale, "loss_scale_window": handler.growth_interval}
    warn_once(f"Accelerator(kwargs_handlers=[{type(handler).__name__}(...)]) is not used by phalanx")
    return {}
