"""Thin collective helpers over c10d, and a byte counter that tests use to check traffic against theory."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.collective_log import watched
from phalanx.runtime.nccl_rules import from_wire, to_wire

__all__ = [
    "CommStats",
    "REDUCE_OPS",
    "all_reduce",
    "broadcast_coalesced",
    "all_gather_varlen",
    "all_gather_bytes",
    "world_size",
]

REDUCE_OPS = ("sum", "mean", "max", "min")


# Bytes each rank sends in the bandwidth-optimal (ring) algorithm, per byte of the full-size buffer:
# an all-reduce is a reduce-scatter followed by an all-gather.
_RING_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}


class CommStats:
    """What this rank handed to each kind of collective.

    ``bytes`` are payload sizes (for reduce-scatter the full input, for all-gather the full output);
    ``wire_bytes`` are what each rank sends in a ring algorithm over N ranks (all-reduce 2S(N-1)/N,
    reduce-scatter and all-gather S(N-1)/N), the unit the ZeRO paper counts traffic in.
    """

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.wire_bytes: dict[str, float] = defaultdict(float)

    def record(self, op: str, tensor: torch.Tensor, world_size: int | None = None) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes[op] += nbytes
        self.calls[op] += 1
        if world_size is not None and op in _RING_FACTOR:
            self.wire_bytes[op] += _RING_FACTOR[op] * nbytes * (world_size - 1) / world_size

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.wire_bytes.clear()


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce(
    tensor: torch.Tensor, op: str = "sum", group: Any = None, stats: CommStats | None = None, async_op: bool = False
) -> Any:
    """In-place all-reduce with ``op`` in :data:`REDUCE_OPS`; ``mean`` divides after a sum (gloo has no AVG)."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; valid ops: {', '.join(REDUCE_OPS)}")
    n = world_size(group)
    if n == 1:
        return None
    if stats is not None:
        stats.record("all_reduce", tensor, n)
    c10d_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[
        op
    ]
    work = watched(dist.all_reduce, tensor, op=c10d_op, group=group, async_op=async_op)
    if op == "mean":
        assert not async_op, "mean all-reduce divides after the wait; call it synchronously"
        tensor.div_(n)
    return work


COALESCE_BYTES = 32 * 2**20
"""The most bytes :func:`broadcast_coalesced` copies into one flat buffer."""


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    src: int = 0,
    group: Any = None,
    stats: CommStats | None = None,
    device: torch.device | None = None,
) -> None:
    """Broadcast many tensors as flat buffers per dtype of at most ``COALESCE_BYTES`` each (a larger tensor alone):
    a few collectives instead of one per tensor, and a copy of at most one buffer at a time, not of the whole model
    (a mostly frozen model's weights are all broadcast here). ``device``: where the buffer travels from (the
    collective's device, e.g. CUDA under NCCL for tensors on the host)."""
    if world_size(group) == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[list[torch.Tensor]]] = defaultdict(lambda: [[]])
    filled: dict[torch.dtype, int] = defaultdict(int)
    for t in tensors:
        size = t.numel() * t.element_size()
        if by_dtype[t.dtype][-1] and filled[t.dtype] + size > COALESCE_BYTES:
            by_dtype[t.dtype].append([])
            filled[t.dtype] = 0
        by_dtype[t.dtype][-1].append(t)
        filled[t.dtype] += size
    for dtype, group_tensors in ((d, b) for d, buckets in by_dtype.items() for b in buckets):
        flat = to_wire(torch.cat([t.detach().reshape(-1) for t in group_tensors]))  # int16 buffers: NCCL has none
        if device is not None:
            flat = flat.to(device)
        if stats is not None:
            stats.record("broadcast", flat)
        watched(dist.broadcast, flat, src=src, group=group)
        flat = from_wire(flat, dtype)
        offset = 0
        with torch.no_grad():
            for t in group_tensors:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
        del flat  # before the next buffer is made: one at a time


def all_gather_varlen(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-gather tensors whose first dimension may differ by rank; returns them concatenated in rank order."""
    n = world_size(group)
    if n == 1:
        return tensor
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    dtype = tensor.dtype
    tensor = to_wire(tensor)  # int16 labels: NCCL has no int16
    length = torch.tensor([tensor.shape[0]], dtype=torch.long, device=tensor.device)
    lengths = [torch.zeros_like(length) for _ in range(n)]
    watched(dist.all_gather, lengths, length, group=group)
    sizes = torch.cat(lengths).tolist()  # one copy to the host, not one per rank
    longest = max(sizes)
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        tensor = torch.cat([tensor, pad])
    out = [torch.empty_like(tensor) for _ in range(n)]
    watched(dist.all_gather, out, tensor.contiguous(), group=group)
    return from_wire(torch.cat([t[:s] for t, s in zip(out, sizes)]), dtype)


def all_gather_bytes(data: bytes, device: torch.device, group: Any = None) -> list[bytes]:
    """Every rank's ``data``, in rank order. Carries JSON between ranks as plain bytes (nothing is pickled)."""
    if world_size(group) == 1:
        return [data]
    n = world_size(group)
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    length = torch.tensor([mine.numel()], dtype=torch.long, device=device)
    lengths = [torch.zeros_like(length) for _ in range(n)]
    watched(dist.all_gather, lengths, length, group=group)
    sizes = torch.cat(lengths).tolist()
    padded = torch.zeros(max(max(sizes), 1), dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine.to(device)
    out = [torch.empty_like(padded) for _ in range(n)]
    watched(dist.all_gather, out, padded, group=group)
    return [t[:size].cpu().numpy().tobytes() for t, size in zip(out, sizes)]
