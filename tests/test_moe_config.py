"""Expert parallelism's fronts: every foreign spelling of it reaches the Engine's ep_size, or is refused or noted with
the reason.

DeepSpeed's AutoEP block (``expert_parallel``) maps its ``autoep_size`` to ep_size and notes or refuses its other keys;
``use_data_before_expert_parallelism`` is noted; Accelerate's ``deepspeed_moe_layer_cls_names`` is noted, and its
ParallelismConfig has no expert size (an ``ep_size`` written there is refused with where to set it instead);
TrainingArguments has its own ep_size field. The mesh refuses an ep_size that does not divide the data-parallel ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from phalanx.config.dialects.accelerate import from_accelerate
from phalanx.config.dialects.deepspeed import from_deepspeed
from phalanx.config.mesh import Mesh, MeshError
from phalanx.config.options import ConfigError
from phalanx.config.settings import resolve_config
from phalanx.trainer.arguments import TrainingArguments

DATA = Path(__file__).parent / "data"
AUTOEP = DATA / "deepspeed" / "autoep_zero2.json"


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    return path


def _ignored(cfg) -> dict[str, str]:
    """The ignored foreign keys (without the file's name) and why."""
    return {key.split(": ", 1)[1]: why for key, why in cfg.ignored}


def _ep(**block: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": 2}, "expert_parallel": {"enabled": True, "autoep_size": 2, **block}}


# ------------------------------------------------------------------------------------------ DeepSpeed's AutoEP
def test_the_autoep_fixture_maps_autoep_size_to_ep_size_with_its_origin():
    cfg = resolve_config(file=AUTOEP, env={})
    engine = cfg.engine
    assert (engine.strategy, engine.precision, engine.ep_size) == ("zero2", "bf16-mixed", 4)
    assert (engine.grad_accum_steps, engine.max_grad_norm) == (2, 1.0)
    assert "expert_parallel.autoep_size" in cfg.origins["ep_size"] and str(AUTOEP) in cfg.origins["ep_size"]
    assert any("autoep_size=4" in n and "base_model_ep_plan" in n and "drops no token" in n for n in cfg.notes)
    ignored = _ignored(cfg)
    for key in ("preset_model", "use_grouped_mm", "score_func", "top_k", "load_balance_coeff"):
        assert f"expert_parallel.{key}" in ignored, key
    assert "base_model_ep_plan" in ignored["expert_parallel.preset_model"]
    assert "consecutive" in ignored["use_data_before_expert_parallelism"]
    # The ep ranks are carved out of the data-parallel ranks: 4 of 4 here, and 6 do not split into groups of 4.
    mesh = Mesh.of(engine, 4, cfg.origins)
    assert (mesh.dp_shard, mesh.ep) == (4, 4)
    with pytest.raises(MeshError, match=r"ep_size=4 \(.*expert_parallel\.autoep_size.*does not divide the 6"):
        Mesh.of(engine, 6, cfg.origins)


def test_phalanx_config_shows_ep_size_and_where_it_came_from(capsys):
    from phalanx.launch.cli import main

    assert main(["config", "--config", str(AUTOEP), "-n", "4"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("ep_size "))
    assert " 4 " in line and "expert_parallel.autoep_size" in line
    assert "ep=4 within the data-parallel ranks" in out
    assert "# ignored: " in out and "expert_parallel.preset_model" in out


@pytest.mark.parametrize(
    "block",
    [
        {"enabled": False, "autoep_size": 4},
        {"enabled": False, "autoep_size": 4, "score_func": "sigmoid"},  # DeepSpeed reads nothing else when off
        {"enabled": True, "autoep_size": 1},
        {"enabled": "auto", "autoep_size": 4},
    ],
)
def test_autoep_off_or_of_size_one_leaves_ep_size_one(tmp_path, block):
    cfg = resolve_config(file=_write(tmp_path, {"expert_parallel": block}), env={})
    assert cfg.engine.ep_size == 1 and "ep_size" not in cfg.origins
    assert {"expert_parallel", "expert_parallel.autoep_size"} & set(_ignored(cfg))


def test_no_autoep_block_is_no_expert_parallelism():
    out = from_deepspeed({"zero_optimization": {"stage": 2}}, "ds.json")
    assert out.get("ep_size") is None


@pytest.mark.parametrize(
    "block, match",
    [
        ({"score_func": "sigmoid"}, r"expert_parallel\.score_func='sigmoid' cannot be honoured.*model's own router"),
        ({"score_apply": "pre"}, r"expert_parallel\.score_apply='pre' cannot be honoured.*remove it"),
        ({"top_k": 2}, r"expert_parallel\.top_k=2 cannot be honoured.*num_experts_per_tok.*remove top_k"),
        ({"route_norm": True}, r"expert_parallel\.route_norm=True .*norm_topk_prob in the model's config"),
        ({"route_scale": 2.5}, r"expert_parallel\.route_scale=2\.5 .*routed_scaling_factor in the model's config"),
        ({"num_expert_groups": 8}, r"expert_parallel\.num_expert_groups=8 .*n_group in the model's config"),
        ({"load_balance_coeff": 0.001}, r"expert_parallel\.load_balance_coeff=0\.001 .*remove it, or write null"),
        ({"expert_tensor_parallel_size": 2}, r"expert_parallel\.expert_tensor_parallel_size=2 .*use 1"),
        (
            {"moe_layer_pattern": "model\\.layers\\.\\d+\\.moe"},
            r"expert_parallel\.moe_layer_pattern=.*base_model_ep_plan",
        ),
        ({"expert_w1": "w1"}, r"expert_parallel\.expert_w1='w1' .*Remove it"),
        ({"autoep_sise": 4}, r"unknown key 'expert_parallel\.autoep_sise'; did you mean 'autoep_size'"),
        ({"autoep_size": 0}, r"expert_parallel\.autoep_size must be a whole number of at least 1"),
        ({"autoep_size": "4"}, r"expert_parallel\.autoep_size must be a whole number"),
        ({"enabled": "yes"}, r"expert_parallel\.enabled is true or false"),
    ],
)
def test_an_autoep_key_phalanx_cannot_honour_is_refused_naming_the_key_and_the_fix(tmp_path, block, match):
    with pytest.raises(ConfigError, match=match):
        resolve_config(file=_write(tmp_path, _ep(**block)), env={})


def test_autoep_keys_that_say_what_phalanx_does_anyway_are_noted(tmp_path):
    block = {"preset_model": "qwen3_moe", "use_grouped_mm": False, "disable_triton_grouped_mm": True,
             "combine_impl": "weighted_sum", "validate_folding_routing": True, "expert_tensor_parallel_size": 1,
             "score_func": "auto", "route_norm": None, "route_scale": 1.0, "routed_scaling_factor": "auto",
             "num_limited_groups": None, "expert_w3": None, "has_shared_experts": None}  # fmt: skip
    cfg = resolve_config(file=_write(tmp_path, _ep(**block)), env={})
    assert cfg.engine.ep_size == 2
    ignored = _ignored(cfg)
    for key in block:
        assert f"expert_parallel.{key}" in ignored, key


def test_use_data_before_expert_parallelism_is_noted_as_the_rank_order_it_is(tmp_path):
    cfg = resolve_config(file=_write(tmp_path, {**_ep(), "use_data_before_expert_parallelism": True}), env={})
    assert cfg.engine.ep_size == 2
    assert any("use_data_before_expert_parallelism=true" in n and "The update is the same" in n for n in cfg.notes)
    alone = resolve_config(file=_write(tmp_path, {"use_data_before_expert_parallelism": True}), env={})
    assert "read only with expert parallelism" in _ignored(alone)["use_data_before_expert_parallelism"]
    with pytest.raises(ConfigError, match="use_data_before_expert_parallelism is true or false"):
        resolve_config(file=_write(tmp_path, {"use_data_before_expert_parallelism": "yes"}), env={})


# ------------------------------------------------------------------------------------------------- Accelerate
def test_accelerate_s_moe_layer_classes_are_noted_and_its_parallelism_config_has_no_ep_size():
    section = {"zero_stage": 3, "deepspeed_moe_layer_cls_names": "MixtralSparseMoeBlock"}
    out = from_accelerate({"distributed_type": "DEEPSPEED", "deepspeed_config": section}, "a.yaml", dict)
    why = dict(out.ignored)["deepspeed_config.deepspeed_moe_layer_cls_names"]
    assert "leaf modules" in why and "base_model_ep_plan" in why
    yaml = {"distributed_type": "FSDP", "num_processes": 4, "parallelism_config": {"parallelism_config_ep_size": 2}}
    with pytest.raises(ConfigError, match=r"parallelism_config_ep_size: .*no expert-parallel size.*--ep-size"):
        from_accelerate(yaml, "a.yaml", dict)
    with pytest.raises(ConfigError, match=r"parallelism_config\['ep_size'\]: .*TrainingArguments\(ep_size=\.\.\.\)"):
        TrainingArguments(parallelism_config={"ep_size": 2})


# ------------------------------------------------------------------------------------------ TrainingArguments
def test_training_arguments_ep_size_reaches_the_engine_s_config(tmp_path, monkeypatch):
    import phalanx

    args = TrainingArguments(str(tmp_path), ep_size=2)
    options = args.engine_options()
    assert options["ep_size"] == 2
    resolved = resolve_config(env={}, cli=options, cli_origin="argument")
    assert resolved.engine.ep_size == 2 and resolved.origins["ep_size"] == "argument"
    assert "ep_size" not in TrainingArguments(str(tmp_path)).engine_options()  # unset: the launcher's or a file's
    with pytest.raises(ConfigError, match=r"strategy_options\['ep_size'\] is set by the TrainingArguments field"):
        TrainingArguments(str(tmp_path), strategy_options={"ep_size": 2})
    # The Engine builds its mesh from it, and names the argument when it does not fit one process.
    for var in ("PHALANX_CONFIG_JSON", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(MeshError, match=r"ep_size=2 \(argument\) does not divide the 1 data-parallel ranks"):
        phalanx.Engine(**options)


def test_training_arguments_ep_size_and_a_deepspeed_autoep_size_must_agree(tmp_path):
    ds = {"zero_optimization": {"stage": 2}, "expert_parallel": {"enabled": True, "autoep_size": 4}}
    with pytest.raises(ConfigError, match=r"expert_parallel\.autoep_size -> ep_size=4.*ep_size=2"):
        TrainingArguments(str(tmp_path), deepspeed=ds, ep_size=2)
    assert TrainingArguments(str(tmp_path / "run"), deepspeed=ds, ep_size=4).engine_options()["ep_size"] == 4
    with pytest.raises(ConfigError, match="ep_size"):
        TrainingArguments(str(tmp_path), strategy="zero2", ep_size=0)


# ------------------------------------------------------------------------------------------------------- mesh
def test_the_mesh_refuses_an_ep_size_that_does_not_divide_the_data_parallel_ranks():
    with pytest.raises(MeshError, match=r"ep_size=3 does not divide the 4 data-parallel ranks"):
        Mesh(4, dp_shard=4, ep=3)
    cfg = resolve_config(cli={"ep_size": 3}, env={})
    with pytest.raises(MeshError, match=r"ep_size=3 \(cli\) does not divide the 4 data-parallel ranks"):
        Mesh.of(cfg.engine, 4, cfg.origins)
    assert Mesh.of(cfg.engine, 6, cfg.origins).ep == 3
