"""Accelerate's config file (``accelerate config`` writes it to ``default_config.yaml``) in phalanx's settings.

``phalanx launch --config default_config.yaml train.py`` runs it unchanged. Every key is either mapped (the origin
shown by ``phalanx config`` names it), ignored with a reason (it has no meaning here, e.g. the TPU keys), or an
error that names what to use instead (a value phalanx cannot honour, e.g. ``distributed_type: MEGATRON_LM``).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.config.dialects.mapping import Mapped, offload_for
from phalanx.config.dialects.names import precision_from_accelerate, strategy_from_zero_stage
from phalanx.config.dialects.parallelism import NAMES as PC_NAMES
from phalanx.config.dialects.parallelism import NOT_ACCELERATE, read_parallelism
from phalanx.config.options import ConfigError

__all__ = ["is_accelerate_config", "from_accelerate", "KNOWN_KEYS"]

# Keys that only an Accelerate config has; a phalanx YAML has none of them.
_MARKERS = {"compute_environment", "distributed_type", "num_machines", "main_training_function", "use_cpu"}
_NONE = ("none", None, False)
_KNOWN_TOP = {
    "distributed_type", "mixed_precision", "use_cpu", "num_processes", "num_machines", "machine_rank",
    "main_process_ip", "main_process_port", "rdzv_backend", "gpu_ids", "deepspeed_config", "fsdp_config",
    "dynamo_config", "dynamo_backend", "parallelism_config", "debug",
}  # fmt: skip
# The keys of a SageMaker config (compute_environment: AMAZON_SAGEMAKER): Accelerate submits a training job there.
_SAGEMAKER = {
    "ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "base_job_name", "pytorch_version",
    "transformers_version", "py_version", "sagemaker_inputs_file", "sagemaker_metrics_file", "additional_args",
}  # fmt: skip


def is_accelerate_config(data: dict[str, Any]) -> bool:
    return bool(_MARKERS & set(data))


def _error(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"accelerate config: {key}={value!r} cannot be honoured by phalanx; {fix}")


def _flag(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("true", "yes", "1"))


def _offload(device: Any, key: str) -> str:
    text = str(device).lower() if device not in _NONE else "none"
    mapping = {"none": "none", "cpu": "cpu", "nvme": "disk"}
    if text not in mapping:
        raise ConfigError(f"invalid {key}: got {device!r} (use none, cpu or nvme)")
    return mapping[text]


_IGNORED_TOP = {
    "compute_environment": "phalanx runs on the machines it is launched on",
    "downcast_bf16": "a TPU setting",
    "main_training_function": "names the function for Accelerate's notebook and TPU launchers; phalanx runs the script",
    "same_network": "phalanx always connects to main_process_ip:main_process_port",
    "enable_cpu_affinity": "phalanx sets OMP_NUM_THREADS per rank and leaves affinity to the OS",
    "ipex_config": "Intel extension settings; phalanx does not use IPEX",
    "mpirun_config": "no hostfile: phalanx launch starts the processes of this machine",
    "commands": "TPU pod commands",
    "command_file": "TPU pod commands",
    "megatron_lm_config": "read only with distributed_type MEGATRON_LM",
    "fp8_config": "read only with mixed_precision fp8",
    **{
        key: "a TPU setting" for key in ("tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_env")
    },
}


def from_accelerate(data: dict[str, Any], where: str, read_json: Callable[[str], dict[str, Any]]) -> Mapped:
    """Translate an Accelerate config. ``read_json`` reads a DeepSpeed file named by ``deepspeed_config_file``."""
    out = Mapped("accelerate")
    dtype = str(data.get("distributed_type", "NO")).upper()
    for key in sorted(set(data) - KNOWN_KEYS[""]):
        close = difflib.get_close_matches(key, sorted(KNOWN_KEYS[""]), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"accelerate config {where}: unknown key {key!r}; {hint}(phalanx reads the keys that "
            "`accelerate config` writes)"
        )
    environment = str(data.get("compute_environment", "LOCAL_MACHINE")).upper()
    sagemaker = sorted(_SAGEMAKER & set(data))
    if environment != "LOCAL_MACHINE" or sagemaker:
        asked = f"compute_environment={environment}" if environment != "LOCAL_MACHINE" else ", ".join(sagemaker)
        raise ConfigError(
            f"accelerate config {where}: {asked} asks Accelerate to submit an Amazon SageMaker training job, which "
            "phalanx launch does not do: it runs on the machines it is started on. Inside a SageMaker job, start "
            "`phalanx launch` from the job's entry point with compute_environment: LOCAL_MACHINE and without the "
            "SageMaker keys"
        )
    for key, value in data.items():
        if key in _IGNORED_TOP:
            if key == "compute_environment":
                out.ignore(key, "LOCAL_MACHINE: " + _IGNORED_TOP[key])
            else:
                out.ignore(key, _IGNORED_TOP[key])
        elif key == "debug":
            if _flag(value):
                out.set("debug_collectives", True, "debug")
            else:
                out.ignore(key, "false: no collective checks")
        elif key == "dynamo_config" or key == "dynamo_backend":
            backend = value.get("dynamo_backend", "NO") if isinstance(value, dict) else value
            if str(backend).upper() not in ("NO", "NONE"):
                raise _error(
                    key,
                    value,
                    "phalanx does not compile models for you: call model = torch.compile(model) "
                    "in the script before engine.prepare, and set dynamo_backend: 'NO'",
                )
            out.ignore(key, "dynamo_backend NO: no compilation asked for")
        elif key == "parallelism_config":
            _map_parallelism(value, out)
    _map_world(data, dtype, out)
    if "mixed_precision" in data:
        out.set("precision", precision_from_accelerate(data["mixed_precision"]), "mixed_precision")
    if dtype == "DEEPSPEED":
        _map_deepspeed(data.get("deepspeed_config") or {}, out, where, read_json)
    elif data.get("deepspeed_config"):
        out.ignore("deepspeed_config", f"read only with distributed_type DEEPSPEED; got {dtype}")
    hostfile = (
        (data.get("mpirun_config") or {}).get("mpirun_hostfile")
        if isinstance(data.get("mpirun_config"), dict)
        else None
    )
    if hostfile:
        raise ConfigError(
            f"accelerate config {where}: mpirun_config.mpirun_hostfile={hostfile!r} asks Accelerate to start the "
            "processes of several machines through mpirun, which phalanx launch does not do. Start them with mpirun "
            f"yourself (the Engine reads its environment): mpirun -f {hostfile} -n <processes> python train.py, or "
            "run phalanx launch --nnodes N --node-rank R --master-addr ADDR train.py on each machine"
        )
    if dtype == "FSDP":
        _map_fsdp(data.get("fsdp_config") or {}, out, int(data.get("num_machines", 1) or 1))
    elif data.get("fsdp_config"):
        out.ignore("fsdp_config", f"read only with distributed_type FSDP; got {dtype}")
    return out


_DEVICE_TYPES = {"NO": None, "MULTI_CPU": "cpu", "MULTI_GPU": "auto", "DEEPSPEED": "auto", "FSDP": "auto"}


def _map_world(data: dict[str, Any], dtype: str, out: Mapped) -> None:
    if dtype not in _DEVICE_TYPES:
        fixes = {
            "MEGATRON_LM": "use strategy pipeline (pipeline stages, with data parallelism) "
            "or zero3 (sharded parameters)",
            "XLA": "phalanx runs on CPUs and CUDA GPUs; use MULTI_GPU or MULTI_CPU",
            "TPU": "phalanx runs on CPUs and CUDA GPUs; use MULTI_GPU or MULTI_CPU",
        }
        raise _error(
            "distributed_type",
            dtype,
            fixes.get(dtype, "phalanx runs on CPUs and CUDA GPUs; use NO, MULTI_CPU, MULTI_GPU, DEEPSPEED or FSDP"),
        )
    device = "cpu" if _flag(data.get("use_cpu")) else _DEVICE_TYPES[dtype]
    if device is not None:
        out.set("device", device, "use_cpu" if _flag(data.get("use_cpu")) else "distributed_type")
    if dtype in ("NO", "MULTI_CPU", "MULTI_GPU"):
        out.set("strategy", "ddp", "distributed_type")
    if "use_cpu" in data and not _flag(data["use_cpu"]) and device is None:
        out.ignore("use_cpu", "false: the device follows distributed_type")

    machines = int(data.get("num_machines", 1) or 1)
    if "num_machines" in data:
        out.set("launch.nnodes", machines, "num_machines")
    if "num_processes" in data:
        total = data["num_processes"]
        if not isinstance(total, int) or total < 1 or total % machines:
            raise ConfigError(
                f"accelerate config: num_processes={total!r} is the total over all machines and must be a positive "
                f"multiple of num_machines={machines} (each machine runs num_processes / num_machines processes)"
            )
        out.set("launch.nproc_per_node", 1 if dtype == "NO" else total // machines, "num_processes")
        if dtype == "NO" and total > 1:
            out.notes.append(
                f"num_processes={total} with distributed_type NO runs one process (as Accelerate does); "
                "use MULTI_CPU or MULTI_GPU for several"
            )
    for key, target in (("machine_rank", "launch.node_rank"), ("main_process_ip", "launch.master_addr")):
        if data.get(key) is not None:
            out.set(target, data[key], key)
    port = data.get("main_process_port")
    if port is not None:
        if not isinstance(port, int):
            raise ConfigError(
                f"accelerate config: main_process_port must be a port number; got {port!r} (write the "
                "port node 0 listens on, e.g. 29500)"
            )
        out.set("launch.master_port", port, "main_process_port")
    backend = str(data.get("rdzv_backend", "static"))
    if backend == "c10d":
        if data.get("main_process_ip") is None or port is None:
            raise ConfigError("accelerate config: rdzv_backend c10d needs main_process_ip and main_process_port")
        out.set("launch.rdzv_endpoint", f"{data['main_process_ip']}:{port}", "rdzv_backend")
    elif backend != "static":
        raise _error("rdzv_backend", backend, "use static (node 0's address and port) or c10d")
    elif "rdzv_backend" in data:
        out.ignore("rdzv_backend", "static is phalanx's default: node 0's address and port")
    gpu_ids = data.get("gpu_ids")
    if gpu_ids is not None and str(gpu_ids).lower() != "all":
        raise _error(
            "gpu_ids",
            gpu_ids,
            "phalanx uses every visible GPU, one per local rank: set "
            f"CUDA_VISIBLE_DEVICES={gpu_ids} before phalanx launch, and gpu_ids: all",
        )
    if gpu_ids is not None:
        out.ignore("gpu_ids", "all: every visible GPU, one per local rank")


_DS_IGNORED = {
    "deepspeed_multinode_launcher": "phalanx launch runs on every node, as Accelerate's 'standard' launcher",
    "zero3_init_flag": "phalanx's zero3 shards the parameters at engine.prepare; "
    "the model is built whole on the host first",
    "zero3_save_16bit_model": "engine.save_model always writes the full gathered weights, in the parameters' dtype",
    "deepspeed_moe_layer_cls_names": "Accelerate marks these classes as DeepSpeed ZeRO-3 leaf modules "
    "(set_z3_leaf_modules), so that a MoE block is gathered whole whichever experts a step routes to; phalanx's zero3 "
    "always gathers a unit whole, experts included (units: zero3_unit_classes), and under expert parallelism "
    "(ep_size) phalanx finds the experts from the model's base_model_ep_plan, not from class names",
}


_DS_MAPPED = {
    "zero_stage", "deepspeed_config_file", "gradient_accumulation_steps", "gradient_clipping",
    "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path",
}  # fmt: skip
_DS_HOSTFILE = ("deepspeed_hostfile", "deepspeed_inclusion_filter", "deepspeed_exclusion_filter")
_FSDP_NOTED = {
    "fsdp_state_dict_type": "engine.save_state always writes sharded checkpoints that resume on any world size; "
    "engine.save_model writes the full model",
    "fsdp_sync_module_states": "phalanx always broadcasts rank 0's parameters at prepare",
    "fsdp_use_orig_params": "prepared models keep their original parameters' names",
    "fsdp_cpu_ram_efficient_loading": "the model is built on each rank; rank 0's values are broadcast",
    "fsdp_version": "phalanx's zero3 is its own; the FSDP1 and FSDP2 keys both map onto it",
    "fsdp_min_num_params": "read only with SIZE_BASED_WRAP, which phalanx does not do",
}
_FSDP_MAPPED = {
    "fsdp_reshard_after_forward", "fsdp_sharding_strategy", "fsdp_offload_params",
    "fsdp_transformer_layer_cls_to_wrap", "fsdp_auto_wrap_policy", "fsdp_backward_prefetch",
    "fsdp_backward_prefetch_policy", "fsdp_forward_prefetch", "fsdp_activation_checkpointing", "fsdp_ignored_modules",
}  # fmt: skip
# Accelerate's ParallelismConfig, as `accelerate config` writes it (each key prefixed, as the launcher's flags are);
# parallelism.py reads it, as it reads the Accelerator's and TrainingArguments' ParallelismConfig.
_PC = "parallelism_config_"
# Accelerate 1.11's ALST spellings (cp_backend: deepspeed with these), renamed sp_* since.
_PC_RENAMED = {"cp_seq_length": "sp_seq_length", "cp_seq_length_is_variable": "sp_seq_length_is_variable",
               "cp_attn_implementation": "sp_attn_implementation"}  # fmt: skip
# DeepSpeed keys that `accelerate config` users put in the deepspeed_config section, which Accelerate hands to
# nothing (no launcher flag or plugin field reads them), with what phalanx does instead.
_DS_PASSED_OVER = {
    "seq_parallel_communication_data_type": "Accelerate passes it to nothing (in a DeepSpeed JSON it is the dtype of "
    "the sequence-parallel communication); phalanx's Ulysses all-to-alls move the activations in their own dtype "
    "(the precision's compute dtype)",
}
# Every key each section of an Accelerate config may hold, as this module reads them; a key outside its section's
# set is an error. keys.py builds the table of what phalanx does with each (docs/config-keys.md) from these sets.
KNOWN_KEYS: dict[str, frozenset[str]] = {
    "": frozenset(_KNOWN_TOP | set(_IGNORED_TOP) | _SAGEMAKER),
    "deepspeed_config": frozenset(_DS_MAPPED | set(_DS_IGNORED) | set(_DS_HOSTFILE) | set(_DS_PASSED_OVER)),
    "fsdp_config": frozenset(_FSDP_MAPPED | set(_FSDP_NOTED)),
    "parallelism_config": frozenset(_PC + name for name in PC_NAMES),
}


def _map_parallelism(section: Any, out: Mapped) -> None:
    """Accelerate's ``parallelism_config``: its sizes are phalanx's mesh sizes, taken as they are written (Accelerate,
    too, needs their product to be the number of processes); cp_size is ring attention, sp_size Ulysses, and their
    options are mapped, noted or refused by ``parallelism.py``."""
    if section in (None, {}):
        out.ignore("parallelism_config", "empty: no device mesh asked for")
        return
    if not isinstance(section, dict):
        raise ConfigError(
            f"accelerate config: parallelism_config must be a mapping of sizes such as "
            f"{{{_PC}tp_size: 2}}; got {section!r}"
        )
    for key in section:
        if _PC + str(key) in KNOWN_KEYS["parallelism_config"]:
            raise ConfigError(
                f"accelerate config: parallelism_config.{key} is not read by Accelerate, which reads the prefixed "
                f"name; did you mean '{_PC}{key}'? (as `accelerate config` writes it)"
            )
        renamed = _PC_RENAMED.get(str(key).removeprefix(_PC))
        if renamed is not None:
            raise ConfigError(
                f"accelerate config: parallelism_config.{key} is Accelerate 1.11's ALST spelling; Accelerate now "
                f"reads '{_PC}{renamed}' (with {_PC}sp_size and {_PC}sp_backend: deepspeed for ALST/Ulysses, which "
                "is phalanx's sp_size)"
            )
        if str(key).removeprefix(_PC) in NOT_ACCELERATE:
            raise ConfigError(f"accelerate config: parallelism_config.{key}: {NOT_ACCELERATE[key.removeprefix(_PC)]}")
        if key not in KNOWN_KEYS["parallelism_config"]:
            raise _unknown("parallelism_config", key)
    values = {key.removeprefix(_PC): value for key, value in section.items() if value is not None}
    try:
        reading = read_parallelism(values, lambda name: f"parallelism_config.{_PC}{name}")
    except ConfigError as e:
        raise ConfigError(f"accelerate config: {e}") from None
    if not reading.asks_for_a_mesh:
        out.ignore("parallelism_config", "every size is 1: no device mesh asked for")
        return
    settings = reading.settings()
    for key, value in section.items():
        name, short = f"parallelism_config.{key}", key.removeprefix(_PC)
        if value is None:
            out.ignore(name, "null: unset")
        elif short in settings:
            out.set(short, settings[short], name)
        else:
            out.ignore(name, reading.accepted[short])
    out.notes.extend(reading.notes)


def _unknown(section: str, key: str) -> ConfigError:
    known = sorted(KNOWN_KEYS[section])
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"accelerate config: unknown key '{section}.{key}'; {hint}known: {', '.join(known)}")


def _map_deepspeed(ds: dict[str, Any], out: Mapped, where: str, read_json: Callable[[str], dict[str, Any]]) -> None:
    """Accelerate's ``deepspeed_config`` section: either inline keys, or a ``deepspeed_config_file``."""
    from phalanx.config.dialects.deepspeed import from_deepspeed

    for key in ds:
        if key not in KNOWN_KEYS["deepspeed_config"]:
            raise _unknown("deepspeed_config", key)
    file = ds.get("deepspeed_config_file")
    if file:
        inline = [
            k for k in ds if k not in ("deepspeed_config_file", "deepspeed_multinode_launcher", "zero3_init_flag")
        ]
        if inline:
            raise ConfigError(
                f"accelerate config: deepspeed_config_file={file!r} and the keys {', '.join(inline)} "
                "both configure DeepSpeed; keep them in the JSON file only (Accelerate refuses this too)"
            )
        path = Path(file)  # Accelerate opens it as given: relative to the working directory, not to the YAML
        beside = Path(where).parent / file
        if not path.is_file() and not path.is_absolute() and beside.is_file():
            raise ConfigError(
                f"accelerate config {where}: deepspeed_config_file={file!r} is not in the working directory "
                f"({Path.cwd()}), where Accelerate looks for it; there is one next to the YAML ({beside}). Run from "
                "there, or write the path from the working directory (or an absolute one)"
            )
        out.merge(from_deepspeed(read_json(str(path)), str(path)), prefix="deepspeed_config_file: ")
        out.set("deepspeed", str(path), "deepspeed_config_file")
    else:
        # Accelerate's default stage, when the section names none, is 2.
        stage = strategy_from_zero_stage(ds.get("zero_stage", 2), "deepspeed_config.zero_stage")
        out.set("strategy", stage, "deepspeed_config.zero_stage")
        if "gradient_clipping" not in ds:  # Accelerate writes "auto" into the config it builds, then fills 1.0
            filled = float(os.environ.get("ACCELERATE_GRADIENT_CLIPPING", "1.0"))
            out.fill(
                "max_grad_norm",
                filled,
                f"deepspeed_config.gradient_clipping (absent: {filled}, as Accelerate fills it)",
            )
    for key, value in ds.items():
        name = f"deepspeed_config.{key}"
        if key in _DS_IGNORED:
            if key == "deepspeed_multinode_launcher" and str(value) != "standard":
                raise _error(
                    name,
                    value,
                    "phalanx launch is started on every node (Accelerate's 'standard' launcher); "
                    "use deepspeed_multinode_launcher: standard",
                )
            out.ignore(name, _DS_IGNORED[key])
        elif key in _DS_PASSED_OVER:
            out.ignore(name, _DS_PASSED_OVER[key])
        elif key in _DS_HOSTFILE:
            raise _error(
                name,
                value,
                "phalanx launch does not read hostfiles: run it on each node with --nnodes, "
                "--node-rank and --master-addr",
            )
        elif key == "gradient_accumulation_steps":
            out.set("grad_accum_steps", value, name)
        elif key == "gradient_clipping":
            if value not in (None, 0, 0.0, "none"):
                out.set("max_grad_norm", float(value), name)
            else:
                out.ignore(name, f"{value!r}: no clipping")
        elif key in ("offload_optimizer_nvme_path", "offload_param_nvme_path"):
            if value not in _NONE and str(value).lower() != "none":
                out.set("offload_dir", str(value), name)
            else:
                out.ignore(name, f"{value!r}: no path")
    if "offload_optimizer_device" in ds or "offload_param_device" in ds:
        opt = _offload(ds.get("offload_optimizer_device"), "deepspeed_config.offload_optimizer_device")
        par = _offload(ds.get("offload_param_device"), "deepspeed_config.offload_param_device")
        stage = out.get("strategy")
        offload_for(out, opt, par, stage, "deepspeed_config.offload_optimizer_device / offload_param_device")


# FSDP1's sharding strategies by name and by number (Accelerate numbers them from 1 in this order).
_SHARDING = {
    "FULL_SHARD": "zero3", "1": "zero3", "SHARD_GRAD_OP": "zero2", "2": "zero2", "NO_SHARD": "ddp", "3": "ddp",
    "HYBRID_SHARD": "zero3", "4": "zero3", "HYBRID_SHARD_ZERO2": "zero2", "5": "zero2",
}  # fmt: skip
_HYBRID = ("HYBRID_SHARD", "4", "HYBRID_SHARD_ZERO2", "5")


def _map_fsdp(fsdp: dict[str, Any], out: Mapped, machines: int) -> None:
    """Accelerate's ``fsdp_config``: FSDP1 sharding strategies and FSDP2's reshard_after_forward onto zero3 / zero2;
    HYBRID_SHARD (and _ZERO2) onto hybrid sharding: shards within each machine, replicas across machines."""
    strategy = "zero3"
    source = "distributed_type"
    if "fsdp_reshard_after_forward" in fsdp:
        value = fsdp["fsdp_reshard_after_forward"]
        text = str(value).upper()
        strategy = {"TRUE": "zero3", "FALSE": "zero2"}.get(text) or _SHARDING.get(text, "")
        source = "fsdp_config.fsdp_reshard_after_forward"
    elif "fsdp_sharding_strategy" in fsdp:
        value = fsdp["fsdp_sharding_strategy"]
        strategy = _SHARDING.get(str(value).upper(), "")
        source = "fsdp_config.fsdp_sharding_strategy"
    if not strategy:
        raise _error(
            source,
            value,
            "use FULL_SHARD (zero3), SHARD_GRAD_OP (zero2), NO_SHARD (ddp), HYBRID_SHARD or HYBRID_SHARD_ZERO2 "
            "(zero3 or zero2 sharded within each machine, replicated across machines), or 1-5 for the same",
        )
    out.set("strategy", strategy, source)
    if source != "distributed_type" and str(value).upper() in _HYBRID:
        _hybrid(value, source, strategy, machines, out)
    for key, value in fsdp.items():
        name = f"fsdp_config.{key}"
        if key not in KNOWN_KEYS["fsdp_config"]:
            raise _unknown("fsdp_config", key)
        if key in ("fsdp_reshard_after_forward", "fsdp_sharding_strategy"):
            continue
        if key == "fsdp_offload_params":
            if _flag(value):
                if strategy == "ddp":
                    raise _error(name, value, "offload needs sharding: use FULL_SHARD or SHARD_GRAD_OP")
                out.set("offload", "cpu", name)
            else:
                out.ignore(name, "false: nothing offloaded")
        elif key == "fsdp_transformer_layer_cls_to_wrap":
            if strategy == "zero3":
                classes = ",".join(value) if isinstance(value, list) else str(value)
                out.set("zero3_unit_classes", classes, name)
            else:
                out.ignore(name, f"{strategy} does not gather parameters per module, so it has no units")
        elif key == "fsdp_auto_wrap_policy":
            if str(value).upper() == "SIZE_BASED_WRAP":
                out.notes.append(
                    "fsdp_auto_wrap_policy SIZE_BASED_WRAP: phalanx's zero3 makes one unit per child "
                    "module with parameters (or per class in fsdp_transformer_layer_cls_to_wrap)"
                )
            out.ignore(
                name,
                "zero3's units are each child module with parameters, or the classes in "
                "fsdp_transformer_layer_cls_to_wrap",
            )
        elif key in ("fsdp_backward_prefetch", "fsdp_backward_prefetch_policy", "fsdp_forward_prefetch"):
            if strategy == "zero3":
                on = _flag(value) or str(value).upper() in ("BACKWARD_PRE", "BACKWARD_POST")
                if key != "fsdp_forward_prefetch" or on:
                    out.set("zero3_prefetch", on, name)
                else:
                    out.ignore(name, "false: zero3_prefetch follows fsdp_backward_prefetch")
            else:
                out.ignore(name, f"{strategy} does not gather parameters")
        elif key == "fsdp_activation_checkpointing":
            if _flag(value):  # FSDP checkpoints each wrapped layer: phalanx every block (zero3's units)
                out.set("activation_checkpointing", "full", name)
            else:
                out.ignore(name, "false")
        elif key == "fsdp_ignored_modules":
            if value not in (None, [], ""):
                raise ConfigError(
                    f"accelerate config: {name}={value!r} leaves modules out of sharding, and phalanx's zero3 shards "
                    "every module; remove the key, or train those modules' owner outside the prepared model"
                )
            out.ignore(name, f"{value!r}: no module is left out")
        else:
            out.ignore(name, _FSDP_NOTED[key])


def _hybrid(value: Any, source: str, strategy: str, machines: int, out: Mapped) -> None:
    """FSDP's HYBRID_SHARD: torch builds its shard groups from the devices of one machine and replicates across
    machines. Here that is dp_replicate_size = num_machines, with dp_shard_size taking the rest (the processes of
    one machine), so that a process count given on the command line keeps the same layout."""
    said = out.get("dp_replicate_size"), out.get("dp_shard_size")
    if said != (None, None):
        raise ConfigError(
            f"accelerate config: {source}={value!r} and parallelism_config's dp sizes both say how the ranks shard "
            f"and replicate (dp_replicate_size={said[0]}, dp_shard_size={said[1]}); Accelerate takes "
            "parallelism_config with FSDP2 only. Keep one: HYBRID_SHARD (shards within each machine), or "
            "fsdp_reshard_after_forward with parallelism_config's dp_shard_size and dp_replicate_size"
        )
    out.set("dp_replicate_size", machines, f"{source} (num_machines={machines}: one replica per machine)")
    if machines == 1:
        out.notes.append(
            f"{source}={value!r} on one machine is {strategy} over all its processes: FSDP's hybrid sharding "
            "shards within a machine and replicates across machines, and with one machine there is nothing to "
            "replicate across (as in torch's FSDP)"
        )
    else:
        out.notes.append(
            f"{source}={value!r}: {strategy} shards within each machine (dp_shard_size = the processes of one "
            f"machine) and replicates over the {machines} machines (dp_replicate_size={machines}), as FSDP does"
        )
