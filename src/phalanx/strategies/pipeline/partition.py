"""Splitting a list of blocks into contiguous pipeline stages, and building only this rank's stage.

- ``pp_partition: parameters`` balances parameter counts (the default), ``uniform`` block counts, ``time`` the
  measured forward+backward time of each block, and ``"3,6"`` gives the cut points (the first block of stage 1, 2).
- A block built on the meta device is materialised on this rank only if its stage is this rank's, and its
  weights are seeded by block index, so they do not depend on the split.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from phalanx.strategies.pipeline.p2p import flat_tensors

__all__ = ["partition_blocks", "block_costs", "time_blocks", "check_no_shared_parameters", "materialise"]


def partition_blocks(costs: list[float], stages: int) -> list[int]:
    """Contiguous split of blocks into ``stages`` that minimises the largest stage cost; returns each stage's first
    block.

    Ties go to the split whose largest stage has the fewest blocks, so that blocks without parameters
    (activations) spread out instead of piling up in one stage.
    """
    n = len(costs)
    assert 1 <= stages <= n
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (math.inf, math.inf)
    # best[k][i]: the best (max cost, max blocks) for blocks [0, i) in k stages; cut[k][i]: where stage k-1 starts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0)
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                cand = max(best[k - 1][j], (prefix[i] - prefix[j], i - j))
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def block_costs(kind: str, blocks: list[nn.Module]) -> list[float]:
    """``uniform``: one per block; otherwise each block's parameter count."""
    if kind == "uniform":
        return [1.0] * len(blocks)
    return [float(sum(p.numel() for p in b.parameters())) for b in blocks]


def time_blocks(blocks: list[nn.Module], batch: Any, loss_fn: Callable[..., Any], device: torch.device) -> torch.Tensor:
    """Seconds of forward+backward of each block on ``batch`` (one micro-batch), after one warm-up round.

    The input of the first block is what ``loss_fn(model, batch)`` hands to the model: ``loss_fn`` runs until it
    calls the model, and stops there. Gradients are cleared afterwards.
    """
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class _Capture(BaseException):
        pass

    class _Probe(nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            captured.append((args, kwargs))
            raise _Capture

    try:
        loss_fn(_Probe(), batch)
    except _Capture:
        pass
    if not captured:
        raise RuntimeError("pp_partition='time': loss_fn(model, batch) did not call the model")
    args, kwargs = captured[0]
    times = torch.zeros(len(blocks), dtype=torch.float64)
    for _ in range(2):  # the first round warms up allocators and kernels
        x: Any = None
        for i, block in enumerate(blocks):
            inp = _detach_requiring_grad(x) if i else None
            t0 = time.perf_counter()
            y = block(*args, **kwargs) if i == 0 else block(inp)
            floats = [t for t in flat_tensors(y) if t.requires_grad]
            if floats:
                torch.autograd.backward(floats, grad_tensors=[torch.ones_like(t) for t in floats])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[i] = time.perf_counter() - t0
            x = y
    for block in blocks:
        for p in block.parameters():
            p.grad = None
    return times


def check_no_shared_parameters(blocks: list[tuple[str, nn.Module]], stage_of_block: list[int]) -> None:
    owner: dict[int, tuple[str, int]] = {}
    for (name, block), s in zip(blocks, stage_of_block):
        for pname, p in block.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), (f"{name}.{pname}", s))
            if first[1] != s:
                raise ValueError(
                    f"parameter {first[0]} (stage {first[1]}) is also {name}.{pname} (stage {s}); pipeline stages "
                    "cannot share a parameter, e.g. an embedding tied to the output head. Untie it, or keep both "
                    "blocks in one stage with explicit cut points (pp_partition='i,j,...')"
                )


def materialise(block: nn.Module, device: torch.device, seed: int, index: int) -> None:
    """Move a block to the device; a block built on the meta device is allocated and initialised there."""
    if not any(t.is_meta for t in [*block.parameters(), *block.buffers()]):
        block.to(device)
        return
    block.to_empty(device=device)
    # Seeded by block index, so that the weights do not depend on which stage (or how many) holds the block.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed * 1_000_003 + index)
        for module in block.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


def _detach_requiring_grad(x: Any) -> Any:
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            d = t.detach()
            return d.requires_grad_(True) if d.is_floating_point() else d
        return t

    leaves, spec = tree_flatten(x)
    return tree_unflatten([one(t) for t in leaves], spec)
