"""The launcher flags of torchrun and Accelerate, as phalanx settings.

    phalanx launch --nproc_per_node 2 --master_port 29500 train.py              # torchrun's spellings
    phalanx launch --num_processes 4 --num_machines 2 --machine_rank 0 \\
        --main_process_ip 10.0.0.1 --main_process_port 29500 --mixed_precision bf16 train.py   # Accelerate's

Each entry names the phalanx setting it sets (``launch.nproc_per_node``, ``precision``) or one of the targets below
that are not settings. ``phalanx.flags`` turns the table into argparse flags and folds the values into the config.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx.config.dialects.names import ACCELERATE_PRECISIONS, precision_from_accelerate, strategy_from_zero_stage
from phalanx.config.dialects.parallelism import check_option
from phalanx.config.options import ConfigError

__all__ = [
    "DialectFlag", "DIALECT_FLAGS", "CONFIG_FILE", "TOTAL_PROCESSES", "USE_DEEPSPEED", "NO_SETTING", "PC_FLAG",
]  # fmt: skip

CONFIG_FILE = "(config file)"
"""The YAML file that ``--config`` names."""
TOTAL_PROCESSES = "(total processes)"
"""Accelerate's ``--num_processes``: processes over all machines, divided by the number of nodes."""
USE_DEEPSPEED = "(use deepspeed)"
"""Accelerate's ``--use_deepspeed``: a ZeRO strategy, of the stage given elsewhere or Accelerate's default 2."""
NO_SETTING = "(nothing)"
"""Accepted for compatibility; phalanx needs nothing from it."""


@dataclass(frozen=True)
class DialectFlag:
    spelling: str
    dialect: str
    target: str
    help: str
    convert: Callable[[str, str], Any] | None = None
    """``(text, spelling) -> value`` in phalanx's terms; None keeps the text (``config/settings.py`` parses it)."""
    switch: bool = False
    """A flag without a value (``--cpu``)."""
    metavar: str = "N"


def _whole(text: str, spelling: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{spelling} takes a whole number; got {text!r} (e.g. {spelling} 2)") from None


def _nproc(text: str, spelling: str) -> int:
    """torchrun's ``--nproc_per_node``: a number, or ``cpu``, ``gpu`` or ``auto`` as torchrun reads them."""
    word = text.lower()
    if word not in ("cpu", "gpu", "cuda", "auto"):
        return _whole(text, spelling)
    if word == "cpu":
        return os.cpu_count() or 1
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if word == "auto":
        return gpus or os.cpu_count() or 1
    if gpus == 0:
        raise ConfigError(f"{spelling} {text} asks for one process per GPU, and this machine has none (use -n N)")
    return gpus


def _accelerate_precision(text: str, spelling: str) -> str:
    return precision_from_accelerate(text, key=spelling)


def _zero_stage(text: str, spelling: str) -> str:
    return strategy_from_zero_stage(text, key=spelling)


def _positive_float(text: str, spelling: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"invalid {spelling}: got {text!r} (a positive number, e.g. {spelling} 1.0)")
    return value


def _cpu(text: str, spelling: str) -> str:
    return "cpu"


_OFFLOAD_DEVICES = {"none": "none", "cpu": "cpu", "nvme": "disk"}


def _offload_device(text: str, spelling: str) -> str:
    """Accelerate's DeepSpeed offload devices: none, cpu, nvme (phalanx's disk: memory-mapped files)."""
    if text not in _OFFLOAD_DEVICES:
        raise ConfigError(f"invalid {spelling}: got {text!r} (none, cpu or nvme, as Accelerate takes it)")
    return _OFFLOAD_DEVICES[text]


def _pc_option(key: str) -> Callable[[str, str], Any]:
    """An option of ParallelismConfig's sequence splits, checked as every front checks it (``parallelism.py``);
    ``phalanx.flags`` reads the options given together with the sizes, for the notes."""

    def convert(text: str, spelling: str) -> Any:
        return check_option(key, text, lambda name: spelling if name == key else PC_FLAG + name)

    return convert


PC_FLAG = "--parallelism_config_"
"""The prefix of Accelerate's ParallelismConfig flags."""


def _mesh_flag(axis: str, help: str) -> DialectFlag:
    return DialectFlag(f"--parallelism_config_{axis}", "Accelerate", axis, help, _whole)


def _pc_flag(key: str, help: str, metavar: str) -> DialectFlag:
    return DialectFlag(PC_FLAG + key, "Accelerate", NO_SETTING, help, _pc_option(key), metavar=metavar)


def _torchrun(
    name: str, help: str, convert: Callable[[str, str], Any] | None = _whole, metavar: str = "N"
) -> DialectFlag:
    return DialectFlag("--" + name, "torchrun", "launch." + name, help, convert, metavar=metavar)


_STAGES = ", ".join(f"{s}={strategy_from_zero_stage(s)}" for s in range(4))

DIALECT_FLAGS: tuple[DialectFlag, ...] = (
    _torchrun("nproc_per_node", "= -n; also cpu, gpu or auto as torchrun reads them", _nproc),
    _torchrun("node_rank", "= --node-rank"),
    _torchrun("master_addr", "= --master-addr", None, "ADDR"),
    _torchrun("master_port", "= --master-port", metavar="PORT"),
    _torchrun("rdzv_endpoint", "= --rdzv-endpoint", None, "HOST:PORT"),
    _torchrun("max_restarts", "= --max-restarts"),
    DialectFlag("--standalone", "torchrun", NO_SETTING, "one node, local rendezvous (phalanx's default)", switch=True),
    DialectFlag(
        "--num_processes",
        "Accelerate",
        TOTAL_PROCESSES,
        "processes over ALL machines; each runs num_processes / num_machines of them",
        _whole,
    ),
    DialectFlag("--num_machines", "Accelerate", "launch.nnodes", "= --nnodes", _whole),
    DialectFlag("--machine_rank", "Accelerate", "launch.node_rank", "= --node-rank", _whole),
    DialectFlag("--main_process_ip", "Accelerate", "launch.master_addr", "= --master-addr", metavar="ADDR"),
    DialectFlag("--main_process_port", "Accelerate", "launch.master_port", "= --master-port", _whole, metavar="PORT"),
    DialectFlag(
        "--mixed_precision",
        "Accelerate",
        "precision",
        "= --precision: " + ", ".join(f"{k}={v}" for k, v in ACCELERATE_PRECISIONS.items()),
        _accelerate_precision,
        metavar="{" + ",".join(ACCELERATE_PRECISIONS) + "}",
    ),
    DialectFlag("--gradient_accumulation_steps", "Accelerate", "grad_accum_steps", "= --grad-accum-steps"),
    DialectFlag(
        "--gradient_clipping",
        "Accelerate",
        "max_grad_norm",
        "= --max-grad-norm (Accelerate's DeepSpeed clipping)",
        _positive_float,
        metavar="NORM",
    ),
    DialectFlag(
        "--use_deepspeed",
        "Accelerate",
        USE_DEEPSPEED,
        "a ZeRO strategy: the stage of --zero_stage, of the DeepSpeed file, or else 2 (Accelerate's default)",
        switch=True,
    ),
    DialectFlag(
        "--zero_stage",
        "Accelerate",
        "strategy",
        f"ZeRO stage as --strategy: {_STAGES}",
        _zero_stage,
        metavar="{0,1,2,3}",
    ),
    DialectFlag(
        "--offload_optimizer_device",
        "Accelerate",
        "offload",
        "= --offload: none, cpu, nvme (= disk, with --offload_optimizer_nvme_path as --offload-dir)",
        _offload_device,
        metavar="{none,cpu,nvme}",
    ),
    DialectFlag(
        "--offload_param_device",
        "Accelerate",
        "offload",
        "= --offload (zero3: the parameter shards live where the optimizer state does; two tiers are refused)",
        _offload_device,
        metavar="{none,cpu,nvme}",
    ),
    DialectFlag("--offload_optimizer_nvme_path", "Accelerate", "offload_dir", "= --offload-dir", metavar="DIR"),
    DialectFlag("--offload_param_nvme_path", "Accelerate", "offload_dir", "= --offload-dir", metavar="DIR"),
    DialectFlag("--config_file", "Accelerate", CONFIG_FILE, "= --config", metavar="FILE"),
    DialectFlag(
        "--deepspeed_config_file", "Accelerate", "deepspeed", "= --deepspeed (a DeepSpeed JSON config)", metavar="FILE"
    ),
    DialectFlag("--multi_gpu", "Accelerate", NO_SETTING, "accepted: phalanx uses every process -n starts", switch=True),
    DialectFlag("--cpu", "Accelerate", "device", "= --device cpu", _cpu, switch=True),
    _mesh_flag("tp_size", "= --tp-size"),
    _mesh_flag("dp_shard_size", "= --dp-shard-size"),
    _mesh_flag("dp_replicate_size", "= --dp-replicate-size"),
    _mesh_flag("cp_size", "= --cp-size (ring attention)"),
    _mesh_flag("sp_size", "= --sp-size (Ulysses, DeepSpeed's ALST)"),
    _pc_flag("cp_backend", "torch only: phalanx's ring attention stands in for torch's context_parallel", "NAME"),
    _pc_flag(
        "cp_comm_strategy",
        "allgather or alltoall: accepted, with a note (phalanx's ring passes kv chunks point-to-point)",
        "{allgather,alltoall}",
    ),
    _pc_flag("sp_backend", "deepspeed only: phalanx's --sp-size is DeepSpeed's ALST/Ulysses", "NAME"),
    _pc_flag("sp_seq_length", "accepted: phalanx reads each batch's length", "TOKENS"),
    _pc_flag("sp_seq_length_is_variable", "accepted: phalanx takes any length in every batch", "{true,false}"),
    _pc_flag(
        "sp_attn_implementation",
        "sdpa; flash attention is accepted with a note (phalanx's Ulysses runs SDPA), eager is refused",
        "NAME",
    ),
    DialectFlag(
        "--use_parallelism_config",
        "Accelerate",
        NO_SETTING,
        "accepted: phalanx reads the --parallelism_config_* sizes with or without it",
        switch=True,
    ),
)
