"""Command-line flags for the engine's and the launcher's settings, made from their declarations.

Every engine setting (the general ones and each strategy's, see ``options.py``) becomes a flag named after it
(``bucket_mb`` -> ``--bucket-mb``), grouped by who reads it, with its doc and allowed values as help. The values
stay text here; ``settings.py`` parses and checks them as it does for the environment, so a flag and a
``PHALANX_*`` variable get the same errors.

The spellings of torchrun and Accelerate (``--nproc_per_node``, ``--num_processes``, ``--mixed_precision``; the
table is ``dialects/flags.py``) and the underscore spelling of every engine flag (``--grad_accum_steps``) are
flags of their own, folded into the same settings by :func:`resolve_flags`: two spellings of one setting with
different values are an error that names both.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from phalanx.config.dialects.flags import (
    CONFIG_FILE,
    DIALECT_FLAGS,
    NO_SETTING,
    PC_FLAG,
    TOTAL_PROCESSES,
    USE_DEEPSPEED,
    DialectFlag,
)
from phalanx.config.dialects.names import strategy_from_zero_stage
from phalanx.config.dialects.parallelism import read_parallelism
from phalanx.config.general import PRECISIONS
from phalanx.config.registry import accepting, strategy_names, strategy_summaries
from phalanx.config.settings import (
    ConfigError,
    GeneralOptions,
    LaunchConfig,
    PhalanxConfig,
    engine_fields,
    resolve_config,
)
from phalanx.logging import get_logger

__all__ = ["add_engine_flags", "add_launch_flags", "add_dialect_flags", "resolve_flags", "flag_spellings"]

_LAUNCH_FLAGS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "nproc_per_node": (["-n", "--nproc-per-node"], {"type": int, "help": "processes on this node (default 1)"}),
    "nnodes": (["--nnodes"], {"help": "number of nodes, or MIN:MAX for an elastic job (with --rdzv-endpoint)"}),
    "min_nodes": (["--min-nodes"], {"type": int, "help": "elastic: the fewest nodes the job goes on with"}),
    "node_rank": (["--node-rank"], {"type": int, "help": "rank of this node, 0 .. nnodes-1"}),
    "master_addr": (["--master-addr"], {"help": "address of node 0 (default 127.0.0.1: this machine only)"}),
    "master_port": (["--master-port"], {"type": int, "help": "rendezvous port (default: a free one)"}),
    "rdzv_endpoint": (["--rdzv-endpoint"], {"help": "HOST:PORT of a c10d rendezvous (elastic)"}),
    "max_restarts": (["--max-restarts"], {"type": int, "help": "restarts of the worker group after a failure"}),
}
assert set(_LAUNCH_FLAGS) == {f.name for f in dataclasses.fields(LaunchConfig)}, "a flag for every launch setting"

_ACCELERATE_ZERO_STAGE = 2
"""The stage Accelerate's DeepSpeed plugin uses when ``--use_deepspeed`` names none."""


def _help(field: dataclasses.Field[Any]) -> str:
    doc = field.metadata.get("doc", "")
    choices = field.metadata.get("choices")
    if field.name == "strategy":
        doc = "How work is spread over ranks: " + "; ".join(f"{n}: {s}" for n, s in strategy_summaries().items())
        choices = strategy_names()
    elif field.name == "precision":
        choices = PRECISIONS
    text = doc + (f" [{', '.join(map(str, choices))}]" if choices else "")
    if field.default is not None and field.default is not dataclasses.MISSING:
        text += f" (default {field.default})"
    return text.replace("%", "%%")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every engine setting, in one group per owner. Flags override the config file and ``PHALANX_*``."""
    groups: dict[Any, argparse._ArgumentGroup] = {}
    for owner, field_ in engine_fields():
        if owner not in groups:
            if owner is GeneralOptions:
                title = "engine (override the config file and PHALANX_* variables)"
            else:
                title = f"{owner.title}: read by {', '.join(accepting(owner))}"
            groups[owner] = parser.add_argument_group(title)
        flag = "--" + field_.name.replace("_", "-")
        groups[owner].add_argument(flag, dest=field_.name, metavar=field_.name.upper(), help=_help(field_))


def add_launch_flags(parser: argparse.ArgumentParser, n_help: str | None = None) -> None:
    """The launcher's flags and ``--config``; ``n_help`` replaces the help of ``-n`` (the demo's default differs)."""
    g = parser.add_argument_group("launch")
    for name, (flags, kwargs) in _LAUNCH_FLAGS.items():
        if name == "nproc_per_node" and n_help:
            kwargs = {**kwargs, "help": n_help}
        g.add_argument(*flags, dest=name, **kwargs)
    parser.add_argument("--config", help="phalanx YAML config file")


def _dest(spelling: str) -> str:
    return "dialect:" + spelling


def _underscore_flags() -> list[DialectFlag]:
    """``--grad_accum_steps`` for ``--grad-accum-steps``: the spelling of torchrun's and Accelerate's flags."""
    return [
        DialectFlag("--" + f.name, "underscore", f.name, "= --" + f.name.replace("_", "-"))
        for _, f in engine_fields()
        if "_" in f.name
    ]


def add_dialect_flags(parser: argparse.ArgumentParser) -> None:
    """torchrun's and Accelerate's spellings (shown in the help) and the underscore spelling of every engine flag."""
    g = parser.add_argument_group(
        "torchrun and Accelerate spellings",
        "Each sets the phalanx setting it names; every engine flag also takes its underscore spelling "
        "(--grad_accum_steps). Two spellings of one setting must agree.",
    )
    for flag in DIALECT_FLAGS:
        kwargs: dict[str, Any] = {"action": "store_true", "default": None} if flag.switch else {"metavar": flag.metavar}
        g.add_argument(flag.spelling, dest=_dest(flag.spelling), help=f"{flag.dialect}: {flag.help}", **kwargs)
    for flag in _underscore_flags():
        parser.add_argument(flag.spelling, dest=_dest(flag.spelling), help=argparse.SUPPRESS)


def flag_spellings(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """Every option string of ``parser``, and whether it takes a value."""
    return {s: action.nargs != 0 for action in parser._actions for s in action.option_strings}


@dataclass
class _Given:
    """What one command line says, each setting with the spellings that gave it."""

    by_target: dict[str, list[tuple[str, str, Any]]] = field(default_factory=dict)
    """target -> (spelling, the text given, its value in phalanx's terms) for each flag that set it."""

    def add(self, target: str, spelling: str, text: Any, value: Any) -> None:
        self.by_target.setdefault(target, []).append((spelling, str(text), value))

    def one(self, target: str) -> Any:
        """The value of ``target``; two spellings with different values are an error naming both."""
        given = self.by_target.get(target, [])

        def shown(spelling: str, text: str, value: Any) -> str:
            if not text:  # a switch, such as --cpu
                return spelling
            return f"{spelling} {text}" + (f" (= {value})" if str(value) != text else "")

        for other in given[1:]:
            if not _same(other[2], given[0][2]):
                what = target if not target.startswith("(") else target.strip("()")
                why = _WHY_ONE.get(target, "")
                raise ConfigError(
                    f"{shown(*given[0])} and {shown(*other)} both set {what}, to different values{why}; give one "
                    "of them"
                )
        return given[0][2] if given else None


_WHY_ONE = {
    "offload": (
        " (phalanx keeps zero3's parameter shards in the same tier as the optimizer state: parameters on cpu with "
        "the optimizer on nvme, or the other way round, has no phalanx equivalent)"
    ),
}
"""Why a setting takes one value, where two of the peers' flags could give it two."""


def _same(a: Any, b: Any) -> bool:
    def norm(v: Any) -> Any:
        text = str(v).strip().lower()
        for parse in (int, float):
            try:
                return parse(text)
            except ValueError:
                pass
        return {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}.get(text, text)

    return bool(norm(a) == norm(b))


def _given(ns: argparse.Namespace) -> _Given:
    given = _Given()
    for name, (spellings, _) in _LAUNCH_FLAGS.items():
        if getattr(ns, name, None) is not None:
            given.add("launch." + name, "/".join(spellings), getattr(ns, name), getattr(ns, name))
    for _, f in engine_fields():
        if getattr(ns, f.name, None) is not None:
            given.add(f.name, "--" + f.name.replace("_", "-"), getattr(ns, f.name), getattr(ns, f.name))
    if getattr(ns, "config", None) is not None:
        given.add(CONFIG_FILE, "--config", ns.config, ns.config)
    for flag in (*DIALECT_FLAGS, *_underscore_flags()):
        text = getattr(ns, _dest(flag.spelling), None)
        if text is None:
            continue
        value = flag.convert(str(text), flag.spelling) if flag.convert else text
        given.add(flag.target, flag.spelling, "" if flag.switch else text, value)
    return given


def resolve_flags(ns: argparse.Namespace) -> PhalanxConfig:
    """The config that a parsed command line asks for: its file, the environment, and its flags in every spelling."""
    given = _given(ns)
    # A DeepSpeed JSON (--deepspeed, --deepspeed_config_file) is the cli layer's "deepspeed" setting.
    cli = {target: given.one(target) for target in given.by_target if not target.startswith("(")}
    file = given.one(CONFIG_FILE)
    if file is None and cli.get("device") != "cpu":  # accelerate launch reads its default config then (not with --cpu)
        file = accelerate_default_config()
        if file is not None:
            get_logger().warning(
                "no --config given: reading Accelerate's default config %s, as accelerate launch does (pass --config "
                "FILE to use another)",
                file,
            )
    total = given.one(TOTAL_PROCESSES)
    if total is not None:
        # The flags or the config file may name the machines (as N or MIN:MAX): read them, with the total on one
        # node as the first guess.
        trial = {**cli, "launch.nproc_per_node": cli.get("launch.nproc_per_node", total)}
        nnodes = resolve_config(file=file, cli=trial).launch.nnodes
        cli["launch.nproc_per_node"] = _per_node(total, nnodes, cli.get("launch.nproc_per_node"))
    notes = _parallelism_notes(given)
    cfg = resolve_config(file=file, cli=cli)
    cfg.notes.extend(note for note in notes if note not in cfg.notes)
    if given.one(USE_DEEPSPEED) and "strategy" not in cfg.origins:
        # Accelerate runs ZeRO stage 2 when --use_deepspeed names no stage (not here, nor in a file), and so does this.
        cfg = resolve_config(file=file, cli={**cli, "strategy": strategy_from_zero_stage(_ACCELERATE_ZERO_STAGE)})
    _refuse_param_offload_without_zero3(given, cfg.engine.strategy)
    standalone = any(spelling == "--standalone" for spelling, _, _ in given.by_target.get(NO_SETTING, []))
    if standalone and cfg.launch.nnodes > 1:
        raise ConfigError(
            f"--standalone runs one node, and nnodes={cfg.launch.nnodes}; drop --standalone, or --nnodes for one node"
        )
    return cfg


def _refuse_param_offload_without_zero3(given: _Given, strategy: str) -> None:
    """Accelerate's ``--offload_param_device`` moves zero3's parameter shards; under any other strategy it would
    set ``offload`` and move the optimizer state instead, which the user did not ask for. The DeepSpeed block of an
    Accelerate YAML is refused the same way (``offload_for``)."""
    for spelling, text, value in given.by_target.get("offload", []):
        if spelling == "--offload_param_device" and value != "none" and strategy != "zero3":
            raise ConfigError(
                f"--offload_param_device {text} offloads parameters, which needs ZeRO stage 3; the strategy is "
                f"{strategy!r} (use --offload_optimizer_device {text} to offload only the optimizer state, or "
                "--zero_stage 3)"
            )


def _parallelism_notes(given: _Given) -> list[str]:
    """The ParallelismConfig that the flags say (Accelerate's --parallelism_config_* and phalanx's --cp-size and
    --sp-size), read as every front reads it: the two sequence splits together are refused naming the flags given,
    and the options' notes are returned."""
    said: dict[str, Any] = {}
    spelt: dict[str, str] = {}
    for target, entries in given.by_target.items():
        for spelling, _, value in entries:
            if spelling.startswith(PC_FLAG):
                name = spelling.removeprefix(PC_FLAG)
            elif target in ("cp_size", "sp_size"):
                name = target
            else:
                continue
            if target in ("cp_size", "sp_size"):
                try:
                    value = int(value)
                except ValueError:
                    continue  # the settings refuse it, naming the flag
            said[name], spelt[name] = value, spelling
    if not said:
        return []
    return read_parallelism(said, lambda name: spelt.get(name, PC_FLAG + name)).notes


def accelerate_default_config() -> str | None:
    """The file ``accelerate config`` writes and ``accelerate launch`` reads when given none, if it exists:
    ``$HF_HOME/accelerate/default_config.yaml`` (``HF_HOME`` defaults to ``$XDG_CACHE_HOME/huggingface``, and that
    to ``~/.cache/huggingface``)."""
    home = os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
    path = os.path.join(os.path.expanduser(home), "accelerate", "default_config.yaml")
    return path if os.path.isfile(path) else None


def _per_node(total: int, nnodes: int, nproc_given: int | None) -> int:
    """Accelerate's ``--num_processes`` counts the processes of all machines; phalanx's -n counts one node's."""
    if total < 1 or total % nnodes:
        near = sorted({nnodes * max(1, total // nnodes), nnodes * (max(0, total // nnodes) + 1)})
        raise ConfigError(
            f"--num_processes {total} counts the processes of all machines and must be a positive multiple of the "
            f"number of machines, nnodes={nnodes} (--num_machines / --nnodes); use --num_processes "
            f"{' or '.join(map(str, near))}, or -n N for N processes on each machine"
        )
    per_node = total // nnodes
    if nproc_given is not None and nproc_given != per_node:
        raise ConfigError(
            f"--num_processes {total} over nnodes={nnodes} means {per_node} processes per node, and "
            f"-n/--nproc-per-node says {nproc_given}; give one of them"
        )
    return per_node
