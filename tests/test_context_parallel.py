"""Context parallelism through the Engine, against one process on whole sequences (fp32, dropout off, 1e-5).

The user's loop is unchanged: ``loss = model(**batch).loss; engine.backward(loss)`` over a prepared loader, which
cuts every sequence over the cp ranks (ring: zig-zag chunks; Ulysses: slices), shifts the labels over the whole
sequence and adds global ``position_ids``. Two models: a transformers Llama (SDPA, grouped-query attention: 4 query
heads, 2 kv heads) with right padding in one row, and the demo GPT (its SDPA calls caught during forward) with
``(input_ids, targets)`` batches. Each run trains a few SGD steps; every whole parameter must match one process's
within 1e-5, and so must the whole-sequence loss computed from the ranks' pieces.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx

STEPS, BATCH, SEQ, VOCAB = 2, 4, 16, 64
TOL = 1e-5


# ---------------------------------------------------------------------------------- models and data
def llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, attn_implementation="sdpa",
        use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def gpt(seed: int = 0) -> nn.Module:
    from phalanx.demo import GPTConfig, TinyGPT

    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32))


def samples(model: str, seq: int = SEQ, pad: bool = True) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(STEPS * BATCH):
        ids = torch.randint(0, VOCAB, (seq + 1,), generator=g)
        if model == "gpt":
            out.append({"input_ids": ids[:-1], "targets": ids[1:]})
            continue
        mask = torch.ones(seq, dtype=torch.long)
        if pad and i % BATCH == 1:  # right padding: the last 5 tokens of one row are not real
            mask[-5:] = 0
        labels = ids[:-1].masked_fill(mask == 0, -100)
        out.append({"input_ids": ids[:-1], "attention_mask": mask, "labels": labels})
    return out


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "targets" in batch:
        logits = model(batch["input_ids"], position_ids=batch.get("position_ids"))
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    return model(**batch).loss


def reference(
    name: str, seq: int = SEQ, pad: bool = True, bf16: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = llama() if name == "llama" else gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = samples(name, seq, pad)
    losses = []
    for step in range(STEPS):
        batch = torch.utils.data.default_collate(data[step * BATCH : (step + 1) * BATCH])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(model, batch).float()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(name: str, options: dict[str, Any], seq: int = SEQ, pad: bool = True, items: bool = False) -> dict[str, Any]:
    engine = phalanx.Engine(**options)
    model = llama() if name == "llama" else gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(samples(name, seq, pad), batch_size=BATCH // engine.topology.data_size)
    model, opt, loader = engine.prepare(model, opt, loader)
    losses = []
    for batch in loader:
        loss = loss_of(model, batch)
        if items:  # the items contract: this rank's sum and target count, summed over dp x cp by the engine
            n = (batch["shift_labels"] != -100).sum()
            engine.backward(loss * n, items=n)
        else:
            engine.backward(loss)
        opt.step()
        opt.zero_grad()
        weight = engine.context_parallel.weight() if engine.context_parallel is not None else None
        # the whole sequence's mean: this rank's mean weighed by its share of the targets, averaged over dp x cp
        losses.append(engine.reduce(loss.detach() * (weight if weight is not None else 1.0), "mean").item())
    state = {k: v.detach().clone() for k, v in engine.get_state_dict(model).items()}
    t = engine.topology
    groups = {"data": (t.data_rank, t.data_size), "shard": t.dp_shard_size, "dp": t.dp_size}
    return {"losses": losses, "state": state, "rank": engine.rank, "groups": groups}


def check(results: list[dict[str, Any]], name: str, seq: int = SEQ, pad: bool = True, losses: bool = True) -> None:
    expected, state = reference(name, seq, pad)
    for r in results:
        if losses:
            assert r["losses"] == pytest.approx(expected, abs=TOL), (r["rank"], r["losses"], expected)
        assert state.keys() == r["state"].keys()
        for k, v in state.items():
            torch.testing.assert_close(r["state"][k], v, atol=TOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


# ---------------------------------------------------------------------------------- cp and sp alone
@pytest.mark.parametrize("name", ["llama", "gpt"])
@pytest.mark.parametrize(("key", "size"), [("cp_size", 2), ("cp_size", 4), ("sp_size", 2), ("sp_size", 4)])
def test_context_parallel_matches_one_process(run_ranks, name, key, size):
    # The Llama at cp2 gets 14 tokens: padded to 16 for cp2's 4 chunks (ignored labels, masked keys) by the loader.
    seq = 14 if (name, key, size) == ("llama", "cp_size", 2) else SEQ
    check(run_ranks(run, size, name, {key: size}, seq), name, seq)


# ---------------------------------------------------------------------------------- composed on the mesh
@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("gpt", {"strategy": "zero3", "cp_size": 2}),  # zero3 over dp2 x cp2: shards over all four ranks
        ("llama", {"strategy": "zero3", "cp_size": 2}),
        ("gpt", {"strategy": "ddp", "cp_size": 2, "tp_size": 2}),
        ("llama", {"strategy": "ddp", "cp_size": 2, "tp_size": 2}),
        # Megatron sp under tp: the demo GPT only (a transformers model is refused it with or without cp)
        ("gpt", {"strategy": "ddp", "cp_size": 2, "tp_size": 2, "sequence_parallel": True}),
    ],
    ids=["gpt-cp2-zero3-dp2", "llama-cp2-zero3-dp2", "gpt-cp2-tp2", "llama-cp2-tp2", "gpt-cp2-tp2-sp"],
)
def test_context_parallel_composes_on_four_ranks(run_ranks, name, options):
    # Over dp2 the Llama's padding falls on one data rank: a mean loss per rank (DDP's contract) would weigh the
    # two ranks alike, so its runs use the items contract, exact over dp x cp (their logged losses are per rank).
    items = name == "llama" and options["strategy"] == "zero3"
    results = run_ranks(run, 4, name, options, SEQ, True, items)
    check(results, name, losses=not items)
    if options["strategy"] == "zero3":  # cp ranks read the same batches; zero3 shards over dp_shard x cp
        assert [r["groups"]["data"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
        assert all(r["groups"]["shard"] == 4 and r["groups"]["dp"] == 4 for r in results)


# ---------------------------------------------------------------------------------- what is refused
def _refused(options: dict[str, Any]) -> dict[str, str]:
    engine = phalanx.Engine(**options)
    model = engine.prepare(gpt())
    ids = torch.randint(0, VOCAB, (2, SEQ))
    out = {}

    def attempt(what: str, call: Any) -> None:
        try:
            call()
            out[what] = "no error"
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[what] = f"{type(e).__name__}: {e}"

    attempt("uncut", lambda: model(ids))  # a whole sequence fed to the model without the prepared loader's cut
    loader = torch.utils.data.DataLoader([{"input_ids": ids[0], "attention_mask": torch.ones(SEQ, SEQ)}], batch_size=1)
    attempt("mask", lambda: next(iter(engine.prepare(loader))))  # arbitrary masks: document masking
    return out


def test_an_uncut_batch_and_document_masks_are_refused_with_the_reason(run_ranks):
    msg = run_ranks(_refused, 2, {"cp_size": 2})[0]
    assert "ran before any batch was cut" in msg["uncut"] and "prepared by engine.prepare" in msg["uncut"]
    assert "Arbitrary masks, such as document masks" in msg["mask"] and "(1, 16, 16)" in msg["mask"]


# ---------------------------------------------------------------------------------- cp x pp
def _pipe_data(ignore: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    y = ids[:, 1:].clone()
    if ignore:  # the last 6 targets of every other row are ignored: cp2's chunks hold unequal counts
        y[::2, -6:] = -100
    return ids[:, :-1], y


def _pipe_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())


def _pipe_loss_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    loss = F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten(), reduction="sum")
    return loss, (batch[1] != -100).sum()


def _pipe_run(options: dict[str, Any], ignore: bool = False, sums: bool = False) -> dict[str, Any]:
    engine = phalanx.Engine(strategy="pipeline", pp_microbatches=2, **options)
    model = gpt().pipeline_blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _pipe_data(ignore)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    model, opt, loader = engine.prepare(model, opt, loader)
    try:
        losses = [
            engine.reduce(engine.train_step(batch, _pipe_loss_sum if sums else _pipe_loss), "mean").item()
            for batch in loader
        ]
    except Exception as e:  # noqa: BLE001 - the message is the result
        return {"error": str(e)}
    state = {k: v.detach().clone() for k, v in engine.get_state_dict(model).items()}
    return {"losses": losses, "state": state, "rank": engine.rank}


@pytest.mark.parametrize("ignore", [False, True], ids=["mean", "ignored-targets-as-sums"])
def test_context_parallel_inside_pipeline_stages_pp2_cp2(run_ranks, ignore):
    results = run_ranks(_pipe_run, 4, {"pp_size": 2, "cp_size": 2}, ignore, ignore)
    model = gpt().pipeline_blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _pipe_data(ignore)
    losses = []
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        loss = _pipe_loss(model, (x[rows], y[rows]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for r in results:
        if not ignore:  # with sums, each rank's returned loss is its own chunks' mean; the parameters tell
            assert r["losses"] == pytest.approx(losses, abs=TOL), (r["rank"], r["losses"], losses)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, atol=TOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_pipeline_mean_losses_over_uneven_cp_chunks_are_refused_on_every_stage(run_ranks):
    results = run_ranks(_pipe_run, 4, {"pp_size": 2, "cp_size": 2}, True, False)
    assert all("fall unevenly on the context-parallel ranks" in r["error"] for r in results), results
    assert all("Return (loss_sum, items) from loss_fn" in r["error"] for r in results)


# ---------------------------------------------------------------------------------- checkpoints across layouts
def _checkpoint_side(options: dict[str, Any], directory: str, save: bool) -> dict[str, torch.Tensor]:
    """Train a step and save_state (save=True), or load_state into a fresh model; then one more SGD step on the
    same batch (it reads the optimizer's momentum: SGD's, linear in the gradients, so that 1e-5 stays meaningful;
    AdamW divides near-zero gradients by their own size). Returns the state after loading and after the extra
    step."""
    engine = phalanx.Engine(**options)
    model = gpt(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loader = torch.utils.data.DataLoader(samples("gpt")[:BATCH], batch_size=BATCH // engine.topology.data_size)
    model, opt, loader = engine.prepare(model, opt, loader)

    def step() -> None:
        for batch in loader:
            engine.backward(loss_of(model, batch))
            opt.step()
            opt.zero_grad()

    if save:
        step()
        engine.save_state(directory)
    else:
        engine.load_state(directory)
    out = {f"loaded/{k}": v.clone() for k, v in engine.get_state_dict(model).items()}
    step()
    return {**out, **{f"next/{k}": v for k, v in engine.get_state_dict(model).items()}}


@pytest.mark.parametrize(
    ("saver", "loader"),
    [(({"strategy": "zero3", "cp_size": 2}, 4), ({"strategy": "ddp"}, 2)),
     (({"strategy": "ddp"}, 2), ({"strategy": "zero3", "cp_size": 2}, 4)),
     (({"strategy": "zero2", "sp_size": 2}, 2), ({"strategy": "ddp"}, 1))],
    ids=["zero3-cp2-to-ddp", "ddp-to-zero3-cp2", "zero2-sp2-to-one-process"],
)  # fmt: skip
def test_a_checkpoint_saved_under_cp_loads_on_another_layout_and_back(run_ranks, tmp_path, saver, loader):
    saved = run_ranks(_checkpoint_side, saver[1], saver[0], str(tmp_path / "ck"), True)
    loaded = run_ranks(_checkpoint_side, loader[1], loader[0], str(tmp_path / "ck"), False)
    for state in (*saved, *loaded):
        for k, v in saved[0].items():
            if k.startswith("loaded/"):
                assert torch.equal(state[k], v), k  # what was saved, bit for bit
            else:
                torch.testing.assert_close(state[k], v, atol=TOL, rtol=0)  # the optimizer state came along


# ---------------------------------------------------------------------------------- bf16
def test_bf16_under_cp_is_as_close_to_fp32_as_one_process_in_bf16(run_ranks):
    """bf16-mixed keeps fp32 weights and computes in bf16 (unit roundoff 2^-8 = 3.9e-3). The ring merges its
    blocks in fp32, so cp changes where bf16 rounding happens, not how much: after two steps each parameter's
    distance from the fp32 run must stay within twice one bf16 process's distance, plus one bf16 unit of the
    update size (lr 0.5 x a gradient of order 1e-2: 2e-5)."""
    _, exact = reference("llama")
    _, one = reference("llama", bf16=True)  # one process under bf16 autocast, as bf16-mixed runs
    cp = run_ranks(run, 2, "llama", {"precision": "bf16-mixed", "cp_size": 2})[0]["state"]
    worst_one = max((one[k] - v).abs().max().item() for k, v in exact.items())
    worst_cp = max((cp[k] - v).abs().max().item() for k, v in exact.items())
    assert 0 < worst_one < 1e-2 and worst_cp <= 2 * worst_one + 2e-5, (worst_one, worst_cp)
