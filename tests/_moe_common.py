"""Tiny mixture-of-experts models for the expert-parallel tests: transformers' Qwen3-MoE and Mixtral (8 experts,
top-2, fp32, the auxiliary loss off), and their single-process reference runs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB, HIDDEN, SEQ, BATCH, STEPS = 64, 32, 8, 8, 3


def moe_model(kind: str, seed: int = 0) -> nn.Module:
    """``kind``: qwen3, mixtral or demo; ``qwen3+aux`` is Qwen3-MoE with its load-balancing loss on (coef 0.1)."""
    kind, aux = kind.removesuffix("+aux"), kind.endswith("+aux")
    torch.manual_seed(seed)
    if kind == "demo":  # phalanx demo --moe: Qwen3-MoE's experts and router in the demo GPT
        from phalanx.demo import GPTConfig, TinyGPT

        return _Logits(
            TinyGPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=HIDDEN, moe=True))
        )
    if kind == "qwen3":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.1 if aux else 0.0,
            output_router_logits=aux,
            max_position_embeddings=64, tie_word_embeddings=False, attention_dropout=0.0,
        )  # fmt: skip
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.0,
            output_router_logits=False, max_position_embeddings=64, tie_word_embeddings=False,
        )  # fmt: skip
        model = MixtralForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():  # not the default init: a zero router would route every token alike
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.05).add_(1.0 if p.dim() == 1 else 0.0)
    return model


class _Logits(nn.Module):
    """The demo GPT with transformers' call: ``model(input_ids=, labels=).loss`` (the next-token loss)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def ep_plan(self) -> dict[str, str]:
        return {f"gpt.{k}": v for k, v in self.gpt.ep_plan().items()}

    def tp_plan(self) -> dict[str, str]:
        return {f"gpt.{k}": v for k, v in self.gpt.tp_plan().items()}

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:  # type: ignore[override]
        logits = self.gpt(input_ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return type("Out", (), {"loss": loss})()


def batches(seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


CLIP = 0.5  # below the gradients' norm at these sizes: every step clips, so the norm must count each expert once


def reference(kind: str, optimizer: str = "sgd") -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the whole batch: the losses of each step and the final parameters."""
    model = moe_model(kind)
    opt = make_optimizer(optimizer, model)
    losses = []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > CLIP
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """The parity runs use SGD with momentum. Adam's first steps move a parameter by lr * g / (|g| + eps), whose
    slope at g ~ 0 is lr / eps (1e6 at lr 1e-2, eps 1e-8): it turns the 1e-11 differences that another order of
    summation leaves in a near-zero gradient (a weight few tokens reach) into 1e-5 in the parameters, whatever
    the strategy. SGD keeps every parameter within 1e-7 of one process here, so 1e-5 checks the gradients."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train_ranks(kind: str, engine: dict[str, Any], optimizer: str = "sgd", save: str | None = None) -> dict[str, Any]:
    """On each rank: the Engine with ``engine``'s settings, the same steps on this rank's slice of each global batch
    (a prepared DataLoader: under context parallelism it also cuts each sequence)."""
    import phalanx

    eng = phalanx.Engine(seed=0, max_grad_norm=CLIP, **engine)
    model = moe_model(kind)
    opt = make_optimizer(optimizer, model)
    samples = [{"input_ids": row, "labels": row} for ids in batches() for row in ids]
    loader = torch.utils.data.DataLoader(samples, batch_size=BATCH // eng.topology.data_size)
    model, opt, loader = eng.prepare(model, opt, loader)
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        eng.backward(loss)
        opt.step()
        opt.zero_grad()
        cp = eng.context_parallel
        weight = cp.weight() if cp is not None else None  # this rank's share of the sequence's targets
        losses.append(float(eng.reduce(loss.detach() * (weight if weight is not None else 1.0), "mean")))
    if save is not None:
        eng.save_state(save)
    state = eng.get_state_dict(model)
    out = {"losses": losses, "state": {k: v.clone() for k, v in state.items()} if eng.rank == 0 else None}
    out["expert_numel"] = sum(p.numel() for n, p in eng.unwrap_model(model).named_parameters() if ".experts." in n)
    return out


def train_many(runs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several trainings in one process (one Engine each): the ranks import transformers once."""
    return [train_ranks(kind, engine) for kind, engine in runs]


# ---------------------------------------------------------------------------- the pipeline's form of the models
class _Embed(nn.Module):
    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


class _Layer(nn.Module):
    """A decoder layer with its own rotary embedding (it has no weights), causal attention with no mask."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device)[None]
        out = self.layer(h, position_ids=pos, position_embeddings=self.rotary(h, pos))
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


class MoESequential(nn.Sequential):
    """A transformers MoE causal LM as the blocks the pipeline splits (embedding, each decoder layer, norm and
    head), with the model's ep plan under the blocks' names."""

    def ep_plan(self) -> dict[str, str]:
        return {"*.layer.mlp.experts": "ep_dispatch_experts"}


def moe_sequential(kind: str, seed: int = 0) -> nn.Module:
    model = moe_model(kind, seed)
    if kind == "demo":
        return model.gpt.pipeline_blocks()  # type: ignore[operator]
    base = model.model
    rotary_cls = type(base.rotary_emb)
    layers = [_Layer(layer, rotary_cls(model.config)) for layer in base.layers]
    return MoESequential(_Embed(base.embed_tokens), *layers, _Head(base.norm, model.lm_head))


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def pipeline_reference(kind: str, optimizer: str = "sgd") -> tuple[list[float], dict[str, torch.Tensor]]:
    model = moe_sequential(kind)
    opt = make_optimizer(optimizer, model)
    losses = []
    for ids in batches():
        loss = lm_loss(model, ids)
        loss.backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > CLIP
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_pipeline(kind: str, engine: dict[str, Any], optimizer: str = "sgd") -> dict[str, Any]:
    import phalanx

    eng = phalanx.Engine(strategy="pipeline", seed=0, max_grad_norm=CLIP, **engine)
    model = moe_sequential(kind)
    opt = make_optimizer(optimizer, model)
    model, opt = eng.prepare(model, opt)
    topo = eng.topology
    per = BATCH // topo.data_size
    losses = []
    for ids in batches():
        mine = ids[topo.data_rank * per : (topo.data_rank + 1) * per]
        losses.append(float(eng.reduce(eng.train_step(mine, lm_loss), "mean")))
    state = eng.get_state_dict(model)
    return {"losses": losses, "state": {k: v.clone() for k, v in state.items()} if eng.rank == 0 else None}
