"""zero3 under autocast keeps no cast of the gathered weights between forward and backward (issue 36, S2).

Autocast casts each weight a matmul uses to bf16 and caches the cast until the forward ends, and the matmul saves it
for backward: a bf16 copy of every gathered weight, alive after zero3 freed the units, 2 bytes a parameter on every
rank whatever the shard count. zero3 has autograd save a marker instead and casts the regathered weight again in
backward. The casts are watched with weak references from a dispatch mode: a weak reference lives as long as the
tensor does, wherever autograd or autocast holds it."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import phalanx

WIDTH, LAYERS = 48, 6


class _CastSpy(TorchDispatchMode):
    """Weak references to every bf16 copy the forward makes of a tensor shaped like a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16 and out.shape == (WIDTH, WIDTH):
            self.casts.append(weakref.ref(out))
        return out


def _steps(keep_casts: bool) -> dict[str, Any]:
    engine = phalanx.Engine(strategy="zero3", precision="bf16-mixed")
    strategy = engine.strategy
    if keep_casts:  # what zero3 did before: autograd and autocast keep the casts
        from phalanx.strategies.zero import zero3

        strategy._saved_by_reference = contextlib.nullcontext  # type: ignore[attr-defined]
        zero3._drop_autocast_casts = lambda device_type: None  # type: ignore[attr-defined]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = engine.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1 + engine.rank)
    losses, alive = [], []
    for _ in range(3):
        x = torch.randn(8, WIDTH, generator=g)
        spy = _CastSpy()
        with spy:
            loss = model(x).square().mean()
        gc.collect()
        alive.append(sum(r() is not None for r in spy.casts))  # between forward and backward
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"alive": alive, "losses": losses, "params": engine.get_state_dict(model)}


def test_zero3_under_autocast_keeps_no_weight_cast_until_backward_and_trains_the_same(run_ranks):
    now = run_ranks(_steps, 2, False)
    before = run_ranks(_steps, 2, True)
    for rank in range(2):
        # Every layer's cast but the first's (its input needs no gradient, so its weight is not saved), as before.
        assert before[rank]["alive"] == [LAYERS - 1] * 3, before[rank]["alive"]
        assert now[rank]["alive"] == [0] * 3, now[rank]["alive"]
        # The weight cast again in backward is the same cast: the training is bit for bit what it was.
        assert now[rank]["losses"] == before[rank]["losses"]
        assert all(torch.equal(v, before[rank]["params"][k]) for k, v in now[rank]["params"].items())


def _under_callers_hooks(use_hooks: bool) -> tuple[int, int, float, dict[str, torch.Tensor]]:
    """The caller's own saved-tensor hooks (activation offloading, say) still see every other saved tensor."""
    engine = phalanx.Engine(strategy="zero3", precision="bf16-mixed")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    counts = {"pack": 0, "unpack": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        counts["pack"] += 1
        return t.clone()  # a copy, as save_on_cpu makes: what comes back must be used

    def unpack(t: torch.Tensor) -> torch.Tensor:
        counts["unpack"] += 1
        return t

    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(3 + engine.rank))
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack) if use_hooks else contextlib.nullcontext():
        loss = model(x).sum()  # a sum saves nothing: every tensor the hooks see was saved inside the model
    engine.backward(loss)
    optimizer.step()
    return counts["pack"], counts["unpack"], loss.item(), engine.get_state_dict(model)


def test_the_callers_saved_tensor_hooks_still_see_the_other_tensors(run_ranks):
    plain = run_ranks(_under_callers_hooks, 2, False)
    hooked = run_ranks(_under_callers_hooks, 2, True)
    for (_, _, loss, params), (packs, unpacks, hooked_loss, hooked_params) in zip(plain, hooked):
        # Inside the model: each Tanh's output and each Linear's input but the first's (its weight cast is ours).
        assert packs >= 2 * LAYERS - 1 and unpacks == packs, (packs, unpacks)
        assert hooked_loss == loss
        assert all(torch.equal(v, params[k]) for k, v in hooked_params.items())
