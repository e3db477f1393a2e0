"""The device mesh as one value: its axes, their sizes, the one check, and the rank arithmetic.

The axes, outermost first, are ``pp, dp_replicate, dp_shard, cp, tp`` (torchtitan's ``ParallelDims`` order): the
ranks of one tensor-parallel group are contiguous (on one machine, on its fastest links), the context-parallel
ranks next to them (they exchange kv chunks at every attention layer), then the shards of one replica, the
replicas, and the pipeline stages::

    rank = (((pp * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t

The ``cp`` axis splits every sequence over its ranks through attention, by one of two methods: the ring
(``cp_size``, causal ring attention) or Ulysses (``sp_size``, all-to-alls between a sequence split and a head
split). The two are one axis, so at most one of them is above 1 (see docs/long-context.md for why).

Three groups are made of the data-parallel axes (``runtime/topology.py`` builds them):

- the *data* ranks, ``dp_replicate x dp_shard``: the loader splits batches over them; cp and tp ranks see the
  same batch;
- the *replica* ranks, ``dp_replicate x dp_shard x cp``: they hold the same parameters (parameters are replicated
  over cp), so gradients are reduced over them;
- the *shard* ranks, ``dp_shard x cp``: zero1/2/3 shard over them, as torchtitan's ``dp_shard_cp`` does.

Expert parallelism is not an axis of its own: ``ep`` ranks are carved out of the replica ranks (they are the
innermost ``ep`` of them, in rank order), as torchtitan carves them out of ``dp_shard x cp``. The experts of a
mixture-of-experts layer are split over those ranks, and the dense parameters stay replicated over them:

- the *ep* ranks: consecutive replica ranks that hold different experts and exchange tokens by all-to-all;
- the *expert replica* ranks (Megatron's expert-data-parallel group): the replica ranks at the same place in their
  ep group, which hold the same experts, so expert gradients are reduced over them;
- the *expert shard* ranks: the shard ranks at the same place in their ep group; zero shards expert state over
  them (so ``ep`` divides ``dp_shard x cp`` under hybrid sharding, checked in :meth:`Mesh.of`, which knows the
  strategy).

The settings are Accelerate's ``ParallelismConfig`` names (``tp_size``, ``cp_size``, ``sp_size``,
``dp_shard_size``, ``dp_replicate_size``) plus the pipeline's ``pp_size``. :meth:`Mesh.of` fills in what was left
unset and checks every degree at once against the world size, in one message that names each size and where it
came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from phalanx.config.options import ConfigError
from phalanx.config.registry import accepts, shards
from phalanx.config.strategy_options import ParallelOptions, PipelineOptions

if TYPE_CHECKING:
    from phalanx.config.settings import EngineConfig

__all__ = ["AXES", "Mesh", "MeshError"]

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's axes, outermost first."""


class MeshError(ConfigError):
    """The world cannot be laid out as asked."""


@dataclass(frozen=True)
class Mesh:
    """Sizes of every axis on ``world`` ranks; their product is ``world`` (checked here, once).

    ``cp_kind`` is ``"ring"`` (``cp_size``) or ``"ulysses"`` (``sp_size``): how the cp axis splits attention."""

    world: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    cp_kind: str = "ring"
    ep: int = 1
    """Expert-parallel degree, carved out of the replica ranks (``dp_replicate x dp_shard x cp``); not a factor of
    the world."""

    def __post_init__(self) -> None:
        if self.cp_kind not in ("ring", "ulysses"):
            raise MeshError(f"cp_kind={self.cp_kind!r} is not a context-parallel method; use 'ring' or 'ulysses'")
        bad = {a: s for a, s in zip(AXES, self.sizes) if not isinstance(s, int) or s < 1}
        if bad:
            raise MeshError(f"mesh sizes must be whole numbers >= 1; got {bad}")
        if self.product != self.world:
            raise MeshError(
                f"the mesh {self.describe()} spans {self.product} ranks, not the {self.world} launched (launch "
                f"{self.product} processes, or change the sizes so that their product is {self.world})"
            )
        if not isinstance(self.ep, int) or self.ep < 1:
            raise MeshError(f"ep_size must be a whole number >= 1; got {self.ep!r}")
        if (self.dp * self.cp) % self.ep:
            raise MeshError(
                f"ep_size={self.ep} does not divide the {self.dp * self.cp} data-parallel ranks of {self.describe()} "
                "(expert parallelism splits the experts over data-parallel ranks; use an ep_size that divides "
                "dp_replicate x dp_shard x cp, or launch more processes)"
            )

    # ------------------------------------------------------------------ sizes
    @property
    def sizes(self) -> tuple[int, int, int, int, int]:
        """(pp, dp_replicate, dp_shard, cp, tp)."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def product(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """The data ranks, replicas times shards: the loader splits batches over them."""
        return self.dp_replicate * self.dp_shard

    @property
    def sp(self) -> int:
        """The Ulysses degree (``sp_size``): the cp axis when it is split by Ulysses, else 1."""
        return self.cp if self.cp_kind == "ulysses" else 1

    @property
    def ring(self) -> int:
        """The ring-attention degree (``cp_size``): the cp axis when it is split by the ring, else 1."""
        return self.cp if self.cp_kind == "ring" else 1

    def size_of(self, axes: tuple[str, ...]) -> int:
        out = 1
        for a in axes:
            out *= self.sizes[_index(a)]
        return out

    def describe(self) -> str:
        """``pp 2 x dp_shard 2 x tp 2``: the axes above 1 (the cp axis named sp under Ulysses)."""
        names = [("sp" if a == "cp" and self.cp_kind == "ulysses" else a, s) for a, s in zip(AXES, self.sizes)]
        out = " x ".join(f"{name} {size}" for name, size in names if size > 1) or "one rank"
        return out + (f" (ep {self.ep} within the data-parallel ranks)" if self.ep > 1 else "")

    def as_dict(self) -> dict[str, int]:
        """The sizes by axis name, as ``memory_report`` and checkpoints record them."""
        out = dict(zip(AXES, self.sizes))
        out["sp"], out["cp"], out["ep"] = self.sp, self.ring, self.ep
        return out

    # ------------------------------------------------------------------ rank arithmetic
    def coordinates(self, rank: int) -> tuple[int, int, int, int, int]:
        """(pp, dp_replicate, dp_shard, cp, tp) of ``rank``."""
        if not 0 <= rank < self.world:
            raise MeshError(f"rank must be in 0..{self.world - 1}; got {rank}")
        out = []
        for size in reversed(self.sizes):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))  # type: ignore[return-value]

    def rank_at(self, coords: tuple[int, ...]) -> int:
        r = 0
        for c, size in zip(coords, self.sizes):
            r = r * size + c
        return r

    def axis_ranks(self, axes: tuple[str, ...], rank: int) -> list[int]:
        """The ranks that share every coordinate of ``rank`` but those of ``axes``, in order."""
        base = list(self.coordinates(rank))
        idx = [_index(a) for a in axes]
        out: list[int] = []

        def walk(k: int) -> None:
            if k == len(idx):
                out.append(self.rank_at(tuple(base)))
                return
            for c in range(self.sizes[idx[k]]):
                base[idx[k]] = c
                walk(k + 1)

        walk(0)
        return sorted(out)

    def axis_rank(self, axes: tuple[str, ...], rank: int) -> int:
        """``rank``'s index among :meth:`axis_ranks` of ``axes``."""
        return self.axis_ranks(axes, rank).index(rank)

    def ep_ranks(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s expert-parallel group: the ``ep`` consecutive replica ranks it is one of."""
        replicas = self.axis_ranks(("dp_replicate", "dp_shard", "cp"), rank)
        first = replicas.index(rank) // self.ep * self.ep
        return replicas[first : first + self.ep]

    def expert_replica_ranks(self, rank: int) -> list[int]:
        """The replica ranks that hold the same experts as ``rank`` (the same place in their ep groups)."""
        replicas = self.axis_ranks(("dp_replicate", "dp_shard", "cp"), rank)
        return replicas[replicas.index(rank) % self.ep :: self.ep]

    def expert_shard_ranks(self, rank: int) -> list[int]:
        """The shard ranks (``dp_shard x cp``) that hold the same experts as ``rank``: where zero shards them."""
        shards = self.axis_ranks(("dp_shard", "cp"), rank)
        if len(shards) % self.ep:  # plain ddp-like replicas (no shard axis): each rank shards alone
            return [rank]
        return shards[shards.index(rank) % self.ep :: self.ep]

    def describe_ranks(self, limit: int = 16) -> str:
        """The mesh and the first ``limit`` ranks' coordinates, as ``phalanx config -n N`` and ``phalanx launch``
        print them."""
        sizes = ", ".join(f"{a}={s}" for a, s in zip(AXES, self.sizes))
        how = {"ring": "; cp by ring attention", "ulysses": "; cp by Ulysses (sp)"}[self.cp_kind] if self.cp > 1 else ""
        how += f"; ep={self.ep} within the data-parallel ranks" if self.ep > 1 else ""
        lines = [f"mesh ({sizes}) on {self.world} ranks; tp innermost{how}"]
        for r in range(min(self.world, limit)):
            c = self.coordinates(r)
            ep = f" ep={self.ep_ranks(r).index(r)}" if self.ep > 1 else ""
            lines.append(f"  rank {r}: " + " ".join(f"{a}={v}" for a, v in zip(AXES, c)) + ep)
        if self.world > limit:
            lines.append(f"  ... and {self.world - limit} more ranks")
        return "\n".join(lines)

    # ------------------------------------------------------------------ from settings
    @classmethod
    def of(cls, config: EngineConfig, world_size: int, origins: dict[str, str] | None = None) -> Mesh:
        """The mesh ``config`` asks for on ``world_size`` ranks, with unset sizes filled in.

        tp, cp and sp default to 1. Under the pipeline, ``pp_size`` defaults to what the other axes leave (one
        stage per rank without them). The data ranks left over go to ``dp_shard`` under the strategies that shard
        (zero1/2/3) and to ``dp_replicate`` otherwise; when one of the two is set, the other takes the rest."""
        origins = origins or {}
        par = config.options(ParallelOptions)
        tp, ring, uly = par.tp_size, par.cp_size, par.sp_size
        pipeline = accepts(config.strategy, PipelineOptions)
        pp_set = config.options(PipelineOptions).pp_size if pipeline else None
        sharding = shards(config.strategy)
        rep, shard = par.dp_replicate_size, par.dp_shard_size

        def said(key: str, value: object) -> str:
            return f"{key}={value} ({origins.get(key, 'default')})"

        def error(problem: str, fix: str) -> MeshError:
            keys: list[tuple[str, int | None]] = [("tp_size", tp), ("cp_size", ring), ("sp_size", uly)]
            keys += [("dp_shard_size", shard), ("dp_replicate_size", rep)]
            parts = [said(k, v) for k, v in keys if k in ("tp_size", "dp_shard_size") or k in origins or v != 1]
            if pipeline:
                parts.insert(0, said("pp_size", pp_set))
            return MeshError(
                f"the device mesh does not fit: {problem}; {', '.join(parts)}, world size {world_size} ({fix})"
            )

        if ring > 1 and uly > 1:
            raise error(
                f"cp_size={ring} (ring attention) and sp_size={uly} (Ulysses) both split the sequence, and phalanx "
                "uses one of them at a time",
                f"use cp_size={ring * uly} alone (any head count, causal), or sp_size={ring * uly} alone (heads "
                "divisible by it)",
            )
        cp, kind = (uly, "ulysses") if uly > 1 else (ring, "ring")
        if not sharding and shard is not None and shard > 1:
            raise error(
                f"dp_shard_size={shard} shards parameters or optimizer state over {shard} ranks, which strategy "
                f"{config.strategy!r} does not do",
                "use zero1, zero2 or zero3 to shard (dp_replicate_size x dp_shard_size is hybrid sharding), or set "
                "dp_replicate_size instead",
            )
        fixed = tp * cp * (rep or 1) * (shard or 1)
        if pipeline and pp_set is None:
            if world_size % fixed:
                raise error(
                    f"tp x cp x dp sizes = {fixed} do not divide the world", "launch a multiple of that many processes"
                )
            pp = world_size // fixed
        else:
            pp = pp_set if pipeline and pp_set is not None else 1
        rest, leftover = divmod(world_size, pp * fixed)
        if leftover or rest < 1:
            raise error(
                f"pp x dp_replicate x dp_shard x cp x tp = {pp * fixed} does not divide the world",
                f"launch a multiple of {pp * fixed} processes, or change the sizes so that their product divides "
                f"{world_size}",
            )
        if rep is None and shard is None:
            rep, shard = (1, rest) if sharding else (rest, 1)
        elif rep is None:
            rep = rest
        elif shard is None:
            shard = rest
        elif rest != 1:
            raise error(
                f"pp x dp_replicate x dp_shard x cp x tp = {pp * fixed} ranks, not the {world_size} launched",
                f"launch {pp * fixed} processes, or leave dp_replicate_size or dp_shard_size unset to take the rest",
            )
        assert rep is not None and shard is not None
        ep = par.ep_size
        if ep > 1 and (rep * shard * cp) % ep:
            raise error(
                f"ep_size={ep} ({origins.get('ep_size', 'default')}) does not divide the {rep * shard * cp} "
                "data-parallel ranks (dp_replicate x dp_shard x cp), out of which expert parallelism is carved",
                f"launch a multiple of {ep} data-parallel ranks, or use an ep_size that divides {rep * shard * cp}",
            )
        if ep > 1 and sharding and rep > 1 and (shard * cp) % ep:
            raise error(
                f"ep_size={ep} ({origins.get('ep_size', 'default')}) does not divide dp_shard x cp = {shard * cp}: "
                "under hybrid sharding the experts' ranks lie within one replica",
                f"use an ep_size that divides {shard * cp}, or leave dp_replicate_size unset",
            )
        return cls(world_size, pp, rep, shard, cp, tp, kind, ep)


def _index(axis: str) -> int:
    if axis not in AXES:
        raise MeshError(f"unknown mesh axis {axis!r}; the axes are {', '.join(AXES)}")
    return AXES.index(axis)
