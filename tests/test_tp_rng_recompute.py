"""Tensor parallelism with dropout under activation checkpointing: the recompute of a forked region (attention on
this rank's heads) must draw the masks the forward drew, so that a checkpointed run ends bit for bit where the run
without checkpointing ends (issue 36, W1).

Each run trains a few SGD steps under the Engine and compares every whole parameter with ``torch.equal``: tp2 alone
(the demo GPT's blocks, and a transformers Llama with ``gradient_checkpointing_enable()``), zero3 over dp2 x tp2, and
the pipeline over pp2 x tp2. Checkpointing runs both ways, non-reentrant (transformers' default) and reentrant. The
tracker alone is checked in one process too: a fork nested in a fork, a checkpointed region that starts inside a
fork, and a stream resumed from torch's RNG state.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import phalanx
from phalanx.demo import GPTConfig, _Block, _Embed, _Head
from phalanx.strategies.tensor_parallel import TPRngTracker

STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 32
MODES = (None, "non-reentrant", "reentrant")
GPT_PLAN = {
    "*.block.qkv": "packed_colwise(packed=3, heads=4)",
    "*.block.proj": "rowwise(heads=4)",
    "*.block.mlp.0": "colwise",
    "*.block.mlp.2": "rowwise",
}


# ------------------------------------------------------------------------------- the tracker, in one process
def _region(tracker: TPRngTracker, x: torch.Tensor, w: torch.Tensor, nested: bool) -> torch.Tensor:
    """Dropout on this rank's stream (twice with ``nested``: a fork inside a fork), then on the replicated one."""
    with tracker.fork():
        y = F.dropout(x * w, 0.5)
        if nested:
            with tracker.fork():
                y = F.dropout(y, 0.5)
    return F.dropout(y, 0.5)


def _grad(tracker: TPRngTracker, mode: str | None, nested: bool, inside: bool = False) -> torch.Tensor:
    """``w``'s gradient after two steps of ``_region``, checkpointed as ``mode`` says; ``inside``: the checkpointed
    region (with its fork) runs inside an outer fork, so that the recompute forks anew, outside any fork."""
    torch.manual_seed(1)
    w = torch.ones(64, requires_grad=True)
    x = torch.randn(64, requires_grad=True)
    for _ in range(2):  # the second step forks from where the first left the generator
        with tracker.fork() if inside else contextlib.nullcontext():
            if mode is None:
                out = _region(tracker, x, w, nested)
            else:
                out = checkpoint(_region, tracker, x, w, nested, use_reentrant=mode == "reentrant")
        (out * torch.arange(64.0)).sum().backward()
    assert w.grad is not None
    return w.grad


def test_recompute_draws_the_forwards_masks_in_one_process():
    tracker = TPRngTracker(seed=5, tp_rank=1)
    for nested, inside in [(False, False), (True, False), (False, True)]:
        plain = _grad(tracker, None, nested, inside)
        assert (plain == 0).any()  # dropout did drop
        for mode in MODES[1:]:
            assert torch.equal(_grad(tracker, mode, nested, inside), plain), (mode, nested, inside)


def test_streams_differ_by_rank_and_by_fork_and_leave_the_default_alike():
    torch.manual_seed(3)
    start = torch.get_rng_state()
    draws, after = [], []
    for rank in (0, 1):
        torch.set_rng_state(start)
        tracker = TPRngTracker(seed=5, tp_rank=rank)
        for _ in range(2):
            with tracker.fork():
                draws.append(torch.rand(16))
        after.append(torch.get_rng_state())
    first0, second0, first1, _ = draws
    assert not torch.equal(first0, second0)  # successive forks: other masks
    assert not torch.equal(first0, first1)  # each rank its own stream
    assert torch.equal(after[0], after[1])  # the replicated stream stays in step over the tp ranks
    # The stream resumes with torch's RNG state (which a checkpoint saves): the tracker holds only its seed.
    state = tracker.state_dict()
    assert state == {"seed": 5, "tp_rank": 1, "states": {}}
    torch.set_rng_state(start)
    resumed = TPRngTracker(seed=0, tp_rank=1)
    resumed.load_state_dict(state)
    with resumed.fork():
        assert torch.equal(torch.rand(16), first1)


# ------------------------------------------------------------------------------- through the Engine
class _Checkpointed(nn.Module):
    """A demo GPT block (forked under tp: it computes on this rank's heads, with attention dropout), checkpointed
    from outside as transformers checkpoints a decoder layer around its attention, and followed inside the
    checkpointed region by a dropout on the replicated residual stream."""

    def __init__(self, cfg: GPTConfig, mode: str | None) -> None:
        super().__init__()
        self.block = _Block(cfg)
        self.drop = nn.Dropout(0.1)
        self.mode = mode

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.block(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode is None:
            return self._run(x)
        out: torch.Tensor = checkpoint(self._run, x, use_reentrant=self.mode == "reentrant")
        return out


def _gpt(mode: str | None) -> nn.Sequential:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=32, dropout=0.2)
    tok, pos = nn.Embedding(VOCAB, cfg.n_embd), nn.Embedding(SEQ, cfg.n_embd)
    blocks = [_Checkpointed(cfg, mode) for _ in range(cfg.n_layer)]
    return nn.Sequential(_Embed(tok, pos), *blocks, _Head(nn.LayerNorm(cfg.n_embd), nn.Linear(cfg.n_embd, VOCAB)))


def _ids(step: int, dp_rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 * step + dp_rank))


def _gpt_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def _train_gpt(strategy: str, options: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]] | None:
    """The whole weights after STEPS steps, for each checkpointing mode (on the first rank)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for mode in MODES:
        engine = phalanx.Engine(strategy=strategy, seed=0, tp_plan=GPT_PLAN, **options)
        model = _gpt(mode)
        model, opt = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
        assert engine._tp.reports[0].forked == [f"{i}.block" for i in range(1, 5)]  # the blocks draw per rank
        for step in range(STEPS):
            ids = _ids(step, engine.topology.dp_rank)
            if strategy == "pipeline":
                engine.train_step(ids, _gpt_loss)
            else:
                engine.backward(_gpt_loss(model, ids))
                opt.step()
                opt.zero_grad()
        out[str(mode)] = engine.get_state_dict(model)
    return out if engine.topology.rank == 0 else None


def _max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _assert_all_equal(runs: dict[str, dict[str, torch.Tensor]]) -> None:
    plain = runs["None"]
    failures = []
    for mode in MODES[1:]:
        ckpt = runs[str(mode)]
        assert ckpt.keys() == plain.keys()
        differ = [k for k in plain if not torch.equal(ckpt[k], plain[k])]
        if differ:
            failures.append(
                f"{mode}: {len(differ)} of {len(plain)} tensors differ, by up to {_max_gap(ckpt, plain):.3g}"
            )
    assert not failures, "checkpointed runs end elsewhere than the plain run: " + "; ".join(failures)


def test_tp2_checkpointed_equals_plain_bitwise(run_ranks):
    _assert_all_equal(run_ranks(_train_gpt, 2, "ddp", {"tp_size": 2})[0])


def test_zero3_tp2_checkpointed_equals_plain_bitwise(run_ranks):
    _assert_all_equal(run_ranks(_train_gpt, 4, "zero3", {"tp_size": 2})[0])


def test_pipeline_pp2_tp2_checkpointed_equals_plain_bitwise(run_ranks):
    _assert_all_equal(run_ranks(_train_gpt, 4, "pipeline", {"pp_size": 2, "tp_size": 2})[0])


# ------------------------------------------------------------------ the reported case: a transformers Llama
def _train_llama() -> dict[str, dict[str, torch.Tensor]] | None:
    from transformers import LlamaConfig, LlamaForCausalLM

    out: dict[str, dict[str, torch.Tensor]] = {}
    for mode in MODES:
        engine = phalanx.Engine(strategy="ddp", seed=0, tp_size=2)
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            attention_dropout=0.1,
            use_cache=False,
        )
        model = LlamaForCausalLM(cfg)
        if mode is not None:
            model.gradient_checkpointing_enable({"use_reentrant": mode == "reentrant"})
        model, opt = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
        assert "model.layers.0.self_attn" in engine._tp.reports[0].forked
        for step in range(STEPS):
            ids = _ids(step, engine.topology.dp_rank)
            logits = model(input_ids=ids[:, :-1]).logits
            engine.backward(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()))
            opt.step()
            opt.zero_grad()
        out[str(mode)] = engine.get_state_dict(model)
    return out if engine.topology.rank == 0 else None


def test_transformers_llama_gradient_checkpointing_equals_plain_bitwise(run_ranks):
    _assert_all_equal(run_ranks(_train_llama, 2)[0])
