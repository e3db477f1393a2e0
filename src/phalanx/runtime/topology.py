"""The device mesh: (pp, dp_replicate, dp_shard, tp) sizes, this rank's coordinates, and each axis's process group.

Built once by the Engine (sizes from ``config/mesh.py``) and passed explicitly to whatever needs it. tp is the
innermost axis, so the ranks of a tensor-parallel group are contiguous, then dp_shard, dp_replicate and pp:
``rank = ((pp_stage * dp_replicate + r) * dp_shard + s) * tp + t``. The data-parallel axes together form ``dp``
(``dp_rank = r * dp_shard + s``): the data loader splits batches over them, and every rank of a tp group sees the
same batch. Without tensor parallelism the layout is the pipeline's pp-major one, ``rank = pp_stage * dp_size +
dp_rank``.

The groups are made with ``dist.new_group`` by every rank in one order. An axis of size 1 has no group (None), and
code must look at its size first; ``dp_group`` is None when the data-parallel axes span the whole world (the
default group is then the dp group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = ["Topology", "TopologyError"]


class TopologyError(ValueError):
    """The world cannot be laid out as asked."""


_AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class Topology:
    world_size: int
    rank: int
    pp_size: int = 1
    tp_size: int = 1
    dp_replicate_size: int | None = None
    """Replicas of the data-parallel axes; default: what dp_shard_size leaves (1 when both are unset)."""
    dp_shard_size: int | None = None
    """Shards of each replica; default: the rest of the data-parallel ranks."""
    dp_size: int = field(init=False)
    dp_rank: int = field(init=False)
    pp_stage: int = field(init=False)
    tp_rank: int = field(init=False)
    dp_replicate_rank: int = field(init=False)
    dp_shard_rank: int = field(init=False)
    dp_group: Any = field(init=False, default=None, repr=False)
    """Process group of this rank's data-parallel peers (same stage, same tp rank); None means the world group."""
    pp_group: Any = field(init=False, default=None, repr=False)
    tp_group: Any = field(init=False, default=None, repr=False)
    dp_shard_group: Any = field(init=False, default=None, repr=False)
    dp_replicate_group: Any = field(init=False, default=None, repr=False)
    groups_by_ranks: dict[tuple[int, ...], Any] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise TopologyError(f"world size must be >= 1; got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise TopologyError(f"rank must be in 0..{self.world_size - 1}; got {self.rank}")
        fixed = self.pp_size * self.tp_size * (self.dp_replicate_size or 1) * (self.dp_shard_size or 1)
        if min(self.pp_size, self.tp_size, self.dp_replicate_size or 1, self.dp_shard_size or 1) < 1 or (
            self.world_size % fixed
        ):
            raise TopologyError(
                f"world size {self.world_size} is not divisible by pp_size={self.pp_size} x tp_size={self.tp_size} x "
                f"dp_replicate_size={self.dp_replicate_size} x dp_shard_size={self.dp_shard_size} = {fixed}, so "
                f"ranks cannot form the mesh (launch a multiple of {fixed} processes, or change the sizes)"
            )
        rest = self.world_size // fixed
        if self.dp_replicate_size is None and self.dp_shard_size is None:
            self.dp_replicate_size, self.dp_shard_size = 1, rest
        elif self.dp_shard_size is None:
            self.dp_shard_size = rest
        elif self.dp_replicate_size is None:
            self.dp_replicate_size = rest
        elif rest != 1:
            raise TopologyError(
                f"pp_size={self.pp_size} x dp_replicate_size={self.dp_replicate_size} x dp_shard_size="
                f"{self.dp_shard_size} x tp_size={self.tp_size} = {fixed} ranks, but the world has {self.world_size}"
            )
        assert self.dp_replicate_size is not None and self.dp_shard_size is not None
        self.dp_size = self.dp_replicate_size * self.dp_shard_size
        (self.pp_stage, self.dp_replicate_rank, self.dp_shard_rank, self.tp_rank) = self.coordinates(self.rank)
        self.dp_rank = self.dp_replicate_rank * self.dp_shard_size + self.dp_shard_rank

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """(pp, dp_replicate, dp_shard, tp)."""
        assert self.dp_replicate_size is not None and self.dp_shard_size is not None
        return (self.pp_size, self.dp_replicate_size, self.dp_shard_size, self.tp_size)

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(pp_stage, dp_replicate, dp_shard, tp) of ``rank``."""
        out = []
        for size in reversed(self.sizes):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))  # type: ignore[return-value]

    def rank_at(self, coords: tuple[int, int, int, int]) -> int:
        r = 0
        for c, size in zip(coords, self.sizes):
            r = r * size + c
        return r

    def axis_ranks(self, axes: tuple[str, ...], rank: int | None = None) -> list[int]:
        """The ranks that share every coordinate of ``rank`` (default: this rank) but those of ``axes``, in order."""
        base = list(self.coordinates(self.rank if rank is None else rank))
        idx = [_AXES.index(a) for a in axes]
        out = []

        def walk(k: int) -> None:
            if k == len(idx):
                out.append(self.rank_at(tuple(base)))  # type: ignore[arg-type]
                return
            for c in range(self.sizes[idx[k]]):
                base[idx[k]] = c
                walk(k + 1)

        walk(0)
        return sorted(out)

    def _axis_groups(self, axes: tuple[str, ...]) -> Any:
        """Create the groups of ``axes`` (every rank creates every one, in rank order); return this rank's."""
        size = 1
        for a in axes:
            size *= self.sizes[_AXES.index(a)]
        if size == 1:
            return None
        if size == self.world_size:
            return None  # the default group
        mine, seen = None, set()
        for r in range(self.world_size):
            ranks = tuple(self.axis_ranks(axes, r))
            if ranks in seen:
                continue
            seen.add(ranks)
            group = self.groups_by_ranks.get(ranks)
            if group is None:
                group = self.groups_by_ranks[ranks] = dist.new_group(list(ranks))
            if self.rank in ranks:
                mine = group
        return mine

    def build_groups(self, device_type: str) -> None:
        """Create the per-axis process groups. Collective: every rank must call it."""
        if not dist.is_initialized() or self.world_size == 1:
            return
        self.pp_group = self._axis_groups(("pp",))
        self.dp_group = self._axis_groups(("dp_replicate", "dp_shard"))
        self.tp_group = self._axis_groups(("tp",))
        if self.tp_size == self.world_size:
            self.tp_group = dist.group.WORLD  # the layers always name their group
        if self.dp_replicate_size != self.dp_size:  # hybrid: the two data-parallel axes apart
            self.dp_shard_group = self._axis_groups(("dp_shard",))
            self.dp_replicate_group = self._axis_groups(("dp_replicate",))
        else:
            self.dp_replicate_group = self.dp_group
        if self.dp_shard_size == self.dp_size:
            self.dp_shard_group = self.dp_group

    def describe(self) -> str:
        """The mesh and every rank's coordinates, as ``phalanx config -n N`` and ``phalanx launch`` print them."""
        sizes = ", ".join(f"{a}={s}" for a, s in zip(_AXES, self.sizes))
        lines = [f"mesh ({sizes}) on {self.world_size} ranks; tp innermost"]
        for r in range(self.world_size):
            c = self.coordinates(r)
            lines.append(f"  rank {r}: " + " ".join(f"{a}={v}" for a, v in zip(_AXES, c)))
        return "\n".join(lines)
