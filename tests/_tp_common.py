"""A small Llama-like transformer for the tensor-parallel tests: grouped-query attention (4 q heads, 2 kv heads),
RMSNorm, a SwiGLU MLP, learned positions, hidden dropout, and the token embedding tied to the head.

Its names and config follow transformers' (``layers.*.self_attn.q_proj``, ``config.num_key_value_heads``), and its
forward reads the sequence length from the token ids, so sequence parallelism applies to it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass
class TinyLlamaConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 16
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_key_value_heads = cfg.num_key_value_heads
        self.num_key_value_groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.dropout = cfg.attention_dropout
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=True)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shapes from the projections, not from x: under sequence parallelism x holds a chunk of the sequence.
        q, k, v = (
            p(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.input_layernorm(x)))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class TinyLlama(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        with torch.no_grad():  # not the default init: a norm at 1 and biases at 0 would hide a wrong gradient
            for p in self.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)

    def tp_plan(self) -> dict[str, str]:
        return {
            "embed_tokens": "embedding_rowwise",
            "embed_positions": "sequence_parallel",
            "layers.*.self_attn.q_proj": "colwise",
            "layers.*.self_attn.k_proj": "colwise",
            "layers.*.self_attn.v_proj": "colwise",
            "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_proj": "colwise",
            "layers.*.mlp.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise",
            "lm_head": "colwise",
        }

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids) + self.embed_positions(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def init_gloo() -> tuple[int, int]:
    """The process group of a phalanx.spawn rank (a file:// store), made by the test itself."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=os.environ["PHALANX_INIT_METHOD"], rank=rank, world_size=world)
    return rank, world


def batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out
