"""Interleaved 1F1B (virtual stages) and ZB-H1 (zero bubble) against a single-process reference; a transformers
Llama pipelined by its base_model_pp_plan; the split backward alone; the schedules' orders and bad settings.

Tolerance: losses and parameters within rtol = atol = 1e-5 in fp32 (the model is tests/_common.py's pipe_model:
8 blocks, tuple boundaries, residual blocks, two param groups), after STEPS steps of AdamW.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _common import grouped_optimizer, make_data, pipe_loss, pipe_model, pipe_reference_run
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.config.settings import ConfigError, EngineConfig
from phalanx.strategies.pipeline.actions import schedule_orders, simulate
from phalanx.strategies.pipeline.split_backward import backward_inputs

STEPS, GLOBAL_BATCH = 4, 16
TOL = dict(rtol=1e-5, atol=1e-5)


def _train(**options) -> dict:
    engine = phalanx.Engine(strategy="pipeline", seed=0, **options)
    torch.manual_seed(100)
    model = pipe_model()
    optimizer = grouped_optimizer("adamw", model)
    x, y = make_data(STEPS * GLOBAL_BATCH)
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // engine.topology.dp_size, shuffle=True)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        loss = engine.train_step(batch, pipe_loss)
        losses.append(engine.reduce(loss, "mean").item())
    with torch.no_grad():
        out = model(x[:8])  # outside train_step: the whole pipeline, on every rank
    return {
        "losses": losses,
        "state": engine.get_state_dict(model),
        "peak_in_flight": engine.strategy.peak_in_flight,
        "eval": out,
    }


def _runs(configs: list[dict]) -> list[dict]:
    return [_train(**c) for c in configs]


def _check(results: list[list[dict]], configs: list[dict]) -> None:
    ref_losses, ref_state = pipe_reference_run(STEPS, GLOBAL_BATCH, "adamw")
    torch.manual_seed(100)
    ref_model = pipe_model()  # the untrained model's output would differ: compare eval against the trained state
    ref_model.load_state_dict(ref_state)
    ref_eval = ref_model(make_data(STEPS * GLOBAL_BATCH)[0][:8]).detach()
    for rank, per_rank in enumerate(results):
        for config, res in zip(configs, per_rank):
            where = f"{config}, rank {rank}"
            torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), **TOL, msg=where)
            assert set(res["state"]) == set(ref_state), where
            for k in ref_state:
                torch.testing.assert_close(res["state"][k], ref_state[k], **TOL, msg=f"{k}, {where}")
            torch.testing.assert_close(res["eval"], ref_eval, **TOL, msg=f"eval, {where}")


PP2 = [
    dict(pp_schedule="interleaved_1f1b", pp_microbatches=4),
    dict(pp_schedule="interleaved_1f1b", pp_microbatches=2, pp_virtual_stages=3),
    dict(pp_schedule="zb_h1", pp_microbatches=4),
    dict(pp_schedule="zb_h1", pp_microbatches=1),
]
PP4 = [
    dict(pp_size=4, pp_schedule="interleaved_1f1b", pp_microbatches=4),  # 8 chunks of one block each
    dict(pp_size=4, pp_schedule="zb_h1", pp_microbatches=8),
    dict(pp_size=2, pp_schedule="interleaved_1f1b", pp_microbatches=4),  # pp2 x dp2
    dict(pp_size=2, pp_schedule="zb_h1", pp_microbatches=4),
    dict(pp_size=2, pp_schedule="interleaved_1f1b", pp_microbatches=2, pp_zero_stage=1),  # and ZeRO-1
    dict(pp_size=2, pp_schedule="zb_h1", pp_microbatches=4, pp_zero_stage=1),
]


def test_schedules_match_single_process_on_2_ranks(run_ranks):
    _check(run_ranks(_runs, 2, PP2), PP2)


def test_schedules_match_single_process_on_4_ranks_with_dp_and_zero1(run_ranks):
    results = run_ranks(_runs, 4, PP4)
    _check(results, PP4)
    # ZB-H1 holds at most pp micro-batches until their weight gradients, as 1F1B does.
    assert max(r[1]["peak_in_flight"] for r in results) <= 4


# ------------------------------------------------------------------------------------------------ Llama
def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(5)
    return LlamaForCausalLM(config)


def _tokens(steps: int) -> torch.Tensor:
    return torch.randint(0, 61, (steps * 8, 12), generator=torch.Generator().manual_seed(3))


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _llama_reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, losses = _tokens(steps), []
    for s in range(steps):
        batch = ids[s * 8 : (s + 1) * 8]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _llama_pipelined(steps: int, schedules: list[str]) -> list[dict]:
    out = []
    for schedule in schedules:
        engine = phalanx.Engine(strategy="pipeline", pp_schedule=schedule, pp_microbatches=4, seed=0)
        model = _llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = engine.prepare(model, opt)
        ids, losses = _tokens(steps), []
        for s in range(steps):
            losses.append(engine.train_step(ids[s * 8 : (s + 1) * 8], _lm_loss).item())
        out.append({"losses": losses, "state": engine.get_state_dict(model)})
    return out


def test_llama_pipelined_by_its_pp_plan_matches_single_process(run_ranks):
    pytest.importorskip("transformers")
    steps = 3
    ref_losses, ref_state = _llama_reference(steps)
    schedules = ["interleaved_1f1b", "zb_h1"]
    for rank, per_rank in enumerate(run_ranks(_llama_pipelined, 2, steps, schedules)):
        for schedule, res in zip(schedules, per_rank):
            where = f"{schedule}, rank {rank}"
            torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), **TOL, msg=where)
            # The state carries the model's own names (as under ddp or in one process).
            assert list(res["state"]) == list(ref_state), where
            for k, v in ref_state.items():
                torch.testing.assert_close(res["state"][k], v, **TOL, msg=f"{k}, {where}")


def _hf_lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1]).logits  # unpipelined: the model's own output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _llama_checkpoints(root: str) -> dict:
    """Pipelined (pp2, 2 steps) -> save_model and save_state; ddp on the same 2 ranks loads that state, steps, saves;
    pipelined loads the ddp state back. A tied Llama is refused."""
    import os

    from transformers import LlamaConfig, LlamaForCausalLM

    ids = _tokens(4)
    out: dict = {}
    engine = phalanx.Engine(strategy="pipeline", pp_schedule="1f1b", pp_microbatches=2, seed=0)
    model = _llama()
    model, _ = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for s in range(2):
        engine.train_step(ids[s * 8 : (s + 1) * 8], _lm_loss)
    out["stage_keys"] = sorted(engine.unwrap_model(model).state_dict())
    with torch.no_grad():
        out["logits"] = model(ids[16:24, :-1])
    engine.save_model(model, os.path.join(root, "hf"))
    engine.save_state(os.path.join(root, "pp"))
    out["pp_state"] = engine.get_state_dict(model)
    out["pp_next_loss"] = engine.train_step(ids[16:24], _lm_loss).item()
    out["pp_next_state"] = engine.get_state_dict(model)

    ddp = phalanx.Engine(strategy="ddp", seed=0)
    torch.manual_seed(11)
    other = LlamaForCausalLM(_llama().config)  # other weights: load_state must replace them all
    other, _ = ddp.prepare(other, torch.optim.AdamW(other.parameters(), lr=1e-2))
    ddp.load_state(os.path.join(root, "pp"))
    out["ddp_loaded"] = ddp.get_state_dict(other)
    half = ids[16:24][ddp.rank * 4 : (ddp.rank + 1) * 4]
    out["ddp_next_loss"] = ddp.reduce(ddp.train_step(half, _hf_lm_loss), "mean").item()
    out["ddp_next_state"] = ddp.get_state_dict(other)
    ddp.save_state(os.path.join(root, "ddp"))

    back = phalanx.Engine(strategy="pipeline", pp_schedule="1f1b", pp_microbatches=2, seed=0)
    torch.manual_seed(12)
    again = LlamaForCausalLM(_llama().config)
    again, _ = back.prepare(again, torch.optim.AdamW(again.parameters(), lr=1e-2))
    back.load_state(os.path.join(root, "ddp"))
    out["pp_loaded"] = back.get_state_dict(again)

    tied = LlamaForCausalLM(LlamaConfig(**{**_llama().config.to_dict(), "tie_word_embeddings": True}))
    try:
        phalanx.Engine(strategy="pipeline", pp_microbatches=2, seed=0).prepare(tied)
        out["tied"] = None
    except ValueError as e:
        out["tied"] = str(e)
    return out


def test_llama_pipelined_checkpoints_carry_the_models_own_names(run_ranks, tmp_path):
    """save_model -> from_pretrained gives the pipelined model's logits (within 1e-5) under the unpipelined model's
    keys; save_state pipelined -> load_state under ddp and back give the same tensors (within 1e-6), and a step
    after the load matches the pipelined one (within 1e-5)."""
    pytest.importorskip("transformers")
    import safetensors.torch
    from transformers import LlamaForCausalLM

    results = run_ranks(_llama_checkpoints, 2, str(tmp_path))
    own = set(_llama().state_dict())
    saved = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    assert set(saved) == own
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    ids = _tokens(4)
    with torch.no_grad():
        logits = loaded(input_ids=ids[16:24, :-1]).logits
    tight = dict(rtol=1e-6, atol=1e-6)
    stage_keys = []
    for rank, res in enumerate(results):
        where = f"rank {rank}"
        torch.testing.assert_close(res["logits"], logits, **TOL, msg=where)
        stage_keys += res["stage_keys"]
        assert set(res["pp_state"]) == own, where
        for name, value in [("ddp_loaded", res["pp_state"]), ("pp_loaded", res["ddp_next_state"])]:
            assert set(res[name]) == own, f"{name}, {where}"
            for k in own:
                torch.testing.assert_close(res[name][k], value[k], **tight, msg=f"{name} {k}, {where}")
        assert res["ddp_next_loss"] == pytest.approx(res["pp_next_loss"], rel=1e-5, abs=1e-5), where
        for k in own:
            torch.testing.assert_close(res["ddp_next_state"][k], res["pp_next_state"][k], **TOL, msg=f"{k}, {where}")
        assert res["tied"] is not None and "tie_word_embeddings=False" in res["tied"], res["tied"]
    # Each stage's unwrapped module holds its own part of the model, under the model's names.
    assert sorted(stage_keys) == sorted(own)


# ------------------------------------------------------------------------------------- split backward alone
class _Tied(nn.Module):
    """A weight used twice (the second use under the first), and an output that depends on a weight alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 5)
        self.alone = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        h = self.a(h) * h
        return self.b(h), self.alone * 2


def test_split_backward_equals_one_backward():
    torch.manual_seed(0)
    model = _Tied()
    x = torch.randn(4, 6)
    gy, ga = torch.randn(4, 5), torch.randn(5)
    ref_in = x.clone().requires_grad_(True)
    y, alone = model(ref_in)
    torch.autograd.backward([y, alone], [gy, ga])
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    inp = x.clone().requires_grad_(True)
    y, alone = model(inp)
    grads, weights = backward_inputs([y, alone], [gy, ga], [inp], list(model.parameters()))
    torch.testing.assert_close(grads[0], ref_in.grad, rtol=1e-6, atol=1e-6)
    assert all(p.grad is None for p in model.parameters()), "B must leave the weights' gradients to W"
    weights.run()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-6, msg=n)
    # A chunk whose input needs no gradient (the first): B does nothing, W the whole backward.
    model.zero_grad()
    y, alone = model(x)
    grads, weights = backward_inputs([y, alone], [gy, ga], [x], list(model.parameters()))
    assert grads == [] and all(p.grad is None for p in model.parameters())
    weights.run()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-6, msg=n)


# ------------------------------------------------------------------------------------- orders and settings
@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 6)])
def test_interleaved_order_runs_and_has_the_theorys_bubble(pp, v, m):
    orders = schedule_orders("interleaved_1f1b", pp, v, m)
    for r, order in enumerate(orders):
        chunks = range(r, pp * v, pp)
        assert sorted(a for a in order if a[0] == "F") == [("F", c, i) for c in chunks for i in range(m)]
        assert sorted(a for a in order if a[0] == "BW") == [("BW", c, i) for c in chunks for i in range(m)]
    sim = simulate(orders, {"F": 1.0, "BW": 2.0})
    step = max(sim["end"])
    for idle in sim["idle"]:
        assert idle / step == pytest.approx((pp - 1) / (v * m + pp - 1))  # (p-1)/v (F+B) over the step


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4), (3, 7)])
def test_zb_h1_order_runs_holds_pp_and_has_the_theorys_bubble(pp, m):
    orders = schedule_orders("zb_h1", pp, 1, m)
    for order in orders:
        held = peak = 0
        for kind, _, _ in order:
            held += {"F": 1, "W": -1}.get(kind, 0)
            peak = max(peak, held)
        assert peak <= pp  # 1F1B's memory
        assert sorted(order) == sorted((k, order[0][1], i) for k in "FBW" for i in range(m))
    sim = simulate(orders, {"F": 1.0, "B": 1.0, "W": 1.0})
    step = max(sim["end"])
    for idle in sim["idle"]:
        assert idle / step == pytest.approx((pp - 1) / (3 * m + pp - 1))  # (p-1)(F+B-W) over the step


def test_schedule_settings_are_checked():
    with pytest.raises(ConfigError, match="'Interleaved1F1B' is pp_schedule='interleaved_1f1b' here"):
        EngineConfig(strategy="pipeline", pp_schedule="Interleaved1F1B")
    with pytest.raises(ConfigError, match="pp_microbatches must be a multiple of pp_size=2; got pp_microbatches=3"):
        EngineConfig(strategy="pipeline", pp_schedule="interleaved_1f1b", pp_size=2, pp_microbatches=3)
    with pytest.raises(ConfigError, match="needs pp_virtual_stages >= 2"):
        EngineConfig(strategy="pipeline", pp_schedule="interleaved_1f1b", pp_virtual_stages=1)
    with pytest.raises(ConfigError, match="pp_virtual_stages=2 applies to pp_schedule='interleaved_1f1b' only"):
        EngineConfig(strategy="pipeline", pp_schedule="zb_h1", pp_virtual_stages=2)
    with pytest.raises(ConfigError, match="invalid pp_virtual_stages"):
        EngineConfig(strategy="pipeline", pp_schedule="interleaved_1f1b", pp_virtual_stages=0)
