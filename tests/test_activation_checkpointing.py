"""Activation checkpointing and offloading in the Engine (issue 39, item 3): ``activation_checkpointing`` full,
every:k and selective, ``activation_offload``, and the foreign spellings that map to them.

Every policy must end where the run without checkpointing ends, bit for bit (``torch.equal`` on each step's loss and
on every whole weight after the steps, so on every gradient), under ddp, zero2, zero3, tp2 with sequence parallelism
and dropout, and the pipeline over pp2: one spawn of two ranks trains every (strategy, model, policy) in turn. The same
runs count the forwards of a module inside each block, so that a policy that recomputed nothing would fail; one
process counts the matmuls backward runs (selective recomputes no matmul, full recomputes each one).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tp_common import TinyLlama, TinyLlamaConfig
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import phalanx
from phalanx.config.dialects.deepspeed import from_deepspeed
from phalanx.config.options import ConfigError
from phalanx.config.settings import EngineConfig, resolve_config
from phalanx.demo import GPTConfig, _Block, _Embed, _Head
from phalanx.engine.activation import (
    BlockBytes,
    activation_peak_bytes,
    checkpoint_blocks,
    kept_by_selective,
    measure_block,
    offload_activations,
    offloaded,
)

POLICIES = (None, "full", "every:2", "selective")
STEPS, BATCH, SEQ, VOCAB = 2, 4, 8, 64


# ------------------------------------------------------------------------------------------- the models
def _tiny_llama() -> TinyLlama:
    """Llama-like, with hidden and attention dropout; its blocks (zero3's units) are every child with parameters."""
    torch.manual_seed(0)
    return TinyLlama(TinyLlamaConfig(attention_dropout=0.1, hidden_dropout=0.1))


def _hf_llama() -> nn.Module:
    """A transformers Llama (blocks: its decoder layers), attention dropout on, and use_cache left at its default."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_dropout=0.1,
    )
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def _gpt() -> nn.Sequential:
    """The demo GPT as blocks of an nn.Sequential (the pipeline's form), attention dropout on."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=32, dropout=0.2)
    embed = _Embed(nn.Embedding(VOCAB, cfg.n_embd), nn.Embedding(SEQ, cfg.n_embd))
    return nn.Sequential(embed, *[_Block(cfg) for _ in range(4)], _Head(nn.LayerNorm(cfg.n_embd), nn.Linear(32, VOCAB)))


MODELS = {"tiny_llama": _tiny_llama, "hf_llama": _hf_llama, "gpt": _gpt}
# A module inside each block (never a block itself): its forward runs again when its block is recomputed.
INNER = {"tiny_llama": "layers.{}.mlp", "hf_llama": "model.layers.{}.mlp", "gpt": "{}.mlp"}
LAYERS = {"tiny_llama": [0, 1], "hf_llama": [0, 1, 2], "gpt": [1, 2, 3, 4]}


def _loss(kind: str, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids[:, :-1]).logits if kind == "hf_llama" else model(ids[:, :-1])
    return F.cross_entropy(out.flatten(0, 1), ids[:, 1:].flatten())


# ------------------------------------------------------------------------------------------- the runs
def _train(kind: str, options: dict[str, Any], policy: str | None) -> dict[str, Any]:
    engine = phalanx.Engine(seed=0, activation_checkpointing=policy, **options)
    model = MODELS[kind]()
    calls = {i: 0 for i in LAYERS[kind]}
    for i in LAYERS[kind]:
        # A pre-hook: a recompute stops once it has made what backward reads (the block's end may not run again).
        model.get_submodule(INNER[kind].format(i)).register_forward_pre_hook(
            lambda *_, i=i: calls.__setitem__(i, calls[i] + 1)
        )
    model, optimizer = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(10 * step))
        ids = ids.chunk(engine.topology.data_size)[engine.topology.data_rank]
        if options.get("strategy") == "pipeline":
            losses.append(engine.train_step(ids, lambda m, b: _loss(kind, m, b)))
        else:
            loss = _loss(kind, model, ids)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    state = engine.get_state_dict(model)
    return {"losses": losses, "state": state, "calls": calls}


# TinyLlama's own plan, its head's logits gathered whole (so that the loss is torch's).
TP_PLAN = {**_tiny_llama().tp_plan(), "lm_head": "colwise_gather_output"}
CASES = [
    ("ddp", "tiny_llama", {"strategy": "ddp"}),
    ("zero2", "tiny_llama", {"strategy": "zero2"}),
    ("zero3", "tiny_llama", {"strategy": "zero3"}),
    ("tp2+sp", "tiny_llama", {"strategy": "ddp", "tp_size": 2, "sequence_parallel": True, "tp_plan": TP_PLAN}),
    ("pp2", "gpt", {"strategy": "pipeline", "pp_size": 2, "pp_microbatches": 2}),
    ("ddp", "hf_llama", {"strategy": "ddp"}),
    ("zero3", "hf_llama", {"strategy": "zero3"}),
]


def _train_every_case() -> list[dict[str, Any]] | None:
    out = [_train(kind, options, policy) for _, kind, options in CASES for policy in POLICIES]
    return out if torch.distributed.get_rank() == 0 else None


def _expected_calls(kind: str, options: dict[str, Any], policy: str | None, layer: int) -> int:
    """Forwards of a block's inner module per step: 1, and 1 more when its block is recomputed. The blocks are
    zero3's units, counted over the whole model: every:2 takes the even ones."""
    micro = options.get("pp_microbatches", 1)
    if policy is None:
        return micro
    index = {"tiny_llama": 2 + layer, "hf_llama": layer, "gpt": layer}[kind]  # tiny_llama: embeddings come first
    return micro * (2 if policy != "every:2" or index % 2 == 0 else 1)


def test_every_policy_ends_where_no_checkpointing_ends_bit_for_bit(run_ranks):
    runs = run_ranks(_train_every_case, 2, timeout=300)[0]
    failures = []
    for c, (name, kind, options) in enumerate(CASES):
        plain = runs[c * len(POLICIES)]
        for p, policy in enumerate(POLICIES):
            run = runs[c * len(POLICIES) + p]
            what = f"{name} {kind} {policy}"
            expected = {i: STEPS * _expected_calls(kind, options, policy, i) for i in LAYERS[kind]}
            if kind == "gpt":  # a pipeline rank sees only its stage's blocks: rank 0 holds the first two
                expected = {i: (n if i <= 2 else 0) for i, n in expected.items()}
            if run["calls"] != expected:
                failures.append(f"{what}: forwards of the blocks' inner modules {run['calls']}, expected {expected}")
            if policy is None:
                continue
            if not all(torch.equal(a, b) for a, b in zip(run["losses"], plain["losses"])):
                failures.append(f"{what}: losses {run['losses']} != {plain['losses']}")
            differ = [k for k in plain["state"] if not torch.equal(run["state"][k], plain["state"][k])]
            if differ:
                failures.append(f"{what}: {len(differ)} weights differ, e.g. {differ[0]}")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------------- in one process
class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class _MLP(nn.Module):
    """A block (not a container, which zero3's units look inside)."""

    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _backward_ops(policy: str | None) -> dict[str, int]:
    torch.manual_seed(0)
    model = nn.Sequential(_MLP(), _MLP())
    checkpoint_blocks(model, policy)
    loss = model(torch.randn(8, 16)).square().sum()
    with _CountOps() as ops:
        loss.backward()
    return ops.counts


def test_selective_recomputes_everything_but_the_matmuls_and_full_recomputes_the_matmuls_too():
    plain, full, selective = (_backward_ops(p) for p in (None, "full", "selective"))
    mm = lambda c: c.get("mm", 0) + c.get("addmm", 0)  # noqa: E731
    assert plain.get("gelu", 0) == 0 and mm(plain) > 0
    assert full["gelu"] == selective["gelu"] == 2  # one per block, recomputed
    assert mm(full) > mm(plain)  # the forward's matmuls again (those whose outputs backward reads)
    assert mm(selective) == mm(plain)  # kept, not recomputed


def test_selective_keeps_an_attention_only_when_it_drops_nothing():
    # Kept, a fused attention with dropout would draw no numbers in the recompute, and every later random op there
    # would draw other numbers than the forward did (on the CPU, SDPA with dropout runs its math path instead).
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 2, 4, 8)
    assert kept_by_selective(attention, (q, q, q), {}) and kept_by_selective(attention, (q, q, q, 0.0), {})
    assert not kept_by_selective(attention, (q, q, q, 0.1), {})
    assert not kept_by_selective(attention, (q, q, q), {"dropout_p": 0.1})
    assert kept_by_selective(torch.ops.aten.mm.default, (q, q), {})
    assert not kept_by_selective(torch.ops.aten.gelu.default, (q,), {})


def test_a_checkpointed_block_keeps_only_its_input():
    torch.manual_seed(0)
    model = nn.Sequential(*[_MLP(16, 64) for _ in range(3)])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes: dict[str | None, int] = {}
    saved: list[tuple[str | None, int]] = []
    for policy in (None, "full"):
        checkpoint_blocks(model, policy)

        def pack(t: torch.Tensor, policy: str | None = policy) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                saved.append((policy, t.numel()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(8, 16, requires_grad=True)).sum()
        sizes[policy] = sum(n for p, n in saved if p == policy)
    assert sizes["full"] == 3 * 8 * 16  # each block's input
    assert sizes[None] > 4 * sizes["full"]


def test_state_dict_keys_do_not_change_and_a_second_wrap_is_a_no_op():
    model = _gpt()
    keys = list(model.state_dict())
    checkpoint_blocks(model, "full")
    forward = model[1].forward
    checkpoint_blocks(model, "full")
    assert list(model.state_dict()) == keys and model[1].forward is forward


def test_the_model_s_own_gradient_checkpointing_and_phalanx_s_are_not_both_applied():
    model = _hf_llama()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    with pytest.raises(ConfigError, match="recomputed twice.*gradient_checkpointing_disable"):
        checkpoint_blocks(model, "every:2")


def test_bad_spellings_are_refused_naming_the_value_and_the_accepted_ones():
    for value in ("every:0", "sometimes", "every:", "every:two", True):
        with pytest.raises(ConfigError, match=rf"activation_checkpointing: got {value!r}.*full, every:k"):
            EngineConfig(activation_checkpointing=value)
    assert EngineConfig(activation_checkpointing="every:3").activation_checkpointing == "every:3"


def test_offload_does_nothing_on_the_cpu_and_its_forward_saves_to_the_host():
    model = nn.Linear(4, 4)
    forward = model.forward
    offload_activations(model, True, torch.device("cpu"))
    assert model.forward == forward  # the CPU: nothing to free, only a note (once)
    seen = []

    def inner(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
        return (x * 2).sin().sum()

    x = torch.randn(5, requires_grad=True)
    offloaded(inner, pin_memory=False)(x).backward()
    assert seen == [True] and torch.equal(x.grad, 2 * (2 * x.detach()).cos())


def test_the_predicted_peak_falls_as_each_policy_keeps_less():
    model = _hf_llama()
    ids = torch.randint(0, VOCAB, (2, 16))
    block = measure_block(model.model.layers[0], lambda: model(input_ids=ids))
    assert 0 < block.kept_full < block.kept_selective < block.saved
    peaks = {p: activation_peak_bytes(block, 4, p) for p in POLICIES}
    assert peaks[None] > peaks["every:2"] > peaks["full"] and peaks[None] > peaks["selective"]
    assert peaks[None] == 4 * block.saved + block.shared
    assert peaks["full"] == 3 * block.kept_full + block.saved + block.shared  # the last block recomputed, 3 kept
    assert peaks["selective"] == 3 * block.kept_selective + block.saved + block.shared
    ten = BlockBytes(saved=10, kept_full=1, kept_selective=4)
    assert activation_peak_bytes(ten, 4, "every:2") == 1 + 10 + 1 + 10  # before backward; each recompute fits


# ------------------------------------------------------------------------------------------- the mappings
def test_accelerate_s_fsdp_activation_checkpointing_maps_to_full(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_activation_checkpointing: true\n")
    resolved = resolve_config(file=path, env={})
    assert resolved.engine.activation_checkpointing == "full"
    assert "fsdp_activation_checkpointing" in resolved.origins["activation_checkpointing"]


def test_accelerate_s_plugin_maps_to_full():
    from phalanx.compat.accelerate.utils import FullyShardedDataParallelPlugin, fsdp_plugin_options

    assert fsdp_plugin_options(FullyShardedDataParallelPlugin(activation_checkpointing=True)) == {
        "activation_checkpointing": "full"
    }
    assert fsdp_plugin_options(FullyShardedDataParallelPlugin()) == {}
    from phalanx.compat.accelerate.accelerator import _plugin_options  # what the Accelerator reads from it

    assert _plugin_options(None, FullyShardedDataParallelPlugin(activation_checkpointing=True)) == {
        "strategy": "zero3",
        "activation_checkpointing": "full",
    }


def test_deepspeed_s_block_offloads_with_cpu_checkpointing_and_switches_nothing_on(tmp_path):
    block = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": False,
             "number_checkpoints": 4, "synchronize_checkpoint_boundary": False, "profile": False}  # fmt: skip
    out = from_deepspeed({"activation_checkpointing": block}, "ds.json")
    assert out.get("activation_offload") is True and out.get("activation_checkpointing") is None
    assert any("partition_activations" in k and "no phalanx" in why for k, why in out.ignored)
    assert any("set activation_checkpointing" in n for n in out.notes)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"activation_checkpointing": {"cpu_checkpointing": False}}))
    assert resolve_config(file=None, cli={"deepspeed": str(path)}, env={}).engine.activation_offload is False
    with pytest.raises(ConfigError, match="activation_checkpointing.partition_activation.*known"):
        from_deepspeed({"activation_checkpointing": {"partition_activation": True}}, "ds.json")


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.head(self.body(x))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def test_training_arguments_gradient_checkpointing_falls_back_to_phalanx_s_for_a_plain_module(tmp_path):
    model = _Plain()
    args = phalanx.TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True, report_to="none")
    phalanx.Trainer(model, args)
    # zero3's units: the Linear inside the Sequential (a container) and the head; Tanh has no parameters.
    assert getattr(model.body[0].forward, "_phalanx_checkpointed", False)
    assert getattr(model.head.forward, "_phalanx_checkpointed", False)
