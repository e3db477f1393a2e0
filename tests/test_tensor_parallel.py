"""Tensor parallelism (strategies/tensor_parallel) against single-process training of the same model from the same
init, on 2 and 4 gloo ranks.

Tolerance: losses at every step and the gathered parameters at the end within rtol = atol = 1e-5 in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tp_common import TinyLlama, TinyLlamaConfig, batches, init_gloo
from torch import nn

from phalanx.strategies.tensor_parallel import (
    STYLES,
    ReplicatedGradError,
    SequenceLengthError,
    TPParam,
    TPPlanError,
    TPRngTracker,
    apply_tp_plan,
    check_replicated_grads,
    loss_parallel,
    resolve_plan,
    tp_gather_full,
    tp_grad_norm_sq,
    tp_param_info,
    tp_slice_of,
    vocab_parallel_cross_entropy,
)

TOL = dict(rtol=1e-5, atol=1e-5)
STEPS, BATCH, SEQ = 4, 4, 8


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)  # Adam turns rounding noise into steps: keep them small


def _tiny(dropout: float = 0.0) -> TinyLlama:
    torch.manual_seed(0)
    return TinyLlama(TinyLlamaConfig(attention_dropout=dropout, hidden_dropout=dropout))


def _reference(opt: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _tiny()
    optimizer = _optimizer(opt, model.parameters())
    losses = []
    for x, y in batches(STEPS, BATCH, SEQ, 64):
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _full_params(model: nn.Module, group) -> dict[str, torch.Tensor]:
    return {name: tp_gather_full(p.detach(), tp_param_info(p), group) for name, p in model.named_parameters()}


def _train_tp(opt: str, sp: bool, use_fn: bool) -> dict:
    rank, world = init_gloo()
    group = dist.new_group(list(range(world)))
    model = _tiny()
    report = apply_tp_plan(model, None, group, sequence_parallel=sp, seed=0)
    optimizer = _optimizer(opt, model.parameters())
    losses, norms = [], []
    for step, (x, y) in enumerate(batches(STEPS, BATCH, SEQ, 64)):
        logits = model(x)
        if use_fn:
            loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), y.flatten(), group)
        else:
            with loss_parallel():
                loss = nn.CrossEntropyLoss()(logits.flatten(0, 1), y.flatten())
        loss.backward()
        if step == 0:
            check_replicated_grads(model, group)
        norms.append(tp_grad_norm_sq(model.parameters(), group).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "norms": norms,
        "params": _full_params(model, group),
        "names": [n for n, _ in model.named_parameters()],
        "attributes": report.attributes,
        "grad_synced": report.grad_synced,
        "forked": report.forked,
        "vocab": report.vocab_size,
        "kv_info": tp_param_info(model.layers[0].self_attn.k_proj.weight),
    }


def _reference_norms(opt: str) -> list[float]:
    model = _tiny()
    optimizer = _optimizer(opt, model.parameters())
    norms = []
    for x, y in batches(STEPS, BATCH, SEQ, 64):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        norms.append(sum(p.grad.pow(2).sum() for p in model.parameters()).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms


@pytest.mark.parametrize(
    "tp,opt,sp,use_fn", [(2, "sgd", False, True), (4, "adamw", False, False), (4, "sgd", True, True)]
)
def test_tiny_llama_matches_single_process(run_ranks, tp, opt, sp, use_fn):
    """GQA (4 q heads, 2 kv heads: split under tp2, replicated under tp4), a tied vocab-parallel embedding and head,
    the vocab-parallel loss; with sequence parallelism in the last case."""
    ref_losses, ref_params = _reference(opt)
    ref_norms = _reference_norms(opt)
    results = run_ranks(_train_tp, tp, opt, sp, use_fn)
    for rank, res in enumerate(results):
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), **TOL, msg=f"rank {rank}")
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref_norms), rtol=1e-4, atol=1e-6)
        assert res["names"] == list(ref_params)  # parameter names unchanged, the tied weight still one
        for k, v in ref_params.items():
            torch.testing.assert_close(res["params"][k], v, **TOL, msg=f"{k}, rank {rank}")
    res = results[-1]
    assert res["vocab"] == 64
    kv = res["kv_info"]
    if tp == 4:  # 2 kv heads over 4 ranks: each held by 2 ranks, gradients summed over them
        assert (kv.parts, kv.replicas, kv.index, kv.grad_sync) == (2, 2, 1, True)
        assert "layers.0.self_attn.num_key_value_groups: 2 -> 1" in res["attributes"]
        assert "layers.0.self_attn.num_key_value_heads: 2 -> 1" in res["attributes"]
    else:
        assert (kv.parts, kv.replicas, kv.index, kv.grad_sync) == (2, 1, 1, False)
    assert "layers.0.self_attn.num_heads: 4 -> " + str(4 // tp) in res["attributes"]
    assert "layers.0.self_attn" in res["forked"]
    if sp:
        assert {"norm.weight", "layers.0.input_layernorm.weight", "layers.0.self_attn.o_proj.bias"} <= set(
            res["grad_synced"]
        )
        assert "embed_positions.weight" in res["grad_synced"]
        assert "layers.1.dropout" in res["forked"]
    else:
        assert "norm.weight" not in res["grad_synced"]


def _sp_on_off(sp: bool) -> dict:
    rank, world = init_gloo()
    group = dist.new_group(list(range(world)))
    model = _tiny()
    apply_tp_plan(model, None, group, sequence_parallel=sp)
    optimizer = _optimizer("sgd", model.parameters())
    losses = []
    for x, y in batches(3, BATCH, SEQ, 64):
        with loss_parallel():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if sp:  # a sequence the tp size does not divide
        try:
            model(torch.zeros(2, 6, dtype=torch.long))
        except SequenceLengthError as e:
            losses.append(str(e))
    return {"losses": losses, "params": _full_params(model, group)}


def test_sequence_parallel_on_and_off_equal(run_ranks):
    off = run_ranks(_sp_on_off, 4, False)[0]
    on = run_ranks(_sp_on_off, 4, True)[0]
    message = on["losses"].pop()
    assert "6 is not a multiple of 4" in message and "pad the sequence to 8" in message
    torch.testing.assert_close(torch.tensor(on["losses"]), torch.tensor(off["losses"]), rtol=1e-6, atol=1e-6)
    for k, v in off["params"].items():
        torch.testing.assert_close(on["params"][k], v, rtol=1e-6, atol=1e-6, msg=k)


# --------------------------------------------------------------------------------- the vocab-parallel loss
def _loss_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    full = torch.randn(10, 12, generator=g) * 3
    target = torch.randint(0, 12, (10,), generator=g)
    target[2] = target[7] = -100
    return full, target


def _loss_cases(_: int) -> list:
    rank, world = init_gloo()
    group = dist.new_group(list(range(world)))
    full, target = _loss_inputs()
    out = []
    for reduction in ("mean", "sum", "none"):
        for smoothing in (0.0, 0.2):
            logits = full.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(logits, target, group, -100, reduction, smoothing)
            loss.backward(torch.ones_like(loss))
            grads = [torch.empty_like(logits.grad) for _ in range(world)]
            dist.all_gather(grads, logits.grad, group=group)
            out.append((reduction, smoothing, loss.detach(), torch.cat(grads, dim=-1)))
    # logits of shape (batch, class, seq), through loss_parallel's F.cross_entropy on a planned lm_head
    apply_tp_plan(nn.ModuleDict({"lm_head": nn.Linear(4, 12, bias=False)}), {"lm_head": "colwise"}, group)
    logits3 = full.view(2, 5, 12).chunk(world, dim=-1)[rank].movedim(-1, 1).clone().requires_grad_(True)
    with loss_parallel():
        loss3 = nn.CrossEntropyLoss(label_smoothing=0.1)(logits3, target.view(2, 5))
        try:
            F.cross_entropy(full, target)
        except ValueError as e:
            wrong = str(e)
    loss3.backward()
    return [out, (loss3.detach(), logits3.grad), wrong]


def test_vocab_parallel_cross_entropy_matches_torch(run_ranks):
    results = run_ranks(_loss_cases, 2, 0)
    out, full, target = results[0][0], *_loss_inputs()
    for reduction, smoothing, loss, grad in out:
        logits = full.clone().requires_grad_(True)
        ref = F.cross_entropy(logits, target, ignore_index=-100, reduction=reduction, label_smoothing=smoothing)
        ref.backward(torch.ones_like(ref))
        torch.testing.assert_close(loss, ref.detach(), **TOL, msg=f"{reduction}, {smoothing}")
        torch.testing.assert_close(grad, logits.grad, **TOL, msg=f"grad {reduction}, {smoothing}")
    logits3 = full.view(2, 5, 12).movedim(-1, 1).clone().requires_grad_(True)
    ref3 = F.cross_entropy(logits3, target.view(2, 5), label_smoothing=0.1)
    ref3.backward()
    for rank, res in enumerate(results):
        loss3, grad3 = res[1]
        torch.testing.assert_close(loss3, ref3.detach(), **TOL)
        torch.testing.assert_close(grad3, logits3.grad.chunk(2, dim=1)[rank], **TOL)
    assert "class dim has 12 entries; this rank's vocabulary shard has 6 (vocabulary 12 over tp=2)" in results[0][2]


# ------------------------------------------------------------------------------- a transformers model
def _hf_llama(tp_rank_count: int) -> tuple:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


def _hf_train(model, steps: int, group=None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in batches(steps, BATCH, SEQ, 64):
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        if group is not None and not losses:
            check_replicated_grads(model, group)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _hf_tp(tp: int) -> dict:
    rank, world = init_gloo()
    group = dist.new_group(list(range(world)))
    model = _hf_llama(tp)
    plan = resolve_plan(model, None)
    report = apply_tp_plan(model, None, group)
    try:
        apply_tp_plan(_hf_llama(tp), None, group, sequence_parallel=True)
    except TPPlanError as e:
        sp_error = str(e)
    losses = _hf_train(model, 3, group)
    return {
        "plan": plan,
        "losses": losses,
        "params": _full_params(model, group),
        "attributes": report.attributes,
        "sp_error": sp_error,
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_transformers_llama_own_plan_matches_single_process(run_ranks, tp):
    model = _hf_llama(tp)
    ref_losses = _hf_train(model, 3)
    res = run_ranks(_hf_tp, tp, tp)[0]
    assert res["plan"]["lm_head"] == "colwise_gather_output"
    assert res["plan"]["model.layers.*.self_attn.k_proj"] == "colwise"
    assert res["plan"]["model.embed_tokens"] == "embedding_rowwise"
    assert "transformers model" in res["sp_error"]
    groups = 2 if tp == 2 else 1  # local q heads per local kv head: 2/1 under tp2, 1/1 (kv replicated) under tp4
    assert f"model.layers.0.self_attn.num_key_value_groups: 2 -> {groups}" in res["attributes"]
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), **TOL)
    for k, v in model.named_parameters():
        torch.testing.assert_close(res["params"][k], v.detach(), **TOL, msg=k)


# ---------------------------------------------------------------------------------------- dropout
def _dropout_run(_: int) -> dict:
    rank, world = init_gloo()
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = TinyLlama(TinyLlamaConfig(attention_dropout=0.3, hidden_dropout=0.3))
    report = apply_tp_plan(model, None, group, seed=5)
    seen: dict[str, torch.Tensor] = {}

    def keep(key: str, t: torch.Tensor) -> None:  # a hook that returns nothing, so it changes nothing
        seen.setdefault(key, t.detach().clone())

    model.layers[0].dropout.register_forward_hook(lambda m, i, o: keep("hidden", o))
    model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, i: keep("heads", i[0]))
    torch.manual_seed(11)  # the default generator: alike on every tp rank
    x, y = batches(1, BATCH, SEQ, 64)[0]
    with loss_parallel():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    with report.tracker.fork():
        forked = torch.rand(4)
    plain = torch.rand(4)
    state = report.tracker.state_dict()
    torch_state = torch.get_rng_state()  # the stream resumes with torch's RNG state, which a checkpoint saves
    again = TPRngTracker(5, rank)
    again.load_state_dict(state)
    with again.fork():
        resumed = torch.rand(4)
    torch.set_rng_state(torch_state)
    with report.tracker.fork():
        continued = torch.rand(4)
    return {
        "loss": loss.item(),
        "grads": _full_params_grads(model, group),
        "hidden": seen["hidden"],
        "heads": seen["heads"],
        "forked": forked,
        "plain": plain,
        "resumed_equal": torch.equal(resumed, continued),
        "state_types": sorted(
            {type(v).__name__ for v in state.values()} | {type(v).__name__ for v in state["states"].values()}
        ),
    }


def _full_params_grads(model: nn.Module, group) -> dict[str, torch.Tensor]:
    return {n: tp_gather_full(p.grad, tp_param_info(p), group) for n, p in model.named_parameters()}


def test_dropout_under_tp_is_reproducible_and_per_rank_where_sharded(run_ranks):
    first = run_ranks(_dropout_run, 2, 0)
    second = run_ranks(_dropout_run, 2, 0)
    for a, b in zip(first, second):
        assert a["loss"] == b["loss"]
        for k in a["grads"]:
            assert torch.equal(a["grads"][k], b["grads"][k]), k
        assert torch.equal(a["heads"], b["heads"])
    r0, r1 = first
    assert torch.equal(r0["hidden"], r1["hidden"])  # replicated activations: the same mask on every rank
    assert not torch.equal(r0["forked"], r1["forked"])  # each rank's own stream
    assert torch.equal(r0["plain"], r1["plain"])
    assert r0["resumed_equal"] and r1["resumed_equal"]
    assert r0["state_types"] == ["dict", "int"]
    # the local heads' attention outputs: dropout zeroed different elements on the two ranks
    zeros0, zeros1 = (r0["heads"] == 0), (r1["heads"] == 0)
    assert zeros0.any() and not torch.equal(zeros0, zeros1)


# ------------------------------------------------------------------------------------- bad plans
def _bad_plans(_: int) -> dict:
    rank, world = init_gloo()
    group = dist.new_group(list(range(world)))
    errors = {}

    def attempt(key, model, plan, **kw):
        try:
            apply_tp_plan(model, plan, group, **kw)
            errors[key] = None
        except (TPPlanError, TypeError) as e:
            errors[key] = f"{type(e).__name__}: {e}"

    cfg = TinyLlamaConfig
    attempt("nothing", _tiny(), {**_tiny().tp_plan(), "layers.*.mlp.fc9": "colwise"})
    attempt("heads", TinyLlama(cfg(num_attention_heads=2, num_key_value_heads=2, hidden_size=48)), None)
    attempt("kv", TinyLlama(cfg(num_attention_heads=6, num_key_value_heads=3, hidden_size=48)), None)
    attempt("vocab", TinyLlama(cfg(vocab_size=66)), None)
    attempt("hidden", TinyLlama(cfg(intermediate_size=66)), None)
    attempt("conv", nn.Sequential(nn.Conv2d(3, 8, 3)), {"0": "colwise"})
    attempt("unknown", _tiny(), {"lm_head": "colwize"})
    attempt("expert", _tiny(), {"layers.*.mlp": "moe_tp_experts"})
    attempt("grouped", _tiny(), {"layers.*.mlp.gate_proj": "grouped_gemm"})
    plan = _tiny().tp_plan()
    del plan["lm_head"]
    attempt("tied", _tiny(), plan)
    attempt("noplan", nn.Linear(4, 4), None)
    model = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attempt("untouched", model, {**model.tp_plan(), "layers.1.mlp.up_proj": "packed_colwise(packed=3)"})
    errors["untouched_equal"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    try:
        apply_tp_plan(nn.Linear(4, 4), {"": "colwise"}, None)
    except TypeError as e:
        errors["nogroup"] = str(e)
    return errors


def test_bad_plans_are_refused_with_the_numbers(run_ranks):
    errors = run_ranks(_bad_plans, 4, 0)[0]
    assert "'layers.*.mlp.fc9'" in errors["nothing"] and "matches no module" in errors["nothing"]
    assert "splits 2 attention heads over tp=4" in errors["heads"]
    assert "3 attention heads over tp=4" in errors["kv"] or "6 attention heads over tp=4" in errors["kv"]
    assert "embed_tokens" in errors["vocab"] and "num_embeddings (the vocabulary)=66 over tp=4" in errors["vocab"]
    assert "layers.0.mlp.gate_proj" in errors["hidden"] and "out_features=66 over tp=4" in errors["hidden"]
    assert "0: style 'colwise' splits an nn.Linear" in errors["conv"] and "Conv2d" in errors["conv"]
    assert "unknown style 'colwize'" in errors["unknown"] and "did you mean 'colwise'" in errors["unknown"]
    # moe_tp_experts is for an experts module (weights stacked by expert), not an MLP of Linear layers; grouped_gemm
    # belongs in the ep plan.
    assert "'moe_tp_experts' applies to an experts module" in errors["expert"] and "(gate_proj" in errors["expert"]
    assert "expert parallelism" in errors["grouped"] and "ep plan" in errors["grouped"]
    assert "grouped_gemm" in errors["grouped"]
    assert "lm_head.weight is the same parameter as embed_tokens.weight" in errors["tied"]
    assert "Linear has no tensor-parallel plan" in errors["noplan"] and "pass tp_plan=" in errors["noplan"]
    assert "layers.1.mlp.up_proj" in errors["untouched"] and "packed blocks" in errors["untouched"]
    assert errors["untouched_equal"]
    assert "tp process group" in errors["nogroup"]


def test_styles_cover_transformers():
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    from phalanx.strategies.tensor_parallel import EXPERT_STYLES

    theirs = set(ALL_PARALLEL_STYLES.keys())
    assert theirs <= set(STYLES) | set(EXPERT_STYLES), theirs - set(STYLES) - set(EXPERT_STYLES)


# ---------------------------------------------------------------------------- TPParam and the pieces
def _pieces(_: int) -> dict:
    rank, world = init_gloo()
    group = dist.new_group(list(range(world)))
    out = {}
    full = torch.arange(24 * 3, dtype=torch.float32).view(24, 3)
    cases = {
        "plain": TPParam((24, 3), 0, rank, world, 1, False),
        "packed": TPParam((24, 3), 0, rank, world, 1, False, packed=3),
        "kv": TPParam((24, 3), 0, rank // 2, 2, world // 2, True),
        "replicated": TPParam((24, 3), None, 0, 1, world, False),
    }
    for key, info in cases.items():
        local = tp_slice_of(full, info)
        out[key] = (info.local_shape, local, tp_gather_full(local, info, group), info.writer(rank))
    return out


def test_tp_slice_and_gather_round_trip(run_ranks):
    results = run_ranks(_pieces, 4, 0)
    full = torch.arange(24 * 3, dtype=torch.float32).view(24, 3)
    for rank, res in enumerate(results):
        for key, (shape, local, gathered, _) in res.items():
            torch.testing.assert_close(gathered, full, msg=key)
            assert tuple(local.shape) == shape
        assert torch.equal(res["plain"][1], full[6 * rank : 6 * rank + 6])
        # packed: [q; k; v] blocks of 8 rows, each cut in 4: this rank's 2 rows of each
        expect = torch.cat([full[8 * b + 2 * rank : 8 * b + 2 * rank + 2] for b in range(3)])
        assert torch.equal(res["packed"][1], expect)
        # kv heads replicated over pairs of ranks: ranks 0, 1 hold rows 0-11, ranks 2, 3 rows 12-23
        assert torch.equal(res["kv"][1], full[12 * (rank // 2) : 12 * (rank // 2) + 12])
        assert res["kv"][3] == (rank % 2 == 0) and res["plain"][3] and res["replicated"][3] == (rank == 0)


def _unsynced(_: int) -> str:
    rank, world = init_gloo()
    group = dist.new_group(list(range(world)))
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4), nn.LayerNorm(4))
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    apply_tp_plan(model, {"0": "colwise", "1": "rowwise"}, group)
    x = torch.randn(3, 4)
    model(x).pow(2).sum().backward()
    check_replicated_grads(model, group)  # the LayerNorm on replicated activations: fine
    # Break it: the norm's gradient made rank-dependent, as a partial sum would be
    model[2].weight.grad += rank
    try:
        check_replicated_grads(model, group)
    except ReplicatedGradError as e:
        return str(e)
    return "no error"


def test_check_replicated_grads_names_the_parameter(run_ranks):
    message = run_ranks(_unsynced, 2, 0)[0]
    assert "2.weight" in message and "2.bias" not in message and "different gradients" in message


def test_demo_gpt_plan_matches_single_process(run_ranks):
    from phalanx.demo import GPTConfig, TinyGPT

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)
    torch.manual_seed(0)
    ref = TinyGPT(cfg)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)  # not Adam: the k part of qkv.bias has a zero gradient, in noise
    losses = []
    for x, y in batches(3, BATCH, SEQ, 32):
        loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for sp in (False, True):
        res = run_ranks(_demo_tp, 4 if sp else 2, cfg, sp)[0]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(losses), **TOL)
        for k, v in ref.named_parameters():
            torch.testing.assert_close(res["params"][k], v.detach(), **TOL, msg=k)
        assert res["qkv"].packed == 3 and res["tied"]


def _demo_tp(cfg, sp: bool) -> dict:
    from phalanx.demo import TinyGPT

    rank, world = init_gloo()
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    apply_tp_plan(model, None, group, sequence_parallel=sp)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in batches(3, BATCH, SEQ, 32):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": _full_params(model, group),
        "qkv": tp_param_info(model.blocks[0].qkv.weight),
        "tied": model.head.weight is model.tok.weight,
    }


class _Styles(nn.Module):
    """One layer of each remaining style: column-split embedding, gathered output into split input (GLM's MLP),
    a packed pair, 4.5x's gather around local layers (the row bias added once), and all_reduce over local rows."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.gate_up = nn.Linear(8, 12)
        self.down = nn.Linear(6, 8)
        self.packed_in = nn.Linear(8, 12)
        self.packed_out = nn.Linear(12, 8)
        self.region = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
        self.shared = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 8, bias=False))
        self.out = nn.Linear(8, 16)

    def tp_plan(self) -> dict[str, str]:
        return {
            "emb": "embedding_colwise",
            "gate_up": "colwise_gather_output",
            "down": "rowwise_split_input",
            "packed_in": "packed_colwise",
            "packed_out": "packed_rowwise",
            "region": "gather",
            "region.0": "local_colwise",
            "region.2": "local_rowwise",
            "shared.0": "colwise",
            "shared.2": "local_rowwise",
            "shared": "all_reduce",
        }

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # whole on every rank: the chunk sees all features
        x = x + self.down(F.silu(gate) * up)
        x = x + self.packed_out(F.relu(self.packed_in(x)))
        x = x + self.region(x)
        x = x + self.shared(x)
        return self.out(x)


def _styles_losses(model: nn.Module, group=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    losses = []
    for x, y in batches(3, BATCH, SEQ, 16):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if group is not None and not losses:
            check_replicated_grads(model, group)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if group is not None:
        params = _full_params(model, group)
    return losses, params


def _styles_tp(_: int) -> tuple:
    rank, world = init_gloo()
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = _Styles()
    report = apply_tp_plan(model, None, group)
    try:
        torch.manual_seed(0)
        apply_tp_plan(_Styles(), None, group, sequence_parallel=True)
    except TPPlanError as e:
        sp_error = str(e)
    return (*_styles_losses(model, group), report.params["region.2.bias"], report.forked, sp_error)


def test_other_styles_match_single_process(run_ranks):
    torch.manual_seed(0)
    ref_losses, ref_params = _styles_losses(_Styles())
    for res in run_ranks(_styles_tp, 2, 0):
        losses, params, bias_info, forked, sp_error = res
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, **TOL, msg=k)
        assert bias_info.dim is None and bias_info.grad_sync  # added on rank 0 only, its gradient summed
        assert forked == []  # no layer split by heads: nothing computes on sharded attention
        assert "down: style 'rowwise_split_input' takes a replicated input" in sp_error
