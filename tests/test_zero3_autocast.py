"""zero3 under autocast keeps no cast of the gathered weights between forward and backward (issue 36, S2).

Autocast casts each weight a matmul uses to bf16 and caches the cast until the forward ends, and the matmul saves it
for backward: a bf16 copy of every gathered weight, alive after zero3 freed the units, 2 bytes a parameter on every
rank whatever the shard count. zero3 has autograd save a marker instead and casts the regathered weight again in
backward. The casts are watched with weak references from a dispatch mode: a weak reference lives as long as the
tensor does, wherever autograd or autocast holds it."""

from __future__ import annotations

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
        import contextlib

        from phalanx.strategies.zero import zero3

        strategy._casts_not_saved = contextlib.nullcontext  # type: ignore[attr-defined]
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
