"""Pipeline parallel benchmark: phalanx gpipe/1f1b/interleaved_1f1b/zb_h1 against torch.distributed.pipelining's
ScheduleGPipe/Schedule1F1B/ScheduleInterleaved1F1B/ScheduleInterleavedZeroBubble, on CPU over gloo, 2 ranks = 2
stages (pp=2, dp=1), 8 micro-batches. The interleaved rows hold 2 chunks per rank (4 chunks of 2 blocks); torch's
zero-bubble row is ScheduleInterleavedZeroBubble with one stage per rank, its ZB-H1 form.

    .venv/bin/python benchmarks/bench_pipeline.py                                    # 5 rounds (about 5 min)
    .venv/bin/python benchmarks/bench_pipeline.py --rounds 3
    .venv/bin/python benchmarks/bench_pipeline.py --only torch_1f1b,phalanx_1f1b --rounds 3
    .venv/bin/python benchmarks/bench_pipeline.py --rounds 1 --steps 3 --warmup 1 --no-json   # smoke run
    .venv/bin/python benchmarks/bench_pipeline.py --only torch_interleaved,phalanx_interleaved,torch_zb,phalanx_zb

Every configuration runs in fresh processes started by phalanx.spawn (2 ranks, gloo, 1 thread each); runs are
interleaved (every round runs every configuration once, in a rotated order), as in bench_ddp.py and bench_zero.py.
The workers are in pipeline_workers.py. See benchmarks/README.md for the columns.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # so that spawned processes (which inherit sys.path) import pipeline_workers

import pipeline_workers  # noqa: E402
from harness import (  # noqa: E402
    add_output_flags,
    add_round_flags,
    environment,
    interleaved_rounds,
    per_rank_median,
    slowest_rank,
    source_record,
    source_state,
    spawn_ranks,
    write_result,
)

WORKLOAD = "mlp"
# 8 residual MLP blocks x + fc2(gelu(fc1(x))), d=512 -> 2048 -> 512: 16.8M parameters, 4 blocks per stage.
DEFAULTS: dict[str, Any] = {
    "d": 512,
    "n_blocks": 8,
    "global_batch": 64,
    "microbatches": 8,
    "lr": 1e-3,
    "warmup": 5,
    "steps": 30,
}
NSTAGES = 2

# Every row's first and final loss against torch ScheduleGPipe's (relative).
TOL_FIRST, TOL_FINAL = 1e-5, 1e-5

TARGETS = {
    "phalanx_gpipe_over_torch_gpipe_step": ("phalanx gpipe", "torch ScheduleGPipe", 1.0),
    "phalanx_1f1b_over_torch_1f1b_step": ("phalanx 1f1b", "torch Schedule1F1B", 1.0),
    "phalanx_interleaved_over_torch_interleaved_step": (
        "phalanx interleaved_1f1b", "torch ScheduleInterleaved1F1B", 0.8,
    ),
    "phalanx_zb_h1_over_torch_zero_bubble_step": ("phalanx zb_h1", "torch ScheduleInterleavedZeroBubble", 0.8),
}  # fmt: skip
PEER = {  # the torch row of the same schedule
    "gpipe": "torch ScheduleGPipe",
    "1f1b": "torch Schedule1F1B",
    "interleaved_1f1b": "torch ScheduleInterleaved1F1B",
    "zb_h1": "torch ScheduleInterleavedZeroBubble",
}


def theory_bubble(schedule: str, p: int, m: int, costs: dict[str, float] | None = None) -> float:
    """Each stage's idle share of the step, by the schedule's formula (``phalanx.strategies.pipeline.actions``):
    gpipe and 1f1b (p-1)/(m+p-1); interleaved with v chunks (p-1)/(v m+p-1); ZB-H1
    (p-1)(F+B-W) / (m (F+B+W) + (p-1)(F+B-W)) with the measured F, B, W of one micro-batch on one stage."""
    if schedule == "interleaved_1f1b":
        return (p - 1) / (2 * m + p - 1)
    if schedule == "zb_h1" and costs:
        f, b, w = costs["F"], costs["B"], costs["W"]
        return (p - 1) * (f + b - w) / (m * (f + b + w) + (p - 1) * (f + b - w))
    if schedule == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


def simulated_bubble(schedule: str, p: int, m: int, kinds: list[dict[str, float]]) -> list[float]:
    """Each stage's idle share of the step when the schedule's actions take the times measured on that stage (ms
    per micro-batch per stage, split evenly over its chunks): the formula's theory, for stages that differ (under
    ZB-H1 the first stage has no input gradient to compute, so its B is empty and its W the whole backward)."""
    from phalanx.strategies.pipeline.actions import schedule_orders, simulate

    v = 2 if schedule == "interleaved_1f1b" else 1
    costs = [{k: t / v for k, t in kd.items()} for kd in kinds]
    for c in costs:
        c.setdefault("B", c.get("BW", 0.0))
        c.setdefault("W", 0.0)
    sim = simulate(schedule_orders(schedule, p, v, m), costs)
    step = max(sim["end"])
    return [idle / step for idle in sim["idle"]]


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    c: list[dict[str, Any]] = [
        {"key": "torch_gpipe", "name": "torch ScheduleGPipe", "kind": "torch", "schedule": "gpipe"},
        {"key": "torch_1f1b", "name": "torch Schedule1F1B", "kind": "torch", "schedule": "1f1b"},
        {"key": "phalanx_gpipe", "name": "phalanx gpipe", "kind": "phalanx", "schedule": "gpipe"},
        {"key": "phalanx_1f1b", "name": "phalanx 1f1b", "kind": "phalanx", "schedule": "1f1b"},
        {
            "key": "torch_interleaved",
            "name": "torch ScheduleInterleaved1F1B",
            "kind": "torch",
            "schedule": "interleaved_1f1b",
        },
        {
            "key": "phalanx_interleaved",
            "name": "phalanx interleaved_1f1b",
            "kind": "phalanx",
            "schedule": "interleaved_1f1b",
        },
        {"key": "torch_zb", "name": "torch ScheduleInterleavedZeroBubble", "kind": "torch", "schedule": "zb_h1"},
        {"key": "phalanx_zb", "name": "phalanx zb_h1", "kind": "phalanx", "schedule": "zb_h1"},
    ]
    if args.only:
        keep = {s.strip() for s in args.only.split(",") if s.strip()}
        c = [x for x in c if x["key"] in keep or x["kind"] in keep or x["name"] in keep]
    return c


def run_config(base: dict[str, Any], cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    spec = dict(base, schedule=cfg["schedule"])
    return spawn_ranks(pipeline_workers.run, NSTAGES, (cfg["kind"], spec), timeout)


def summarize_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    per_step = slowest_rank(results)
    last = results[-1]  # the last stage knows the loss under every configuration
    return {
        "median_ms": 1e3 * statistics.median(per_step),
        "step_ms": [1e3 * t for t in per_step],
        # per rank (= stage): median over timed steps of the schedule's wall time, of the time blocked in p2p waits,
        # and of their ratio (the measured bubble)
        "schedule_ms": [1e3 * statistics.median(r["schedule_s"]) for r in results],
        "wait_ms": [1e3 * statistics.median(r["wait_s"]) for r in results],
        "bubble": [statistics.median(w / s for w, s in zip(r["wait_s"], r["schedule_s"])) for r in results],
        "peak_rss_mib": [r["peak_hwm_mib"] for r in results],
        "ru_maxrss_mib": [r["peak_rss_mib"] for r in results],
        "setup_peak_rss_mib": [r["setup_peak_hwm_mib"] for r in results],
        "cpu_ms_per_step": [1e3 * r["cpu_per_step"] for r in results],
        "losses": list(last["losses"]),
        "param_checksum": sum(r["param_checksum"] for r in results),
        "stage_params": [r["n_stage_params"] for r in results],
        "threads": [r["threads"] for r in results],
        "describe": results[0].get("describe"),
        "split_check": [r.get("split_check") for r in results],
        # phalanx's action schedules: per rank, the median time of one micro-batch's F, B, W (BW) on one stage
        "kind_ms": [
            {
                k: 1e3 * statistics.median(r[f"{k}_s"]) / r.get("per_stage_micro", 1)
                for k in ("F", "B", "W", "BW")
                if r.get(f"{k}_s")
            }
            for r in results
        ],
    }


def _fmt(vals: list[Any], fmt: str = "{:.0f}") -> str:
    return "/".join("-" if v is None else fmt.format(v) for v in vals)


def base_spec(args: argparse.Namespace) -> dict[str, Any]:
    """What every configuration trains: the workload's size, seed, batches, warm-up and timed steps, AdamW."""
    base = dict(DEFAULTS, seed=args.seed, adamw=args.adamw)
    for k in ("d", "n_blocks", "global_batch", "microbatches", "warmup", "steps"):
        v = getattr(args, k)
        if v is not None:
            base[k] = v
    if base["global_batch"] % base["microbatches"]:
        raise SystemExit(
            f"global batch {base['global_batch']} is not divisible by {base['microbatches']} micro-batches"
        )
    if base["n_blocks"] % (2 * NSTAGES):
        raise SystemExit(f"{base['n_blocks']} blocks do not split evenly over {2 * NSTAGES} interleaved chunks")
    return base


def bench(args: argparse.Namespace) -> dict[str, Any]:
    base = base_spec(args)
    p, m = NSTAGES, base["microbatches"]
    theory = (p - 1) / (m + p - 1)
    d, nb = base["d"], base["n_blocks"]
    nparams = nb * (8 * d * d + 5 * d)
    configs = configurations(args)
    print(
        f"\n=== pipeline mlp: {nb} residual MLP blocks d={d} ({nparams:,} parameters), global batch "
        f"{base['global_batch']}, pp={p} on {p} ranks (gloo x 1 thread), m={m} micro-batches of "
        f"{base['global_batch'] // m}, {base['warmup']} warm-up + {base['steps']} timed steps, {args.rounds} rounds, "
        f"{len(configs)} configurations, AdamW {args.adamw} ===",
        flush=True,
    )
    start = source_state()
    print(f"phalanx checkout: {start[0]}, sources {start[1]}", flush=True)

    def headline(s: dict[str, Any]) -> str:
        return f"{s['median_ms']:8.1f} ms/step  bubble/stage {_fmt(s['bubble'], '{:.3f}')}"

    rounds, failures, wall = interleaved_rounds(
        configs, args, lambda cfg: run_config(base, cfg, args.timeout), summarize_round, headline
    )
    sources = source_record(start, source_state())

    # -------- aggregate
    rows = []
    for cfg in configs:
        rs = rounds[cfg["name"]]
        if not rs:
            rows.append({**cfg, "failed": failures.get(cfg["name"], "no result")})
            continue
        meds = [r["median_ms"] for r in rs]
        bubble = per_rank_median(rs, "bubble", NSTAGES)
        kinds = [
            {k: statistics.median(r["kind_ms"][rank][k] for r in rs) for k in rs[0]["kind_ms"][rank]}
            for rank in range(NSTAGES)
        ]
        row_theory = [theory_bubble(cfg["schedule"], p, m)] * NSTAGES
        if all(kinds) and cfg["schedule"] in ("interleaved_1f1b", "zb_h1"):
            row_theory = simulated_bubble(cfg["schedule"], p, m, kinds)
        rows.append(
            {
                **cfg,
                "theory_bubble": row_theory,
                "bubble_over_theory": [b / t if b is not None else None for b, t in zip(bubble, row_theory)],
                "ms_per_micro_batch_per_stage": kinds,
                "median_ms": statistics.median(meds),
                "min_ms": min(meds),
                "round_medians_ms": meds,
                "schedule_ms_per_stage": per_rank_median(rs, "schedule_ms", NSTAGES),
                "wait_ms_per_stage": per_rank_median(rs, "wait_ms", NSTAGES),
                "bubble_per_stage": bubble,
                "bubble_max": max(b for b in bubble if b is not None) if any(b is not None for b in bubble) else None,
                "peak_rss_mib_per_rank": per_rank_median(rs, "peak_rss_mib", NSTAGES),
                "ru_maxrss_mib_per_rank": per_rank_median(rs, "ru_maxrss_mib", NSTAGES),
                "setup_peak_rss_mib_per_rank": per_rank_median(rs, "setup_peak_rss_mib", NSTAGES),
                "cpu_ms_per_step_per_rank": per_rank_median(rs, "cpu_ms_per_step", NSTAGES),
                "foreign_load_cores": [r["foreign_load_cores"] for r in rs],
                "first_loss": rs[0]["losses"][0],
                "final_loss": rs[0]["losses"][-1],
                "losses": rs[0]["losses"],
                "param_checksum": rs[0]["param_checksum"],
                "stage_params": rs[0]["stage_params"],
                "threads_seen": rs[0]["threads"],
                "describe": rs[0]["describe"],
                "split_check": rs[0]["split_check"],
                **({"failed_later": failures[cfg["name"]]} if cfg["name"] in failures else {}),
            }
        )
    ok_rows = [r for r in rows if "failed" not in r]
    by = {r["name"]: r for r in ok_rows}
    for r in ok_rows:
        ref_name = PEER[r["schedule"]]
        r["x_torch_same_schedule"] = r["median_ms"] / by[ref_name]["median_ms"] if ref_name in by else None

    # -------- setup check: every row trains the same model as torch ScheduleGPipe (else the first row that ran)
    ref = by.get("torch ScheduleGPipe") or (ok_rows[0] if ok_rows else None)
    checks = []
    if ref is not None:
        for r in ok_rows:
            if r is ref:
                continue
            d_first = abs(r["first_loss"] - ref["first_loss"]) / abs(ref["first_loss"])
            d_last = abs(r["final_loss"] - ref["final_loss"]) / abs(ref["final_loss"])
            d_max = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
            d_sum = abs(r["param_checksum"] - ref["param_checksum"]) / max(1e-12, abs(ref["param_checksum"]))
            checks.append(
                {
                    "name": r["name"],
                    "reference": ref["name"],
                    "first_loss_rel_diff": d_first,
                    "final_loss_rel_diff": d_last,
                    "max_step_loss_rel_diff": d_max,
                    "param_checksum_rel_diff": d_sum,
                    "ok": d_first < TOL_FIRST and d_last < TOL_FINAL,
                }
            )

    # -------- target ratios
    targets: dict[str, Any] = {}
    for tname, (num, den, limit) in TARGETS.items():
        if num not in by or den not in by:
            continue
        ratio = by[num]["median_ms"] / by[den]["median_ms"]
        paired = [a["median_ms"] / b["median_ms"] for a, b in zip(rounds[num], rounds[den])]
        targets[tname] = {
            "ratio": ratio,
            "target": limit,
            "meets": ratio <= limit,
            "per_round": paired,
            "per_round_median": statistics.median(paired) if paired else None,
            "numerator": num,
            "denominator": den,
        }

    # -------- print (markdown)
    print(
        f"\n### pipeline `mlp` ({nparams:,} parameters, {nb} blocks, {nb // NSTAGES} per stage), global batch "
        f"{base['global_batch']}, pp={p}, m={m}, 2 ranks x 1 thread, gloo\n"
    )
    print(
        f"median over {args.rounds} rounds of the median step time (slower rank per step; {base['warmup']} warm-up + "
        f"{base['steps']} timed steps per run); wall {wall:.0f} s; theoretical bubble (p-1)/(m+p-1) = {theory:.3f}\n"
    )
    cols = [
        "configuration",
        "median ms",
        "rounds min-max",
        "x torch (same schedule)",
        "schedule ms/stage",
        "wait ms/stage",
        "bubble/stage",
        "theory",
        "bubble / theory",
        "peak RSS MiB/rank",
        "CPU ms/step/rank",
        "final loss",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['name']} | FAILED |" + " |" * (len(cols) - 2))
            continue
        spread = f"{min(r['round_medians_ms']):.1f}-{max(r['round_medians_ms']):.1f}"
        xt = f"{r['x_torch_same_schedule']:.3f}" if r["x_torch_same_schedule"] is not None else "-"
        print(
            f"| {r['name']} | {r['median_ms']:.1f} | {spread} | {xt} | {_fmt(r['schedule_ms_per_stage'], '{:.1f}')} | "
            f"{_fmt(r['wait_ms_per_stage'], '{:.1f}')} | {_fmt(r['bubble_per_stage'], '{:.3f}')} | "
            f"{_fmt(r['theory_bubble'], '{:.3f}')} | {_fmt(r['bubble_over_theory'], '{:.2f}')} | "
            f"{_fmt(r['peak_rss_mib_per_rank'])} | "
            f"{_fmt(r['cpu_ms_per_step_per_rank'])} | {r['final_loss']:.6f} |"
        )
    print(
        "\n(bubble = wait / schedule wall time per stage. phalanx: `last_step_timing` idle_s / step_s, the time "
        "blocked on p2p receives. torch: wall time inside `schedules._wait_batch_p2p` (receives, and in 1F1B the "
        "sends fused with them) / wall time of `schedule.step()`. theory: the schedule's formula, for zb_h1 with "
        "the measured F, B, W per micro-batch.)"
    )
    for r in ok_rows:
        if any(r["ms_per_micro_batch_per_stage"]):
            print(f"{r['name']}: ms per micro-batch per stage {r['ms_per_micro_batch_per_stage']}")
    if targets:
        print("\n| target | ratio | target | verdict | per round (median) |\n|---|---:|---:|---|---|")
        for t in targets.values():
            per = ", ".join(f"{x:.3f}" for x in t["per_round"]) or "-"
            pm = f" ({t['per_round_median']:.3f})" if t["per_round_median"] is not None else ""
            print(
                f"| {t['numerator']} / {t['denominator']} step time | {t['ratio']:.3f} | <= {t['target']} | "
                f"{'meets' if t['meets'] else 'MISSES'} | {per}{pm} |"
            )
    if checks and ref is not None:
        bad = [c for c in checks if not c["ok"]]
        print(
            f"\nsetup check vs {ref['name']} (same init, same global batches; first and final loss rel diff < "
            f"{TOL_FIRST:g} / {TOL_FINAL:g}): "
            + ("OK" if not bad else "FAILED for " + ", ".join(c["name"] for c in bad))
        )
        for c in checks:
            print(
                f"  {c['name']:<22} first {c['first_loss_rel_diff']:.1e}, final {c['final_loss_rel_diff']:.1e}, "
                f"max over steps {c['max_step_loss_rel_diff']:.1e}, param checksum {c['param_checksum_rel_diff']:.1e}"
                + ("" if c["ok"] else "   <-- MISMATCH")
            )
    splits = [(r["name"], r["split_check"]) for r in ok_rows if r["kind"] == "phalanx"]
    for name, sc in splits:
        ok = all(s and s.get("ok") for s in sc)
        print(
            f"split check {name}: "
            + (
                "stage k holds blocks " + "; ".join(f"{s['stage']}: {s['blocks']}" for s in sc)
                if ok
                else f"FAILED {sc}"
            )
        )
    if failures:
        print("\nfailed configurations:")
        for name, err in failures.items():
            print(f"  {name}: {err[-3000:]}")

    return {
        "workload": WORKLOAD,
        "param_count": nparams,
        "base_spec": base,
        "nstages": NSTAGES,
        "theoretical_bubble": theory,
        "rounds": args.rounds,
        "wall_s": wall,
        "definitions": {
            "median_ms": "median over rounds of (median over timed steps of the step time, the slowest rank per step); "
            "a step is the schedule (torch: schedule.step(); phalanx: engine.train_step(), which includes "
            "the optimizer step) + optimizer.step() + zero_grad()",
            "x_torch_same_schedule": "median_ms / median_ms of the torch row with the same schedule (lower is better)",
            "schedule_ms_per_stage": "median over steps of the schedule's own wall time (phalanx: last_step_timing"
            "['step_s']; torch: schedule.step()), median over rounds",
            "wait_ms_per_stage": "phalanx: last_step_timing['idle_s'] (blocked on p2p receives); torch: wall time in "
            "schedules._wait_batch_p2p (all p2p waits; 1F1B fuses sends with receives)",
            "bubble_per_stage": "median over steps of wait / schedule time, median over rounds",
            "theoretical_bubble": "(p-1)/(m+p-1) for gpipe and 1f1b (the header's figure); per row: theory_bubble",
            "theory_bubble": theory_bubble.__doc__,
            "bubble_over_theory": "bubble_per_stage / theory_bubble",
            "peak_rss_mib_per_rank": "VmHWM of /proc/self/status at the end of training, median over rounds",
            "ru_maxrss_mib_per_rank": "getrusage(RUSAGE_SELF).ru_maxrss at the end of training (never below the "
            "driver's RSS, see bench_zero)",
            "targets": {k: f"{v[0]} / {v[1]} step time <= {v[2]}" for k, v in TARGETS.items()},
            "setup_checks": f"first and final loss (last stage) relative to torch ScheduleGPipe's: < {TOL_FIRST:g} "
            f"and < {TOL_FINAL:g}; param_checksum = sum over stages of the float64 sum of parameters",
        },
        **sources,
        "targets": targets,
        "setup_checks": checks,
        "failures": failures,
        "configs": rows,
        "raw_rounds": rounds,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_flags(p, rounds=5)
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per run ({DEFAULTS['steps']})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed warm-up steps per run ({DEFAULTS['warmup']})")
    p.add_argument(
        "--global-batch", dest="global_batch", type=int, default=None, help=f"global batch ({DEFAULTS['global_batch']})"
    )
    p.add_argument("--microbatches", type=int, default=None, help=f"micro-batches m ({DEFAULTS['microbatches']})")
    p.add_argument("--d", type=int, default=None, help=f"block width ({DEFAULTS['d']})")
    p.add_argument("--blocks", dest="n_blocks", type=int, default=None, help=f"blocks ({DEFAULTS['n_blocks']})")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated keys, kinds or names: torch_gpipe, torch_1f1b, phalanx_gpipe, phalanx_1f1b, "
        "torch_interleaved, phalanx_interleaved, torch_zb, phalanx_zb (kinds: torch, phalanx)",
    )
    p.add_argument("--adamw", choices=["default", "foreach", "fused"], default="default")
    p.add_argument("--seed", type=int, default=1234)
    add_output_flags(p, HERE / "results", f"pipeline-{WORKLOAD}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    env = environment()
    result = bench(args)
    write_result(result, args, f"pipeline-{WORKLOAD}", env, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
