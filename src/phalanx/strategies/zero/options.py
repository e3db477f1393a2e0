"""The zero strategies' settings: how they shard (also under the pipeline's ``pp_zero_stage: 1``), what they
offload, and zero3's units."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from phalanx.options import Options, ConfigError, option

if TYPE_CHECKING:
    from phalanx.config import EngineConfig

__all__ = ["ZeroShardOptions", "ZeroOptions", "Zero3Options", "COMM_DTYPES", "COLLECTIVES", "OFFLOAD"]

COMM_DTYPES = ("bf16", "fp16", "fp32")
COLLECTIVES = ("auto", "native", "p2p", "allreduce")
OFFLOAD = ("none", "cpu", "disk")


@dataclass
class ZeroShardOptions(Options):
    title: ClassVar[str] = "ZeRO sharding (zero1, zero2, zero3; pipeline with pp_zero_stage=1)"
    applies_to: ClassVar[str] = "the zero strategies"

    zero_collectives: str = option(
        "auto",
        "native (reduce-scatter / all-gather), p2p (both made of point-to-point sends, gloo only; the fastest there), "
        "allreduce (both emulated with all-reduce), or auto: p2p on gloo, native otherwise.",
        choices=COLLECTIVES,
    )
    zero_allow_untested_optimizer: bool = option(
        False, "Accept an optimizer outside torch.optim's elementwise ones (as DeepSpeed's option of that name)."
    )


@dataclass
class ZeroOptions(Options):
    title: ClassVar[str] = "zero strategies (zero1, zero2, zero3)"
    applies_to: ClassVar[str] = "the zero strategies"

    offload: str = option(
        "none",
        "Where optimizer state (and zero3's parameter shards) live: none (the device), cpu (host memory, pinned on "
        "CUDA) or disk (memory-mapped files under offload_dir).",
        choices=OFFLOAD,
        elsewhere="{key}={value!r} needs a zero strategy (zero1, zero2 or zero3); got strategy={strategy!r}",
    )
    offload_dir: str | None = option(None, "Directory for offload: disk (like DeepSpeed's nvme_path); it must be writable.")
    offload_chunk_mb: float = option(
        64.0,
        "offload: disk steps the optimizer this many MiB of parameters at a time, so one chunk of state is resident.",
        check=lambda v: v > 0,
        fix="use a positive size such as 64",
    )
    comm_dtype: str | None = option(
        None, "Dtype parameters and gradients travel in (bf16, fp16 or fp32); default: theirs.", choices=COMM_DTYPES
    )

    def check(self, config: EngineConfig) -> None:
        if self.offload == "disk" and not self.offload_dir:
            raise ConfigError("offload='disk' needs offload_dir: a writable directory for the memory-mapped files")


@dataclass
class Zero3Options(Options):
    title: ClassVar[str] = "zero3"
    applies_to: ClassVar[str] = "strategy='zero3'"

    zero3_unit_classes: str | None = option(
        None,
        "Comma-separated module class names gathered as one unit (like Accelerate's "
        "fsdp_transformer_layer_cls_to_wrap); default: each child module with parameters.",
    )
    zero3_prefetch: bool = option(True, "All-gather the next unit while the current one computes (forward and backward).")
