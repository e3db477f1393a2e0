"""Worker functions for bench_moe.py: one run of one expert-parallel configuration, in processes started by
phalanx.spawn (1 thread per rank, gloo).

The model is a transformers ``Qwen3MoeForCausalLM`` (every layer a mixture of experts, ``top_k`` of ``experts``,
the auxiliary loss off, ``attn_implementation="sdpa"``, transformers' own initialisation), built with
``torch.manual_seed(seed)`` right before construction, fp32, AdamW. Step ``s`` draws one global batch of random
token ids from ``(seed, s)``; data rank ``r`` takes its ``batch`` rows, so every configuration trains on the same
tokens and starts from the same loss.

``run(spec)`` (every rank):

1. after the imports and ``phalanx.Engine(strategy=..., ep_size=...)``: ``gc.collect()``, the *baseline* (``VmRSS``),
   and ``VmHWM`` reset to it (``/proc/self/clear_refs``), so that the peak below is this configuration's own;
2. the model built whole, ``engine.prepare`` (which cuts the experts), ``harness.train_loop`` (warm-up and timed
   steps); then ``VmHWM`` and ``VmRSS`` over the baseline, and ``engine.memory_report()``;
3. one *measured* step: ``VmHWM`` reset again before it (the step's own peak over the RSS it starts from),
   phalanx's collective log on (every collective's label, op, elements and dtype; forward and backward apart), and a
   forward pre-hook on each experts module that reads the routing it is given (``top_k_index``): how many (token,
   expert) pairs go to each ep rank, so that the rows that leave this rank are counted exactly;
4. the expert elements this rank holds: the local expert tensors of the model (ddp), or, under zero3 (whose
   parameters are empty between steps), the expert parts of this rank's slices of the strategy's segments.

Every function here is module-level so that the spawn start method can import it by name.
"""

from __future__ import annotations

import gc
import time
import warnings
from typing import Any

import torch
from cp_workers import _entries, _log_off, _log_on, _reset_hwm
from harness import make_adamw, memory_now, train_loop, world
from torch import nn

EXPERTS = ".mlp.experts"  # the experts modules of a transformers MoE decoder layer


def build_model(spec: dict[str, Any]) -> nn.Module:
    """A Qwen3-MoE causal LM of ``spec["model"]``'s sizes: every layer sparse, no auxiliary loss, untied head."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    m = spec["model"]
    torch.manual_seed(spec["seed"])
    cfg = Qwen3MoeConfig(
        vocab_size=m["vocab"],
        hidden_size=m["hidden"],
        intermediate_size=m["hidden"] * 4,  # the dense MLP's: unused, every layer is sparse
        moe_intermediate_size=m["moe_intermediate"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        head_dim=m["hidden"] // m["heads"],
        num_experts=m["experts"],
        num_experts_per_tok=m["top_k"],
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.0,
        output_router_logits=False,
        max_position_embeddings=max(spec["seq"], 16),
        tie_word_embeddings=False,
        attention_dropout=0.0,
        use_cache=False,
    )
    model = Qwen3MoeForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def global_batch(spec: dict[str, Any], step: int, ranks: int) -> torch.Tensor:
    """Step ``step``'s token ids for all ``ranks`` data ranks, ``[ranks * batch, seq]``."""
    g = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + step)
    return torch.randint(spec["model"]["vocab"], (ranks * spec["batch"], spec["seq"]), generator=g)


class Routing:
    """Forward pre-hooks on the experts modules: per module, the (token, expert) pairs this rank routes to each ep
    rank (``top_k_index // (E / ep)``), the tokens and ``top_k``, and the pairs per expert."""

    def __init__(self, model: nn.Module, experts: int, ep: int) -> None:
        self.experts, self.ep = experts, ep
        self.by_module: dict[str, dict[str, Any]] = {}
        self.handles = [
            mod.register_forward_pre_hook(self._hook(name))
            for name, mod in model.named_modules()
            if name.endswith(EXPERTS)
        ]

    def _hook(self, name: str) -> Any:
        def hook(mod: nn.Module, args: Any) -> None:
            hidden, index = args[0], args[1]
            flat = index.reshape(-1)
            per_expert = torch.bincount(flat, minlength=self.experts)[: self.experts]
            per_rank = per_expert.view(self.ep, self.experts // self.ep).sum(1)
            self.by_module[name] = {
                "tokens": int(hidden.shape[0]),
                "hidden": int(hidden.shape[1]),
                "top_k": int(index.shape[1]),
                "pairs_per_expert": per_expert.tolist(),
                "pairs_to_ep_rank": per_rank.tolist(),
            }

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def expert_layout(engine: Any, model: nn.Module) -> dict[str, Any]:
    """The expert elements this rank holds, and their bytes, counted from what it holds: under ddp the local expert
    tensors (their ``numel``); under zero (the parameters are views into flat segments, empty between steps under
    zero3) the expert parameters' parts of this rank's ``[lo, hi)`` slice of each segment (read from the
    strategy's segments, phalanx internals)."""
    names = {id(p): n for n, p in model.named_parameters()}
    segments = getattr(engine.strategy, "segments", None)
    if not segments:
        held = [p for n, p in model.named_parameters() if EXPERTS + "." in n]
        return {
            "source": "the model's expert tensors",
            "elements": sum(p.numel() for p in held),
            "bytes": sum(p.numel() * p.element_size() for p in held),
        }
    elements, nbytes, seg_count = 0, 0, 0
    for s in segments:
        for i, p in enumerate(s.params):
            if EXPERTS + "." not in names.get(id(p), ""):
                continue
            a, b = max(s.offsets[i], s.lo), min(s.offsets[i] + s.shapes[i].numel(), s.hi)
            if a < b:
                elements += b - a
                nbytes += (b - a) * s.full.element_size()
        seg_count += bool(getattr(s, "expert", False))
    return {
        "source": "this rank's slices of the strategy's segments",
        "elements": elements,
        "bytes": nbytes,
        "expert_segments": seg_count,
        "segments": len(segments),
    }


def _units(engine: Any) -> list[dict[str, Any]] | None:
    """zero3's units (name and whole bytes when gathered), for the notes on its communication buffers."""
    units = getattr(engine.strategy, "units", None)
    if not units:
        return None
    return [{"name": u.name, "full_bytes": u.full_bytes, "root": u.is_root} for u in units]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """The one entry point phalanx.spawn calls: see the module docstring."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    # the model's classes before the baseline: importing them takes about 140 MiB, the same in every configuration
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: F401

    import phalanx

    rank, size = world()
    engine = phalanx.Engine(strategy=spec["strategy"], ep_size=spec["ep"], seed=spec["seed"], **spec["engine"])
    topo = engine.topology
    gc.collect()
    base = memory_now()
    reset = _reset_hwm()

    model = build_model(spec)
    whole = {n: p.numel() for n, p in model.named_parameters()}
    expert_whole = sum(v for n, v in whole.items() if EXPERTS + "." in n)
    opt = make_adamw(model.parameters(), spec)
    t0 = time.perf_counter()
    wrapped, opt = engine.prepare(model, opt)
    prepare_s = time.perf_counter() - t0
    inner = engine.unwrap_model(wrapped)
    mem_prepared = memory_now()
    data_rank, data_size, per = topo.data_rank, topo.data_size, spec["batch"]

    def batch(s: int) -> tuple[torch.Tensor, None]:
        return global_batch(spec, s, data_size)[data_rank * per : (data_rank + 1) * per], None

    def step(ids: torch.Tensor, _: Any) -> torch.Tensor:
        loss = wrapped(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    out = train_loop(spec, rank, batch, step, lambda: None)
    mem_loop = memory_now()
    report = engine.memory_report()

    # ---- the measured step: its own peak, its collectives, its routing
    ids, _ = batch(spec["warmup"] + spec["steps"])
    routing = Routing(inner, spec["model"]["experts"], topo.ep_size)
    gc.collect()
    pre = memory_now()
    step_reset = _reset_hwm()
    pre_after_reset = memory_now()
    log = _log_on()
    try:
        t0 = time.perf_counter()
        loss = wrapped(input_ids=ids, labels=ids).loss
        n_forward = len(log[0].recent)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        measured_s = time.perf_counter() - t0
    finally:
        entries = _log_off(log)
        routing.remove()
    post = memory_now()

    def over(now: dict[str, float | None], key: str, ref: dict[str, float | None]) -> float | None:
        a, b = now[key], ref["vm_rss_mib"]
        return a - b if a is not None and b is not None else None

    out.update(
        strategy=spec["strategy"],
        ep=topo.ep_size,
        ep_rank=topo.ep_rank,
        expert_dp_size=topo.expert_dp_size,
        expert_shard_size=topo.expert_shard_size if spec["strategy"] == "zero3" else None,
        data_rank=data_rank,
        data_size=data_size,
        n_params_whole=sum(whole.values()),
        expert_params_whole=expert_whole,
        expert_layout=expert_layout(engine, inner),
        zero3_units=_units(engine),
        memory_report=report,
        prepare_s=prepare_s,
        measured_loss=float(loss.detach()),
        measured_step_s=measured_s,
        collectives=_entries(entries[:n_forward], "forward") + _entries(entries[n_forward:], "backward"),
        routing=routing.by_module,
        memory={
            "hwm_reset": reset and step_reset,
            "baseline": base,
            "after_prepare": mem_prepared,
            "after_loop": mem_loop,
            "before_measured_step": pre,
            "after_measured_step": post,
            # peak (VmHWM) since the baseline (build, prepare, the warm-up and timed steps) over the baseline RSS
            "peak_over_baseline_mib": over(mem_loop, "vm_hwm_mib", base) if reset else None,
            "held_over_baseline_mib": over(mem_loop, "vm_rss_mib", base),
            "prepare_peak_over_baseline_mib": over(mem_prepared, "vm_hwm_mib", base) if reset else None,
            # the measured step's peak over the RSS it started from
            "step_peak_over_start_mib": over(post, "vm_hwm_mib", pre_after_reset) if step_reset else None,
        },
    )
    return out
