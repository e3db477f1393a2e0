"""NCCL's rules on gloo (phalanx/runtime/nccl_rules.py), and the places that broke them: the suite's ranks all run
under the rules (tests/conftest.py), so every multi-rank test also checks that nothing NCCL refuses reaches a
collective; the tests here check the rules themselves and the paths that broke them before."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.runtime import nccl_rules
from phalanx.runtime.collective_log import LOG, watched

# Code "in phalanx": compiled with a file name inside the package, so that the rules mark what it makes.
_IN_PHALANX = os.path.join(nccl_rules._PACKAGE, "strategies", "_made_up_for_a_test.py")


def _run_as_phalanx(source: str, **names: object) -> dict[str, object]:
    scope: dict[str, object] = {"torch": torch, **names}
    exec(compile(source, _IN_PHALANX, "exec"), scope)
    return scope


def test_the_rules_mark_what_phalanx_puts_on_the_host():
    device = torch.device("cpu")  # the engine's device: a torch.device object
    with nccl_rules._Rules():
        made = _run_as_phalanx(
            "on_device = torch.zeros(3, device=device)\n"
            "no_device = torch.zeros(3)\n"
            "copied_out = on_device.cpu()\n"
            "derived = no_device * 2 + 1\n"
            "mixed = on_device * no_device\n"
            "moved_back = copied_out.to(device)\n"
            "pinned_spelling = on_device.to('cpu')\n"
            "listed = torch.tensor([1, 2])\n",
            device=device,
        )
        users_own = torch.zeros(3)  # the user's tensors are taken as placed where they should be
    site = nccl_rules.host_site
    assert site(made["on_device"]) is None and site(made["mixed"]) is None and site(made["moved_back"]) is None
    assert site(users_own) is None
    assert "_made_up_for_a_test.py:2 (torch.zeros() with no device)" in str(site(made["no_device"]))
    assert "(.cpu())" in str(site(made["copied_out"]))
    assert site(made["derived"]) == site(made["no_device"])
    assert "(.to('cpu'))" in str(site(made["pinned_spelling"]))
    assert "torch.tensor() with no device" in str(site(made["listed"]))
    # .cpu() on CPU returns the tensor itself: the device tensor must not be marked through it.
    assert site(made["on_device"]) is None


def test_wire_dtypes_round_trip_and_wrap_as_the_dtype_would():
    for dtype, wide in ((torch.int16, torch.int32), (torch.uint16, torch.int32), (torch.uint32, torch.int64)):
        t = torch.tensor([0, 7, 300], dtype=dtype)
        w = nccl_rules.to_wire(t)
        assert w.dtype == wide == nccl_rules.wire_dtype(dtype) and w.dtype not in nccl_rules.NCCL_DTYPES_MISSING
        assert torch.equal(nccl_rules.from_wire(w, dtype), t)
    big = torch.tensor([2**64 - 1, 5], dtype=torch.uint64)
    w = nccl_rules.to_wire(big)
    assert w.dtype == torch.int64 and torch.equal(nccl_rules.from_wire(w, torch.uint64), big)
    assert nccl_rules.from_wire(torch.tensor([60000], dtype=torch.int32), torch.int16).item() == 60000 - 2**16


def _refusals() -> dict[str, str]:
    dist.init_process_group("gloo", init_method=os.environ["PHALANX_INIT_METHOD"], rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))  # fmt: skip
    out: dict[str, str] = {}
    ok = torch.ones(2)
    watched(dist.all_reduce, ok)  # the user's tensor, a dtype NCCL has: allowed
    out["allowed"] = str(ok.tolist())
    host = _run_as_phalanx("t = torch.ones(2)\n")["t"]
    for name, call in (
        ("host", lambda: watched(dist.all_reduce, host)),
        ("int16", lambda: watched(dist.all_reduce, torch.ones(2, dtype=torch.int16))),
        ("uint32", lambda: watched(dist.broadcast, torch.ones(2, dtype=torch.uint32), src=0)),
    ):
        try:
            call()
            out[name] = "allowed"
        except nccl_rules.NcclRulesError as e:
            out[name] = str(e)
    solo = dist.new_group([0])
    if dist.get_rank() == 1:
        try:
            watched(dist.all_reduce, torch.ones(1), group=solo)
            out["not a member"] = "allowed"
        except nccl_rules.NcclRulesError as e:
            out["not a member"] = str(e)
    dist.barrier()
    return out


def test_the_rules_refuse_host_tensors_missing_dtypes_and_non_members(run_ranks):
    r0, r1 = run_ranks(_refusals, 2)
    assert r0["allowed"] == "[2.0, 2.0]"
    assert "host tensor (shape (2,), torch.float32) made at" in r0["host"] and "_made_up_for_a_test.py:1" in r0["host"]
    assert "NCCL has no int16" in r0["int16"] and "Widen it first" in r0["int16"]
    assert "NCCL has no uint32" in r1["uint32"]
    assert "rank 1 is not a member" in r1["not a member"]


# ------------------------------------------------------------------ the Accelerate front's helpers, on the device
def _pad_across_processes() -> list[list[int]]:
    from phalanx.accelerate.utils import pad_across_processes

    engine = phalanx.Engine()
    padded = pad_across_processes(torch.ones(1, engine.rank + 2, dtype=torch.long), dim=1, pad_index=-1)
    return padded.tolist()


def test_pad_across_processes_reduces_the_sizes_on_the_device(run_ranks):
    assert run_ranks(_pad_across_processes, 2) == [[[1, 1, -1]], [[1, 1, 1]]]


# ------------------------------------------------------------------------------ dtypes NCCL lacks, carried wide
def _narrow_dtypes() -> dict[str, object]:
    import phalanx.horovod as hvd

    hvd.init()
    out: dict[str, object] = {}
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64):
        t = hvd.allreduce(torch.tensor([3, 4 + hvd.rank()], dtype=dtype), op=hvd.Sum)
        out[f"allreduce {dtype}"] = (t.dtype, t.tolist())
        b = hvd.broadcast(torch.tensor([hvd.rank() + 7], dtype=dtype), root_rank=1)
        out[f"broadcast {dtype}"] = (b.dtype, b.tolist())
    return out


def test_horovod_carries_the_dtypes_nccl_lacks(run_ranks):
    r0, r1 = run_ranks(_narrow_dtypes, 2)
    assert r0 == r1
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64):
        assert r0[f"allreduce {dtype}"] == (dtype, [6, 9])
        assert r0[f"broadcast {dtype}"] == (dtype, [8])


class _Int16Buffer(torch.nn.Module):
    """A buffer NCCL cannot carry as it is: ddp broadcasts buffers from the first replica."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.register_buffer("counts", torch.zeros(3, dtype=torch.int16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _ddp_int16_buffer() -> list[int]:
    engine = phalanx.Engine(strategy="ddp")
    model = _Int16Buffer()
    model.counts += torch.tensor([1, 2, 30000], dtype=torch.int16) * (engine.rank + 1)
    model = engine.prepare(model)
    engine.backward(model(torch.ones(2, 4)).sum())
    return model.counts.tolist()


def test_ddp_broadcasts_int16_buffers_from_the_first_replica(run_ranks):
    assert run_ranks(_ddp_int16_buffer, 2) == [[1, 2, 30000]] * 2


class _Ids(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, (x * 100).to(torch.int16)


class _UseIds(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, ids = xs
        return self.fc(x) + ids.float().sum(dim=1, keepdim=True)


def _pipeline_int16_boundary() -> float:
    engine = phalanx.Engine(strategy="pipeline", pp_size=2, pp_partition="2", pp_microbatches=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Ids(), _UseIds())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    x = torch.arange(16.0).reshape(4, 4) / 16
    loss = engine.train_step((x, torch.zeros(4, 1)), lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    return float(loss)


def test_an_int16_tensor_crosses_a_pipeline_boundary(run_ranks):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Ids(), _UseIds())
    x = torch.arange(16.0).reshape(4, 4) / 16
    expected = torch.nn.functional.mse_loss(model(x), torch.zeros(4, 1)).item()
    losses = run_ranks(_pipeline_int16_boundary, 2)
    assert losses[0] == pytest.approx(expected, rel=1e-6) and losses[1] == pytest.approx(expected, rel=1e-6)


# --------------------------------------------------------------- S1: the log lets go of finished collectives
def _log_after_polled_steps() -> dict[str, int]:
    engine = phalanx.Engine(strategy="zero2", hang_timeout_s=60)
    real = LOG._group
    LOG._groups.clear()
    LOG._group = lambda group: (real(group)[0], True, real(group)[2])  # type: ignore[method-assign]  # polled, as NCCL's
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = engine.prepare(model, optimizer)
    for _ in range(2):
        engine.backward(model(torch.randn(4, 8)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    entries = list(LOG.recent)
    return {
        "open": len(LOG.open),
        "seen": len(entries),
        "holding a work or a tensor": sum(
            e.work is not None and not isinstance(e.work, int) for e in [*entries, *LOG.open.values()]
        ),
    }


def test_the_collective_log_holds_no_work_after_a_step(run_ranks):
    for counts in run_ranks(_log_after_polled_steps, 2):
        assert counts["seen"] > 4, counts  # the zero2 step's collectives were logged
        assert counts["open"] == 0 and counts["holding a work or a tensor"] == 0, counts


# ------------------------------------------------------------------ S4: tp clipping makes no float64 gradient copy
def _largest_float64_made_by_clipping(strategy: str) -> tuple[int, int, int]:
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests._tp_common import TinyLlama, TinyLlamaConfig

    class Float64Spy(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                    Float64Spy.largest = max(Float64Spy.largest, t.numel())
            return out

    engine = phalanx.Engine(strategy=strategy, tp_size=2)
    torch.manual_seed(0)
    model = TinyLlama(TinyLlamaConfig())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    engine.backward(model(ids).square().mean())
    with Float64Spy():
        engine.clip_grad_norm_(1e-3)
    params = list(model.parameters())  # under zero the gradients live in flat shards, as long as these together
    return Float64Spy.largest, len(params), max(p.numel() for p in params)


@pytest.mark.filterwarnings("ignore:strategy 'zero2' on one data-parallel rank")
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_clipping_under_tp_makes_no_float64_copy_of_the_gradients(run_ranks, strategy):
    for largest, n_params, biggest in run_ranks(_largest_float64_made_by_clipping, 2, strategy):
        # Per-tensor norms (one float64 each) are all it may make; a copy of a gradient would be `biggest` long.
        assert largest <= n_params < biggest, (largest, n_params, biggest)


# ------------------------------------------------- B7: debug_collectives' fingerprints where the group has no mirror
def _debug_collectives_on_an_extra_group() -> list[float]:
    engine = phalanx.Engine(debug_collectives=True, hang_timeout_s=60)
    extra = dist.new_group([0, 1])  # made by the script, as a kv sub-group or a Horovod process set: no gloo mirror
    t = torch.full((2,), float(engine.rank + 1), device=engine.device)
    watched(dist.all_reduce, t, group=extra)  # its fingerprint is exchanged over `extra` itself, from the device
    return t.tolist()


def test_debug_collectives_fingerprints_travel_on_the_device_where_no_gloo_mirror_exists(run_ranks):
    assert run_ranks(_debug_collectives_on_an_extra_group, 2) == [[3.0, 3.0]] * 2
