"""The neutral exchange of training state between the strategies and checkpoints.

A strategy gives its rank's share of the model and optimizer state as :class:`ShardEntry` slices keyed by
parameter name (``sharded_state``), and takes it back from any :class:`StateReader` (``load_sharded_state``),
whatever strategy and world size wrote it. Neither ``state.py`` nor the strategies need the other for
these types: both import them from here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

__all__ = [
    "ChunkSpec", "ShardEntry", "StateReader", "chunk_segments", "read_chunk_into", "read_into", "read_new",
    "read_optimizer_state", "balanced_slices", "whole_entry", "named_tensors", "keys_by_param", "load_whole_tensors",
]  # fmt: skip


class ChunkSpec(NamedTuple):
    """Chunk ``part`` of a whole tensor cut along ``dim`` (a tensor-parallel rank's piece of it): along ``dim`` the
    tensor is read as ``packed`` equal blocks (3 for a fused ``[q; k; v]``), each cut into ``parts`` equal chunks
    (``torch.chunk`` order), and the chunk is the ``part``-th chunk of every block, concatenated in block order. Its
    shape is the whole shape with ``dim`` divided by ``parts``; its elements are flattened in that shape."""

    dim: int
    parts: int
    packed: int
    part: int

    def shape(self, whole: tuple[int, ...]) -> tuple[int, ...]:
        out = list(whole)
        out[self.dim] //= self.parts
        return tuple(out)

    def fits(self, whole: tuple[int, ...]) -> bool:
        """Whether this is a chunk of a tensor of shape ``whole`` (the dim exists and divides evenly)."""
        return (
            0 <= self.dim < len(whole)
            and min(self.parts, self.packed) >= 1
            and 0 <= self.part < self.parts
            and whole[self.dim] % (self.parts * self.packed) == 0
        )


class ShardEntry(NamedTuple):
    """One rank's slice of one tensor of the training state, in a layout that does not depend on the strategy.

    ``key`` is ``model/<parameter or buffer name>`` or ``optim/<parameter name>/<state name>`` (e.g.
    ``exp_avg``, ``step``); ``data`` holds elements ``[start, stop)`` of the flattened tensor, whose whole
    shape is ``shape``. Together, the entries of every rank cover each tensor exactly once.

    ``data`` may be a view of live training state, on the training device: copy it before the next step
    changes it (a checkpoint writes it out at once, without a copy on the CPU).

    With ``chunk`` (tensor parallelism), ``shape`` is still the whole tensor's, and ``[start, stop)`` are elements of
    the flattened chunk ``chunk`` of it (:class:`ChunkSpec`): the entries then cover each chunk exactly once. One
    entry stays one run however the chunk lies in the whole tensor (a weight split along its last dim included).
    """

    key: str
    shape: tuple[int, ...]
    start: int
    stop: int
    data: torch.Tensor
    chunk: ChunkSpec | None = None


class StateReader(Protocol):
    """Where ``load_sharded_state`` reads from: a checkpoint on disk, or entries held in memory."""

    def keys(self) -> Iterable[str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key`` (possibly a view of the reader's memory).
        A reader may also have ``read_into(key, start, stop, out)`` and ``dtype(key)``: see :func:`read_into`."""
        ...


def read_into(reader: StateReader, key: str, start: int, stop: int, out: torch.Tensor) -> None:
    """Elements ``[start, stop)`` of ``key`` into the 1-D tensor ``out``: straight into its memory when the reader
    can (a checkpoint reads the file into it), else through ``read``."""
    direct = getattr(reader, "read_into", None)
    if direct is not None:
        direct(key, start, stop, out)
    else:
        out.copy_(reader.read(key, start, stop))


def chunk_segments(
    shape: tuple[int, ...], chunk: ChunkSpec | None, start: int, stop: int
) -> list[tuple[int, int, int]]:
    """Where elements ``[start, stop)`` of ``chunk`` of a tensor of ``shape`` (None: of the whole tensor) lie in the
    whole flattened tensor: ``(whole_start, offset from start, length)`` runs, contiguous in both, in increasing
    order of both. A chunk along dim 0 is one run; along a later dim, one run per row of the dims before it."""
    if stop <= start:
        return []
    if chunk is None or chunk.parts == 1:  # one chunk of one is the whole tensor, blocks and all
        return [(start, 0, stop - start)]
    inner = math.prod(shape[chunk.dim + 1 :])
    length = shape[chunk.dim]
    block = length // chunk.packed
    seg = block // chunk.parts * inner  # one contiguous piece of the chunk in the whole tensor
    per_outer = chunk.packed * seg
    out: list[tuple[int, int, int]] = []
    q = start
    while q < stop:
        o, r = divmod(q, per_outer)
        k, m = divmod(r, seg)
        n = min(seg - m, stop - q)
        whole = (o * length + k * block) * inner + chunk.part * seg + m
        if out and out[-1][0] + out[-1][2] == whole:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((whole, q - start, n))
        q += n
    return out


def read_chunk_into(
    reader: StateReader, key: str, chunk: ChunkSpec | None, start: int, stop: int, out: torch.Tensor
) -> None:
    """Elements ``[start, stop)`` of chunk ``chunk`` of ``key`` (None: of the whole tensor) into the 1-D ``out``,
    whatever layout the reader holds it in: a checkpoint reads its runs straight into ``out`` (one read per run when
    it was saved in the same chunks), any other reader is read run by run of the whole tensor."""
    direct = getattr(reader, "read_chunk_into", None)
    if direct is not None:
        direct(key, chunk, start, stop, out)
        return
    for whole, offset, n in chunk_segments(tuple(reader.shape(key)), chunk, start, stop):
        read_into(reader, key, whole, whole + n, out[offset : offset + n])


def read_new(reader: StateReader, key: str, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor ``key`` in new memory of its own on ``device`` (never aliasing the reader's), in ``dtype``
    (default: as saved)."""
    shape = tuple(reader.shape(key))
    n = math.prod(shape)
    saved_dtype = getattr(reader, "dtype", None)
    if saved_dtype is None:
        return reader.read(key, 0, n).reshape(shape).to(device=device, dtype=dtype, copy=True)
    out = torch.empty(n, dtype=dtype or saved_dtype(key), device=device)
    read_into(reader, key, 0, n, out)
    return out.view(shape)


def read_optimizer_state(reader: StateReader, key: str, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Optimizer state ``key`` (``optim/<name>/<state>``) for ``param``, placed as torch's ``Optimizer.load_state_dict``
    places it: ``step`` on the CPU (on the parameter's device for fused or capturable optimizers), floating state in
    the parameter's dtype on its device (a zero checkpoint's fp32 moments onto bf16 parameters), the rest on its
    device as saved."""
    if key.rpartition("/")[2] == "step":
        on_device = bool(group.get("fused") or group.get("capturable"))
        return read_new(reader, key, param.device if on_device else torch.device("cpu"))
    saved = getattr(reader, "dtype", None)
    floating = saved(key).is_floating_point if saved is not None else reader.read(key, 0, 0).is_floating_point()
    return read_new(reader, key, param.device, param.dtype if floating else None)


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (each tied one once, under its first name) and buffers."""
    return list(model.named_parameters()) + list(model.named_buffers())


def balanced_slices(tensors: list[tuple[str, torch.Tensor]], rank: int, n: int) -> list[ShardEntry]:
    """Rank ``rank``'s share when the tensors are laid end to end and cut into ``n`` runs of equal bytes: each
    element goes to the rank whose run holds its first byte, so every element is given exactly once. Replicas use
    it so that a save writes in parallel although every one of them holds everything."""
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    lo, hi = total * rank // n, total * (rank + 1) // n
    out, pos = [], 0
    for key, t in tensors:
        size, numel = t.element_size(), t.numel()
        a = min(numel, max(0, -(-(lo - pos) // size)))
        b = min(numel, max(0, -(-(hi - pos) // size)))
        if a < b or (numel == 0 and rank == 0):  # an empty tensor is still listed, by rank 0
            out.append(ShardEntry(key, tuple(t.shape), a, b, t.detach().reshape(-1)[a:b]))
        pos += numel * size
    return out


def whole_entry(key: str, t: torch.Tensor) -> ShardEntry:
    return ShardEntry(key, tuple(t.shape), 0, t.numel(), t.detach().reshape(-1))


def _read_whole(reader: StateReader, key: str) -> torch.Tensor:
    shape = reader.shape(key)
    return reader.read(key, 0, math.prod(shape)).reshape(shape)


def keys_by_param(reader: StateReader) -> dict[str, list[str]]:
    """``optim/<name>/<state>`` keys grouped as {name: [state, ...]}."""
    out: dict[str, list[str]] = {}
    for key in reader.keys():
        if key.startswith("optim/"):
            name, _, state = key[len("optim/") :].rpartition("/")
            out.setdefault(name, []).append(state)
    return out


def load_whole_tensors(model: nn.Module, reader: StateReader, skip: set[Any] | None = None) -> None:
    """Copy whole parameters and buffers from ``reader``; the error lists what is missing or mis-shaped."""
    problems = []
    wanted = [(n, t) for n, t in named_tensors(model) if skip is None or t not in skip]
    available = set(reader.keys())
    for name, t in wanted:
        key = f"model/{name}"
        if key not in available:
            problems.append(f"{name}: not in the checkpoint")
        elif tuple(reader.shape(key)) != tuple(t.shape):
            problems.append(
                f"{name}: shape {tuple(reader.shape(key))} in the checkpoint, {tuple(t.shape)} in the model"
            )
    if problems:
        raise ValueError("the checkpoint does not match the model: " + "; ".join(problems[:5]))
    with torch.no_grad():
        for name, t in wanted:
            if t.is_contiguous():
                read_into(reader, f"model/{name}", 0, t.numel(), t.view(-1))
            else:
                t.copy_(_read_whole(reader, f"model/{name}"))
