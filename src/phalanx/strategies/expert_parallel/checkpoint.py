"""Checkpoints of an expert-parallel model hold whole expert tensors, so that any layout loads on any other.

Each ep rank holds experts ``[r * E/ep, (r + 1) * E/ep)`` of every experts weight: dim 0 is the outermost, so its
piece is the contiguous run ``[r * n, (r + 1) * n)`` of the whole flattened tensor (n = the piece's numel). The
data-parallel strategy saves its pieces at their local shape; :class:`EPCheckpointView` wraps it and moves every
expert entry (a parameter, or optimizer state shaped like it) to the whole shape and its run; scalar state (``step``)
of an expert parameter is written by ep rank 0. Loading, the strategy reads through :class:`EPReader`, which shows
each whole expert tensor at the local shape, offset to this rank's run. ``full_state_dict`` all-gathers the experts
over the ep group.

Under tensor parallelism the tp view wraps this one (the tp piece of an expert weight is what ep cuts by expert).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.checkpoint.shards import ShardEntry, StateReader, read_into
from phalanx.runtime.collective_log import watched
from phalanx.strategies._views import PieceView, param_name

from .params import EPParam, ep_param_info

__all__ = ["EPCheckpointView", "EPReader"]


class EPCheckpointView(PieceView):
    """``strategy``'s checkpoint methods with whole expert tensors (see the module's docstring)."""

    def info_of(self, p: torch.Tensor) -> EPParam | None:
        return ep_param_info(p)

    def encode(self, info: EPParam) -> list[Any]:
        return [list(info.full_shape), info.parts]

    def decode(self, data: list[Any]) -> EPParam:
        shape, parts = data
        return EPParam(tuple(shape), parts, self.topology.ep_rank)

    def gather(self, local: torch.Tensor, info: EPParam, name: str) -> torch.Tensor:
        whole = local.new_empty(info.full_shape)
        watched(
            dist.all_gather_into_tensor, whole, local.contiguous(), group=self.topology.ep_group,
            label=f"ep gather {name}",
        )  # fmt: skip
        return whole

    def sharded_state(self, model: nn.Module, optimizers: Any = None) -> list[ShardEntry]:
        entries = self.strategy.sharded_state(model, optimizers)
        layouts = self.layouts(model)
        first = self.topology.ep_rank == 0
        out = []
        for e in entries:
            name = param_name(e.key)
            info = layouts.get(name) if name is not None else None
            if info is None:
                out.append(e)
            elif tuple(e.shape) == info.local_shape:
                out.append(e._replace(shape=info.full_shape, start=e.start + info.offset, stop=e.stop + info.offset))
            elif tuple(e.shape) == ():
                if first:  # alike on every ep rank
                    out.append(e)
            else:
                raise ValueError(
                    f"{e.key} has shape {tuple(e.shape)}, and its expert parameter's piece on this ep rank "
                    f"{info.local_shape}: an expert-parallel checkpoint holds optimizer state shaped like its "
                    "parameter, "
                    "or scalars (an optimizer with factored state cannot be saved under ep_size > 1)"
                )
        return out

    def load_sharded_state(self, model: nn.Module, optimizers: Any, reader: StateReader) -> None:
        self.strategy.load_sharded_state(model, optimizers, EPReader(reader, self.layouts(model)))


class EPReader:
    """A :class:`StateReader` that shows each whole expert tensor (a parameter, or state shaped like it) at this ep
    rank's local shape, its elements read from this rank's run of the whole."""

    def __init__(self, reader: StateReader, layouts: dict[str, EPParam]) -> None:
        self.reader = reader
        self.pieces: dict[str, EPParam] = {}
        for key in reader.keys():
            name = param_name(key)
            info = layouts.get(name) if name is not None else None
            if info is not None and tuple(reader.shape(key)) == info.full_shape:
                self.pieces[key] = info

    def keys(self) -> Any:
        return self.reader.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        info = self.pieces.get(key)
        return info.local_shape if info is not None else tuple(self.reader.shape(key))

    def dtype(self, key: str) -> torch.dtype:
        saved = getattr(self.reader, "dtype", None)
        return saved(key) if saved is not None else self.reader.read(key, 0, 0).dtype

    def _offset(self, key: str) -> int:
        info = self.pieces.get(key)
        return info.offset if info is not None else 0

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        o = self._offset(key)
        return self.reader.read(key, start + o, stop + o)

    def read_into(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        o = self._offset(key)
        read_into(self.reader, key, start + o, stop + o, out)
