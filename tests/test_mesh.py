"""The device mesh: hybrid sharding (dp_replicate x dp_shard) and, later in this file, tensor parallelism composed
with the data-parallel strategies and the pipeline, each against single-process training from the same init.

Tolerance: losses and parameters within rtol = atol = 1e-5 in fp32 (as the ddp and zero tests).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _common import TiedNet, global_order, grouped_optimizer, make_tokens, tied_reference_run
from torch.utils.data import DataLoader, TensorDataset

import phalanx

STEPS, GLOBAL_BATCH = 8, 12
TOL = dict(rtol=1e-5, atol=1e-5)


def _hybrid(strategy: str, opt: str, max_norm: float | None) -> dict:
    engine = phalanx.Engine(strategy=strategy, seed=0, dp_replicate_size=2)
    torch.manual_seed(100 + engine.rank)  # ranks differ on purpose: prepare must start them all from rank 0
    model = TiedNet()
    optimizer = grouped_optimizer(opt, model)
    x, y = make_tokens(STEPS * GLOBAL_BATCH)
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // engine.world_size, shuffle=True)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    losses, norms = [], []
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        engine.backward(loss)
        if max_norm is not None:
            norms.append(float(engine.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(engine.reduce(loss, "mean").item())
    topo = engine.topology
    return {
        "losses": losses,
        "norms": norms,
        "state": engine.get_state_dict(model),
        "coords": (topo.dp_replicate_rank, topo.dp_shard_rank),
        "group": engine.strategy.world,
    }


def _clipped_reference(opt: str, max_norm: float) -> tuple[list[float], list[float], dict]:
    torch.manual_seed(100)
    model = TiedNet()
    optimizer = grouped_optimizer(opt, model)
    x, y = make_tokens(STEPS * GLOBAL_BATCH)
    order = global_order(len(x), 0, 0)
    losses, norms = [], []
    for step in range(STEPS):
        idx = order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_hybrid_sharding_2x2_matches_single_process(run_ranks, strategy):
    results = run_ranks(_hybrid, 4, strategy, "adamw", None)
    ref_losses, ref_state = tied_reference_run(STEPS, GLOBAL_BATCH, "adamw")
    ref_losses = ref_losses[:STEPS]
    assert [r["coords"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["group"] == 2 for r in results)  # each rank shards over 2, not 4
    for rank, res in enumerate(results):
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), **TOL, msg=f"rank {rank}")
        for k in ref_state:
            torch.testing.assert_close(res["state"][k], ref_state[k], **TOL, msg=f"{k}, rank {rank}")


def test_hybrid_sharding_clips_by_the_global_norm(run_ranks):
    max_norm = 0.05
    results = run_ranks(_hybrid, 4, "zero3", "sgd", max_norm)
    ref_losses, ref_norms, ref_state = _clipped_reference("sgd", max_norm)
    assert min(ref_norms) > max_norm  # clipping is active at every step
    for rank, res in enumerate(results):
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref_norms), **TOL, msg=f"rank {rank}")
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), **TOL, msg=f"rank {rank}")
        for k in ref_state:
            torch.testing.assert_close(res["state"][k], ref_state[k], **TOL, msg=f"{k}, rank {rank}")
