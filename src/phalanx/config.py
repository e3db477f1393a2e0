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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from phalanx.precision import PRECISIONS
from phalanx.strategies import strategy_names

__all__ = ["ConfigError", "EngineConfig", "LaunchConfig", "PhalanxConfig", "resolve_config", "ENV_CONFIG_JSON"]

ENV_CONFIG_JSON = "PHALANX_CONFIG_JSON"
_ENV_PREFIX = "PHALANX_"
# Environment variables of ours that are not config fields.
_ENV_NOT_FIELDS = {ENV_CONFIG_JSON, "PHALANX_INIT_METHOD"}


class ConfigError(ValueError):
    """A configuration value is wrong: the message names the key, the value, where it came from and the fix."""


@dataclass
class EngineConfig:
    """What the Engine does: strategy, precision, accumulation and the knobs of the strategy."""

    strategy: str = "ddp"
    """How work is spread over ranks. ``ddp``: every rank holds the whole model, gradients are all-reduced."""
    precision: str = "fp32"
    """``fp32``, ``bf16-mixed`` (autocast to bfloat16) or ``fp16-mixed`` (autocast to float16, dynamic loss scaling)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step (the accumulation window) under ``engine.accumulate()``."""
    seed: int = 0
    """Seed for model init helpers and the data order; the global sample order depends only on seed and epoch."""
    bucket_mb: float = 25.0
    """Size of one gradient bucket (ddp) in MiB; a bucket is all-reduced as soon as its last gradient lands."""
    broadcast_buffers: bool = True
    """ddp: broadcast module buffers (e.g. BatchNorm statistics) from rank 0 before each training forward."""
    find_unused_parameters: bool = False
    """ddp: allow trainable parameters that get no gradient in a backward (they are reduced as zeros)."""
    max_grad_norm: float | None = None
    """``engine.train_step`` clips the global gradient norm to this value when set."""
    pp_size: int | None = None
    """Pipeline stages; the data-parallel size is world_size / pp_size. Default: the world size under
    ``strategy: pipeline`` (one stage per rank), else 1."""
    pp_schedule: str = "1f1b"
    """pipeline: ``1f1b`` (warm-up, one forward one backward, cool-down: at most pp_size micro-batches of
    activations held per stage) or ``gpipe`` (every forward, then every backward: all micro-batches held)."""
    pp_microbatches: int | None = None
    """pipeline: micro-batches each batch is split into (the bubble is (pp-1)/(m+pp-1)); default 2 x pp_size."""
    pp_partition: str = "parameters"
    """pipeline: how blocks are split into stages: ``parameters`` (balanced parameter counts), ``uniform``
    (balanced block counts), ``time`` (balanced forward+backward time, measured at the first step), or cut
    points such as ``"3,6"`` (stage 1 starts at block 3, stage 2 at block 6)."""
    pp_zero_stage: int = 0
    """pipeline: ``1`` shards each stage's optimizer state over its data-parallel replicas (ZeRO-1, as DeepSpeed's
    pipeline engine allows); ``0`` keeps it whole on every replica. Stages 2 and 3 are refused: they would
    reduce-scatter gradients or gather parameters once per micro-batch."""
    device: str = "auto"
    """``auto`` (CUDA of the local rank when there is one, else CPU), ``cpu`` or ``cuda``."""
    timeout_s: float = 1800.0
    """Timeout of collectives and of process-group start-up, in seconds."""
    log_all_ranks: bool = False
    """Log from every rank, not only rank 0."""
    offload: str = "none"
    """zero strategies: where optimizer state (and zero3's parameter shards) live: ``none`` (the device),
    ``cpu`` (host memory, pinned on CUDA) or ``disk`` (memory-mapped files under ``offload_dir``)."""
    offload_dir: str | None = None
    """Directory for ``offload: disk`` (like DeepSpeed's ``nvme_path``); it must be writable."""
    offload_chunk_mb: float = 64.0
    """``offload: disk`` steps the optimizer this many MiB of parameters at a time, so one chunk of state is resident."""
    comm_dtype: str | None = None
    """zero strategies: dtype parameters and gradients travel in (``bf16``, ``fp16`` or ``fp32``); default: theirs."""
    zero_collectives: str = "auto"
    """``native`` (reduce-scatter / all-gather), ``allreduce`` (both emulated with all-reduce, faster on gloo),
    or ``auto``: allreduce on gloo, native otherwise."""
    zero3_unit_classes: str | None = None
    """zero3: comma-separated module class names gathered as one unit (like Accelerate's
    ``fsdp_transformer_layer_cls_to_wrap``); default: each child module with parameters."""
    zero3_prefetch: bool = True
    """zero3: all-gather the next unit while the current one computes (forward and backward)."""
    zero_allow_untested_optimizer: bool = False
    """zero strategies accept an optimizer outside torch.optim's elementwise ones (as DeepSpeed's option of that name)."""

    def __post_init__(self) -> None:
        names = strategy_names()
        if self.strategy not in names:
            raise ConfigError(f"unknown strategy {self.strategy!r}; valid strategies: {', '.join(names)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}; valid precisions: {', '.join(PRECISIONS)}")
        _require(self.grad_accum_steps >= 1, "grad_accum_steps", self.grad_accum_steps, "use 1 for no accumulation")
        _require(self.bucket_mb > 0, "bucket_mb", self.bucket_mb, "use a positive size such as 25")
        _require(self.pp_size is None or self.pp_size >= 1, "pp_size", self.pp_size, "use 1 for no pipeline")
        _require(self.pp_schedule in ("1f1b", "gpipe"), "pp_schedule", self.pp_schedule, "use 1f1b or gpipe")
        _require(
            self.pp_microbatches is None or self.pp_microbatches >= 1,
            "pp_microbatches",
            self.pp_microbatches,
            "use 1 or more micro-batches per batch",
        )
        if self.strategy == "pipeline":
            from phalanx.strategies.partition import parse_partition

            try:
                parse_partition(self.pp_partition)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            if self.pp_zero_stage not in (0, 1):
                raise ConfigError(
                    f"pp_zero_stage={self.pp_zero_stage!r} is not supported: use 0 (each stage's replicas hold its whole "
                    "optimizer state) or 1 (they shard it). Stages 2 and 3 would reduce-scatter gradients or gather "
                    "parameters on every micro-batch, which is why DeepSpeed's pipeline engine refuses them too"
                )
            if self.grad_accum_steps > 1:
                raise ConfigError(
                    f"grad_accum_steps={self.grad_accum_steps} does not apply to strategy='pipeline': its micro-batches "
                    "already accumulate gradients within each engine.train_step (set pp_microbatches instead, e.g. "
                    f"pp_microbatches={self.grad_accum_steps * (self.pp_microbatches or 1)}, with a batch that many times larger)"
                )
        else:
            if self.pp_size is not None and self.pp_size > 1:
                raise ConfigError(
                    f"pp_size={self.pp_size} splits the model into pipeline stages, which needs strategy='pipeline'; "
                    f"got strategy={self.strategy!r} (use strategy='pipeline', or pp_size=1)"
                )
            pipeline_only = {
                "pp_schedule": self.pp_schedule != "1f1b",
                "pp_microbatches": self.pp_microbatches is not None,
                "pp_partition": self.pp_partition != "parameters",
                "pp_zero_stage": self.pp_zero_stage != 0,
            }
            for key, set_ in pipeline_only.items():
                if set_:
                    raise ConfigError(
                        f"{key}={getattr(self, key)!r} applies to strategy='pipeline' only; got strategy={self.strategy!r}"
                    )
        _require(self.timeout_s > 0, "timeout_s", self.timeout_s, "use a positive number of seconds")
        _require(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "max_grad_norm",
            self.max_grad_norm,
            "use a positive norm, or leave it unset to not clip",
        )
        _require(
            self.device in ("auto", "cpu", "cuda"), "device", self.device, "use one of: auto, cpu, cuda"
        )
        _require(self.offload in ("none", "cpu", "disk"), "offload", self.offload, "use one of: none, cpu, disk")
        _require(self.offload_chunk_mb > 0, "offload_chunk_mb", self.offload_chunk_mb, "use a positive size such as 64")
        _require(
            self.comm_dtype in (None, "bf16", "fp16", "fp32"), "comm_dtype", self.comm_dtype, "use bf16, fp16 or fp32"
        )
        _require(
            self.zero_collectives in ("auto", "native", "allreduce"),
            "zero_collectives",
            self.zero_collectives,
            "use one of: auto, native, allreduce",
        )
        zero_only = {
            "comm_dtype": self.comm_dtype is not None,
            "zero_collectives": self.zero_collectives != "auto",
            "zero_allow_untested_optimizer": self.zero_allow_untested_optimizer,
        }
        pipeline_zero1 = ("zero_collectives", "zero_allow_untested_optimizer")  # also apply to pp_zero_stage=1
        for key, set_ in zero_only.items():
            if set_ and not self.strategy.startswith("zero"):
                if self.strategy == "pipeline" and self.pp_zero_stage == 1 and key in pipeline_zero1:
                    continue
                raise ConfigError(
                    f"{key}={getattr(self, key)!r} applies to the zero strategies only; got strategy={self.strategy!r} "
                    "(use zero1, zero2 or zero3, or leave it unset; under strategy='pipeline' with pp_zero_stage=1, "
                    f"{' and '.join(pipeline_zero1)} apply)"
                )
        if self.zero3_unit_classes is not None and self.strategy != "zero3":
            raise ConfigError(
                f"zero3_unit_classes={self.zero3_unit_classes!r} applies to strategy='zero3' only; got strategy={self.strategy!r}"
            )
        if self.offload != "none" and not self.strategy.startswith("zero"):
            raise ConfigError(
                f"offload={self.offload!r} needs a zero strategy (zero1, zero2 or zero3); got strategy={self.strategy!r}"
            )
        if self.offload == "disk" and not self.offload_dir:
            raise ConfigError("offload='disk' needs offload_dir: a writable directory for the memory-mapped files")


@dataclass
class LaunchConfig:
    """How `phalanx launch` starts processes; mapped onto torch.distributed.run."""

    nproc_per_node: int = 1
    """Processes on this node (-n)."""
    nnodes: int = 1
    """Number of nodes."""
    node_rank: int = 0
    """Rank of this node, 0 .. nnodes-1 (static rendezvous only)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0. The default binds to loopback; give a network address to span machines."""
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
        _require(0 <= self.master_port <= 65535, "master_port", self.master_port, "use a port in 1..65535, or 0 for a free one")
        _require(self.max_restarts >= 0, "max_restarts", self.max_restarts, "use 0 or more")
        if self.nnodes > 1 and self.rdzv_endpoint is None and self.master_addr in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError(
                f"nnodes={self.nnodes} needs the address of node 0 that the other nodes can reach; got master_addr="
                f"{self.master_addr!r}, which is this machine's loopback (pass --master-addr <node 0's address>)"
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

    def describe(self) -> str:
        """A printable table of every value and its origin."""
        lines = []
        for section, obj in (("", self.engine), ("launch.", self.launch)):
            for f in dataclasses.fields(obj):
                key = section + f.name
                lines.append(f"{key:<28} {getattr(obj, f.name)!r:<20} ({self.origins.get(key, 'default')})")
        return "\n".join(lines)


def _require(ok: bool, key: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"invalid {key}: got {value!r} ({fix})")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name != "origins"}


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
) -> PhalanxConfig:
    """Build the config from its layers. ``cli`` keys are engine field names or ``launch.<name>``.

    When ``env`` holds ``PHALANX_CONFIG_JSON`` (set by the launcher), those values and origins form the
    base that the other layers override.
    """
    env = os.environ if env is None else env
    engine_types, launch_types = _field_types(EngineConfig), _field_types(LaunchConfig)
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}

    def put(key: str, value: Any, where: str) -> None:
        section, _, name = key.rpartition(".")
        types_ = launch_types if section == "launch" else engine_types
        valid = [("launch." if section else "") + n for n in types_]
        if name not in types_ or section not in ("", "launch"):
            raise _unknown(key, valid, where)
        values[key] = _coerce(value, types_[name], key, where)
        origins[key] = where

    handed_down = ENV_CONFIG_JSON in env
    if handed_down:
        # The launcher already layered file < env < CLI; re-reading the environment here would let a
        # PHALANX_* variable override a CLI flag.
        handed = json.loads(env[ENV_CONFIG_JSON])
        for key, value in handed["values"].items():
            put(key, value, handed["origins"].get(key, "launcher"))
    if file is not None:
        where = str(file)
        for key, value in _read_yaml(file).items():
            if key == "launch":
                if not isinstance(value, dict):
                    raise ConfigError(f"{where}: key 'launch' must be a mapping; got {value!r}")
                for sub, v in value.items():
                    put(f"launch.{sub}", v, where)
            else:
                put(str(key), value, where)
    for var, text in ({} if handed_down else env).items():
        if var.startswith(_ENV_PREFIX) and var not in _ENV_NOT_FIELDS:
            name = var[len(_ENV_PREFIX):].lower()
            if name in engine_types:
                put(name, text, f"env {var}")
    for key, value in (cli or {}).items():
        if value is not None:
            put(key, value, cli_origin)

    engine = EngineConfig(**{k: v for k, v in values.items() if "." not in k})
    launch = LaunchConfig(**{k.split(".", 1)[1]: v for k, v in values.items() if k.startswith("launch.")})
    return PhalanxConfig(engine=engine, launch=launch, origins=origins)


def config_to_env(config: PhalanxConfig) -> str:
    """Serialise the engine part of a resolved config for ``PHALANX_CONFIG_JSON``."""
    origins = {k: v for k, v in config.origins.items() if "." not in k}
    values = {k: getattr(config.engine, k) for k in origins}
    return json.dumps({"values": values, "origins": origins})
