"""Expert-parallel dispatch and combine (phalanx/strategies/expert_parallel/dispatch.py and plan.py) against the
model's own experts module in one process.

Every rank builds the same experts module (the demo's: transformers' Qwen3MoeExperts line for line; 8 experts,
fp32) and the same tokens and routing; rank r's tokens are its slice. The experts are cut over ep ranks by
``apply_ep_plan``'s cut, and each rank's output and the gradients of its tokens, its routing weights and its
experts' weights are compared with the whole module's within 1e-5 (the dense module's expert gradients are summed
over the ep group's tokens: each ep rank's local experts receive every rank's tokens). Cases: ep2 and ep4, top-1
and top-2, an expert no token picks, a rank with no tokens at all, two ep groups of 2 in a 4-rank world, the
capacity factor's drops counted; experts no token reaches (ddp, zero2, zero3, frozen or not, ranks seeded apart);
the plan's refusals.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.collective_log import LOG
from phalanx.strategies.expert_parallel import apply_ep_plan, dispatch_elements

TOL = 1e-5
E, H, INTER, T = 8, 16, 12, 10


def _init() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=os.environ["PHALANX_INIT_METHOD"], rank=rank, world_size=world)
    return rank


class _Holder(torch.nn.Module):
    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.experts = experts


def _experts() -> torch.nn.Module:
    # The demo's experts module: transformers' Qwen3MoeExperts line for line (tests/test_demo_moe.py checks they
    # agree), without importing transformers in every rank.
    from phalanx.demo import Experts

    torch.manual_seed(0)
    m = Experts(H, INTER, E)
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.3)
        m.down_proj.normal_(0, 0.3)
    return m


def _routing(world: int, k: int, empty_rank: int | None, unused_expert: int | None) -> tuple[Any, Any, Any, list[int]]:
    g = torch.Generator().manual_seed(1)
    counts = [0 if r == empty_rank else T + r for r in range(world)]
    n = sum(counts)
    x = torch.randn(n, H, generator=g)
    scores = torch.randn(n, E, generator=g)
    if unused_expert is not None:
        scores[:, unused_expert] = -1e9
    w, idx = torch.softmax(scores, -1).topk(k, -1)
    w = w / w.sum(-1, keepdim=True)
    return x, idx, w, counts


def _case(ep_groups: list[list[int]], k: int, empty_rank: int | None, unused: int | None, cf: float | None) -> dict:
    rank = _init()
    world = dist.get_world_size()
    x, idx, w, counts = _routing(world, k, empty_rank, unused)
    # The reference: the whole module on every rank's tokens.
    ref = _experts()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out_ref = ref(xr, idx, wr)
    dy = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(2))
    (out_ref * dy).sum().backward()
    lo, hi = sum(counts[:rank]), sum(counts[: rank + 1])
    # Under test: this rank's tokens, the experts cut over its ep group.
    members = next(g for g in ep_groups if rank in g)
    groups = [dist.new_group(g) for g in ep_groups]
    group = groups[ep_groups.index(members)]
    holder = _Holder(_experts())
    report = apply_ep_plan(
        holder, group, len(members), members.index(rank), plan={"experts": "ep_dispatch_experts"}, capacity_factor=cf
    )
    xl, wl = x[lo:hi].clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
    LOG.clear() if hasattr(LOG, "clear") else None
    out = holder.experts(xl, idx[lo:hi], wl)
    (out * dy[lo:hi]).sum().backward()
    local = E // len(members)
    mine = slice(members.index(rank) * local, (members.index(rank) + 1) * local)
    result: dict[str, Any] = {"stats": report.stats.read()}
    if cf is None:
        # Expert gradients: the module on this ep group's tokens only (the other group's tokens went elsewhere).
        group_ref = _experts()
        glo = [sum(counts[:r]) for r in members]
        ghi = [sum(counts[: r + 1]) for r in members]
        rows = torch.cat([torch.arange(a, b) for a, b in zip(glo, ghi)]) if members else torch.arange(0)
        o = group_ref(x[rows], idx[rows], w[rows])
        (o * dy[rows]).sum().backward()
        result.update(
            out=(out - out_ref[lo:hi]).abs().max().item() if hi > lo else 0.0,
            dx=(xl.grad - xr.grad[lo:hi]).abs().max().item() if hi > lo else 0.0,
            dw=(wl.grad - wr.grad[lo:hi]).abs().max().item() if hi > lo else 0.0,
            gate_up=(holder.experts.gate_up_proj.grad - group_ref.gate_up_proj.grad[mine]).abs().max().item(),
            down=(holder.experts.down_proj.grad - group_ref.down_proj.grad[mine]).abs().max().item(),
            shape=tuple(holder.experts.gate_up_proj.shape),
            num_experts=holder.experts.num_experts,
        )
    return result


def _cases(cases: list[tuple[Any, ...]]) -> list[dict]:
    return [_case(*c) for c in cases]  # one spawn for several cases: the ranks import transformers once


def _check(results: list[list[dict]], cases: list[tuple[Any, ...]]) -> None:
    for r, per_rank in enumerate(results):
        for (groups, *_), res in zip(cases, per_rank):
            for key in ("out", "dx", "dw", "gate_up", "down"):
                assert res[key] < TOL, (r, groups, key, res[key])
            ep = len(next(g for g in groups if r in g))
            assert res["shape"] == (E // ep, 2 * INTER, H) and res["num_experts"] == E // ep
            assert res["stats"]["dropped"] == 0


def test_dispatch_on_two_ranks_and_the_capacity_factor(run_ranks: Any) -> None:
    cases = [
        ([[0, 1]], 2, None, None, None),
        ([[0, 1]], 1, 1, 3, None),  # top-1, rank 1 has no tokens, expert 3 unused
    ]
    capped = ([[0, 1]], 1, None, None, 0.5)
    results = run_ranks(_cases, 2, [*cases, capped])
    _check([r[:2] for r in results], cases)
    # Capacity 0.5 of the even share: each expert keeps at most ceil(0.5 * n * k / E) pairs from a rank.
    for r, per_rank in enumerate(results):
        stats, n = per_rank[2]["stats"], T + r
        assert stats["routed"] + stats["dropped"] == n
        assert stats["dropped"] > 0 and stats["routed"] <= E * -(-n // (2 * E))


def test_dispatch_on_four_ranks_one_group_and_two(run_ranks: Any) -> None:
    cases = [
        ([[0, 1, 2, 3]], 2, None, 5, None),  # ep4, expert 5 unused
        ([[0, 1], [2, 3]], 2, 2, None, None),  # two ep groups of 2; rank 2 has no tokens
    ]
    _check(run_ranks(_cases, 4, cases), cases)


def test_traffic_formula() -> None:
    assert dispatch_elements(100, 2, 16, 4) == 100 * 2 * 16 * 3 / 4
    assert dispatch_elements(100, 2, 16, 1) == 0


# ------------------------------------------------------------------------------------------- bad input
def test_the_plan_refuses_what_it_cannot_split() -> None:
    from phalanx.config.options import ConfigError
    from phalanx.config.settings import EngineConfig
    from phalanx.strategies.expert_parallel import EPPlanError

    # A dense model has no ep plan: named, with the fix.
    with pytest.raises(EPPlanError, match=r"Linear has no expert-parallel plan.*ep_plan\(\).*ep_size=1"):
        apply_ep_plan(torch.nn.Linear(2, 2), None, 2, 0)
    # 8 experts do not divide over 3 ranks.
    with pytest.raises(EPPlanError, match=r"experts has 8 experts, which do not divide over ep_size=3"):
        apply_ep_plan(_Holder(_experts()), None, 3, 0, plan={"experts": "ep_dispatch_experts"})
    # A style that is not expert parallelism, and an entry that matches nothing.
    with pytest.raises(EPPlanError, match=r"style 'colwise' is not an expert-parallel style"):
        apply_ep_plan(_Holder(_experts()), None, 2, 0, plan={"experts": "colwise"})
    with pytest.raises(EPPlanError, match=r"'mlp\.experts' \(ep_dispatch_experts\) matches no module"):
        apply_ep_plan(_Holder(_experts()), None, 2, 0, plan={"mlp.experts": "ep_dispatch_experts"})
    # An experts module whose weights are not stacked by expert.
    holder = _Holder(torch.nn.Linear(4, 4))
    with pytest.raises(EPPlanError, match=r"no num_experts and no stacked expert weights"):
        apply_ep_plan(holder, None, 2, 0, plan={"experts": "ep_dispatch_experts"})
    # Nothing changed on a refusal.
    assert isinstance(holder.experts, torch.nn.Linear) and holder.experts.weight.shape == (4, 4)
    # The capacity factor without expert parallelism is a setting that would be ignored: refused.
    with pytest.raises(ConfigError, match=r"moe_capacity_factor=1.25 applies under expert parallelism only"):
        EngineConfig(moe_capacity_factor=1.25)


# ------------------------------------------------------------------------------------------- idle experts
class _OneExpert(torch.nn.Module):
    """Every token to expert 0: under ep2, ep rank 1's experts get no token at all."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from phalanx.demo import Experts

        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(H, H)
        self.experts = Experts(H, INTER, E)
        with torch.no_grad():
            self.experts.gate_up_proj.normal_(0, 0.3)
            self.experts.down_proj.normal_(0, 0.3)

    def ep_plan(self) -> dict[str, str]:
        return {"experts": "ep_dispatch_experts"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        ones = torch.ones(h.shape[0], 1)
        return self.experts(h, torch.zeros(h.shape[0], 1, dtype=torch.long), ones)


def _idle_experts(strategy: str, frozen: bool = False, save: str | None = None) -> dict[str, Any]:
    import phalanx

    eng = phalanx.Engine(strategy=strategy, ep_size=2, seed=0)
    model = _OneExpert(seed=eng.rank)  # seeded apart: every rank must start from the first rank's weights
    model.experts.requires_grad_(not frozen)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.1)
    model, opt = eng.prepare(model, opt)
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        eng.backward(model(x[eng.rank * 4 : (eng.rank + 1) * 4]).square().mean())
        opt.step()
        opt.zero_grad()
    if save is not None:
        eng.save_state(save)
    return {k: v.clone() for k, v in eng.get_state_dict(model).items()}


def _one_process(frozen: bool) -> dict[str, torch.Tensor]:
    model = _OneExpert()
    model.experts.requires_grad_(not frozen)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.1)
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _idle_runs(runs: list[tuple[str, bool, str]]) -> list[dict[str, Any]]:
    return [_idle_experts(*run) for run in runs]  # one spawn for every case


def test_experts_no_token_reaches_still_train_as_in_one_process(run_ranks: Any, tmp_path: Any) -> None:
    # One process: the stacked weights get a gradient (zeros on experts 1..7) and weight decay, as on every rank.
    # The ranks are seeded apart: each ep rank keeps its piece of the first rank's experts.
    from phalanx.checkpoint.read import Checkpoint

    runs = [(s, frozen, str(tmp_path / f"{s}-{frozen}")) for frozen in (False, True) for s in ("ddp", "zero2", "zero3")]
    results = run_ranks(_idle_runs, 2, runs)[0]
    for (strategy, frozen, save), state in zip(runs, results):
        ref = _one_process(frozen)
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v, rtol=0, atol=TOL, msg=f"{strategy} frozen={frozen} {k}")
        # Frozen experts too are saved whole, each ep rank's run once.
        reader = Checkpoint(save).reader(0)
        for k in ("experts.gate_up_proj", "experts.down_proj"):
            whole = reader.read(f"model/{k}", 0, ref[k].numel()).view(ref[k].shape)
            torch.testing.assert_close(whole, ref[k], rtol=0, atol=TOL, msg=f"saved {strategy} {frozen} {k}")


def test_fp16_overflow_is_agreed_over_every_rank_under_ep() -> None:
    # The ep ranks hold different experts' gradients: an overflow in any of them must skip the step everywhere.
    from types import SimpleNamespace

    from phalanx.engine.precision import agree_found_inf

    precision = SimpleNamespace(sync_found_inf=False, found_inf_group="unset")
    strategy = SimpleNamespace(grad_shard_group=lambda: None, shards_gradients=False)
    agree_found_inf(precision, strategy, SimpleNamespace(tp_size=1, ep_size=2))  # type: ignore[arg-type]
    assert precision.sync_found_inf is True and precision.found_inf_group is None  # None: the whole world
    precision = SimpleNamespace(sync_found_inf=False, found_inf_group="unset")
    agree_found_inf(precision, strategy, SimpleNamespace(tp_size=1, ep_size=1))  # type: ignore[arg-type]
    assert precision.sync_found_inf is False  # ddp without ep: every rank holds the same reduced gradients
