"""Each strategy's own settings, declared as :class:`~phalanx.config.options.Options` groups: what every
data-parallel strategy reads (ddp, zero, the pipeline's stages), the zero strategies' sharding, offload and units,
and the pipeline's stages, schedule and partition.

They live on the ground floor, beside the registry that names which strategy accepts which group, so that
configuration, the dialects and ``phalanx launch --help`` read them without importing any strategy. The strategies
read their values with ``config.options(Group)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from phalanx.config.options import ConfigError, Options, option

if TYPE_CHECKING:
    from phalanx.config.settings import EngineConfig

__all__ = [
    "DataParallelOptions",
    "ZeroShardOptions",
    "ZeroOptions",
    "Zero3Options",
    "PipelineOptions",
    "ParallelOptions",
    "COMM_DTYPES",
    "COLLECTIVES",
    "OFFLOAD",
    "SCHEDULES",
    "parse_partition",
]


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
        True,
        "Broadcast module buffers (e.g. BatchNorm statistics) from the first replica before each training forward.",
    )
    find_unused_parameters: bool = option(
        False, "Allow trainable parameters that get no gradient in a backward (they are reduced as zeros)."
    )


@dataclass
class ParallelOptions(Options):
    """The device mesh's tensor-parallel and data-parallel degrees (Accelerate's ``ParallelismConfig`` names)."""

    title: ClassVar[str] = "device mesh (tensor, context and hybrid-sharded data parallelism)"
    applies_to: ClassVar[str] = "every strategy"

    tp_size: int = option(
        1,
        "Tensor-parallel degree: each layer of the plan is split over this many ranks (contiguous ranks, the "
        "innermost axis of the mesh).",
        check=lambda v: v >= 1,
        fix="use 1 for no tensor parallelism",
    )
    cp_size: int = option(
        1,
        "Context parallelism by ring attention: every sequence is split over this many ranks (two zig-zag chunks "
        "each) and the kv chunks rotate over the ring in every attention layer. Causal attention; any head count. "
        "See docs/long-context.md.",
        check=lambda v: v >= 1,
        fix="use 1 for no context parallelism",
    )
    sp_size: int = option(
        1,
        "Context parallelism by Ulysses (DeepSpeed's ALST): every sequence is split over this many ranks, and "
        "all-to-alls turn the split into a head split around attention. Attention heads must divide by it. Not "
        "with cp_size (one of the two at a time). See docs/long-context.md.",
        check=lambda v: v >= 1,
        fix="use 1 for no Ulysses sequence parallelism",
    )
    ep_size: int = option(
        1,
        "Expert parallelism: the experts of every mixture-of-experts layer are split over this many ranks, carved "
        "out of the data-parallel ranks (it divides dp_replicate x dp_shard x cp); tokens go to their experts' ranks "
        "and back by all-to-all. The split follows the model's base_model_ep_plan. See docs/moe.md.",
        check=lambda v: v >= 1,
        fix="use 1 for no expert parallelism",
    )
    moe_capacity_factor: float | None = option(
        None,
        "Under expert parallelism, the most pairs each expert takes from a rank, as a multiple of the even share "
        "(tokens x top_k / experts), as Megatron's --moe-expert-capacity-factor; the pairs over it are dropped (they "
        "add nothing to the token's output) and counted. Default: dropless, every pair is computed, as the model "
        "computes it in one process.",
        check=lambda v: v > 0,
        fix="use a positive factor such as 1.25, or leave it unset for dropless routing",
    )
    moe_aux_loss: str = option(
        "rank",
        "A mixture-of-experts model's load-balancing loss: 'rank' computes it on each rank's tokens (a per-rank "
        "statistic, as Megatron's aux_loss; the model's own code, unchanged), 'global' over the tokens of every "
        "data-parallel and context-parallel rank (Megatron's global_aux_loss), equal to one process's on the whole "
        "batch. 'global' applies to transformers MoE models (their load_balancing_loss_func). See docs/moe.md.",
        choices=("rank", "global"),
    )
    dp_shard_size: int | None = option(
        None,
        "Data-parallel ranks that shard the model (zero1/2/3); default: every data-parallel rank under zero, 1 "
        "otherwise. With dp_replicate_size it is hybrid sharding (FSDP's HYBRID_SHARD).",
        check=lambda v: v >= 1,
        fix="use 1 or more",
    )
    dp_replicate_size: int | None = option(
        None,
        "Data-parallel replicas, each holding a whole copy (or, under zero, one dp_shard_size group's shards); "
        "default: the data-parallel ranks that dp_shard_size leaves.",
        check=lambda v: v >= 1,
        fix="use 1 or more",
    )
    tp_plan: str | None = option(
        None,
        "The tensor-parallel plan: a JSON object of module-name patterns to styles (inline, or a path to a .json "
        "file); default: the model's own plan (a transformers model's base_model_tp_plan, or tp_plan() of the "
        "model). See docs/tensor-parallel.md.",
    )
    sequence_parallel: bool = option(
        False,
        "Under tensor parallelism, split the sequence (dim 1) over the tp ranks in the norm and dropout regions, "
        "so that their activations take 1/tp_size of the memory (Korthikanti et al., 2022).",
    )

    def check(self, config: EngineConfig) -> None:
        if self.ep_size == 1 and "moe_capacity_factor" in self.set_fields():
            raise ConfigError(
                f"moe_capacity_factor={self.moe_capacity_factor!r} applies under expert parallelism only; got "
                "ep_size=1 (set ep_size to 2 or more, or leave moe_capacity_factor unset)"
            )
        if self.tp_size == 1:
            for key in ("tp_plan", "sequence_parallel"):
                if key in self.set_fields():
                    raise ConfigError(
                        f"{key}={getattr(self, key)!r} applies under tensor parallelism only; got tp_size=1 (set "
                        "tp_size to 2 or more, or leave it unset)"
                    )


# ---------------------------------------------------------------- zero
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
    offload_dir: str | None = option(
        None, "Directory for offload: disk (like DeepSpeed's nvme_path); it must be writable."
    )
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
        "fsdp_transformer_layer_cls_to_wrap); default: a transformers model's _no_split_modules (its decoder layers, "
        "as Accelerate's transformer-based wrap takes them), else each child module with parameters.",
    )
    zero3_prefetch: bool = option(
        True, "All-gather the next unit while the current one computes (forward and backward)."
    )


# ------------------------------------------------------------ pipeline
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zb_h1")
_SCHEDULE_ALIASES = {  # what other tools call them, for the error message
    "interleaved1f1b": "interleaved_1f1b", "interleaved": "interleaved_1f1b", "zbh1": "zb_h1",
    "zerobubble": "zb_h1", "interleavedzerobubble": "zb_h1", "zbvzerobubble": "zb_h1", "zb1p": "zb_h1",
}  # fmt: skip


def parse_partition(spec: str) -> str | list[int]:
    """``parameters``, ``uniform`` or ``time``, or explicit cut points ``"3,6"`` (the first block of stages 1..)."""
    if spec in ("parameters", "uniform", "time"):
        return spec
    try:
        cuts = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"pp_partition must be parameters, uniform, time, or comma-separated cut points such as '3,6'; got {spec!r}"
        ) from None
    if not cuts or any(b <= a for a, b in zip(cuts, cuts[1:])) or cuts[0] <= 0:
        raise ValueError(
            "pp_partition cut points must be positive and increasing (the first block of stage 1, 2, ...); "
            f"got {spec!r}"
        )
    return cuts


def _check_partition(value: str) -> bool:
    parse_partition(value)  # raises with the reason
    return True


@dataclass
class PipelineOptions(Options):
    title: ClassVar[str] = "pipeline"
    applies_to: ClassVar[str] = "strategy='pipeline'"

    pp_size: int | None = option(
        None,
        "Pipeline stages; the data-parallel size is world_size / pp_size. "
        "Default: the world size (one stage per rank).",
        check=lambda v: v >= 1,
        fix="use 1 for no pipeline",
        is_set=lambda v: v is not None and v > 1,
        elsewhere="{key}={value} splits the model into pipeline stages, which needs strategy='pipeline'; got "
        "strategy={strategy!r} (use strategy='pipeline', or pp_size=1)",
    )
    pp_schedule: str = option(
        "1f1b",
        "1f1b (warm-up, one forward one backward, cool-down: at most pp_size micro-batches of activations held per "
        "stage), gpipe (every forward, then every backward: all micro-batches held), interleaved_1f1b (1F1B over "
        "pp_virtual_stages chunks per rank, bubble / v: torch's Interleaved1F1B, Megatron's virtual pipeline) or "
        "zb_h1 (zero-bubble ZB-H1: each backward split into input and weight gradients, the latter deferred into "
        "the bubble; 1F1B's memory).",
    )
    pp_virtual_stages: int | None = option(
        None,
        "Model chunks per rank for pp_schedule=interleaved_1f1b (Megatron's virtual_pipeline_model_parallel_size); "
        "default 2 there, 1 for the other schedules.",
        check=lambda v: v >= 1,
        fix="use 2 or more chunks per rank with pp_schedule=interleaved_1f1b",
    )
    pp_microbatches: int | None = option(
        None,
        "Micro-batches each batch is split into (the bubble is (pp-1)/(m+pp-1)); default 2 x pp_size.",
        check=lambda v: v >= 1,
        fix="use 1 or more micro-batches per batch",
    )
    pp_partition: str = option(
        "parameters",
        "How blocks are split into stages: parameters (balanced parameter counts), uniform (balanced block counts), "
        'time (balanced forward+backward time, measured at the first step), or cut points such as "3,6" (stage 1 '
        "starts at block 3, stage 2 at block 6).",
    )
    pp_zero_stage: int = option(
        0,
        "1 shards each stage's optimizer state over its data-parallel replicas (ZeRO-1, as DeepSpeed's pipeline engine "
        "allows); 0 keeps it whole on every replica. Stages 2 and 3 are refused: they would reduce-scatter gradients "
        "or gather parameters once per micro-batch.",
    )

    def virtual_stages(self) -> int:
        """Chunks per rank: pp_virtual_stages, or its default for the schedule."""
        if self.pp_virtual_stages is not None:
            return self.pp_virtual_stages
        return 2 if self.pp_schedule == "interleaved_1f1b" else 1

    def check(self, config: EngineConfig) -> None:
        if self.pp_schedule not in SCHEDULES:
            known = _SCHEDULE_ALIASES.get(str(self.pp_schedule).lower().replace("_", "").replace("-", ""))
            raise ConfigError(
                f"invalid pp_schedule: got {self.pp_schedule!r} (use one of: {', '.join(SCHEDULES)}"
                + (f"; {self.pp_schedule!r} is pp_schedule={known!r} here)" if known else ")")
            )
        if self.pp_schedule == "interleaved_1f1b" and self.virtual_stages() < 2:
            raise ConfigError(
                f"pp_schedule='interleaved_1f1b' needs pp_virtual_stages >= 2 chunks per rank; got "
                f"pp_virtual_stages={self.pp_virtual_stages} (use 2 or more, or pp_schedule='1f1b' for one chunk)"
            )
        if self.pp_schedule != "interleaved_1f1b" and self.virtual_stages() != 1:
            raise ConfigError(
                f"pp_virtual_stages={self.pp_virtual_stages} applies to pp_schedule='interleaved_1f1b' only; got "
                f"pp_schedule={self.pp_schedule!r} (use pp_schedule='interleaved_1f1b', or leave pp_virtual_stages "
                "unset)"
            )
        if self.pp_schedule == "interleaved_1f1b" and self.pp_size is not None and self.pp_microbatches is not None:
            if self.pp_microbatches % self.pp_size:
                m, pp = self.pp_microbatches, self.pp_size
                raise ConfigError(
                    f"pp_schedule='interleaved_1f1b' sends micro-batches round the pipeline in groups of pp_size, so "
                    f"pp_microbatches must be a multiple of pp_size={pp}; got pp_microbatches={m} (use "
                    f"{max(pp, m - m % pp)} or {m + pp - m % pp}, as Megatron-LM requires)"
                )
        try:
            _check_partition(self.pp_partition)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.pp_zero_stage not in (0, 1):
            raise ConfigError(
                f"pp_zero_stage={self.pp_zero_stage!r} is not supported: use 0 (each stage's replicas hold its whole "
                "optimizer state) or 1 (they shard it). Stages 2 and 3 would reduce-scatter gradients or gather "
                "parameters on every micro-batch, which is why DeepSpeed's pipeline engine refuses them too"
            )
        if config.grad_accum_steps > 1:
            raise ConfigError(
                f"grad_accum_steps={config.grad_accum_steps} does not apply to strategy='pipeline': its micro-batches "
                "already accumulate gradients within each engine.train_step (set pp_microbatches instead, e.g. "
                f"pp_microbatches={config.grad_accum_steps * (self.pp_microbatches or 1)}, with a batch that many "
                "times larger)"
            )
        if self.pp_zero_stage == 0:
            shard = config.options(ZeroShardOptions)
            for key in shard.set_fields():
                raise ConfigError(
                    f"{key}={getattr(shard, key)!r} applies to the zero strategies only; got strategy='pipeline' "
                    "(use zero1, zero2 or zero3, or leave it unset; under strategy='pipeline' with pp_zero_stage=1, "
                    "zero_collectives and zero_allow_untested_optimizer apply)"
                )
