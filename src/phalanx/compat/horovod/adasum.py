"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021), on c10d.

Two gradients ``a`` and ``b`` combine as ``(1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b``: orthogonal ones add
(nothing in common is counted twice), equal ones average, and anything between is in between, whatever their scale.
More ranks combine as a tree in rank order: neighbours pair at each level ((0, 1), (2, 3), ...), and a rank left
without a partner passes its vector up unchanged. Every rank gathers every rank's tensor and computes the same tree,
so every rank holds the same result (Horovod's recursive halving computes the same tree with less traffic; this one
trades bandwidth for simplicity). The dot products are taken in float64.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.collective_log import watched

__all__ = ["adasum_pair", "adasum_tree", "adasum_allreduce_"]


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The Adasum combination of two tensors of the same shape."""
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    dot, aa, bb = torch.dot(a64, b64), torch.dot(a64, a64), torch.dot(b64, b64)
    if aa == 0:
        return b.clone()
    if bb == 0:
        return a.clone()
    out = (1 - dot / (2 * aa)) * a64 + (1 - dot / (2 * bb)) * b64
    return out.reshape(a.shape).to(a.dtype)


def adasum_tree(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Combine ``tensors`` (one per rank, in rank order) level by level, as the module's docstring says."""
    level = list(tensors)
    while len(level) > 1:
        level = [
            adasum_pair(level[i], level[i + 1]) if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)
        ]
    return level[0]


def adasum_allreduce_(tensor: torch.Tensor, wire: torch.Tensor, group: Any = None, size: int | None = None) -> None:
    """Replace ``tensor`` with the Adasum of every rank's (of ``group``, ``size`` ranks); ``wire`` is ``tensor``
    where collectives can take it."""
    if not tensor.is_floating_point():
        raise ValueError(f"hvd.Adasum combines floating-point tensors; got {tensor.dtype} (use hvd.Sum)")
    parts = [torch.empty_like(wire) for _ in range(dist.get_world_size() if size is None else size)]
    watched(dist.all_gather, parts, wire.contiguous(), group=group, label="hvd.allreduce (Adasum)")
    tensor.copy_(adasum_tree(parts).to(tensor.device))
