"""The sizes of the device mesh: how many ranks each axis of (pp, dp_replicate, dp_shard, tp) spans.

The settings are Accelerate's ``ParallelismConfig`` names (``tp_size``, ``dp_shard_size``, ``dp_replicate_size``)
plus the pipeline's ``pp_size``. :func:`mesh_sizes` fills in what was left unset and checks every degree at once
against the world size, in one message that names each size and where it came from (as torchtitan's
``ParallelDims`` does), so that a bad layout is one error, not a chain of them.

The order is pp, dp_replicate, dp_shard, tp, tp innermost: the ranks of one tensor-parallel group are contiguous
(on one machine, on its fastest links), then the shards of one replica, then the replicas, then the stages.
``runtime/topology.py`` builds the process groups from these sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from phalanx.config.options import ConfigError
from phalanx.config.registry import accepts
from phalanx.config.strategy_options import ParallelOptions, PipelineOptions, ZeroOptions

if TYPE_CHECKING:
    from phalanx.config.settings import EngineConfig

__all__ = ["MeshSizes", "mesh_sizes", "AXES"]

AXES = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh's axes, outermost first (context parallelism would sit between dp_shard and tp)."""


class MeshSizes(NamedTuple):
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def dp(self) -> int:
        """The data-parallel size: replicas times shards (the data loader splits batches over these ranks)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def describe(self) -> str:
        return " x ".join(f"{name} {size}" for name, size in zip(AXES, self) if size > 1) or "one rank"


def mesh_sizes(config: EngineConfig, world_size: int, origins: dict[str, str] | None = None) -> MeshSizes:
    """The mesh ``config`` asks for on ``world_size`` ranks, with unset sizes filled in.

    tp defaults to 1. Under the pipeline, ``pp_size`` defaults to what the other axes leave (one stage per rank
    without them). The data-parallel ranks left over go to ``dp_shard`` under the zero strategies (they shard over
    all of them) and to ``dp_replicate`` otherwise; when one of the two is set, the other takes the rest."""
    origins = origins or {}
    par = config.options(ParallelOptions)
    tp = par.tp_size
    pipeline = accepts(config.strategy, PipelineOptions)
    pp_set = config.options(PipelineOptions).pp_size if pipeline else None
    shards = accepts(config.strategy, ZeroOptions)
    rep, shard = par.dp_replicate_size, par.dp_shard_size

    def said(key: str, value: object) -> str:
        return f"{key}={value} ({origins.get(key, 'default')})"

    def error(problem: str, fix: str) -> ConfigError:
        parts = [said("tp_size", tp), said("dp_shard_size", shard), said("dp_replicate_size", rep)]
        if pipeline:
            parts.insert(0, said("pp_size", pp_set))
        return ConfigError(
            f"the device mesh does not fit: {problem}; {', '.join(parts)}, world size {world_size} ({fix})"
        )

    if not shards and shard is not None and shard > 1:
        raise error(
            f"dp_shard_size={shard} shards parameters or optimizer state over {shard} ranks, which strategy "
            f"{config.strategy!r} does not do",
            "use zero1, zero2 or zero3 to shard (dp_replicate_size x dp_shard_size is hybrid sharding), or set "
            "dp_replicate_size instead",
        )
    fixed = tp * (rep or 1) * (shard or 1)
    if pipeline:
        if pp_set is None:
            if world_size % fixed:
                raise error(
                    f"tp x dp sizes = {fixed} do not divide the world", "launch a multiple of that many processes"
                )
            pp = world_size // fixed
        else:
            pp = pp_set
    else:
        pp = 1
    rest, leftover = divmod(world_size, pp * fixed)
    if leftover or rest < 1:
        raise error(
            f"pp x tp x dp_replicate x dp_shard = {pp * fixed} does not divide the world",
            f"launch a multiple of {pp * fixed} processes, or change the sizes so that their product divides "
            f"{world_size}",
        )
    if rep is None and shard is None:
        rep, shard = (1, rest) if shards else (rest, 1)
    elif rep is None:
        rep = rest
    elif shard is None:
        shard = rest
    elif rest != 1:
        raise error(
            f"pp x tp x dp_replicate x dp_shard = {pp * fixed} ranks, not the {world_size} launched",
            f"launch {pp * fixed} processes, or leave dp_replicate_size or dp_shard_size unset to take the rest",
        )
    assert rep is not None and shard is not None
    return MeshSizes(pp, rep, shard, tp)
