"""The process groups of a device mesh, and this rank's place in it.

The sizes, their check and the rank arithmetic belong to :class:`~phalanx.config.mesh.Mesh`; this module only
builds the groups (``dist.new_group``, by every rank in one order) and names this rank's coordinates. Built once by
the Engine and passed explicitly to whatever needs it.

The groups, each None when its axes have size 1 (code looks at the size first):

- ``tp_group``, ``pp_group``, ``cp_group``: one axis each;
- ``data_group`` (``dp_replicate x dp_shard``): the loader splits batches over it; every rank of a cp or tp group
  sees the same batch;
- ``dp_group`` (``dp_replicate x dp_shard x cp``): the ranks that hold the same parameters. Gradients are reduced
  over it, and ``dp_size`` is its size: without context parallelism it is the data group;
- ``dp_shard_group`` (``dp_shard x cp``) and ``dp_replicate_group``: zero shards over the first and, under hybrid
  sharding, reduces over the second. ``dp_shard_size`` is the size of that group.

Under expert parallelism (``mesh.ep > 1``), three more, carved out of the dp ranks (see ``config/mesh.py``):

- ``ep_group``: the ranks that hold different experts of each layer and exchange tokens by all-to-all;
- ``expert_dp_group`` (Megatron's expert-data-parallel group): the dp ranks that hold the same experts; expert
  gradients are reduced over it;
- ``expert_shard_group``: where zero shards the experts' state (the dp_shard x cp ranks with the same experts).

A group that spans the whole world is the default group (``dp_group`` is then None, as c10d spells it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from phalanx.config.mesh import Mesh, MeshError
from phalanx.runtime import nccl_rules

__all__ = ["Topology", "TopologyError"]

TopologyError = MeshError
"""The world cannot be laid out as asked (raised by :class:`~phalanx.config.mesh.Mesh`)."""

_DATA = ("dp_replicate", "dp_shard")
_REPLICAS = ("dp_replicate", "dp_shard", "cp")
_SHARDS = ("dp_shard", "cp")


@dataclass
class Topology:
    mesh: Mesh
    rank: int
    pp_stage: int = field(init=False)
    dp_replicate_rank: int = field(init=False)
    cp_rank: int = field(init=False)
    tp_rank: int = field(init=False)
    data_rank: int = field(init=False)
    """This rank's index among the data ranks: which slice of each batch it reads."""
    dp_rank: int = field(init=False)
    """This rank's index among the ranks that hold the same parameters (data ranks x cp)."""
    dp_shard_rank: int = field(init=False)
    """This rank's index among the ranks zero shards over (dp_shard x cp)."""
    data_group: Any = field(init=False, default=None, repr=False)
    dp_group: Any = field(init=False, default=None, repr=False)
    pp_group: Any = field(init=False, default=None, repr=False)
    cp_group: Any = field(init=False, default=None, repr=False)
    tp_group: Any = field(init=False, default=None, repr=False)
    dp_shard_group: Any = field(init=False, default=None, repr=False)
    dp_replicate_group: Any = field(init=False, default=None, repr=False)
    ep_rank: int = field(init=False)
    """This rank's place in its ep group: it holds experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``."""
    expert_dp_rank: int = field(init=False)
    expert_shard_rank: int = field(init=False)
    ep_group: Any = field(init=False, default=None, repr=False)
    expert_dp_group: Any = field(init=False, default=None, repr=False)
    expert_shard_group: Any = field(init=False, default=None, repr=False)
    groups_by_ranks: dict[tuple[int, ...], Any] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        m = self.mesh
        self.pp_stage, self.dp_replicate_rank, _, self.cp_rank, self.tp_rank = m.coordinates(self.rank)
        self.data_rank = m.axis_rank(_DATA, self.rank)
        self.dp_rank = m.axis_rank(_REPLICAS, self.rank)
        self.dp_shard_rank = m.axis_rank(_SHARDS, self.rank)
        self.ep_rank = m.ep_ranks(self.rank).index(self.rank)
        self.expert_dp_rank = m.expert_replica_ranks(self.rank).index(self.rank)
        self.expert_shard_rank = m.expert_shard_ranks(self.rank).index(self.rank)

    # ------------------------------------------------------------------ sizes, by the names strategies use
    @property
    def world_size(self) -> int:
        return self.mesh.world

    @property
    def pp_size(self) -> int:
        return self.mesh.pp

    @property
    def tp_size(self) -> int:
        return self.mesh.tp

    @property
    def cp_size(self) -> int:
        """The context-parallel degree, whichever method splits it (``mesh.cp_kind``)."""
        return self.mesh.cp

    @property
    def data_size(self) -> int:
        return self.mesh.dp

    @property
    def dp_size(self) -> int:
        return self.mesh.dp * self.mesh.cp

    @property
    def dp_replicate_size(self) -> int:
        return self.mesh.dp_replicate

    @property
    def dp_shard_size(self) -> int:
        return self.mesh.dp_shard * self.mesh.cp

    @property
    def ep_size(self) -> int:
        return self.mesh.ep

    @property
    def expert_dp_size(self) -> int:
        """The dp ranks that hold the same experts: ``dp_size / ep_size``."""
        return self.dp_size // self.mesh.ep

    @property
    def expert_shard_size(self) -> int:
        return len(self.mesh.expert_shard_ranks(self.rank))

    @property
    def sizes(self) -> tuple[int, int, int, int, int]:
        """(pp, dp_replicate, dp_shard, cp, tp)."""
        return self.mesh.sizes

    def coordinates(self, rank: int) -> tuple[int, int, int, int, int]:
        return self.mesh.coordinates(rank)

    def axis_ranks(self, axes: tuple[str, ...], rank: int | None = None) -> list[int]:
        """The ranks that share every coordinate of ``rank`` (default: this rank) but those of ``axes``, in order."""
        return self.mesh.axis_ranks(axes, self.rank if rank is None else rank)

    # ------------------------------------------------------------------ groups
    def _axis_groups(self, axes: tuple[str, ...]) -> Any:
        """Create the groups of ``axes`` (every rank creates every one, in rank order); return this rank's."""
        return self._groups(lambda r: self.mesh.axis_ranks(axes, r))

    def _groups(self, ranks_of: Any) -> Any:
        """Create the groups ``ranks_of(rank)`` names (every rank creates every one, in rank order); return this
        rank's, None when it is this rank alone or the whole world (the default group)."""
        size = len(ranks_of(self.rank))
        if size == 1:
            return None
        if size == self.world_size:
            return None  # the default group
        mine, seen = None, set()
        for r in range(self.world_size):
            ranks = tuple(ranks_of(r))
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
        m = self.mesh
        self.pp_group = self._axis_groups(("pp",))
        self.dp_group = self._axis_groups(_REPLICAS)
        self.data_group = self._axis_groups(_DATA) if m.cp > 1 else self.dp_group
        self.tp_group = self._axis_groups(("tp",))
        if m.tp == m.world:
            self.tp_group = dist.group.WORLD  # the layers always name their group
        self.cp_group = self._axis_groups(("cp",))
        if m.cp == m.world:
            self.cp_group = dist.group.WORLD  # attention always names its group
        if m.dp_replicate > 1 and self.dp_shard_size > 1:  # hybrid: the two data-parallel axes apart
            self.dp_shard_group = self._axis_groups(_SHARDS)
            self.dp_replicate_group = self._axis_groups(("dp_replicate",))
        elif m.dp_replicate > 1:
            self.dp_replicate_group = self.dp_group
        else:
            self.dp_shard_group = self.dp_group
        if m.ep > 1:
            self.ep_group = self._groups(m.ep_ranks)
            if m.ep == m.world:
                self.ep_group = dist.group.WORLD  # dispatch always names its group
            self.expert_dp_group = self._groups(m.expert_replica_ranks)
            self.expert_shard_group = self._groups(m.expert_shard_ranks)

    def data_cpu_group(self) -> Any:
        """The data ranks in a gloo group of their own, for small host-side exchanges that must not sync a device
        (a sharded stream's positions), declared a host group to ``nccl_rules``. Made on gloo too, so that a gloo run
        takes the path a NCCL run needs. Collective the first time: every rank must call it. None when this rank is
        its only data rank."""
        if "_data_cpu" in self.__dict__:
            return self.__dict__["_data_cpu"]
        mine: Any = None
        if dist.is_initialized() and self.world_size > 1 and self.data_size > 1:
            seen: set[tuple[int, ...]] = set()
            for r in range(self.world_size):  # every rank creates every group, in rank order
                ranks = tuple(self.mesh.axis_ranks(_DATA, r))
                if ranks not in seen:
                    seen.add(ranks)
                    made = dist.new_group(list(ranks), backend="gloo")
                    mine = made if self.rank in ranks else mine
            nccl_rules.host_group(mine)
        self.__dict__["_data_cpu"] = mine
        return mine

    def describe(self, limit: int = 16) -> str:
        """The mesh and every rank's coordinates, as ``phalanx config -n N`` and ``phalanx launch`` print them."""
        return self.mesh.describe_ranks(limit)
