"""Splitting a list of blocks into contiguous pipeline stages, and building only this rank's stage.

- ``pp_partition: parameters`` balances parameter counts (the default), ``uniform`` block counts, ``time`` the
  measured forward+backward time of each block, and ``"3,6"`` gives the cut points (the first block of stage 1, 2).
- A model built on the meta device is given its values by ``materialise_stage``: every block in order, on the
  host, from the CPU generator, as ``strategies/deferred_init.py`` initialises one for ddp or zero3, so that the
  weights are those of the model built on the CPU from the same seed, whatever the split and the device. One block
  is on the host at a time; this rank keeps its stage's blocks, the others go back to meta.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Container
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from phalanx.runtime.placement import place_module
from phalanx.strategies.deferred_init import DeferredInit, has_meta
from phalanx.strategies.pipeline.p2p import flat_tensors

__all__ = [
    "partition_blocks",
    "block_costs",
    "time_blocks",
    "check_no_shared_parameters",
    "materialise_stage",
]


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


def check_no_shared_parameters(
    blocks: list[tuple[str, nn.Module]],
    stage_of_block: list[int],
    homes: dict[str, list[tuple[str, nn.Module]]] | None = None,
) -> None:
    """Refuse a parameter held by blocks of two stages: each stage would train its own copy, and the tie would
    silently break. ``homes`` names the parameters as the model does (see ``hf_plan.block_homes``)."""
    owner: dict[int, tuple[str, int]] = {}
    for (name, block), s in zip(blocks, stage_of_block):
        for path, module in (homes or {}).get(name, [(name, block)]):
            for pname, p in module.named_parameters(remove_duplicate=False):
                first = owner.setdefault(id(p), (f"{path}.{pname}", s))
                if first[1] != s:
                    raise ValueError(
                        f"parameter {first[0]} (stage {first[1]}) is also {path}.{pname} (stage {s}); pipeline "
                        "stages cannot share a parameter, e.g. an input embedding tied to the output head, whose "
                        "tie each stage's own copy would silently break. Untie it (a transformers model: build it "
                        "with tie_word_embeddings=False in its config), use pp_size=1, or keep both blocks in one "
                        "stage with explicit cut points (pp_partition='i,j,...')"
                    )


def materialise_stage(
    model: nn.Sequential, lo: int, hi: int, device: torch.device, held: Container[int] | None = None
) -> None:
    """Give blocks ``lo..hi-1`` of ``model`` (this rank's stage), or the blocks whose indices are in ``held`` (a
    rank's chunks under virtual stages), their values on ``device``; the other blocks end on the meta device, their
    parameter objects kept.

    A meta-built model is initialised by ``DeferredInit``, zero3's and ddp's path: each block in order, on the host
    from the CPU generator (never the device's: CUDA's draws other numbers from the same seed), including the blocks
    of other stages, so that this stage's blocks draw where they draw in a normal build and the generator ends where
    it ends (alike on every stage). Each other block goes back to meta as soon as it has drawn: the host holds one
    block at a time beyond the stage's own."""
    cpu = torch.device("cpu")
    init = DeferredInit(model) if has_meta(model) else None
    for i, block in enumerate(model.children()):
        if init is not None and has_meta(block):
            init.materialise_through(block, cpu)
        if (i in held) if held is not None else (lo <= i < hi):
            place_module(block, device, what=f"pipeline block {i}")
        else:
            _drop_to_meta(block)


def _drop_to_meta(block: nn.Module) -> None:
    """Every tensor of ``block`` on the meta device. The parameter objects are kept (their contents swapped): an
    optimizer built before prepare holds them, and with ``block.to("meta")`` it would keep their host values alive
    until the strategy drops them from it."""
    for module in block.modules():
        for name, p in module._parameters.items():
            if p is None or p.is_meta:
                continue
            empty = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            try:
                torch.utils.swap_tensors(p, empty)
            except RuntimeError:  # a weak reference to p forbids the swap: a new object, as block.to("meta") gives
                module._parameters[name] = empty
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta:
                module._buffers[name] = b.to("meta")


def _detach_requiring_grad(x: Any) -> Any:
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            d = t.detach()
            return d.requires_grad_(True) if d.is_floating_point() else d
        return t

    leaves, spec = tree_flatten(x)
    return tree_unflatten([one(t) for t in leaves], spec)
