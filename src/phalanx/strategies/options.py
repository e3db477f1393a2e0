"""Settings shared by every strategy that keeps data-parallel replicas: ddp, zero, and the pipeline's stages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phalanx.options import Options, option

__all__ = ["DataParallelOptions"]


@dataclass
class DataParallelOptions(Options):
    title: ClassVar[str] = "data parallel (ddp, zero, pipeline stages)"
    applies_to: ClassVar[str] = "the data-parallel strategies"

    bucket_mb: float = option(
        25.0,
        "Size of one gradient bucket in MiB (ddp; zero1/zero2 buckets); a bucket is reduced as soon as its last "
        "gradient lands.",
        check=lambda v: v > 0,
        fix="use a positive size such as 25",
    )
    broadcast_buffers: bool = option(
        True, "Broadcast module buffers (e.g. BatchNorm statistics) from the first replica before each training forward."
    )
    find_unused_parameters: bool = option(
        False, "Allow trainable parameters that get no gradient in a backward (they are reduced as zeros)."
    )
