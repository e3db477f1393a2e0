"""The flat-segment layout of the zero strategies.

Parameters are packed into flat *segments*: gradient buckets in reverse parameter order for zero1/zero2 (as
ddp's buckets), and one segment per unit and dtype for zero3. Each segment is padded to a multiple of the
data-parallel size N, and rank r owns the contiguous slice ``[r*s, (r+1)*s)`` of it (s = padded/N). The
model's parameters become views of the segment's ``full`` buffer; the optimizer steps fp32 *master* copies of
the rank's slice only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx.runtime.placement import LEDGER
from phalanx.strategies.expert_parallel.params import is_expert
from phalanx.strategies.zero.pool import BufferPool

if TYPE_CHECKING:
    from phalanx.strategies.zero.base import ModelState

__all__ = ["Segment", "by_dtype", "merge_runs", "padded_empty"]


class Segment:
    """A flat run of same-dtype parameters, padded to a multiple of N; this rank owns ``[lo, hi)`` of it."""

    def __init__(
        self,
        index: int,
        params: list[nn.Parameter],
        world: int,
        rank: int,
        device: torch.device | None = None,
        what: str = "segment",
        expert: bool = False,
    ) -> None:
        """``device``: where the segment lives, when not where ``params`` are (zero3 lays out a unit built on the
        host: its flat buffer is made there and placed on ``device`` whole, the only copy of the unit there)."""
        self.index = index
        self.params = params
        self.expert = expert  # experts (expert parallelism): sharded over the ranks that hold the same experts
        self.dtype = params[0].dtype
        self.device = params[0].device if device is None else device
        self.offsets: list[int] = []
        self.shapes = [p.shape for p in params]  # zero3 swaps in empty tensors while a unit is freed
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.padded = -(-offset // world) * world
        self.shard_numel = self.padded // world
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.trainable = [p.requires_grad for p in params]
        full = torch.zeros(self.padded, dtype=self.dtype, device=params[0].device)
        with torch.no_grad():
            for i, p in enumerate(params):
                self.view_of(i, full).copy_(p.detach())
                p.data = self.view_of(i, full)  # the original storage is released as we go
        self.full = LEDGER.to_device(full, self.device, what=what)
        del full  # once the views below point at the device, the host copy goes
        self.attach_views()
        # Set by the strategy:
        self.master: torch.Tensor | None = None  # fp32 slice the optimizer steps (None: nothing trainable)
        self.master_is_full_slice = False  # master is a view of full[lo:hi] (zero1/2, fp32, no offload)
        self.master_grad: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []  # zero1: each parameter's .grad, a view into grad_full
        self.shard_param: torch.Tensor | None = None  # zero3: the at-rest slice in the parameters' dtype
        self.pending = 0
        self.ready: list[bool] = []
        self.owner: ModelState | None = None
        self.work: Any = None
        self.work_out: torch.Tensor | None = None
        self.lent: list[torch.Tensor] = []  # pool buffers of the reduction in flight, given back when it is finished

    @property
    def has_trainable(self) -> bool:
        return any(self.trainable)

    def view_of(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        shape, o = self.shapes[i], self.offsets[i]
        return flat[o : o + shape.numel()].view(shape)

    def attach_views(self) -> None:
        for i, p in enumerate(self.params):
            p.data = self.view_of(i, self.full)
        self.pointers = [p.data_ptr() for p in self.params]

    def param_runs(self, a: int, b: int) -> Iterator[tuple[int, int, int, int, int]]:
        """For shard range ``[a, b)``: (param index, start, stop in the flattened param, start, stop in the shard)."""
        for i, o in enumerate(self.offsets):
            ga, gb = max(o, self.lo + a), min(o + self.shapes[i].numel(), self.lo + b)
            if ga < gb:
                yield i, ga - o, gb - o, ga - self.lo, gb - self.lo

    def local_runs(self, params: set[nn.Parameter] | None = None) -> list[tuple[int, int, int]]:
        """(param index, start, stop) in shard coordinates for each trainable parameter's part of this slice."""
        runs = []
        for i, (p, o) in enumerate(zip(self.params, self.offsets)):
            if not self.trainable[i] or (params is not None and p not in params):
                continue
            a, b = max(o, self.lo), min(o + self.shapes[i].numel(), self.hi)
            if a < b:
                runs.append((i, a - self.lo, b - self.lo))
        return runs


def padded_empty(seg: Segment, pool: BufferPool | None = None) -> torch.Tensor:
    """A full-size gradient buffer whose padding is zero, from ``pool`` when given; every parameter's view is written
    before use."""
    flat = (
        torch.empty(seg.padded, dtype=seg.dtype, device=seg.device)
        if pool is None
        else pool.take(seg.padded, seg.dtype, seg.device)
    )
    flat[seg.numel :].zero_()
    return flat


def by_dtype(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` grouped by (dtype, device, expert or not, trainable or frozen), in order: one zero3 segment each.
    A frozen segment has no fp32 master, gradient slice or optimizer state: only its shard, as the rest."""
    groups: dict[tuple[torch.dtype, torch.device, bool, bool], list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device, is_expert(p), p.requires_grad), []).append(p)
    return list(groups.values())


def merge_runs(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Adjacent (index, start, stop) runs joined into one, so that an optimizer piece spans parameters."""
    merged: list[tuple[int, int, int]] = []
    for i, a, b in runs:
        if merged and merged[-1][2] == a:
            merged[-1] = (merged[-1][0], merged[-1][1], b)
        else:
            merged.append((i, a, b))
    return merged
