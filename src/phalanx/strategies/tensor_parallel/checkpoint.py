"""Checkpoints of a tensor-parallel model in whole-tensor terms, so that one saved on any layout loads on any other.

Under tensor parallelism the data-parallel strategy (ddp, zero, pipeline) works on each tp rank's local pieces: its
``sharded_state`` keys them by their usual names with their local shapes. :class:`TPCheckpointView` wraps the
strategy and presents that state as the checkpoint format knows it, with no notion of tp:

- saving, a split piece becomes a run of the whole tensor's chunk (``ShardEntry.chunk``, a :class:`ChunkSpec`: the
  dim, the parts, the packed blocks and which chunk; one run however the chunk lies in the whole tensor); a piece
  held by several tp ranks (replicated parameters, replicated kv heads) is written by its first holder only
  (``TPParam.writer``), buffers and scalar optimizer state (``step``) by tp rank 0;
- loading, the strategy reads through a reader that shows each split tensor at its local shape and reads this rank's
  chunk of it, whatever layout saved it (whole tensors without tp, other chunks under another tp size): each rank
  reads only what it holds;
- ``state_shapes`` gives whole shapes (checked against the checkpoint's), and ``full_state_dict`` gathers every
  split tensor over the tp group.

Everything else is the wrapped strategy's (``__getattr__``). Under pipeline parallelism the other stages' tensors
have no ``TPParam`` on this rank: their layouts are exchanged once (a collective) at the first call that needs them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.checkpoint.shards import ChunkSpec, ShardEntry, StateReader, read_chunk_into, read_into
from phalanx.strategies._views import PieceView, param_name

from .params import TPParam, tp_gather_full, tp_param_info

__all__ = ["TPCheckpointView", "chunk_of", "param_name"]


def chunk_of(info: TPParam) -> ChunkSpec | None:
    """The chunk of the whole tensor that a parameter placed by ``info`` holds; None when it holds it whole."""
    if info.dim is None or info.parts == 1:
        return None
    return ChunkSpec(info.dim, info.parts, info.packed, info.index)


class TPCheckpointView(PieceView):
    """``strategy``'s checkpoint methods in whole-tensor coordinates (see the module's docstring); the Engine passes
    it where it passes the strategy to ``save_checkpoint``, ``load_checkpoint``, ``load_weights`` and
    ``get_state_dict`` when ``tp_size > 1``."""

    def info_of(self, p: torch.Tensor) -> TPParam | None:
        return tp_param_info(p)

    def encode(self, info: TPParam) -> list[Any]:
        return [list(info.full_shape), info.dim, info.parts, info.packed, info.replicas]

    def decode(self, data: list[Any]) -> TPParam:
        shape, dim, parts, packed, replicas = data
        index = 0 if dim is None else self.topology.tp_rank // replicas  # the chunk this tp rank holds there
        return TPParam(tuple(shape), dim, index, parts, replicas, False, packed)

    def gather(self, local: torch.Tensor, info: TPParam, name: str) -> torch.Tensor | None:
        return None if chunk_of(info) is None else tp_gather_full(local, info, self.topology.tp_group)

    # ------------------------------------------------------------------ the Strategy checkpoint methods
    def sharded_state(self, model: nn.Module, optimizers: Any = None) -> list[ShardEntry]:
        """The strategy's entries of this tp rank's pieces, as runs of whole tensors (or of their chunks), each piece
        given by one holder only. A collective, as the strategy's."""
        entries = self.strategy.sharded_state(model, optimizers)
        layouts = self.layouts(model)
        tp_rank = self.topology.tp_rank
        out = []
        for e in entries:
            name = param_name(e.key)
            info = layouts.get(name) if name is not None else None
            if info is None:  # buffers, and anything else every tp rank holds whole
                if tp_rank == 0:
                    out.append(e)
            elif tuple(e.shape) == info.local_shape:  # the parameter, or optimizer state shaped like it
                if info.writer(tp_rank):
                    out.append(e._replace(shape=info.full_shape, chunk=chunk_of(info)))
            elif tuple(e.shape) == ():  # per-parameter scalars (step): alike on every tp rank
                if tp_rank == 0:
                    out.append(e)
            else:
                raise ValueError(
                    f"{e.key} has shape {tuple(e.shape)}, and its parameter's piece on this tp rank "
                    f"{info.local_shape}: a tensor-parallel checkpoint holds optimizer state shaped like its "
                    "parameter, or scalars (an optimizer with factored state, such as Adafactor's, cannot be saved "
                    "under tp_size > 1)"
                )
        return out

    def load_sharded_state(self, model: nn.Module, optimizers: Any, reader: StateReader) -> None:
        """The strategy loads this tp rank's pieces from ``reader``, whatever layout wrote it."""
        self.strategy.load_sharded_state(model, optimizers, LocalReader(reader, self.layouts(model)))


class LocalReader:
    """A :class:`StateReader` that shows a tp rank's pieces: each split tensor (a parameter, or optimizer state
    shaped like it, saved at the whole shape) at its local shape, its elements read from this rank's chunk."""

    def __init__(self, reader: StateReader, layouts: dict[str, TPParam]) -> None:
        self.reader = reader
        self.chunks: dict[str, tuple[ChunkSpec, tuple[int, ...]]] = {}
        for key in reader.keys():
            name = param_name(key)
            info = layouts.get(name) if name is not None else None
            chunk = chunk_of(info) if info is not None else None
            if info is not None and chunk is not None and tuple(reader.shape(key)) == info.full_shape:
                self.chunks[key] = (chunk, info.local_shape)

    def keys(self) -> Any:
        return self.reader.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        held = self.chunks.get(key)
        return held[1] if held is not None else tuple(self.reader.shape(key))

    def dtype(self, key: str) -> torch.dtype:
        saved = getattr(self.reader, "dtype", None)
        return saved(key) if saved is not None else self.reader.read(key, 0, 0).dtype

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        if key not in self.chunks:
            return self.reader.read(key, start, stop)
        out = torch.empty(stop - start, dtype=self.dtype(key))
        read_chunk_into(self.reader, key, self.chunks[key][0], start, stop, out)
        return out

    def read_into(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        if key in self.chunks:
            read_chunk_into(self.reader, key, self.chunks[key][0], start, stop, out)
        else:
            read_into(self.reader, key, start, stop, out)
