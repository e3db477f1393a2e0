"""DeepSpeed-Ulysses (phalanx/strategies/context_parallel/ulysses.py) against one process on the whole sequence.

Every rank builds the same whole-sequence q, k, v (and a fixed random weighting ``w`` of the output, whose weighted
sum is the loss), runs causal SDPA on it (kv heads repeated for grouped-query: an independent check of which kv
head each query head reads), and compares with Ulysses on its own contiguous slice: the output and the gradients of
q, k and v within 1e-5 in fp32. Cases: sp2 and sp4 over the default group, h == h_kv and grouped-query with
h_kv >= P and h_kv < P (kv heads replicated), a key padding mask over the whole sequence, two subgroups of a 4-rank
world each running its own, bf16, the collective log's traffic against ``ulysses_traffic_elements``, and the errors.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.runtime.collective_log import LOG
from phalanx.strategies.context_parallel.layout import positions
from phalanx.strategies.context_parallel.ulysses import (
    heads_to_seq,
    seq_to_heads,
    ulysses_attention,
    ulysses_traffic_elements,
)

B, S, D = 2, 8, 4
TOL = 1e-5
# bf16 against the fp32 reference: bf16 keeps 8 significant bits (a relative rounding of 2**-9 ~ 2e-3). The inputs
# are rounded once, SDPA's products and softmax run in bf16 with fp32 accumulation, and the output and each gradient
# are rounded again: a few roundings of values of order 1, each up to ~4e-3 at magnitude 1-2. 3e-2 allows about
# eight of them, and still catches a misplaced head or position (those are off by order 1). Ulysses must also stay
# within twice the error of one bf16 process on the whole sequence (the all-to-alls move bits, they add none).
BF16_TOL = 3e-2

# (h, h_kv) per sp size: h == h_kv, grouped-query with h_kv >= P, and (sp4) h_kv < P, replicated.
CASES = {2: [(4, 4), (4, 2), (6, 2)], 4: [(4, 4), (8, 4), (4, 2), (4, 1), (8, 2)]}


# ------------------------------------------------------------------------------------------- helpers
def _init() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=os.environ["PHALANX_INIT_METHOD"], rank=rank, world_size=world)
    return rank


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _masked_attend(keep: torch.Tensor) -> Any:
    """Causal attention that also hides the keys ``keep`` marks False (the caller holds the whole sequence's mask)."""
    s = keep.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool).tril() & keep[:, None, None, :]  # [b, 1, s, s]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """One process, the whole sequence: kv heads repeated (query head i reads kv head i // (h/h_kv)), causal."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    allowed = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril() & keep[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _case(h: int, h_kv: int, group: Any, seed: int, masked: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """Ulysses on this rank's slice against the one-process reference: the largest gap of out, dq, dk, dv."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, S, D, generator=g, requires_grad=True)
    k = torch.randn(B, h_kv, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, h_kv, S, D, generator=g, requires_grad=True)
    w = torch.randn(B, h, S, D, generator=g)
    keep = torch.rand(B, S, generator=g) > 0.3 if masked else None
    if keep is not None:
        keep[:, 0] = True  # every causal row keeps a key
    ref = _reference(q, k, v, keep)
    (ref * w).sum().backward()

    mine = positions("ulysses", size, rank, S)
    ql, kl, vl = (t.detach()[:, :, mine].to(dtype).requires_grad_() for t in (q, k, v))
    attend = _causal if keep is None else _masked_attend(keep)
    out = ulysses_attention(ql, kl, vl, attend, group=group)
    assert out.shape == (B, h, S // size, D) and out.dtype == dtype
    (out.float() * w[:, :, mine]).sum().backward()
    gaps = {
        "out": _gap(out, ref[:, :, mine]),
        "dq": _gap(_grad(ql), _grad(q)[:, :, mine]),
        "dk": _gap(_grad(kl), _grad(k)[:, :, mine]),
        "dv": _gap(_grad(vl), _grad(v)[:, :, mine]),
    }
    if dtype != torch.float32:  # the same precision in one process: what Ulysses may not be much worse than
        q1, k1, v1 = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        one = _reference(q1, k1, v1, keep)
        (one.float() * w).sum().backward()
        gaps["one_process"] = max(
            _gap(one, ref),
            *(_gap(_grad(t), _grad(r)) for t, r in ((q1, q), (k1, k), (v1, v))),
        )
    return gaps


def _round_trip(group: Any, seed: int) -> dict:
    """seq_to_heads and heads_to_seq against the whole tensor, bit for bit, and their gradients."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    h = 2 * size
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, h, S, D, generator=g)
    w_heads = torch.randn(B, h, S, D, generator=g)  # weights of seq_to_heads' result, whole
    w_seq = torch.randn(B, h, S, D, generator=g)  # weights of heads_to_seq's result, whole
    mine, heads = positions("ulysses", size, rank, S), slice(rank * h // size, (rank + 1) * h // size)
    ok = {}

    xl = x[:, :, mine].clone().requires_grad_()
    y = seq_to_heads(xl, group=group)
    ok["seq_to_heads"] = torch.equal(y, x[:, heads])
    ok["identity"] = torch.equal(heads_to_seq(y, group=group), xl)
    (y * w_heads[:, heads]).sum().backward()  # d/dx_l of the whole sum: w_heads at this rank's positions
    ok["seq_to_heads grad"] = torch.equal(_grad(xl), w_heads[:, :, mine])

    yl = x[:, heads].clone().requires_grad_()
    z = heads_to_seq(yl, group=group)
    ok["heads_to_seq"] = torch.equal(z, x[:, :, mine])
    ok["identity back"] = torch.equal(seq_to_heads(z, group=group), yl)
    (z * w_seq[:, :, mine]).sum().backward()
    ok["heads_to_seq grad"] = torch.equal(_grad(yl), w_seq[:, heads])

    # The backward of each is the other's all-to-all: a gradient through the round trip is the gradient itself.
    xr = x[:, :, mine].clone().requires_grad_()
    heads_to_seq(seq_to_heads(xr, group=group), group=group).backward(w_seq[:, :, mine])
    ok["round trip grad"] = torch.equal(_grad(xr), w_seq[:, :, mine])
    return ok


def _traffic(h: int, h_kv: int, group: Any) -> dict:
    """The collective log's all-to-alls of one forward and backward, and the formula's."""
    size = dist.get_world_size(group)
    LOG.on = True
    LOG.recent.clear()
    try:
        _case(h, h_kv, group, seed=3)
    finally:
        LOG.on = False
    entries = [e for e in LOG.recent if e.label and e.label.startswith("ulysses")]
    sent = {"forward": 0, "backward": 0}
    for e in entries:  # each all-to-all keeps 1/size of its payload and sends the rest
        sent["backward" if str(e.label).endswith("backward") else "forward"] += e.numel * (size - 1) // size
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    logged: dict[str, Any] = {
        "ops": sorted({e.op for e in entries}),
        "groups": sorted({e.group for e in entries}),
        "calls": {e.label: e.numel for e in entries},
        "n": len(entries),
        **sent,
    }
    return {"logged": logged, "want": ulysses_traffic_elements(B, h, h_kv, S // size, D, size), "ranks": ranks}


def _errors(group: Any) -> dict:
    """The messages of the refused head counts (h not a multiple of P; h_kv neither a multiple nor a divisor)."""
    size = dist.get_world_size(group)
    s_local = S // size
    tries = {
        "h": (size + 1, size + 1),
        "h_kv": (6, 3) if size == 2 else (12, 6),  # h_kv >= P, not a multiple of P
        "h_kv small": (3 * size, 3) if size == 4 else None,  # h_kv < P, P not a multiple of it
    }
    out: dict[str, tuple[int, int, str | None]] = {}
    for name, shape in tries.items():
        if shape is None:
            continue
        h, h_kv = shape
        q = torch.randn(B, h, s_local, D)
        kv = torch.randn(B, h_kv, s_local, D)
        try:
            ulysses_attention(q, kv, kv, _causal, group=group)
        except ValueError as e:
            out[name] = (h, h_kv, str(e))
        else:
            out[name] = (h, h_kv, None)
    return out


# ------------------------------------------------------------------------------------------- rank functions
def _sp(bf16: bool) -> dict:
    rank = _init()
    size = dist.get_world_size()
    res: dict[str, Any] = {"rank": rank}
    for h, h_kv in CASES[size]:
        res[f"h={h} h_kv={h_kv}"] = _case(h, h_kv, None, seed=10 + h + h_kv)
    h, h_kv = CASES[size][-1]
    res[f"masked h={h} h_kv={h_kv}"] = _case(h, h_kv, None, seed=20, masked=True)
    res["round trip"] = _round_trip(None, seed=30)
    res["traffic"] = [_traffic(h, h_kv, None) for h, h_kv in CASES[size][-2:]]
    res["errors"] = _errors(None)
    if bf16:
        res["bf16"] = _case(4, 2, None, seed=40, dtype=torch.bfloat16)
    return res


def _subgroups() -> dict:
    rank = _init()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, in the same order
    mine = groups[rank // 2]
    seed = 50 + rank // 2  # each pair its own data: a block crossing pairs would not match
    return {
        "h=4 h_kv=2": _case(4, 2, mine, seed=seed),
        "masked h=4 h_kv=1": _case(4, 1, mine, seed=seed + 2, masked=True),
        "round trip": _round_trip(mine, seed=seed),
        "traffic": [_traffic(4, 1, mine)],
    }


# ------------------------------------------------------------------------------------------- checks
def _assert_close(results: list[dict], skip: tuple[str, ...] = ("rank", "round trip", "traffic", "errors", "bf16")):
    bad = []
    for rank, res in enumerate(results):
        for name, gaps in res.items():
            if name in skip:
                continue
            bad += [f"rank {rank} {name} {k}: {v:.2e}" for k, v in gaps.items() if not v <= TOL]
    assert not bad, "Ulysses differs from the one-process reference: " + "; ".join(bad)


def _assert_round_trip(results: list[dict]) -> None:
    bad = [f"rank {r} {k}" for r, res in enumerate(results) for k, ok in res["round trip"].items() if not ok]
    assert not bad, "not bit for bit: " + ", ".join(bad)


def _assert_traffic(results: list[dict]) -> None:
    for res in results:
        for t in res["traffic"]:
            logged, want = t["logged"], t["want"]
            assert logged["ops"] == ["all_to_all"]
            assert logged["groups"] == [t["ranks"]]
            assert logged["n"] == 8  # q, k, v, out; and their four reverses
            assert logged["calls"] == want["calls"]
            assert (logged["forward"], logged["backward"]) == (want["forward"], want["backward"]) != (0, 0)


@pytest.mark.parametrize("size", [2, 4])
def test_ulysses_matches_one_process(run_ranks, size):
    results = run_ranks(_sp, size, size == 2)
    _assert_close(results)
    _assert_round_trip(results)
    _assert_traffic(results)
    for res in results:
        for name, (h, h_kv, message) in res["errors"].items():
            assert message is not None, f"{name}: h={h}, h_kv={h_kv} over {size} ranks was not refused"
            assert f"P={size}" in message and "sp size" in message
            assert (f"h={h}" if name == "h" else f"h_kv={h_kv}") in message
    if size == 2:
        for res in results:
            gaps = res["bf16"]
            one = gaps.pop("one_process")
            assert one > 0  # bf16 did round
            assert all(g <= BF16_TOL and g <= 2 * one + 1e-3 for g in gaps.values()), (gaps, one)


def test_ulysses_on_two_subgroups(run_ranks):
    results = run_ranks(_subgroups, 4)
    _assert_close(results)
    _assert_round_trip(results)
    _assert_traffic(results)
    assert [res["traffic"][0]["ranks"] for res in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]


# ------------------------------------------------------------------------------------------- one process
def test_traffic_formula():
    # sp4, h=8, h_kv=2: kv replicated to 4 heads. Per tensor (P-1)/P of it: q and out 2*8*2*4 = 128 -> 96 each,
    # k and v 2*4*2*4 = 64 -> 48 each.
    t = ulysses_traffic_elements(2, 8, 2, 2, 4, 4)
    assert (t["forward"], t["backward"], t["total"]) == (288, 288, 576)
    assert t["calls"]["ulysses k"] == t["calls"]["ulysses v backward"] == 64
    assert ulysses_traffic_elements(2, 8, 8, 2, 4, 1)["total"] == 0
    # h_kv >= P: no replication, k and v at their own size.
    assert ulysses_traffic_elements(1, 8, 4, 3, 2, 2)["forward"] == (48 + 24 + 24 + 48) // 2


@pytest.mark.parametrize(
    ("h", "h_kv", "size", "names"),
    [
        (6, 6, 4, ["h=6", "P=4"]),
        (6, 3, 2, ["h_kv=3", "P=2"]),
        (12, 3, 4, ["h_kv=3", "P=4"]),
        (6, 4, 2, ["h=6", "h_kv=4"]),
    ],
)
def test_refused_heads(h, h_kv, size, names):
    with pytest.raises(ValueError) as e:
        ulysses_traffic_elements(1, h, h_kv, 4, 8, size)
    assert all(n in str(e.value) for n in names), str(e.value)


def test_one_process_calls_attend_as_is():
    q, k, v = torch.randn(1, 4, 8, 2), torch.randn(1, 2, 8, 2), torch.randn(1, 2, 8, 2)
    assert seq_to_heads(q) is q and heads_to_seq(q) is q
    assert torch.equal(ulysses_attention(q, k, v, _causal), _causal(q, k, v))
