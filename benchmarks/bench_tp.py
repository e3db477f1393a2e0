"""Tensor parallelism and hybrid sharding against torch's own, on CPU over gloo (issue 30, item 7).

    .venv/bin/python benchmarks/bench_tp.py --comparison tp2 --rounds 3      # 2 ranks: tp2, with and without SP
    .venv/bin/python benchmarks/bench_tp.py --comparison tp4 --rounds 3      # 4 ranks (on 2 cores: oversubscribed)
    .venv/bin/python benchmarks/bench_tp.py --comparison hybrid --rounds 3   # zero3 2x2 against FSDP2 HSDP 2x2
    .venv/bin/python benchmarks/bench_tp.py --rounds 1 --steps 2 --warmup 1 --no-json   # smoke run of all three

One comparison per invocation writes one file: results/tp-tp2.json, results/tp-tp4.json, results/hybrid-zero3.json.

- tpN: ``phalanx.Engine(strategy="ddp", tp_size=N)`` (dp = 1) against ``torch.distributed.tensor.parallel``
  (``parallelize_module`` with ColwiseParallel / RowwiseParallel / PrepareModuleInput, SequenceParallel on the norms
  in the SP variant, ``loss_parallel`` on the vocab-sharded logits) on ``init_device_mesh("cpu", (N,))``; both with
  and without sequence parallelism.
- hybrid: ``phalanx.Engine(strategy="zero3", dp_replicate_size=2)`` on 4 ranks against FSDP2 ``fully_shard`` per
  block and on the root over ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))``.

The model is tp_workers.BenchGPT (plain Embedding / Linear / LayerNorm layers, the same for both sides), AdamW
everywhere; every run is fresh processes from phalanx.spawn with 1 thread per rank, the rounds interleave the
configurations (harness.interleaved_rounds). After the timed steps each run profiles one more step: the bytes every
rank handed to each collective (counted the same way for both sides, from the c10d ops in the trace), compared with
the textbook count of the layout, and where the time went. See benchmarks/README.md ("bench_tp.py").
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # so that spawned processes (which inherit sys.path) import tp_workers


import tp_workers  # noqa: E402
from harness import (  # noqa: E402
    RANK_THREADS,
    add_output_flags,
    add_round_flags,
    environment,
    interleaved_rounds,
    mean_over_ranks,
    slowest_rank,
    source_record,
    source_state,
    spawn_ranks,
    write_result,
)

TARGET_STEP_RATIO = 0.8  # issue 30: phalanx at most 0.8x torch's step time
LOSS_TOL = 1e-4  # first-step loss, phalanx against torch (same init, same batch)

COMPARISONS = {
    "tp2": {"nprocs": 2, "layout": "tp", "stem": "tp-tp2"},
    "tp4": {"nprocs": 4, "layout": "tp", "stem": "tp-tp4"},
    "hybrid": {"nprocs": 4, "layout": "hybrid", "stem": "hybrid-zero3"},
}


def configurations(comparison: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    c = COMPARISONS[comparison]
    n = c["nprocs"]
    if c["layout"] == "tp":
        cfgs = [
            {"key": "phalanx", "name": f"phalanx tp{n}", "kind": "phalanx_tp", "sp": False, "peer": f"torch tp{n}"},
            {"key": "torch", "name": f"torch tp{n}", "kind": "torch_tp", "sp": False},
            {
                "key": "phalanx_sp",
                "name": f"phalanx tp{n} SP",
                "kind": "phalanx_tp",
                "sp": True,
                "peer": f"torch tp{n} SP",
            },
            {"key": "torch_sp", "name": f"torch tp{n} SP", "kind": "torch_tp", "sp": True},
        ]
    else:
        cfgs = [
            {
                "key": "phalanx",
                "name": "phalanx zero3 2x2",
                "kind": "phalanx_hybrid",
                "sp": False,
                "peer": "FSDP2 HSDP 2x2",
            },
            {"key": "torch", "name": "FSDP2 HSDP 2x2", "kind": "fsdp2_hybrid", "sp": False},
        ]
    for cfg in cfgs:
        cfg.update(nprocs=n, threads=RANK_THREADS)
    if args.only:
        keep = {s.strip() for s in args.only.split(",") if s.strip()}
        cfgs = [x for x in cfgs if x["key"] in keep or x["name"] in keep]
    return cfgs


def base_spec(comparison: str, args: argparse.Namespace) -> dict[str, Any]:
    c = COMPARISONS[comparison]
    hybrid = c["layout"] == "hybrid"
    return {
        "seed": args.seed,
        "lr": 1e-3,
        "adamw": args.adamw,
        "warmup": args.warmup,
        "steps": args.steps,
        "global_batch": args.global_batch or (8 if hybrid else 4),
        "layout": c["layout"],
        "model": {
            "vocab": args.vocab,
            "n_embd": args.n_embd,
            "n_head": args.n_head,
            "n_layer": args.n_layer,
            "seq": args.seq,
        },
        "replicas": 2,
        # every all-reduce of a tp layout spans the tp group (all ranks); of the hybrid, the 2 replicas
        "ar_group": 2 if hybrid else c["nprocs"],
        "profile_step": not args.no_profile,
        "top_ops": 15,
    }


def run_config(base: dict[str, Any], cfg: dict[str, Any], timeout: float, reference: bool) -> list[dict[str, Any]]:
    spec = dict(base, sequence_parallel=cfg["sp"], reference=reference)
    return spawn_ranks(tp_workers.run, cfg["nprocs"], (cfg["kind"], spec), timeout, threads=cfg["threads"])


def summarize_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    per_step = slowest_rank(results)
    r0 = results[0]
    prof = [r.get("profile") for r in results]
    return {
        "median_ms": 1e3 * statistics.median(per_step),
        "step_ms": [1e3 * t for t in per_step],
        "peak_rss_mib": [r["peak_hwm_mib"] for r in results],
        "ru_maxrss_mib": [r["peak_rss_mib"] for r in results],
        "setup_peak_rss_mib": [r["setup_peak_hwm_mib"] for r in results],
        "cpu_ms_per_step": [1e3 * r["cpu_per_step"] for r in results],
        "minor_faults_per_step": [r["minor_faults_per_step"] for r in results],
        "losses_per_rank": [r["losses"] for r in results],
        # tp ranks all hold the whole batch's loss; the hybrid's hold their quarter's: the mean is the global loss
        "losses": mean_over_ranks(results),
        "reference_first_loss": r0.get("reference_first_loss"),
        "state_bytes_per_rank": [r["state_bytes"] for r in results],
        "collectives_per_rank": [p["collectives"] if p else None for p in prof],
        "profile_rank0": {k: v for k, v in (prof[0] or {}).items() if k != "collectives"},
        "comm_self_cpu_ms_per_rank": [p["self_cpu_ms_collectives"] if p else None for p in prof],
        "self_cpu_ms_per_rank": [p["self_cpu_ms_total"] for p in prof if p],
        "profiled_step_ms_per_rank": [p["profiled_step_ms"] for p in prof if p],
        "param_checksum": r0["param_checksum"],
        "threads": r0["threads"],
        "n_params": r0.get("n_params"),
        **({"describe": r0["describe"]} if "describe" in r0 else {}),
        **(
            {"phalanx_comm_stats_all_steps": r0["phalanx_comm_stats_all_steps"]}
            if "phalanx_comm_stats_all_steps" in r0
            else {}
        ),
    }


# ------------------------------------------------------------------------------------------ textbook traffic


def textbook(comparison: str, base: dict[str, Any], sp: bool, n_params: int | None) -> dict[str, Any]:
    """What the layout must send per rank and step (ring bytes, fp32), as the papers count it.

    Megatron TP over N ranks, activation A = b*s*h*4 bytes, L layers: 4 all-reduces of A per layer (2 forward, 2
    backward), one for the embedding's output (forward) and one for the head's input gradient (backward): (4L + 2)
    all-reduces, each 2A(N-1)/N. With sequence parallelism each becomes an all-gather + reduce-scatter pair, each
    A(N-1)/N: the same bytes; the replicated parameters then act on sequence shards and their gradients are
    all-reduced too (the 2L+1 norms' weight and bias, the 2L row-parallel biases: (6L + 2)h floats). The
    vocab-parallel loss all-reduces 3 floats per token (max, sum of exponentials, target logit).

    HSDP over R replicas x S shards, P = parameter bytes: all-gather of the parameters within the shard group in
    the forward and again in the backward (2 P(S-1)/S), reduce-scatter of the gradients (P(S-1)/S), all-reduce of the
    1/S shard across the replicas (2 (P/S)(R-1)/R)."""
    m = base["model"]
    c = COMPARISONS[comparison]
    n = c["nprocs"]
    if c["layout"] == "tp":
        b, s, h, L = base["global_batch"], m["seq"], m["n_embd"], m["n_layer"]
        A = b * s * h * 4
        act = (4 * L + 2) * 2 * A * (n - 1) / n
        loss = 2 * (3 * b * s * 4) * (n - 1) / n
        sync = 2 * ((6 * L + 2) * h * 4) * (n - 1) / n if sp else 0.0
        parts = {"activations": act, "loss": loss, "replicated_param_grads": sync}
        return {
            "wire_bytes": parts,
            "wire_bytes_total": sum(parts.values()),
            "formula": (
                "(4L+2) x 2A(N-1)/N"
                + (" as all-gather + reduce-scatter pairs" if sp else " as all-reduces")
                + f", A = b*s*h*4 = {A}, L = {L}, N = {n}"
            ),
        }
    if not n_params:
        return {}
    P = n_params * 4
    R = base["replicas"]
    S = n // R
    parts = {
        "all_gather_forward": P * (S - 1) / S,
        "all_gather_backward": P * (S - 1) / S,
        "reduce_scatter": P * (S - 1) / S,
        "all_reduce_across_replicas": 2 * (P / S) * (R - 1) / R,
    }
    return {
        "wire_bytes": parts,
        "wire_bytes_total": sum(parts.values()),
        "formula": f"P = {P} bytes, R = {R} replicas, S = {S} shards",
    }


# ------------------------------------------------------------------------------------------ one comparison


def _med(vals: list[float]) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _max_over_ranks_median(rs: list[dict[str, Any]], key: str) -> float | None:
    """Median over rounds of the largest per-rank value (the rank that needs the most)."""
    return _med([max(v for v in r[key] if v is not None) for r in rs])


def _category_medians(rs: list[dict[str, Any]]) -> dict[str, float | None]:
    cats = [r["profile_rank0"].get("self_cpu_ms_by_category", {}) for r in rs]
    names = sorted({k for c in cats for k in c})
    med = {k: _med([c.get(k, 0.0) for c in cats]) for k in names}
    return dict(sorted(med.items(), key=lambda kv: -(kv[1] or 0.0)))


def _mb(x: float | None) -> str:
    return f"{x / 1e6:.2f}" if x is not None else "-"


def bench(comparison: str, args: argparse.Namespace) -> dict[str, Any]:
    base = base_spec(comparison, args)
    configs = configurations(comparison, args)
    c = COMPARISONS[comparison]
    m = base["model"]
    print(
        f"\n=== {comparison}: {c['nprocs']} ranks x {RANK_THREADS} thread on gloo; BenchGPT vocab {m['vocab']}, "
        f"n_embd {m['n_embd']}, {m['n_head']} heads, {m['n_layer']} layers, seq {m['seq']}, global batch "
        f"{base['global_batch']}; {base['warmup']} warm-up + {base['steps']} timed steps, {args.rounds} rounds ===",
        flush=True,
    )
    start = source_state()
    seen: set[str] = set()

    def run(cfg: dict[str, Any]) -> list[dict[str, Any]]:
        first = cfg["name"] not in seen  # the single-process reference loss: in each configuration's first run
        seen.add(cfg["name"])
        return run_config(base, cfg, args.timeout, first)

    def headline(s: dict[str, Any]) -> str:
        return f"{s['median_ms']:8.1f} ms/step, peak RSS {max(s['peak_rss_mib']):.0f} MiB"

    rounds, failures, wall = interleaved_rounds(configs, args, run, summarize_round, headline)
    sources = source_record(start, source_state())

    rows: list[dict[str, Any]] = []
    for cfg in configs:
        rs = rounds[cfg["name"]]
        if not rs:
            rows.append({**cfg, "failed": failures.get(cfg["name"], "no result")})
            continue
        meds = [r["median_ms"] for r in rs]
        n_params = next((r["n_params"] for r in rs if r.get("n_params")), None)
        coll = rs[0]["collectives_per_rank"]
        wire = [x["wire_bytes_total"] if x else None for x in coll]
        tb = textbook(comparison, base, cfg["sp"], n_params)
        row = {
            **cfg,
            "median_ms": statistics.median(meds),
            "min_ms": min(meds),
            "max_ms": max(meds),
            "round_medians_ms": meds,
            "peak_rss_mib": _max_over_ranks_median(rs, "peak_rss_mib"),
            "peak_rss_mib_per_round_per_rank": [r["peak_rss_mib"] for r in rs],
            "setup_peak_rss_mib": _max_over_ranks_median(rs, "setup_peak_rss_mib"),
            "cpu_ms_per_step_per_rank": [_med([r["cpu_ms_per_step"][k] for r in rs]) for k in range(cfg["nprocs"])],
            "state_bytes_per_rank": rs[0]["state_bytes_per_rank"],
            "state_bytes_max_rank": max(x["total"] for x in rs[0]["state_bytes_per_rank"]),
            "foreign_load_cores": [r["foreign_load_cores"] for r in rs],
            "first_loss": rs[0]["losses"][0],
            "final_loss": rs[0]["losses"][-1],
            "losses": rs[0]["losses"],
            "first_loss_per_rank": [x[0] for x in rs[0]["losses_per_rank"]],
            "reference_first_loss": rs[0]["reference_first_loss"],
            "param_checksum": rs[0]["param_checksum"],
            "n_params": n_params,
            "collectives_per_rank": coll,
            "wire_bytes_max_rank": max((w for w in wire if w is not None), default=None),
            "textbook": tb,
            "measured_over_textbook": (
                max(w for w in wire if w is not None) / tb["wire_bytes_total"]
                if tb and any(w is not None for w in wire)
                else None
            ),
            "profile": {
                "comm_self_cpu_ms_rank0_median": _med([r["comm_self_cpu_ms_per_rank"][0] for r in rs]),
                "self_cpu_ms_rank0_median": _med(
                    [r["self_cpu_ms_per_rank"][0] for r in rs if r["self_cpu_ms_per_rank"]]
                ),
                "profiled_step_ms_rank0_median": _med(
                    [r["profiled_step_ms_per_rank"][0] for r in rs if r["profiled_step_ms_per_rank"]]
                ),
                "self_cpu_ms_by_category_rank0_median": _category_medians(rs),
                "top_ops_rank0_round1": rs[0]["profile_rank0"].get("top_ops"),
                "top_ops_rank0_last_round": rs[-1]["profile_rank0"].get("top_ops"),
            },
            "rounds": rs,
            **({"describe": rs[0]["describe"]} if "describe" in rs[0] else {}),
            **({"failed_later": failures[cfg["name"]]} if cfg["name"] in failures else {}),
        }
        rows.append(row)
    by = {r["name"]: r for r in rows if "failed" not in r}

    # -------- ratios phalanx / torch, and the correctness check
    ratios: dict[str, Any] = {}
    checks: list[dict[str, Any]] = []
    for r in by.values():
        peer = by.get(r.get("peer", ""))
        if peer is None:
            continue
        per_round = [a["median_ms"] / b["median_ms"] for a, b in zip(rounds[r["name"]], rounds[peer["name"]])]
        step = r["median_ms"] / peer["median_ms"]
        ratios[f"{r['name']} / {peer['name']}"] = {
            "step_time": step,
            "step_time_per_round": per_round,
            "step_time_per_round_median": statistics.median(per_round) if per_round else None,
            "step_time_target": TARGET_STEP_RATIO,
            "meets_step_target": step <= TARGET_STEP_RATIO,
            "peak_rss": r["peak_rss_mib"] / peer["peak_rss_mib"]
            if r["peak_rss_mib"] and peer["peak_rss_mib"]
            else None,
            "model_state_bytes": r["state_bytes_max_rank"] / peer["state_bytes_max_rank"],
            "wire_bytes": (
                r["wire_bytes_max_rank"] / peer["wire_bytes_max_rank"]
                if r["wire_bytes_max_rank"] and peer["wire_bytes_max_rank"]
                else None
            ),
            "phalanx_wire_over_textbook": r["measured_over_textbook"],
            "torch_wire_over_textbook": peer["measured_over_textbook"],
        }
        diff = abs(r["first_loss"] - peer["first_loss"])
        ref = r["reference_first_loss"]
        checks.append(
            {
                "phalanx": r["name"],
                "torch": peer["name"],
                "phalanx_first_loss": r["first_loss"],
                "torch_first_loss": peer["first_loss"],
                "single_process_first_loss": ref,
                "abs_diff": diff,
                "phalanx_vs_single_process": abs(r["first_loss"] - ref) if ref is not None else None,
                "torch_vs_single_process": (
                    abs(peer["first_loss"] - peer["reference_first_loss"])
                    if peer["reference_first_loss"] is not None
                    else None
                ),
                "final_loss_abs_diff": abs(r["final_loss"] - peer["final_loss"]),
                "tolerance": LOSS_TOL,
                "ok": diff <= LOSS_TOL,
            }
        )

    # -------- print (markdown)
    print(f"\n### {comparison}: median over {args.rounds} rounds (slower rank per step); wall {wall:.0f} s\n")
    cols = [
        "configuration",
        "median ms",
        "rounds min-max",
        "peak RSS MiB (max rank)",
        "params+grads+AdamW MB/rank",
        "sent MB/rank/step",
        "textbook MB",
        "sent / textbook",
        "collective calls (rank 0)",
        "first loss",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['name']} | FAILED: {r['failed'][:120]} |")
            continue
        calls = (r["collectives_per_rank"][0] or {}).get("calls", {})
        print(
            f"| {r['name']} | {r['median_ms']:.1f} | {r['min_ms']:.0f}-{r['max_ms']:.0f} | {r['peak_rss_mib']:.0f} | "
            f"{_mb(r['state_bytes_max_rank'])} | {_mb(r['wire_bytes_max_rank'])} | "
            f"{_mb(r['textbook'].get('wire_bytes_total'))} | "
            f"{r['measured_over_textbook']:.3f} | {', '.join(f'{k} {v}' for k, v in sorted(calls.items()))} | "
            f"{r['first_loss']:.6f} |"
        )
    print("\nphalanx / torch (target step time <= 0.8):\n")
    print("| pair | step time | per round (median; min-max) | peak RSS | model state | bytes sent |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, v in ratios.items():
        pr = v["step_time_per_round"]
        print(
            f"| {k} | {v['step_time']:.3f} {'(meets)' if v['meets_step_target'] else '(MISSES 0.8)'} | "
            f"{v['step_time_per_round_median']:.3f}; {min(pr):.2f}-{max(pr):.2f} | "
            f"{v['peak_rss']:.3f} | {v['model_state_bytes']:.3f} | {v['wire_bytes']:.3f} |"
        )
    print("\nfirst-step loss, phalanx against torch (same init, same batch; tolerance 1e-4):\n")
    for ch in checks:
        print(
            f"  {ch['phalanx']}: {ch['phalanx_first_loss']:.7f}, {ch['torch']}: {ch['torch_first_loss']:.7f}, "
            f"|diff| {ch['abs_diff']:.2e} ({'ok' if ch['ok'] else 'FAIL'}); "
            + (
                f"one process: {ch['single_process_first_loss']:.7f}"
                if ch["single_process_first_loss"] is not None
                else "one process: not recorded in this run"
            )
        )
    print("\nprofiled step, rank 0 (median over rounds): collectives' self CPU / all self CPU; top ops of round 1\n")
    for r in rows:
        if "failed" in r:
            continue
        p = r["profile"]
        if p["self_cpu_ms_rank0_median"] is None:
            continue
        top = ", ".join(f"{o['op']} {o['self_cpu_ms']:.0f}" for o in (p["top_ops_rank0_round1"] or [])[:6])
        cats = ", ".join(f"{k} {v:.0f}" for k, v in p["self_cpu_ms_by_category_rank0_median"].items() if v)
        print(
            f"  {r['name']}: {p['comm_self_cpu_ms_rank0_median']:.0f} / {p['self_cpu_ms_rank0_median']:.0f} ms "
            f"(step {p['profiled_step_ms_rank0_median']:.0f} ms)\n    by category: {cats}\n    top ops: {top}"
        )

    return {
        "benchmark": "bench_tp",
        "comparison": comparison,
        "nprocs": c["nprocs"],
        "threads_per_rank": RANK_THREADS,
        "oversubscribed": c["nprocs"] > (__import__("os").cpu_count() or 1),
        "spec": base,
        "rows": rows,
        "ratios_phalanx_over_torch": ratios,
        "step_time_target": TARGET_STEP_RATIO,
        "correctness_first_loss": checks,
        "failures": failures,
        "wall_s": wall,
        **sources,
        "definitions": {
            "median_ms": "median over rounds of each round's median step (forward + backward + AdamW step + zero_grad; "
            "a step's time is the slower rank's)",
            "peak_rss_mib": "VmHWM of the rank with the largest one, at the end of the timed steps (before the "
            "profiled step), median over rounds; includes the ~300 MiB of the torch import",
            "state_bytes": "bytes of the parameters the optimizer steps on this rank (local pieces), their gradients "
            "(counted at the parameters' size) and the AdamW moments",
            "wire_bytes": "per rank, one profiled step after the timed ones: the c10d ops in the torch.profiler trace "
            "(what torch.distributed.* and DTensor's functional collectives both dispatch to), in ring bytes: "
            "all-reduce 2S(N-1)/N, all-gather and reduce-scatter S(N-1)/N (S the full tensor), send S",
            "textbook": "see textbook() in bench_tp.py: Megatron TP (4L+2 activation all-reduces, or as many AG+RS "
            "pairs under SP) and HSDP (AG forward and backward, RS, AR of the 1/S shard across replicas)",
            "comm_self_cpu_ms": "self CPU time of the c10d / gloo / functional-collective ops in the profiled step: on "
            "gloo mostly the time a rank waits for its peers",
        },
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comparison", default="tp2,tp4,hybrid", help="comma-separated: tp2, tp4, hybrid")
    add_round_flags(p, rounds=3, timeout=600.0)
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per run")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: tp 4, hybrid 8)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--only", default="", help="keys or names: phalanx, torch, phalanx_sp, torch_sp")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled step (no byte counts, no top ops)")
    p.add_argument("--adamw", choices=["default", "foreach", "fused"], default="default")
    p.add_argument("--seed", type=int, default=1234)
    add_output_flags(p, HERE / "results", "tp-<comparison>")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = environment()
    for comparison in [s.strip() for s in args.comparison.split(",") if s.strip()]:
        if comparison not in COMPARISONS:
            raise SystemExit(f"unknown comparison {comparison!r} (tp2, tp4, hybrid)")
        write_result(bench(comparison, args), args, COMPARISONS[comparison]["stem"], env, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
