"""Command-line flags for the engine's and the launcher's settings, made from their declarations.

Every engine setting (the general ones and each strategy's, see ``options.py``) becomes a flag named after it
(``bucket_mb`` -> ``--bucket-mb``), grouped by who reads it, with its doc and allowed values as help. The values
stay text here; ``config.py`` parses and checks them as it does for the environment, so a flag and a
``PHALANX_*`` variable get the same errors.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from phalanx.config import GeneralOptions, LaunchConfig, engine_fields
from phalanx.strategies import accepting, strategy_summaries

__all__ = ["add_engine_flags", "add_launch_flags", "cli_values"]

_LAUNCH_FLAGS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "nproc_per_node": (["-n", "--nproc-per-node"], {"type": int, "help": "processes on this node (default 1)"}),
    "nnodes": (["--nnodes"], {"type": int, "help": "number of nodes"}),
    "node_rank": (["--node-rank"], {"type": int, "help": "rank of this node, 0 .. nnodes-1"}),
    "master_addr": (["--master-addr"], {"help": "address of node 0 (default 127.0.0.1: this machine only)"}),
    "master_port": (["--master-port"], {"type": int, "help": "rendezvous port (default: a free one)"}),
    "rdzv_endpoint": (["--rdzv-endpoint"], {"help": "HOST:PORT of a c10d rendezvous (elastic)"}),
    "max_restarts": (["--max-restarts"], {"type": int, "help": "restarts of the worker group after a failure"}),
}
assert set(_LAUNCH_FLAGS) == {f.name for f in dataclasses.fields(LaunchConfig)}, "a flag for every launch setting"


def _help(field: dataclasses.Field[Any]) -> str:
    doc = field.metadata.get("doc", "")
    choices = field.metadata.get("choices")
    text = doc + (f" [{', '.join(map(str, choices))}]" if choices else "")
    if field.default is not None and field.default is not dataclasses.MISSING:
        text += f" (default {field.default})"
    return text.replace("%", "%%")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every engine setting, in one group per owner. Flags override the config file and ``PHALANX_*``."""
    groups: dict[Any, argparse._ArgumentGroup] = {}
    for owner, field in engine_fields():
        if owner not in groups:
            if owner is GeneralOptions:
                title = "engine (override the config file and PHALANX_* variables)"
            else:
                title = f"{owner.title}: read by {', '.join(accepting(owner))}"
            groups[owner] = parser.add_argument_group(title)
        flag = "--" + field.name.replace("_", "-")
        help_text = _help(field)
        if field.name == "strategy":
            help_text = "How work is spread over ranks: " + "; ".join(f"{n}: {s}" for n, s in strategy_summaries().items())
            help_text += " (default ddp)"
        groups[owner].add_argument(flag, dest=field.name, metavar=field.name.upper(), help=help_text)


def add_launch_flags(parser: argparse.ArgumentParser, default_n: int | None = None) -> None:
    g = parser.add_argument_group("launch")
    for name, (flags, kwargs) in _LAUNCH_FLAGS.items():
        extra: dict[str, Any] = {"default": default_n} if name == "nproc_per_node" else {}
        g.add_argument(*flags, dest=name, **kwargs, **extra)
    parser.add_argument("--config", help="phalanx YAML config file")


def cli_values(ns: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags, as ``resolve_config``'s ``cli`` layer (unset flags are None and skipped)."""
    engine = {f.name: getattr(ns, f.name, None) for _, f in engine_fields()}
    launch = {f"launch.{name}": getattr(ns, name, None) for name in _LAUNCH_FLAGS}
    return {**engine, **launch}
