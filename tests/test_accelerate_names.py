"""Accelerate's names on the Engine (issue: the front door). Each test shows what the name does, against a reference:
plain torch, our own older name for the same thing, or the documented global sample order."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
import warnings
import weakref
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _common import Indices, OddNet, global_order, make_data
from torch import nn
from torch.utils.data import DataLoader

import phalanx


# ------------------------------------------------------------------------------------ accumulate(*models)
def _accumulated(form: str) -> tuple[dict[str, torch.Tensor], int]:
    engine = phalanx.Engine(grad_accum_steps=2, seed=0)
    torch.manual_seed(100)
    model = OddNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = engine.prepare(model, optimizer)
    passed = {"none": (), "prepared": (model,), "unwrapped": (engine.unwrap_model(model),)}[form]
    x, y = make_data(24)
    for i in range(6):
        with engine.accumulate(*passed):
            engine.backward(F.mse_loss(model(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4]))
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, engine.global_step


def test_accumulate_takes_the_prepared_models_and_accumulates_as_before():
    torch.manual_seed(100)
    ref = OddNet()
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    x, y = make_data(24)
    for s in range(3):  # two micro-batches of 4 are one step on the mean over 8
        F.mse_loss(ref(x[8 * s : 8 * s + 8]), y[8 * s : 8 * s + 8]).backward()
        optimizer.step()
        optimizer.zero_grad()
    for form in ("none", "prepared", "unwrapped"):
        state, steps = _accumulated(form)
        assert steps == 3, form
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, msg=f"{form}: {k}")


def test_accumulate_names_a_model_that_was_never_prepared():
    engine = phalanx.Engine(grad_accum_steps=2)
    model = engine.prepare(OddNet())
    with (
        pytest.raises(ValueError, match=r"got a Linear \(argument 1\) that engine.prepare did not return"),
        engine.accumulate(model, nn.Linear(2, 2)),
    ):
        pass
    with engine.accumulate(model):  # the refusal left no window half open
        pass
    assert engine._micro_steps == 1


# --------------------------------------------------------------------------------------- sync_gradients
def test_sync_gradients_is_true_outside_a_window_and_counts_steps_after_the_block():
    engine = phalanx.Engine(grad_accum_steps=3)
    assert engine.sync_gradients is True  # no window open yet
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Indices(7), batch_size=1)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    inside, counted = [], 0
    for idx in loader:
        with engine.accumulate(model):
            inside.append(engine.sync_gradients)
            engine.backward(model(idx.float().unsqueeze(1)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        if engine.sync_gradients:  # Accelerate's examples count optimizer steps so, after the block
            counted += 1
    # Windows of 3, and the DataLoader's last batch ends the short third window.
    assert inside == [False, False, True, False, False, True, True]
    assert counted == engine.global_step == 3
    assert engine.sync_gradients is True  # the last window ended


# ---------------------------------------------------------------------------------------------- autocast
@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16-mixed", torch.bfloat16)])
def test_autocast_is_a_context_manager_in_the_configured_precision(precision, dtype):
    engine = phalanx.Engine(precision=precision)
    layer = nn.Linear(4, 3)  # not prepared: autocast is for code outside the prepared models' forward
    x = torch.randn(2, 4)
    with engine.autocast():
        inside = layer(x)
    outside = layer(x)
    assert inside.dtype == dtype and outside.dtype == torch.float32
    torch.testing.assert_close(inside.float(), outside, atol=5e-2, rtol=5e-2)


# ------------------------------------------------------------------------------ world names, gather, save
Pair = namedtuple("Pair", "left right")


def _world_and_collectives(root: str) -> dict:
    engine = phalanx.Engine()
    r = engine.rank
    out: dict = {
        "names": (
            engine.num_processes,
            engine.process_index,
            engine.local_process_index,
            engine.is_local_main_process,
            str(engine.device),
        ),
        "ranks": (engine.world_size, engine.rank, engine.local_rank),
    }
    varlen = torch.arange(r + 1) + 10 * r  # lengths 1, 2, 3
    nested = {"a": [torch.full((2, 3), float(r)), (torch.tensor(float(r)),)], "p": Pair(torch.tensor([r]), varlen)}
    out["varlen"] = engine.gather(varlen)
    out["scalar"] = engine.gather(torch.tensor(r * 1.5))
    out["nested"] = engine.gather(nested)
    try:
        engine.gather(["text"])
    except TypeError as e:
        out["bad"] = str(e)
    # After a pass whose last global batch was padded: gather keeps the padding, gather_for_metrics drops it.
    loader = engine.prepare(DataLoader(Indices(7), batch_size=1))
    out["pass_gather"], out["pass_metrics"] = [], []
    for idx in loader:
        out["pass_gather"] += engine.gather(idx).tolist()
        out["pass_metrics"] += engine.gather_for_metrics(idx).tolist()

    # wait_for_everyone: rank 0 writes a little late; every rank sees the file after the barrier.
    flag = Path(root, "flag")
    if engine.is_main_process:
        time.sleep(0.3)
        flag.write_text("ready")
    engine.wait_for_everyone()
    out["flag_seen"] = flag.exists()
    engine.wait_for_everyone()
    # local_main_process_first: the first process of the machine runs the block before the others.
    cache = Path(root, "cache")
    with engine.local_main_process_first():
        if engine.is_local_main_process:
            time.sleep(0.3)
            cache.write_text("filled")
        out["cache_seen"] = cache.exists()

    # save: written once, by the main process, whichever rank's object is passed.
    engine.save({"w": torch.full((2,), float(r)), "b": torch.arange(3)}, os.path.join(root, "weights.safetensors"))
    engine.save({"step": 3, "w": torch.full((2,), float(r))}, os.path.join(root, "state.pt"))
    engine.save(torch.tensor(r), os.path.join(root, f"from-rank-{r}.pt"))
    for bad in ({"step": 3}, [torch.zeros(1)]):
        try:
            engine.save(bad, os.path.join(root, "bad.safetensors"))
        except TypeError as e:
            out.setdefault("save_errors", []).append(str(e))
    engine.wait_for_everyone()
    return out


def test_accelerate_world_names_gather_barriers_and_save_on_three_ranks(run_ranks, tmp_path):
    from safetensors import safe_open

    results = run_ranks(_world_and_collectives, 3, str(tmp_path))
    expected_nested = {
        "a": [torch.cat([torch.full((2, 3), float(r)) for r in range(3)]), (torch.tensor([0.0, 1.0, 2.0]),)],
        "p": Pair(torch.tensor([0, 1, 2]), torch.tensor([0, 10, 11, 20, 21, 22])),
    }
    for rank, out in enumerate(results):
        assert out["names"] == (3, rank, rank, rank == 0, "cpu")
        assert out["ranks"] == (3, rank, rank)
        assert out["varlen"].tolist() == [0, 10, 11, 20, 21, 22]  # in rank order, lengths may differ
        assert out["scalar"].tolist() == [0.0, 1.5, 3.0]  # a 0-d tensor becomes one item per process
        nested = out["nested"]
        assert isinstance(nested["a"][1], tuple) and isinstance(nested["p"], Pair)
        torch.testing.assert_close(nested, expected_nested)
        assert "engine.gather takes tensors" in out["bad"] and "got str" in out["bad"]
        # 7 samples on 3 ranks: the last global batch is padded from the start of the order.
        assert out["pass_gather"] == [0, 1, 2, 3, 4, 5, 6, 0, 1]
        assert out["pass_metrics"] == list(range(7))
        assert out["flag_seen"] and out["cache_seen"], rank
        assert "item 'step' is a int" in out["save_errors"][0] and "got a list" in out["save_errors"][1]
    with safe_open(str(tmp_path / "weights.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("w").tolist() == [0.0, 0.0] and f.get_tensor("b").tolist() == [0, 1, 2]
    saved = torch.load(tmp_path / "state.pt", weights_only=False)
    assert saved["step"] == 3 and saved["w"].tolist() == [0.0, 0.0]
    assert sorted(p.name for p in tmp_path.glob("from-rank-*")) == ["from-rank-0.pt"]
    assert not (tmp_path / "bad.safetensors").exists()


def test_save_refuses_a_pickle_under_a_safetensors_name(tmp_path):
    engine = phalanx.Engine()
    with pytest.raises(ValueError, match="pickle under a safetensors name"):
        engine.save({"w": torch.zeros(1)}, tmp_path / "w.safetensors", safe_serialization=False)
    engine.save({"w": torch.ones(2)}, tmp_path / "w.bin", safe_serialization=True)
    from safetensors.torch import load_file

    assert load_file(tmp_path / "w.bin")["w"].tolist() == [1.0, 1.0]


# --------------------------------------------------------------------------------------------- free_memory
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_free_memory_lets_the_prepared_objects_go_and_starts_afresh(strategy):
    def train(engine: phalanx.Engine, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = engine.prepare(model, optimizer)
        x, y = make_data(8)
        engine.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        return model, optimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zero2 on one rank shards nothing, and says so
        kept_engine, engine = phalanx.Engine(strategy=strategy), phalanx.Engine(strategy=strategy)
    model, optimizer = train(kept_engine, OddNet())
    kept = weakref.ref(model)
    del model, optimizer
    gc.collect()
    assert kept() is not None  # without free_memory the engine holds the model

    model, optimizer = train(engine, OddNet())
    ref = weakref.ref(model)
    assert engine.global_step == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = engine.free_memory(model, optimizer)
    assert (model, optimizer) == (None, None)
    gc.collect()
    assert ref() is None  # nothing in the engine (or its strategy) holds it any more
    assert engine.global_step == 0 and engine.sync_gradients
    model, optimizer = train(engine, OddNet())  # a second training in the same process
    assert engine.global_step == 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.free_memory()
    with pytest.raises(ValueError, match=r"OddNet was prepared before engine.free_memory"):
        engine.prepare(engine.unwrap_model(model))


# ---------------------------------------------------------------------------------------------- engine.epoch
N_SAMPLES, GLOBAL_BATCH, SEED = 30, 6, 7


def _epoch_run(root: str, resume: bool) -> dict:
    engine = phalanx.Engine(seed=SEED)
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Indices(N_SAMPLES), batch_size=GLOBAL_BATCH // engine.world_size, shuffle=True)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    out: dict = {"epochs": [], "batches": []}

    def step(idx: torch.Tensor) -> None:
        out["epochs"].append(engine.epoch)
        out["batches"].append(engine.gather(idx).tolist())
        engine.backward(model(idx.float().unsqueeze(1)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()

    if not resume:
        out["before"] = engine.epoch
        for epoch in range(2):
            for b, idx in enumerate(loader):
                step(idx)
                if epoch == 1 and b == 1:
                    break  # two global batches into epoch 1
        engine.save_state(root)
        out["saved_at"] = engine.epoch
        return out
    engine.load_state(root)
    out["resumed_at"], out["steps_per_epoch"], out["global_step"] = engine.epoch, len(loader), engine.global_step
    for _epoch in range(engine.epoch, 3):  # as a script resumes its epoch loop
        for idx in loader:
            step(idx)
    out["after"] = engine.epoch
    return out


def test_epoch_follows_the_loader_through_a_resume_on_another_world_size(run_ranks, tmp_path):
    def global_batches(epoch: int, start: int = 0) -> list[list[int]]:
        order = global_order(N_SAMPLES, SEED, epoch).tolist()
        return [order[i : i + GLOBAL_BATCH] for i in range(start * GLOBAL_BATCH, N_SAMPLES, GLOBAL_BATCH)]

    saved = run_ranks(_epoch_run, 2, str(tmp_path / "ck"), False)[0]
    assert saved["before"] == 0 and saved["saved_at"] == 1
    assert saved["epochs"] == [0] * 5 + [1] * 2
    assert saved["batches"] == global_batches(0) + global_batches(1)[:2]
    for world in (1, 3):
        resumed = run_ranks(_epoch_run, world, str(tmp_path / "ck"), True)[0]
        assert resumed["resumed_at"] == 1, world  # mid-epoch 1, whatever the world size
        assert resumed["global_step"] == 7 and resumed["steps_per_epoch"] == 5
        assert resumed["batches"] == global_batches(1, start=2) + global_batches(2), world
        assert resumed["epochs"] == [1] * 3 + [2] * 5, world
        assert resumed["after"] == 3


def test_epoch_without_a_loader_is_an_error():
    engine = phalanx.Engine()
    with pytest.raises(RuntimeError, match="no DataLoader was prepared"):
        _ = engine.epoch
    engine.prepare(DataLoader(Indices(4), batch_size=2))
    engine.prepare(DataLoader(Indices(4), batch_size=4))  # an eval loader prepared second does not count
    assert engine.epoch == 0


# -------------------------------------------------------------------------------------- warnings, once per job
WARNING_SCRIPT = textwrap.dedent(
    """
    import sys
    import warnings

    import phalanx


    def main(all_ranks):
        engine = phalanx.Engine(log_all_ranks=all_ranks)
        warnings.warn("a script warning, marker-" + str(7431))  # the marker is not in the source line shown
        engine.wait()


    if __name__ == "__main__":
        for all_ranks in (False, True):  # two jobs, one after the other; a line on each stream between them
            for stream in (sys.stdout, sys.stderr):
                print(f"=== job all_ranks={all_ranks}", file=stream, flush=True)
            phalanx.spawn(main, nprocs=2, args=(all_ranks,), threads_per_proc=1)
    """
)


def test_a_python_warning_prints_once_per_job_unless_every_rank_logs(tmp_path):
    # One parent process runs both jobs (log_all_ranks False, then True), which saves a second start (about 4 s of
    # CPU importing torch and phalanx); each job's output is what its stdout and stderr hold between the lines.
    script = tmp_path / "train.py"
    script.write_text(WARNING_SCRIPT)
    env = {**os.environ, "PHALANX_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr
    jobs = {False: "", True: ""}
    for stream in (proc.stdout, proc.stderr):
        before, first, rest = stream.partition("=== job all_ranks=False\n")
        one, second, two = rest.partition("=== job all_ranks=True\n")
        assert first and second and "marker-7431" not in before, stream
        jobs[False] += one
        jobs[True] += two
    for all_ranks, times in ((False, 1), (True, 2)):
        combined = jobs[all_ranks]
        assert combined.count("marker-7431") == times, (all_ranks, combined)
        if all_ranks:
            assert "[phalanx rank 1] WARNING" in combined and "UserWarning: a script warning" in combined


# ------------------------------------------------------------------------------------ ParallelismConfig and handlers
def test_parallelism_config_and_its_handlers_take_accelerate_s_fields():
    import dataclasses

    accelerate = pytest.importorskip("accelerate.utils.dataclasses", reason="accelerate is not installed")
    from accelerate.parallelism_config import ParallelismConfig as AcceleratePC

    from phalanx.accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig, TorchContextParallelConfig

    def names(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if f.init}

    assert names(ParallelismConfig) == names(AcceleratePC)
    assert names(TorchContextParallelConfig) == names(accelerate.TorchContextParallelConfig)
    assert names(DeepSpeedSequenceParallelConfig) == names(accelerate.DeepSpeedSequenceParallelConfig)
    pc = ParallelismConfig(cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy="alltoall"))
    assert pc.cp_enabled and not pc.sp_enabled and not pc.tp_enabled
