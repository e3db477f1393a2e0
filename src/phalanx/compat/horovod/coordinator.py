"""Horovod's coordinator check, on c10d: before each tensor operation, every rank compares what it is about to do.

Horovod's coordinator refuses an operation whose ranks disagree on the dtype, the shape, the root rank, the reduce op
or the scale factors, and every rank raises. c10d does not look: an int32 tensor reduced with a float32 one returns
reinterpreted bits, a broadcast into another shape mixes the two ranks' data, and different sizes abort gloo. So each
``hvd`` operation is preceded by one small all-reduce of its description (a few integers, MAX of the values and of
their negatives, which says at once whether every rank sent the same). When they differ, the ranks exchange their
descriptions and all raise the same :class:`HorovodMismatchError`, naming each rank's call, before any bytes of the
tensor move. The cost is one all-reduce of 32 integers per operation; the gradients of ``DistributedOptimizer`` go
through phalanx's reducer, which is consistent by construction, and are not checked one by one.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.collective_log import watched

__all__ = ["HorovodMismatchError", "agree"]

CHECKS = True
"""Always on, as in Horovod; benchmarks/bench_horovod_checks.py turns it off to measure what the checks cost."""

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip
_DIMS = 8  # shape dimensions compared one by one; deeper ones are folded into one number
_KINDS = ("hvd.allreduce", "hvd.allgather", "hvd.broadcast", "hvd.alltoall", "hvd.reducescatter")


class HorovodMismatchError(RuntimeError, ValueError):
    """The ranks called one Horovod operation with different dtypes, shapes, root ranks, ops or scale factors.

    A ``RuntimeError``, as Horovod raises it (and a ``ValueError``, as earlier phalanx versions raised some)."""


def _bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def _describe(kind: str, tensor: torch.Tensor, root: int | None, op: Any, scales: tuple[float, float]) -> str:
    text = f"{kind} with dtype {str(tensor.dtype).removeprefix('torch.')}, shape {tuple(tensor.shape)}"
    if op is not None:
        text += f", op {getattr(op, 'name', op)}"
    if root is not None:
        text += f", root rank {root}"
    if scales != (1.0, 1.0):
        text += f", prescale {scales[0]:g}, postscale {scales[1]:g}"
    return text


def agree(
    kind: str,
    tensor: torch.Tensor,
    *,
    root: int | None = None,
    op: Any = None,
    scales: tuple[float, float] = (1.0, 1.0),
    first_dim_may_differ: bool = False,
) -> None:
    """Every rank's call of ``kind`` must match this one; raises :class:`HorovodMismatchError` on every rank if not.

    Call it on every rank, before the collective, in a distributed world."""
    if not CHECKS:
        return
    shape = list(tensor.shape)
    if first_dim_may_differ and shape:
        shape[0] = 0
    dims = shape[:_DIMS] + [-1] * max(0, _DIMS - len(shape))
    if len(shape) > _DIMS:
        dims[-1] = zlib.crc32(repr(shape[_DIMS - 1 :]).encode())
    dtype = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else 100 + zlib.crc32(str(tensor.dtype).encode())
    ops = -1 if op is None else zlib.crc32(str(getattr(op, "name", op)).encode())
    mine = [_KINDS.index(kind), dtype, ops, -2 if root is None else root, len(shape), *dims, *map(_bits, scales)]
    values = torch.tensor(mine + [-v for v in mine], dtype=torch.int64)
    watched(dist.all_reduce, values, op=dist.ReduceOp.MAX, label=f"{kind} check")
    n = len(mine)
    if torch.equal(values[:n], -values[n:]):  # the largest equals the smallest: every rank sent the same
        return
    calls: list[Any] = [None] * dist.get_world_size()
    watched(dist.all_gather_object, calls, _describe(kind, tensor, root, op, scales), label=f"{kind} mismatch")
    lines = "\n".join(f"  rank {r}: {c}" for r, c in enumerate(calls))
    raise HorovodMismatchError(
        f"{kind}: the ranks called it with different arguments, and Horovod refuses that too (nothing was "
        f"exchanged):\n{lines}\nEvery rank must pass a tensor of the same dtype and shape"
        + (" (the first dimension may differ for allgather)" if first_dim_may_differ else "")
        + ", the same op and the same root rank"
    )
