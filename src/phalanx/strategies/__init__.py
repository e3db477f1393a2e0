"""Strategies by name. The Engine, the CLI and the Trainer look strategies up here and never branch on their type.

The registry maps a name to ``module:Class`` so that naming and validating a strategy does not import it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.strategies.base import Strategy

__all__ = ["strategy_names", "get_strategy_class"]

_REGISTRY: dict[str, str] = {
    "ddp": "phalanx.strategies.ddp:DDPStrategy",
    "zero1": "phalanx.strategies.zero:Zero1Strategy",
    "zero2": "phalanx.strategies.zero:Zero2Strategy",
    "zero3": "phalanx.strategies.zero:Zero3Strategy",
    "pipeline": "phalanx.strategies.pipeline:PipelineStrategy",
}


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


def get_strategy_class(name: str) -> type[Strategy]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; valid strategies: {', '.join(strategy_names())}")
    module, _, cls = _REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)
