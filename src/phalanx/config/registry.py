"""Strategies by name. The Engine, the CLI and the Trainer look strategies up here and never branch on their type.

Each name maps to ``module:Class`` (so that naming a strategy does not import it) and to the option groups
(:class:`~phalanx.config.options.Options`, declared in ``strategy_options.py``) it accepts. This module sits on the
ground floor with the rest of configuration: ``settings.py``, the flags and the dialects compose the option groups
from this table, and no strategy is imported until the Engine asks for its class.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple

from phalanx.config.options import Options
from phalanx.config.strategy_options import (
    DataParallelOptions,
    ParallelOptions,
    PipelineOptions,
    Zero3Options,
    ZeroOptions,
    ZeroShardOptions,
)

if TYPE_CHECKING:
    from phalanx.strategies.base import Strategy

__all__ = [
    "strategy_names",
    "get_strategy_class",
    "option_groups",
    "accepting",
    "accepts",
    "shards",
    "DEFAULT_STRATEGY",
]


class _Entry(NamedTuple):
    target: str
    options: tuple[type[Options], ...]
    summary: str


_REGISTRY: dict[str, _Entry] = {
    "ddp": _Entry(
        "phalanx.strategies.ddp:DDPStrategy", (ParallelOptions, DataParallelOptions),
        "every rank holds the whole model; gradients are all-reduced in buckets during backward",
    ),
    "zero1": _Entry(
        "phalanx.strategies.zero.bucketed:Zero1Strategy",
        (ParallelOptions, DataParallelOptions, ZeroShardOptions, ZeroOptions),
        "optimizer state sharded over the ranks",
    ),
    "zero2": _Entry(
        "phalanx.strategies.zero.bucketed:Zero2Strategy",
        (ParallelOptions, DataParallelOptions, ZeroShardOptions, ZeroOptions),
        "optimizer state and gradients sharded",
    ),
    "zero3": _Entry(
        "phalanx.strategies.zero.zero3:Zero3Strategy",
        (ParallelOptions, DataParallelOptions, ZeroShardOptions, ZeroOptions, Zero3Options),
        "optimizer state, gradients and parameters sharded; units gathered around their forward and backward",
    ),
    "pipeline": _Entry(
        "phalanx.strategies.pipeline.strategy:PipelineStrategy",
        (ParallelOptions, DataParallelOptions, PipelineOptions, ZeroShardOptions),
        "the model split into stages over ranks, micro-batches pushed through by GPipe or 1F1B",
    ),
}  # fmt: skip


DEFAULT_STRATEGY = "ddp"
"""What ``Engine()`` runs when nothing says otherwise."""


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


def strategy_summaries() -> dict[str, str]:
    """One line on each strategy, for help texts."""
    return {name: _REGISTRY[name].summary for name in strategy_names()}


def get_strategy_class(name: str) -> type[Strategy]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; valid strategies: {', '.join(strategy_names())}")
    module, _, cls = _REGISTRY[name].target.partition(":")
    return getattr(importlib.import_module(module), cls)


def option_groups() -> list[type[Options]]:
    """Every strategy's option groups, each once, in a stable order."""
    return list(dict.fromkeys(g for name in strategy_names() for g in _REGISTRY[name].options))


def accepts(name: str, group: type[Options]) -> bool:
    return group in _REGISTRY[name].options


def shards(name: str | None) -> bool:
    """Whether strategy ``name`` shards parameters, gradients or optimizer state over the data-parallel ranks (the
    zero strategies): the mesh gives such a strategy the data ranks as ``dp_shard``, the others as
    ``dp_replicate``."""
    return name in _REGISTRY and accepts(name, ZeroOptions)


def accepting(group: type[Options]) -> list[str]:
    """The strategies that accept ``group``."""
    return [name for name in strategy_names() if accepts(name, group)]
