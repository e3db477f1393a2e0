"""The built-in demo: a small byte-level GPT trained on the Python standard library's own source.

phalanx demo                                  # 2 processes on CPU (one per GPU where there are GPUs)
phalanx demo -n 1 -- --steps 100 --layers 2   # demo options go after --
phalanx demo -- --moe --experts 8 --top-k 2    # a mixture-of-experts MLP in every block (Qwen3-MoE's layout)
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import sysconfig
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from phalanx.logging import warn_once
from phalanx.strategies.context_parallel.context import positions_like

__all__ = [
    "GPTConfig",
    "TinyGPT",
    "SparseMoE",
    "TopKRouter",
    "Experts",
    "load_balancing_loss",
    "load_stdlib_bytes",
    "ByteChunks",
    "default_nproc",
    "parse_args",
    "main",
]


def default_nproc() -> int:
    """One process per GPU where there are GPUs, else 2 CPU processes."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    moe: bool = False
    """Each block's MLP is a mixture of experts (``SparseMoE``) instead of the dense GELU MLP."""
    n_experts: int = 8
    """Experts per MoE layer (with ``moe``)."""
    top_k: int = 2
    """Experts each token is routed to (with ``moe``)."""
    moe_intermediate: int | None = None
    """Each expert's hidden width; None: ``4 * n_embd // top_k``, so that a token's routed experts hold about the
    dense MLP's width between them."""

    def __post_init__(self) -> None:
        if self.moe and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"a mixture of experts routes each token to 1..n_experts experts; got top_k={self.top_k} with "
                f"n_experts={self.n_experts} (lower top_k or raise n_experts)"
            )

    @property
    def expert_width(self) -> int:
        return self.moe_intermediate or max(1, 4 * self.n_embd // self.top_k)


# ----------------------------------------------------------------------------------------- mixture of experts
# The MoE MLP follows transformers 5's Qwen3-MoE layout name for name and op for op (Qwen3MoeSparseMoeBlock: `gate`
# the router, `experts` the stacked expert weights), because expert parallelism splits a model by that contract:
# ep_plan() names `experts` and its two 3-D weights, whose dim 0 is the expert.
class TopKRouter(nn.Module):
    """Qwen3MoeTopKRouter: ``hidden [T, H] -> (router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])``,
    the softmax in fp32, the top-k probabilities renormalised to sum to 1 and cast back to the logits' dtype."""

    def __init__(self, hidden_dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.hidden_dim, self.num_experts, self.top_k = hidden_dim, num_experts, top_k
        self.norm_topk_prob = True
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_dim))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
        top_k_weights, top_k_index = torch.topk(router_probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
        return router_logits, top_k_weights.to(router_logits.dtype), top_k_index


class Experts(nn.Module):
    """Qwen3MoeExperts: ``num_experts`` gated MLPs stacked in ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows)
    and ``down_proj [E, H, I]``. The activation is SiLU (a SwiGLU expert, as Qwen3-MoE's), so the weights carry over
    to and from transformers unchanged.

    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]: each token's routed experts'
    outputs, weighted. Expert ids >= num_experts are skipped: expert parallelism lowers num_experts to the experts
    this rank holds and marks the others' (token, expert) pairs with such ids."""

    def __init__(self, hidden_dim: int, intermediate_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, intermediate_dim))
        self.act_fn = nn.SiLU()

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # One extra class collects every skipped id, so that one_hot takes any id.
            skip = top_k_index.clamp(max=self.num_experts)
            expert_mask = F.one_hot(skip, num_classes=self.num_experts + 1).permute(2, 1, 0)  # [E + 1, k, T]
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for hit in expert_hit:
            expert_idx = hit[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            gate, up = F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current = F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])
            current = current * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
        return final_hidden_states


class SparseMoE(nn.Module):
    """Qwen3MoeSparseMoeBlock: route each token (``gate``), run its experts (``experts``). The router logits of the
    last forward stay in ``router_logits`` for the load-balancing loss (``load_balancing_loss``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.experts = Experts(cfg.n_embd, cfg.expert_width, cfg.n_experts)
        self.gate = TopKRouter(cfg.n_embd, cfg.n_experts, cfg.top_k)
        self.router_logits: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        self.router_logits, top_k_weights, top_k_index = self.gate(flat)
        return self.experts(flat, top_k_index, top_k_weights).reshape(shape)


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (its eqs. 4-6) over the layers' router logits ``[T, E]`` together, as
    transformers' load_balancing_loss_func computes it: ``num_experts * sum_e f_e * P_e``, where ``f_e`` is the share
    of rows whose top-k picks include expert e and ``P_e`` its mean router probability. It is ``top_k`` when the
    routing is perfectly even, and grows as it concentrates on a few experts."""
    assert router_logits, "no router logits: the model has no mixture-of-experts layer, or ran no forward"
    picks = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    prob_sum = torch.zeros_like(picks)
    rows = 0
    for logits in router_logits:
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top = torch.topk(probs, top_k, dim=-1).indices
        picks = picks + F.one_hot(top, num_experts).sum(dim=(0, 1))  # counted without a host sync (no bincount)
        prob_sum = prob_sum + probs.sum(dim=0)
        rows += probs.shape[0]
    return num_experts * torch.sum((picks / rows) * (prob_sum / rows))


def _router_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The load-balancing loss over the router logits of ``model``'s last forward (None if it has no MoE layer);
    takes them off the layers, so that they do not keep the step's graph alive."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE) and m.router_logits is not None]
    if not layers:
        return None
    logits = [m.router_logits for m in layers if m.router_logits is not None]
    for m in layers:
        m.router_logits = None
    return load_balancing_loss(logits, layers[0].gate.num_experts, layers[0].gate.top_k)


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp: nn.Module = (
            SparseMoE(cfg)
            if cfg.moe
            else nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))
        )
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shapes come from qkv's output, not from x: under tensor parallelism qkv holds this rank's heads only, and
        # under sequence parallelism x holds a chunk of the sequence while qkv's output holds all of it.
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=2)
        q, k, v = (z.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).flatten(2))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT over bytes (vocabulary 256), with the token embedding tied to the output head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding, TopKRouter)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, Experts):
            nn.init.normal_(m.gate_up_proj, std=0.02)
            nn.init.normal_(m.down_proj, std=0.02)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``idx`` ``[b, t]``; ``position_ids`` (default ``0..t-1``) are the tokens' places in the whole
        sequence: under context parallelism the prepared loader gives them, as each rank holds chunks of it."""
        if position_ids is None:
            position_ids = positions_like(idx)
        x = self.tok(idx) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def tp_plan(self) -> dict[str, str]:
        """The tensor-parallel plan (phalanx.strategies.tensor_parallel): the tied embedding and head split once on
        the vocabulary (the head's logits gathered, so the loss and generate() see them whole), each block's fused
        qkv as 3 packed blocks of heads, its projection and MLP Megatron-style; the positions split along the
        sequence under sequence parallelism."""
        h = self.cfg.n_head
        mlp = (
            {  # Qwen3-MoE's: every expert split Megatron-style, the routed mixture summed; the router replicated
                "blocks.*.mlp.experts.gate_up_proj": "packed_colwise",
                "blocks.*.mlp.experts.down_proj": "rowwise",
                "blocks.*.mlp.experts": "moe_tp_experts",
            }
            if self.cfg.moe
            else {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
        )
        return {
            "tok": "embedding_rowwise",
            "pos": "sequence_parallel",
            "blocks.*.qkv": f"packed_colwise(packed=3, heads={h})",
            "blocks.*.proj": f"rowwise(heads={h})",
            **mlp,
            "head": "colwise_gather_output",
        }

    def ep_plan(self) -> dict[str, str]:
        """The expert-parallel plan, as transformers' base_model_ep_plan: each MoE layer's experts split over the ep
        ranks along the expert dim, tokens sent to their experts' ranks and back. Empty for the dense model."""
        if not self.cfg.moe:
            return {}
        return {
            "blocks.*.mlp.experts": "ep_dispatch_experts",
            "blocks.*.mlp.experts.gate_up_proj": "grouped_gemm",
            "blocks.*.mlp.experts.down_proj": "grouped_gemm",
        }

    def pipeline_blocks(self) -> nn.Sequential:
        """The same network as ``nn.Sequential(embedding, block, ..., head)`` for ``strategy: pipeline``.

        Pipeline stages cannot share a parameter, so the head gets its own copy of the tied embedding weight
        (from here on the two train separately, as in GPipe-style pipelines without tied-layer exchange). MoE blocks
        run as they are; the demo trains them without the load-balancing loss there, as a stage's router logits do
        not reach the last stage, where the loss is computed.
        """
        head = nn.Linear(self.cfg.n_embd, self.cfg.vocab_size, bias=False)
        with torch.no_grad():
            head.weight.copy_(self.tok.weight)
        seq = nn.Sequential(_Embed(self.tok, self.pos), *self.blocks, _Head(self.ln_f, head))
        if self.cfg.moe:  # the blocks are the Sequential's children "1".."n": the same plan under those names
            seq._ep_plan = {k.replace("blocks.*.", "*."): v for k, v in self.ep_plan().items()}  # type: ignore[assignment]
        return seq

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8, top_k: int = 40) -> torch.Tensor:
        return generate(self, self.cfg.block_size, idx, new_tokens, temperature, top_k)


class _Embed(nn.Module):
    def __init__(self, tok: nn.Embedding, pos: nn.Embedding) -> None:
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(positions_like(idx))


class _Head(nn.Module):
    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


@torch.no_grad()
def generate(
    model: Callable[[torch.Tensor], torch.Tensor],
    block_size: int,
    idx: torch.Tensor,
    new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
) -> torch.Tensor:
    """Sample ``new_tokens`` bytes after ``idx`` from a model that maps byte ids to logits."""
    for _ in range(new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :] / temperature
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1, None]
        logits = logits.masked_fill(logits < kth, -math.inf)
        idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
    return idx


def _gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], aux_loss_coef: float = 0.0) -> torch.Tensor:
    """Cross-entropy, plus ``aux_loss_coef`` times the MoE layers' load-balancing loss on this rank's tokens."""
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    aux = _router_aux_loss(model) if aux_loss_coef else None
    return loss if aux is None else loss + aux_loss_coef * aux.to(loss.dtype)


def load_stdlib_bytes(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The Python standard library's own ``.py`` files, concatenated in sorted path order, as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no .py files under the standard library directory {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).clone()


class ByteChunks(torch.utils.data.Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes: input is the first block_size, target the shift."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


# ----------------------------------------------------------------------------------------- the demo
class _RankZeroParser(argparse.ArgumentParser):
    """Every rank parses the demo options; only rank 0 prints help and errors (every rank still exits)."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)


def _parser() -> argparse.ArgumentParser:
    p = _RankZeroParser(
        prog="phalanx demo --",
        description="Train a byte-level GPT on the Python standard library's source with phalanx.Engine. Engine "
        "options go before `--` (phalanx demo -n 2 --precision bf16-mixed -- --steps 100); these go after it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = GPTConfig()
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per micro-batch")
    p.add_argument("--block-size", type=int, default=d.block_size, help="context length in bytes")
    p.add_argument("--layers", type=int, default=d.n_layer)
    p.add_argument("--heads", type=int, default=d.n_head)
    p.add_argument("--d-model", type=int, default=d.n_embd, help="embedding width")
    p.add_argument("--moe", action="store_true", help="a mixture-of-experts MLP in every block (Qwen3-MoE's layout)")
    p.add_argument("--experts", type=int, default=d.n_experts, help="experts per MoE layer (with --moe)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts each token is routed to (with --moe)")
    p.add_argument(
        "--aux-loss-coef",
        type=float,
        default=0.01,
        help="weight of the MoE load-balancing loss added to the cross-entropy (0: off; not under pipeline)",
    )
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (linear warmup, then cosine to 10%%)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (None: 10%% of --steps, at most 100)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per rank for the eval loss (0: skip)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="share of the bytes held out for eval")
    p.add_argument("--sample-bytes", type=int, default=200, help="bytes to generate at the end (0: skip)")
    p.add_argument("--prompt", default="def ", help="prompt for the generated sample")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="bytes of stdlib source to load")
    p.add_argument("--log-every", type=int, default=10, help="read the loss for the progress bar every N steps")
    p.add_argument("--metrics-jsonl", default=None, metavar="PATH", help="also append metrics to this JSONL file")
    p.add_argument(
        "--save-dir",
        default=None,
        metavar="DIR",
        help="save a checkpoint to DIR/step-N every --save-every steps and at the end (the last 2 are kept)",
    )
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --save-dir, if any")
    return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in ("steps", "batch_size", "block_size", "layers", "heads", "d_model", "max_bytes", "log_every"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(a, name)}")
    for name in ("eval_batches", "sample_bytes"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0; got {getattr(a, name)}")
    if a.d_model % a.heads:
        p.error(f"--d-model ({a.d_model}) must be divisible by --heads ({a.heads})")
    if a.experts < 1:
        p.error(f"--experts must be >= 1; got {a.experts}")
    if not 1 <= a.top_k <= a.experts:
        p.error(f"--top-k must be in 1..--experts ({a.experts}); got {a.top_k}")
    if a.aux_loss_coef < 0:
        p.error(f"--aux-loss-coef must be >= 0 (0: off); got {a.aux_loss_coef}")
    if not 0.0 <= a.eval_fraction < 1.0:
        p.error(f"--eval-fraction must be in [0, 1); got {a.eval_fraction}")
    if a.lr <= 0:
        p.error(f"--lr must be > 0; got {a.lr}")
    if a.save_every < 0:
        p.error(f"--save-every must be >= 0; got {a.save_every}")
    if (a.resume or a.save_every) and not a.save_dir:
        p.error("--resume and --save-every need --save-dir DIR (where the checkpoints are)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the demo options; `phalanx demo` calls it before starting any process."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def _lr_lambda(steps: int, warmup: int, floor: float = 0.1) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def _forever(loader: Iterable[Any]) -> Iterator[Any]:
    """Batches from pass after pass over ``loader`` (a prepared loader reshuffles each pass by itself)."""
    while True:
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        if not yielded:
            raise RuntimeError("the training DataLoader is empty")


def main(argv: Sequence[str] | None = None) -> int:
    from phalanx.checkpoint.state import latest_checkpoint
    from phalanx.engine.engine import Engine
    from phalanx.runtime.memory import gather_peak_memory
    from phalanx.trainer.tracking import JsonlMetrics, ProgressBar, Throughput, format_count

    parser = _parser()
    args = parse_args(argv)

    engine = Engine()
    cfg = engine.config
    accum = cfg.grad_accum_steps
    dp = engine.topology.data_size

    # ---- data: the stdlib's source, the tail held out for eval
    data = load_stdlib_bytes(args.max_bytes)
    n_eval = int(len(data) * args.eval_fraction) if args.eval_batches else 0
    train_bytes, eval_bytes = data[: len(data) - n_eval], data[len(data) - n_eval :]
    train_set = ByteChunks(train_bytes, args.block_size)
    if len(train_set) < args.batch_size * dp:
        parser.error(
            f"{len(train_bytes)} training bytes make only {len(train_set)} sequences of {args.block_size + 1} bytes, "
            f"fewer than one global batch ({args.batch_size} x {dp} ranks); raise --max-bytes or lower --batch-size"
        )
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)

    # ---- model, optimizer, schedule
    gpt_cfg = GPTConfig(
        block_size=args.block_size,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.d_model,
        moe=args.moe,
        n_experts=args.experts,
        top_k=args.top_k,
    )
    pipelined = engine.strategy.drives_backward  # the schedule runs forward and backward: train with train_step
    aux_loss_coef = args.aux_loss_coef if args.moe else 0.0
    if pipelined and aux_loss_coef:
        warn_once("--aux-loss-coef: the MoE load-balancing loss is not supported under pipeline; training without it")
        aux_loss_coef = 0.0
    loss_fn = functools.partial(_gpt_loss, aux_loss_coef=aux_loss_coef)
    model: nn.Module = TinyGPT(gpt_cfg).pipeline_blocks() if pipelined else TinyGPT(gpt_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    warmup = args.warmup if args.warmup is not None else max(1, min(100, args.steps // 10))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(args.steps, warmup))
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, loader, scheduler)
    resumed_from = latest_checkpoint(args.save_dir) if args.resume else None
    if resumed_from is not None:
        engine.load_state(resumed_from)  # model, optimizer, schedule, loader position and RNG, on any world size
        if engine.global_step >= args.steps:
            parser.error(
                f"{resumed_from} is at step {engine.global_step}, not before --steps {args.steps}: nothing to train"
            )

    moe_desc = f"moe {args.experts} experts top-{args.top_k}, aux loss coef {aux_loss_coef:g}" if args.moe else ""
    engine.print(
        f"phalanx demo: TinyGPT {format_count(n_params)} params ({args.layers} layers, {args.heads} heads, d_model "
        f"{args.d_model}, {moe_desc + ', ' if moe_desc else ''}context {args.block_size} bytes) on "
        f"{format_count(len(train_bytes))}B of stdlib source "
        f"({format_count(len(eval_bytes))}B held out)\n"
        f"  {cfg.strategy} x {engine.world_size} rank(s) on {engine.device.type}, {cfg.precision}, global batch "
        f"{args.batch_size} x {dp} x {accum} accum = {format_count(args.batch_size * dp * accum * args.block_size)} "
        f"tokens/step, {args.steps} steps"
        + (f"\n  resumed from {resumed_from} at step {engine.global_step}" if resumed_from is not None else ""),
        flush=True,
    )

    # ---- train
    tokens_per_micro = args.batch_size * args.block_size * dp  # global tokens in one micro-batch
    recent: deque[torch.Tensor] = deque(maxlen=args.log_every * accum)  # last log_every steps' detached losses: no sync
    bar = ProgressBar(total=args.steps, enabled=engine.is_main_process, desc="train")
    metrics = JsonlMetrics(args.metrics_jsonl, enabled=engine.is_main_process)
    meter = Throughput()
    steps_done, skipped = engine.global_step, 0
    bar.update(steps_done)
    model.train()
    if pipelined and cfg.max_grad_norm is None:
        cfg.max_grad_norm = 1.0  # train_step clips to this; the loop below clips at 1.0 under the other strategies
    for x, y in _forever(loader):
        if pipelined:
            loss = engine.train_step((x, y), loss_fn)  # forward, backward, clip, step and schedule, all stages
        else:
            with engine.accumulate():
                loss = loss_fn(model, (x, y))
                engine.backward(loss)
                engine.clip_grad_norm_(1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        recent.append(loss.detach())
        meter.add(tokens_per_micro)
        if not engine.sync_gradients:
            continue
        steps_done += 1
        skipped += int(engine.step_was_skipped)
        if engine.is_main_process:
            if steps_done % args.log_every == 0 or steps_done == args.steps:
                shown_loss = torch.stack(list(recent)).mean().item()  # the only host sync, every log_every steps
                tps = meter.rate()
                lr = scheduler.get_last_lr()[0]
                bar.update(1, loss=shown_loss, tokens_per_s=tps, lr=lr)
                metrics.log(step=steps_done, loss=shown_loss, tokens_per_s=tps, lr=lr)
            else:
                bar.update(1)  # no sync: only the count moves
        if args.save_dir and (steps_done == args.steps or (args.save_every and steps_done % args.save_every == 0)):
            engine.save_state(Path(args.save_dir) / f"step-{steps_done}", keep_last=2)
        if steps_done >= args.steps:
            break
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    train_time = meter.elapsed()
    bar.close()
    # Every rank's mean loss over its last log_every steps, averaged over the ranks.
    train_loss = engine.reduce(torch.stack(list(recent)).mean().float(), "mean").item()

    # ---- eval on the held-out tail: per-sequence losses gathered in global order
    eval_loss: float | None = None
    if n_eval and args.eval_batches:
        eval_set = ByteChunks(eval_bytes, args.block_size)
        if len(eval_set) > 0:
            eval_loader = engine.prepare(DataLoader(eval_set, batch_size=args.batch_size, shuffle=False))
            model.eval()
            losses = []
            with torch.no_grad():
                for i, (x, y) in enumerate(eval_loader):
                    if i >= args.eval_batches:
                        break
                    logits = model(x)
                    per_token = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), reduction="none")
                    losses.append(engine.gather_for_metrics(per_token.view(x.shape[0], -1).mean(dim=1)))
            model.train()
            eval_loss = torch.cat(losses).mean().item() if losses else None
            metrics.log(step=steps_done, eval_loss=eval_loss, eval_sequences=sum(len(t) for t in losses))

    memory = gather_peak_memory(engine.device)  # collective: every rank

    # ---- a sample from rank 0 only, from a plain copy of the trained weights. Under zero3 a forward of the
    # prepared model is a collective, so rank 0 cannot run it alone; get_state_dict works under every strategy
    # (every rank takes part), and the other ranks wait for the sample below.
    sample = ""
    if args.sample_bytes:
        weights = engine.get_state_dict(model)
        if engine.is_main_process:
            net: nn.Module = (TinyGPT(gpt_cfg).pipeline_blocks() if pipelined else TinyGPT(gpt_cfg)).to(engine.device)
            net.load_state_dict(weights)
            net.eval()
            prompt_bytes = args.prompt.encode("utf-8") or b"\n"
            prompt = torch.tensor([list(prompt_bytes)], dtype=torch.long, device=engine.device)
            torch.manual_seed(cfg.seed)
            with engine.autocast():
                out = generate(net, gpt_cfg.block_size, prompt, args.sample_bytes)
            sample = bytes(out[0].tolist()).decode("utf-8", errors="replace")
        del weights

    # ---- summary
    global_tps = meter.total_tokens / train_time if train_time > 0 else 0.0
    mem_lines = []
    for r, m in enumerate(memory):
        line = f"    rank {r}: peak RSS {m['rss_mib']:.0f} MiB"
        if "cuda_mib" in m:
            line += f", peak CUDA allocated {m['cuda_mib']:.0f} MiB"
        mem_lines.append(line)
    lines = [
        "",
        "phalanx demo summary",
        f"  strategy            {cfg.strategy}",
        f"  world size          {engine.world_size} ({engine.device.type}, {dp} data-parallel"
        + "".join(
            f", {n} {s}"
            for n, s in engine.topology.mesh.as_dict().items()
            if n in ("pp", "cp", "sp", "tp", "ep") and s > 1
        )
        + ")",
        f"  precision           {cfg.precision}",
        *(
            [f"  model               {moe_desc}" + (" (in the train loss)" if aux_loss_coef else "")]
            if moe_desc
            else []
        ),
        f"  steps               {steps_done}"
        + (f" of {accum} micro-batches" if accum > 1 else "")
        + (f" ({skipped} skipped: fp16 overflow)" if skipped else ""),
        f"  tokens              {format_count(meter.total_tokens)} in {train_time:.1f} s",
        f"  tokens/s (global)   {format_count(global_tps)}",
        "  peak memory per rank",
        *mem_lines,
        f"  final train loss    {train_loss:.4f}  (mean of the last {len(recent)} micro-batches, all ranks)",
        "  eval loss           "
        + (f"{eval_loss:.4f}  (held-out tail of the corpus)" if eval_loss is not None else "skipped"),
    ]
    if sample:
        lines += [
            "  sample (rank 0, prompt " + repr(args.prompt) + "):",
            *("    | " + s.rstrip() for s in sample.splitlines()),
        ]
    engine.print("\n".join(lines), flush=True)
    metrics.log(
        summary=True,
        strategy=cfg.strategy,
        **({"moe": {"experts": args.experts, "top_k": args.top_k, "aux_loss_coef": aux_loss_coef}} if args.moe else {}),
        world_size=engine.world_size,
        precision=cfg.precision,
        steps=steps_done,
        tokens_per_s=global_tps,
        train_loss=train_loss,
        eval_loss=eval_loss,
        peak_memory=memory,
    )
    metrics.close()
    engine.wait()  # rank 0 generated while the others waited here: leave together
    return 0


if __name__ == "__main__":
    sys.exit(main())
