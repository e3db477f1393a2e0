"""TrainingArguments: transformers' names and defaults, its derived values, phalanx's errors, and the Engine mapping."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import warnings

import pytest

from phalanx.config.settings import ConfigError
from phalanx.trainer import arguments as arguments_module
from phalanx.trainer.arguments import TrainingArguments, UnknownArgumentError

# Fields of ours that transformers 5 does not have: deprecated spellings it removed, and phalanx's own.
PHALANX_ONLY = {"warmup_ratio", "evaluation_strategy", "strategy", "precision", "strategy_options", "tp_size",
                "ep_size", "dp_shard_size", "dp_replicate_size", "save_async"}  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_deprecations():
    arguments_module._WARNED.clear()
    yield
    arguments_module._WARNED.clear()


def _default(f: dataclasses.Field) -> object:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]


def test_important_defaults_are_transformers_defaults():
    # Written out from transformers 5's training_args.py, so that this runs without transformers installed.
    expected = {
        "per_device_train_batch_size": 8, "per_device_eval_batch_size": 8, "gradient_accumulation_steps": 1,
        "learning_rate": 5e-5, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
        "optim": "adamw_torch_fused",
        "max_grad_norm": 1.0, "num_train_epochs": 3.0, "max_steps": -1, "lr_scheduler_type": "linear",
        "lr_scheduler_kwargs": None, "warmup_steps": 0, "logging_strategy": "steps", "logging_steps": 500,
        "logging_first_step": False, "eval_strategy": "no", "eval_steps": None, "eval_on_start": False,
        "save_strategy": "steps", "save_steps": 500, "save_total_limit": None, "save_only_model": False,
        "load_best_model_at_end": False, "metric_for_best_model": None, "greater_is_better": None, "seed": 42,
        "data_seed": None, "bf16": False, "fp16": False, "dataloader_num_workers": 0, "dataloader_drop_last": False,
        "dataloader_pin_memory": True, "remove_unused_columns": True, "label_names": None, "report_to": "none",
        "run_name": None, "disable_tqdm": None, "resume_from_checkpoint": None, "deepspeed": None,
        "gradient_checkpointing": None, "average_tokens_across_devices": True, "output_dir": None,
        "include_for_metrics": [], "prediction_loss_only": False, "logging_nan_inf_filter": True,
        "do_train": False, "do_eval": False, "do_predict": False, "optim_args": None,
        "dataloader_persistent_workers": False, "dataloader_prefetch_factor": None, "label_smoothing_factor": 0.0,
        "batch_eval_metrics": False, "eval_use_gather_object": False, "log_level": "passive",
        "log_level_replica": "warning", "skip_memory_metrics": True, "torch_compile": False,
        "torch_compile_backend": None, "torch_compile_mode": None, "restore_callback_states_from_checkpoint": False,
        "auto_find_batch_size": False, "enable_jit_checkpoint": False, "eval_delay": 0, "eval_accumulation_steps": None,
        "fsdp": None, "parallelism_config": None,
    }  # fmt: skip
    ours = {f.name: _default(f) for f in dataclasses.fields(TrainingArguments)}
    assert set(ours) == set(expected) | PHALANX_ONLY
    assert {k: ours[k] for k in expected} == expected
    args = TrainingArguments()
    # transformers' __post_init__ resolutions of the None defaults
    assert args.output_dir == "trainer_output"
    assert args.report_to == [] and args.disable_tqdm is False and args.gradient_checkpointing is False
    assert args.train_batch_size == 8 and args.eval_batch_size == 8
    assert args.metric_for_best_model is None and args.greater_is_better is None and args.precision is None


def test_defaults_equal_the_installed_transformers():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (a test extra)")
    theirs = {f.name: _default(f) for f in dataclasses.fields(transformers.TrainingArguments)}
    ours = {f.name: _default(f) for f in dataclasses.fields(TrainingArguments)}
    assert set(ours) - set(theirs) == PHALANX_ONLY, "a field name that transformers does not have"
    differ = {k: (v, theirs[k]) for k, v in ours.items() if k in theirs and v != theirs[k]}
    assert differ == {}, "(ours, transformers')"


def test_unknown_keyword_is_an_error_with_a_suggestion():
    with pytest.raises(UnknownArgumentError) as info:
        TrainingArguments("out", learning_rat=1e-4)
    assert "'learning_rat'" in str(info.value) and "did you mean 'learning_rate'?" in str(info.value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigError)
    with pytest.raises(TypeError, match="'bucket_mb' is an Engine knob; pass it as strategy_options="):
        TrainingArguments(bucket_mb=25)
    with pytest.raises(
        TypeError, match="'fsdp_config' is a transformers argument that phalanx does not take; use fsdp"
    ):
        TrainingArguments(fsdp_config={"version": 2})


def test_load_best_model_needs_matching_strategies():
    with pytest.raises(ConfigError) as info:
        TrainingArguments(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="steps")
    assert "eval_strategy='epoch'" in str(info.value) and "save_strategy='steps'" in str(info.value)
    with pytest.raises(ConfigError, match="save_steps=250, eval_steps=100"):
        TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=100, save_steps=250)
    with pytest.raises(ConfigError, match="a count and a ratio cannot promise"):
        TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.1, save_steps=500)
    ok = TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=100, save_steps=300)
    assert (ok.eval_steps, ok.save_steps) == (100, 300)
    ratios = TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.1, save_steps=0.3)
    assert ratios.save_steps == 0.3
    best = TrainingArguments(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="best")
    assert best.metric_for_best_model == "loss" and best.greater_is_better is False


def test_save_best_needs_an_evaluation():
    with pytest.raises(ConfigError, match="save_strategy='best'.*eval_strategy='no'"):
        TrainingArguments(save_strategy="best")


def test_seed_000_arguments():
    # How seed 000 writes them, evaluation_strategy included.
    with pytest.warns(FutureWarning, match="evaluation_strategy is deprecated"):
        args = TrainingArguments(
            output_dir="out",
            per_device_train_batch_size=16,
            per_device_eval_batch_size=32,
            logging_steps=10,
            evaluation_strategy="epoch",
            save_strategy="epoch",
            save_total_limit=3,
            learning_rate=2e-5,
            weight_decay=0.01,
            metric_for_best_model="f1",
            load_best_model_at_end=True,
        )
    assert args.eval_strategy == "epoch" and args.evaluation_strategy is None
    assert args.metric_for_best_model == "f1" and args.greater_is_better is True


def test_evaluation_strategy_warns_once_and_must_agree():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TrainingArguments(evaluation_strategy="steps", eval_steps=10)
        TrainingArguments(evaluation_strategy="steps", eval_steps=10)
    assert [str(w.message) for w in caught if w.category is FutureWarning] == [
        "TrainingArguments: evaluation_strategy is deprecated (transformers 5 removed it); use eval_strategy"
    ]
    with pytest.raises(ConfigError, match="evaluation_strategy='epoch' and eval_strategy='steps' disagree"):
        TrainingArguments(evaluation_strategy="epoch", eval_strategy="steps", eval_steps=5)


def test_warmup_ratio_is_read_into_warmup_steps_with_a_warning():
    with pytest.warns(FutureWarning, match="warmup_ratio is deprecated"):
        args = TrainingArguments(warmup_ratio=0.1)
    assert args.warmup_steps == 0.1 and args.warmup_ratio is None
    assert args.get_warmup_steps(95) == 10  # ceil(9.5)
    with pytest.raises(ConfigError, match="warmup_ratio=0.1 and warmup_steps=50 both set the warmup"):
        TrainingArguments(warmup_ratio=0.1, warmup_steps=50)
    with pytest.raises(ConfigError, match=r"invalid warmup_ratio: got 1.5 \(use a ratio in \[0, 1\)\)"):
        TrainingArguments(warmup_ratio=1.5)


def test_warmup_steps_count_or_ratio():
    assert TrainingArguments(warmup_steps=7).get_warmup_steps(1000) == 7
    assert TrainingArguments(warmup_steps=0.05).get_warmup_steps(1000) == 50
    assert TrainingArguments(warmup_steps=0.05).get_warmup_steps(30) == 2  # ceil(1.5)
    assert TrainingArguments(warmup_steps=0).get_warmup_steps(1000) == 0
    with pytest.raises(ConfigError, match="invalid warmup_steps: got 2.5"):
        TrainingArguments(warmup_steps=2.5)
    with pytest.raises(ConfigError, match="invalid warmup_steps: got -1"):
        TrainingArguments(warmup_steps=-1)


def test_eval_steps_fall_back_to_logging_steps():
    args = TrainingArguments(eval_strategy="steps", logging_steps=25)
    assert args.eval_steps == 25 and isinstance(args.eval_steps, int)
    assert TrainingArguments(eval_strategy="steps", eval_steps=0, logging_steps=0.2).eval_steps == 0.2
    with pytest.raises(ConfigError, match="needs eval_steps > 0, or logging_steps > 0"):
        TrainingArguments(eval_strategy="steps", logging_strategy="no", logging_steps=0)
    with pytest.raises(ConfigError, match="invalid logging_steps: got 12.5"):
        TrainingArguments(logging_steps=12.5)
    assert TrainingArguments(logging_steps=12.0).logging_steps == 12


def test_greater_is_better_follows_the_metric_name():
    assert TrainingArguments(metric_for_best_model="accuracy").greater_is_better is True
    assert TrainingArguments(metric_for_best_model="eval_loss").greater_is_better is False
    assert TrainingArguments(metric_for_best_model="loss", greater_is_better=True).greater_is_better is True
    lb = TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=500)
    assert lb.metric_for_best_model == "loss" and lb.greater_is_better is False


def test_precision_contradictions():
    with pytest.raises(ConfigError, match="bf16=True and fp16=True ask for two precisions"):
        TrainingArguments(bf16=True, fp16=True)
    with pytest.raises(ConfigError) as info:
        TrainingArguments(precision="fp32", bf16=True)
    assert "precision='fp32'" in str(info.value) and "bf16=True" in str(info.value)
    with pytest.raises(ConfigError, match="unknown precision 'bf16'"):
        TrainingArguments(precision="bf16")
    agree = TrainingArguments(precision="fp16-mixed", fp16=True)
    assert agree.precision == "fp16-mixed" and agree.fp16 and not agree.bf16
    from_precision = TrainingArguments(precision="bf16-mixed")
    assert from_precision.bf16 is True and from_precision.fp16 is False


def test_choices_and_counts_are_checked():
    with pytest.raises(ConfigError, match="invalid eval_strategy: got 'epochs'; did you mean 'epoch'?"):
        TrainingArguments(eval_strategy="epochs")
    with pytest.raises(ConfigError, match="invalid save_strategy: got 'always'"):
        TrainingArguments(save_strategy="always")
    with pytest.raises(ConfigError, match="unknown lr_scheduler_type 'cosin'; did you mean 'cosine'?"):
        TrainingArguments(lr_scheduler_type="cosin")
    with pytest.raises(ConfigError, match="key 'decay_steps' is not read by lr_scheduler_type='warmup_stable_decay'"):
        TrainingArguments(lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs={"decay_steps": 2})
    with pytest.raises(ConfigError, match="lr_scheduler_kwargs key 'power' is not read by lr_scheduler_type='cosine'"):
        TrainingArguments(lr_scheduler_type="cosine", lr_scheduler_kwargs={"power": 2.0})
    with pytest.raises(ConfigError, match="needs exactly one of min_lr or min_lr_rate"):
        TrainingArguments(lr_scheduler_type="cosine_with_min_lr")
    parsed = TrainingArguments(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs='{"min_lr_rate": 0.1}')
    assert parsed.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    with pytest.raises(ConfigError, match="invalid per_device_train_batch_size: got 0"):
        TrainingArguments(per_device_train_batch_size=0)
    with pytest.raises(ConfigError, match="invalid gradient_accumulation_steps: got 0"):
        TrainingArguments(gradient_accumulation_steps=0)
    with pytest.raises(
        ConfigError, match=r"optim='adafactor' is not built in; .* Trainer\(optimizers=\(optimizer, None\)\)"
    ):
        TrainingArguments(optim="adafactor")


def test_strategy_and_its_knobs_are_checked():
    with pytest.raises(ConfigError, match="unknown strategy 'zero4'; did you mean 'zero3'?"):
        TrainingArguments(strategy="zero4")
    with pytest.raises(
        ConfigError, match="strategy_options: unknown Engine knob 'bucket_md'; did you mean 'bucket_mb'?"
    ):
        TrainingArguments(strategy_options={"bucket_md": 10})
    with pytest.raises(
        ConfigError,
        match=r"strategy_options\['grad_accum_steps'\] is set by the TrainingArguments "
        "field gradient_accumulation_steps",
    ):
        TrainingArguments(strategy_options={"grad_accum_steps": 4})
    with pytest.raises(ConfigError, match="offload"):  # zero3's knob under ddp: the Engine's own rule, early
        TrainingArguments(strategy="ddp", strategy_options={"offload": "cpu"})
    args = TrainingArguments(strategy="zero3", strategy_options={"offload": "cpu", "bucket_mb": 8.0})
    assert args.engine_options()["offload"] == "cpu"


def test_engine_options_mapping(tmp_path):
    args = TrainingArguments(
        str(tmp_path),
        bf16=True,
        gradient_accumulation_steps=4,
        max_grad_norm=0.5,
        seed=7,
        strategy="ddp",
        strategy_options={"bucket_mb": 4.0},
    )
    assert args.engine_options() == {
        "strategy": "ddp",
        "precision": "bf16-mixed",
        "grad_accum_steps": 4,
        "seed": 7,
        "max_grad_norm": 0.5,
        "bucket_mb": 4.0,
    }
    plain = TrainingArguments(str(tmp_path), max_grad_norm=0).engine_options()
    assert plain == {"grad_accum_steps": 1, "seed": 42, "max_grad_norm": None}  # no strategy/precision: the launcher's
    assert TrainingArguments(fp16=True).engine_options()["precision"] == "fp16-mixed"


def test_engine_constructs_from_the_options(tmp_path, monkeypatch):
    import phalanx

    for var in ("PHALANX_CONFIG_JSON", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    args = TrainingArguments(str(tmp_path), bf16=True, gradient_accumulation_steps=2, max_grad_norm=2.0, seed=3)
    engine = phalanx.Engine(**args.engine_options())
    try:
        assert engine.config.precision == "bf16-mixed" and engine.config.grad_accum_steps == 2
        assert engine.config.max_grad_norm == 2.0 and engine.config.seed == 3 and engine.config.strategy == "ddp"
        assert engine.num_processes == 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def test_deepspeed_dict_is_written_and_auto_is_filled(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}  # fmt: skip
    args = TrainingArguments(str(tmp_path / "run"), deepspeed=ds, gradient_accumulation_steps=4, bf16=True)
    options = args.engine_options()
    path = tmp_path / "run" / "ds_config.json"
    assert options["deepspeed"] == str(path) and json.loads(path.read_text()) == ds
    from phalanx.config.settings import resolve_config

    resolved = resolve_config(env={}, cli=options, cli_origin="argument").engine
    assert (resolved.strategy, resolved.precision, resolved.grad_accum_steps) == ("zero2", "bf16-mixed", 4)
    assert resolved.max_grad_norm == 1.0  # "auto" gradient_clipping filled from max_grad_norm


def test_deepspeed_values_that_contradict_the_arguments(tmp_path):
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError) as info:
        TrainingArguments(str(tmp_path), deepspeed=str(ds_file), gradient_accumulation_steps=2)
    assert "grad_accum_steps=8" in str(info.value) and "grad_accum_steps=2" in str(info.value)
    assert "gradient_accumulation_steps" in str(info.value)
    ok = TrainingArguments(str(tmp_path), deepspeed=str(ds_file), gradient_accumulation_steps=8)
    assert ok.engine_options()["deepspeed"] == str(ds_file)
    with pytest.raises(ConfigError, match="unknown key 'zero_optimisation'"):
        TrainingArguments(deepspeed={"zero_optimisation": {"stage": 2}})


def test_to_dict_round_trips(tmp_path):
    args = TrainingArguments(
        str(tmp_path),
        eval_strategy="steps",
        eval_steps=50,
        lr_scheduler_type="polynomial",
        lr_scheduler_kwargs={"power": 2.0},
        label_names=["labels"],
        report_to="tensorboard",
        strategy="zero2",
        strategy_options={"bucket_mb": 2.0},
    )
    data = json.loads(args.to_json_string())
    assert data["eval_steps"] == 50 and data["report_to"] == ["tensorboard"] and data["strategy"] == "zero2"
    again = TrainingArguments(**data)
    assert again == args and again.to_dict() == args.to_dict()
    assert pickle.loads(pickle.dumps(args)) == args
    assert dataclasses.replace(args, seed=1).seed == 1


def test_no_clipping_in_the_arguments_contradicts_a_deepspeed_gradient_clipping(tmp_path):
    # max_grad_norm=0 means "do not clip"; the file's gradient_clipping must not win without a word.
    with pytest.raises(ConfigError, match=r"gradient_clipping -> max_grad_norm=1.0.*max_grad_norm=0.0"):
        TrainingArguments(output_dir=str(tmp_path), max_grad_norm=0, deepspeed={"gradient_clipping": 1.0})


# ------------------------------------------------------------------------ the device mesh: tp, hybrid sharding
@pytest.mark.parametrize(
    "fsdp, strategy",
    [
        (True, "zero3"),
        ("full_shard", "zero3"),
        ("shard_grad_op auto_wrap", "zero2"),
        ("no_shard", "ddp"),
        ("hybrid_shard", "zero3"),
        (["hybrid_shard_zero2", "offload"], "zero2"),
    ],
)
def test_fsdp_words_are_the_strategy(fsdp, strategy):
    args = TrainingArguments(fsdp=fsdp)
    assert args.strategy == strategy and args.engine_options()["strategy"] == strategy
    assert ("offload" in str(fsdp)) == (args.strategy_options.get("offload") == "cpu")


def test_fsdp_hybrid_shard_shards_over_the_processes_of_one_machine(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    options = TrainingArguments(fsdp="hybrid_shard").engine_options()
    assert (options["strategy"], options["dp_shard_size"]) == ("zero3", 4)  # dp_replicate: the machines, the rest
    assert "dp_replicate_size" not in options
    assert TrainingArguments(fsdp="hybrid_shard", tp_size=2).engine_options()["dp_shard_size"] == 2
    with pytest.raises(ConfigError, match="its 4 processes .* do not divide by tp_size=3"):
        TrainingArguments(fsdp="hybrid_shard", tp_size=3).engine_options()
    assert "dp_shard_size" not in TrainingArguments(fsdp="full_shard").engine_options()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert "dp_shard_size" not in TrainingArguments(fsdp="hybrid_shard").engine_options()  # one process


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fsdp": "hybrid_shard", "strategy": "ddp"}, r"fsdp='hybrid_shard' is strategy 'zero3', and strategy='ddp'"),
        ({"fsdp": "full_shard shard_grad_op"}, "names full_shard and shard_grad_op; give one"),
        ({"fsdp": "hybrid_shrd"}, "invalid fsdp: got 'hybrid_shrd'; did you mean 'hybrid_shard'"),
        ({"fsdp": "no_shard offload"}, "offload needs sharding"),
        ({"fsdp": "full_shard offload", "strategy_options": {"offload": "disk"}}, "offload='disk'"),
        ({"fsdp": "hybrid_shard", "dp_replicate_size": 2}, "shards within each machine.*dp_replicate_size=2"),
        # Ring attention and Ulysses both split the sequence: one at a time (Accelerate refuses the pair too).
        ({"parallelism_config": {"cp_size": 2, "sp_size": 4}}, r"\['cp_size'\]=2 and .*\['sp_size'\]=4 both split"),
        (
            {"parallelism_config": {"sp_size": 4, "sp_backend": "torch"}},
            "only sequence-parallel backend is 'deepspeed'",
        ),
        ({"parallelism_config": {"tp_sise": 2}}, "unknown key 'tp_sise'; did you mean 'tp_size'"),
        ({"parallelism_config": {"tp_size": 0}}, r"\['tp_size'\] must be a whole number of at least 1; got 0"),
        ({"parallelism_config": {"tp_size": 2}, "tp_size": 4}, "parallelism_config says tp_size=2 and the field"),
        ({"strategy_options": {"tp_size": 2}}, r"strategy_options\['tp_size'\] is set by the TrainingArguments field"),
        ({"strategy": "zero3", "strategy_options": {"sequence_parallel": True}}, "applies under tensor parallelism"),
    ],
)
def test_mesh_arguments_that_cannot_be_honoured_say_why(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TrainingArguments(**kwargs)


def test_parallelism_config_sizes_are_the_mesh_fields(tmp_path):
    args = TrainingArguments(
        str(tmp_path),
        fsdp=True,
        parallelism_config={"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2, "cp_size": 1},
        strategy_options={"sequence_parallel": True},
    )
    assert (args.tp_size, args.dp_shard_size, args.dp_replicate_size) == (2, 2, 2)
    options = args.engine_options()
    assert {k: options[k] for k in ("strategy", "tp_size", "dp_shard_size", "dp_replicate_size")} == {
        "strategy": "zero3",
        "tp_size": 2,
        "dp_shard_size": 2,
        "dp_replicate_size": 2,
    }
    assert options["sequence_parallel"] is True
    from phalanx.config.mesh import Mesh
    from phalanx.config.settings import resolve_config

    resolved = resolve_config(env={}, cli=options, cli_origin="argument")
    assert Mesh.of(resolved.engine, 8, resolved.origins).sizes == (1, 2, 2, 1, 2)
    again = TrainingArguments(**json.loads(args.to_json_string()))  # kept as plain values
    assert again == args
    # All ones (Accelerate's ParallelismConfig() with nothing set) asks for nothing.
    plain = TrainingArguments(parallelism_config={"tp_size": 1, "dp_shard_size": 1, "dp_replicate_size": 1})
    assert plain.tp_size is None and "tp_size" not in plain.engine_options()


def test_accelerate_s_parallelism_config_object_is_read(monkeypatch):
    accelerate = pytest.importorskip("accelerate.parallelism_config", reason="accelerate is not installed")
    for var in list(os.environ):
        if var.startswith("PARALLELISM_CONFIG_"):
            monkeypatch.delenv(var)
    args = TrainingArguments(
        strategy="zero3", parallelism_config=accelerate.ParallelismConfig(tp_size=2, dp_shard_size=4)
    )
    assert (args.tp_size, args.dp_shard_size, args.dp_replicate_size) == (2, 4, 1)
    assert args.parallelism_config == {
        "tp_size": 2, "dp_shard_size": 4, "dp_replicate_size": 1, "cp_size": 1, "sp_size": 1, "cp_backend": "torch",
        "sp_backend": "deepspeed",
    }  # fmt: skip
    # Context parallelism is ring attention, for the Engine (Accelerate's handler's allgather gets a note).
    args = TrainingArguments(parallelism_config=accelerate.ParallelismConfig(cp_size=2))
    assert args.engine_options()["cp_size"] == 2 and args.parallelism_config["cp_comm_strategy"] == "allgather"


def test_tp_size_contradicting_deepspeed_autotp_is_an_error(tmp_path):
    ds = {"tensor_parallel": {"autotp_size": 4}, "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match=r"tensor_parallel.autotp_size -> tp_size=4.*tp_size=2"):
        TrainingArguments(str(tmp_path), deepspeed=ds, tp_size=2)
    assert TrainingArguments(str(tmp_path), deepspeed=ds, tp_size=4).engine_options()["tp_size"] == 4
