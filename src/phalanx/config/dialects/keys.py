"""The table of every DeepSpeed and Accelerate config key phalanx reads, and what it does with each.

The table is not written by hand: for each key that the dialect modules know (their ``KNOWN_KEYS``), it runs the
dialect's own code on a small file without the key and on the same file with it, for one or more values, and writes
what changed: the phalanx settings it sets, the reason it is ignored, or the error that refuses it. So the table says
what the code does, and ``tests/test_config_keys.py`` fails when a key the code knows has no probe here, or the
reverse, and when ``docs/config-keys.md`` is not what this module prints::

    python -m phalanx.config.dialects.keys > docs/config-keys.md
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from phalanx.config.dialects import accelerate as acc
from phalanx.config.dialects import deepspeed as ds
from phalanx.config.dialects.mapping import Mapped
from phalanx.config.options import ConfigError

__all__ = ["SECTIONS", "Row", "rows", "render"]

_ON_OFF = [{"enabled": True}, {"enabled": False}]
# The file a probed deepspeed_config_file names.
_DS_FILE = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}


@dataclass(frozen=True)
class Section:
    """One block of one dialect: its base file, where a key goes in it, and the values each key is tried with."""

    dialect: str  # "deepspeed" or "accelerate"
    name: str  # the key of KNOWN_KEYS in the dialect's module ("" is the top level)
    base: dict[str, Any]
    path: tuple[str, ...]  # where the section's keys live in the file
    probes: dict[str, list[Any]]
    bases: dict[str, dict[str, Any]] | None = None  # a key that needs another base file

    @property
    def title(self) -> str:
        where = self.name or "top level"
        return f"{'DeepSpeed JSON' if self.dialect == 'deepspeed' else 'Accelerate YAML'}: {where}"

    def known(self) -> frozenset[str]:
        module = ds if self.dialect == "deepspeed" else acc
        return module.KNOWN_KEYS[self.name]

    def document(self, key: str, value: Any = None, *, present: bool) -> dict[str, Any]:
        doc = copy.deepcopy((self.bases or {}).get(key, self.base))
        block = doc
        for part in self.path:
            block = block.setdefault(part, {})
        block.pop(key, None)
        if present:
            block[key] = copy.deepcopy(value)
        return doc


# DeepSpeed's AutoEP block, on: the base its keys are read in.
_EP = {"zero_optimization": {"stage": 2}, "expert_parallel": {"enabled": True, "autoep_size": 2}}
# The bases of the options of the two sequence splits: read with their size above 1.
_PC_CP = {"distributed_type": "FSDP", "num_processes": 2, "parallelism_config": {"parallelism_config_cp_size": 2}}
_PC_SP = {"distributed_type": "DEEPSPEED", "num_processes": 2, "deepspeed_config": {"zero_stage": 3},
          "parallelism_config": {"parallelism_config_sp_size": 2}}  # fmt: skip

_SAGEMAKER_VALUES = {"ec2_instance_type": "ml.p3.2xlarge", "iam_role_name": "accelerate_sagemaker_execution_role",
                     "image_uri": None, "profile": "default", "region": "us-east-1", "base_job_name": "accelerate",
                     "pytorch_version": "2.5.0", "transformers_version": "4.46", "py_version": "py311",
                     "sagemaker_inputs_file": "inputs.tsv", "sagemaker_metrics_file": "metrics.tsv",
                     "additional_args": {"max_run": 3600}}  # fmt: skip

SECTIONS: list[Section] = [
    Section("deepspeed", "", {}, (), {
        "train_batch_size": [32, "auto"],
        "train_micro_batch_size_per_gpu": [4, "auto"],
        "gradient_accumulation_steps": [2, "auto"],
        "gradient_clipping": [1.0, 0, "auto"],
        "fp16": [{"enabled": True}, {"enabled": "auto"}, {"enabled": False}],
        "bf16": [{"enabled": True}, {"enabled": "auto"}],
        "bfloat16": [{"enabled": True}],
        "zero_optimization": [{"stage": 2}],
        "optimizer": [{"type": "AdamW", "params": {"lr": "auto"}}],
        "scheduler": [{"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}],
        "zero_allow_untested_optimizer": [True],
        "communication_data_type": ["bf16", "fp32"],
        "amp": _ON_OFF,
        "fp8": [{"enabled": True}, {"enabled": False}],
        "torch_autocast": [{"enabled": True, "dtype": "bfloat16"}, {"enabled": True, "dtype": "float16"},
                           {"enabled": False}],
        "tensor_parallel": [{"autotp_size": 2}, {"autotp_size": 1}],
        "quantize_training": _ON_OFF,
        "steps_per_print": [100],
        "wall_clock_breakdown": [True],
        "memory_breakdown": [True],
        "dump_state": [True],
        "prescale_gradients": [True],
        "gradient_predivide_factor": [1.0],
        "seq_parallel_communication_data_type": ["fp32"],
        "zero_force_ds_cpu_optimizer": [False],
        "tensorboard": [{"enabled": True, "output_path": "runs"}],
        "wandb": [{"enabled": True, "project": "p"}],
        "csv_monitor": [{"enabled": True}],
        "comms_logger": [{"enabled": True}],
        "flops_profiler": [{"enabled": True}],
        "checkpoint": [{"tag_validation": "Warn"}],
        "activation_checkpointing": [{"partition_activations": False}, {"cpu_checkpointing": True}],
        "aio": [{"block_size": 1048576}],
        "data_types": [{"grad_accum_dtype": "fp32"}],
        "pipeline": [{"activation_checkpoint_interval": 0}],
        "elasticity": _ON_OFF,
        "autotuning": _ON_OFF,
        "compression_training": [{"weight_quantization": {}}],
        "sparse_attention": [{"mode": "fixed"}],
        "data_efficiency": _ON_OFF,
        "curriculum_learning": _ON_OFF,
        "eigenvalue": _ON_OFF,
        "progressive_layer_drop": _ON_OFF,
        "comet": [{"enabled": True}],
        "timers": [{"throughput": {"enabled": True}}],
        "log_level": ["info"],
        "nebula": [{"enabled": True}],
        "disable_allgather": [True],
        "dataloader_drop_last": [True],
        "graph_harvesting": [True],
        "sparse_gradients": [True],
        "vocabulary_size": [50257],
        "use_data_before_expert_parallelism": [True, False],
        "hybrid_engine": [{"enabled": True}, {"enabled": False}],
        "compile": [{"deepcompile": True}, {"deepcompile": False}],
        "expert_parallel": [{"enabled": True, "autoep_size": 2}, {"enabled": True, "autoep_size": 1},
                            {"enabled": False, "autoep_size": 2}, {"enabled": "auto"}],
        "gradient_allreduce_op": ["mean", "sum"],
        "managed_gradient_accumulation": [True, False],
        "sequence_parallel_size": [4, 1, "auto"],
    }, bases={"use_data_before_expert_parallelism": _EP}),
    Section("deepspeed", "zero_optimization", {"zero_optimization": {"stage": 2}}, ("zero_optimization",), {
        "stage": [0, 1, 2, 3, "auto"],
        "offload_optimizer": [{"device": "cpu"}, {"device": "nvme", "nvme_path": "/local_nvme"}, {"device": "auto"},
                              {"device": "none"}],
        "offload_param": [{"device": "cpu"}],
        "reduce_bucket_size": [500_000_000, "auto", 0],
        "reduce_scatter": [True, False],
        "ignore_unused_parameters": [True],
        "cpu_offload": [True, False],
        "zenflow": [{"topk_ratio": 0.1}],
        "allgather_bucket_size": [500_000_000],
        "allgather_partitions": [True],
        "contiguous_gradients": [True],
        "overlap_comm": [True],
        "round_robin_gradients": [False],
        "sub_group_size": [1_000_000_000],
        "load_from_fp32_weights": [True],
        "elastic_checkpoint": [False],
        "stage3_prefetch_bucket_size": ["auto"],
        "stage3_param_persistence_threshold": ["auto"],
        "stage3_max_live_parameters": [1_000_000_000],
        "stage3_max_reuse_distance": [1_000_000_000],
        "stage3_gather_16bit_weights_on_model_save": [True],
        "stage3_gather_fp16_weights_on_model_save": [True],
        "memory_efficient_linear": [True],
        "use_multi_rank_bucket_allreduce": [True],
        "stage3_module_granularity_threshold": [0],
        "log_trace_cache_warnings": [False],
        "zero_hpz_partition_size": [1, 8],
        "zero_quantized_weights": [False, True],
        "zero_quantized_gradients": [False, True],
        "mics_shard_size": [-1, 8],
        "cpu_offload_param": [True, False],
        "cpu_offload_use_pin_memory": [True],
        "stage3_model_persistence_threshold": [0],
        "stage3_use_all_reduce_for_fetch_params": [True],
        "stage3_allgather_sequential": [True],
        "pipeline_loading_checkpoint": [True],
        "override_module_apply": [False],
        "enable_sanity_checks": [True],
        "save_muon_momentum_buffer_in_memory": [True],
        "leaf_module": [{"classes": ["MixtralSparseMoeBlock"]}],
        "legacy_stage1": [False],
        "mics_hierarchical_params_gather": [False, True],
        "zero_quantized_nontrainable_weights": [False, True],
        "zeropp_loco_param": [None, {"err_beta": 0.8}],
        **{name: [value] for name, value in (
            ("prefetch_bucket_size", 50_000_000), ("param_persistence_threshold", 100_000),
            ("model_persistence_threshold", 0), ("max_live_parameters", 1_000_000_000),
            ("max_reuse_distance", 1_000_000_000), ("gather_16bit_weights_on_model_save", True),
            ("gather_fp16_weights_on_model_save", True), ("module_granularity_threshold", 0),
            ("use_all_reduce_for_fetch_params", True), ("allgather_sequential", True))},
    }, bases={"offload_param": {"zero_optimization": {"stage": 3}},
              "zero_hpz_partition_size": {"zero_optimization": {"stage": 3}}}),
    Section("deepspeed", "zero_optimization.offload_*",
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
            ("zero_optimization", "offload_optimizer"), {
        "device": ["cpu", "nvme", "none", "auto"],
        "nvme_path": ["/local_nvme"],
        "pin_memory": [True],
        "buffer_count": [4],
        "buffer_size": [100_000_000],
        "max_in_cpu": [1_000_000_000],
        "fast_init": [False],
        "ratio": [1.0, 0.3],
        "pipeline_read": [True],
        "pipeline_write": [True],
        "super_offload": [False, True],
        "cpuadam_cores_perc": [0.9],
    }),
    Section("deepspeed", "tensor_parallel", {"tensor_parallel": {"autotp_size": 2}}, ("tensor_parallel",), {
        "autotp_size": [2, 1],
        "tensor_parallel": [{"tp_size": 2}],
        "tp": [{"tp_size": 2}],
        "tp_overlap_comm": [True],
        "dtype": ["bf16"],
        "keep_module_on_host": [True],
        "partition_config": [None, {"layer_specs": [{"patterns": [".*\\.o_proj\\.weight$"],
                                                     "partition_type": "row"}]}],
        "preset_model": [None, "llama"],
        "injection_policy_tuple": [None],
        "replace_with_kernel_inject": [False, True],
        "kernel_inject": [True],
    }),
    Section("deepspeed", "tensor_parallel.tp", {"tensor_parallel": {"autotp_size": 2, "tp": {}}},
            ("tensor_parallel", "tp"), {
        "tp_size": [2, 1, 4],
        "tp_grain_size": [64],
        "mpu": [None],
        "tp_group": [None],
    }),
    Section("deepspeed", "expert_parallel", _EP, ("expert_parallel",), {
        "enabled": [True, False, "auto"],
        "autoep_size": [4, 1],
        "expert_tensor_parallel_size": [1, 2],
        "preset_model": ["mixtral"],
        "use_grouped_mm": [True],
        "disable_triton_grouped_mm": [False],
        "combine_impl": ["auto"],
        "validate_folding_routing": [False],
        "score_func": ["auto", "sigmoid"],
        "score_apply": ["auto", "pre"],
        "route_norm": [None, True],
        "route_scale": [1.0, 2.5],
        "routed_scaling_factor": ["auto", 2.5],
        "top_k": ["auto", 2],
        "num_expert_groups": [None, 8],
        "num_limited_groups": [None, 4],
        "load_balance_coeff": [None, 0.001],
        "moe_layer_pattern": [None, "model\\.layers\\.\\d+\\.moe"],
        "router_pattern": ["router"],
        "expert_pattern": ["experts"],
        "expert_w1": ["w1"],
        "expert_w2": ["w2"],
        "expert_w3": [None, "w3"],
        "num_experts_attr": ["num_local_experts"],
        "top_k_attr": ["num_experts_per_tok"],
        "has_shared_experts": [None, False],
        "shared_experts_pattern": ["shared_expert"],
        "shared_experts_gate_pattern": ["shared_expert_gate"],
    }),
    Section("deepspeed", "activation_checkpointing", {"activation_checkpointing": {}}, ("activation_checkpointing",), {
        "partition_activations": [True, False],
        "cpu_checkpointing": [True, False],
        "contiguous_memory_optimization": [True, False],
        "number_checkpoints": [4, None],
        "synchronize_checkpoint_boundary": [True, False],
        "profile": [True, False],
    }),
    Section("deepspeed", "fp16", {"fp16": {"enabled": True}}, ("fp16",), {
        "enabled": [True, "auto", False],
        "loss_scale": [0, 128],
        "initial_scale_power": [12],
        "loss_scale_window": [500],
        "hysteresis": [4],
        "min_loss_scale": [2],
        "auto_cast": [False],
        "consecutive_hysteresis": [False, True],
        "fp16_master_weights_and_grads": [False, True],
    }),
    Section("deepspeed", "bf16", {"bf16": {"enabled": True}}, ("bf16",), {
        "enabled": [True, "auto", False],
        "bf16_master_weights_and_grads": [False, True],
        "bf16_optimizer_states": [False, True],
        "immediate_grad_update": [True],
        "check_grad_overflow": [False],
    }),
    Section("accelerate", "", {"distributed_type": "MULTI_CPU"}, (), {
        "distributed_type": ["NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA"],
        "mixed_precision": ["no", "fp16", "bf16", "fp8"],
        "use_cpu": [True, False],
        "num_processes": [4],
        "num_machines": [2],
        "machine_rank": [1],
        "main_process_ip": ["10.0.0.1"],
        "main_process_port": [29500],
        "rdzv_backend": ["static", "c10d"],
        "gpu_ids": ["all", "0,1"],
        "deepspeed_config": [{"zero_stage": 2}],
        "fsdp_config": [{"fsdp_sharding_strategy": "FULL_SHARD"}],
        "dynamo_config": [{"dynamo_backend": "NO"}, {"dynamo_backend": "INDUCTOR"}],
        "dynamo_backend": ["NO"],
        "parallelism_config": [{"parallelism_config_tp_size": 1}, {"parallelism_config_tp_size": 2}],
        "debug": [True, False],
        "compute_environment": ["LOCAL_MACHINE", "AMAZON_SAGEMAKER"],
        "downcast_bf16": ["no"],
        "main_training_function": ["main"],
        "same_network": [True],
        "enable_cpu_affinity": [False],
        "ipex_config": [{"ipex": False}],
        "mpirun_config": [{}, {"mpirun_hostfile": "~/hostfile"}],
        "commands": [["ls"]],
        "command_file": ["commands.sh"],
        "megatron_lm_config": [{"megatron_lm_tp_degree": 2}],
        "fp8_config": [{"backend": "TE"}],
        "tpu_name": ["tpu"],
        "tpu_zone": ["us-central1-a"],
        "tpu_use_cluster": [False],
        "tpu_use_sudo": [False],
        "tpu_vm": [["vm"]],
        "tpu_env": [["A=1"]],
        **{key: [value] for key, value in _SAGEMAKER_VALUES.items()},
    }, bases={"num_machines": {"distributed_type": "MULTI_CPU", "num_processes": 4},
              "rdzv_backend": {"distributed_type": "MULTI_CPU", "main_process_ip": "10.0.0.1",
                               "main_process_port": 29500}}),
    Section("accelerate", "deepspeed_config", {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2}},
            ("deepspeed_config",), {
        "zero_stage": [0, 1, 2, 3],
        "deepspeed_config_file": ["ds_config.json"],
        "gradient_accumulation_steps": [4],
        "gradient_clipping": [1.0, "none"],
        "offload_optimizer_device": ["cpu", "nvme", "none"],
        "offload_param_device": ["cpu"],
        "offload_optimizer_nvme_path": ["/nvme", "none"],
        "offload_param_nvme_path": ["/nvme"],
        "deepspeed_multinode_launcher": ["standard", "pdsh"],
        "zero3_init_flag": [True],
        "zero3_save_16bit_model": [True],
        "deepspeed_moe_layer_cls_names": ["MixtralSparseMoeBlock"],
        "deepspeed_hostfile": ["/job/hostfile"],
        "deepspeed_inclusion_filter": ["worker-0:0,1"],
        "deepspeed_exclusion_filter": ["worker-1:0"],
        "seq_parallel_communication_data_type": ["bf16"],
    }, bases={"deepspeed_config_file": {"distributed_type": "DEEPSPEED", "deepspeed_config": {}},
              "offload_param_device": {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}}}),
    Section("accelerate", "fsdp_config", {"distributed_type": "FSDP", "fsdp_config": {}}, ("fsdp_config",), {
        "fsdp_sharding_strategy": ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2", 4],
        "fsdp_reshard_after_forward": [True, False],
        "fsdp_offload_params": [True, False],
        "fsdp_transformer_layer_cls_to_wrap": ["GPT2Block"],
        "fsdp_auto_wrap_policy": ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"],
        "fsdp_backward_prefetch": ["BACKWARD_PRE", "NO_PREFETCH"],
        "fsdp_backward_prefetch_policy": ["BACKWARD_PRE"],
        "fsdp_forward_prefetch": [True, False],
        "fsdp_activation_checkpointing": [False, True],
        "fsdp_ignored_modules": [None, ["lm_head"]],
        "fsdp_state_dict_type": ["SHARDED_STATE_DICT"],
        "fsdp_sync_module_states": [True],
        "fsdp_use_orig_params": [True],
        "fsdp_cpu_ram_efficient_loading": [True],
        "fsdp_version": [2],
        "fsdp_min_num_params": [100_000_000],
    }),
    Section("accelerate", "parallelism_config",
            {"distributed_type": "FSDP", "num_processes": 8, "parallelism_config": {"parallelism_config_tp_size": 2}},
            ("parallelism_config",), {
        "parallelism_config_tp_size": [2, 1],
        "parallelism_config_dp_shard_size": [2],
        "parallelism_config_dp_replicate_size": [2],
        "parallelism_config_cp_size": [1, 8],
        "parallelism_config_sp_size": [1, 2, 4],
        "parallelism_config_cp_backend": ["torch", "deepspeed"],
        "parallelism_config_cp_comm_strategy": ["allgather", "alltoall"],
        "parallelism_config_sp_backend": ["deepspeed", "megatron"],
        "parallelism_config_sp_seq_length": ["1024"],
        "parallelism_config_sp_seq_length_is_variable": [True, False],
        "parallelism_config_sp_attn_implementation": ["sdpa", "flash_attention_2", "eager"],
    }, bases={
        **{f"parallelism_config_{k}": _PC_CP for k in ("cp_backend", "cp_comm_strategy")},
        **{f"parallelism_config_{k}": _PC_SP for k in ("sp_backend", "sp_seq_length", "sp_seq_length_is_variable",
                                                       "sp_attn_implementation")},
        "parallelism_config_sp_size": {"distributed_type": "DEEPSPEED", "num_processes": 4,
                                       "deepspeed_config": {"zero_stage": 3}, "parallelism_config": {}},
    }),
]  # fmt: skip


@dataclass(frozen=True)
class Row:
    section: Section
    key: str
    value: Any
    kind: str  # "maps", "ignores", "refuses"
    outcome: str


def _translate(section: Section, doc: dict[str, Any]) -> Mapped:
    if section.dialect == "deepspeed":
        return ds.from_deepspeed(doc, "(probe)")
    return acc.from_accelerate(doc, "(probe)", lambda _path: copy.deepcopy(_DS_FILE))


def _outcome(section: Section, key: str, value: Any) -> tuple[str, str]:
    before = _translate(section, section.document(key, present=False))
    try:
        after = _translate(section, section.document(key, value, present=True))
    except ConfigError as e:
        return "refuses", str(e).replace(" (probe):", ":").replace("(probe)", "the file")
    parts = [f"sets `{k}` = `{v!r}`".replace("'(probe)'", "this file") for k, v, s in after.values
             if (k, v, s) not in before.values]  # fmt: skip
    parts += [f"sets `{k}` = `{v!r}` unless another setting says it" for k, v, s in after.fills
              if (k, v, s) not in before.fills]  # fmt: skip
    parts += [f"ignored: {why}" for k, why in after.ignored if (k, why) not in before.ignored]
    parts += [f"note: {n}" for n in after.notes if n not in before.notes]
    if not parts and (after.values, after.ignored, after.notes, after.fills) == (
        before.values,
        before.ignored,
        before.notes,
        before.fills,
    ):
        return "default", "the same as leaving the key out"
    kind = "maps" if any(p.startswith("sets") for p in parts) else "ignores" if parts else "nothing"
    return kind, "; ".join(parts) or "(no effect)"


def rows() -> Iterator[Row]:
    """Every probe's row. The ``ACCELERATE_*`` variables that fill "auto" values are set aside meanwhile, so that
    the table shows what a file means on its own."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("ACCELERATE_")}
    try:
        found = [
            Row(section, key, value, *_outcome(section, key, value))
            for section in SECTIONS
            for key, values in section.probes.items()
            for value in values
        ]
    finally:
        os.environ.update(saved)
    yield from found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(emit: Callable[[str], None] = print) -> None:
    emit("# DeepSpeed and Accelerate config keys in phalanx\n")
    emit(
        "Generated by `python -m phalanx.config.dialects.keys > docs/config-keys.md` from the dialect code itself: "
        "each row is the key put into a small file and read by phalanx, and what changed (the settings it sets, "
        "the reason it is ignored, or the error that refuses it). `tests/test_config_keys.py` fails when this page, "
        "or the list of keys the code reads, drifts. The value tried is shown; other values of the same key may "
        "map differently (see the code in `src/phalanx/config/dialects/`).\n"
    )
    current = None
    for row in rows():
        if row.section is not current:
            current = row.section
            emit(f"\n## {current.title}\n")
            emit("| key | value | phalanx |")
            emit("|---|---|---|")
        value = json.dumps(row.value)
        emit(f"| `{row.key}` | `{_cell(value)}` | **{row.kind}**: {_cell(row.outcome)} |")


if __name__ == "__main__":
    render()
