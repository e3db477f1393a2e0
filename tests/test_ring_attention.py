"""Ring attention (phalanx/strategies/context_parallel/ring.py) against attention in one process on the whole sequence.

Every rank builds the same whole-sequence q, k, v (and padding mask) from a seed, runs torch's
``scaled_dot_product_attention`` on all of it (kv heads repeated, a causal mask combined with the key padding), and
keeps its own zig-zag positions (``layout.positions('ring', ...)``); then it runs ``ring_attention`` on those positions
alone and compares the output and the gradients of q, k and v of ``(out * w).sum()`` for a fixed random ``w``. The
ranks return their largest differences and the test process asserts on them: cp2 and cp4, h == h_kv and
grouped-query, right and left padding, two subgroup rings side by side, float32 and bf16, and the elements sent as the
collective log records them against ``ring_traffic_elements``. Size 1 and the input checks run in this process.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.runtime.collective_log import LOG
from phalanx.strategies.context_parallel import layout
from phalanx.strategies.context_parallel.ring import ring_attention, ring_traffic_elements

B, H, S, D = 2, 4, 16, 8  # S = 16: two chunks of 4 tokens per rank on cp2, of 2 on cp4
TIGHT = 1e-10  # float64 in, float64 out: only summation order differs from the reference
FP32 = 1e-5  # float32: the brief's bound; the differences measured are ~1e-6
# bf16: q, k and v are rounded to bf16 and the fp32 reference runs on those same rounded values, so what differs is
# that ring attention rounds its output to bf16 (unit roundoff u = 2**-8), its backward sees that rounded O in
# D = rowsum(dO * O) and dO rounded to bf16 (u each), and the gradients are rounded to bf16 once more: a few u of the
# tensor's magnitude. bf16 differences are therefore measured relative to the reference's largest |value| and held to
# 4u = 2**-6 (measured: 1-1.5u); a wrong block (a missed chunk, a wrong causal mask) is off by 10% or more.
BF16 = 2.0**-6


# ------------------------------------------------------------------------------------------------ helpers
def _init() -> tuple[int, int]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=os.environ["PHALANX_INIT_METHOD"], rank=rank, world_size=world)
    return rank, world


def _inputs(h_kv: int, seed: int, padding: bool, h: int = H) -> dict[str, Any]:
    """The whole sequence: q, k, v, the output weighting w, and (``padding``) a key padding mask with a right-padded
    row 0 (its last 5 tokens) and a left-padded row 1 (its first 3: those queries attend nothing)."""
    g = torch.Generator().manual_seed(seed)
    mask = None
    if padding:
        mask = torch.ones(B, S, dtype=torch.bool)
        mask[0, S - 5 :] = False
        mask[1, :3] = False
    return {
        "q": torch.randn(B, h, S, D, generator=g, dtype=torch.float64),
        "k": torch.randn(B, h_kv, S, D, generator=g, dtype=torch.float64),
        "v": torch.randn(B, h_kv, S, D, generator=g, dtype=torch.float64),
        "w": torch.randn(B, h, S, D, generator=g, dtype=torch.float64),
        "mask": mask,
    }


def _reference(x: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Output and gradients of whole-sequence attention in one process, in ``dtype``."""
    q, k, v = (x[n].to(dtype, copy=True).requires_grad_() for n in ("q", "k", "v"))
    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if x["mask"] is None:
        out = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    else:
        allowed = torch.ones(S, S, dtype=torch.bool).tril() & x["mask"][:, None, None, :]
        out = F.scaled_dot_product_attention(q, kr, vr, attn_mask=allowed)
    (out * x["w"].to(dtype)).sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _ring(x: dict[str, Any], dtype: torch.dtype, pos: torch.Tensor, group: Any) -> dict[str, torch.Tensor]:
    """The same on this rank's positions through ring attention."""
    q, k, v = (x[n][:, :, pos].to(dtype, copy=True).requires_grad_() for n in ("q", "k", "v"))
    mask = x["mask"][:, pos] if x["mask"] is not None else None
    out = ring_attention(q, k, v, group=group, key_padding_mask=mask)
    assert out.dtype == dtype and out.shape == q.shape
    w = x["w"][:, :, pos]
    loss = (out.float() * w.float()).sum() if dtype == torch.bfloat16 else (out * w.to(dtype)).sum()
    loss.backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _errors(x: dict[str, Any], dtype: torch.dtype, group: Any, size: int, rank: int) -> dict[str, float]:
    """Largest |ring - reference| of the output and each gradient on this rank's positions (plus checks that
    fully masked queries give exactly 0 and nothing is NaN)."""
    pos = layout.positions("ring", size, rank, S)
    ref = _reference(x, torch.float32 if dtype == torch.bfloat16 else dtype)
    got = _ring(x, dtype, pos, group)
    errors = {}
    for name in ("out", "dq", "dk", "dv"):
        assert not got[name].isnan().any(), name
        want = ref[name][:, :, pos].double()
        scale = want.abs().max().item() if dtype == torch.bfloat16 else 1.0  # bf16: relative to the magnitude
        errors[name] = (got[name].double() - want).abs().max().item() / scale
    if x["mask"] is not None:  # row 1's first 3 queries attend nothing: output and gradient exactly 0
        dead = pos < 3
        errors["dead rows"] = got["out"][1, :, dead].abs().sum().item() + got["dq"][1, :, dead].abs().sum().item()
    return errors


_CASES = {  # name: (h_kv, padding, dtype)
    "mha": (4, False, torch.float64),
    "gqa2": (2, False, torch.float64),
    "gqa1": (1, False, torch.float64),
    "padded": (4, True, torch.float64),
    "padded gqa2": (2, True, torch.float64),
    "fp32 gqa2": (2, False, torch.float32),
    "bf16 gqa2": (2, True, torch.bfloat16),
}


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: TIGHT, torch.float32: FP32}.get(dtype, BF16)


# -------------------------------------------------------------------------------------- the ring, cp2 and cp4
def _all_cases() -> dict[str, dict[str, float]]:
    rank, world = _init()
    return {
        name: _errors(_inputs(h_kv, seed, padding), dtype, None, world, rank)
        for seed, (name, (h_kv, padding, dtype)) in enumerate(_CASES.items())
    }


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_whole_sequence_attention(run_ranks, cp):
    for rank, result in enumerate(run_ranks(_all_cases, cp, timeout=60)):
        for name, errors in result.items():
            tol = _tolerance(_CASES[name][2])
            assert max(errors.values()) < tol, (cp, rank, name, errors)


# --------------------------------------------------------------------------- two subgroup rings side by side
def _subgroup_rings() -> dict[str, float]:
    rank, _ = _init()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    mine = rank // 2
    # Different inputs per ring: a message crossing between the rings would show.
    x = _inputs(2, seed=100 + mine, padding=True)
    return _errors(x, torch.float64, groups[mine], 2, dist.get_rank(groups[mine]))


def test_subgroups_run_their_own_rings(run_ranks):
    for rank, errors in enumerate(run_ranks(_subgroup_rings, 4, timeout=60)):
        assert max(errors.values()) < TIGHT, (rank, errors)


# ---------------------------------------------------------------------------------------------- the traffic
def _logged(label: str) -> tuple[int, int, int]:
    """(elements sent, elements received, sends) under ``label`` in the collective log."""
    entries = [e for e in LOG.recent if e.label == label]
    sent = sum(e.numel for e in entries if e.op == "send")
    received = sum(e.numel for e in entries if e.op == "recv")
    return sent, received, sum(e.op == "send" for e in entries)


def _traffic(h: int, h_kv: int) -> list[dict[str, Any]]:
    rank, world = _init()
    results = []
    LOG.on = True
    try:
        for padding in (False, True):
            x = _inputs(h_kv, seed=7, padding=padding, h=h)
            pos = layout.positions("ring", world, rank, S)
            q, k, v = (x[n][:, :, pos].float().requires_grad_() for n in ("q", "k", "v"))
            mask = x["mask"][:, pos] if padding else None
            LOG.reset()
            out = ring_attention(q, k, v, key_padding_mask=mask)
            forward = _logged("ring attention kv")
            out.sum().backward()
            results.append(
                {
                    "padding": padding,
                    "forward": forward,
                    "backward_kv": _logged("ring attention kv (backward)"),
                    "backward_dkv": _logged("ring attention dkv"),
                    "forward_again": _logged("ring attention kv"),  # the backward logs none under this label
                    "open": len(LOG.open),
                }
            )
    finally:
        LOG.on = False
    return results


@pytest.mark.parametrize("cp, h, h_kv", [(2, 4, 4), (4, 4, 1)])
def test_traffic_matches_the_formula(run_ranks, cp, h, h_kv):
    s_local = S // cp
    for rank, results in enumerate(run_ranks(_traffic, cp, h, h_kv, timeout=60)):
        for r in results:
            want = ring_traffic_elements(B, h_kv, s_local, D, cp, key_padding_mask=r["padding"])
            transfers = 2 if r["padding"] else 1  # k and v travel as one message, the mask as another
            assert r["forward"] == (want["forward"], want["forward"], (cp - 1) * transfers), (rank, r, want)
            assert r["forward_again"] == r["forward"], (rank, r)
            assert r["backward_kv"] == (want["backward_kv"], want["backward_kv"], (cp - 1) * transfers), (rank, r)
            assert r["backward_dkv"] == (want["backward_dkv"], want["backward_dkv"], cp), (rank, r, want)
            assert want["backward"] == want["backward_kv"] + want["backward_dkv"]
            assert r["open"] == 0, (rank, r)  # every transfer was waited for


def test_traffic_formula():
    # size 4, b=2, h_kv=1, s_local=4, d=8: a kv pair is 2 * 2 * 1 * 4 * 8 = 128 elements, a mask 8.
    assert ring_traffic_elements(2, 1, 4, 8, 4) == {
        "forward": 3 * 128,
        "backward_kv": 3 * 128,
        "backward_dkv": 4 * 128,
        "backward": 7 * 128,
    }
    assert ring_traffic_elements(2, 1, 4, 8, 4, key_padding_mask=True)["forward"] == 3 * (128 + 8)
    assert ring_traffic_elements(2, 1, 4, 8, 1) == {"forward": 0, "backward_kv": 0, "backward_dkv": 0, "backward": 0}


# ------------------------------------------------------------------------------------------ size 1, in-process
@pytest.mark.parametrize("name", list(_CASES))
def test_size_one_is_plain_causal_attention(name):
    h_kv, padding, dtype = _CASES[name]
    errors = _errors(_inputs(h_kv, seed=3, padding=padding), dtype, None, 1, 0)
    assert max(errors.values()) < _tolerance(dtype), errors


@pytest.mark.parametrize("name", ["padded", "padded gqa2", "gqa1"])
def test_blocks_computed_in_tiles_of_query_rows_give_the_same_result(monkeypatch, name):
    # A tile budget of 5 score elements cuts every block into tiles of one or a few query rows (and the causal
    # mask with them), as the 16 MiB budget cuts long chunks.
    from phalanx.strategies.context_parallel import ring

    monkeypatch.setattr(ring, "_TILE_ELEMENTS", 5)
    assert len(ring._tiles(4, 2)) == 2 and len(ring._tiles(4, 100)) == 4
    h_kv, padding, dtype = _CASES[name]
    errors = _errors(_inputs(h_kv, seed=3, padding=padding), dtype, None, 1, 0)
    assert max(errors.values()) < _tolerance(dtype), errors


def test_size_one_takes_the_scale_and_equals_sdpa_is_causal():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    assert (ring_attention(q, k, v, scale=0.3) - want).abs().max().item() < FP32  # (not assert_close: 2 s to import)


# ---------------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs_are_refused_with_the_value_and_the_fix():
    q, kv = torch.zeros(1, 4, 8, 2), torch.zeros(1, 2, 8, 2)
    with pytest.raises(ValueError, match=r"dropout_p=0\.1.*Set the model's attention dropout to 0"):
        ring_attention(q, kv, kv, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"4-D q .*got \(4, 8, 2\).*transpose"):
        ring_attention(q[0], kv, kv)
    with pytest.raises(ValueError, match=r"k and v of one shape; got k \(1, 2, 8, 2\) and v \(1, 2, 6, 2\)"):
        ring_attention(q, kv, kv[:, :, :6])
    with pytest.raises(ValueError, match=r"matching q \(1, 4, 8, 2\).*got \(1, 2, 6, 2\)"):
        ring_attention(q, kv[:, :, :6], kv[:, :, :6])
    with pytest.raises(ValueError, match=r"h=4 and h_kv=3. Use h_kv dividing h"):
        ring_attention(q, torch.zeros(1, 3, 8, 2), torch.zeros(1, 3, 8, 2))
    with pytest.raises(ValueError, match=r"s_local=7. Pad the sequence to a multiple of 2 \* cp_size"):
        ring_attention(q[:, :, :7], kv[:, :, :7], kv[:, :, :7])
    with pytest.raises(ValueError, match=r"one floating dtype; got torch.float32, torch.float64"):
        ring_attention(q, kv.double(), kv)
    with pytest.raises(ValueError, match=r"bool \[batch, s_local\] = \[1, 8\].*got torch.float32 \(1, 8\)"):
        ring_attention(q, kv, kv, key_padding_mask=torch.ones(1, 8))
    with pytest.raises(ValueError, match=r"got torch.bool \(1, 6\)"):
        ring_attention(q, kv, kv, key_padding_mask=torch.ones(1, 6, dtype=torch.bool))
