"""Flat buffers that the zero strategies reuse: gathered units, gradient buffers, reduction landing slices.

zero3 gathers every unit twice a step and frees it twice; zero2 and zero3 fill a full-size gradient buffer for every
unit or bucket and drop it once reduced. Each such buffer was a fresh allocation: on the host, glibc serves a block
that it has seen freed from its heap, where it interleaves with small allocations, and the freed room stays in the
process. Measured on main before the pool (2 cores, gloo, 24 x Linear(1024) built on meta, AdamW, zero3): peak
resident memory 1.41-1.51x the prediction on 2 ranks and 1.45-1.91x on 4, growing step after step.

The pool keeps the blocks instead. ``take`` lends a block (the smallest free one that is large enough, else a new
one), ``give`` takes it back, and a block is lent again only when nothing else refers to its storage: a view kept
by autograd, a collective still holding its tensors (NCCL stashes them until the work is done) or the caller's own
variable makes the pool pass it over. So a block cannot be overwritten while anything can still read it; at worst
the pool grows by the blocks that something kept. The blocks a step needs are the same every step, so after the
first step the pool stops growing, within the plan's size (``memory_report``: ``pool_bytes`` beside
``comm_buffers``). zero2 keeps its two gradient buffers between steps too: measured, 20 MiB more held than
before the pool for the same resident peak (benchmarks/results/zero-pool.md).
"""

from __future__ import annotations

import torch

from phalanx.runtime.placement import LEDGER

__all__ = ["BufferPool"]


def _others(block: torch.Tensor) -> int:
    """How many tensors or storages other than ``block`` itself refer to its storage (the storage object made to
    ask is one more)."""
    return int(torch._C._storage_Use_Count(block.untyped_storage()._cdata)) - 2


class BufferPool:
    """Blocks of flat memory by (dtype, device), lent and given back (see the module's docstring)."""

    def __init__(self, what: str = "zero buffers") -> None:
        self.what = what
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}  # data pointer -> block
        self.nbytes = 0
        self.blocks = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements, uninitialised; give it back with :meth:`give`."""
        free = self._free.setdefault((dtype, device), [])
        best = None
        for i, b in enumerate(free):
            if b.numel() >= numel and (best is None or b.numel() < free[best].numel()) and _others(b) == 0:
                best = i
        if best is None:
            block = LEDGER.record(torch.empty(numel, dtype=dtype, device=device), self.what)
            self.nbytes += block.numel() * block.element_size()
            self.blocks += 1
        else:
            block = free.pop(best)
        self._lent[block.data_ptr()] = block
        return block[:numel]

    def give(self, t: torch.Tensor) -> None:
        """Take back the block ``t`` came from (a tensor :meth:`take` returned, or a view starting where it does).
        A tensor not from this pool is ignored. It is lent again once nothing else refers to it."""
        block = self._lent.pop(t.data_ptr(), None)
        if block is not None:
            self._free[(block.dtype, block.device)].append(block)
