"""The launcher's other spellings: torchrun's and Accelerate's flags, Horovod's ``horovodrun``, and the help.

Most checks run ``phalanx config`` in this process (it resolves the flags and prints every value with its origin);
two start real ranks to see that the settings arrive in the workers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import phalanx.launch.cli

PHALANX = [sys.executable, "-m", "phalanx"]


@pytest.fixture(autouse=True)
def _no_phalanx_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("PHALANX_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("HF_HOME", os.path.join(os.sep, "nonexistent-hf-home"))  # no Accelerate default config


def _config(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, tuple[str, str]]:
    """``phalanx config FLAGS`` as {key: (value, origin)}."""
    assert phalanx.launch.cli.main(["config", *flags]) == 0, capsys.readouterr().err
    table = {}
    for line in capsys.readouterr().out.splitlines():
        found = re.match(r"(\S+)\s+(.+?)\s+\((.*)\)$", line)
        if found and not line.startswith("#"):
            table[found.group(1)] = (found.group(2), found.group(3))
    return table


def _error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The one line that a refused command line prints (exit code 2)."""
    try:
        code = phalanx.launch.cli.main(list(args))
    except SystemExit as e:  # argparse's own checks (a value of the wrong type) end in exit(2)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


# ----------------------------------------------------------------------------------- flag -> setting
@pytest.mark.parametrize(
    "flags, expected",
    [
        # torchrun
        (
            [
                "--nproc_per_node",
                "3",
                "--nnodes",
                "2",
                "--node_rank",
                "1",
                "--master_addr",
                "10.0.0.5",
                "--master_port",
                "29400",
                "--max_restarts",
                "2",
            ],
            {
                "launch.nproc_per_node": "3",
                "launch.nnodes": "2",
                "launch.node_rank": "1",
                "launch.master_addr": "'10.0.0.5'",
                "launch.master_port": "29400",
                "launch.max_restarts": "2",
            },
        ),
        (["--nproc-per-node", "2", "--standalone"], {"launch.nproc_per_node": "2", "launch.nnodes": "1"}),
        (["--nproc_per_node", "cpu"], {"launch.nproc_per_node": str(os.cpu_count())}),
        (["--rdzv_endpoint", "10.0.0.5:29400", "--nnodes", "2"], {"launch.rdzv_endpoint": "'10.0.0.5:29400'"}),
        # Accelerate: --num_processes counts every machine's processes
        (
            [
                "--num_processes",
                "4",
                "--num_machines",
                "2",
                "--machine_rank",
                "1",
                "--main_process_ip",
                "10.0.0.5",
                "--main_process_port",
                "29400",
            ],
            {
                "launch.nproc_per_node": "2",
                "launch.nnodes": "2",
                "launch.node_rank": "1",
                "launch.master_addr": "'10.0.0.5'",
                "launch.master_port": "29400",
            },
        ),
        (["--num_processes", "3"], {"launch.nproc_per_node": "3", "launch.nnodes": "1"}),
        (
            ["--num_processes", "4", "--num_machines", "2", "-n", "2", "--master-port", "29400"],
            {"launch.nproc_per_node": "2"},
        ),
        (["--mixed_precision", "bf16"], {"precision": "'bf16-mixed'"}),
        (["--mixed_precision", "fp16"], {"precision": "'fp16-mixed'"}),
        (["--mixed_precision", "no", "--precision", "fp32"], {"precision": "'fp32'"}),
        (["--gradient_accumulation_steps", "4"], {"grad_accum_steps": "4"}),
        (["--gradient_clipping", "1.0"], {"max_grad_norm": "1.0"}),  # it was an unknown flag
        (["--use_deepspeed", "--zero_stage", "3"], {"strategy": "'zero3'"}),
        (["--zero_stage", "0"], {"strategy": "'ddp'"}),
        (["--zero_stage", "1", "--strategy", "zero1"], {"strategy": "'zero1'"}),
        (["--use_deepspeed"], {"strategy": "'zero2'"}),  # Accelerate's default stage
        (["--use_deepspeed", "--strategy", "zero3"], {"strategy": "'zero3'"}),
        (["--cpu", "--multi_gpu"], {"device": "'cpu'"}),
        # the underscore spelling of every engine flag
        (
            ["--grad_accum_steps", "3", "--max_grad_norm", "1.5", "--timeout_s", "60"],
            {"grad_accum_steps": "3", "max_grad_norm": "1.5", "timeout_s": "60.0"},
        ),
        (
            ["--strategy", "zero3", "--zero3_prefetch", "false", "--bucket_mb", "5"],
            {"zero3_prefetch": "False", "bucket_mb": "5.0"},
        ),
        # Accelerate's ParallelismConfig flags are the mesh's sizes; cp and sp of 1 ask for nothing.
        (
            [
                "-n",
                "8",
                "--strategy",
                "zero3",
                "--use_parallelism_config",
                "--parallelism_config_tp_size",
                "2",
                "--parallelism_config_dp_shard_size",
                "2",
                "--parallelism_config_dp_replicate_size",
                "2",
                "--parallelism_config_cp_size",
                "1",
                "--parallelism_config_sp_size",
                "1",
            ],
            {"tp_size": "2", "dp_shard_size": "2", "dp_replicate_size": "2"},
        ),
        (["--tp_size", "2", "--parallelism_config_tp_size", "2", "-n", "2"], {"tp_size": "2"}),
        (["--strategy", "zero2", "--offload_optimizer_device", "cpu"], {"offload": "'cpu'"}),
        (
            ["--strategy", "zero3", "--offload_param_device", "nvme", "--offload_optimizer_device", "nvme"]
            + ["--offload_optimizer_nvme_path", "/tmp"],
            {"offload": "'disk'", "offload_dir": "'/tmp'"},
        ),
    ],
)
def test_dialect_flags_set_the_phalanx_setting(capsys, flags, expected):
    table = _config(capsys, *flags)
    for key, value in expected.items():
        assert table[key][0] == value, (key, table[key])
        if key != "launch.nnodes":
            assert table[key][1] == "cli", (key, table[key])


def test_config_file_is_accelerates_spelling_of_config(capsys, tmp_path):
    config = tmp_path / "phalanx.yaml"
    config.write_text("seed: 7\nlaunch:\n  nproc_per_node: 3\n")
    assert _config(capsys, "--config_file", str(config)) == _config(capsys, "--config", str(config))
    assert _config(capsys, "--config_file", str(config))["seed"] == ("7", str(config))


def test_accelerate_s_default_config_is_read_when_no_config_is_given(capsys, tmp_path, monkeypatch):
    # accelerate launch reads $HF_HOME/accelerate/default_config.yaml when given no --config_file (not with --cpu);
    # phalanx used to ignore it, and ran fp32 on one process where the file asked for bf16 on two.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    default = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    assert _config(capsys)["precision"][1] == "default"  # no file there: nothing read
    default.parent.mkdir(parents=True)
    default.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmixed_precision: bf16\n"
        "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\n"
    )
    table = _config(capsys)
    assert table["precision"][0] == "'bf16-mixed'" and table["precision"][1].startswith(str(default))
    assert table["launch.nproc_per_node"][0] == "2"
    mine = tmp_path / "phalanx.yaml"
    mine.write_text("seed: 7\n")
    assert not _config(capsys, "--config", str(mine))["precision"][1].startswith(str(default))  # a given file wins
    assert not _config(capsys, "--cpu")["precision"][1].startswith(str(default))  # as accelerate launch --cpu


def test_num_processes_counts_the_machines_in_the_config_file(capsys, tmp_path):
    config = tmp_path / "phalanx.yaml"
    config.write_text("launch:\n  nnodes: 2\n  master_port: 29400\n")
    assert _config(capsys, "--config", str(config), "--num_processes", "6")["launch.nproc_per_node"] == ("3", "cli")
    assert (
        _config(capsys, "--config", str(config), "--num_processes", "6", "-n", "3")["launch.nproc_per_node"][0] == "3"
    )
    err = _error(capsys, "config", "--config", str(config), "--num_processes", "6", "-n", "6")
    assert "--num_processes 6 over nnodes=2 means 3 processes per node, and -n/--nproc-per-node says 6" in err


def test_deepspeed_config_file_is_deepspeed(capsys, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    table = _config(capsys, "--deepspeed_config_file", str(ds))
    assert table == _config(capsys, "--deepspeed", str(ds))
    assert table["strategy"][0] == "'zero3'" and table["deepspeed"] == (repr(str(ds)), "cli")
    # --use_deepspeed takes the stage of the file, not Accelerate's default 2
    assert _config(capsys, "--use_deepspeed", "--deepspeed", str(ds))["strategy"][0] == "'zero3'"


# --------------------------------------------------------------------------------- refused, in one line
@pytest.mark.parametrize(
    "flags, said",
    [
        (["--precision", "fp32", "--mixed_precision", "bf16"], ["--precision fp32", "--mixed_precision bf16"]),
        (["--strategy", "zero2", "--zero_stage", "3"], ["--strategy zero2", "--zero_stage 3"]),
        (["-n", "2", "--nproc_per_node", "3"], ["--nproc-per-node 2", "--nproc_per_node 3"]),
        (
            ["--grad-accum-steps", "2", "--gradient_accumulation_steps", "4"],
            ["--grad-accum-steps 2", "--gradient_accumulation_steps 4"],
        ),
        (["--grad-accum-steps", "2", "--grad_accum_steps", "3"], ["--grad-accum-steps 2", "--grad_accum_steps 3"]),
        (
            ["--master-port", "29400", "--main_process_port", "29401"],
            ["--master-port 29400", "--main_process_port 29401"],
        ),
        (["--config", "a.yaml", "--config_file", "b.yaml"], ["--config a.yaml", "--config_file b.yaml"]),
        (["--device", "cuda", "--cpu"], ["--device cuda", "--cpu"]),
        (["--num_processes", "4", "-n", "3"], ["--num_processes 4", "4 processes per node", "says 3"]),
        (
            ["--num_processes", "3", "--num_machines", "2", "--master-port", "29400"],
            ["--num_processes 3", "nnodes=2", "use --num_processes 2 or 4"],
        ),
        (["--num_processes", "two"], ["--num_processes", "'two'"]),
        (["--zero_stage", "4"], ["--zero_stage", "'4'", "0, 1, 2 and 3"]),
        (["--mixed_precision", "fp8"], ["fp8", "bf16"]),
        (["--mixed_precision", "int4"], ["'int4'", "no, fp16, bf16"]),
        (["--nproc_per_node", "many"], ["--nproc_per_node", "'many'"]),
        (["--standalone", "--nnodes", "2", "--master-port", "29400"], ["--standalone", "nnodes=2"]),
        (["--tp-size", "4", "--parallelism_config_tp_size", "2"], ["--tp-size 4", "--parallelism_config_tp_size 2"]),
        (
            ["--parallelism_config_cp_size", "4", "--parallelism_config_sp_size", "2"],
            ["--parallelism_config_cp_size=4 and --parallelism_config_sp_size=2 both split the sequence", "=8 alone"],
        ),
        (["--parallelism_config_sp_backend", "megatron", "--parallelism_config_sp_size", "2"], ["'deepspeed'"]),
        (["--parallelism_config_tp_size", "two"], ["--parallelism_config_tp_size takes a whole number", "'two'"]),
        (
            ["--offload_param_device", "cpu", "--offload_optimizer_device", "nvme"],
            ["--offload_param_device cpu", "--offload_optimizer_device nvme (= disk)", "same tier"],
        ),
        (["--offload_optimizer_device", "gpu"], ["--offload_optimizer_device", "'gpu'", "none, cpu or nvme"]),
        # under zero2 it would have moved the optimizer state instead, silently (DeepSpeed ignores it at stage 2)
        (
            ["--strategy", "zero2", "--offload_param_device", "cpu"],
            ["--offload_param_device cpu", "ZeRO stage 3", "'zero2'", "--offload_optimizer_device cpu"],
        ),
    ],
)
def test_disagreeing_or_bad_flags_are_one_line_naming_both(capsys, flags, said):
    err = _error(capsys, "config", *flags)
    assert err.startswith("phalanx config: config error: "), err
    for text in said:
        assert text in err, (text, err)


@pytest.mark.parametrize(
    "args, said",
    [
        (["launch", "--stratgy", "zero3", "train.py"], "unknown flag --stratgy; did you mean --strategy?"),
        (["launch", "--num_process=4", "train.py"], "unknown flag --num_process; did you mean --num_processes?"),
        (["config", "--mixed-precision", "bf16"], "unknown flag --mixed-precision; did you mean --mixed_precision?"),
        (["config", "--gradient_accumulation", "2"], "did you mean --gradient_accumulation_steps?"),
        (["launch", "--nproc", "2", "train.py"], "did you mean --nproc-per-node?"),
        (["horovodrun", "-np", "2", "--xyzzy", "t.py"], "unknown flag --xyzzy (see phalanx horovodrun --help)"),
    ],
)
def test_unknown_flags_get_one_line_with_the_nearest_spelling(capsys, args, said):
    err = _error(capsys, *args)
    assert said in err and "usage" not in err, err


def test_a_bad_value_is_one_line_too(capsys):
    err = _error(capsys, "launch", "-n", "x", "train.py")
    assert "invalid int value: 'x'" in err and "see phalanx launch --help" in err and "usage" not in err


# ------------------------------------------------------------------------------------------ help
def test_launch_help_lists_the_choices_and_the_dialects(capsys):
    with pytest.raises(SystemExit):
        phalanx.launch.cli.main(["launch", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    from phalanx.config.general import PRECISIONS
    from phalanx.config.registry import strategy_names

    assert f"[{', '.join(strategy_names())}] (default ddp)" in out
    assert f"[{', '.join(PRECISIONS)}] (default fp32)" in out
    for flag in (
        "--nproc_per_node",
        "--num_processes",
        "--mixed_precision {no,fp16,bf16}",
        "--zero_stage {0,1,2,3}",
        "--use_deepspeed",
        "--config_file",
        "--deepspeed_config_file",
        "--cpu",
        "--multi_gpu",
        "--parallelism_config_tp_size",
        "--parallelism_config_dp_shard_size",
        "--parallelism_config_dp_replicate_size",
        "--parallelism_config_cp_size",
        "--tp-size",
        "--dp-shard-size",
        "--dp-replicate-size",
        "--tp-plan",
        "--sequence-parallel",
    ):
        assert flag in out, flag
    assert "no=fp32, fp16=fp16-mixed, bf16=bf16-mixed" in out and "0=ddp, 1=zero1, 2=zero2, 3=zero3" in out


def test_demo_help_shows_the_demos_options_and_its_default_n():
    proc = subprocess.run([*PHALANX, "demo", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    n_help = out.split("--nproc-per-node NPROC_PER_NODE ")[1].split(" --nnodes")[0]
    assert n_help == "processes on this node (default: one per GPU, or 2 on a machine without GPUs)", n_help
    assert "--strategy STRATEGY" in out  # phalanx's flags
    assert "--steps STEPS optimizer steps (default: 300)" in out  # the demo's own


# ------------------------------------------------------------------------------------------ real ranks
REPORT = textwrap.dedent(
    """
    import json, os, sys, phalanx
    engine = phalanx.Engine()
    c = engine.config
    line = json.dumps({"rank": engine.rank, "world": engine.world_size, "strategy": c.strategy,
                       "precision": c.precision, "accum": c.grad_accum_steps, "argv": sys.argv[1:]})
    sys.stdout.write("REPORT " + line + " END\\n")
    sys.stdout.flush()
    engine.wait()
    """
)


def _reports(out: str) -> list[dict]:
    return sorted((json.loads(m) for m in re.findall(r"REPORT (.*?) END", out)), key=lambda r: r["rank"])


def test_accelerate_flags_reach_the_ranks_and_a_flag_after_the_script_goes_to_the_script(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    proc = subprocess.run(
        [
            *PHALANX,
            "launch",
            "--num_processes",
            "2",
            "--mixed_precision",
            "bf16",
            "--gradient_accumulation_steps",
            "2",
            "--use_deepspeed",
            "--zero_stage",
            "1",
            "--cpu",
            str(script),
            "--strategy",
            "zero3",
            "--lr",
            "1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    reports = _reports(proc.stdout)
    assert [r["rank"] for r in reports] == [0, 1], proc.stdout
    for r in reports:
        assert (r["world"], r["strategy"], r["precision"], r["accum"]) == (2, "zero1", "bf16-mixed", 2), r
        assert r["argv"] == ["--strategy", "zero3", "--lr", "1"]  # the script's own --strategy, untouched
    warnings = [line for line in proc.stderr.splitlines() if "came after the script" in line]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0] == (
        f"phalanx launch: --strategy came after the script name, so {script} gets it, not phalanx; to give it to "
        "phalanx, put it before the script: phalanx launch --num_processes 2 --mixed_precision bf16 "
        "--gradient_accumulation_steps 2 --use_deepspeed --zero_stage 1 --cpu --strategy zero3 "
        f"{script} --lr 1"
    )


def test_the_misplaced_flag_line_moves_only_phalanx_flags_and_stops_at_a_separator():
    from phalanx.launch.cli import _misplaced

    spellings = {"--strategy": True, "-n": True, "--cpu": False}
    assert _misplaced(["launch", "-n", "2", "t.py", "--lr", "1"], ["--lr", "1"], spellings) is None
    assert _misplaced(["launch", "t.py", "--", "--strategy", "x"], ["--", "--strategy", "x"], spellings) is None
    script_args = ["--cpu", "-n", "2", "--lr", "1"]
    line = _misplaced(["launch", "t.py", *script_args], script_args, spellings)
    assert line is not None and "--cpu and -n came after" in line
    assert line.endswith("put them before the script: phalanx launch --cpu -n 2 t.py --lr 1"), line


def test_horovodrun_is_launch(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    proc = subprocess.run(
        [*PHALANX, "horovodrun", "-np", "2", "-H", "localhost:2", str(script), "--epochs", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PHALANX_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    reports = _reports(proc.stdout)
    assert [(r["rank"], r["world"], r["argv"]) for r in reports] == [(r, 2, ["--epochs", "1"]) for r in (0, 1)]


@pytest.mark.parametrize(
    "args, said",
    [
        (["-np", "2", "-H", "node7:2"], ["host 'node7'", "not this machine", "--nnodes", "--master-addr"]),
        (["-np", "2", "-H", "localhost:1,10.1.2.3:1"], ["host '10.1.2.3'", "--nnodes"]),
        (["-np", "3", "-H", "localhost:2"], ["-np 3 needs 3 slots", "gives 2", "-H localhost:3"]),
        (["-np", "2", "-H", "localhost:x"], ["'x'", "e.g. -H localhost:2"]),
        (["-np", "0"], ["-np must be 1 or more; got 0"]),
    ],
)
def test_horovodrun_refuses_other_machines_and_missing_slots(capsys, tmp_path, args, said):
    script = tmp_path / "t.py"
    script.write_text("")
    err = _error(capsys, "horovodrun", *args, str(script))
    assert err.startswith("phalanx horovodrun: "), err
    for text in said:
        assert text in err, (text, err)
