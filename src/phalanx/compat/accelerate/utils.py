"""``accelerate.utils`` names that training scripts import, with Accelerate's meaning, for ``phalanx.accelerate``.

The plugin and configuration classes take Accelerate's keyword arguments; :class:`~.accelerator.Accelerator` reads
them into phalanx's settings (or refuses the ones phalanx cannot honour, naming them).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from phalanx.config.dialects.parallelism import object_spelling, read_parallelism, values_of
from phalanx.engine.data import PreparedIterableLoader

__all__ = [
    "DistributedType", "DataLoaderConfiguration", "GradientAccumulationPlugin", "DeepSpeedPlugin",
    "FullyShardedDataParallelPlugin", "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs",
    "ProjectConfiguration", "ParallelismConfig", "TorchContextParallelConfig", "DeepSpeedSequenceParallelConfig",
    "set_seed", "seed_set", "skip_first_batches",
]  # fmt: skip


@dataclasses.dataclass
class TorchContextParallelConfig:
    """Accelerate's options of ``cp_size`` (``accelerate.utils.TorchContextParallelConfig``): how torch's
    context_parallel exchanges kv shards. phalanx's ring passes kv chunks point-to-point whatever it says (a note)."""

    cp_comm_strategy: str | None = None


@dataclasses.dataclass
class DeepSpeedSequenceParallelConfig:
    """Accelerate's options of ``sp_size`` (``accelerate.utils.DeepSpeedSequenceParallelConfig``), read as
    ``config/dialects/parallelism.py`` says: phalanx's Ulysses takes any sequence length and runs SDPA inside."""

    sp_seq_length: int | None = None
    sp_seq_length_is_variable: bool | None = None
    sp_attn_implementation: str | None = None


@dataclasses.dataclass
class ParallelismConfig:
    """Accelerate's ``ParallelismConfig`` (``from accelerate.parallelism_config import ParallelismConfig``): the
    device mesh's data-parallel replicas and shards, its tensor-parallel degree, and the sequence split over
    ``cp_size`` ranks (phalanx's ring attention, for torch's context_parallel) or ``sp_size`` ranks (phalanx's Ulysses,
    for DeepSpeed's ALST). The Accelerator reads it, or Accelerate's own, with ``parallelism_options``."""

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: Any = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: DeepSpeedSequenceParallelConfig | None = None

    @property
    def cp_enabled(self) -> bool:
        return (self.cp_size or 1) > 1

    @property
    def sp_enabled(self) -> bool:
        return (self.sp_size or 1) > 1

    @property
    def tp_enabled(self) -> bool:
        return (self.tp_size or 1) > 1


def parallelism_options(config: Any, notes: list[str] | None = None) -> dict[str, int]:
    """The Engine settings of an Accelerate (or phalanx) ``ParallelismConfig``; the notes on its options go to
    ``notes``. What phalanx cannot do is refused, as every front refuses it (``config/dialects/parallelism.py``)."""
    if config is None:
        return {}
    reading = read_parallelism(values_of(config, type(config).__name__), object_spelling(type(config).__name__))
    if notes is not None:
        notes.extend(reading.notes)
    # Accelerate's tp_handler (filled in by default) has nothing to say here: the plan is the model's.
    return reading.settings()


class DistributedType(str, enum.Enum):
    """Accelerate's names for how a run is distributed (the ones a CPU or CUDA run can have)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    MULTI_XPU = "MULTI_XPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"


@dataclasses.dataclass
class DataLoaderConfiguration:
    """Accelerate's loader options, as the Accelerator reads them (``engine/streams.py`` for streams)."""

    split_batches: bool = False
    """Refused: divide the DataLoader's batch_size by the number of processes instead."""
    dispatch_batches: bool | None = None
    """True: a loader over an ``IterableDataset`` gives the batches of Accelerate's dispatcher (process 0's stream,
    each process its slice of every global batch); phalanx gets them by reading the stream whole on every process
    (so with ``num_workers=0``) rather than sending them from process 0. False or None: a sharded stream is read by
    shard, each sample once over all processes and workers (its batches are not Accelerate's, whose processes each
    read the whole stream and keep a slice); an unsharded one is read whole on every process, as Accelerate's
    ``IterableDatasetShard`` reads it. A map-style loader's batches are the same either way."""
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False
    """Honoured either way: every prepared loader has ``state_dict()``/``load_state_dict()``, and ``save_state`` and
    ``load_state`` keep its position (mid-epoch included), as Accelerate does with True (torchdata's
    ``StatefulDataLoader``). With False, Accelerate does not restore the position and scripts call
    ``skip_first_batches`` after ``load_state``: on a map-style loader that sets the same position again."""

    def __post_init__(self) -> None:
        for name in ("dispatch_batches", "use_stateful_dataloader"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"DataLoaderConfiguration({name}={value!r}): expected True or False")


@dataclasses.dataclass
class GradientAccumulationPlugin:
    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclasses.dataclass
class DeepSpeedPlugin:
    hf_ds_config: Any = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None


@dataclasses.dataclass
class FullyShardedDataParallelPlugin:
    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    cpu_offload: Any = None
    auto_wrap_policy: Any = None
    transformer_cls_names_to_wrap: list[str] | None = None
    state_dict_type: Any = None
    activation_checkpointing: bool | None = None
    """Accelerate checkpoints each wrapped layer; phalanx's ``activation_checkpointing="full"`` checkpoints every
    block (zero3's units: a transformers model's decoder layers): see :func:`fsdp_plugin_options`."""


def fsdp_plugin_options(plugin: FullyShardedDataParallelPlugin) -> dict[str, Any]:
    """The Engine settings of a plugin's options beyond its sharding and offload (the Accelerator reads plugins with
    it; not an Accelerate name): ``activation_checkpointing=True`` is ``activation_checkpointing="full"``, as an
    Accelerate YAML's ``fsdp_activation_checkpointing: true``."""
    return {"activation_checkpointing": "full"} if plugin.activation_checkpointing else {}


@dataclasses.dataclass
class DistributedDataParallelKwargs:
    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: Any = None
    comm_wrapper: Any = None
    comm_state_option: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GradScalerKwargs:
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclasses.dataclass
class InitProcessGroupKwargs:
    """Accelerate's process-group arguments: ``timeout`` (a ``datetime.timedelta``) becomes phalanx's timeout_s."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: Any = None


@dataclasses.dataclass
class ProjectConfiguration:
    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False


_SEED: list[int] = []  # the last set_seed, which an Accelerator's loaders draw their order from


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch, as Accelerate's ``set_seed``; the data order of the loaders an Accelerator
    prepares afterwards follows the seed too (the same order on every rank)."""
    if device_specific:
        seed += dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
    _SEED[:] = [seed]


def seed_set() -> int | None:
    """The seed of the last :func:`set_seed`, if any."""
    return _SEED[0] if _SEED else None


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """The loader, starting its next pass ``num_batches`` batches in, as Accelerate's (later passes start at 0).

    A loader that an Accelerator prepared skips without loading the skipped batches."""
    sampler = getattr(dataloader, "global_sampler", None)
    if isinstance(dataloader, PreparedIterableLoader):
        raise TypeError(
            "skip_first_batches does not take a prepared stream (an IterableDataset's loader): its position is "
            "saved by accelerator.save_state and restored by load_state, which seeks each shard instead of reading "
            f"the skipped batches; got num_batches={num_batches} (call load_state, or drop the skip)"
        )
    if sampler is None:
        raise TypeError(
            "skip_first_batches takes a DataLoader that accelerator.prepare returned; got a "
            f"{type(dataloader).__name__} (prepare it first)"
        )
    if not 0 <= num_batches <= len(dataloader):
        raise ValueError(f"skip_first_batches: num_batches={num_batches} is outside 0..{len(dataloader)}")
    sampler.start_batch = num_batches
    return dataloader
