"""zero1/zero2/zero3 against a single-process reference, and against torch's ZeroRedundancyOptimizer and FSDP2.

Tolerance: losses and parameters within rtol = atol = 1e-5 in fp32 after 20 steps (the same as ddp's).
The model (TiedNet) has sizes that do not divide by 2, 3 or 4, an embedding tied to the output head,
a frozen layer, and two param groups with their own lr, weight decay and momentum.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from _common import TiedNet, grouped_optimizer, make_tokens, tied_reference_run

STEPS, GLOBAL_BATCH = 20, 12
TOL = dict(rtol=1e-5, atol=1e-5)
STAGES = ("zero1", "zero2", "zero3")


def _train(strategy: str, opt: str, steps: int = STEPS, global_batch: int = GLOBAL_BATCH, **options) -> dict:
    engine = phalanx.Engine(strategy=strategy, seed=0, **options)
    torch.manual_seed(100 + engine.rank)  # ranks differ on purpose: prepare must start them all from rank 0
    model = TiedNet()
    optimizer = grouped_optimizer(opt, model)
    x, y = make_tokens(steps * global_batch)
    loader = DataLoader(TensorDataset(x, y), batch_size=global_batch // engine.world_size, shuffle=True)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    engine.strategy.stats.reset()
    losses = []
    for xb, yb in loader:
        loss = engine.train_step((xb, yb), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        losses.append(engine.reduce(loss, "mean").item())
    return {
        "losses": losses,
        "state": engine.get_state_dict(model),
        "desc": engine.strategy.describe(),
        "memory": engine.memory_report(),
    }


def _all_stages(opts: tuple[str, ...], collectives: str) -> dict:
    return {(s, o): _train(s, o, zero_collectives=collectives) for s in STAGES for o in opts}


# "auto" is the all-reduce emulation on gloo; "native" uses reduce-scatter and all-gather.
@pytest.mark.parametrize("world_size,collectives", [(2, "auto"), (2, "native"), (3, "auto"), (3, "native"), (4, "auto")])
def test_zero_stages_match_single_process(run_ranks, world_size, collectives):
    opts = ("sgd", "adamw")
    refs = {o: tied_reference_run(STEPS, GLOBAL_BATCH, o) for o in opts}
    results = run_ranks(_all_stages, world_size, opts, collectives)
    for rank, per_rank in enumerate(results):
        for (stage, opt), res in per_rank.items():
            ref_losses, ref_state = refs[opt]
            where = f"{stage}/{opt}, rank {rank} of {world_size}"
            torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), **TOL, msg=f"losses, {where}")
            assert set(res["state"]) == set(ref_state)
            for k in ref_state:
                torch.testing.assert_close(res["state"][k], ref_state[k], **TOL, msg=f"{k}, {where}")
            # The frozen layer is rank 0's initial one, untouched.
            assert torch.equal(res["state"]["frozen.weight"], ref_state["frozen.weight"])
