"""Config layering and validation, world detection from launcher environments, and topology checks."""

from __future__ import annotations

from pathlib import Path

import pytest

import phalanx
from phalanx.config.mesh import Mesh
from phalanx.config.settings import ConfigError, resolve_config
from phalanx.runtime.topology import Topology, TopologyError
from phalanx.runtime.world import detect_world, first_slurm_host


def test_layers_defaults_file_env_cli(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("precision: bf16-mixed\ngrad_accum_steps: 4\nseed: 7\nlaunch:\n  nproc_per_node: 3\n")
    env = {"PHALANX_GRAD_ACCUM_STEPS": "8", "PHALANX_SEED": "9"}
    cfg = resolve_config(file=f, env=env, cli={"seed": 11})
    assert cfg.engine.strategy == "ddp" and cfg.origins.get("strategy") is None  # default
    assert cfg.engine.precision == "bf16-mixed" and cfg.origins["precision"] == str(f)  # file
    assert cfg.engine.grad_accum_steps == 8 and cfg.origins["grad_accum_steps"] == "env PHALANX_GRAD_ACCUM_STEPS"
    assert cfg.engine.seed == 11 and cfg.origins["seed"] == "cli"
    assert cfg.launch.nproc_per_node == 3
    assert "grad_accum_steps             8" in cfg.describe()


def test_unknown_key_in_file_names_key_and_file(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("launch:\n  nprocs: 2\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown key 'launch\.nprocs'"):
        resolve_config(file=f, env={})


def test_wrong_type_in_file_names_key_and_file(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("grad_accum_steps: four\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: key 'grad_accum_steps' must be int; got 'four'"):
        resolve_config(file=f, env={})
    f.write_text("broadcast_buffers: 3\n")
    with pytest.raises(ConfigError, match="'broadcast_buffers' must be bool"):
        resolve_config(file=f, env={})


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match="env PHALANX_BUCKET_MB: key 'bucket_mb' must be float"):
        resolve_config(env={"PHALANX_BUCKET_MB": "big"})


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config(file="/no/such/phalanx.yaml", env={})


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"strategy": "dpp"}, "unknown strategy 'dpp'; valid strategies: ddp"),
        ({"precision": "fp8"}, "unknown precision 'fp8'; valid precisions: fp32, bf16-mixed, fp16-mixed"),
        ({"grad_accum_steps": 0}, "invalid grad_accum_steps: got 0"),
        ({"bucket_mb": -1.0}, "invalid bucket_mb: got -1.0"),
    ],
)
def test_engine_rejects_bad_values(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        phalanx.Engine(**kwargs)
    assert fragment in str(info.value)


def test_engine_rejects_unknown_option():
    with pytest.raises(ConfigError, match="unknown key 'bucket_size'.*did you mean 'bucket_mb'"):
        phalanx.Engine(bucket_size=10)


def test_world_from_torchrun_env():
    w = detect_world(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (w.rank, w.world_size, w.local_rank, w.source, w.init_method) == (3, 8, 1, "torchrun", "env://")


def test_world_from_slurm_env():
    w = detect_world(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_STEP_ID": "0",
            "SLURM_STEP_NODELIST": "gpu[07-08],cpu1",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert (w.rank, w.world_size, w.local_rank, w.source) == (5, 8, 1, "slurm")
    assert w.init_method == "tcp://gpu07:18456"


def test_world_from_open_mpi_env():
    w = detect_world(
        {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        }
    )
    assert (w.rank, w.world_size, w.local_rank, w.source, w.init_method) == (2, 4, 2, "mpi", "tcp://127.0.0.1:29500")
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        detect_world({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})


def test_plain_python_is_world_size_one():
    w = detect_world({})
    assert (w.rank, w.world_size, w.source, w.init_method) == (0, 1, "single", None)


def test_slurm_node_lists():
    assert first_slurm_host("node03") == "node03"
    assert first_slurm_host("node[03-05,7],gpu1") == "node03"
    assert first_slurm_host("a1,b2") == "a1"


def test_topology_layout_and_validation():
    t = Topology(Mesh(8, pp=2, dp_replicate=4), rank=5)
    assert (t.dp_size, t.pp_stage, t.dp_rank, t.data_rank) == (4, 1, 1, 1)
    with pytest.raises(TopologyError, match=r"the mesh pp 4 spans 4 ranks, not the 6 launched"):
        Topology(Mesh(6, pp=4), rank=0)
    with pytest.raises(TopologyError, match=r"rank must be in 0..5; got 6"):
        Topology(Mesh(6, dp_replicate=6), rank=6)


def test_mesh_layout_puts_tp_innermost_then_dp_shard_then_dp_replicate_then_pp():
    t = Topology(Mesh(16, pp=2, tp=2, dp_replicate=2, dp_shard=2), rank=13)
    # 13 = ((1 * 2 + 1) * 2 + 0) * 2 + 1
    assert t.coordinates(13) == (1, 1, 0, 0, 1)
    assert (t.pp_stage, t.dp_replicate_rank, t.dp_shard_rank, t.tp_rank) == (1, 1, 0, 1)
    assert (t.dp_size, t.dp_rank) == (4, 2)
    assert t.axis_ranks(("tp",)) == [12, 13]
    assert t.axis_ranks(("dp_shard",)) == [13, 15]
    assert t.axis_ranks(("dp_replicate",)) == [9, 13]
    assert t.axis_ranks(("dp_replicate", "dp_shard")) == [9, 11, 13, 15]
    assert t.axis_ranks(("pp",)) == [5, 13]
    assert all(t.mesh.rank_at(t.coordinates(r)) == r for r in range(16))
    # without tp the pipeline's pp-major layout is unchanged
    p = Topology(Mesh(8, pp=2, dp_shard=4), rank=5)
    assert p.axis_ranks(("dp_replicate", "dp_shard")) == [4, 5, 6, 7] and p.axis_ranks(("pp",)) == [1, 5]
    text = t.describe()
    assert "mesh (pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=2) on 16 ranks" in text
    assert "rank 13: pp=1 dp_replicate=1 dp_shard=0 cp=0 tp=1" in text


@pytest.mark.parametrize(
    ("strategy", "options", "world", "sizes"),
    [
        ("ddp", {}, 4, (1, 4, 1, 1, 1)),
        ("zero3", {}, 4, (1, 1, 4, 1, 1)),
        ("ddp", {"tp_size": 2}, 4, (1, 2, 1, 1, 2)),
        ("zero3", {"tp_size": 2}, 8, (1, 1, 4, 1, 2)),
        ("zero3", {"dp_replicate_size": 2}, 4, (1, 2, 2, 1, 1)),
        ("zero2", {"dp_shard_size": 2}, 8, (1, 4, 2, 1, 1)),
        ("pipeline", {"tp_size": 2}, 4, (2, 1, 1, 1, 2)),
        ("pipeline", {"tp_size": 2, "pp_size": 2}, 8, (2, 2, 1, 1, 2)),
        ("zero3", {"cp_size": 2}, 8, (1, 1, 4, 2, 1)),
        ("ddp", {"sp_size": 2, "tp_size": 2}, 8, (1, 2, 1, 2, 2)),
        ("pipeline", {"cp_size": 2, "pp_size": 2}, 8, (2, 2, 1, 2, 1)),
    ],
)
def test_mesh_sizes_fill_what_is_unset(strategy, options, world, sizes):
    cfg = resolve_config(cli={"strategy": strategy, **options}).engine
    assert Mesh.of(cfg, world).sizes == sizes


@pytest.mark.parametrize(
    ("strategy", "options", "world", "match"),
    [
        (
            "ddp",
            {"tp_size": 3},
            4,
            r"does not divide the world; tp_size=3 \(argument\), dp_shard_size=None \(default\)",
        ),
        (
            "ddp",
            {"dp_shard_size": 2},
            4,
            r"dp_shard_size=2 shards .* strategy 'ddp' does not do; .*use zero1, zero2 or zero3",
        ),
        ("zero3", {"dp_shard_size": 2, "dp_replicate_size": 1, "tp_size": 1}, 4, r"2 ranks, not the 4 launched"),
        (
            "pipeline",
            {"tp_size": 2, "pp_size": 3},
            8,
            r"pp x dp_replicate x dp_shard x cp x tp = 6 does not divide.*pp_size=3",
        ),
        ("zero3", {"cp_size": 3}, 4, r"does not divide the world; tp_size=1 \(default\), cp_size=3 \(argument\)"),
        ("ddp", {"cp_size": 2, "sp_size": 2}, 4, r"both split the sequence.*use cp_size=4 alone"),
    ],
)
def test_mesh_sizes_name_every_degree_in_one_error(strategy, options, world, match):
    cfg = resolve_config(cli={"strategy": strategy, **options}, cli_origin="argument")
    with pytest.raises(ConfigError, match=match) as err:
        Mesh.of(cfg.engine, world, cfg.origins)
    assert f"world size {world}" in str(err.value)


def test_tp_options_need_tp():
    with pytest.raises(
        ConfigError, match=r"sequence_parallel=True applies under tensor parallelism only; got tp_size=1"
    ):
        resolve_config(cli={"sequence_parallel": True})
