"""The demo GPT's mixture-of-experts MLP (``phalanx demo -- --moe``), in one process: its router and experts against
transformers' Qwen3-MoE classes (whose layout expert parallelism splits by), the block against a token-by-token
reference, the load-balancing loss against transformers' load_balancing_loss_func, and the dense model unchanged."""

from __future__ import annotations

import fnmatch

import pytest
import torch
import torch.nn.functional as F

from phalanx.demo import (
    Experts,
    GPTConfig,
    SparseMoE,
    TinyGPT,
    TopKRouter,
    _gpt_loss,
    _router_aux_loss,
    load_balancing_loss,
    parse_args,
)

qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
H, W, E, K = 32, 16, 8, 2  # hidden size, expert width (moe_intermediate_size), experts, experts per token


def _qwen_config():  # type: ignore[no-untyped-def]
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=W,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=True,
        hidden_act="silu",  # the demo's experts are SwiGLU, as Qwen3-MoE's
        experts_implementation="eager",
    )


def _moe(std: float = 0.3, seed: int = 0) -> SparseMoE:
    """A block with weights large enough that the routing and the experts' outputs are far from zero."""
    moe = SparseMoE(GPTConfig(n_embd=H, moe=True, n_experts=E, top_k=K, moe_intermediate=W))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return moe


def _hidden(tokens: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))


def test_block_matches_a_token_by_token_reference():
    moe = _moe(std=0.15)  # outputs of order 1, so that 1e-6 is a few fp32 roundings
    x = _hidden(2 * 12).view(2, 12, H)
    out = moe(x)
    assert out.shape == x.shape
    assert moe.router_logits is not None and moe.router_logits.shape == (24, E)
    w_gate, w_gu, w_down = moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj
    ref = torch.zeros(24, H)
    for t, h in enumerate(x.reshape(-1, H)):
        probs = torch.softmax(w_gate @ h, dim=-1)
        top_p, top_e = probs.topk(K)
        top_p = top_p / top_p.sum()
        for p, e in zip(top_p, top_e.tolist(), strict=True):
            gate, up = w_gu[e, :W] @ h, w_gu[e, W:] @ h
            ref[t] += p * (w_down[e] @ (F.silu(gate) * up))
    assert 0.5 < ref.abs().max() < 2.0  # a comparison of non-trivial numbers
    torch.testing.assert_close(out.reshape(-1, H), ref, atol=1e-6, rtol=0.0)


def test_block_matches_qwen3_moe_sparse_block():
    moe = _moe()
    theirs = qwen3_moe.Qwen3MoeSparseMoeBlock(_qwen_config())
    theirs.load_state_dict(moe.state_dict())  # the same names: gate.weight, experts.gate_up_proj, experts.down_proj
    x = _hidden(20).view(4, 5, H)
    assert torch.equal(moe(x), theirs(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_qwen3_moe_top_k_router(dtype):
    ours = TopKRouter(H, E, K).to(dtype)
    theirs = qwen3_moe.Qwen3MoeTopKRouter(_qwen_config()).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(2)))
        theirs.weight.copy_(ours.weight)
    assert (ours.num_experts, ours.top_k, ours.norm_topk_prob) == (E, K, True)
    h = _hidden().to(dtype)
    for a, b in zip(ours(h), theirs(h), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert ours(h)[1].dtype == dtype  # the weights cast back to the logits' dtype


def test_experts_match_qwen3_moe_experts():
    ours = _moe().experts
    theirs = qwen3_moe.Qwen3MoeExperts(_qwen_config())
    theirs.load_state_dict(ours.state_dict())
    h = _hidden(30)
    g = torch.Generator().manual_seed(3)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(30)])
    weights = torch.rand(30, K, generator=g)
    assert torch.equal(ours(h, index, weights), theirs(h, index, weights))


def test_experts_skip_ids_past_num_experts():
    """Expert parallelism lowers num_experts to a rank's own experts and marks the others' pairs with larger ids."""
    experts = _moe().experts
    h = _hidden(6)
    index = torch.tensor([[0, 3], [1, 8], [9, 12], [2, 2], [7, 8], [8, 8]])
    weights = torch.rand(6, K, generator=torch.Generator().manual_seed(4))
    kept = index < E
    ref = experts(h, torch.where(kept, index, 0), weights * kept)  # expert 0 at weight 0 for the skipped pairs
    torch.testing.assert_close(experts(h, index, weights), ref)
    experts.num_experts = 4  # as if this rank held experts 0..3: 7, 8, 9 and 12 are others'
    local = (index < 4) & kept
    torch.testing.assert_close(experts(h, index, weights), experts(h, torch.where(local, index, 0), weights * local))


def test_moe_option_builds_the_model_with_its_plans():
    args = parse_args(["--moe"])
    assert (args.moe, args.experts, args.top_k, args.aux_loss_coef) == (True, 8, 2, 0.01)
    assert parse_args([]).moe is False
    custom = parse_args(["--moe", "--experts", "4", "--top-k", "1", "--aux-loss-coef", "0"])
    assert (custom.experts, custom.top_k, custom.aux_loss_coef) == (4, 1, 0.0)
    for bad in (["--moe", "--top-k", "9"], ["--moe", "--experts", "0"], ["--aux-loss-coef", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)

    cfg = GPTConfig(n_layer=2, n_embd=64, moe=args.moe, n_experts=args.experts, top_k=args.top_k)
    model = TinyGPT(cfg)
    for block in model.blocks:
        mlp = block.mlp
        assert isinstance(mlp, SparseMoE) and isinstance(mlp.gate, TopKRouter) and isinstance(mlp.experts, Experts)
        assert mlp.experts.num_experts == mlp.gate.num_experts == 8 and mlp.gate.top_k == 2
        assert mlp.gate.weight.shape == (8, 64)
        assert mlp.experts.gate_up_proj.shape == (8, 2 * 128, 64) and mlp.experts.down_proj.shape == (8, 64, 128)

    assert model.ep_plan() == {
        "blocks.*.mlp.experts": "ep_dispatch_experts",
        "blocks.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "blocks.*.mlp.experts.down_proj": "grouped_gemm",
    }
    tp = model.tp_plan()
    assert {k: v for k, v in tp.items() if ".mlp" in k} == {
        "blocks.*.mlp.experts.gate_up_proj": "packed_colwise",
        "blocks.*.mlp.experts.down_proj": "rowwise",
        "blocks.*.mlp.experts": "moe_tp_experts",
    }
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    for pattern in [*model.ep_plan(), *tp]:  # every entry names something the model has
        assert fnmatch.filter(names, pattern), pattern
    assert TinyGPT(GPTConfig(n_layer=1)).ep_plan() == {}

    # Initialised from the seed, like the rest: the same seed builds the same experts.
    torch.manual_seed(5)
    again = TinyGPT(cfg)
    torch.manual_seed(5)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), TinyGPT(cfg).parameters(), strict=True))
    assert 0.015 < model.blocks[0].mlp.experts.down_proj.std() < 0.025


def test_load_balancing_loss_matches_transformers():
    torch.manual_seed(6)
    model = TinyGPT(GPTConfig(n_layer=3, n_embd=H, n_head=4, block_size=16, moe=True, n_experts=E, top_k=K))
    x = torch.randint(0, 256, (2, 16))
    y = torch.roll(x, -1, dims=1)
    model(x)
    logits = tuple(block.mlp.router_logits for block in model.blocks)
    ours = load_balancing_loss(logits, E, K)
    assert ours > 0
    torch.testing.assert_close(ours, qwen3_moe.load_balancing_loss_func(logits, E, K))

    # In the demo's loss: the cross-entropy plus coef x the same loss, with gradient reaching every router.
    ce = _gpt_loss(model, (x, y))
    model.zero_grad()
    total = _gpt_loss(model, (x, y), aux_loss_coef=0.5)
    aux = qwen3_moe.load_balancing_loss_func(logits, E, K)  # the forward is deterministic: the same logits again
    torch.testing.assert_close(total, ce + 0.5 * aux)
    total.backward()
    assert all(block.mlp.gate.weight.grad.abs().sum() > 0 for block in model.blocks)
    assert all(block.mlp.router_logits is None for block in model.blocks)  # taken off: no graph kept alive
    assert _router_aux_loss(TinyGPT(GPTConfig(n_layer=1))) is None


def test_pipeline_blocks_run_the_moe_blocks():
    torch.manual_seed(7)
    model = TinyGPT(GPTConfig(n_layer=2, n_embd=H, n_head=4, block_size=16, moe=True, n_experts=E, top_k=K))
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model.pipeline_blocks()(x), model(x))


DENSE_NAMES = [  # TinyGPT(GPTConfig(n_layer=2)).named_parameters(), taken before the MoE variant
    "tok.weight", "pos.weight",
    "blocks.0.ln1.weight", "blocks.0.ln1.bias", "blocks.0.qkv.weight", "blocks.0.qkv.bias", "blocks.0.proj.weight",
    "blocks.0.proj.bias", "blocks.0.ln2.weight", "blocks.0.ln2.bias", "blocks.0.mlp.0.weight", "blocks.0.mlp.0.bias",
    "blocks.0.mlp.2.weight", "blocks.0.mlp.2.bias",
    "blocks.1.ln1.weight", "blocks.1.ln1.bias", "blocks.1.qkv.weight", "blocks.1.qkv.bias", "blocks.1.proj.weight",
    "blocks.1.proj.bias", "blocks.1.ln2.weight", "blocks.1.ln2.bias", "blocks.1.mlp.0.weight", "blocks.1.mlp.0.bias",
    "blocks.1.mlp.2.weight", "blocks.1.mlp.2.bias",
    "ln_f.weight", "ln_f.bias",
]  # fmt: skip


def test_dense_model_is_unchanged():
    model = TinyGPT(GPTConfig(n_layer=2))
    assert [n for n, _ in model.named_parameters()] == DENSE_NAMES
    assert model.tp_plan() == {
        "tok": "embedding_rowwise",
        "pos": "sequence_parallel",
        "blocks.*.qkv": "packed_colwise(packed=3, heads=4)",
        "blocks.*.proj": "rowwise(heads=4)",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
        "head": "colwise_gather_output",
    }
    # The dense loss has no auxiliary term, whatever the coefficient.
    x = torch.randint(0, 256, (2, 16))
    y = torch.roll(x, -1, dims=1)
    assert torch.equal(_gpt_loss(model, (x, y)), _gpt_loss(model, (x, y), aux_loss_coef=0.01))
