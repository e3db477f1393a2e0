"""`phalanx launch --max-restarts N --resume-from DIR`: a rank killed with SIGKILL mid-run, the worker group restarted,
and the script (which has no resume code) continues from the newest complete checkpoint in DIR. The final weights
must be bitwise equal to those of a run that was never interrupted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

PHALANX = [sys.executable, "-m", "phalanx"]

# No resume code: Engine(resume_from=...) comes from --resume-from, and prepare loads the newest checkpoint.
SCRIPT = textwrap.dedent(
    """\
    import os, sys
    import torch
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader, TensorDataset
    import phalanx

    kill_rank, kill_step, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    engine = phalanx.Engine()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.9)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, opt, loader, sched = engine.prepare(model, opt, loader, sched)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for epoch in range(engine.epoch, 3):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            engine.backward(loss)
            opt.step(); sched.step(); opt.zero_grad()
            if engine.global_step % 4 == 0:
                engine.save_state(f"{engine.config.resume_from}/step-{engine.global_step}", keep_last=2)
            if first_attempt and engine.global_step == kill_step and engine.rank == kill_rank:
                os.kill(os.getpid(), 9)
    state = engine.get_state_dict(model)
    if engine.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items()}, out)
    sys.stdout.write(f"steps {engine.global_step}\\n"); sys.stdout.flush()  # one write: ranks share the pipe
    """
)


def _launch(
    tmp_path: Path, name: str, strategy: str, nprocs: int, kill: tuple[int, int], restarts: int
) -> subprocess.CompletedProcess:
    (tmp_path / "job.py").write_text(SCRIPT)
    ckpt = tmp_path / f"{name}-ckpt"
    env = {**os.environ, "PHALANX_DEVICE": "cpu", "PHALANX_STRATEGY": strategy}
    return subprocess.run(
        [
            *PHALANX,
            "launch",
            "-n",
            str(nprocs),
            "--max-restarts",
            str(restarts),
            "--resume-from",
            str(ckpt),
            "job.py",
            str(kill[0]),
            str(kill[1]),
            str(tmp_path / f"{name}.safetensors"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.parametrize(("strategy", "nprocs", "kill"), [("ddp", 2, (1, 10)), ("zero2", 3, (0, 18))])
def test_a_killed_rank_restarts_from_the_newest_checkpoint_bitwise(tmp_path, strategy, nprocs, kill):
    straight = _launch(tmp_path, "straight", strategy, nprocs, (-1, -1), restarts=0)
    assert straight.returncode == 0, straight.stderr[-3000:]
    # The straight job resumes from a directory that holds no checkpoint yet: it starts fresh, and says so.
    assert "holds no checkpoint yet: training starts from the beginning" in straight.stderr
    assert "restart" not in straight.stderr.split("holds no checkpoint yet")[1]
    resumed = _launch(tmp_path, "resumed", strategy, nprocs, kill, restarts=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = 3 * 96 // (4 * nprocs)
    assert re.findall(r"steps (\d+)", resumed.stdout) == [str(steps)] * nprocs, resumed.stdout
    last_saved = kill[1] // 4 * 4
    # The launcher's summary: one restart, from the checkpoint before the kill.
    assert "phalanx launch: 1 restart" in resumed.stderr, resumed.stderr[-3000:]
    assert f"step-{last_saved} (global step {last_saved})" in resumed.stderr, resumed.stderr[-3000:]
    a, b = load_file(tmp_path / "straight.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


TRAINER_SCRIPT = textwrap.dedent(
    """\
    import os, sys
    import torch
    from safetensors.torch import save_file
    from torch.utils.data import TensorDataset
    import phalanx

    kill_step, out_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(96, 13, generator=g), torch.randint(0, 5, (96,), generator=g))
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(13, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 5))
    loss = lambda outputs, labels, num_items_in_batch=None: torch.nn.functional.cross_entropy(outputs, labels)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    class Kill(phalanx.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if first_attempt and state.global_step == kill_step and int(os.environ["RANK"]) == 1:
                os.kill(os.getpid(), 9)

    args = phalanx.TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, num_train_epochs=2,
                                     save_steps=4, save_total_limit=2, logging_steps=2, disable_tqdm=True,
                                     report_to=[], learning_rate=0.01)
    trainer = phalanx.Trainer(model, args, train_dataset=data, compute_loss_func=loss, callbacks=[Kill()])
    trainer.train()  # no resume_from_checkpoint: --resume-from (the output_dir) does it
    state = trainer.engine.get_state_dict(trainer.model)
    if trainer.engine.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items()}, out)
    sys.stdout.write(f"steps {trainer.state.global_step}\\n"); sys.stdout.flush()
    """
)


def test_the_trainer_resumes_from_its_output_dir_bitwise(tmp_path):
    (tmp_path / "train.py").write_text(TRAINER_SCRIPT)
    env = {**os.environ, "PHALANX_DEVICE": "cpu"}
    runs = {}
    for name, kill, restarts in (("straight", -1, 0), ("resumed", 10, 1)):
        out_dir = tmp_path / f"{name}-out"
        runs[name] = subprocess.run(
            [
                *PHALANX,
                "launch",
                "-n",
                "2",
                "--max-restarts",
                str(restarts),
                "--resume-from",
                str(out_dir),
                "train.py",
                str(kill),
                str(out_dir),
                str(tmp_path / f"{name}.safetensors"),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    assert "restart 1 resumed from checkpoint-8 (global step 8)" in runs["resumed"].stderr, runs["resumed"].stderr[
        -3000:
    ]
    assert re.findall(r"steps (\d+)", runs["resumed"].stdout) == ["24", "24"]  # 96 / (4 x 2) x 2 epochs
    a, b = load_file(tmp_path / "straight.safetensors"), load_file(tmp_path / "resumed.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_trainer_resume_dir_other_than_its_output_dir_is_refused(tmp_path, monkeypatch):
    import phalanx

    monkeypatch.setenv("PHALANX_RESUME_FROM", str(tmp_path / "elsewhere"))
    with pytest.raises(
        ValueError, match=r"the Trainer saves its checkpoints in output_dir=.*pass --resume-from with the output_dir"
    ):
        phalanx.Trainer(
            torch.nn.Linear(2, 2), phalanx.TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[])
        )


def test_a_backward_before_everything_the_checkpoint_holds_is_prepared_is_refused(tmp_path):
    import phalanx

    def parts():
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, 2)

    engine = phalanx.Engine(resume_from=str(tmp_path))
    model, opt, sched = engine.prepare(*parts())
    engine.backward(model(torch.ones(2, 3)).sum())
    opt.step()
    sched.step()
    opt.zero_grad()
    engine.save_state(tmp_path / "step-1")
    saved = {k: v.clone() for k, v in engine.get_state_dict(model).items()}

    again = phalanx.Engine(resume_from=str(tmp_path))
    model2, opt2, _ = parts()
    model2, opt2 = again.prepare(model2, opt2)  # the scheduler is missing: nothing can be loaded yet
    with pytest.raises(
        RuntimeError, match=r"step-1 holds state for objects not prepared yet \(1 more LR scheduler\(s\)\)"
    ):
        again.backward(model2(torch.ones(2, 3)).sum())
    third = phalanx.Engine(resume_from=str(tmp_path))
    model3, opt3, sched3 = third.prepare(*parts())  # everything at once: loaded here, before the loop
    assert third.global_step == 1
    for k, v in third.get_state_dict(model3).items():
        assert torch.equal(v, saved[k]), k


ELASTIC_SCRIPT = textwrap.dedent(
    """\
    import os, sys, signal
    import torch
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader, TensorDataset
    import phalanx

    engine = phalanx.Engine()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = engine.prepare(model, opt, DataLoader(data, batch_size=4, shuffle=True))
    sys.stdout.write(f"world {engine.world_size} from step {engine.global_step}\\n"); sys.stdout.flush()
    for epoch in range(engine.epoch, 2):
        for x, y in loader:
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step(); opt.zero_grad()
            if engine.global_step % 4 == 0:
                engine.save_state(f"{engine.config.resume_from}/step-{engine.global_step}")
            if engine.global_step == 6 and os.environ.get("LOSE_THIS_NODE") == "1":
                os.kill(os.getppid(), signal.SIGKILL)  # the node's launcher, then its worker: the machine is gone
                os.kill(os.getpid(), signal.SIGKILL)
    state = engine.get_state_dict(model)
    if engine.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items()}, sys.argv[1])
    sys.stdout.write(f"world {engine.world_size} finished at step {engine.global_step}\\n"); sys.stdout.flush()
    """
)


@pytest.mark.serial  # a 1 s keep-alive: a node starved of the cores for 3 s would be taken for lost
def test_an_elastic_job_that_loses_a_node_finishes_on_the_other(tmp_path):
    import shutil
    import socket

    (tmp_path / "job.py").write_text(ELASTIC_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Once torchrun's rendezvous has its minimum of nodes it waits last_call_timeout (30 s) for more, long enough
    # for a lost node's keep-alive to lapse (3 x 5 s) so that the round goes on without it. Both shorter here (the
    # lost node lapses after 3 x 1 s, and the survivor's round closes 8 s after it joins): the same sequence, a
    # third of the wait. PET_RDZV_CONF is torchrun's --rdzv-conf.
    rdzv = "last_call_timeout=8,keep_alive_interval=1,keep_alive_max_attempt=3"
    env = {**os.environ, "PHALANX_DEVICE": "cpu", "PET_RDZV_CONF": rdzv}
    argv = [
        *PHALANX,
        "launch",
        "--nnodes",
        "1:2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "-n",
        "1",
        "--max-restarts",
        "1",
        "--resume-from",
        "ckpt",
        "job.py",
    ]
    survivor = subprocess.Popen(
        [*argv, "a.safetensors"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # The node at the endpoint hosts torchrun's c10d rendezvous store, and the job cannot outlive it: it must be the
    # survivor. Start the other node once it listens.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    lost = subprocess.Popen(
        [*argv, "b.safetensors"],
        cwd=tmp_path,
        env={**env, "LOSE_THIS_NODE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = survivor.communicate(timeout=240)
        lost.communicate(timeout=30)
    finally:
        for p in (survivor, lost):
            p.kill()
    assert survivor.returncode == 0, err[-3000:]
    assert lost.returncode == -9
    # Two nodes of one rank each, then the survivor alone from the checkpoint before the loss (step 4 of 24).
    assert out.split("\n")[:3] == ["world 2 from step 0", "world 1 from step 4", "world 1 finished at step 44"], out
    assert "restart 1 resumed from step-4 (global step 4) on 1 rank(s)" in err, err[-3000:]
    # The reference: the smaller world continuing from that checkpoint, never interrupted.
    (tmp_path / "ref").mkdir()
    shutil.copytree(tmp_path / "ckpt" / "step-4", tmp_path / "ref" / "step-4")
    ref = subprocess.run(
        [*PHALANX, "launch", "-n", "1", "--resume-from", "ref", "job.py", "ref.safetensors"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "ref.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k
