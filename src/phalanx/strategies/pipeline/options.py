"""The pipeline strategy's settings: stages, schedule, micro-batches, partition, and how a stage's replicas
hold its optimizer state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from phalanx.options import Options, ConfigError, option

if TYPE_CHECKING:
    from phalanx.config import EngineConfig

__all__ = ["PipelineOptions", "SCHEDULES"]

SCHEDULES = ("1f1b", "gpipe")


def _check_partition(value: str) -> bool:
    from phalanx.strategies.pipeline.partition import parse_partition

    parse_partition(value)  # raises with the reason
    return True


@dataclass
class PipelineOptions(Options):
    title: ClassVar[str] = "pipeline"
    applies_to: ClassVar[str] = "strategy='pipeline'"

    pp_size: int | None = option(
        None,
        "Pipeline stages; the data-parallel size is world_size / pp_size. Default: the world size (one stage per rank).",
        check=lambda v: v >= 1,
        fix="use 1 for no pipeline",
        is_set=lambda v: v is not None and v > 1,
        elsewhere="{key}={value} splits the model into pipeline stages, which needs strategy='pipeline'; got "
        "strategy={strategy!r} (use strategy='pipeline', or pp_size=1)",
    )
    pp_schedule: str = option(
        "1f1b",
        "1f1b (warm-up, one forward one backward, cool-down: at most pp_size micro-batches of activations held per "
        "stage) or gpipe (every forward, then every backward: all micro-batches held).",
        choices=SCHEDULES,
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
        "time (balanced forward+backward time, measured at the first step), or cut points such as \"3,6\" (stage 1 "
        "starts at block 3, stage 2 at block 6).",
    )
    pp_zero_stage: int = option(
        0,
        "1 shards each stage's optimizer state over its data-parallel replicas (ZeRO-1, as DeepSpeed's pipeline engine "
        "allows); 0 keeps it whole on every replica. Stages 2 and 3 are refused: they would reduce-scatter gradients "
        "or gather parameters once per micro-batch.",
    )

    def check(self, config: EngineConfig) -> None:
        from phalanx.strategies.zero.options import ZeroShardOptions

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
                f"pp_microbatches={config.grad_accum_steps * (self.pp_microbatches or 1)}, with a batch that many times "
                "larger)"
            )
        if self.pp_zero_stage == 0:
            shard = config.options(ZeroShardOptions)
            for key in shard.set_fields():
                raise ConfigError(
                    f"{key}={getattr(shard, key)!r} applies to the zero strategies only; got strategy='pipeline' "
                    "(use zero1, zero2 or zero3, or leave it unset; under strategy='pipeline' with pp_zero_stage=1, "
                    "zero_collectives and zero_allow_untested_optimizer apply)"
                )
