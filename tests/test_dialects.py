"""Accelerate YAML and DeepSpeed JSON configs resolve to the phalanx config a user of those tools would expect.

The three Accelerate configs of seed 004 are kept verbatim in tests/data/accelerate; two of them hold the blog's
placeholders for the address and port of the main machine, which the tests fill in (and check that, left as they
are, they are an error naming the key).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phalanx.config.dialects.deepspeed import from_deepspeed
from phalanx.config.mesh import Mesh
from phalanx.config.settings import ConfigError, resolve_config

DATA = Path(__file__).parent / "data"
SEED = DATA / "accelerate"


def _filled(name: str, tmp_path: Path, port: int = 29500) -> Path:
    text = (SEED / name).read_text().replace("主机器的ip", "127.0.0.1").replace("端口号", str(port))
    path = tmp_path / name
    path.write_text(text)
    return path


def _origin(cfg, key: str) -> str:
    return cfg.origins[key]


def _ignored(cfg) -> set[str]:
    return {key.split(": ", 1)[1] for key, _ in cfg.ignored}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------- Accelerate's YAML
def test_seed004_single_node_yaml_is_two_ddp_processes():
    cfg = resolve_config(file=SEED / "seed004_single_node.yaml", env={})
    assert (cfg.engine.strategy, cfg.engine.precision, cfg.engine.device) == ("ddp", "fp32", "auto")
    assert (cfg.launch.nproc_per_node, cfg.launch.nnodes) == (2, 1)
    assert _origin(cfg, "launch.nproc_per_node").endswith("(accelerate num_processes)")
    assert _origin(cfg, "precision").endswith("(accelerate mixed_precision)")
    assert {
        "compute_environment",
        "downcast_bf16",
        "tpu_env",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "same_network",
        "gpu_ids",
        "rdzv_backend",
    } <= _ignored(cfg)


def test_seed004_multi_node_yaml_divides_the_total_over_the_machines(tmp_path):
    cfg = resolve_config(file=_filled("seed004_multi_node.yaml", tmp_path), env={})
    # Accelerate's num_processes (4) is over both machines: 2 on each.
    assert (cfg.launch.nproc_per_node, cfg.launch.nnodes, cfg.launch.node_rank) == (2, 2, 0)
    assert (cfg.launch.master_addr, cfg.launch.master_port) == ("127.0.0.1", 29500)
    assert cfg.engine.strategy == "ddp"
    assert "main_training_function" in _ignored(cfg)


def test_seed004_deepspeed_yaml_is_zero3_with_accumulation(tmp_path):
    cfg = resolve_config(file=_filled("seed004_deepspeed_zero3.yaml", tmp_path), env={})
    assert (cfg.engine.strategy, cfg.engine.grad_accum_steps, cfg.engine.offload) == ("zero3", 4, "none")
    assert (cfg.launch.nproc_per_node, cfg.launch.nnodes) == (2, 2)
    assert _origin(cfg, "strategy").endswith("(accelerate deepspeed_config.zero_stage)")
    assert _origin(cfg, "grad_accum_steps").endswith("(accelerate deepspeed_config.gradient_accumulation_steps)")
    assert {
        "deepspeed_config.zero3_init_flag",
        "deepspeed_config.zero3_save_16bit_model",
        "deepspeed_config.deepspeed_multinode_launcher",
    } <= _ignored(cfg)


@pytest.mark.parametrize("name", ["seed004_multi_node.yaml", "seed004_deepspeed_zero3.yaml"])
def test_the_blogs_placeholders_are_an_error_naming_the_key(name):
    with pytest.raises(ConfigError, match="main_process_port must be a port number; got '端口号'"):
        resolve_config(file=SEED / name, env={})


def test_phalanx_config_prints_origins_and_ignored_keys(tmp_path, capsys):
    from phalanx.launch.cli import main

    assert main(["config", "--config", str(_filled("seed004_deepspeed_zero3.yaml", tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "(accelerate deepspeed_config.zero_stage)" in out and "'zero3'" in out
    assert "# ignored: " in out and "tpu_use_sudo (a TPU setting)" in out


_BASE = "compute_environment: LOCAL_MACHINE\nnum_machines: 1\nnum_processes: 2\n"


@pytest.mark.parametrize(
    "extra, match",
    [
        ("distributed_type: MEGATRON_LM\n", "MEGATRON_LM.*use strategy pipeline"),
        ("distributed_type: MULTI_GPU\nmixed_precision: fp8\n", "fp8.*use mixed_precision: bf16"),
        ("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HALF_SHARD\n", "HALF_SHARD.*HYBRID_SHARD"),
        # Ring attention and Ulysses split the sequence one at a time; Accelerate's SP backend is DeepSpeed's ALST.
        (
            "distributed_type: FSDP\nparallelism_config:\n  parallelism_config_cp_size: 2\n"
            "  parallelism_config_sp_size: 2\n",
            r"parallelism_config_cp_size=2 and .*parallelism_config_sp_size=2 both split the sequence.*cp_size=4 alone",
        ),
        (
            "distributed_type: FSDP\nparallelism_config:\n  parallelism_config_sp_size: 2\n"
            "  parallelism_config_sp_backend: megatron\n",
            "parallelism_config_sp_backend='megatron': Accelerate's only sequence-parallel backend is 'deepspeed'",
        ),
        # Accelerate's own spelling has the prefix; the bare name would be dropped by Accelerate without a word.
        ("distributed_type: FSDP\nparallelism_config:\n  tp_size: 2\n", "did you mean 'parallelism_config_tp_size'"),
        ("distributed_type: FSDP\nparallelism_config:\n  parallelism_config_tp_size: 0\n", "at least 1; got 0"),
        # Two ways of saying the replicas: FSDP1's hybrid and FSDP2's ParallelismConfig (Accelerate refuses it too).
        (
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n"
            "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 1\n",
            "HYBRID_SHARD' and parallelism_config's dp sizes both say.*dp_replicate_size=2",
        ),
        ("distributed_type: MULTI_GPU\ndynamo_config:\n  dynamo_backend: INDUCTOR\n", "torch.compile"),
        ("distributed_type: MULTI_GPU\ngpu_ids: 0,1\n", "CUDA_VISIBLE_DEVICES=0,1"),
        ("distributed_type: MULTI_GPU\nnum_procesess: 2\n", "did you mean 'num_processes'"),
        # It was dropped with an "ignored" note, and the job would have waited for machines nobody started.
        ("distributed_type: MULTI_CPU\nmpirun_config:\n  mpirun_hostfile: hosts\n", "mpirun -f hosts -n"),
        ("distributed_type: FSDP\nfsdp_config:\n  fsdp_ignored_modules: [head]\n", "shards every module"),
    ],
)
def test_accelerate_values_phalanx_cannot_honour_are_errors(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        resolve_config(file=_write(tmp_path, "a.yaml", _BASE + extra), env={})


def test_accelerate_values_that_mean_nothing_asked_are_accepted(tmp_path):
    text = _BASE + "distributed_type: FSDP\nfsdp_config:\n  fsdp_ignored_modules: null\nmpirun_config: {}\n"
    cfg = resolve_config(file=_write(tmp_path, "a.yaml", text), env={})
    assert cfg.engine.strategy == "zero3"
    assert {"fsdp_config.fsdp_ignored_modules", "mpirun_config"} <= _ignored(cfg)


def test_accelerate_total_processes_must_divide_over_machines(tmp_path):
    path = _write(tmp_path, "a.yaml", "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 3\n")
    with pytest.raises(ConfigError, match="num_processes=3 is the total over all machines.*num_machines=2"):
        resolve_config(file=path, env={})


def test_accelerate_fsdp2_maps_onto_zero3(tmp_path):
    text = _BASE + (
        "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_reshard_after_forward: true\n"
        "  fsdp_offload_params: true\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_transformer_layer_cls_to_wrap: Block\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
    )
    cfg = resolve_config(file=_write(tmp_path, "fsdp.yaml", text), env={})
    assert (cfg.engine.strategy, cfg.engine.offload, cfg.engine.zero3_unit_classes) == ("zero3", "cpu", "Block")
    assert cfg.engine.precision == "bf16-mixed"
    assert "fsdp_config.fsdp_state_dict_type" in _ignored(cfg)


def test_accelerate_fsdp1_shard_grad_op_is_zero2(tmp_path):
    text = _BASE + "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
    assert resolve_config(file=_write(tmp_path, "fsdp.yaml", text), env={}).engine.strategy == "zero2"


def test_accelerate_multi_cpu_and_use_cpu_pin_the_device(tmp_path):
    cfg = resolve_config(file=_write(tmp_path, "a.yaml", _BASE + "distributed_type: MULTI_CPU\n"), env={})
    assert cfg.engine.device == "cpu"
    cfg = resolve_config(
        file=_write(tmp_path, "b.yaml", _BASE + "distributed_type: MULTI_GPU\nuse_cpu: true\n"), env={}
    )
    assert cfg.engine.device == "cpu"


def test_accelerate_yaml_naming_a_deepspeed_json(tmp_path, monkeypatch):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2}))
    text = (
        _BASE
        + "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n  zero3_init_flag: false\n"
    )
    yaml = _write(tmp_path, "a.yaml", text)
    # Accelerate opens deepspeed_config_file from the working directory, not from the YAML's folder.
    with pytest.raises(ConfigError, match="is not in the working directory.*there is one next to the YAML"):
        resolve_config(file=yaml, env={})
    monkeypatch.chdir(tmp_path)
    cfg = resolve_config(file=yaml, env={})
    assert (cfg.engine.strategy, cfg.engine.grad_accum_steps) == ("zero1", 2)
    assert "deepspeed_config_file: zero_optimization.stage" in _origin(cfg, "strategy")


def test_the_cli_overrides_an_accelerate_file(tmp_path):
    cfg = resolve_config(file=SEED / "seed004_single_node.yaml", env={}, cli={"launch.nproc_per_node": 3})
    assert (cfg.launch.nproc_per_node, _origin(cfg, "launch.nproc_per_node")) == (3, "cli")


# ---------------------------------------------------------------------------------------------- DeepSpeed's JSON
def test_hf_style_json_with_auto_values_and_offload():
    cfg = resolve_config(file=DATA / "deepspeed" / "hf_auto_offload.json", env={}, cli={"launch.nproc_per_node": 2})
    e = cfg.engine
    assert (e.strategy, e.offload, e.precision, e.grad_accum_steps, e.max_grad_norm) == (
        "zero2",
        "cpu",
        "fp32",
        1,
        1.0,  # "auto" clipping: 1.0, as Accelerate fills it
    )
    assert (e.micro_batch_size, e.global_batch_size, e.bucket_mb) == (None, None, 25.0)  # auto: the loader decides
    assert {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients",
        "steps_per_print",
    } <= _ignored(cfg)


def test_json_with_blocks_and_nvme_offload():
    path = DATA / "deepspeed" / "zero3_blocks.json"
    cfg = resolve_config(file=path, env={}, cli={"launch.nproc_per_node": 2})
    e = cfg.engine
    assert (e.strategy, e.offload, e.offload_dir, e.max_grad_norm) == ("zero3", "disk", "/tmp/phalanx-offload", 1.0)
    # train 16 = micro 4 x accumulation x 2 ranks: the accumulation follows.
    assert (e.global_batch_size, e.micro_batch_size, e.grad_accum_steps) == (16, 4, 2)
    assert cfg.origins["grad_accum_steps"].startswith("batch rule")
    assert e.deepspeed == str(path)


def test_the_batch_rule_error_names_the_culprit_and_the_world_size(tmp_path):
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    path = _write(tmp_path, "ds.json", json.dumps(ds))
    with pytest.raises(ConfigError) as e:
        resolve_config(file=path, env={}, cli={"launch.nproc_per_node": 2})
    text = str(e.value)
    assert "global_batch_size=32" in text and "(world size 2)" in text and "= 16" in text
    assert "grad_accum_steps 4" in text and "micro_batch_size 8" in text and "4 ranks" in text
    # The same file on 4 ranks holds.
    assert resolve_config(file=path, env={}, cli={"launch.nproc_per_node": 4}).engine.global_batch_size == 32


def test_the_batch_rule_reads_the_workers_world_size(tmp_path):
    path = _write(tmp_path, "ds.json", json.dumps({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2}))
    assert resolve_config(file=path, env={"WORLD_SIZE": "3"}).engine.grad_accum_steps == 2
    with pytest.raises(ConfigError, match=r"not a multiple of .*micro_batch_size=2.* data-parallel size 4"):
        resolve_config(file=path, env={"WORLD_SIZE": "4"})


def test_fp16_block_sets_deepspeeds_loss_scaling(tmp_path):
    path = _write(tmp_path, "ds.json", json.dumps({"fp16": {"enabled": True, "initial_scale_power": 12}}))
    e = resolve_config(file=path, env={}).engine
    assert e.precision == "fp16-mixed"
    # DeepSpeed's defaults for the keys the block leaves out.
    assert (e.loss_scale_init, e.loss_scale_window, e.loss_scale_hysteresis, e.loss_scale_min) == (4096.0, 1000, 2, 1.0)


def test_deepspeed_autos_are_filled_as_accelerate_fills_them(tmp_path, monkeypatch):
    # A stage or an offload device written "auto" is filled from Accelerate's plugin (its launcher's environment,
    # else stage 2 and no offload). It used to leave the stage unset: the run was ddp, silently.
    ds = {"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"}}}
    path = _write(tmp_path, "ds.json", json.dumps(ds))
    for variable in ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"):
        monkeypatch.delenv(variable, raising=False)
    cfg = resolve_config(file=path, env={})
    assert (cfg.engine.strategy, cfg.engine.offload) == ("zero2", "none")
    assert '"auto": 2, as Accelerate fills it' in _origin(cfg, "strategy")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    cfg = resolve_config(file=path, env={})
    assert (cfg.engine.strategy, cfg.engine.offload) == ("zero3", "cpu")


def test_deepspeed_settings_that_phalanx_can_map_are_mapped(tmp_path):
    ds = {
        "zero_optimization": {"stage": 2, "cpu_offload": True, "reduce_bucket_size": 0},  # DeepSpeed's old spelling
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "tensor_parallel": {"autotp_size": 1},  # no tensor parallelism asked for
        "quantize_training": {"enabled": False},
        "seq_parallel_communication_data_type": "fp32",
    }
    cfg = resolve_config(file=_write(tmp_path, "ds.json", json.dumps(ds)), env={})
    assert (cfg.engine.strategy, cfg.engine.offload, cfg.engine.precision) == ("zero2", "cpu", "bf16-mixed")
    assert {"tensor_parallel", "quantize_training", "seq_parallel_communication_data_type"} <= _ignored(cfg)
    from phalanx.config.dialects.deepspeed_blocks import build_optimizer

    with pytest.raises(ConfigError, match="1-bit compressed communication"):
        build_optimizer({"type": "OneBitAdam", "params": {"lr": 1e-3}}, [torch.nn.Parameter(torch.zeros(1))])


def test_loss_scaling_outside_fp16_is_an_error():
    with pytest.raises(ConfigError, match="loss_scale_window=100 applies to precision='fp16-mixed' only"):
        resolve_config(env={}, cli={"loss_scale_window": 100})


def test_offload_at_a_stage_that_does_not_offload_is_ignored_as_deepspeed_ignores_it_with_a_note():
    for zero, what in (
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param (cpu) is ignored at ZeRO stage 2"),
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer (cpu) is ignored at ZeRO stage 0"),
    ):
        mapped = from_deepspeed({"zero_optimization": zero}, "ds.json")
        assert mapped.get("offload") in (None, "none") and any(what in n for n in mapped.notes), mapped


def test_a_key_outside_deepspeed_s_schema_is_ignored_as_deepspeed_ignores_it_but_a_near_miss_is_a_typo():
    mapped = from_deepspeed({"cuda_visible_devices": "0,1", "train_batch_size": 8}, "ds.json")
    assert any("'cuda_visible_devices' is not a DeepSpeed setting" in n for n in mapped.notes)
    with pytest.raises(ConfigError, match="did you mean 'gradient_clipping'"):
        from_deepspeed({"gradient_cliping": 1.0}, "ds.json")


@pytest.mark.parametrize(
    "ds, match",
    [
        ({"train_batch_sise": 8}, "unknown key 'train_batch_sise'; did you mean 'train_batch_size'"),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "cpu"},
                    "offload_optimizer": {"device": "nvme"},
                }
            },
            "to one place",
        ),
        ({"zero_optimization": {"stage": 4}}, "ZeRO stages are 0, 1, 2 and 3"),
        ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "did you mean 'overlap_comm'"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enable one of them"),
        ({"amp": {"enabled": True}}, "Apex"),
        ({"sparse_attention": {"enabled": True}}, "sparse_attention is enabled"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "does not quantise"),
        # Features DeepSpeed has and phalanx lacks are named as DeepSpeed names them, not called typos.
        ({"hybrid_engine": {"enabled": True}}, r"the Hybrid Engine for RLHF generation \(hybrid_engine\)"),
        # AutoTP's options that choose another split than the model's plan are refused, with the way to say it.
        ({"tensor_parallel": {"autotp_size": 2, "preset_model": "llama"}}, "preset_model='llama'.*model's own plan"),
        ({"tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": []}}}, "as tp_plan"),
        ({"tensor_parallel": {"autotp_size": 2, "kernel_inject": True}}, "fused inference kernels"),
        ({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}}, "tp.tp_size=4 differs from.*autotp_size=2"),
        ({"tensor_parallel": {"autotp_size": 2, "tp_overlap": True}}, "did you mean 'tp_overlap_comm'"),
        ({"tensor_parallel": {"autotp_size": -1}}, "autotp_size must be a whole number"),
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": "8"}}, "invalid .*zero_hpz_partition_size"),
        ({"quantize_training": {"enabled": True}}, "quantization-aware training"),
        ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, "ZenFlow"),
        ({"torch_autocast": {"enabled": True, "dtype": "torch.float16"}}, "without a loss scaler"),
        # They used to be accepted, and the run kept fp32 master weights without a word.
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "keeps master weights and gradients in"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "keeps the optimizer state in bf16"),
    ],
)
def test_deepspeed_values_phalanx_cannot_honour_are_errors(tmp_path, ds, match):
    with pytest.raises(ConfigError, match=match):
        resolve_config(file=_write(tmp_path, "ds.json", json.dumps(ds)), env={})


def test_deepspeed_key_in_a_phalanx_yaml(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    cfg = resolve_config(file=_write(tmp_path, "p.yaml", f"deepspeed: {tmp_path / 'ds.json'}\nseed: 3\n"), env={})
    assert (cfg.engine.strategy, cfg.engine.precision, cfg.engine.seed) == ("zero2", "bf16-mixed", 3)
    inline = "deepspeed:\n  zero_optimization:\n    stage: 1\n"
    assert resolve_config(file=_write(tmp_path, "q.yaml", inline), env={}).engine.strategy == "zero1"


def test_a_key_that_contradicts_the_deepspeed_file_in_the_same_place_is_an_error(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match="strategy='zero2' .* disagrees with strategy='zero3'"):
        resolve_config(file=_write(tmp_path, "p.yaml", f"strategy: zero2\ndeepspeed: {tmp_path / 'ds.json'}\n"), env={})
    with pytest.raises(ConfigError, match="disagrees"):
        resolve_config(env={}, cli={"strategy": "zero2"}, deepspeed=tmp_path / "ds.json")
    # A later layer (the command line over a file) overrides, as for any setting.
    cfg = resolve_config(file=tmp_path / "ds.json", env={}, cli={"strategy": "zero2"})
    assert cfg.engine.strategy == "zero2"


def test_zero_stage_in_a_phalanx_yaml_points_to_strategy(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'zero_stage'; write strategy: zero1, zero2 or zero3"):
        resolve_config(file=_write(tmp_path, "p.yaml", "zero_stage: 3\n"), env={})


# --------------------------------------------------------------------------- the device mesh in the peers' names
def test_accelerate_parallelism_config_is_the_device_mesh(tmp_path):

    text = (
        "distributed_type: FSDP\nnum_machines: 1\nnum_processes: 8\nmixed_precision: bf16\nfsdp_config:\n"
        "  fsdp_version: 2\n  fsdp_reshard_after_forward: true\nparallelism_config:\n"
        "  parallelism_config_cp_size: 1\n  parallelism_config_dp_replicate_size: 2\n"
        "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n"
    )  # Accelerate's examples/torch_native_parallelism/configs/tp_hsdp.yaml
    cfg = resolve_config(file=_write(tmp_path, "tp_hsdp.yaml", text), env={})
    e = cfg.engine
    assert (e.strategy, e.tp_size, e.dp_shard_size, e.dp_replicate_size) == ("zero3", 2, 2, 2)
    assert "parallelism_config.parallelism_config_tp_size" in _origin(cfg, "tp_size")
    assert "parallelism_config.parallelism_config_dp_replicate_size" in _origin(cfg, "dp_replicate_size")
    assert "parallelism_config.parallelism_config_cp_size" in _ignored(cfg)
    assert Mesh.of(e, 8, cfg.origins).sizes == (1, 2, 2, 1, 2)
    # Every size 1 asks for nothing: the strategy's own layout.
    ones = text.replace(": 2\n", ": 1\n")
    cfg = resolve_config(file=_write(tmp_path, "ones.yaml", ones), env={})
    assert "tp_size" not in cfg.origins and "parallelism_config" in _ignored(cfg)


def test_accelerate_parallelism_sizes_that_do_not_fit_are_one_error_naming_the_file_keys(tmp_path):

    text = _BASE + "distributed_type: MULTI_GPU\nparallelism_config:\n  parallelism_config_dp_shard_size: 2\n"
    cfg = resolve_config(file=_write(tmp_path, "a.yaml", text), env={})
    with pytest.raises(ConfigError, match=r"strategy 'ddp' does not do.*parallelism_config_dp_shard_size"):
        Mesh.of(cfg.engine, 2, cfg.origins)


@pytest.mark.parametrize(
    "value, strategy", [("HYBRID_SHARD", "zero3"), ("HYBRID_SHARD_ZERO2", "zero2"), (4, "zero3"), (5, "zero2")]
)
def test_accelerate_fsdp_hybrid_shard_shards_within_a_machine_and_replicates_across_machines(tmp_path, value, strategy):

    text = (
        "compute_environment: LOCAL_MACHINE\nnum_machines: 2\nnum_processes: 16\ndistributed_type: FSDP\n"
        "main_process_ip: 10.0.0.1\nmain_process_port: 29500\n"
        f"fsdp_config:\n  fsdp_sharding_strategy: {value}\n"
    )
    cfg = resolve_config(file=_write(tmp_path, "hsdp.yaml", text), env={})
    assert (cfg.engine.strategy, cfg.engine.dp_replicate_size, cfg.engine.dp_shard_size) == (strategy, 2, None)
    assert "num_machines=2" in _origin(cfg, "dp_replicate_size")
    assert any("replicates over the 2 machines" in note for note in cfg.notes)
    # dp_shard takes what is left: the 8 processes of one machine, as FSDP's intra-node shard groups.
    assert Mesh.of(cfg.engine, 16, cfg.origins).sizes == (1, 2, 8, 1, 1)


def test_accelerate_fsdp_hybrid_shard_on_one_machine_is_plain_sharding_with_a_note(tmp_path):
    text = _BASE + "distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: HYBRID_SHARD\n"
    cfg = resolve_config(file=_write(tmp_path, "a.yaml", text), env={})
    assert (cfg.engine.strategy, cfg.engine.dp_replicate_size) == ("zero3", 1)
    assert any("on one machine is zero3 over all its processes" in note for note in cfg.notes)


def test_deepspeed_autotp_size_is_tp_size_and_its_other_keys_each_say_what_they_do(tmp_path):
    ds = {
        "zero_optimization": {"stage": 2},
        "tensor_parallel": {
            "autotp_size": 4,
            "tp_overlap_comm": True,
            "dtype": "bf16",
            "keep_module_on_host": False,
            "preset_model": None,
            "tp": {"tp_size": 4, "tp_grain_size": 64},
        },
    }
    cfg = resolve_config(file=_write(tmp_path, "ds.json", json.dumps(ds)), env={})
    assert (cfg.engine.strategy, cfg.engine.tp_size) == ("zero2", 4)
    assert "tensor_parallel.autotp_size" in _origin(cfg, "tp_size")
    assert any("the model's own plan" in note and "infers one" in note for note in cfg.notes)
    ignored = _ignored(cfg)
    for key in ("tp_overlap_comm", "dtype", "keep_module_on_host", "preset_model", "tp.tp_size", "tp.tp_grain_size"):
        assert f"tensor_parallel.{key}" in ignored, key


def test_deepspeed_hpz_is_hybrid_zero3_over_the_hpz_group_with_the_memory_that_differs(tmp_path):

    ds = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}}
    cfg = resolve_config(file=_write(tmp_path, "ds.json", json.dumps(ds)), env={})
    assert (cfg.engine.strategy, cfg.engine.dp_shard_size) == ("zero3", 4)
    assert "zero_hpz_partition_size" in _origin(cfg, "dp_shard_size")
    assert any("The update is the same" in n and "the memory is not" in n for n in cfg.notes)
    assert Mesh.of(cfg.engine, 16, cfg.origins).sizes == (1, 4, 4, 1, 1)
    with pytest.raises(ConfigError, match=r"dp_shard_size=4 \(.*zero_hpz_partition_size.*world size 6"):
        Mesh.of(cfg.engine, 6, cfg.origins)
    # DeepSpeed reads it at stage 3 only; below, it is ignored as there, and 1 is off.
    for stage, size in ((2, 4), (3, 1)):
        ds = {"zero_optimization": {"stage": stage, "zero_hpz_partition_size": size}}
        cfg = resolve_config(file=_write(tmp_path, "ds.json", json.dumps(ds)), env={})
        assert "dp_shard_size" not in cfg.origins and "zero_optimization.zero_hpz_partition_size" in _ignored(cfg)
