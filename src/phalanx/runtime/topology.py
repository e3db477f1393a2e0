"""The mesh of ranks: (pp, dp) sizes, this rank's coordinates, and the process group of each axis.

Built once by the Engine and passed explicitly to whatever needs it. Rank layout is pp-major:
``rank = pp_stage * dp_size + dp_rank``, so the ranks of one stage are contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

__all__ = ["Topology", "TopologyError"]


class TopologyError(ValueError):
    """The world cannot be laid out as asked."""


@dataclass
class Topology:
    world_size: int
    rank: int
    pp_size: int = 1
    dp_size: int = field(init=False)
    dp_rank: int = field(init=False)
    pp_stage: int = field(init=False)
    dp_group: Any = field(init=False, default=None, repr=False)
    """Process group of this rank's data-parallel replicas; None means the default (world) group."""
    pp_group: Any = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise TopologyError(f"world size must be >= 1; got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise TopologyError(f"rank must be in 0..{self.world_size - 1}; got {self.rank}")
        if self.pp_size < 1 or self.world_size % self.pp_size:
            raise TopologyError(
                f"world size {self.world_size} is not divisible by pp_size={self.pp_size}, so ranks cannot form "
                f"a (pp, dp) mesh (launch a multiple of {self.pp_size} processes, or change pp_size)"
            )
        self.dp_size = self.world_size // self.pp_size
        self.pp_stage, self.dp_rank = divmod(self.rank, self.dp_size)

    def build_groups(self, device_type: str) -> None:
        """Create the per-axis process groups. Collective: every rank must call it."""
        if self.pp_size == 1 or not dist.is_initialized():
            return  # dp spans the world: the default group already is the dp group
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (self.pp_size, self.dp_size), mesh_dim_names=("pp", "dp"))
        self.dp_group, self.pp_group = mesh.get_group("dp"), mesh.get_group("pp")
