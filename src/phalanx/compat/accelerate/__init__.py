"""Accelerate's API on phalanx: a script written for ``from accelerate import Accelerator`` runs with the import
changed to ``from phalanx.accelerate import Accelerator`` (and ``accelerate.utils`` to ``phalanx.accelerate.utils``).
See :mod:`phalanx.compat.accelerate.accelerator` for where it follows Accelerate rather than the Engine."""

from __future__ import annotations

from phalanx.compat.accelerate.accelerator import AcceleratedScheduler, Accelerator, GradientState
from phalanx.compat.accelerate.utils import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    ProjectConfiguration,
    set_seed,
    skip_first_batches,
)
from phalanx.config.dialects.dummies import DummyOptim, DummyScheduler

__all__ = [
    "Accelerator", "AcceleratedScheduler", "GradientState", "DistributedType", "DataLoaderConfiguration",
    "GradientAccumulationPlugin",
    "DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "DistributedDataParallelKwargs", "GradScalerKwargs",
    "ProjectConfiguration", "set_seed", "skip_first_batches", "DummyOptim", "DummyScheduler",
]  # fmt: skip
