"""CUDA placement checks. Skipped (not faked) on machines without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import phalanx

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.cuda
def test_engine_places_model_and_batches_on_the_local_gpu():
    engine = phalanx.Engine(precision="bf16-mixed")
    assert engine.device == torch.device("cuda", 0)
    model, loader = engine.prepare(
        torch.nn.Linear(8, 2), DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 2)), batch_size=8)
    )
    assert next(model.parameters()).device.type == "cuda"
    assert loader.pin_memory
    x, y = next(iter(loader))
    assert x.device == engine.device and y.device == engine.device
    out = model(x)
    assert out.dtype == torch.float32
    engine.backward(torch.nn.functional.mse_loss(out, y))
    assert engine.precision_report()["compute"] == "bfloat16"


def _nccl_ddp() -> list[float]:
    engine = phalanx.Engine(device="cuda")
    torch.manual_seed(engine.rank)
    model = torch.nn.Linear(8, 2)
    model = engine.prepare(model)
    x = torch.ones(4, 8, device=engine.device) * (engine.rank + 1)
    engine.backward(model(x).sum())
    return model.weight.grad.cpu().reshape(-1).tolist()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.cuda
def test_nccl_ddp_averages_gradients(run_ranks):
    g0, g1 = run_ranks(_nccl_ddp, 2)
    assert g0 == g1
    assert g0 == pytest.approx([6.0] * 8 + [6.0] * 8)  # mean over ranks of 4 rows of 1s and of 2s


@cuda
@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:strategy .* shards nothing")
@pytest.mark.parametrize("strategy,offload", [("zero2", "cpu"), ("zero3", "cpu"), ("zero3", "none")])
def test_zero_on_one_gpu_with_offload_and_accumulation_matches_torch(strategy, offload):
    """Device placement, pinned host slices and cross-device accumulation (no peers needed: world size 1)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).cuda()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    engine = phalanx.Engine(strategy=strategy, offload=offload, grad_accum_steps=2, device="cuda")
    model, optimizer = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    if offload == "cpu":
        assert all(p.device.type == "cpu" and p.is_pinned() for g in optimizer.param_groups for p in g["params"])
    data = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)).cuda()
    for step in range(4):
        for half in (data[:4], data[4:]):
            with engine.accumulate():
                engine.backward(model(half).square().mean())
                optimizer.step()
                optimizer.zero_grad()
        ref(data[:4]).square().mean().div(2).backward()
        ref(data[4:]).square().mean().div(2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = engine.get_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v.cpu(), rtol=1e-5, atol=1e-5, msg=k)


@cuda
@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:strategy .* shards nothing")
@pytest.mark.parametrize("strategy,options", [("ddp", {}), ("zero3", {"offload": "cpu"}), ("ddp", {"fused": True})])
def test_checkpoint_on_the_gpu_resumes_bitwise(tmp_path, strategy, options):
    """Device tensors go through pinned host memory on save; state comes back on the GPU (a fused AdamW's step
    too), RNG included, and training continues bitwise."""
    fused = options.pop("fused", False)

    def build() -> tuple[phalanx.Engine, torch.nn.Module, torch.optim.Optimizer]:
        engine = phalanx.Engine(strategy=strategy, device="cuda", seed=0, **options)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2))
        model, optimizer = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None))
        return engine, model, optimizer

    def step(engine: phalanx.Engine, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        engine.backward(model(torch.randn(4, 8, device="cuda")).square().mean())
        optimizer.step()
        optimizer.zero_grad()

    engine, model, optimizer = build()
    for _ in range(3):
        step(engine, model, optimizer)
    engine.save_state(tmp_path / "ck")
    for _ in range(3):
        step(engine, model, optimizer)
    straight = engine.get_state_dict(model)
    engine, model, optimizer = build()
    engine.load_state(tmp_path / "ck")
    if fused:
        assert all(s["step"].device.type == "cuda" for s in optimizer.state.values())
    for _ in range(3):
        step(engine, model, optimizer)
    resumed = engine.get_state_dict(model)
    for k, v in straight.items():
        assert torch.equal(resumed[k], v), k
