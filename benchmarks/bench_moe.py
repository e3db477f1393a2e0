"""Expert parallelism (``Engine(ep_size=N)``) on a transformers Qwen3-MoE, on CPU over gloo (issue 38).

    .venv/bin/python benchmarks/bench_moe.py --retries 0                  # everything (about 7 min on 2 idle cores)
    .venv/bin/python benchmarks/bench_moe.py --smoke                      # small sizes, 1 round, writes nothing

One driver run, every configuration on the same 4 ranks (1 thread each, gloo; 4 processes on 2 cores), the same
model, tokens and AdamW; each run (``moe_workers.run``) gives every part below, and the rounds are interleaved
(``harness.interleaved_rounds``):

1. **memory_report**: per rank, ``engine.memory_report()`` under ddp at ep1, ep2, ep4 and zero3 at ep1, ep2: the
   ``experts`` entry (expert elements held / whole, fraction 1/ep), the expert elements and bytes this rank holds
   (counted from its tensors, or its slices of zero's segments), beside ``E_w x 4 B / ep`` (``/ expert shard
   size`` too under zero3), and the report's held and predicted totals;
2. **dispatch traffic per step** from phalanx's collective log (one measured step after the timed ones): the
   elements of each ep all-to-all (labels ``ep <module>: tokens / weights / outputs / counts`` and their
   ``(backward)``) per layer, against the routed pairs ``tokens x top_k x hidden`` (what ``all_to_all_single`` is
   handed, the rows that stay on this rank included) and the rows that actually leave the rank (from the routing
   each experts module receives: pairs per destination ep rank), beside ``dispatch_elements`` =
   ``tokens x top_k x hidden x (ep-1)/ep`` (uniform routing); the gradient reduction and the other collectives;
3. **step time**: ep2 and ep4 against dense ddp (ep1), zero3+ep2 against zero3, as ratios (median of rounds, and
   per round);
4. **peak memory**: each rank's peak RSS (``VmHWM``) over its own baseline (after the imports and the Engine,
   before the model is built), the RSS held after the steps, and the measured step's own peak over the RSS it
   starts from; zero3+ep2 against zero3, ddp ep2/ep4 against ddp.

Writes ``results/moe.json`` and ``results/moe.md``. See benchmarks/README.md ("bench_moe.py").
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # so that spawned processes (which inherit sys.path) import moe_workers


import moe_workers  # noqa: E402
from harness import (  # noqa: E402
    RANK_THREADS,
    add_output_flags,
    add_round_flags,
    environment,
    interleaved_rounds,
    mean_over_ranks,
    per_rank_median,
    slowest_rank,
    source_record,
    source_state,
    spawn_ranks,
    write_result,
)

STEM = "moe"
NPROCS = 4
LOSS_TOL = 1e-4  # first-step loss of every configuration against dense ddp (same init, same tokens)
BYTES = 4  # fp32

CONFIGS = {
    "ddp": {"name": "ddp (dense, ep1)", "strategy": "ddp", "ep": 1, "against": None},
    "ddp_ep2": {"name": "ddp ep2", "strategy": "ddp", "ep": 2, "against": "ddp"},
    "ddp_ep4": {"name": "ddp ep4", "strategy": "ddp", "ep": 4, "against": "ddp"},
    "zero3": {"name": "zero3 (ep1)", "strategy": "zero3", "ep": 1, "against": "ddp"},
    "zero3_ep2": {"name": "zero3 ep2", "strategy": "zero3", "ep": 2, "against": "zero3"},
}
# The ratios the issue asks for (the zero3 against ddp row is a by-product).
RATIOS = [("ddp_ep2", "ddp"), ("ddp_ep4", "ddp"), ("zero3_ep2", "zero3"), ("zero3", "ddp")]

EP_LABEL = re.compile(r"^ep (?P<module>\S+): (?P<kind>tokens|weights|outputs|counts)(?P<bwd> \(backward\))?$")
# Each all-to-all's input: the rows this rank sends ("sent", = its routed pairs) or those it received ("received").
ROWS_OF = {
    ("tokens", "forward"): "sent",
    ("weights", "forward"): "sent",
    ("outputs", "forward"): "received",
    ("outputs", "backward"): "sent",
    ("tokens", "backward"): "received",
    ("weights", "backward"): "received",
}


def model_spec(args: argparse.Namespace) -> dict[str, int]:
    return {
        "vocab": args.vocab,
        "hidden": args.hidden,
        "moe_intermediate": args.moe_intermediate,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "experts": args.experts,
        "top_k": args.top_k,
    }


def base_spec(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "seed": args.seed,
        "lr": 1e-3,
        "adamw": args.adamw,
        "warmup": args.warmup,
        "steps": args.steps,
        "seq": args.seq,
        "batch": args.batch,
        "model": model_spec(args),
    }


def engine_options(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Engine settings beyond strategy and ep_size: zero3 gathers one decoder layer at a time (``--zero3-units``;
    phalanx's default unit is each child of the root, which for a transformers causal LM is the whole decoder)."""
    if cfg["strategy"] == "zero3" and args.zero3_units:
        return {"zero3_unit_classes": args.zero3_units}
    return {}


# ------------------------------------------------------------------------------------------ traffic


def _layer(module: str) -> int:
    m = re.search(r"layers\.(\d+)\.", module)
    return int(m.group(1)) if m else -1


def ep_traffic(res: dict[str, Any]) -> dict[str, Any]:
    """One rank's measured step: each ep all-to-all's logged elements per layer, the rows it carried that leave
    the rank (from the routing), and the routed pairs; the other collectives grouped by label."""
    routing = res["routing"]
    ep, me = res["ep"], res["ep_rank"]
    hidden = next(iter(routing.values()))["hidden"] if routing else None
    layers: dict[int, dict[str, Any]] = {}
    for module, r in routing.items():
        pairs = sum(r["pairs_to_ep_rank"])
        local = r["pairs_to_ep_rank"][me] if ep > 1 else pairs
        layers[_layer(module)] = {
            "module": module,
            "tokens": r["tokens"],
            "top_k": r["top_k"],
            "routed_pairs": pairs,
            "pairs_kept_local": local,
            "pairs_sent_off_rank": pairs - local,
            "pairs_to_ep_rank": r["pairs_to_ep_rank"],
            "pairs_per_expert": r["pairs_per_expert"],
            "a2a": {},
        }
    other: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in res["collectives"]:
        m = EP_LABEL.match(e["label"] or "")
        if not m:
            key = f"{e['phase']}: {e['op']} ({re.sub(r'[0-9]+', '#', e['label'] or 'no label')})"
            other[key]["calls"] += 1
            other[key]["elements"] += e["numel"]
            other[key]["bytes"] += e["bytes"]
            continue
        phase = "backward" if m.group("bwd") else "forward"
        kind = m.group("kind")
        lay = layers.setdefault(_layer(m.group("module")), {"module": m.group("module"), "a2a": {}})
        a = lay["a2a"].setdefault(f"{kind} ({phase})", {"elements": 0, "bytes": 0, "calls": 0})
        a["elements"] += e["numel"]
        a["bytes"] += e["bytes"]
        a["calls"] += 1
    for lay in layers.values():
        if "routed_pairs" not in lay or hidden is None:
            continue
        # rows received = what the forward's outputs all-to-all hands back (its input: the rows computed here)
        out_fwd = lay["a2a"].get("outputs (forward)", {}).get("elements", 0)
        lay["pairs_received"] = out_fwd // hidden
        lay["pairs_received_off_rank"] = lay["pairs_received"] - lay["pairs_kept_local"]
        for name, a in lay["a2a"].items():
            kind, phase = name.split(" (")[0], name.split(" (")[1].rstrip(")")
            rows = ROWS_OF.get((kind, phase))
            if rows == "sent":
                a["rows"], a["off_rank_rows"] = lay["routed_pairs"], lay["pairs_sent_off_rank"]
            elif rows == "received":
                a["rows"], a["off_rank_rows"] = lay["pairs_received"], lay["pairs_received_off_rank"]
            if rows and a["rows"]:
                # the row width on the wire, from the log: H, H + 1 when the routing weight travels as one more
                # column of the tokens, 1 for a weights-only exchange
                a["width"] = a["elements"] / a["rows"]
                a["off_rank_elements"] = a["off_rank_rows"] * a["width"]
    return {
        "hidden": hidden,
        "layers": {str(k): v for k, v in sorted(layers.items())},
        "other": {k: dict(v) for k, v in sorted(other.items())},
    }


def traffic_table(row: dict[str, Any], m: dict[str, int]) -> dict[str, Any]:
    """Per all-to-all: the log's elements per step and per layer (rank 0, and every rank), the routed elements
    ``T k H``, the off-rank elements measured, and the uniform-routing formula ``T k H (ep-1)/ep``."""
    ep, L = row["ep"], m["layers"]
    per_rank = row["traffic_per_rank"]
    tokens = row["tokens_per_rank"]
    k, h = m["top_k"], m["hidden"]
    routed = tokens * k * h
    formula = routed * (ep - 1) / ep  # dispatch.dispatch_elements(tokens, k, h, ep)
    kinds = ["tokens (forward)", "outputs (forward)", "outputs (backward)", "tokens (backward)"]
    kinds += ["weights (forward)", "weights (backward)", "counts (forward)"]
    out: dict[str, Any] = {}
    for kind in kinds:
        cells = [lay["a2a"].get(kind, {}) for t in per_rank for lay in t["layers"].values()]
        if not any(c.get("calls") for c in cells):
            continue  # this revision of dispatch has no such exchange
        log_step = [sum(lay["a2a"].get(kind, {}).get("elements", 0) for lay in t["layers"].values()) for t in per_rank]
        off_step = [
            sum(lay["a2a"].get(kind, {}).get("off_rank_elements", 0) for lay in t["layers"].values()) for t in per_rank
        ]
        calls = [sum(lay["a2a"].get(kind, {}).get("calls", 0) for lay in t["layers"].values()) for t in per_rank]
        entry: dict[str, Any] = {
            "log_elements_per_step_per_rank": log_step,
            "log_elements_per_layer_rank0": log_step[0] / L,
            "log_elements_per_layer_mean": statistics.fmean(log_step) / L,
            "calls_per_step_rank0": calls[0],
        }
        if kind.startswith("counts"):
            entry.update(formula_per_layer=m["experts"], formula="E (one count per expert)")
            out[kind] = entry
            continue
        rows = sum(c.get("rows", 0) for c in cells)
        width = sum(c.get("elements", 0) for c in cells) / rows if rows else float(h)
        w_name = {h: "H", h + 1: "H+1", 1: "1"}.get(round(width), f"{width:g}")
        routed_k = tokens * k * width
        f = routed_k * (ep - 1) / ep
        entry.update(
            wire_width=width,
            wire_width_name=w_name,
            routed_elements_per_layer=routed_k,
            routed_formula=f"T*k*{w_name} = {tokens}*{k}*{width:g}",
            log_over_routed_mean=statistics.fmean(log_step) / L / routed_k,
            off_rank_elements_per_step_per_rank=off_step,
            off_rank_elements_per_layer_rank0=off_step[0] / L,
            off_rank_per_layer_min=min(off_step) / L,
            off_rank_per_layer_max=max(off_step) / L,
            off_rank_per_layer_mean=statistics.fmean(off_step) / L,
            formula_per_layer=f,
            formula=f"T*k*{w_name}*(ep-1)/ep = {tokens}*{k}*{width:g}*{ep - 1}/{ep}",
            off_rank_over_formula_mean=statistics.fmean(off_step) / L / f if f else None,
        )
        out[kind] = entry
    # the pairs per expert over every rank and layer: how uniform the router is
    per_expert = [0] * m["experts"]
    for t in per_rank:
        for lay in t["layers"].values():
            for i, c in enumerate(lay.get("pairs_per_expert", [])):
                per_expert[i] += c
    total = sum(per_expert)
    return {
        "tokens_per_rank": tokens,
        "routed_elements_per_layer": routed,
        "dispatch_elements_formula_per_layer": formula,
        "by_all_to_all": out,
        "pairs_per_expert_all_ranks_layers": per_expert,
        "expert_load_max_over_mean": max(per_expert) / (total / len(per_expert)) if total else None,
        "other_rank0": per_rank[0]["other"],
    }


# ------------------------------------------------------------------------------------------ what a run gave


def summarize_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    per_step = slowest_rank(results)
    mem = [r["memory"] for r in results]
    return {
        "median_ms": 1e3 * statistics.median(per_step),
        "step_ms": [1e3 * t for t in per_step],
        "losses": mean_over_ranks(results),
        "measured_loss": statistics.fmean(r["measured_loss"] for r in results),
        "measured_step_ms": 1e3 * max(r["measured_step_s"] for r in results),
        "cpu_ms_per_step": [1e3 * r["cpu_per_step"] for r in results],
        "minor_faults_per_step": [r["minor_faults_per_step"] for r in results],
        "prepare_s": [r["prepare_s"] for r in results],
        "peak_over_baseline_mib": [x["peak_over_baseline_mib"] for x in mem],
        "held_over_baseline_mib": [x["held_over_baseline_mib"] for x in mem],
        "prepare_peak_over_baseline_mib": [x["prepare_peak_over_baseline_mib"] for x in mem],
        "step_peak_over_start_mib": [x["step_peak_over_start_mib"] for x in mem],
        "baseline_rss_mib": [x["baseline"]["vm_rss_mib"] for x in mem],
        "memory_detail": mem,
        "memory_report": [r["memory_report"] for r in results],
        "expert_layout": [r["expert_layout"] for r in results],
        "zero3_units": results[0]["zero3_units"],
        "traffic_per_rank": [ep_traffic(r) for r in results],
        "topology": [
            {k: r[k] for k in ("ep", "ep_rank", "expert_dp_size", "expert_shard_size", "data_rank", "data_size")}
            for r in results
        ],
        "n_params_whole": results[0]["n_params_whole"],
        "expert_params_whole": results[0]["expert_params_whole"],
        "threads": results[0]["threads"],
        "phalanx_files": sorted({str(r["phalanx_file"]) for r in results}),
    }


def memory_report_table(row: dict[str, Any]) -> dict[str, Any]:
    """Part 1 for one configuration: the report's experts entry, the held expert elements per rank, the formula."""
    ew, ep = row["expert_params_whole"], row["ep"]
    shard = row["topology"][0]["expert_shard_size"] if row["strategy"] == "zero3" else 1
    shard = shard if ep > 1 else (NPROCS if row["strategy"] == "zero3" else 1)  # zero3 ep1: the experts over all 4
    formula_el = ew / ep / shard
    reps = row["memory_report"]
    held = [x["elements"] for x in row["expert_layout"]]
    dense_whole = row["n_params_whole"] - ew
    dense_share = dense_whole / (NPROCS if row["strategy"] == "zero3" else 1)
    return {
        "expert_params_whole": ew,
        "expert_bytes_whole": ew * BYTES,
        "ep": ep,
        "expert_shard_size": shard,
        "report_experts": [r.get("experts") for r in reps],
        "held_expert_elements_per_rank": held,
        "held_expert_bytes_per_rank": [x["bytes"] for x in row["expert_layout"]],
        "held_expert_source": row["expert_layout"][0]["source"],
        "formula_elements": formula_el,
        "formula_bytes": formula_el * BYTES,
        "formula": f"E_w*4 B/ep{'/shard' if row['strategy'] == 'zero3' else ''} = {ew}*4/{ep}"
        + (f"/{shard}" if row["strategy"] == "zero3" else ""),
        "held_over_formula_mean": statistics.fmean(held) / formula_el if formula_el else None,
        "held_over_formula_per_rank": [h / formula_el for h in held] if formula_el else None,
        "expert_state_bytes_per_rank_formula": 16 * formula_el,  # p + g + AdamW's two moments, fp32
        "report_held_total_per_rank": [r["held_total"] for r in reps],
        "report_predicted_total_per_rank": [r["predicted_total"] for r in reps],
        "report_held": [r["held"] for r in reps],
        "report_trainable_params": [r["trainable_params"] for r in reps],
        "report_expected_peak": [r.get("expected_peak") for r in reps],
        "state_formula_bytes": 16 * (dense_share + formula_el),
        "state_formula": "16 B x (dense/N_dense + E_w/ep/shard): p + g + AdamW's two moments, fp32",
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    m = model_spec(args)
    keys = [k.strip() for k in args.configs.split(",") if k.strip()]
    for need in ("ddp", "zero3"):
        if need not in keys and any(CONFIGS[k]["against"] == need for k in keys):
            keys.insert(0, need)  # the ratios are against it
    configs = [{**CONFIGS[k], "key": k, "threads": RANK_THREADS} for k in keys]
    print(
        f"=== expert parallelism: Qwen3-MoE vocab {m['vocab']}, hidden {m['hidden']}, {m['layers']} layers, "
        f"{m['experts']} experts top-{m['top_k']}, moe_intermediate {m['moe_intermediate']}, {m['heads']} heads / "
        f"{m['kv_heads']} kv heads; {NPROCS} ranks x batch {args.batch} x {args.seq} tokens; {args.warmup} warm-up + "
        f"{args.steps} timed steps + 1 measured step, {args.rounds} rounds; {RANK_THREADS} thread per rank, gloo ===",
        flush=True,
    )
    start = source_state()
    t_all = time.perf_counter()
    base = base_spec(args)

    def run(cfg: dict[str, Any]) -> list[dict[str, Any]]:
        spec = dict(base, strategy=cfg["strategy"], ep=cfg["ep"], engine=engine_options(cfg, args))
        return spawn_ranks(moe_workers.run, NPROCS, (spec,), args.timeout)

    def headline(s: dict[str, Any]) -> str:
        peak = max(p for p in s["peak_over_baseline_mib"] if p is not None) if any(s["peak_over_baseline_mib"]) else 0
        return f"{s['median_ms']:8.1f} ms/step, first loss {s['losses'][0]:.6f}, peak over baseline {peak:.0f} MiB"

    rounds, failures, wall = interleaved_rounds(configs, args, run, summarize_round, headline)
    sources = source_record(start, source_state())

    rows: dict[str, dict[str, Any]] = {}
    for cfg in configs:
        rs = rounds[cfg["name"]]
        if not rs:
            rows[cfg["key"]] = {**cfg, "failed": failures.get(cfg["name"], "no result")}
            continue
        meds = [r["median_ms"] for r in rs]
        first = rs[0]
        rows[cfg["key"]] = {
            **cfg,
            "median_ms": statistics.median(meds),
            "min_ms": min(meds),
            "max_ms": max(meds),
            "round_medians_ms": meds,
            "first_loss": first["losses"][0],
            "final_loss": first["losses"][-1],
            "tokens_per_rank": args.batch * args.seq,
            "n_params_whole": first["n_params_whole"],
            "expert_params_whole": first["expert_params_whole"],
            "topology": first["topology"],
            "memory_report": first["memory_report"],
            "expert_layout": first["expert_layout"],
            "zero3_units": first["zero3_units"],
            "traffic_per_rank": first["traffic_per_rank"],
            "traffic_same_every_round": all(r["traffic_per_rank"] == first["traffic_per_rank"] for r in rs),
            "peak_over_baseline_mib": per_rank_median(rs, "peak_over_baseline_mib", NPROCS),
            "held_over_baseline_mib": per_rank_median(rs, "held_over_baseline_mib", NPROCS),
            "prepare_peak_over_baseline_mib": per_rank_median(rs, "prepare_peak_over_baseline_mib", NPROCS),
            "step_peak_over_start_mib": per_rank_median(rs, "step_peak_over_start_mib", NPROCS),
            "cpu_ms_per_step": per_rank_median(rs, "cpu_ms_per_step", NPROCS),
            # every round's timing and memory; the traffic and reports of round 1 (the flag says whether it changed)
            "rounds": [
                {k: v for k, v in r.items() if k not in ("traffic_per_rank", "memory_report", "zero3_units")}
                for r in rs
            ],
        }

    # -------- 1. memory_report
    memory_reports = {k: memory_report_table(r) for k, r in rows.items() if "failed" not in r}

    # -------- 2. traffic
    traffic = {k: traffic_table(r, m) for k, r in rows.items() if "failed" not in r and r["ep"] > 1}
    other = {k: r["traffic_per_rank"][0]["other"] for k, r in rows.items() if "failed" not in r}

    # -------- 3. step time and 4. memory, as ratios
    step_time: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    checks: dict[str, Any] = {}
    ref_loss = rows.get("ddp", {}).get("first_loss")
    for key, against in RATIOS:
        a, b = rows.get(key), rows.get(against)
        if not a or not b or "failed" in a or "failed" in b:
            continue
        per_round = [x["median_ms"] / y["median_ms"] for x, y in zip(a["rounds"], b["rounds"])]
        step_time[f"{key} / {against}"] = {
            "ratio_of_medians": a["median_ms"] / b["median_ms"],
            "per_round": per_round,
            "per_round_median": statistics.median(per_round) if per_round else None,
        }
        mem: dict[str, Any] = {}
        for fig in ("peak_over_baseline_mib", "held_over_baseline_mib", "step_peak_over_start_mib"):
            xa = [v for v in a[fig] if v is not None]
            xb = [v for v in b[fig] if v is not None]
            if xa and xb:
                per_round_max = [
                    max(v for v in x[fig] if v is not None) / max(v for v in y[fig] if v is not None)
                    for x, y in zip(a["rounds"], b["rounds"])
                    if any(x[fig]) and any(y[fig])
                ]
                mem[fig] = {
                    "max_rank": max(xa),
                    "against_max_rank": max(xb),
                    "ratio_max_rank": max(xa) / max(xb),
                    "per_round_ratio_max_rank": per_round_max,
                }
        ha = memory_reports[key]["report_held_total_per_rank"][0]
        hb = memory_reports[against]["report_held_total_per_rank"][0]
        mem["report_held_total"] = {"bytes": ha, "against_bytes": hb, "ratio": ha / hb}
        memory[f"{key} / {against}"] = mem
    for key, r in rows.items():
        if "failed" in r or ref_loss is None:
            continue
        checks[key] = {
            "first_loss": r["first_loss"],
            "ddp_first_loss": ref_loss,
            "abs_diff": abs(r["first_loss"] - ref_loss),
            "ok": abs(r["first_loss"] - ref_loss) <= LOSS_TOL,
        }

    result = {
        "benchmark": "bench_moe",
        "spec": {**base, "nprocs": NPROCS, "configs": keys, "smoke": args.smoke, "zero3_units": args.zero3_units},
        "threads_per_rank": RANK_THREADS,
        "rows": rows,
        "memory_report": memory_reports,
        "traffic": traffic,
        "other_collectives_rank0": other,
        "step_time": step_time,
        "memory_ratios": memory,
        "correctness_first_loss": checks,
        "failures": failures,
        "wall_s": time.perf_counter() - t_all,
        "rounds_wall_s": wall,
        **sources,
        "definitions": DEFINITIONS,
    }
    print("\n" + "\n".join(tables(result)))
    return result


DEFINITIONS = {
    "expert_params_whole": "E_w: elements of every experts module's stacked weights (gate_up_proj, down_proj) of "
    "the whole model, counted on the model before prepare",
    "memory_report": "engine.memory_report() after the timed steps, per rank; its 'experts' entry counts the expert "
    "elements of this rank's experts before any zero sharding (fraction = 1/ep)",
    "held_expert_elements": "expert elements this rank holds: under ddp the numel of its (cut) expert tensors; under "
    "zero3 the expert parameters' parts of this rank's [lo, hi) slices of the strategy's segments. Bytes x 4 (fp32)",
    "traffic": "phalanx's collective log on for one measured step after the timed ones (its recent-entry buffer "
    "unbounded): each all_to_all entry's elements are its whole input (all_to_all_single's input tensor), the rows "
    "that stay on this rank included. 'forward' is what the forward logged, 'backward' the rest",
    "off_rank": "rows that leave the rank, from the routing each experts module receives (a forward pre-hook reads "
    "top_k_index; destination ep rank = expert // (E/ep)): sent = routed pairs - pairs to this rank's experts; "
    "received (the outputs' forward, the tokens' backward) = rows received - pairs kept local; x w elements, w the "
    "row width on the wire (the log's elements / rows: H, or H + 1 where the routing weight travels as a column)",
    "dispatch_formula": "phalanx.strategies.expert_parallel.dispatch.dispatch_elements: T*k*H*(ep-1)/ep per layer "
    "per direction, T = tokens per rank (batch x seq), with uniform routing",
    "step_time": "median over rounds of each round's median step (forward + backward + AdamW step + zero_grad; the "
    "slowest rank's); 4 ranks on 2 cores (oversubscribed); per-round ratios pair runs close in time",
    "peak_over_baseline": "per rank: VmHWM after the timed steps minus VmRSS at the baseline (after the imports, "
    "the Qwen3-MoE classes and Engine(), gc.collect(), VmHWM reset through /proc/self/clear_refs), MiB: the model "
    "built whole, prepare (the cut), the steps. held_over_baseline: VmRSS after the steps minus the baseline. "
    "step_peak_over_start: the measured step's VmHWM (reset before it) minus its starting VmRSS. Medians over "
    "rounds per rank",
}


# ------------------------------------------------------------------------------------------ printing


def _mib(x: float | None) -> str:
    return f"{x / 2**20:.2f}" if x is not None else "-"


def _span(xs: list[Any], fmt: str = "{:,.0f}") -> str:
    """One value when every rank has it, else 'min-max'."""
    vals = [x for x in xs if x is not None]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def tables(result: dict[str, Any]) -> list[str]:
    """The markdown tables (printed, and written to results/moe.md)."""
    spec = result["spec"]
    m = spec["model"]
    out: list[str] = []
    a = out.append
    any_row = next((r for r in result["rows"].values() if "failed" not in r), None)
    n_params = any_row["n_params_whole"] if any_row else None
    ew = any_row["expert_params_whole"] if any_row else None
    a(
        f"Model: transformers Qwen3MoeForCausalLM, vocab {m['vocab']}, hidden {m['hidden']}, {m['layers']} layers "
        f"(all sparse), {m['experts']} experts top-{m['top_k']} (norm_topk_prob, aux loss off), moe_intermediate "
        f"{m['moe_intermediate']}, {m['heads']} heads / {m['kv_heads']} kv heads, untied head, fp32, {n_params:,} "
        f"parameters of which E_w = {ew:,} in experts; AdamW. {NPROCS} ranks x batch {spec['batch']} x "
        f"{spec['seq']} tokens (T = {spec['batch'] * spec['seq']} tokens per rank), {RANK_THREADS} thread per rank, "
        f"gloo, {spec['warmup']} warm-up + {spec['steps']} timed steps + 1 measured step per run. zero3 units: "
        + (f"`zero3_unit_classes={spec['zero3_units']}`." if spec["zero3_units"] else "phalanx's default.")
    )
    a("")
    a("### 1. memory_report: the experts each rank holds")
    a("")
    a(
        "| config | ep | expert shard ranks | report: experts held / whole (fraction) | held expert elements per rank "
        "| MiB per rank | formula | formula MiB | held / formula | report held_total MiB per rank (predicted) "
        "| report comm_buffers MiB |"
    )
    a("|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|")
    for key, t in result["memory_report"].items():
        rep = t["report_experts"][0]
        rep_s = (
            f"{rep['expert_params_held']:,} / {rep['expert_params_whole']:,} ({rep['fraction']:.3f})" if rep else "-"
        )
        a(
            f"| {key} | {t['ep']} | {t['expert_shard_size']} | {rep_s} | {_span(t['held_expert_elements_per_rank'])} "
            f"| {_span([b / 2**20 for b in t['held_expert_bytes_per_rank']], '{:.2f}')} "
            f"| {t['formula']} | {_mib(t['formula_bytes'])} | {_span(t['held_over_formula_per_rank'], '{:.4f}')} | "
            f"{_span([x / 2**20 for x in t['report_held_total_per_rank']], '{:.2f}')} "
            f"({_span([x / 2**20 for x in t['report_predicted_total_per_rank']], '{:.2f}')}) | "
            f"{_span([h['comm_buffers'] / 2**20 for h in t['report_held']], '{:.2f}')} |"
        )
    a("")
    a(
        "held expert elements: counted from what each rank holds (ddp: the numel of its expert tensors; zero3: the "
        "expert parameters' parts of its slices of zero's segments); the report's `experts` entry counts before zero "
        "sharding. held_total = params + grads + optimizer state (p + g + AdamW's 2 moments = 16 B per element); "
        "predicted: the report's ZeRO formulas."
    )
    a("")
    a("### 2. Dispatch traffic per measured step (elements; fp32 = 4 bytes, counts int64)")
    a("")
    a(
        "| config | all-to-all | row width w | log elements / layer (rank 0) | routed T·k·w / layer | log / routed "
        "(mean of ranks) | off-rank / layer, measured (rank 0; min-max of ranks) | formula T·k·w·(ep-1)/ep | "
        "off-rank / formula (mean of ranks) | calls / step |"
    )
    a("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for key, t in result["traffic"].items():
        for kind, x in t["by_all_to_all"].items():
            if kind.startswith("counts"):
                a(
                    f"| {key} | {kind} | | {x['log_elements_per_layer_rank0']:,.0f} | E = {x['formula_per_layer']} "
                    f"| | | | | {x['calls_per_step_rank0']} |"
                )
                continue
            a(
                f"| {key} | {kind} | {x['wire_width_name']} = {x['wire_width']:g} | "
                f"{x['log_elements_per_layer_rank0']:,.0f} | {x['routed_elements_per_layer']:,.0f} | "
                f"{x['log_over_routed_mean']:.3f} | {x['off_rank_elements_per_layer_rank0']:,.0f} "
                f"({x['off_rank_per_layer_min']:,.0f}-{x['off_rank_per_layer_max']:,.0f}) | "
                f"{x['formula_per_layer']:,.0f} | {x['off_rank_over_formula_mean']:.3f} | {x['calls_per_step_rank0']} |"
            )
    a("")
    a(
        "T = tokens per rank, k = top_k, H = hidden; w = the row width on the wire, read from the log (H + 1 when the "
        "routing weight travels as one more column of the tokens). Each all_to_all_single's logged size is its whole "
        "input, the rows that stay on this rank included, so log / routed = 1 for what a rank sends (its T·k pairs) "
        "and varies for what it received (the outputs' forward, the tokens' backward). Off-rank: the rows whose "
        "other end is another ep rank, counted from the routing each experts module receives. "
        + "; ".join(
            f"{key}: dispatch_elements(T, k, H, ep) = {t['dispatch_elements_formula_per_layer']:,.0f}"
            for key, t in result["traffic"].items()
        )
        + "."
    )
    a("")
    for key, t in result["traffic"].items():
        a(
            f"{key}: pairs per expert over every rank and layer {t['pairs_per_expert_all_ranks_layers']} "
            f"(max / mean {t['expert_load_max_over_mean']:.3f})"
        )
    a("")
    a("Other collectives of the measured step, rank 0 (elements per step; `#` stands for a number):")
    a("")
    a("| config | collective | calls | elements | MiB |")
    a("|---|---|---:|---:|---:|")
    for key, oth in result["other_collectives_rank0"].items():
        for label, v in oth.items():
            a(f"| {key} | {label} | {v['calls']} | {v['elements']:,} | {_mib(v['bytes'])} |")
    a("")
    a("### 3. Step time (interleaved rounds)")
    a("")
    a("| config | median ms | rounds min-max | first loss | |diff| vs ddp | final loss | CPU ms/step/rank |")
    a("|---|---:|---:|---:|---:|---:|---|")
    for key, r in result["rows"].items():
        if "failed" in r:
            a(f"| {key} | FAILED: {r['failed'][:200]} | | | | | |")
            continue
        ck = result["correctness_first_loss"].get(key)
        a(
            f"| {key} | {r['median_ms']:.1f} | {r['min_ms']:.0f}-{r['max_ms']:.0f} | {r['first_loss']:.6f} | "
            f"{ck['abs_diff']:.1e} | {r['final_loss']:.6f} | "
            + ", ".join(f"{x:.0f}" for x in r["cpu_ms_per_step"] if x is not None)
            + " |"
        )
    a("")
    a("| ratio | of medians | per round | median of per-round |")
    a("|---|---:|---|---:|")
    for name, s in result["step_time"].items():
        a(
            f"| {name} | {s['ratio_of_medians']:.3f} | {', '.join(f'{x:.3f}' for x in s['per_round'])} | "
            f"{s['per_round_median']:.3f} |"
        )
    a("")
    a("### 4. Peak memory per rank over its own baseline (MiB, median of rounds)")
    a("")
    a(
        "| config | baseline RSS | peak over baseline, whole run | of which by the end of prepare | held after the "
        "steps | measured step's peak over its start |"
    )
    a("|---|---|---|---|---|---|")
    for key, r in result["rows"].items():
        if "failed" in r:
            continue
        base_rss = per_rank_median(r["rounds"], "baseline_rss_mib", NPROCS)
        a(
            f"| {key} | {', '.join(f'{x:.0f}' for x in base_rss if x is not None)} | "
            f"{', '.join(f'{x:.0f}' for x in r['peak_over_baseline_mib'] if x is not None)} | "
            f"{', '.join(f'{x:.0f}' for x in r['prepare_peak_over_baseline_mib'] if x is not None)} | "
            f"{', '.join(f'{x:.0f}' for x in r['held_over_baseline_mib'] if x is not None)} | "
            f"{', '.join(f'{x:.0f}' for x in r['step_peak_over_start_mib'] if x is not None)} |"
        )
    a("")
    a(
        "| ratio (max rank) | peak over baseline | per round | held after the steps | step's peak | "
        "memory_report held_total |"
    )
    a("|---|---:|---|---:|---:|---:|")
    for name, mm in result["memory_ratios"].items():
        pk, hd, sp = (
            mm.get(f) for f in ("peak_over_baseline_mib", "held_over_baseline_mib", "step_peak_over_start_mib")
        )
        a(
            f"| {name} | {pk['ratio_max_rank']:.3f} ({pk['max_rank']:.1f} / {pk['against_max_rank']:.1f}) | "
            f"{', '.join(f'{x:.3f}' for x in pk['per_round_ratio_max_rank'])} | "
            f"{hd['ratio_max_rank']:.3f} ({hd['max_rank']:.1f} / {hd['against_max_rank']:.1f}) | "
            f"{sp['ratio_max_rank']:.3f} ({sp['max_rank']:.1f} / {sp['against_max_rank']:.1f}) | "
            f"{mm['report_held_total']['ratio']:.3f} |"
            if pk and hd and sp
            else f"| {name} | - | | - | - | {mm['report_held_total']['ratio']:.3f} |"
        )
    return out


def write_markdown(result: dict[str, Any], args: argparse.Namespace, argv: list[str] | None) -> None:
    if args.no_json:
        return
    cmd = " ".join(["python benchmarks/bench_moe.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [
        "# Expert parallelism: memory, dispatch traffic, step time and peak memory (bench_moe.py)",
        "",
        f"Command: `.venv/bin/{cmd.strip()}`; phalanx {result['phalanx_commit']} (sources "
        f"{result['phalanx_src_sha256']}), finished {result.get('finished', '')}, wall {result['wall_s']:.0f} s. "
        "Full figures: `moe.json`.",
        "",
        *tables(result),
        "",
        "### Definitions",
        "",
        *(f"- `{k}`: {v}" for k, v in result["definitions"].items()),
        "",
    ]
    path = Path(args.out) / (f"{STEM}-{args.tag}.md" if args.tag else f"{STEM}.md")
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


SMOKE = {
    "rounds": 1,
    "steps": 2,
    "warmup": 1,
    "quiet_wait": 0.0,
    "retries": 0,
    "vocab": 256,
    "hidden": 64,
    "moe_intermediate": 64,
    "layers": 2,
    "seq": 32,
    "batch": 2,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_flags(p, rounds=3, timeout=600.0)
    p.set_defaults(quiet_wait=10.0)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of: {', '.join(CONFIGS)}")
    p.add_argument("--smoke", action="store_true", help="small sizes, 1 round, 2 steps; writes nothing")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per run")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument(
        "--zero3-units",
        default="Qwen3MoeDecoderLayer",
        help="zero3_unit_classes of the zero3 rows ('' for phalanx's default: each child of the root, here the whole "
        "decoder as one unit)",
    )
    p.add_argument("--adamw", choices=["default", "foreach", "fused"], default="default")
    p.add_argument("--seed", type=int, default=1234)
    add_output_flags(p, HERE / "results", STEM)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
        args.no_json = True
    env = environment(transformers=_version("transformers"))
    result = bench(args)
    write_result(result, args, STEM, env, argv)
    write_markdown(result, args, argv)
    return 0


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:  # noqa: BLE001 - recorded as unknown
        return None


if __name__ == "__main__":
    sys.exit(main())
