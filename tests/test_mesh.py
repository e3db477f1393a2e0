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


# ----------------------------------------------------------------------------- tensor parallelism, composed
TP_STEPS, TP_BATCH, SEQ_LEN = 4, 8, 8


def _gpt_cfg():
    from phalanx.demo import GPTConfig

    return GPTConfig(vocab_size=32, block_size=SEQ_LEN, n_layer=2, n_head=4, n_embd=16, dropout=0.0)


def _gpt_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 32, (n, SEQ_LEN), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _gpt_reference(opt: str = "sgd", max_norm: float | None = None, steps: int = TP_STEPS) -> dict:
    from phalanx.demo import TinyGPT

    torch.manual_seed(100)
    model = TinyGPT(_gpt_cfg())
    optimizer = _make_opt(opt, model)
    x, y = _gpt_data(steps * TP_BATCH)
    order = global_order(len(x), 0, 0)
    losses, norms = [], []
    for step in range(steps):
        idx = order[step * TP_BATCH : (step + 1) * TP_BATCH]
        loss = F.cross_entropy(model(x[idx]).flatten(0, 1), y[idx].flatten())
        loss.backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _make_opt(opt: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum: Adam would turn the roundoff in gradients that are zero in exact arithmetic (the key bias:
    # softmax ignores a constant added to every key) into lr-sized steps, and compare noise.
    if opt == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _gpt_run(
    strategy: str, options: dict, opt: str = "sgd", max_norm: float | None = None, extra_forward: bool = False
) -> dict:
    from phalanx.demo import TinyGPT

    engine = phalanx.Engine(strategy=strategy, seed=0, **options)
    torch.manual_seed(100)
    model = TinyGPT(_gpt_cfg())
    optimizer = _make_opt(opt, model)
    x, y = _gpt_data(TP_STEPS * TP_BATCH)
    loader = DataLoader(TensorDataset(x, y), batch_size=TP_BATCH // engine.topology.dp_size, shuffle=True)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    losses, norms = [], []

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())

    for xb, yb in loader:
        if engine.strategy.drives_backward:
            loss = engine.train_step((xb, yb), loss_fn)
        else:
            loss = loss_fn(model, (xb, yb))
            engine.backward(loss)
            if max_norm is not None:
                norms.append(float(engine.clip_grad_norm_(max_norm)))
            if extra_forward:  # a forward with no backward before the step (a metric in train mode) changes nothing
                model(xb).sum()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(engine.reduce(loss, "mean").item())
    if options.get("sequence_parallel"):  # the replicated gradients were summed once per step, not per use
        assert engine._tp.deferred is not None and not engine._tp.deferred  # every one summed by the last step
    return {"losses": losses, "norms": norms, "state": _full_state(engine, model), "rank": engine.rank}


def _full_state(engine, model) -> dict:
    """The whole state dict: under tp, get_state_dict gathers each split tensor over the tp group."""
    return engine.get_state_dict(model)


def _check_against(results: list[dict], ref: dict, what: str) -> None:
    for res in results:
        where = f"{what}, rank {res['rank']}"
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), **TOL, msg=where)
        if ref["norms"]:
            torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref["norms"]), **TOL, msg=where)
        assert set(res["state"]) == set(ref["state"]), where
        for k, v in ref["state"].items():
            torch.testing.assert_close(res["state"][k], v, **TOL, msg=f"{k}, {where}")


def test_tp2_with_ddp_matches_single_process(run_ranks):
    results = run_ranks(_gpt_run, 2, "ddp", {"tp_size": 2})
    _check_against(results, _gpt_reference(), "tp2")


@pytest.mark.parametrize(
    ("strategy", "options", "world"),
    [
        ("ddp", {"tp_size": 4}, 4),
        ("ddp", {"tp_size": 2}, 4),
        ("zero1", {"tp_size": 2}, 4),
        ("zero2", {"tp_size": 2}, 4),
        ("zero3", {"tp_size": 2}, 4),
        ("zero3", {"tp_size": 2, "sequence_parallel": True}, 4),
        ("ddp", {"tp_size": 2, "sequence_parallel": True}, 2),
        ("zero1", {"tp_size": 2, "sequence_parallel": True}, 4),
        ("zero3", {"tp_size": 2, "dp_replicate_size": 2, "sequence_parallel": True}, 8),
    ],
    ids=[
        "tp4",
        "tp2xddp2",
        "tp2xzero1",
        "tp2xzero2",
        "tp2xzero3",
        "tp2xzero3-sp",
        "tp2-sp",
        "tp2xzero1-sp",
        "tp2xhybrid-zero3-2x2-sp-8-ranks",
    ],  # fmt: skip
)
def test_tensor_parallel_composes_with_data_parallel(run_ranks, strategy, options, world):
    results = run_ranks(_gpt_run, world, strategy, options, "sgd", 0.05)
    ref = _gpt_reference("sgd", 0.05)
    assert min(ref["norms"]) > 0.05  # clipping is active at every step: clip_grad_norm_ returns the 1-process norm
    _check_against(results, ref, f"{strategy} {options}")


def test_a_forward_without_backward_before_the_step_does_not_sum_twice(run_ranks):
    results = run_ranks(_gpt_run, 2, "ddp", {"tp_size": 2, "sequence_parallel": True}, "sgd", 0.05, True)
    _check_against(results, _gpt_reference("sgd", 0.05), "tp2 sp, an extra forward before each step")


def _pipe_cfg():
    from phalanx.demo import GPTConfig

    return GPTConfig(vocab_size=32, block_size=SEQ_LEN, n_layer=2, n_head=2, n_embd=8, dropout=0.0)


PIPE_PLAN = {
    "0.tok": "embedding_rowwise",
    "*.qkv": "packed_colwise(packed=3, heads=2)",
    "*.proj": "rowwise(heads=2)",
    "*.mlp.0": "colwise",
    "*.mlp.2": "rowwise",
    "3.head": "colwise_gather_output",
}


def _pipe_blocks():
    from phalanx.demo import TinyGPT

    torch.manual_seed(100)
    return TinyGPT(_pipe_cfg()).pipeline_blocks()


def _pipe_reference(steps: int) -> dict:
    model = _pipe_blocks()
    optimizer = _make_opt("sgd", model)
    x, y = _gpt_data(steps * TP_BATCH)
    order = global_order(len(x), 0, 0)
    losses = []
    for step in range(steps):
        idx = order[step * TP_BATCH : (step + 1) * TP_BATCH]
        loss = F.cross_entropy(model(x[idx]).flatten(0, 1), y[idx].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": [], "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _pipe_run(options: dict, steps: int) -> dict:
    plan = {**PIPE_PLAN, "0.pos": "sequence_parallel"} if options.get("sequence_parallel") else PIPE_PLAN
    engine = phalanx.Engine(strategy="pipeline", seed=0, pp_microbatches=2, tp_plan=plan, **options)
    model = _pipe_blocks()
    optimizer = _make_opt("sgd", model)
    x, y = _gpt_data(steps * TP_BATCH)
    loader = DataLoader(TensorDataset(x, y), batch_size=TP_BATCH // engine.topology.dp_size, shuffle=True)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    losses = []
    for xb, yb in loader:
        loss = engine.train_step((xb, yb), lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten()))
        losses.append(engine.reduce(loss, "mean").item())
    return {"losses": losses, "state": _full_state(engine, model), "rank": engine.rank}


def test_pipeline_with_tensor_parallelism_pp2_tp2(run_ranks):
    results = run_ranks(_pipe_run, 4, {"pp_size": 2, "tp_size": 2}, TP_STEPS)
    _check_against(results, _pipe_reference(TP_STEPS), "pp2 x tp2")


def test_pipeline_with_sequence_parallelism_pp2_tp2(run_ranks):
    results = run_ranks(_pipe_run, 4, {"pp_size": 2, "tp_size": 2, "sequence_parallel": True}, TP_STEPS)
    _check_against(results, _pipe_reference(TP_STEPS), "pp2 x tp2, sp")


def test_pipeline_data_and_tensor_parallelism_pp2_dp2_tp2_on_8_ranks(run_ranks):
    results = run_ranks(_pipe_run, 8, {"pp_size": 2, "tp_size": 2}, 2)
    _check_against(results, _pipe_reference(2), "pp2 x dp2 x tp2")


# ------------------------------------------------------------------------- tp2 x dp2: the details stay correct
def _replicated_grads_and_overflow() -> dict:
    """tp2 x ddp2: replicated parameters' gradients after one backward; then an fp16 overflow on one rank only."""
    from phalanx.demo import TinyGPT

    engine = phalanx.Engine(strategy="ddp", seed=0, tp_size=2, precision="fp16-mixed")
    torch.manual_seed(100)
    model = TinyGPT(_gpt_cfg())
    optimizer = _make_opt("sgd", model)
    model, optimizer = engine.prepare(model, optimizer)
    x, y = _gpt_data(TP_BATCH)
    half = TP_BATCH // 2
    rows = slice(engine.topology.dp_rank * half, (engine.topology.dp_rank + 1) * half)
    engine.backward(F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten()))
    unwrapped = engine.unwrap_model(model)
    replicated = {n: p.grad.clone() for n, p in unwrapped.named_parameters() if p._phalanx_tp.dim is None}
    optimizer.step()
    optimizer.zero_grad()
    first_skipped = engine.step_was_skipped
    before = {n: p.detach().clone() for n, p in unwrapped.named_parameters()}
    engine.backward(F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten()))
    if engine.rank == 1:  # tp rank 1 of the first replica: one element of one split parameter overflows
        unwrapped.blocks[0].mlp[0].weight.grad.view(-1)[3] = float("inf")
    optimizer.step()
    unchanged = all(torch.equal(before[n], p.detach()) for n, p in unwrapped.named_parameters())
    return {
        "replicated": replicated,
        "tp_rank": engine.topology.tp_rank,
        "first_skipped": first_skipped,
        "skipped": engine.step_was_skipped,
        "unchanged": unchanged,
    }


def test_tp2xdp2_replicated_grads_agree_and_an_overflow_on_one_tp_rank_skips_everywhere(run_ranks):
    results = run_ranks(_replicated_grads_and_overflow, 4)
    assert [r["tp_rank"] for r in results] == [0, 1, 0, 1]
    # norms, biases of row-parallel layers, the position embedding: the same gradient on every tp rank
    assert {"ln_f.weight", "blocks.0.proj.bias", "pos.weight"} <= set(results[0]["replicated"])
    for a, b in ((0, 1), (2, 3)):
        for name, g in results[a]["replicated"].items():
            assert torch.equal(g, results[b]["replicated"][name]), name
    assert not any(r["first_skipped"] for r in results)
    assert all(r["skipped"] and r["unchanged"] for r in results)  # rank 1's inf skipped the step on all four


def _accumulate_items(world_options: dict) -> dict:
    from phalanx.demo import TinyGPT

    engine = phalanx.Engine(strategy="zero2", seed=0, grad_accum_steps=2, **world_options)
    torch.manual_seed(100)
    model = TinyGPT(_gpt_cfg())
    optimizer = _make_opt("sgd", model)
    x, y = _masked_data()
    loader = DataLoader(TensorDataset(x, y), batch_size=TP_BATCH // 2 // engine.topology.dp_size, shuffle=True)
    model, optimizer, loader = engine.prepare(model, optimizer, loader)
    for xb, yb in loader:
        with engine.accumulate():
            loss_sum = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten(), reduction="sum", ignore_index=-100)
            engine.backward(loss_sum, items=(yb != -100).sum())
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": [], "norms": [], "state": _full_state(engine, model), "rank": engine.rank}


def _masked_data() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _gpt_data(TP_STEPS * TP_BATCH)
    g = torch.Generator().manual_seed(3)
    y = y.masked_fill(torch.rand(y.shape, generator=g) < 0.4, -100)  # uneven token counts per micro-batch and rank
    return x, y


def test_tp2xdp2_accumulation_with_items_matches_single_process(run_ranks):
    from phalanx.demo import TinyGPT

    results = run_ranks(_accumulate_items, 4, {"tp_size": 2})
    torch.manual_seed(100)
    model = TinyGPT(_gpt_cfg())
    optimizer = _make_opt("sgd", model)
    x, y = _masked_data()
    order = global_order(len(x), 0, 0)
    for step in range(TP_STEPS):
        idx = order[step * TP_BATCH : (step + 1) * TP_BATCH]
        loss = F.cross_entropy(model(x[idx]).flatten(0, 1), y[idx].flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ref = {"losses": [], "norms": [], "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    _check_against(results, ref, "tp2 x zero2, accumulation with items=")


def _dropout_run() -> dict:
    from phalanx.demo import GPTConfig, TinyGPT

    engine = phalanx.Engine(strategy="ddp", seed=0, tp_size=2)
    torch.manual_seed(100)
    model = TinyGPT(GPTConfig(vocab_size=32, block_size=SEQ_LEN, n_layer=2, n_head=4, n_embd=16, dropout=0.2))
    optimizer = _make_opt("sgd", model)
    model, optimizer = engine.prepare(model, optimizer)
    x, y = _gpt_data(TP_BATCH)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": _full_state(engine, model)}


def test_dropout_under_tp2_is_reproducible(run_ranks):
    first, second = run_ranks(_dropout_run, 2), run_ranks(_dropout_run, 2)
    for a, b in zip(first, second):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
    assert first[0]["losses"] == first[1]["losses"]  # the tp ranks compute one model's loss
    assert len(set(first[0]["losses"])) == 3  # and it trains


def _dropout_resume(directory: str, resume: bool) -> dict:
    """tp2 with dropout: 4 straight steps saving after step 2, or a resume from that save for steps 3 and 4."""
    from phalanx.demo import GPTConfig, TinyGPT

    engine = phalanx.Engine(strategy="ddp", seed=0, tp_size=2)
    torch.manual_seed(100)
    model = TinyGPT(GPTConfig(vocab_size=32, block_size=SEQ_LEN, n_layer=2, n_head=4, n_embd=16, dropout=0.2))
    optimizer = _make_opt("sgd", model)
    model, optimizer = engine.prepare(model, optimizer)
    if resume:
        engine.load_state(directory)
    x, y = _gpt_data(TP_BATCH)
    losses = []
    for step in range(2 if resume else 0, 4):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == 1 and not resume:
            engine.save_state(directory)
    return {"losses": losses, "state": engine.get_state_dict(model)}


def test_resume_under_tp2_with_dropout_continues_bitwise(run_ranks, tmp_path):
    straight = run_ranks(_dropout_resume, 2, str(tmp_path / "ck"), False)
    resumed = run_ranks(_dropout_resume, 2, str(tmp_path / "ck"), True)
    for a, b in zip(straight, resumed):
        assert a["losses"][2:] == b["losses"]  # the dropout masks of steps 3 and 4 are drawn again, the same
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


# ---------------------------------------------------------------- the front door: Accelerate's ParallelismConfig
def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(100)
    return transformers.LlamaForCausalLM(cfg)


def _llama_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 64, (4, 12), generator=g) for _ in range(3)]


def _llama_accelerate(use_peer_class: bool) -> dict:
    """A transformers Llama with no plan written by the user, trained through phalanx.accelerate at tp2."""
    if use_peer_class:
        from accelerate.parallelism_config import ParallelismConfig
    else:
        from phalanx.accelerate import ParallelismConfig
    from phalanx.accelerate import Accelerator

    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    model = _llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for ids in _llama_batches():
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "norms": [],
        "state": accelerator.get_state_dict(model),
        "rank": accelerator.process_index,
    }


def test_a_transformers_model_gets_tp_from_its_own_plan_through_accelerate(run_ranks):
    use_peer = pytest.importorskip("accelerate", reason="the peer's ParallelismConfig") is not None
    results = run_ranks(_llama_accelerate, 2, use_peer)
    model = _llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for ids in _llama_batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    ref = {"losses": losses, "norms": [], "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    _check_against(results, ref, "Llama tp2 through phalanx.accelerate")


def test_parallelism_config_maps_the_mesh_and_refuses_what_cannot_be():
    from phalanx.accelerate import ParallelismConfig
    from phalanx.compat.accelerate.utils import parallelism_options

    assert parallelism_options(ParallelismConfig(dp_replicate_size=2, tp_size=2)) == {
        "dp_replicate_size": 2, "tp_size": 2,
    }  # fmt: skip
    assert parallelism_options(ParallelismConfig(cp_size=2)) == {"cp_size": 2}
    with pytest.raises(ValueError, match=r"cp_size=2 and ParallelismConfig.sp_size=2 both split the sequence"):
        parallelism_options(ParallelismConfig(cp_size=2, sp_size=2))
    with pytest.raises(ValueError, match=r"tp_size must be a whole number of at least 1; got 0"):
        parallelism_options(ParallelismConfig(tp_size=0))


def test_phalanx_config_prints_the_mesh_and_every_rank(capsys):
    from phalanx.launch.cli import main

    assert main(["config", "-n", "8", "--strategy", "zero3", "--tp-size", "2", "--dp-replicate-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "mesh (pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=2) on 8 ranks; tp innermost" in out
    assert "rank 5: pp=0 dp_replicate=1 dp_shard=0 cp=0 tp=1" in out
    assert main(["config", "-n", "6", "--tp-size", "4"]) == 2
    err = capsys.readouterr().err
    assert (
        "pp x dp_replicate x dp_shard x cp x tp = 4 does not divide the world; tp_size=4 (cli)" in err
        and "world size 6" in err
    )


def _checkpoint_side(strategy: str, options: dict, directory: str, save: bool) -> dict:
    """Train two steps and save_state (save=True), or load_state into a fresh model; the whole state dict."""
    from phalanx.demo import TinyGPT

    engine = phalanx.Engine(strategy=strategy, seed=0, **options)
    torch.manual_seed(100)
    model = TinyGPT(_gpt_cfg())
    model, optimizer = engine.prepare(model, _make_opt("sgd", model))
    if save:
        x, y = _gpt_data(TP_BATCH)
        for _ in range(2):
            engine.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
            optimizer.step()
            optimizer.zero_grad()
        engine.save_state(directory)
    else:
        engine.load_state(directory)
    return engine.get_state_dict(model)


@pytest.mark.parametrize(
    ("saver", "world"),
    [(("zero3", {"tp_size": 2}), 4), (("zero3", {"tp_size": 2, "dp_replicate_size": 2}), 8)],
    ids=["tp2xzero3", "tp2xhybrid-zero3"],
)
def test_a_zero3_checkpoint_under_tp_loads_whole_on_another_layout(run_ranks, tmp_path, saver, world):
    saved = run_ranks(_checkpoint_side, world, saver[0], saver[1], str(tmp_path / "ck"), True)
    loaded = run_ranks(_checkpoint_side, 2, "ddp", {}, str(tmp_path / "ck"), False)
    for state in (*saved, *loaded):
        assert set(state) == set(saved[0])
        assert all(torch.equal(state[k], saved[0][k]) for k in state)
