"""DeepSpeed's JSON config (``ds_config.json``) in phalanx's settings.

``phalanx launch --deepspeed ds_config.json train.py``, a ``deepspeed:`` key in a phalanx YAML, or Accelerate's
``deepspeed_config_file`` read it. DeepSpeed silently ignores a top-level key it does not know; phalanx does not:
an unknown key is an error with a suggestion. ``"auto"`` (as Hugging Face writes it) leaves a value to phalanx: the
batch sizes come from the script's DataLoader and the batch rule, the rest keep phalanx's defaults. The
``optimizer`` and ``scheduler`` blocks are built at ``engine.prepare`` when the script passes none
(``deepspeed_blocks.py``).
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

from phalanx.config.dialects.deepspeed_moe import EP_KEYS, map_expert_parallel
from phalanx.config.dialects.mapping import Mapped, offload_for
from phalanx.config.dialects.names import strategy_from_zero_stage
from phalanx.config.options import ConfigError
from phalanx.config.registry import shards

__all__ = ["read_deepspeed", "from_deepspeed", "is_auto", "KNOWN_KEYS"]

_MIB = 2**20

# Keys with no meaning in phalanx, and why. A block here with "enabled": true asks for a feature phalanx lacks.
_IGNORED = {
    "steps_per_print": "phalanx reports progress through its progress bar and metric sinks",
    "wall_clock_breakdown": "benchmarks/ measures phalanx against its peers",
    "memory_breakdown": "engine.memory_report() gives the per-rank memory",
    "dump_state": "phalanx config prints the resolved settings",
    "prescale_gradients": "phalanx averages in the reduction: each bucket is scaled, then all-reduced",
    "gradient_predivide_factor": "phalanx averages in the reduction: each bucket is scaled, then all-reduced",
    "seq_parallel_communication_data_type": "the dtype of DeepSpeed's sequence-parallel communication; phalanx's "
    "Ulysses (sp_size) all-to-alls move the activations in their own dtype (the precision's compute dtype)",
    "zero_force_ds_cpu_optimizer": "phalanx steps your own optimizer on the host shard",
    "tensorboard": "phalanx's tracking writes TensorBoard when it is installed",
    "wandb": "use phalanx's tracking (JSONL, TensorBoard)",
    "csv_monitor": "phalanx's tracking writes JSONL",
    "comms_logger": "DeepSpeed's communication logger",
    "flops_profiler": "DeepSpeed's profiler",
    "checkpoint": "phalanx checkpoints are its own format (safetensors + JSON, resumable on any world size)",
    "aio": "phalanx's disk offload uses memory-mapped files",
    "data_types": "phalanx accumulates gradients in the parameters' dtype",
    "pipeline": "configures DeepSpeed's PipelineModule; use strategy pipeline",
    "elasticity": "phalanx resumes on any world size from its checkpoints",
    "autotuning": "DeepSpeed's autotuner",
    "compression_training": "DeepSpeed's compression library",
    "sparse_attention": "DeepSpeed's sparse attention kernels",
    "data_efficiency": "DeepSpeed's data efficiency library",
    "curriculum_learning": "DeepSpeed's curriculum library",
    "eigenvalue": "DeepSpeed's eigenvalue analysis",
    "progressive_layer_drop": "DeepSpeed's progressive layer drop",
    "comet": "use phalanx's tracking (JSONL, TensorBoard)",
    "timers": "DeepSpeed's timers; benchmarks/ measures phalanx",
    "log_level": "DeepSpeed's logger",
    "nebula": "DeepSpeed's Nebula checkpoint service; phalanx writes its own checkpoints",
    "disable_allgather": "a 1-bit Adam setting, and phalanx has no 1-bit optimizers",
    "dataloader_drop_last": "applies to the loader deepspeed.initialize(training_data=...) builds; phalanx prepares "
    "the script's DataLoader and keeps its drop_last",
    "graph_harvesting": "an HPU graph-capture option; phalanx runs on CPUs and CUDA GPUs",
    "sparse_gradients": "phalanx reduces embedding gradients as dense tensors; the update is the same",
    "vocabulary_size": "read by DeepSpeed's sparse embedding gradients only",
}
# Keys outside DeepSpeed's config schema too: DeepSpeed ignores them, and so does phalanx, saying so. A key close to a
# known one is taken for a typo instead, and refused.
# DeepSpeed features phalanx lacks, by the block that asks for them: refused when on, noted when off.
_FEATURES = {
    "quantize_training": ("quantization-aware training (quantize_training)", "enabled"),
    "hybrid_engine": ("the Hybrid Engine for RLHF generation (hybrid_engine)", "enabled"),
    "compile": ("DeepCompile (compile.deepcompile)", "deepcompile"),
}
_MAPPED = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "fp16",
    "bf16", "bfloat16", "zero_optimization", "optimizer", "scheduler", "zero_allow_untested_optimizer",
    "communication_data_type", "amp", "fp8", "torch_autocast", "gradient_allreduce_op",
    "managed_gradient_accumulation", "tensor_parallel", "sequence_parallel_size", "expert_parallel",
    "use_data_before_expert_parallelism", "activation_checkpointing", *_FEATURES,
}  # fmt: skip
_ZERO_IGNORED = {
    "allgather_bucket_size": "phalanx gathers per bucket (zero1/2) or per unit (zero3)",
    "allgather_partitions": "phalanx always all-gathers the updated shards",
    "contiguous_gradients": "phalanx's gradients always live in flat contiguous buckets",
    "overlap_comm": "phalanx always overlaps the reductions with backward",
    "round_robin_gradients": "phalanx's shards are contiguous slices",
    "sub_group_size": "phalanx steps the whole local shard (disk offload steps offload_chunk_mb at a time)",
    "load_from_fp32_weights": "phalanx checkpoints always hold the fp32 master weights",
    "elastic_checkpoint": "phalanx checkpoints always load on any world size",
    "stage3_prefetch_bucket_size": "zero3 prefetches one unit ahead (zero3_prefetch)",
    "stage3_param_persistence_threshold": "zero3 gathers every unit, small ones too; to gather small modules with "
    "their neighbours, choose the units with zero3_unit_classes (e.g. the transformer block's class)",
    "stage3_max_live_parameters": "zero3 holds at most the current and the prefetched unit",
    "stage3_max_reuse_distance": "zero3 frees each unit after use",
    "stage3_gather_16bit_weights_on_model_save": "engine.save_model always writes the full gathered weights",
    "stage3_gather_fp16_weights_on_model_save": "engine.save_model always writes the full gathered weights",
    "memory_efficient_linear": "a DeepSpeed kernel choice",
    "use_multi_rank_bucket_allreduce": "a DeepSpeed kernel choice",
    "stage3_module_granularity_threshold": "zero3's units are modules (zero3_unit_classes)",
    "log_trace_cache_warnings": "DeepSpeed's trace cache",
    "cpu_offload_use_pin_memory": "phalanx pins the host copies itself when the compute device is CUDA",
    "stage3_model_persistence_threshold": "zero3 gathers every unit, small ones too (zero3_unit_classes picks units)",
    "stage3_use_all_reduce_for_fetch_params": "zero3 all-gathers each unit's shards; the gathered values are the same",
    "stage3_allgather_sequential": "zero3 all-gathers each unit's shards; the gathered values are the same",
    "pipeline_loading_checkpoint": "phalanx checkpoints load on any layout",
    "override_module_apply": "a hook of DeepSpeed's zero3 into module.apply",
    "enable_sanity_checks": "DeepSpeed's internal checks",
    "save_muon_momentum_buffer_in_memory": "DeepSpeed's Muon optimizer buffers",
    "leaf_module": "zero3's units are chosen with zero3_unit_classes",
    "legacy_stage1": "phalanx's zero1 is its own",
}
# The unprefixed names DeepSpeed also accepts for the stage3_ keys.
_ZERO_IGNORED.update(
    {k.removeprefix("stage3_"): why for k, why in list(_ZERO_IGNORED.items()) if k.startswith("stage3_")}
)
# Off by default in DeepSpeed; a value that asks for them is an error, since phalanx cannot do it.
_ZERO_REFUSED = {
    "zero_quantized_weights": (False, "phalanx does not quantise communication; use comm_dtype bf16"),
    "zero_quantized_gradients": (False, "phalanx does not quantise communication; use comm_dtype bf16"),
    "mics_shard_size": (-1, "phalanx shards over all data-parallel ranks (no MiCS groups)"),
    "mics_hierarchical_params_gather": (False, "phalanx has no MiCS groups"),
    "zero_quantized_nontrainable_weights": (False, "phalanx does not quantise weights (ZeRO++ qwZ)"),
    "zeropp_loco_param": (None, "phalanx has no ZeRO++ LoCo gradient compression"),
}
_COMM_DTYPES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32",
                "float32": "fp32", "float": "fp32"}  # fmt: skip
_ZERO_MAPPED = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "reduce_scatter",
                "ignore_unused_parameters", "cpu_offload", "cpu_offload_param", "zenflow",
                "zero_hpz_partition_size"}  # fmt: skip
# DeepSpeed's AutoTP block (deepspeed/runtime/tensor_parallel/config.py, TPTrainingConfig), with its aliases.
_TP_NOTED = {
    "tp_overlap_comm": "overlaps DeepSpeed's row-parallel all-reduce with backward: a speed choice, the values are "
    "the same",
    "dtype": "the dtype deepspeed.tp_model_init converts the model to; phalanx's precision comes from bf16 / fp16",
    "keep_module_on_host": "where DeepSpeed keeps checkpoint weights while AutoTP loads them; phalanx splits the "
    "model's own weights at engine.prepare",
}
# Read by DeepSpeed only when set (None or false is its default); set, each is refused with why.
_TP_REFUSED = {
    "partition_config": "DeepSpeed's own layer specs (regular expressions to row or column); phalanx takes the "
    "split as tp_plan: a JSON object of module-name patterns to styles such as colwise and rowwise (--tp-plan)",
    "preset_model": "DeepSpeed's built-in plan for an architecture; phalanx takes the model's own plan (a "
    "transformers model's base_model_tp_plan) or tp_plan. Remove preset_model to use the model's plan, or write "
    "the split as tp_plan",
    "injection_policy_tuple": "an injection policy for DeepSpeed's AutoTP parser; give phalanx the split as tp_plan",
    "replace_with_kernel_inject": "DeepSpeed's fused inference kernels, which phalanx does not have",
    "kernel_inject": "DeepSpeed's fused inference kernels, which phalanx does not have",
}
_TP_GROUP = {
    "tp_grain_size": "AutoTP's granularity for uneven splits; phalanx splits each planned layer into tp_size equal "
    "parts",
    "mpu": "a Python object; phalanx builds the tensor-parallel groups from its own mesh",
    "tp_group": "a Python object; phalanx builds the tensor-parallel groups from its own mesh",
}
# DeepSpeed's activation_checkpointing block configures deepspeed.checkpointing.checkpoint, which the model calls on
# its own blocks: the block checkpoints nothing by itself. Its keys phalanx has no use for, and why.
_AC_IGNORED = {
    "partition_activations": "splits each checkpoint's saved input over DeepSpeed's model-parallel ranks; no phalanx "
    "equivalent (under tensor parallelism, sequence_parallel splits the activations of the norm and dropout regions)",
    "contiguous_memory_optimization": "lays DeepSpeed's partitioned checkpoints out in one buffer",
    "number_checkpoints": "sizes the buffer of contiguous_memory_optimization",
    "synchronize_checkpoint_boundary": "a CUDA synchronise at each DeepSpeed checkpoint, for profiling",
    "profile": "DeepSpeed's timers of its checkpoints",
}
# DeepSpeed's loss scaler defaults, used when the fp16 block is enabled and leaves a key out.
_FP16_DEFAULTS = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                  "min_loss_scale": 1}  # fmt: skip
_BF16_REFUSED = ("bf16_master_weights_and_grads", "bf16_optimizer_states")
_BF16_NOTED = ("immediate_grad_update", "check_grad_overflow")
# Every key each section of a DeepSpeed file may hold, as this module reads them; a key outside its section's set
# is an error. keys.py builds the table of what phalanx does with each (docs/config-keys.md) from these sets.
KNOWN_KEYS: dict[str, frozenset[str]] = {
    "": frozenset(_MAPPED | set(_IGNORED)),
    "zero_optimization": frozenset(_ZERO_MAPPED | set(_ZERO_IGNORED) | set(_ZERO_REFUSED)),
    "zero_optimization.offload_*": frozenset(
        {
            "device",
            "nvme_path",
            "pin_memory",
            "buffer_count",
            "buffer_size",
            "max_in_cpu",
            "fast_init",
            "ratio",
            "pipeline_read",
            "pipeline_write",
            "super_offload",
            "cpuadam_cores_perc",
        }  # fmt: skip
    ),
    "fp16": frozenset(
        {*_FP16_DEFAULTS, "enabled", "auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"}
    ),  # fmt: skip
    "bf16": frozenset({"enabled", *_BF16_REFUSED, *_BF16_NOTED}),
    "tensor_parallel": frozenset({"autotp_size", "tensor_parallel", "tp", *_TP_NOTED, *_TP_REFUSED}),
    "tensor_parallel.tp": frozenset({"tp_size", *_TP_GROUP}),
    "expert_parallel": EP_KEYS,
    "activation_checkpointing": frozenset({"cpu_checkpointing", *_AC_IGNORED}),
}


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def read_deepspeed(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"DeepSpeed config {str(p)!r} does not exist (check the path given to --deepspeed)")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {str(p)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {str(p)!r} must hold a JSON object; got {type(data).__name__}")
    return data


def _enabled(block: Any, key: str) -> bool | None:
    """``{"enabled": true}`` -> True; ``"auto"`` -> None (leave it to the other settings)."""
    if not isinstance(block, dict):
        raise ConfigError(f'DeepSpeed config: {key!r} must be an object such as {{"enabled": true}}; got {block!r}')
    value = block.get("enabled", False)
    return None if is_auto(value) else bool(value)


def from_deepspeed(data: dict[str, Any], where: str) -> Mapped:
    out = Mapped("deepspeed")
    for key in data:
        if key not in _MAPPED and key not in _IGNORED:
            close = difflib.get_close_matches(key, sorted(_MAPPED | set(_IGNORED)), n=1, cutoff=0.8)
            if close:
                raise ConfigError(
                    f"DeepSpeed config {where}: unknown key {key!r}; did you mean {close[0]!r}? (DeepSpeed would "
                    "silently ignore the misspelt key; phalanx refuses, so that the setting is not dropped)"
                )
            out.notes.append(
                f"DeepSpeed config {where}: {key!r} is not a DeepSpeed setting; DeepSpeed ignores it, and so does "
                "phalanx (remove it if it was meant as one)"
            )
            out.ignore(key, "not a DeepSpeed setting (DeepSpeed ignores it too)")
    for key, (feature, switch) in _FEATURES.items():
        block = data.get(key)
        if block is None:
            continue
        on = block.get(switch) if isinstance(block, dict) else block
        if on not in (None, False, 0, 1) or on is True:
            raise ConfigError(f"DeepSpeed config {where}: {key} asks for {feature}, which phalanx does not have")
        out.ignore(key, f"off: {feature} is not used")
    _map_torch_autocast(data.get("torch_autocast"), out, where)
    if "tensor_parallel" in data:
        _map_tensor_parallel(data["tensor_parallel"], out, where)
    if "sequence_parallel_size" in data:
        _map_sequence_parallel(data["sequence_parallel_size"], out, where)
    map_expert_parallel(data, out, where)
    if "activation_checkpointing" in data:
        _map_activation_checkpointing(data["activation_checkpointing"], out, where)
    for key, why in _IGNORED.items():
        if key in data:
            block = data[key]
            if (
                isinstance(block, dict)
                and block.get("enabled") is True
                and key not in ("tensorboard", "wandb", "csv_monitor", "comms_logger", "flops_profiler")
            ):
                raise ConfigError(
                    f"DeepSpeed config {where}: {key} is enabled, and phalanx cannot honour it ({why}); "
                    "remove the block or set enabled: false"
                )
            out.ignore(key, why)
    for key, target in (
        ("train_batch_size", "global_batch_size"),
        ("train_micro_batch_size_per_gpu", "micro_batch_size"),
        ("gradient_accumulation_steps", "grad_accum_steps"),
    ):
        if key in data:
            if is_auto(data[key]):
                out.ignore(key, "auto: from the DataLoader's batch size and the batch rule")
            else:
                out.set(target, data[key], key)
    if "gradient_clipping" in data:
        value = data["gradient_clipping"]
        if is_auto(value):  # Accelerate fills it from ACCELERATE_GRADIENT_CLIPPING, else 1.0; the HF Trainer from
            # its max_grad_norm, which it passes on itself
            filled = float(os.environ.get("ACCELERATE_GRADIENT_CLIPPING", "1.0"))
            out.fill("max_grad_norm", filled, f'gradient_clipping ("auto": {filled}, as Accelerate fills it)')
        elif value in (0, 0.0, None):
            out.ignore("gradient_clipping", "0: no clipping")
        else:
            out.set("max_grad_norm", float(value), "gradient_clipping")
    _map_precision(data, out)
    zero = data.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"DeepSpeed config {where}: zero_optimization must be an object; got {zero!r}")
    stage, stage_source = zero.get("stage", 0), "zero_optimization.stage"
    if is_auto(stage):  # Accelerate's fill: its plugin's zero_stage, from the launcher's environment, else 2
        stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
        stage_source += f' ("auto": {stage}, as Accelerate fills it from ACCELERATE_DEEPSPEED_ZERO_STAGE, else 2)'
    strategy = strategy_from_zero_stage(stage, "zero_optimization.stage")
    out.set("strategy", strategy, stage_source)
    _map_zero(zero, strategy, out)
    if "zero_allow_untested_optimizer" in data and strategy not in (None, "ddp"):
        out.set(
            "zero_allow_untested_optimizer",
            bool(data["zero_allow_untested_optimizer"]),
            "zero_allow_untested_optimizer",
        )
    elif "zero_allow_untested_optimizer" in data:
        out.ignore("zero_allow_untested_optimizer", "read by the zero strategies only")
    op = str(data.get("gradient_allreduce_op", "mean")).lower()
    if op != "mean":
        raise ConfigError(
            f"DeepSpeed config {where}: gradient_allreduce_op={data['gradient_allreduce_op']!r} sums the ranks' "
            'gradients, and phalanx always averages them (DeepSpeed\'s default, "mean"); use "mean" and, for '
            "the summed update, multiply the loss by the number of data-parallel ranks"
        )
    if "gradient_allreduce_op" in data:
        out.ignore("gradient_allreduce_op", "mean: phalanx averages the ranks' gradients")
    if "managed_gradient_accumulation" in data:
        if not data["managed_gradient_accumulation"]:
            raise ConfigError(
                f"DeepSpeed config {where}: managed_gradient_accumulation=false leaves accumulation boundaries to the "
                "caller, and phalanx always manages them (engine.accumulate(), grad_accum_steps); remove the key"
            )
        out.ignore("managed_gradient_accumulation", "true: phalanx manages the accumulation window")
    if "communication_data_type" in data and data["communication_data_type"] is not None:
        text = str(data["communication_data_type"]).lower()
        if text not in _COMM_DTYPES:
            raise ConfigError(
                f"invalid communication_data_type: got {data['communication_data_type']!r} (use fp16, bf16 or fp32)"
            )
        out.set("comm_dtype", _COMM_DTYPES[text], "communication_data_type")
    for block in ("optimizer", "scheduler"):
        if block in data:
            if not isinstance(data[block], dict) or "type" not in data[block]:
                raise ConfigError(
                    f"DeepSpeed config {where}: {block} must be an object with a 'type' and 'params'; "
                    f"got {data[block]!r}"
                )
    if "optimizer" in data or "scheduler" in data:
        out.set("deepspeed", where, "optimizer / scheduler blocks")
    return out


def _map_precision(data: dict[str, Any], out: Mapped) -> None:
    if "amp" in data and _enabled(data["amp"], "amp"):
        raise ConfigError(
            'DeepSpeed config: amp (NVIDIA Apex) is not supported; use "fp16": {"enabled": true} '
            'or "bf16": {"enabled": true}'
        )
    if "fp8" in data and _enabled(data["fp8"], "fp8"):
        raise ConfigError('DeepSpeed config: fp8 is not supported by phalanx; use "bf16": {"enabled": true}')
    bf16 = _enabled(data["bf16"], "bf16") if "bf16" in data else None
    bf16 = _enabled(data["bfloat16"], "bfloat16") if "bfloat16" in data and bf16 is None else bf16
    fp16 = _enabled(data["fp16"], "fp16") if "fp16" in data else None
    if fp16 and bf16:
        raise ConfigError("DeepSpeed config: fp16 and bf16 are both enabled; enable one of them")
    if bf16:
        out.set("precision", "bf16-mixed", "bf16.enabled")
        _check_bf16_block(data.get("bf16", data.get("bfloat16")), out)
    elif fp16:
        out.set("precision", "fp16-mixed", "fp16.enabled")
        _map_loss_scale(data["fp16"], out)
    elif fp16 is False or bf16 is False:
        out.set("precision", "fp32", "fp16.enabled / bf16.enabled")
    for key, on in (("fp16", fp16), ("bf16", bf16)):
        if key in data and not on:
            out.ignore(key, "auto: precision comes from the other settings" if on is None else "not enabled")
    for key in ("amp", "fp8"):
        if key in data:
            out.ignore(key, "not enabled")


def _map_activation_checkpointing(block: Any, out: Mapped, where: str) -> None:
    """DeepSpeed's activation_checkpointing block: ``cpu_checkpointing`` is phalanx's activation_offload; the block
    switches no checkpointing on (the model calls deepspeed.checkpointing itself), so the note says how phalanx does."""
    if not isinstance(block, dict):
        raise ConfigError(f"DeepSpeed config {where}: activation_checkpointing must be an object; got {block!r}")
    known = KNOWN_KEYS["activation_checkpointing"]
    for key, value in block.items():
        name = f"activation_checkpointing.{key}"
        if key not in known:
            raise ConfigError(f"DeepSpeed config {where}: unknown key {name!r}; known: {', '.join(sorted(known))}")
        if key == "cpu_checkpointing":
            if value:
                out.set("activation_offload", True, name)
            else:
                out.ignore(name, "false: nothing offloaded")
        else:
            out.ignore(name, _AC_IGNORED[key] if value else f"{value!r}: off")
    out.notes.append(
        f"DeepSpeed config {where}: its activation_checkpointing block configures deepspeed.checkpointing.checkpoint, "
        "which a model calls on its own blocks, and checkpoints nothing by itself; phalanx does not call it. For "
        "phalanx to checkpoint the model's blocks, set activation_checkpointing (full, every:k or selective)"
    )


def _map_torch_autocast(block: Any, out: Mapped, where: str) -> None:
    """DeepSpeed's torch_autocast: autocast of the forward without a loss scaler, which bf16-mixed is."""
    if block is None:
        return
    if not isinstance(block, dict) or not block.get("enabled", False):
        out.ignore("torch_autocast", "not enabled")
        return
    dtype = str(block.get("dtype", "bfloat16")).replace("torch.", "").lower()
    if dtype not in ("bfloat16", "bf16"):
        raise ConfigError(
            f"DeepSpeed config {where}: torch_autocast with dtype {block.get('dtype')!r} autocasts to fp16 without a "
            'loss scaler, which phalanx does not do; use "fp16": {"enabled": true} (with loss scaling) or '
            'torch_autocast dtype "bfloat16"'
        )
    out.set("precision", "bf16-mixed", "torch_autocast (bfloat16)")


def _check_bf16_block(block: Any, out: Mapped) -> None:
    """DeepSpeed's bf16 options beyond ``enabled``: the ones that change what is kept in bf16 are refused (phalanx
    keeps fp32 master weights, gradients and optimizer state under bf16-mixed), the others noted."""
    if not isinstance(block, dict):
        return
    for key, value in block.items():
        if key == "enabled":
            continue
        if key in _BF16_REFUSED:
            if value:
                what = "master weights and gradients" if "master" in key else "the optimizer state"
                raise ConfigError(
                    f"DeepSpeed config: bf16.{key}=true keeps {what} in bf16, and phalanx has no such mode: under "
                    f"bf16-mixed it keeps them in fp32 (more memory, exact updates). Set {key} to false or leave it out"
                )
            out.ignore(f"bf16.{key}", "false: fp32, as phalanx keeps them")
        elif key in _BF16_NOTED:
            out.ignore(f"bf16.{key}", "phalanx's bf16-mixed applies each window's gradients at the optimizer step")
        else:
            raise ConfigError(
                f"DeepSpeed config: bf16.{key} is a bf16 option phalanx does not know; known: enabled, "
                "bf16_master_weights_and_grads, bf16_optimizer_states, immediate_grad_update, check_grad_overflow"
            )


def _map_loss_scale(block: dict[str, Any], out: Mapped) -> None:
    known = KNOWN_KEYS["fp16"]
    for key in block:
        if key not in known:
            raise ConfigError(f"DeepSpeed config: unknown key 'fp16.{key}'; known: {', '.join(sorted(known))}")
    if block.get("consecutive_hysteresis"):
        raise ConfigError("DeepSpeed config: fp16.consecutive_hysteresis is not supported; leave it false")
    if block.get("fp16_master_weights_and_grads"):
        raise ConfigError(
            "DeepSpeed config: fp16.fp16_master_weights_and_grads is not supported: phalanx keeps fp32 "
            "master weights; leave it false"
        )
    for key in ("consecutive_hysteresis", "fp16_master_weights_and_grads"):
        if key in block:
            out.ignore(f"fp16.{key}", "false: off")
    if "auto_cast" in block:
        out.ignore("fp16.auto_cast", "phalanx's fp16-mixed always autocasts the forward")
    values = {k: block.get(k, d) for k, d in _FP16_DEFAULTS.items()}
    for key, value in values.items():
        if is_auto(value):
            values[key] = _FP16_DEFAULTS[key]
    if values["loss_scale"]:
        out.set("loss_scale", float(values["loss_scale"]), "fp16.loss_scale")
        return
    out.set("loss_scale_init", float(2 ** int(values["initial_scale_power"])), "fp16.initial_scale_power")
    out.set("loss_scale_window", int(values["loss_scale_window"]), "fp16.loss_scale_window")
    out.set("loss_scale_hysteresis", int(values["hysteresis"]), "fp16.hysteresis")
    out.set("loss_scale_min", float(values["min_loss_scale"]), "fp16.min_loss_scale")


def _map_zero(zero: dict[str, Any], strategy: str | None, out: Mapped) -> None:
    opt_dev, par_dev = "none", "none"
    for key, value in zero.items():
        name = f"zero_optimization.{key}"
        if key == "stage":
            continue
        if key in _ZERO_IGNORED:
            out.ignore(name, _ZERO_IGNORED[key])
        elif key == "zero_hpz_partition_size":
            _map_hpz(value, strategy, out)
        elif key in _ZERO_REFUSED:
            default, why = _ZERO_REFUSED[key]
            if value not in (default, None, 0) or (value is True):
                raise ConfigError(f"DeepSpeed config: {name}={value!r} cannot be honoured: {why}")
            out.ignore(name, f"{value!r}: off")
        elif key == "cpu_offload":  # DeepSpeed's older spelling of offload_optimizer: {device: cpu}
            if value:
                opt_dev = "cpu"
            out.ignore(name, "true: the optimizer is offloaded to the CPU" if value else "false: no offload")
        elif key == "cpu_offload_param":  # DeepSpeed's older spelling of offload_param: {device: cpu}
            if value:
                par_dev = "cpu"
            out.ignore(name, "true: the parameters are offloaded to the CPU" if value else "false: no offload")
        elif key == "zenflow":
            raise ConfigError(
                f"DeepSpeed config: {name} asks for ZenFlow's stall-free offloading, which phalanx does not have; "
                'use "offload_optimizer": {"device": "cpu"}'
            )
        elif key in ("offload_optimizer", "offload_param"):
            device, path = _offload_block(value, name, out)
            if key == "offload_optimizer":
                opt_dev = device
            else:
                par_dev = device
            if path is not None and device == "disk":
                out.set("offload_dir", path, f"{name}.nvme_path")
        elif key == "reduce_bucket_size":
            if is_auto(value) or value in (0, None):
                out.ignore(name, f"{value!r}: phalanx's bucket_mb default")
            else:
                # DeepSpeed counts elements; phalanx sizes buckets in MiB of fp32 gradients.
                out.set("bucket_mb", float(value) * 4 / _MIB, f"{name} (elements x 4 bytes)")
        elif key == "reduce_scatter":
            if value is False and shards(strategy):
                out.set("zero_collectives", "allreduce", name)
            else:
                out.ignore(name, "true: zero2 and zero3 reduce-scatter (zero_collectives picks how on gloo)")
        elif key == "ignore_unused_parameters":
            out.set("find_unused_parameters", bool(value), name)
        else:
            known = sorted(KNOWN_KEYS["zero_optimization"])
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"DeepSpeed config: unknown key {name!r}; {hint}known: {', '.join(known)}")
    stage = zero.get("stage", 0)
    if par_dev != "none" and strategy != "zero3":  # DeepSpeed offloads parameters at stage 3 only, else ignores it
        out.notes.append(
            f"zero_optimization.offload_param ({par_dev}) is ignored at ZeRO stage {stage!r}, as DeepSpeed ignores it: "
            "only stage 3 offloads parameters. Set stage 3 to offload them, or remove offload_param"
        )
        par_dev = "none"
    if opt_dev != "none" and strategy in (None, "ddp"):  # no ZeRO optimizer: nothing to offload
        out.notes.append(
            f"zero_optimization.offload_optimizer ({opt_dev}) is ignored at ZeRO stage {stage!r}, as DeepSpeed "
            "ignores it: only stages 1-3 offload the optimizer. Set stage 1, 2 or 3 to offload it, or remove it"
        )
        opt_dev = "none"
    if (opt_dev, par_dev) != ("none", "none") or shards(strategy):
        if strategy not in (None, "ddp"):
            offload_for(out, opt_dev, par_dev, strategy, "zero_optimization.offload_optimizer / offload_param")


_OFFLOAD_NOTED = {
    "pin_memory": "phalanx pins the host copies itself when the compute device is CUDA",
    "buffer_count": "DeepSpeed's NVMe swap buffers; phalanx's disk offload memory-maps its files",
    "buffer_size": "DeepSpeed's NVMe swap buffers; phalanx's disk offload memory-maps its files",
    "max_in_cpu": "DeepSpeed's NVMe swap buffers; phalanx's disk offload memory-maps its files",
    "fast_init": "DeepSpeed's NVMe optimizer initialisation",
    "pipeline_read": "DeepSpeed's NVMe read pipelining; phalanx's disk offload memory-maps its files",
    "pipeline_write": "DeepSpeed's NVMe write pipelining; phalanx's disk offload memory-maps its files",
    "cpuadam_cores_perc": "the cores of DeepSpeed's CPU Adam; phalanx steps your optimizer on the host shard",
}


def _offload_block(block: Any, name: str, out: Mapped) -> tuple[str, str | None]:
    if block is None:
        return "none", None
    if not isinstance(block, dict):
        raise ConfigError(f'DeepSpeed config: {name} must be an object such as {{"device": "cpu"}}; got {block!r}')
    known = KNOWN_KEYS["zero_optimization.offload_*"]
    for key in block:
        if key not in known:
            raise ConfigError(f"DeepSpeed config: unknown key '{name}.{key}'; known: {', '.join(sorted(known))}")
    if block.get("ratio", 1.0) not in (1, 1.0):
        raise ConfigError(
            f"DeepSpeed config: {name}.ratio={block['ratio']!r} (partial offload) is not supported; "
            "phalanx offloads all of it: use 1.0"
        )
    if block.get("super_offload"):
        raise ConfigError(
            f"DeepSpeed config: {name}.super_offload asks for SuperOffload (superchip offloading), which phalanx "
            "does not have; remove it to offload as ZeRO-Offload does"
        )
    device = str(block.get("device", "none")).lower()
    if device == "auto":  # Accelerate's fill: the launcher's environment, else none
        variable = f"ACCELERATE_DEEPSPEED_{name.split('.')[-1].upper()}_DEVICE"
        device = os.environ.get(variable, "none").lower()
        out.ignore(f"{name}.device", f'"auto": {device}, as Accelerate fills it from {variable} (else none)')
    mapping = {"none": "none", "cpu": "cpu", "nvme": "disk"}
    if device not in mapping:
        raise ConfigError(f"invalid {name}.device: got {block.get('device')!r} (use none, cpu or nvme)")
    path = block.get("nvme_path")
    for key in block:
        if key in _OFFLOAD_NOTED:
            out.ignore(f"{name}.{key}", _OFFLOAD_NOTED[key])
        elif key == "ratio":
            out.ignore(f"{name}.ratio", "1.0: all of it is offloaded")
        elif key == "super_offload":
            out.ignore(f"{name}.super_offload", "false")
        elif key == "nvme_path" and mapping[device] != "disk":
            out.ignore(f"{name}.nvme_path", f"read only with device nvme; got {device}")
    return mapping[device], (str(path) if path else None)


def _map_tensor_parallel(block: Any, out: Mapped, where: str) -> None:
    """DeepSpeed's AutoTP: ``autotp_size`` is phalanx's tp_size. The split is the model's own plan (or tp_plan),
    where DeepSpeed's AutoTP also prefers a transformers model's tp_plan and else infers one from the layers."""
    if not isinstance(block, dict):
        raise ConfigError(f'DeepSpeed config {where}: tensor_parallel must be an object such as {{"autotp_size": 2}}')
    known = KNOWN_KEYS["tensor_parallel"]
    for key in block:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"DeepSpeed config {where}: unknown key 'tensor_parallel.{key}'; {hint}known: "
                + ", ".join(sorted(known))
            )
    size = block.get("autotp_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(
            f"DeepSpeed config {where}: tensor_parallel.autotp_size must be a whole number (0 or 1 for none); got "
            f"{size!r}"
        )
    if size > 1:
        out.set("tp_size", size, "tensor_parallel.autotp_size")
        out.notes.append(
            f"tensor_parallel.autotp_size={size}: phalanx splits the layers that the model's own plan names (a "
            "transformers model's base_model_tp_plan), or tp_plan when given; DeepSpeed's AutoTP takes that plan "
            "too when the model has one, and otherwise infers one from the model's layers, which phalanx does "
            "not (give tp_plan for a model without a plan)"
        )
    else:
        out.ignore("tensor_parallel", f"autotp_size {size}: no tensor parallelism")
    for key, value in block.items():
        name = f"tensor_parallel.{key}"
        if key in _TP_NOTED:
            out.ignore(name, _TP_NOTED[key])
        elif key in _TP_REFUSED:
            if value not in (None, False, {}, []):
                raise ConfigError(f"DeepSpeed config {where}: {name}={value!r} cannot be honoured: {_TP_REFUSED[key]}")
            out.ignore(name, f"{value!r}: not used")
        elif key in ("tensor_parallel", "tp"):
            _map_tp_group(value, max(size, 1), name, out, where)


def _map_sequence_parallel(size: Any, out: Mapped, where: str) -> None:
    """DeepSpeed's ``sequence_parallel_size`` (the Ulysses degree ALST's ``UlyssesSPAttentionHF`` and its mpu build
    their groups from) is phalanx's sp_size: the same split of the sequence, and of the heads around attention."""
    key = "sequence_parallel_size"
    if is_auto(size):
        out.ignore(key, "auto: sp_size comes from the other settings (parallelism_config's sp_size, --sp-size)")
        return
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"DeepSpeed config {where}: {key} must be a whole number of at least 1; got {size!r}")
    if size == 1:
        out.ignore(key, "1: no sequence parallelism")
        return
    out.set("sp_size", size, key)
    out.notes.append(
        f"{key}={size}: phalanx's Ulysses (sp_size={size}) splits every sequence over {size} ranks and all-to-alls "
        "to a head split around attention, as DeepSpeed's ALST does; the prepared loader cuts each batch (the job of "
        "DeepSpeed's UlyssesSPDataLoaderAdapter) and engine.backward weighs each rank's loss by its share of the "
        "targets, so a script needs no all-gather of the ranks' losses. Attention heads must divide by it"
    )


def _map_tp_group(block: Any, size: int, name: str, out: Mapped, where: str) -> None:
    if not isinstance(block, dict):
        raise ConfigError(f'DeepSpeed config {where}: {name} must be an object such as {{"tp_size": {size}}}')
    known = KNOWN_KEYS["tensor_parallel.tp"]
    for key, value in block.items():
        if key not in known:
            raise ConfigError(
                f"DeepSpeed config {where}: unknown key '{name}.{key}'; known: {', '.join(sorted(known))}"
            )
        if key == "tp_size":
            if value not in (1, size):
                raise ConfigError(
                    f"DeepSpeed config {where}: {name}.tp_size={value!r} differs from tensor_parallel.autotp_size="
                    f"{size} (DeepSpeed refuses this too); leave tp_size out or make them equal"
                )
            same = "DeepSpeed's default; autotp_size decides" if value == 1 else "the same as autotp_size"
            out.ignore(f"{name}.tp_size", f"{value!r}: {same}")
        elif key in ("mpu", "tp_group") and value is not None:
            raise ConfigError(f"DeepSpeed config {where}: {name}.{key}={value!r} cannot be honoured: {_TP_GROUP[key]}")
        else:
            out.ignore(f"{name}.{key}", _TP_GROUP[key])


def _map_hpz(value: Any, strategy: str | None, out: Mapped) -> None:
    """ZeRO++'s hpZ: a secondary copy of the parameters sharded within groups of ``value`` ranks (a machine), for
    the all-gathers; optimizer state and gradients stay sharded over every rank. phalanx's nearest is hybrid zero3
    over groups of that size, whose update is the same and whose memory is not."""
    name = "zero_optimization.zero_hpz_partition_size"
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"invalid {name}: got {value!r} (a whole number of ranks; 1 for no hpZ)")
    if value <= 1:
        out.ignore(name, f"{value!r}: off")
    elif strategy != "zero3":
        out.ignore(name, f"read at ZeRO stage 3 only, as DeepSpeed reads it; got strategy {strategy!r}")
    else:
        out.set("dp_shard_size", value, name)
        out.notes.append(
            f"{name}={value}: phalanx's zero3 shards over groups of {value} ranks and replicates across the groups "
            "(hybrid sharding), so the parameters are gathered within a group as hpZ gathers them. The update is the "
            "same (gradients are averaged over every data-parallel rank; only the order of the sums differs), the "
            "memory is not: optimizer state, fp32 master weights and gradient shards are split over the group, not "
            "over every rank as under DeepSpeed (world size / hpZ size times DeepSpeed's share per rank), and there "
            "is no second copy of the parameters"
        )
