"""Context parallelism (ring attention and Ulysses) against one process, on CPU over gloo (issue 37, "Memory and
traffic").

    .venv/bin/python benchmarks/bench_context_parallel.py --retries 0          # everything, about 12 min idle
    .venv/bin/python benchmarks/bench_context_parallel.py --no-memory          # without the 16K-token measure
    .venv/bin/python benchmarks/bench_context_parallel.py --rounds 1 --steps 2 --warmup 1 --mem-seq 2048 \\
        --quiet-wait 0 --no-json                                               # smoke run (about 3 min)

One driver run measures, on one small Llama (grouped-query attention, batch 1):

1. **traffic per step** from phalanx's collective log (one measured step after the timed ones), per layer and per
   step, for ring attention (cp2, cp4) and Ulysses (sp2, sp4), beside the textbook formula and phalanx's own
   (``ring_traffic_elements`` / ``ulysses_traffic_elements`` in ring.py / ulysses.py, restated in
   ``formulas()`` here); attention traffic (labels ``ring attention ...``, ``ulysses ...``) apart from the gradient
   reduction (``ddp bucket ...``) and anything else;
2. **saved-for-backward bytes per rank** of one forward (``torch.autograd.graph.saved_tensors_hooks``; unique
   storages, and every saved tensor's bytes), per layer and module, at one process, cp2, cp4, sp2 and sp4, as a
   ratio to one process beside 1/cp;
3. **peak memory at 16,384 tokens**: one process against 4 ranks at cp4 (and sp4 with ``--memory-configs``), each
   rank's peak resident memory over its own baseline; where the memory goes at the peak (torch.profiler with
   ``profile_memory`` on rank 0: the allocations alive at the peak, by op and module or backward node);
4. **step time** against one process on the whole sequence (same tokens), interleaved rounds
   (``harness.interleaved_rounds``), and a try of torch's own
   ``torch.distributed.tensor.experimental.context_parallel`` (recorded error when it does not run on CPU).

Writes ``results/context-parallel.json`` and ``results/context-parallel.md``. See benchmarks/README.md
("bench_context_parallel.py").
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # so that spawned processes (which inherit sys.path) import cp_workers


import cp_workers  # noqa: E402
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
    wait_quiet,
    write_result,
)

TARGET_MEMORY_RATIO = 0.35  # issue 37: each cp4 rank's peak <= 0.35 of one process's, at 16,384 tokens
LOSS_TOL = 1e-4  # first-step loss of every configuration against one process (same init, same sequence)
STEM = "context-parallel"

CONFIGS = {
    "single": {"name": "one process", "kind": "single", "nprocs": 1, "setting": None, "method": "none"},
    "cp2": {"name": "phalanx cp2 (ring)", "kind": "phalanx", "nprocs": 2, "setting": "cp_size", "method": "ring"},
    "cp4": {"name": "phalanx cp4 (ring)", "kind": "phalanx", "nprocs": 4, "setting": "cp_size", "method": "ring"},
    "sp2": {"name": "phalanx sp2 (Ulysses)", "kind": "phalanx", "nprocs": 2, "setting": "sp_size", "method": "ulysses"},
    "sp4": {"name": "phalanx sp4 (Ulysses)", "kind": "phalanx", "nprocs": 4, "setting": "sp_size", "method": "ulysses"},
}

RING_LABELS = ("ring attention kv", "ring attention kv (backward)", "ring attention dkv")


def model_spec(args: argparse.Namespace) -> dict[str, int]:
    return {
        "vocab": args.vocab,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
    }


def base_spec(args: argparse.Namespace, seq: int, mode: str) -> dict[str, Any]:
    return {
        "seed": args.seed,
        "lr": 1e-3,
        "adamw": args.adamw,
        "warmup": args.warmup,
        "steps": args.steps,
        "seq": seq,
        "mode": mode,
        "model": model_spec(args),
    }


# ------------------------------------------------------------------------------------------ formulas


def formulas(method: str, n: int, m: dict[str, int], seq: int, b: int = 1) -> dict[str, Any]:
    """Elements one rank sends per attention layer (forward and backward), by the textbook and by phalanx.

    Ring over ``n`` ranks, ``kv = 2 * b * h_kv * (s / n) * d`` (k and v of one rank's chunks): textbook forward
    ``(n - 1) kv`` (each rank passes every kv pair but its last one on), backward twice that (the kv pairs again and
    the dK/dV accumulators, ``n - 1`` hops each); phalanx sends ``(n - 1) kv + n kv`` in the backward (ring.py: the
    accumulator of a pair starts on its owner and makes ``n`` hops, the last one bringing it home).

    Ulysses over ``n`` ranks: four all-to-alls per layer forward (q, k, v, out) of the local tensors,
    ``b * (s / n) * d * (2h + 2h_kv)`` elements handed over, ``(n - 1) / n`` of them sent; the same backward. The
    textbook counts k and v at the kv-head width ``h_kv``; phalanx repeats kv heads up to ``n`` when ``h_kv < n``
    (ulysses.py: each rank must get one whole kv head), so it hands over ``2h + 2 max(h_kv, n)`` heads."""
    h, h_kv = m["heads"], m["kv_heads"]
    d = m["hidden"] // h
    s_local = seq // n
    if method == "ring":
        kv = 2 * b * h_kv * s_local * d
        return {
            "unit": f"kv = 2*b*h_kv*(s/cp)*d = 2*{b}*{h_kv}*{s_local}*{d} = {kv}",
            "textbook": {"forward": (n - 1) * kv, "backward": 2 * (n - 1) * kv},
            "textbook_formula": {"forward": "(cp-1)*kv", "backward": "2*(cp-1)*kv"},
            "phalanx": {"forward": (n - 1) * kv, "backward": (n - 1) * kv + n * kv},
            "phalanx_formula": {"forward": "(cp-1)*kv", "backward": "(cp-1)*kv + cp*kv (dK/dV accumulators: cp hops)"},
            "phalanx_parts": {"backward_kv": (n - 1) * kv, "backward_dkv": n * kv},
        }
    if method == "ulysses":
        hkv_wire = max(h_kv, n)
        text_payload = b * s_local * d * (2 * h + 2 * h_kv)
        ph_payload = b * s_local * d * (2 * h + 2 * hkv_wire)
        sent_text = text_payload * (n - 1) // n
        sent_ph = ph_payload * (n - 1) // n
        return {
            "unit": f"b*(s/sp)*d = {b}*{s_local}*{d} = {b * s_local * d} per head",
            "textbook": {"forward": sent_text, "backward": sent_text},
            "textbook_payload": {"forward": text_payload, "backward": text_payload},
            "textbook_formula": {
                "forward": "(sp-1)/sp * b*(s/sp)*d*(2h + 2h_kv)",
                "backward": "(sp-1)/sp * b*(s/sp)*d*(2h + 2h_kv)",
            },
            "phalanx": {"forward": sent_ph, "backward": sent_ph},
            "phalanx_payload": {"forward": ph_payload, "backward": ph_payload},
            "phalanx_formula": {
                "forward": f"(sp-1)/sp * b*(s/sp)*d*(2h + 2*max(h_kv, sp)); max(h_kv, sp) = {hkv_wire}",
                "backward": f"(sp-1)/sp * b*(s/sp)*d*(2h + 2*max(h_kv, sp)); max(h_kv, sp) = {hkv_wire}",
            },
        }
    return {}


def grad_formula(n_params: int, n: int) -> dict[str, Any]:
    """The gradient all-reduce over the ``n`` cp ranks (they hold the same parameters): payload P elements, ring
    all-reduce sends 2P(n-1)/n per rank."""
    return {
        "payload_elements": n_params,
        "ring_sent_elements": 2 * n_params * (n - 1) / n,
        "formula": f"all-reduce of P = {n_params} fp32 gradients over cp={n}: sent 2P(cp-1)/cp",
    }


# ------------------------------------------------------------------------------------------ what a run gave


def traffic_of(entries: list[dict[str, Any]], method: str, n: int) -> dict[str, Any]:
    """One rank's measured step, sorted: attention traffic by phase (elements and bytes sent and received, calls),
    the gradient reduction, and everything else."""
    attn = {p: {"sent_elements": 0, "sent_bytes": 0, "received_elements": 0, "payload_elements": 0, "calls": 0}
            for p in ("forward", "backward")}  # fmt: skip
    by_label: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.Counter())
    grad = {"payload_elements": 0, "payload_bytes": 0, "calls": 0}
    other: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.Counter())
    for e in entries:
        label = e["label"] or ""
        if label in RING_LABELS or label.startswith("ulysses"):
            a = attn[e["phase"]]
            key = f"{e['phase']}: {label} {e['op']}"
            by_label[key]["calls"] += 1
            by_label[key]["elements"] += e["numel"]
            if e["op"] == "send":
                a["sent_elements"] += e["numel"]
                a["sent_bytes"] += e["bytes"]
                a["calls"] += 1
            elif e["op"] == "recv":
                a["received_elements"] += e["numel"]
            elif e["op"] == "all_to_all":  # hands over the whole local tensor; (N-1)/N of it leaves the rank
                a["payload_elements"] += e["numel"]
                a["sent_elements"] += e["numel"] * (n - 1) // n
                a["sent_bytes"] += e["bytes"] * (n - 1) // n
                a["received_elements"] += e["numel"] * (n - 1) // n
                a["calls"] += 1
        elif label.startswith("ddp bucket"):
            grad["payload_elements"] += e["numel"]
            grad["payload_bytes"] += e["bytes"]
            grad["calls"] += 1
        else:
            k = f"{e['phase']}: {e['op']} ({label or 'no label'})"
            other[k]["calls"] += 1
            other[k]["elements"] += e["numel"]
            other[k]["bytes"] += e["bytes"]
    grad["ring_sent_elements"] = 2 * grad["payload_elements"] * (n - 1) / n
    grad["ring_sent_bytes"] = 2 * grad["payload_bytes"] * (n - 1) / n
    return {
        "attention": attn,
        "attention_by_label": {k: dict(v) for k, v in by_label.items()},
        "gradient_reduction": grad,
        "other": {k: dict(v) for k, v in other.items()},
    }


def summarize_round(results: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    per_step = slowest_rank(results)
    return {
        "median_ms": 1e3 * statistics.median(per_step),
        "step_ms": [1e3 * t for t in per_step],
        "losses": mean_over_ranks(results),  # each rank's loss times its cut's weight: the mean is the whole's
        "measured_loss": statistics.fmean(r["measured_loss"] for r in results),
        "cpu_ms_per_step": [1e3 * r["cpu_per_step"] for r in results],
        "peak_rss_mib": [r["peak_hwm_mib"] for r in results],
        "traffic_per_rank": [traffic_of(r["collectives"], cfg["method"], cfg["nprocs"]) for r in results],
        "saved_per_rank": [r["saved"] for r in results],
        "n_params": results[0]["n_params"],
        "state_bytes_per_rank": [r["state_bytes"] for r in results],
        "threads": results[0]["threads"],
        "phalanx_files": sorted({str(r["phalanx_file"]) for r in results}),
    }


# ------------------------------------------------------------------------------------------ the parts


def probe_torch_cp(args: argparse.Namespace) -> list[dict[str, Any]]:
    """torch's context_parallel on the same model (2 ranks, a short sequence), SDPA's default backend, then math."""
    out = []
    spec = base_spec(args, 64, "probe")
    for backend in ("default", "math"):
        t0 = time.perf_counter()
        try:
            res = spawn_ranks(cp_workers.run, 2, ("torch_cp", dict(spec, backend=backend)), 180.0)
        except Exception as e:  # noqa: BLE001 - recorded
            res = [{"ok": False, "error": f"spawn failed: {type(e).__name__}: {str(e)[-1500:]}"}]
        row = {"backend": backend, "ranks": res, "wall_s": time.perf_counter() - t0}
        row["runs"] = all(r.get("ok") for r in res)
        errs = [r["error"] for r in res if not r.get("ok")]
        first = next((e for e in errs if "Connection closed" not in e), errs[0] if errs else None)
        row["error"] = first
        print(f"  torch context_parallel, SDPA backend {backend}: " + ("runs" if row["runs"] else f"FAILS: {first}"))
        out.append(row)
    return out


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    """One step at ``--mem-seq`` tokens per configuration (fresh processes), then the profiled step."""
    out: dict[str, Any] = {}
    for key in [k.strip() for k in args.memory_configs.split(",") if k.strip()]:
        cfg = CONFIGS[key]
        profiled = {k.strip() for k in args.profile_configs.split(",") if k.strip()}
        spec = dict(base_spec(args, args.mem_seq, "memory"), setting=cfg["setting"], profile_memory=key in profiled)
        if args.quiet_wait > 0:
            wait_quiet(args.quiet_wait, args.quiet_threshold)
        t0 = time.perf_counter()
        try:
            res = spawn_ranks(cp_workers.run, cfg["nprocs"], (cfg["kind"], spec), args.memory_timeout)
        except Exception as e:  # noqa: BLE001 - a failure is reported, the other parts go on
            out[key] = {**cfg, "failed": f"{type(e).__name__}: {str(e)[-3000:]}"}
            print(f"  memory {cfg['name']}: FAILED {out[key]['failed'][:300]}", flush=True)
            continue
        peaks = [r["peak_over_baseline_mib"] for r in res]
        out[key] = {
            **cfg,
            "seq": args.mem_seq,
            "wall_s": time.perf_counter() - t0,
            "peak_over_baseline_mib_per_rank": peaks,
            "peak_over_baseline_mib_max_rank": max(p for p in peaks if p is not None) if any(peaks) else None,
            "ru_maxrss_over_baseline_mib_per_rank": [r["ru_maxrss_over_baseline_mib"] for r in res],
            "baseline_rss_mib_per_rank": [r["baseline"]["vm_rss_mib"] for r in res],
            "step_s_per_rank": [r["step_s"] for r in res],
            "step_user_s_per_rank": [r["step_user_s"] for r in res],
            "step_sys_s_per_rank": [r["step_sys_s"] for r in res],
            "step_minor_faults_per_rank": [r["step_minor_faults"] for r in res],
            "loss": statistics.fmean(r["loss"] for r in res),
            "state_bytes_per_rank": [r["state_bytes"] for r in res],
            "ranks": res,
        }
        print(
            f"  memory {cfg['name']} at {args.mem_seq} tokens: peak over baseline per rank "
            f"{', '.join(f'{p:.0f}' for p in peaks if p is not None)} MiB; step "
            f"{max(r['step_s'] for r in res):.1f} s (wall {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    m = model_spec(args)
    keys = [k.strip() for k in args.configs.split(",") if k.strip()]
    if "single" not in keys:
        keys.insert(0, "single")  # every ratio is against it
    configs = [{**CONFIGS[k], "key": k, "threads": RANK_THREADS} for k in keys]
    print(
        f"=== context parallelism: Llama vocab {m['vocab']}, hidden {m['hidden']}, intermediate {m['intermediate']}, "
        f"{m['layers']} layers, {m['heads']} heads / {m['kv_heads']} kv heads; batch 1 x {args.seq} tokens; "
        f"{args.warmup} warm-up + {args.steps} timed steps + 1 measured step, {args.rounds} rounds; "
        f"{RANK_THREADS} thread per rank, gloo ===",
        flush=True,
    )
    start = source_state()
    t_all = time.perf_counter()

    torch_cp: list[dict[str, Any]] = []
    if not args.no_torch_probe:
        print("\n-- torch's own context_parallel on CPU/gloo (2 ranks, 64 tokens)", flush=True)
        torch_cp = probe_torch_cp(args)

    print("\n-- step time, traffic and saved bytes (interleaved rounds)", flush=True)
    base = base_spec(args, args.seq, "time")

    def run(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        spec = dict(base, setting=cfg["setting"])
        return cfg, spawn_ranks(cp_workers.run, cfg["nprocs"], (cfg["kind"], spec), args.timeout)

    def summarize(x: tuple[dict[str, Any], list[dict[str, Any]]]) -> dict[str, Any]:
        return summarize_round(x[1], x[0])

    def headline(s: dict[str, Any]) -> str:
        return f"{s['median_ms']:8.1f} ms/step, first loss {s['losses'][0]:.6f}"

    rounds, failures, wall = interleaved_rounds(configs, args, run, summarize, headline)

    memory: dict[str, Any] = {}
    if not args.no_memory:
        print(f"\n-- peak memory at {args.mem_seq} tokens", flush=True)
        memory = run_memory(args)
    sources = source_record(start, source_state())

    # -------- rows
    rows: dict[str, dict[str, Any]] = {}
    for cfg in configs:
        rs = rounds[cfg["name"]]
        if not rs:
            rows[cfg["key"]] = {**cfg, "failed": failures.get(cfg["name"], "no result")}
            continue
        meds = [r["median_ms"] for r in rs]
        rows[cfg["key"]] = {
            **cfg,
            "median_ms": statistics.median(meds),
            "min_ms": min(meds),
            "max_ms": max(meds),
            "round_medians_ms": meds,
            "first_loss": rs[0]["losses"][0],
            "final_loss": rs[0]["losses"][-1],
            "measured_loss": rs[0]["measured_loss"],
            "n_params": rs[0]["n_params"],
            "traffic_per_rank": rs[0]["traffic_per_rank"],
            "traffic_same_every_round": all(r["traffic_per_rank"] == rs[0]["traffic_per_rank"] for r in rs),
            "saved_per_rank": rs[0]["saved_per_rank"],
            "saved_same_every_round": all(
                [x["by_scope"] for x in r["saved_per_rank"]] == [x["by_scope"] for x in rs[0]["saved_per_rank"]]
                for r in rs
            ),
            # every round's timing; the traffic and saved bytes of round 1 only (the flags say whether they changed)
            "rounds": [{k: v for k, v in r.items() if k not in ("traffic_per_rank", "saved_per_rank")} for r in rs],
        }
    single = rows.get("single", {})

    # -------- 1. traffic
    traffic: dict[str, Any] = {}
    for key, row in rows.items():
        if key == "single" or "failed" in row:
            continue
        n, L = row["nprocs"], m["layers"]
        f = formulas(row["method"], n, m, args.seq)
        per_rank = row["traffic_per_rank"]
        t0 = per_rank[0]
        phases = {}
        for phase in ("forward", "backward"):
            meas = t0["attention"][phase]["sent_elements"]
            phases[phase] = {
                "measured_sent_elements_per_step": meas,
                "measured_sent_bytes_per_step": t0["attention"][phase]["sent_bytes"],
                "measured_sent_elements_per_layer": meas / L,
                "textbook_elements_per_layer": f["textbook"][phase],
                "phalanx_formula_elements_per_layer": f["phalanx"][phase],
                "measured_over_textbook": meas / L / f["textbook"][phase],
                "measured_over_phalanx_formula": meas / L / f["phalanx"][phase],
                "textbook_formula": f["textbook_formula"][phase],
                "phalanx_formula": f["phalanx_formula"][phase],
                "calls_per_step": t0["attention"][phase]["calls"],
                "all_ranks_equal": all(
                    r["attention"][phase]["sent_elements"] == meas
                    and r["attention"][phase]["received_elements"] == t0["attention"][phase]["received_elements"]
                    for r in per_rank
                ),
                "received_elements_per_step": t0["attention"][phase]["received_elements"],
            }
        g = grad_formula(row["n_params"], n)
        traffic[key] = {
            "unit": f["unit"],
            "phases": phases,
            "ring_parts": f.get("phalanx_parts"),
            "by_label_rank0": t0["attention_by_label"],
            "gradient_reduction": {
                **t0["gradient_reduction"],
                "formula_payload_elements": g["payload_elements"],
                "formula_ring_sent_elements": g["ring_sent_elements"],
                "measured_over_formula": t0["gradient_reduction"]["payload_elements"] / g["payload_elements"],
                "formula": g["formula"],
            },
            "other_collectives_rank0": t0["other"],
            "same_every_round": row["traffic_same_every_round"],
        }

    # -------- 2. saved bytes
    saved: dict[str, Any] = {}
    if single and "failed" not in single:
        ref = single["saved_per_rank"][0]["by_scope"]
        ref_total = single["saved_per_rank"][0]["unique_bytes_total"]
        for key, row in rows.items():
            if "failed" in row:
                continue
            n = row["nprocs"]
            per_rank = []
            for sv in row["saved_per_rank"]:
                scopes = {}
                for scope, v in sv["by_scope"].items():
                    r = ref.get(scope)
                    scopes[scope] = {
                        **v,
                        "unique_ratio": v["unique_bytes"] / r["unique_bytes"] if r and r["unique_bytes"] else None,
                        "tensor_ratio": v["tensor_bytes"] / r["tensor_bytes"] if r and r["tensor_bytes"] else None,
                    }
                per_rank.append(
                    {
                        "by_scope": scopes,
                        "unique_bytes_total": sv["unique_bytes_total"],
                        "tensor_bytes_total": sv["tensor_bytes_total"],
                        "total_unique_ratio": sv["unique_bytes_total"] / ref_total,
                    }
                )
            per_layer = {}
            for i in range(m["layers"]):
                per_layer[f"layer{i}"] = {
                    part: max(
                        (pr["by_scope"].get(f"layer{i}.{part}", {}).get("unique_ratio") or 0.0) for pr in per_rank
                    )
                    for part in ("attention", "mlp", "norms")
                }
            detail = next((v for k, v in row["saved_per_rank"][0].items() if k.startswith("detail_")), None)
            saved[key] = {
                "one_over_cp": 1.0 / n,
                "same_every_round": row["saved_same_every_round"],
                "saved_tensors_of_layer1_rank0": detail,
                "per_rank": per_rank,
                "max_rank_ratio_per_layer": per_layer,
                "max_rank_total_ratio": max(p["total_unique_ratio"] for p in per_rank),
            }

    for row in rows.values():
        row.pop("saved_per_rank", None)  # in saved_for_backward, with the ratios

    # -------- 3. memory
    mem_summary: dict[str, Any] = {}
    if memory.get("single") and "failed" not in memory["single"]:
        one = memory["single"]["peak_over_baseline_mib_max_rank"]
        for key, mrow in memory.items():
            if key == "single" or "failed" in mrow or not one:
                continue
            ratio = mrow["peak_over_baseline_mib_max_rank"] / one
            mem_summary[key] = {
                "one_process_peak_mib": one,
                "max_rank_peak_mib": mrow["peak_over_baseline_mib_max_rank"],
                "ratio": ratio,
                "per_rank_ratio": [p / one for p in mrow["peak_over_baseline_mib_per_rank"]],
                "target": TARGET_MEMORY_RATIO if key == "cp4" else None,  # the issue's target is cp4's
                "meets_target": ratio <= TARGET_MEMORY_RATIO if key == "cp4" else None,
            }
            p_one, p_this = _alloc_peak(memory["single"]), _alloc_peak(mrow)
            if p_one and p_this:
                mem_summary[key]["allocator_peak_ratio_rank0"] = p_this / p_one

    # -------- 4. step time
    step_time: dict[str, Any] = {}
    checks: dict[str, Any] = {}
    if single and "failed" not in single:
        for key, row in rows.items():
            if key == "single" or "failed" in row:
                continue
            per_round = [a["median_ms"] / b["median_ms"] for a, b in zip(row["rounds"], single["rounds"])]
            step_time[key] = {
                "ratio_of_medians": row["median_ms"] / single["median_ms"],
                "per_round": per_round,
                "per_round_median": statistics.median(per_round) if per_round else None,
                "oversubscribed": row["nprocs"] > 2,
            }
            checks[key] = {
                "first_loss": row["first_loss"],
                "one_process_first_loss": single["first_loss"],
                "abs_diff": abs(row["first_loss"] - single["first_loss"]),
                "ok": abs(row["first_loss"] - single["first_loss"]) <= LOSS_TOL,
            }

    result = {
        "benchmark": "bench_context_parallel",
        "spec": {**base, "mem_seq": args.mem_seq, "configs": keys, "memory_configs": args.memory_configs},
        "threads_per_rank": RANK_THREADS,
        "rows": rows,
        "traffic": traffic,
        "saved_for_backward": saved,
        "memory": memory,
        "memory_ratio": mem_summary,
        "memory_target": TARGET_MEMORY_RATIO,
        "step_time_over_one_process": step_time,
        "correctness_first_loss": checks,
        "torch_context_parallel": torch_cp,
        "failures": failures,
        "wall_s": time.perf_counter() - t_all,
        "rounds_wall_s": wall,
        **sources,
        "definitions": DEFINITIONS,
    }
    print_tables(result, args)
    return result


DEFINITIONS = {
    "traffic": "phalanx's collective log (phalanx.runtime.collective_log.LOG, on for one measured step after the "
    "timed ones, its recent-entry buffer unbounded): per rank, the elements of every entry. Ring: the send "
    "entries (labels 'ring attention kv', '... (backward)', 'ring attention dkv'); Ulysses: each all_to_all entry's "
    "payload is the whole local tensor, of which (N-1)/N is sent. 'forward' is what the forward logged, 'backward' "
    "everything after it (backward and optimizer step). Bytes = elements x the entry dtype's size",
    "gradient_reduction": "the 'ddp bucket' all-reduces over the cp ranks (dp = 1): payload = the gradients, and the "
    "ring all-reduce's 2P(N-1)/N elements sent per rank",
    "saved_for_backward": "torch.autograd.graph.saved_tensors_hooks around one forward (the measured step): "
    "unique_bytes counts each storage once (its whole nbytes, at the module that saved it first), tensor_bytes sums "
    "numel x element_size of every saved tensor; parameters are left out. Ratios are against one process on the "
    "whole sequence; max over ranks",
    "memory_peak": "per rank: VmHWM after the step minus VmRSS at the baseline (after setup and the first batch, "
    "gc.collect(), VmHWM reset to the current RSS through /proc/self/clear_refs), MiB; ru_maxrss over the baseline "
    "too (it also holds setup's and the parent's peak)",
    "memory_profile": "rank 0, one more step under torch.profiler(profile_memory=True): the running sum of the "
    "bytes allocated minus freed during the step, its peak, and the step's allocations alive at the peak with the "
    "op that made each and the module (forward) or autograd node (backward) around it",
    "step_time": "median over rounds of each round's median step (forward + backward + AdamW step + zero_grad; the "
    "slowest rank's), over one process's; 4-rank rows run 4 processes on 2 cores (oversubscribed)",
}


# ------------------------------------------------------------------------------------------ printing


def _alloc_peak(mrow: dict[str, Any]) -> int | None:
    """Rank 0's allocator peak over its profiled step's start (bytes), where that step was profiled."""
    prof = (mrow.get("ranks") or [{}])[0].get("profile")
    return prof["peak_bytes_over_step_start"] if prof else None


def _mib(x: float | None) -> str:
    return f"{x / 2**20:.2f}" if x is not None else "-"


def tables(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The markdown tables (printed, and written to results/context-parallel.md)."""
    spec = result["spec"]
    m = spec["model"]
    out: list[str] = []
    a = out.append
    n_params = next((r["n_params"] for r in result["rows"].values() if "n_params" in r), None)
    a(
        f"Model: transformers LlamaForCausalLM, vocab {m['vocab']}, hidden {m['hidden']}, intermediate "
        f"{m['intermediate']}, {m['layers']} layers, {m['heads']} heads / {m['kv_heads']} kv heads (head dim "
        f"{m['hidden'] // m['heads']}), untied head, fp32, {n_params} parameters; batch 1, no attention mask; AdamW. "
        f"{RANK_THREADS} thread per rank, gloo, 2 cores."
    )
    a("")
    a(f"### 1. Attention traffic per rank, {spec['seq']} tokens (elements sent; fp32 = 4 bytes each)")
    a("")
    a("| config | phase | measured / step | measured / layer | textbook / layer | textbook formula | measured / "
      "textbook | phalanx formula / layer | measured / phalanx formula | sends or all-to-alls / step |")  # fmt: skip
    a("|---|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for key, t in result["traffic"].items():
        for phase, p in t["phases"].items():
            a(
                f"| {key} | {phase} | {p['measured_sent_elements_per_step']:,} "
                f"({_mib(p['measured_sent_bytes_per_step'])} MiB) | {p['measured_sent_elements_per_layer']:,.0f} | "
                f"{p['textbook_elements_per_layer']:,} | "
                f"{p['textbook_formula']} | {p['measured_over_textbook']:.3f} | "
                f"{p['phalanx_formula_elements_per_layer']:,} | {p['measured_over_phalanx_formula']:.3f} | "
                f"{p['calls_per_step']} |"
            )
    a("")
    a("Units: " + "; ".join(f"{k}: {t['unit']}" for k, t in result["traffic"].items()))
    a("")
    a("Gradient reduction (the 'ddp bucket' all-reduces over the cp ranks), per step:")
    a("")
    a("| config | all-reduce payload (elements) | formula P | measured / formula | ring-sent elements / rank "
      "(2P(N-1)/N) | MiB sent / rank | other collectives (rank 0) |")  # fmt: skip
    a("|---|---:|---:|---:|---:|---:|---|")
    for key, t in result["traffic"].items():
        g = t["gradient_reduction"]
        other = "; ".join(f"{k}: {v['calls']} x, {v['elements']} el." for k, v in t["other_collectives_rank0"].items())
        a(
            f"| {key} | {g['payload_elements']:,} | {g['formula_payload_elements']:,} | "
            f"{g['measured_over_formula']:.3f} | {g['ring_sent_elements']:,.0f} | {_mib(g['ring_sent_bytes'])} | "
            f"{other or '-'} |"
        )
    a("")
    a("### 2. Saved-for-backward bytes per rank, one forward (unique storages; max over ranks / one process)")
    a("")
    sv = result["saved_for_backward"]
    if sv:
        L = m["layers"]
        head = "| config | 1/cp | total (MiB, max rank) | total ratio | " + " | ".join(
            f"L{i} attn | L{i} mlp | L{i} norms" for i in range(L)
        )
        a(head + " |")
        a("|---|---:|---:|---:|" + "---:|" * (3 * L))
        for key, s in sv.items():
            tot = max(p["unique_bytes_total"] for p in s["per_rank"])
            cells = []
            for i in range(L):
                lay = s["max_rank_ratio_per_layer"][f"layer{i}"]
                cells += [f"{lay['attention']:.3f}", f"{lay['mlp']:.3f}", f"{lay['norms']:.3f}"]
            a(
                f"| {key} | {s['one_over_cp']:.3f} | {_mib(tot)} | {s['max_rank_total_ratio']:.3f} | "
                + " | ".join(cells)
                + " |"
            )
        one = sv.get("single", {}).get("per_rank", [{}])[0].get("by_scope", {})
        if one:
            a("")
            a(
                "One process, MiB (unique / every saved tensor): "
                + ", ".join(
                    f"{k} {_mib(v['unique_bytes'])} / {_mib(v['tensor_bytes'])}" for k, v in sorted(one.items())
                )
            )
    a("")
    a(f"### 3. Peak memory at {spec['mem_seq']} tokens (each rank's peak RSS over its own baseline)")
    a("")
    mem = result["memory"]
    if mem:
        a(
            "| config | peak over baseline, MiB per rank | max rank | / one process | target | step s (max rank) | "
            "allocator peak, rank 0 (MiB) | / one process | user + sys CPU s, minor faults (rank 0) |"
        )
        a("|---|---|---:|---:|---:|---:|---:|---:|---|")
        for key, r in mem.items():
            if "failed" in r:
                a(f"| {key} | FAILED: {r['failed'][:200]} | | | | | | | |")
                continue
            ms = result["memory_ratio"].get(key)
            a(
                f"| {key} | {', '.join(f'{p:.0f}' for p in r['peak_over_baseline_mib_per_rank'])} | "
                f"{r['peak_over_baseline_mib_max_rank']:.0f} | {ms['ratio']:.3f} | "
                + (
                    f"<= {TARGET_MEMORY_RATIO} {'(meets)' if ms['meets_target'] else '(MISSES)'} | "
                    if ms["target"]
                    else "- | "
                )
                if ms
                else f"| {key} | {', '.join(f'{p:.0f}' for p in r['peak_over_baseline_mib_per_rank'])} | "
                f"{r['peak_over_baseline_mib_max_rank']:.0f} | 1 | | "
            )
            out[-1] += f"{max(r['step_s_per_rank']):.1f} | {_mib(_alloc_peak(r))} | "
            ar = ms.get("allocator_peak_ratio_rank0") if ms else (1.0 if _alloc_peak(r) else None)
            out[-1] += f"{ar:.3f} |" if ar is not None else "- |"
            out[-1] += (
                f" {r['step_user_s_per_rank'][0]:.1f} + {r['step_sys_s_per_rank'][0]:.1f}, "
                f"{r['step_minor_faults_per_rank'][0]:,} |"
            )
        for key, r in mem.items():
            prof = (r.get("ranks") or [{}])[0].get("profile") if "failed" not in r else None
            if not prof:
                continue
            a("")
            a(
                f"{key}, rank 0, profiled step: allocator peak {_mib(prof['peak_bytes_over_step_start'])} MiB over the "
                f"step's start, in {prof['peak_in']['context']} / {prof['peak_in']['op']}; alive at the peak, "
                f"by module or backward node (MiB): "
                + ", ".join(f"{k} {_mib(v)}" for k, v in list(prof["live_at_peak_by_context"].items())[:10])
            )
            a("")
            a("| made in | op | MiB each | count | MiB |")
            a("|---|---|---:|---:|---:|")
            for x in prof["live_at_peak_top"][:12]:
                a(f"| {x['context']} | {x['op']} | {_mib(x['bytes_each'])} | {x['count']} | {_mib(x['bytes'])} |")
    a("")
    a(f"### 4. Step time, {spec['seq']} tokens, against one process on the whole sequence")
    a("")
    a("| config | median ms | rounds min-max | / one process | per round | first loss | |diff| vs one process |")
    a("|---|---:|---:|---:|---|---:|---:|")
    for key, r in result["rows"].items():
        if "failed" in r:
            a(f"| {key} | FAILED: {r['failed'][:200]} | | | | | |")
            continue
        st = result["step_time_over_one_process"].get(key)
        ck = result["correctness_first_loss"].get(key)
        a(
            f"| {key} | {r['median_ms']:.1f} | {r['min_ms']:.0f}-{r['max_ms']:.0f} | "
            f"{st['ratio_of_medians']:.2f} | {', '.join(f'{x:.2f}' for x in st['per_round'])} | "
            if st
            else f"| {key} | {r['median_ms']:.1f} | {r['min_ms']:.0f}-{r['max_ms']:.0f} | 1 | | "
        )
        out[-1] += f"{r['first_loss']:.6f} | {ck['abs_diff']:.1e} |" if ck else f"{r['first_loss']:.6f} | |"
    a("")
    for row in result["torch_context_parallel"]:
        a(
            f"torch.distributed.tensor.experimental.context_parallel (2 ranks, CPU mesh, SDPA backend "
            f"{row['backend']}): "
            + ("runs" if row["runs"] else f"fails: `{' '.join((row['error'] or '').split())[:300]}`")
        )
    return out


def print_tables(result: dict[str, Any], args: argparse.Namespace) -> None:
    print("\n" + "\n".join(tables(result, args)))


def write_markdown(result: dict[str, Any], args: argparse.Namespace, argv: list[str] | None) -> None:
    if args.no_json:
        return
    cmd = " ".join(["python benchmarks/bench_context_parallel.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [
        "# Context parallelism: traffic, saved bytes, memory and step time (bench_context_parallel.py)",
        "",
        f"Command: `.venv/bin/{cmd.strip()}`; phalanx {result['phalanx_commit']} (sources "
        f"{result['phalanx_src_sha256']}), finished {result.get('finished', '')}, wall {result['wall_s']:.0f} s. "
        "Full figures: `context-parallel.json`.",
        "",
        *tables(result, args),
        "",
    ]
    out = Path(args.out)
    path = out / (f"{STEM}-{args.tag}.md" if args.tag else f"{STEM}.md")
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_flags(p, rounds=3, timeout=600.0)
    p.set_defaults(quiet_wait=10.0)
    p.add_argument("--configs", default="single,cp2,cp4,sp2,sp4", help="of: single, cp2, cp4, sp2, sp4")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per run")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (traffic, saved bytes, step time)")
    p.add_argument("--mem-seq", type=int, default=16384, help="tokens of the peak-memory measure")
    p.add_argument("--memory-configs", default="single,cp4,sp4", help="of: single, cp2, cp4, sp2, sp4")
    p.add_argument("--memory-timeout", type=float, default=1200.0, help="seconds one memory run may take")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measure")
    p.add_argument(
        "--profile-configs",
        default="single,cp4",
        help="memory configurations that run one more step with rank 0 under the memory profiler ('' for none)",
    )
    p.add_argument("--no-torch-probe", action="store_true", help="do not try torch's context_parallel")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--adamw", choices=["default", "foreach", "fused"], default="default")
    p.add_argument("--seed", type=int, default=1234)
    add_output_flags(p, HERE / "results", STEM)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = environment()
    result = bench(args)
    write_result(result, args, STEM, env, argv)
    write_markdown(result, args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
