"""Typed configuration: the one source of truth for every setting phalanx reads.

Sources are layered, later ones winning::

    defaults < YAML file (--config) < environment (PHALANX_*) < CLI flags / Engine(...) keyword arguments

`phalanx launch` resolves the layers once and hands the result to every worker in
``PHALANX_CONFIG_JSON``; ``Engine()`` with no arguments picks it up. ``phalanx config`` prints the
resolved values with the origin of each.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.config.general import PRECISIONS, GeneralOptions
from phalanx.config.options import ConfigError, Options
from phalanx.config.registry import accepting, accepts, option_groups, strategy_names

__all__ = ["ConfigError", "EngineConfig", "LaunchConfig", "PhalanxConfig", "resolve_config", "ENV_CONFIG_JSON"]

ENV_CONFIG_JSON = "PHALANX_CONFIG_JSON"
_ENV_PREFIX = "PHALANX_"
# Environment variables of ours that are not config fields.
_ENV_NOT_FIELDS = {ENV_CONFIG_JSON, "PHALANX_INIT_METHOD", "PHALANX_LAUNCH_ID", "PHALANX_STORE_PER_ATTEMPT"}

T = typing.TypeVar("T", bound=Options)


def _groups() -> list[type[Options]]:
    return [GeneralOptions, *option_groups()]


def engine_fields() -> list[tuple[type[Options], dataclasses.Field[Any]]]:
    """Every engine setting, with the group that declares it: the general ones, then each strategy's."""
    return [(g, f) for g in _groups() for f in dataclasses.fields(g)]


class EngineConfig(GeneralOptions):
    """What the Engine does: the general settings (attributes of this class) and the option groups of every
    strategy, readable flat by name (``config.bucket_mb``) or as the group (``config.options(ZeroOptions)``).

    ``EngineConfig(**values)`` checks every value against its declaration, refuses a
    setting that the chosen strategy does not accept, and runs each accepted group's own rules.
    """

    def __init__(self, **values: Any) -> None:
        owner = {f.name: g for g, f in engine_fields()}
        for key in values:
            if key not in owner:
                raise _unknown(key, list(owner), "EngineConfig")
        general = {k: v for k, v in values.items() if owner[k] is GeneralOptions}
        super().__init__(**general)
        self._groups: dict[type[Options], Options] = {
            g: g(**{k: v for k, v in values.items() if owner[k] is g}) for g in option_groups()
        }
        self._validate()

    def options(self, group: type[T]) -> T:
        """The settings of ``group`` (e.g. ``ZeroOptions``), typed."""
        return typing.cast(T, self._groups[group])

    def __getattr__(self, name: str) -> Any:
        groups = self.__dict__.get("_groups", {})
        for group in groups.values():
            if name in group.__dataclass_fields__:
                return getattr(group, name)
        raise AttributeError(f"EngineConfig has no setting {name!r}")

    def values(self) -> dict[str, Any]:
        """Every setting by name."""
        general = {f.name: getattr(self, f.name) for f in dataclasses.fields(GeneralOptions)}
        return general | {f.name: getattr(g, f.name) for g in self._groups.values() for f in dataclasses.fields(g)}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineConfig) and self.values() == other.values()

    def __repr__(self) -> str:
        return "EngineConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.values().items()) + ")"

    def _validate(self) -> None:
        names = strategy_names()
        if self.strategy not in names:
            raise ConfigError(f"unknown strategy {self.strategy!r}; valid strategies: {', '.join(names)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}; valid precisions: {', '.join(PRECISIONS)}")
        GeneralOptions.check_fields(self)
        if self.hang_timeout_s is not None and self.hang_timeout_s >= self.timeout_s:
            raise ConfigError(
                f"hang_timeout_s={self.hang_timeout_s:g} is not below timeout_s={self.timeout_s:g}: collectives would "
                "time out first, with a message that names no rank. Lower hang_timeout_s, or raise timeout_s"
            )
        if self.precision != "fp16-mixed":
            for f in dataclasses.fields(GeneralOptions):
                if f.name.startswith("loss_scale") and getattr(self, f.name) != f.default:
                    raise ConfigError(
                        f"{f.name}={getattr(self, f.name)!r} applies to precision='fp16-mixed' only (loss scaling); "
                        f"got precision={self.precision!r} (use fp16-mixed, or leave it unset)"
                    )
        for group in self._groups.values():
            group.check_fields()
        for cls, group in self._groups.items():
            if accepts(self.strategy, cls):
                continue
            for key in group.set_fields():
                value = getattr(group, key)
                template = cls.__dataclass_fields__[key].metadata.get("elsewhere")
                if template:
                    raise ConfigError(template.format(key=key, value=value, strategy=self.strategy))
                raise ConfigError(
                    f"{key}={value!r} applies to {cls.applies_to} only; got strategy={self.strategy!r} (use "
                    f"{' or '.join(accepting(cls))}, or leave it unset)"
                )
        for cls, group in self._groups.items():
            if accepts(self.strategy, cls):
                group.check(self)


@dataclass
class LaunchConfig:
    """How `phalanx launch` starts processes; mapped onto torch.distributed.run."""

    nproc_per_node: int = 1
    """Processes on this node (-n)."""
    nnodes: int = 1
    """Number of nodes; ``MIN:MAX`` (with --rdzv-endpoint) runs elastic: the job goes on with MIN to MAX nodes."""
    min_nodes: int | None = None
    """Elastic: the fewest nodes the job continues on after losing one (``--nnodes MIN:MAX`` sets it)."""
    node_rank: int = 0
    """Rank of this node, 0 .. nnodes-1 (static rendezvous only)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0. The default binds to loopback; give a network address to span machines. With nnodes > 1 on
    loopback, every node runs on this machine (a way to try a multi-node config before renting machines)."""
    master_port: int = 0
    """Port of the rendezvous store on node 0; 0 picks a free port (single node only)."""
    rdzv_endpoint: str | None = None
    """host:port of a c10d rendezvous, instead of master_addr/node_rank (elastic, nodes may join in any order)."""
    max_restarts: int = 0
    """How many times torchrun restarts the worker group after a failure."""

    def __post_init__(self) -> None:
        _require(self.nproc_per_node >= 1, "nproc_per_node (-n)", self.nproc_per_node, "use -n 1 or more")
        _require(self.nnodes >= 1, "nnodes", self.nnodes, "use --nnodes 1 or more")
        _require(
            0 <= self.node_rank < self.nnodes,
            "node_rank",
            self.node_rank,
            f"node ranks run from 0 to nnodes-1={self.nnodes - 1}",
        )
        _require(
            0 <= self.master_port <= 65535,
            "master_port",
            self.master_port,
            "use a port in 1..65535, or 0 for a free one",
        )
        _require(self.max_restarts >= 0, "max_restarts", self.max_restarts, "use 0 or more")
        if self.min_nodes is not None:
            _require(
                1 <= self.min_nodes <= self.nnodes,
                "nnodes MIN:MAX",
                f"{self.min_nodes}:{self.nnodes}",
                "use 1 <= MIN <= MAX",
            )
            if self.rdzv_endpoint is None and self.min_nodes < self.nnodes:
                raise ConfigError(
                    f"nnodes={self.min_nodes}:{self.nnodes} is elastic and needs a c10d rendezvous that nodes can "
                    "leave and join: pass --rdzv-endpoint HOST:PORT (the same on every node), or a fixed --nnodes"
                )
        if self.nnodes > 1 and self.master_port == 0 and self.rdzv_endpoint is None:
            raise ConfigError(
                f"nnodes={self.nnodes} needs a fixed rendezvous port that every node knows; got master_port=0 "
                "(pass --master-port P, or --rdzv-endpoint HOST:PORT)"
            )


@dataclass
class PhalanxConfig:
    """The whole configuration: engine fields at the top level of a YAML file, launcher fields under ``launch:``."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    origins: dict[str, str] = field(default_factory=dict)
    """Where each value came from: ``default``, the file path, ``env PHALANX_X``, ``cli`` or ``argument``."""
    overrides: list[str] = field(default_factory=list)
    """One line for each value that a script's ``Engine(...)`` argument took over from the launcher, a file or the
    environment with another value: two sources disagreed, and the Engine warns once."""
    ignored: list[tuple[str, str]] = field(default_factory=list)
    """Keys of an Accelerate or DeepSpeed file that have no meaning in phalanx, each with why."""
    notes: list[str] = field(default_factory=list)
    """Where phalanx honours a foreign setting in its own way; the Engine warns each once."""

    def describe(self) -> str:
        """A printable table of every value the chosen strategy reads, with its origin, then the launcher's."""
        lines = []
        strategy = self.engine.strategy
        for group, f in engine_fields():
            if f.name.startswith("loss_scale") and self.engine.precision != "fp16-mixed":
                continue
            if group is GeneralOptions or accepts(strategy, group):
                value = getattr(self.engine, f.name)
                lines.append(f"{f.name:<28} {value!r:<20} ({self.origins.get(f.name, 'default')})")
        for f in dataclasses.fields(self.launch):
            key = "launch." + f.name
            lines.append(f"{key:<28} {getattr(self.launch, f.name)!r:<20} ({self.origins.get(key, 'default')})")
        unused = [g.title for g in option_groups() if not accepts(strategy, g)]
        if unused:
            lines.append(f"# not read by strategy {strategy!r}: the settings of {'; '.join(unused)}")
        for key, why in self.ignored:
            lines.append(f"# ignored: {key} ({why})")
        for note in self.notes:
            lines.append(f"# note: {note}")
        return "\n".join(lines)


def _require(ok: bool, key: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"invalid {key}: got {value!r} ({fix})")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name != "origins"}


def _engine_types() -> dict[str, Any]:
    return {name: typ for g in _groups() for name, typ in _field_types(g).items()}


def _coerce(value: Any, typ: Any, key: str, where: str) -> Any:
    """Check (or, for strings from env/CLI, parse) a value against the field's type."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _coerce(value, args[0], key, where)
    from_text = isinstance(value, str) and typ is not str
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if from_text and value.lower() in ("1", "true", "yes", "on"):
                return True
            if from_text and value.lower() in ("0", "false", "no", "off"):
                return False
        elif typ is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if from_text:
                return int(value)
        elif typ is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if from_text:
                return float(value)
        elif typ is str:
            if isinstance(value, str):
                return value
    except ValueError:
        pass
    tname = getattr(typ, "__name__", str(typ))
    raise ConfigError(f"{where}: key {key!r} must be {tname}; got {value!r} ({type(value).__name__})")


def _unknown(key: str, valid: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"{where}: unknown key {key!r}; {hint}valid keys: {', '.join(valid)}")


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist (check the path given to --config)")
    if p.suffix == ".json":
        from phalanx.config.dialects.deepspeed import read_deepspeed

        return read_deepspeed(p)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys to values; got {type(data).__name__}")
    return data


def resolve_config(
    file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
    cli_origin: str = "cli",
    deepspeed: str | os.PathLike[str] | None = None,
) -> PhalanxConfig:
    """Build the config from its layers. ``cli`` keys are engine field names or ``launch.<name>``.

    ``file`` is a phalanx YAML, an Accelerate config YAML, or a DeepSpeed JSON; ``deepspeed`` (a DeepSpeed JSON) is
    read at the ``cli`` layer, as ``--deepspeed``. When ``env`` holds ``PHALANX_CONFIG_JSON`` (set by the launcher),
    those values and origins form the base that the other layers override.
    """
    env = os.environ if env is None else env
    engine_types, launch_types = _engine_types(), _field_types(LaunchConfig)
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    out = PhalanxConfig()
    from_foreign: dict[str, tuple[Any, str]] = {}  # what a DeepSpeed file set in the layer being read
    fills: dict[str, tuple[Any, str]] = {}  # what an "auto" becomes when no layer sets the key

    def put(key: str, value: Any, where: str, expand: bool = True) -> None:
        section, _, name = key.rpartition(".")
        types_ = launch_types if section == "launch" else engine_types
        valid = [("launch." if section else "") + n for n in types_]
        if name not in types_ or section not in ("", "launch"):
            from phalanx.config.dialects.names import FOREIGN_KEYS

            if key in FOREIGN_KEYS:
                raise ConfigError(f"{where}: unknown key {key!r}; {FOREIGN_KEYS[key]}")
            raise _unknown(key, valid, where)
        if key == "launch.nnodes" and isinstance(value, str) and ":" in value:  # torchrun's elastic MIN:MAX
            low, _, value = value.partition(":")
            put("launch.min_nodes", low, where)
        coerced = _coerce(value, types_[name], key, where)
        if key in from_foreign and from_foreign[key][0] != coerced:
            raise ConfigError(
                f"{key}={coerced!r} from {_source(where)} disagrees with {key}={from_foreign[key][0]!r} from "
                f"{from_foreign[key][1]}; say it in one place"
            )
        if where == "argument" and key in values and values[key] != coerced and '"auto"' not in origins[key]:
            out.overrides.append(
                f"Engine({key}={coerced!r}) in the script overrides {key}={values[key]!r} "
                f"from {_source(origins[key])}; the run uses {coerced!r}. Say it in one place: drop the argument "
                "from Engine(...), or the setting from the launcher, file or environment"
            )
        values[key] = coerced
        origins[key] = where
        if key == "deepspeed" and expand and coerced is not None:
            put_mapped(_deepspeed_mapping(coerced), coerced, where)

    def put_mapped(mapped: Any, path: str, where: str) -> None:
        for key, value, source in mapped.values:
            origin = (
                f"{path} ({mapped.dialect} {source})"
                if where in (path, str(path))
                else f"{path} ({mapped.dialect} {source}, named by {_source(where)})"
            )
            put(key, value, origin, expand=False)
            from_foreign[key] = (values[key], origin)
        out.ignored.extend((f"{path}: {k}", why) for k, why in mapped.ignored)
        out.notes.extend(mapped.notes)
        for key, value, source in mapped.fills:
            fills[key] = (value, f"{path} ({mapped.dialect} {source})")

    handed_down = ENV_CONFIG_JSON in env
    if handed_down:
        # The launcher already layered file < env < CLI; re-reading the environment here would let a
        # PHALANX_* variable override a CLI flag.
        handed = json.loads(env[ENV_CONFIG_JSON])
        for key, value in handed["values"].items():
            put(key, value, handed["origins"].get(key, "launcher"), expand=False)
        out.notes.extend(handed.get("notes", []))
    if file is not None:
        where = str(file)
        data = _read_yaml(file)
        if Path(where).suffix == ".json":
            put_mapped(_deepspeed_mapping(where, data), where, where)
            values["deepspeed"], origins["deepspeed"] = where, where
        elif _is_accelerate(data):
            put_mapped(_accelerate_mapping(data, where), where, where)
        else:
            # A deepspeed: key goes first, so that a key of this file that contradicts it is an error.
            for key, value in sorted(data.items(), key=lambda kv: kv[0] != "deepspeed"):
                if key == "launch":
                    if not isinstance(value, dict):
                        raise ConfigError(f"{where}: key 'launch' must be a mapping; got {value!r}")
                    for sub, v in value.items():
                        put(f"launch.{sub}", v, where)
                elif key == "deepspeed" and isinstance(value, dict):
                    put_mapped(_deepspeed_mapping(where, value), where, where)
                else:
                    put(str(key), value, where)
        from_foreign.clear()
    for var, text in ({} if handed_down else env).items():
        if var.startswith(_ENV_PREFIX) and var not in _ENV_NOT_FIELDS:
            name = var[len(_ENV_PREFIX) :].lower()
            if name in engine_types:
                put(name, text, f"env {var}")
    layer = {"deepspeed": str(deepspeed)} if deepspeed is not None else {}
    layer.update({k: v for k, v in (cli or {}).items() if v is not None})
    for key, value in sorted(layer.items(), key=lambda kv: kv[0] != "deepspeed"):
        put(key, value, cli_origin)
    for key, (value, origin) in fills.items():
        if key not in values:
            put(key, value, origin, expand=False)

    out.engine = EngineConfig(**{k: v for k, v in values.items() if "." not in k})
    if out.engine.global_batch_size is not None or out.engine.micro_batch_size is not None:
        from phalanx.config.dialects.batch import apply_batch_rule

        world = (
            int(env["WORLD_SIZE"])
            if "WORLD_SIZE" in env
            else int(values.get("launch.nproc_per_node", 1)) * int(values.get("launch.nnodes", 1))
        )
        from phalanx.config.mesh import Mesh

        mesh = Mesh.of(out.engine, world, origins)
        apply_batch_rule(values, origins, world, mesh.pp, mesh.tp, mesh.cp)
        out.engine = EngineConfig(**{k: v for k, v in values.items() if "." not in k})
    out.launch = LaunchConfig(**{k.split(".", 1)[1]: v for k, v in values.items() if k.startswith("launch.")})
    out.origins = origins
    return out


def _is_accelerate(data: dict[str, Any]) -> bool:
    from phalanx.config.dialects.accelerate import is_accelerate_config

    return is_accelerate_config(data)


def _accelerate_mapping(data: dict[str, Any], where: str) -> Any:
    from phalanx.config.dialects.accelerate import from_accelerate
    from phalanx.config.dialects.deepspeed import read_deepspeed

    return from_accelerate(data, where, read_deepspeed)


def _deepspeed_mapping(path: str, data: dict[str, Any] | None = None) -> Any:
    from phalanx.config.dialects.deepspeed import from_deepspeed, read_deepspeed

    return from_deepspeed(read_deepspeed(path) if data is None else data, path)


def _source(origin: str) -> str:
    """An origin as a person reads it: which command, file or variable set the value."""
    if origin == "cli":
        return "the command line (phalanx launch / phalanx config flags)"
    if origin.startswith("env "):
        return f"the environment variable {origin[4:]}"
    return f"the config file {origin}" if origin not in ("default", "launcher", "argument") else origin


def config_to_env(config: PhalanxConfig) -> str:
    """Serialise the engine part of a resolved config for ``PHALANX_CONFIG_JSON``."""
    origins = {k: v for k, v in config.origins.items() if "." not in k}
    values = {k: getattr(config.engine, k) for k in origins}
    return json.dumps({"values": values, "origins": origins, "notes": config.notes})
