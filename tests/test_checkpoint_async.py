"""Asynchronous saves (``save_state(..., async_save=True)``, ``TrainingArguments(save_async=True)``): the same files
as a synchronous save, written while training goes on; one save at a time; failures raised, naming the rank, at the
next save, at ``wait_for_checkpoint()`` and at the end of the process; the process waits for a save in flight.

Equality is exact: the asynchronous checkpoint's manifest (but its time and id) and every tensor equal the
synchronous one's, and a run resumed from it continues bitwise as the run that saved it. The parameters and the
optimizer state are copied by the thread and the next optimizer step waits for that copy: the tests hold the copy
back until a step has begun (and a forward has changed BatchNorm's statistics), so a step that did not wait, or
buffers not taken in the call, would show in the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import BNNet, TiedNet, grouped_optimizer, make_data, make_tokens
from torch.utils.data import DataLoader, TensorDataset

import phalanx
import phalanx.checkpoint.state as state_module
from phalanx.checkpoint import Checkpoint, CheckpointError, async_save, latest_checkpoint
from phalanx.checkpoint.async_save import AsyncSave

STRATEGIES = ["ddp", "zero2", "zero3"]


def _setup(strategy: str):
    engine = phalanx.Engine(strategy=strategy, seed=5)
    torch.manual_seed(100)
    model = TiedNet()
    optimizer = grouped_optimizer("adamw", model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    x, y = make_tokens(64)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, loader, scheduler)
    return engine, model, optimizer, loader, iter(loader)


def _steps(engine, model, batches, n: int) -> None:
    for _ in range(n):
        x, y = next(batches)
        engine.train_step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def _same_checkpoint(a: Path, b: Path) -> None:
    """The manifests equal but for the time and the id of the save, and every tensor is bitwise equal."""
    with Checkpoint(a) as ca, Checkpoint(b) as cb:
        ma, mb = ({k: v for k, v in c.manifest.items() if k not in ("saved_at", "save_id")} for c in (ca, cb))
        assert json.dumps(ma, sort_keys=True, default=str) == json.dumps(mb, sort_keys=True, default=str)
        assert ca.verify() == [] and cb.verify() == []
        for key in ca.tensors:
            assert torch.equal(ca.read_whole(key), cb.read_whole(key)), key


def _slow_writes(seconds: float) -> None:
    """Every shard file takes ``seconds`` longer: a save is certainly still being written when looked at."""
    write = state_module.write_shard

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return write(*args, **kwargs)

    state_module.write_shard = slow


def _copy_once_a_step_began(optimizer) -> dict:
    """The thread's next copy of the state starts only once a ``step()`` of ``optimizer`` has begun (and 50 ms
    later): a step that did not wait for the copy would change what is saved. Returns a dict that says, once the
    copy ran, whether the step really came first (``step_came_first``), and holds the ``hook`` to remove after."""
    began = threading.Event()
    # Registered before the save's hook, so it runs first; removed on this thread by the caller, after the step
    # (torch refuses a hook removed while the hooks run).
    seen = {"hook": optimizer.register_step_pre_hook(lambda *_: began.set())}
    run = async_save.Copies.run

    def held_back(copies) -> None:
        async_save.Copies.run = run
        seen["step_came_first"] = bool(copies.pending) and began.wait(60)
        time.sleep(0.05)
        run(copies)

    async_save.Copies.run = held_back
    return seen


def _bitwise_and_ordering(root: str) -> dict:
    out: dict = {}
    for strategy in STRATEGIES:
        engine, model, optimizer, loader, batches = _setup(strategy)
        _steps(engine, model, batches, 3)
        engine.save_state(f"{root}/{strategy}-sync")
        seen = _copy_once_a_step_began(optimizer)
        saving = engine.save_state(f"{root}/{strategy}-async", async_save=True)
        assert isinstance(saving, AsyncSave)
        _steps(engine, model, batches, 2)  # changes the state the thread is writing from: it has its own copy
        assert engine.wait_for_checkpoint() == Path(f"{root}/{strategy}-async")
        seen["hook"].remove()
        out[f"{strategy}_step_came_first"] = seen.get("step_came_first")
        assert saving.result() == Path(f"{root}/{strategy}-async")
        straight = {k: v.clone() for k, v in engine.get_state_dict(model).items()}
        if engine.rank == 0:
            _same_checkpoint(Path(f"{root}/{strategy}-sync"), Path(f"{root}/{strategy}-async"))
        # A fresh run resumed from the asynchronous checkpoint continues as the run that saved it.
        engine, model, _, loader, _ = _setup(strategy)
        engine.load_state(f"{root}/{strategy}-async")
        _steps(engine, model, iter(loader), 2)
        resumed = engine.get_state_dict(model)
        out[strategy] = [k for k in straight if not torch.equal(straight[k], resumed[k])]

    # BatchNorm's running statistics change in the forward, before the step that the copy waits for: the call
    # takes them itself.
    engine = phalanx.Engine(strategy="ddp", seed=5)
    torch.manual_seed(100)
    bn_model = BNNet()
    bn_model, bn_opt = engine.prepare(bn_model, torch.optim.AdamW(bn_model.parameters(), lr=0.01))
    x, y = make_data(16)

    def bn_step() -> None:
        engine.train_step((x, y), lambda m, b: F.mse_loss(m(b[0]), b[1]))

    bn_step()
    engine.save_state(f"{root}/bn-sync")
    seen = _copy_once_a_step_began(bn_opt)
    engine.save_state(f"{root}/bn-async", async_save=True)
    bn_step()
    engine.wait_for_checkpoint()
    seen["hook"].remove()
    out["bn_step_came_first"] = seen.get("step_came_first")
    if engine.rank == 0:
        _same_checkpoint(Path(f"{root}/bn-sync"), Path(f"{root}/bn-async"))

    # One save at a time, keep_last: each call returns before its files are written, and first waits for the last.
    engine, model, _, loader, batches = _setup("ddp")
    _slow_writes(0.3)
    handles = []
    for step in range(1, 5):
        _steps(engine, model, batches, 1)
        handles.append(engine.save_state(f"{root}/keep/step-{step}", keep_last=2, async_save=True))
        out.setdefault("running_after_call", []).append(not handles[-1].done())
        out.setdefault("earlier_done_after_call", []).append(all(h.done() for h in handles[:-1]))
    engine.wait_for_checkpoint()
    return out


def test_async_saves_equal_sync_saves_bitwise_one_at_a_time_with_keep_last(run_ranks, tmp_path):
    """ddp, zero2, zero3 on 2 ranks: the asynchronous checkpoint equals the synchronous one of the same state
    bitwise (manifest, checksums, tensors), though training went on during the write and a step began before the
    thread copied the parameters and optimizer state (the step waits for that copy; a BatchNorm model's forward
    changed its statistics first), and resuming from it continues bitwise; saves in a row each return at once,
    wait for the one before, and rotate under keep_last."""
    results = run_ranks(_bitwise_and_ordering, 2, str(tmp_path))
    for rank, res in enumerate(results):
        for name in (*STRATEGIES, "bn"):
            assert res[f"{name}_step_came_first"] is True, (rank, name, res[f"{name}_step_came_first"])
        for strategy in STRATEGIES:
            assert res[strategy] == [], f"rank {rank}, {strategy}: resumed run differs in {res[strategy]}"
        assert res["running_after_call"] == [True] * 4
        assert res["earlier_done_after_call"] == [True] * 4
    assert sorted(os.listdir(tmp_path / "keep")) == ["step-3", "step-4"]  # no staging directory left either
    assert latest_checkpoint(tmp_path / "keep").name == "step-4"
    assert sorted(os.listdir(tmp_path / "keep" / "step-4")) == [
        "manifest.json",
        "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors",
    ]


def _fail_on(rank: int, engine) -> None:
    """The next shard file of ``rank`` fails as a full disk would."""
    write = state_module.write_shard

    def failing(*args, **kwargs):
        state_module.write_shard = write
        raise OSError(28, "No space left on device (injected)")

    if engine.rank == rank:
        state_module.write_shard = failing


def _errors(root: str) -> dict:
    out: dict = {}
    engine, model, _, loader, batches = _setup("zero2")
    _steps(engine, model, batches, 1)
    engine.save_state(f"{root}/step-1", async_save=True)
    # A failure on rank 1, raised on every rank by the collective wait.
    _steps(engine, model, batches, 1)
    _fail_on(1, engine)
    engine.save_state(f"{root}/step-2", async_save=True)
    try:
        engine.wait_for_checkpoint()
    except CheckpointError as e:
        out["wait"] = str(e)
    out["latest_after_wait"] = latest_checkpoint(root).name
    # A failure not waited for is raised by the next save, on every rank, once.
    _fail_on(1, engine)
    engine.save_state(f"{root}/step-2", async_save=True)
    _steps(engine, model, batches, 1)
    try:
        engine.save_state(f"{root}/step-3")
    except CheckpointError as e:
        out["next_save"] = str(e)
    engine.save_state(f"{root}/step-3")  # reported once: this one goes through
    # A failure on rank 0, fetched by each rank's own handle: the next save does not raise it again.
    _fail_on(0, engine)
    saving = engine.save_state(f"{root}/step-4", async_save=True)
    try:
        saving.result()
    except CheckpointError as e:
        out["result"] = str(e)
    out["step-4"] = os.path.exists(f"{root}/step-4")
    # The thread's copy of the parameters fails on rank 1: the step held for it goes on, and the save fails, named.
    if engine.rank == 1:
        run = async_save.Copies.run

        def failing_copy(copies) -> None:
            async_save.Copies.run = run
            copies.queued.set()  # what run() does however it ends
            raise RuntimeError("copy failed (injected)")

        async_save.Copies.run = failing_copy
    engine.save_state(f"{root}/step-6", async_save=True)
    _steps(engine, model, batches, 1)
    try:
        engine.wait_for_checkpoint()
    except CheckpointError as e:
        out["copy"] = str(e)
    # NaN in the state: the thread refuses to write it.
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")
    engine.save_state(f"{root}/step-5", async_save=True)
    try:
        engine.wait_for_checkpoint()
    except CheckpointError as e:
        out["nan"] = str(e)
    # The script ends while a (slow) save is being written: the process waits for it.
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = 0.0
    _slow_writes(1.0)
    out["done_at_return"] = engine.save_state(f"{root}/final", async_save=True).done()
    return out


def test_background_failures_surface_naming_the_rank_and_the_process_waits_at_exit(run_ranks, tmp_path):
    root = tmp_path / "ckpt"
    results = run_ranks(_errors, 2, str(root))
    for res in results:
        assert "rank 1: " in res["wait"] and "No space left on device (injected)" in res["wait"], res["wait"]
        assert res["latest_after_wait"] == "step-1"
        assert "earlier asynchronous save" in res["next_save"] and "rank 1: " in res["next_save"], res["next_save"]
        assert "step-2" in res["next_save"]
        assert "non-finite" in res["nan"], res["nan"]
        assert "rank 1: RuntimeError: copy failed (injected)" in res["copy"], res["copy"]
        assert res["done_at_return"] is False
        assert res["step-4"] is False
    assert "No space left on device (injected)" in results[0]["result"], results[0]["result"]
    assert "rank 0 gave this save up" in results[1]["result"], results[1]["result"]
    # Nothing half-written was left, and the save in flight at the end is complete and intact.
    assert sorted(os.listdir(root)) == ["final", "step-1", "step-3"]
    with Checkpoint(root / "final") as ck:
        assert ck.verify() == []
        assert ck.manifest["counters"]["global_step"] == 4


SCRIPT = """
import torch, phalanx, phalanx.checkpoint.state as state
def failing(*args, **kwargs):
    raise OSError(5, "Input/output error (injected)")
state.write_shard = failing
engine = phalanx.Engine(strategy="ddp")
model, opt = engine.prepare(torch.nn.Linear(4, 4), torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1))
engine.save_state("ckpt/step-1", async_save=True)
print("script done")
"""


def test_a_failure_never_raised_ends_the_process_with_exit_code_1(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {**os.environ, "PHALANX_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, "job.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert "script done" in proc.stdout
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "rank 0: the process ends, and its last asynchronous save" in proc.stderr, proc.stderr[-2000:]
    assert "Input/output error (injected)" in proc.stderr
    assert not (tmp_path / "ckpt" / "step-1").exists()


def _trainer(tmp: Path, save_async: bool) -> phalanx.Trainer:
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(64, 13, generator=g), torch.randint(0, 5, (64,), generator=g))
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(13, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    args = phalanx.TrainingArguments(
        output_dir=str(tmp),
        learning_rate=0.01,
        per_device_train_batch_size=8,
        max_steps=4,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=2,
        save_async=save_async,
        disable_tqdm=True,
        report_to=[],
        seed=0,
    )
    trainer = phalanx.Trainer(
        model, args, train_dataset=data, compute_loss_func=lambda o, y, **_: F.cross_entropy(o, y)
    )
    trainer.train()
    return trainer


def test_trainer_save_async_writes_the_same_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_DEVICE", "cpu")
    _trainer(tmp_path / "sync", False)
    _trainer(tmp_path / "async", True)
    names = sorted(os.listdir(tmp_path / "sync"))
    assert sorted(os.listdir(tmp_path / "async")) == names
    assert [n for n in names if n.startswith("checkpoint")] == ["checkpoint-3", "checkpoint-4"]
    for name in ("checkpoint-3", "checkpoint-4"):
        _same_checkpoint(tmp_path / "sync" / name, tmp_path / "async" / name)
        files = sorted(os.listdir(tmp_path / "sync" / name))
        assert sorted(os.listdir(tmp_path / "async" / name)) == files and "trainer_state.json" in files
        assert "model.safetensors" in files
        a, b = (json.loads((tmp_path / d / name / "trainer_state.json").read_text()) for d in ("sync", "async"))
        assert a == b
