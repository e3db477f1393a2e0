"""Which positions of a sequence each rank holds under context parallelism.

Ring attention (``cp``) is causal: a query attends only to the keys before it, so a plain split into cp contiguous
slices would give the last rank cp times the work of the first. The sequence is therefore cut into ``2 * cp`` equal
chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (the zig-zag layout of Megatron-CP and torchtitan's
load-balanced ring), one early and one late, so every rank has the same number of query-key pairs.

Ulysses (``sp``) is not position-dependent (it attends over the whole sequence after its all-to-all), so rank ``r``
holds the contiguous slice ``r``.

The local sequence of a rank is its chunks concatenated in this order; :func:`positions` gives their global indices,
which become ``position_ids`` and index the whole-sequence tensors (labels, padding masks) that every rank of the
group holds before the cut.
"""

from __future__ import annotations

import torch

__all__ = ["LayoutError", "chunks", "multiple", "positions"]


class LayoutError(ValueError):
    """A sequence cannot be laid out over the context-parallel ranks as asked."""


def multiple(kind: str, size: int) -> int:
    """The sequence length must be a multiple of this: ``2 * cp`` chunks for the ring, ``sp`` slices for Ulysses."""
    if kind not in ("ring", "ulysses"):
        raise LayoutError(f"unknown context-parallel kind {kind!r}; expected 'ring' or 'ulysses'")
    return 2 * size if kind == "ring" else size


def chunks(kind: str, size: int, rank: int) -> tuple[int, ...]:
    """The chunk indices rank ``rank`` holds, in local order (each chunk is ``seq_len // multiple(kind, size)``)."""
    if not 0 <= rank < size:
        raise LayoutError(f"rank {rank} is outside a context-parallel group of {size}")
    return (rank, 2 * size - 1 - rank) if kind == "ring" else (rank,)


def positions(kind: str, size: int, rank: int, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions rank ``rank`` holds of a sequence of ``seq_len``, in local order (int64)."""
    m = multiple(kind, size)
    if seq_len % m:
        raise LayoutError(
            f"a sequence of {seq_len} tokens cannot be cut into {m} equal chunks for {kind} over {size} ranks "
            f"(pad it to a multiple of {m}; the prepared loader does this itself)"
        )
    n = seq_len // m
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in chunks(kind, size, rank)])
