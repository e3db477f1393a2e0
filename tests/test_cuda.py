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
