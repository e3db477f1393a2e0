"""CUDA placement checks. Skipped (not faked) on machines without a GPU."""

from __future__ import annotations

import numpy as np
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
    for _step in range(4):
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


def _trainer_run(tmp: str, bf16: bool) -> tuple[phalanx.Trainer, dict[str, torch.Tensor], list[float]]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 3))
    args = phalanx.TrainingArguments(
        output_dir=tmp,
        per_device_train_batch_size=16,
        num_train_epochs=3,
        logging_steps=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        bf16=bf16,
    )
    trainer = phalanx.Trainer(
        model,
        args,
        train_dataset=TensorDataset(x, y),
        eval_dataset=TensorDataset(x[:10], y[:10]),
        compute_loss_func=lambda out, labels, num_items_in_batch=None: torch.nn.functional.cross_entropy(out, labels),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, trainer.engine.get_state_dict(trainer.model), losses


@cuda
@pytest.mark.cuda
def test_the_trainer_on_one_gpu_matches_the_cpu_and_trains_in_bf16(tmp_path, monkeypatch):
    trainer, gpu_state, gpu_losses = _trainer_run(str(tmp_path / "gpu"), bf16=False)
    assert trainer.engine.device.type == "cuda" and next(trainer.model.parameters()).is_cuda
    pred = trainer.predict(trainer.eval_dataset)
    # moved to the host batch by batch, and handed over as numpy arrays (as transformers does)
    assert isinstance(pred.predictions, np.ndarray) and isinstance(pred.label_ids, np.ndarray)
    assert pred.predictions.shape == (10, 3) and pred.label_ids.shape == (10,)
    monkeypatch.setenv("PHALANX_DEVICE", "cpu")
    _, cpu_state, cpu_losses = _trainer_run(str(tmp_path / "cpu"), bf16=False)
    monkeypatch.delenv("PHALANX_DEVICE")
    for k, v in cpu_state.items():
        torch.testing.assert_close(gpu_state[k], v, rtol=1e-4, atol=1e-5, msg=k)
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)
    bf16, _, bf16_losses = _trainer_run(str(tmp_path / "bf16"), bf16=True)
    assert bf16.engine.precision_report()["compute"] == "bfloat16"
    assert bf16_losses[-1] < bf16_losses[0] and bf16_losses == pytest.approx(cpu_losses, rel=5e-2)


@cuda
@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:strategy .* shards nothing")
@pytest.mark.parametrize("strategy,offload", [("ddp", "none"), ("zero3", "cpu")])
def test_load_model_onto_the_gpu(tmp_path, strategy, offload):
    import safetensors.torch

    torch.manual_seed(1)
    source = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    safetensors.torch.save_file(source.state_dict(), str(tmp_path / "model.safetensors"))
    engine = phalanx.Engine(strategy=strategy, offload=offload, device="cuda")
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    model, _ = engine.prepare(model, torch.optim.AdamW(model.parameters()))
    engine.load_model(tmp_path)
    got = engine.get_state_dict(model)
    assert all(torch.equal(got[k], v) for k, v in source.state_dict().items())
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x.cuda()).cpu(), source(x), rtol=1e-5, atol=1e-5)


@cuda
@pytest.mark.cuda
def test_load_and_dispatch_over_the_gpu_host_memory_and_disk(tmp_path):
    from safetensors.torch import save_file
    from torch import nn

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)) for _ in range(6)]
    model = nn.Sequential(*blocks).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "w.safetensors")
    x = torch.randn(4, 256)
    with torch.inference_mode():
        want = model.cuda()(x.cuda()).cpu()
    with phalanx.init_empty_weights():
        empty = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)) for _ in range(6)])
    block = 2 * (256 * 256 + 256) * 4
    streaming = 2 * (256 * 256 + 256) * 4
    placed = phalanx.load_and_dispatch(
        empty,
        tmp_path / "w.safetensors",
        no_split_module_classes=["Sequential"],
        max_memory={0: 2 * block + streaming + 1000, "cpu": 2 * block + 1000},
    )
    assert list(placed.hf_device_map.values()) == [0, 0, "cpu", "cpu", "disk", "disk"]
    with torch.inference_mode():
        got = placed(x)  # a CPU input: the output comes back to the CPU
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert placed[2][0].weight.device.type == "cpu" and placed[4][0].weight.is_meta  # at rest between forwards


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("strategy,offload", [("ddp", "none"), ("zero3", "none"), ("zero3", "cpu")])
def test_a_meta_built_model_on_the_gpu_equals_the_cpu_build(strategy, offload):
    """Deferred init draws from the CPU generator and then moves each part to the GPU: the weights equal a CPU build."""
    from _common import TiedNet

    torch.manual_seed(100)
    want = TiedNet().state_dict()
    extra = {"offload": offload} if offload != "none" else {}
    engine = phalanx.Engine(strategy=strategy, device="cuda", **extra)
    torch.manual_seed(100)
    with torch.device("meta"):
        net = TiedNet()
    model = engine.prepare(net)
    got = engine.get_state_dict(model)
    assert all(torch.equal(got[k].cpu(), v) for k, v in want.items())
    assert model(torch.randint(0, 11, (2, 5), device=engine.device)).device.type == "cuda"


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_parallel_attention_and_cut_on_the_gpu(dtype):
    """The ring's blocks (a ring of one: no transfer) and Ulysses' pass-through on the device against SDPA, and a
    batch cut for rank 0 of cp2 staying on the device: what a one-GPU machine can check of context parallelism."""
    import torch.nn.functional as F

    from phalanx.strategies.context_parallel.context import ContextParallel
    from phalanx.strategies.context_parallel.ring import ring_attention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, 16, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 64, 16, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 64, 16, device="cuda", dtype=dtype, requires_grad=True)
    out = ring_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    tol = 1e-5 if dtype == torch.float32 else 2**-6 * ref.abs().max().item()  # bf16: four rounding units
    assert out.device.type == "cuda" and (out.float() - ref).abs().max().item() < tol
    out.float().sum().backward()
    assert q.grad is not None and q.grad.device.type == "cuda" and torch.isfinite(q.grad).all()
    cp = ContextParallel("ring", None, 2, 0)
    ids = torch.randint(0, 50, (2, 16), device="cuda")
    batch = cp.cut({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
    assert all(t.device.type == "cuda" for t in batch.values())
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert batch["shift_labels"][0].tolist() == [*ids[0, 1:5].tolist(), *ids[0, 13:].tolist(), -100]
