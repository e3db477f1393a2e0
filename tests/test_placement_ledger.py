"""The placement ledger (``runtime/placement.py``): what ``engine.prepare`` puts on the compute device.

On these CPU-only gloo ranks the compute device is the CPU: the ledger counts the strategies' placements all the
same (moves that are no-ops here included), so the bounds below are what a GPU would hold.

zero3 of a model built on the host (not meta) places, on each rank, its buffers, and one unit at a time: the unit's
padded flat working buffer (to take rank 0's values), from which it keeps its shard. With U the units, n_u the
elements of unit u, N the ranks, padded_u = ceil(n_u / N) * N (the documented padding) and shard_u = padded_u / N,
all fp32 (4 bytes):

    without offload:   peak <= buffers + sum_u shard_u * (4 + 4) + max_u padded_u * 4
                       (each rank's parameter shard, which is the fp32 master, and its fp32 gradient slice; plus
                       one unit's working buffer), and after prepare live == buffers + sum_u shard_u * (4 + 4);
    with offload=cpu:  peak <= buffers + max_u padded_u * 4 (shards, masters and gradient slices on the host; only
                       one unit's working buffer at a time on the device), and after prepare live == buffers.

Before the fix (issue 36, B2) zero3 moved the whole model onto the device first (``model.to(device)``): on 4 ranks
each rank's peak was 93,488 bytes (the model's 92,992 and its buffers' 496), against 62,160 allowed without offload
and 15,632 with offload=cpu. Now: 61,040 and 15,632.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.runtime.placement import LEDGER, PlacementLedger

WIDTH, BLOCKS = 61, 6  # 61 x 61 + 61 = 3782 elements a block: no world size of 2, 3 or 4 divides it


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)])
        self.norm = nn.BatchNorm1d(WIDTH)  # two fp32 buffers and an int64 one
        self.head = nn.Linear(WIDTH, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(self.norm(x))


def _units(model: nn.Module) -> list[int]:
    """Elements of each zero3 unit (the default units: each child module with parameters, inside ModuleLists)."""
    return [sum(p.numel() for p in m.parameters()) for m in [*model.blocks, model.norm, model.head]]


def _expected(model: nn.Module, world: int) -> dict[str, int]:
    padded = [math.ceil(n / world) * world for n in _units(model)]
    return {
        "buffers": sum(b.untyped_storage().nbytes() for b in model.buffers()),
        "shards": sum(p // world * (4 + 4) for p in padded),
        "one_unit": max(padded) * 4,
        "whole": sum(_units(model)) * 4,
    }


def _train_step(engine: phalanx.Engine, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(engine.rank)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randint(0, 7, (8,), generator=g)
    engine.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    optimizer.zero_grad()


def _zero3(offload: str, meta: bool) -> dict:
    engine = phalanx.Engine(strategy="zero3", seed=0, offload=offload)
    torch.manual_seed(engine.rank)  # ranks differ: prepare takes rank 0's values
    if meta:
        with torch.device("meta"):
            model = Net()
        expected = _expected(Net(), engine.world_size)  # sizes only
    else:
        model = Net()
        expected = _expected(model, engine.world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    LEDGER.reset()
    model, optimizer = engine.prepare(model, optimizer)
    out = {"peak": LEDGER.peak_bytes, "live": LEDGER.live_bytes, "moves": list(LEDGER.moves), **expected}
    _train_step(engine, model, optimizer)  # gathers and frees every unit twice: the ledger follows the resizes
    out["live_after_step"] = LEDGER.live_bytes
    out["pool"] = engine.strategy.comm.pool.nbytes  # the gathered units' and gradients' buffers, kept for reuse
    out["plan"] = engine.memory_report()["held"]["comm_buffers"]
    return out


def _ddp() -> dict:
    engine = phalanx.Engine(strategy="ddp", seed=0)
    model = Net()
    whole = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)  # the flat buckets
    LEDGER.reset()
    engine.prepare(model)
    return {
        "live": LEDGER.live_bytes,
        "peak": LEDGER.peak_bytes,
        "whole": whole + grads,
        "moves": [w for w, _ in LEDGER.moves],
    }


def _all(world: int) -> dict:
    return {
        "host": _zero3("none", meta=False),
        "host_offload": _zero3("cpu", meta=False),
        "meta": _zero3("none", meta=True),
        "ddp": _ddp(),
    }


def test_zero3_of_a_host_built_model_places_shards_and_one_unit(run_ranks):
    world = 4
    for rank, res in enumerate(run_ranks(_all, world, world)):
        for built in ("host", "meta"):
            r = res[built]
            bound = r["buffers"] + r["shards"] + r["one_unit"]
            where = f"zero3, model built on {built}, rank {rank} of {world}"
            assert bound < r["whole"], "the bound must be below the whole model for this test to mean anything"
            assert r["peak"] <= bound, f"{where}: peak {r['peak']} bytes on the device > shards + one unit = {bound}"
            assert r["live"] == r["buffers"] + r["shards"], f"{where}: {r['live']} bytes held after prepare"
            # No parameter went to the device whole: only the units' working buffers, shards and gradient slices.
            whole_params = [w for w, _ in r["moves"] if w.endswith((".weight", ".bias"))]
            assert not whole_params, f"{where}: parameters placed whole: {whole_params}"
            # After a step the device holds what it held after prepare, and the pool of buffers the step reuses,
            # within the plan's peak of them.
            assert r["live_after_step"] == r["live"] + r["pool"], f"{where}: a step left {r['live_after_step']} bytes"
            assert 0 < r["pool"] <= r["plan"], f"{where}: the pool holds {r['pool']} bytes; the plan, {r['plan']}"

        r = res["host_offload"]
        where = f"zero3, offload=cpu, rank {rank} of {world}"
        assert r["peak"] <= r["buffers"] + r["one_unit"], f"{where}: peak {r['peak']} on the device"
        assert r["peak"] > r["buffers"], f"{where}: the working unit goes through the device to take rank 0's values"
        assert r["live"] == r["buffers"], f"{where}: {r['live']} bytes on the device after prepare"
        assert r["live_after_step"] == r["buffers"] + r["pool"], f"{where}: {r['live_after_step']} bytes after a step"
        assert 0 < r["pool"] <= r["plan"], f"{where}: the pool holds {r['pool']} bytes; the plan, {r['plan']}"

        # ddp holds the whole model and its gradient buckets on every rank: the ledger sees exactly that.
        d = res["ddp"]
        assert d["live"] == d["peak"] == d["whole"], f"ddp, rank {rank}: {d}"
        placed = [w for w in d["moves"] if w != "ddp gradient bucket"]
        assert len(placed) == len(list(Net().parameters())) + len(list(Net().buffers())), d["moves"]
        assert "ddp gradient bucket" in d["moves"]


# ---------------------------------------------------------------------------------------- the ledger alone
def test_ledger_counts_storages_once_and_forgets_freed_and_resized_ones():
    ledger = PlacementLedger()
    a = ledger.to_device(torch.zeros(100), "cpu", what="a")
    ledger.record(a[10:], what="a view")  # the same storage: not counted twice
    b = ledger.record(torch.zeros(50, dtype=torch.float64), what="b")
    assert (ledger.live_bytes, ledger.peak_bytes) == (400 + 400, 800)
    assert ledger.moves == [("a", 400), ("b", 400)]
    ledger.record(torch.empty(10, device="meta"))  # holds no memory
    assert ledger.live_bytes == 800
    del a
    assert ledger.live_bytes == 400  # the finalizer on the storage
    b.untyped_storage().resize_(0)
    ledger.resized(b)
    assert ledger.live_bytes == 0
    b.untyped_storage().resize_(200)
    ledger.resized(b)
    assert (ledger.live_bytes, ledger.peak_bytes) == (200, 800)
    ledger.resized(torch.zeros(3))  # not counted: ignored
    ledger.reset()
    assert (ledger.live_bytes, ledger.peak_bytes, ledger.moves) == (0, 0, [])
    del b  # forgotten by reset: its finalizer must not count it off again
    assert ledger.live_bytes == 0


def test_place_module_moves_through_the_ledger(monkeypatch):
    seen: list[str] = []
    real = LEDGER.to_device

    def spy(t: torch.Tensor, device, non_blocking: bool = False, what: str = "tensor") -> torch.Tensor:
        seen.append(what)
        return real(t, device, non_blocking, what)

    monkeypatch.setattr(LEDGER, "to_device", spy)
    from phalanx.runtime.placement import place_module

    LEDGER.reset()
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    place_module(model, "cpu", what="ddp:")
    assert seen == ["ddp: 0.weight", "ddp: 0.bias", "ddp: 1.weight", "ddp: 1.bias"] + [
        "ddp: 1.running_mean",
        "ddp: 1.running_var",
        "ddp: 1.num_batches_tracked",
    ]
    with torch.device("meta"):
        block = nn.Linear(3, 4)
    place_module(block, "cpu", what="block", empty=True)  # to_empty: allocated on the device, counted
    assert not block.weight.is_meta and LEDGER.moves[-1] == ("block bias", 16)
    LEDGER.reset()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_offload_host_buffers_are_pinned_for_cuda(monkeypatch, device):
    """S3: the host tensors that device<->host copies read or write are pinned when the compute device is CUDA (the
    CPU-only machine cannot pin: torch.zeros is intercepted to see what is asked for); on CPU nothing changes."""
    from phalanx.strategies.zero import offload

    asked: list[bool] = []
    real_zeros = torch.zeros

    def zeros(*args, pin_memory: bool = False, **kwargs):
        asked.append(pin_memory)
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(offload.torch, "zeros", zeros)
    store = offload.StateStore("cpu", torch.device(device))
    store.zeros(8, torch.float32)  # a master slice
    store.host_zeros(8, torch.float32)  # a gradient slice, or the staging buffer of a device-to-host copy
    assert asked == [device == "cuda"] * 2


def test_device_to_host_copy_waits_before_the_host_reads(monkeypatch):
    """S3: a non_blocking device-to-host copy returns before the data has landed. The helper must wait for the
    device (a CUDA event) before the host adds the landed values: checked with the wait intercepted, on CPU tensors,
    and the wait itself with a stand-in for torch.cuda.Event."""
    from phalanx.strategies.zero import collectives

    dst, src = torch.ones(4), torch.arange(4.0)
    staged_at_wait: list[torch.Tensor] = []

    def wait(device: torch.device) -> None:
        staged_at_wait.append(dst.clone())  # the host must not have read the staging buffer yet

    monkeypatch.setattr(collectives, "wait_for_device", wait)
    collectives.copy_to_host(dst, src, staging=torch.empty(8))
    assert len(staged_at_wait) == 1 and torch.equal(staged_at_wait[0], torch.ones(4))
    assert torch.equal(dst, torch.ones(4) + src)
    collectives.copy_to_host(dst, src.bfloat16())  # a plain copy, the dtype changed before it (on the device)
    assert dst.dtype == torch.float32 and torch.equal(dst, src) and len(staged_at_wait) == 2

    calls: list[str] = []

    class Event:
        def record(self, stream: str) -> None:
            calls.append(f"record on {stream}")

        def synchronize(self) -> None:
            calls.append("synchronize")

    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"the current stream of {device}")
    collectives.wait_for_device(torch.device("cuda", 1))
    collectives.wait_for_device(torch.device("cpu"))  # nothing to wait for: CPU copies are done when they return
    assert calls == ["record on the current stream of cuda:1", "synchronize"]
