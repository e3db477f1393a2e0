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

import json
import weakref
from typing import Any

import torch
from torch import nn

from phalanx.checkpoint.shards import ChunkSpec, ShardEntry, StateReader, read_chunk_into, read_into
from phalanx.runtime.comm import all_gather_bytes
from phalanx.runtime.topology import Topology

from .params import TPParam, tp_gather_full, tp_param_info

__all__ = ["TPCheckpointView", "chunk_of", "param_name"]


def param_name(key: str) -> str | None:
    """The parameter (or buffer) name of a state key: ``model/<name>`` or ``optim/<name>/<state>``."""
    kind, _, rest = key.partition("/")
    if kind == "model":
        return rest
    if kind == "optim":
        return rest.rpartition("/")[0]
    return None


def chunk_of(info: TPParam) -> ChunkSpec | None:
    """The chunk of the whole tensor that a parameter placed by ``info`` holds; None when it holds it whole."""
    if info.dim is None or info.parts == 1:
        return None
    return ChunkSpec(info.dim, info.parts, info.packed, info.index)


class TPCheckpointView:
    """``strategy``'s checkpoint methods in whole-tensor coordinates (see the module's docstring); the Engine passes
    it where it passes the strategy to ``save_checkpoint``, ``load_checkpoint``, ``load_weights`` and
    ``get_state_dict`` when ``tp_size > 1``."""

    def __init__(self, strategy: Any, topology: Topology) -> None:
        self.strategy = strategy
        self.topology = topology
        self._layouts: weakref.WeakKeyDictionary[nn.Module, dict[str, TPParam]] = weakref.WeakKeyDictionary()

    def __getattr__(self, name: str) -> Any:
        if name == "strategy":  # not set yet (unpickling): never recurse
            raise AttributeError(name)
        return getattr(self.strategy, name)

    # ------------------------------------------------------------------ layouts
    def layouts(self, model: nn.Module) -> dict[str, TPParam]:
        """Every parameter's :class:`TPParam` by the name the strategy saves it under. Under pipeline parallelism a
        collective the first time (the other stages' layouts come from their ranks); call it on every rank."""
        known = self._layouts.get(model)
        if known is not None:
            return known
        found: dict[str, TPParam] = {}
        for module in (model, self.strategy.unwrap_model(model)):
            for name, p in module.named_parameters():
                info = tp_param_info(p)
                if info is not None:
                    found.setdefault(name, info)
        if self.topology.pp_size > 1:
            mine = {n: [list(i.full_shape), i.dim, i.parts, i.packed, i.replicas] for n, i in found.items()}
            group = self.topology.pp_group  # the same tp rank in every stage
            for blob in all_gather_bytes(json.dumps(mine).encode(), self.strategy.device, group):
                for name, (shape, dim, parts, packed, replicas) in json.loads(blob).items():
                    if name not in found:  # another stage's: the chunk this tp rank holds there
                        index = 0 if dim is None else self.topology.tp_rank // replicas
                        found[name] = TPParam(tuple(shape), dim, index, parts, replicas, False, packed)
        self._layouts[model] = found
        return found

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

    def state_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """Whole shapes. Under pipeline parallelism a collective the first time (see :meth:`layouts`)."""
        layouts = self.layouts(model)
        out = {}
        for name, shape in self.strategy.state_shapes(model).items():
            info = layouts.get(name)
            out[name] = info.full_shape if info is not None and tuple(shape) == info.local_shape else tuple(shape)
        return out

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole state dict on every rank: the strategy's (whole over the data-parallel and pipeline ranks),
        each split tensor gathered over the tp group. A collective: every rank calls it."""
        state = self.strategy.full_state_dict(model)
        layouts = self.layouts(model)
        stored = self.strategy.state_dict_keys(model)
        device = self.strategy.device
        gathered: dict[str, torch.Tensor] = {}
        out = {}
        for key, value in state.items():
            name = stored.get(key, key)
            info = layouts.get(name)
            if info is None or chunk_of(info) is None or tuple(value.shape) != info.local_shape:
                out[key] = value
                continue
            if name not in gathered:  # a tied weight's second key: the same tensor, gathered once
                gathered[name] = tp_gather_full(value.to(device), info, self.topology.tp_group).to("cpu")
            out[key] = gathered[name]
        return out


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
