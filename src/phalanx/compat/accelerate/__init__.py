"""Accelerate's API on phalanx: a script written for ``from accelerate import Accelerator`` runs with the import
changed to ``from phalanx.accelerate import Accelerator`` (and ``accelerate.utils`` to ``phalanx.accelerate.utils``).
See :mod:`phalanx.compat.accelerate.accelerator` for where it follows Accelerate rather than the Engine."""

from __future__ import annotations

from phalanx.compat.accelerate.accelerator import AcceleratedScheduler, Accelerator, GradientState
from phalanx.compat.accelerate.operations import find_executable_batch_size, get_logger
from phalanx.compat.accelerate.utils import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ParallelismConfig,
    ProjectConfiguration,
    set_seed,
    skip_first_batches,
)
from phalanx.config.dialects.dummies import DummyOptim, DummyScheduler

__all__ = [
    "Accelerator", "AcceleratedScheduler", "GradientState", "DistributedType", "DataLoaderConfiguration",
    "GradientAccumulationPlugin",
    "DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "DistributedDataParallelKwargs", "GradScalerKwargs",
    "InitProcessGroupKwargs", "ParallelismConfig",
    "ProjectConfiguration", "set_seed", "skip_first_batches", "DummyOptim", "DummyScheduler",
    "get_logger", "find_executable_batch_size",
]  # fmt: skip
