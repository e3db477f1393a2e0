"""A DeepSpeed JSON trains under the strategy it names, and matches the same run configured natively.

Both runs go through the same strategy code, so their losses and parameters must be equal bit for bit; the native
run is itself checked against a single-process reference in test_zero.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.config.dialects.deepspeed_blocks import build_scheduler
from phalanx.config.settings import ConfigError
from tests._common import OddNet, make_data

DATA = Path(__file__).parent / "data" / "deepspeed"
STEPS = 4


def _train(engine_kwargs: dict, blocks: bool, micro: int = 4) -> dict:
    engine = phalanx.Engine(seed=0, **engine_kwargs)
    torch.manual_seed(100)
    model = OddNet()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = make_data(64)
    loader = DataLoader(TensorDataset(x, y), batch_size=micro)
    if blocks:
        optimizer = phalanx.DummyOptim(model.parameters())
        scheduler = phalanx.DummyScheduler(optimizer)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.001, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        block = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 3,
                                                "warmup_type": "linear"}}  # fmt: skip
        scheduler = build_scheduler(block, optimizer)
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, loader, scheduler)
    losses, lrs = [], []
    for i, (xb, yb) in enumerate(loader):
        if i == STEPS * engine.config.grad_accum_steps:
            break
        with engine.accumulate():
            loss = F.mse_loss(model(xb), yb)
            engine.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(engine.reduce(loss.detach()).item())
        lrs.append(optimizer.param_groups[0]["lr"])
    state = {k: v.clone() for k, v in engine.get_state_dict(model).items()}
    moved = any(not torch.equal(initial[k], state[k]) for k in initial)
    return {
        "losses": losses,
        "lrs": lrs,
        "state": state,
        "moved": moved,
        "strategy": engine.strategy.name,
        "offload": engine.config.offload,
        "accum": engine.config.grad_accum_steps,
        "type": type(
            engine.unwrap_optimizer(optimizer) if hasattr(engine, "unwrap_optimizer") else optimizer.optimizer
        ).__name__,
    }


def _compare(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and a["lrs"] == b["lrs"]
    for key in a["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), key


def test_hf_style_auto_json_with_offload_trains_as_the_native_config(run_ranks):
    via_json = run_ranks(_train, 2, {"config_file": str(DATA / "hf_auto_offload.json")}, False)
    # "auto" gradient_clipping is 1.0, as Accelerate fills it.
    native = run_ranks(_train, 2, {"strategy": "zero2", "offload": "cpu", "max_grad_norm": 1.0}, False)
    assert via_json[0]["strategy"] == "zero2" and via_json[0]["offload"] == "cpu"
    for rank in range(2):
        _compare(via_json[rank], native[rank])
    assert via_json[0]["moved"]  # it trained


def test_json_blocks_build_the_optimizer_and_schedule(run_ranks, tmp_path):
    ds = json.loads((DATA / "zero3_blocks.json").read_text())
    for block in ("offload_optimizer", "offload_param"):
        ds["zero_optimization"][block]["nvme_path"] = str(tmp_path / "offload")
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    via_json = run_ranks(_train, 2, {"config_file": str(tmp_path / "ds.json")}, True)
    # train 16 = micro 4 x accumulation 2 x 2 ranks; gradient_clipping 1.0 clips at each optimizer step.
    native_kwargs = {
        "strategy": "zero3",
        "offload": "disk",
        "offload_dir": str(tmp_path / "native"),
        "grad_accum_steps": 2,
        "max_grad_norm": 1.0,
    }
    native = run_ranks(_train, 2, native_kwargs, False)
    assert (via_json[0]["strategy"], via_json[0]["offload"], via_json[0]["accum"]) == ("zero3", "disk", 2)
    # DeepSpeed's linear warm-up over 3 steps: iteration i (the i-th step, from 0) runs at 0.001 * i / 3.
    assert via_json[0]["lrs"][:8:2] == pytest.approx([0.0, 0.0, 0.001 / 3, 0.002 / 3])
    for rank in range(2):
        _compare(via_json[rank], native[rank])
    shutil.rmtree(tmp_path / "offload", ignore_errors=True)


def test_the_loader_must_have_the_micro_batch_size_of_the_config(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 8}))
    with pytest.raises(ConfigError, match=r"micro_batch_size=8 .*DataLoader has batch_size=4"):
        _train({"config_file": str(tmp_path / "ds.json")}, False, micro=4)


def test_two_sources_for_one_optimizer_are_refused(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    with pytest.raises(ConfigError, match="two sources for one optimizer"):
        _train({"config_file": str(tmp_path / "ds.json")}, False)
    with pytest.raises(ConfigError, match="DummyOptim stands for the optimizer block"):
        _train({}, True)


def _stock_lrs(warmup: int, config: str | None) -> list[float]:
    engine = phalanx.Engine(seed=0, **({"config_file": config} if config else {"strategy": "zero2"}))
    model = OddNet()
    adam = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    if config:  # the blocks of the file, every value "auto", filled as Accelerate fills them
        optimizer = phalanx.DummyOptim(model.parameters(), **adam)
        scheduler = phalanx.DummyScheduler(optimizer, warmup_num_steps=warmup)
    else:  # the same written out: from 0 to the optimizer's lr, over at least one step
        optimizer = torch.optim.AdamW(model.parameters(), **adam)
        block = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                "warmup_num_steps": max(1, warmup)}}  # fmt: skip
        scheduler = build_scheduler(block, optimizer)
    model, optimizer, scheduler = engine.prepare(model, optimizer, scheduler)
    x, y = make_data(4)
    lrs = []
    for _ in range(5):
        engine.backward(F.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("warmup", [0, 4])
def test_the_stock_hf_deepspeed_config_trains_with_accelerate_s_fill(warmup):
    # transformers' ds_config_zero2.json shape (every optimizer and scheduler value "auto"), driven as Accelerate
    # scripts drive it: DummyOptim and DummyScheduler. It used to stop at prepare ("nothing fills it").
    filled = _stock_lrs(warmup, str(DATA / "hf_stock_zero2.json"))
    assert filled == _stock_lrs(warmup, None)
    assert filled[-1] == pytest.approx(0.01) and filled[0] < 0.01  # warmed up to the optimizer's lr
