"""What the tensor- and expert-parallel checkpoint views share: a strategy's checkpoint methods seen through each
parameter's placement (a tp piece, an ep rank's experts), so that checkpoints hold whole tensors.

A view wraps a strategy (or another view: the tp view wraps the ep one) and keeps everything else the strategy's
(``__getattr__``). Subclasses say how a placement is read from a parameter (:meth:`PieceView.info_of`), how it
travels to the other pipeline stages (:meth:`PieceView.encode`, :meth:`PieceView.decode`), and how a local tensor
becomes whole (:meth:`PieceView.gather`); a placement has ``full_shape`` and ``local_shape``.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import torch
from torch import nn

from phalanx.runtime.comm import all_gather_bytes
from phalanx.runtime.topology import Topology

__all__ = ["PieceView", "param_name"]


def param_name(key: str) -> str | None:
    """The parameter (or buffer) name of a state key: ``model/<name>`` or ``optim/<name>/<state>``."""
    kind, _, rest = key.partition("/")
    if kind == "model":
        return rest
    if kind == "optim":
        return rest.rpartition("/")[0]
    return None


class PieceView:
    """``strategy``'s checkpoint methods in whole-tensor coordinates; see the module's docstring."""

    def __init__(self, strategy: Any, topology: Topology) -> None:
        self.strategy = strategy
        self.topology = topology
        self._layouts: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()

    def __getattr__(self, name: str) -> Any:
        if name == "strategy":  # not set yet (unpickling): never recurse
            raise AttributeError(name)
        return getattr(self.strategy, name)

    # ------------------------------------------------------------------ what a subclass says
    def info_of(self, p: torch.Tensor) -> Any:
        """The placement of parameter ``p``, or None."""
        raise NotImplementedError

    def encode(self, info: Any) -> list[Any]:
        """``info`` as JSON, for the other pipeline stages."""
        raise NotImplementedError

    def decode(self, data: list[Any]) -> Any:
        """Another stage's placement, as this rank holds that stage's tensor."""
        raise NotImplementedError

    def gather(self, local: torch.Tensor, info: Any, name: str) -> torch.Tensor | None:
        """``local`` made whole (a collective over the view's group), or None when it is whole already."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    def layouts(self, model: nn.Module) -> dict[str, Any]:
        """Every parameter's placement by the name the strategy saves it under. Under pipeline parallelism a
        collective the first time (the other stages' placements come from their ranks); call it on every rank."""
        known = self._layouts.get(model)
        if known is not None:
            return known
        found: dict[str, Any] = {}
        for module in (model, self.strategy.unwrap_model(model)):
            for name, p in module.named_parameters():
                info = self.info_of(p)
                if info is not None:
                    found.setdefault(name, info)
        if self.topology.pp_size > 1:
            mine = {n: self.encode(i) for n, i in found.items()}
            group = self.topology.pp_group  # the same place in every stage
            for blob in all_gather_bytes(json.dumps(mine).encode(), self.strategy.device, group):
                for name, data in json.loads(blob).items():
                    if name not in found:
                        found[name] = self.decode(data)
        self._layouts[model] = found
        return found

    def state_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """Whole shapes. Under pipeline parallelism a collective the first time (see :meth:`layouts`)."""
        layouts = self.layouts(model)
        out = {}
        for name, shape in self.strategy.state_shapes(model).items():
            info = layouts.get(name)
            out[name] = info.full_shape if info is not None and tuple(shape) == info.local_shape else tuple(shape)
        return out

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole state dict on every rank: the strategy's, each placed tensor made whole. A collective."""
        state = self.strategy.full_state_dict(model)
        layouts = self.layouts(model)
        stored = self.strategy.state_dict_keys(model)
        gathered: dict[str, torch.Tensor] = {}
        out = {}
        for key, value in state.items():
            name = stored.get(key, key)
            info = layouts.get(name)
            if info is None or tuple(value.shape) != info.local_shape:
                out[key] = value
                continue
            if name not in gathered:  # a tied weight's second key: the same tensor, gathered once
                whole = self.gather(value.to(self.strategy.device), info, name)
                gathered[name] = value if whole is None else whole.to("cpu")
            out[key] = gathered[name]
        return out
