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

import json
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.checkpoint.shards import ShardEntry, StateReader, read_into
from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import all_gather_bytes
from phalanx.runtime.topology import Topology

from .params import EPParam, ep_param_info

__all__ = ["EPCheckpointView", "EPReader"]


def _param_name(key: str) -> str | None:
    kind, _, rest = key.partition("/")
    if kind == "model":
        return rest
    if kind == "optim":
        return rest.rpartition("/")[0]
    return None


class EPCheckpointView:
    """``strategy``'s checkpoint methods with whole expert tensors (see the module's docstring)."""

    def __init__(self, strategy: Any, topology: Topology) -> None:
        self.strategy = strategy
        self.topology = topology
        self._layouts: weakref.WeakKeyDictionary[nn.Module, dict[str, EPParam]] = weakref.WeakKeyDictionary()

    def __getattr__(self, name: str) -> Any:
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def layouts(self, model: nn.Module) -> dict[str, EPParam]:
        """Every expert parameter's :class:`EPParam` by the name it is saved under; under pipeline parallelism the
        other stages' too (a collective the first time: call it on every rank)."""
        known = self._layouts.get(model)
        if known is not None:
            return known
        found: dict[str, EPParam] = {}
        for module in (model, self.strategy.unwrap_model(model)):
            for name, p in module.named_parameters():
                info = ep_param_info(p)
                if info is not None:
                    found.setdefault(name, info)
        if self.topology.pp_size > 1:
            mine = {n: [list(i.full_shape), i.parts] for n, i in found.items()}
            for blob in all_gather_bytes(json.dumps(mine).encode(), self.strategy.device, self.topology.pp_group):
                for name, (shape, parts) in json.loads(blob).items():
                    found.setdefault(name, EPParam(tuple(shape), parts, self.topology.ep_rank))
        self._layouts[model] = found
        return found

    def sharded_state(self, model: nn.Module, optimizers: Any = None) -> list[ShardEntry]:
        entries = self.strategy.sharded_state(model, optimizers)
        layouts = self.layouts(model)
        first = self.topology.ep_rank == 0
        out = []
        for e in entries:
            name = _param_name(e.key)
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

    def state_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        layouts = self.layouts(model)
        out = {}
        for name, shape in self.strategy.state_shapes(model).items():
            info = layouts.get(name)
            out[name] = info.full_shape if info is not None and tuple(shape) == info.local_shape else tuple(shape)
        return out

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole state dict on every rank, each expert tensor all-gathered over the ep group. A collective."""
        state = self.strategy.full_state_dict(model)
        layouts = self.layouts(model)
        stored = self.strategy.state_dict_keys(model)
        device = self.strategy.device
        gathered: dict[str, torch.Tensor] = {}
        out = {}
        for key, value in state.items():
            name = stored.get(key, key)
            info = layouts.get(name)
            if info is None or tuple(value.shape) != info.local_shape:
                out[key] = value
                continue
            if name not in gathered:
                local = value.to(device).contiguous()
                whole = local.new_empty(info.full_shape)
                watched(
                    dist.all_gather_into_tensor, whole, local, group=self.topology.ep_group, label=f"ep gather {name}"
                )
                gathered[name] = whole.to("cpu")
            out[key] = gathered[name]
        return out


class EPReader:
    """A :class:`StateReader` that shows each whole expert tensor (a parameter, or state shaped like it) at this ep
    rank's local shape, its elements read from this rank's run of the whole."""

    def __init__(self, reader: StateReader, layouts: dict[str, EPParam]) -> None:
        self.reader = reader
        self.pieces: dict[str, EPParam] = {}
        for key in reader.keys():
            name = _param_name(key)
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
