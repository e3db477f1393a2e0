"""Data-parallel benchmark: phalanx ddp against one process, torch DDP and Accelerate, on CPU over gloo.

    .venv/bin/python benchmarks/bench_ddp.py                      # both workloads, 5 rounds
    .venv/bin/python benchmarks/bench_ddp.py --workload mlp --rounds 3 --steps 10
    .venv/bin/python benchmarks/bench_ddp.py --workload mlp --bucket-mb 4,8,50   # extra phalanx bucket sizes
    .venv/bin/python benchmarks/bench_ddp.py --workload mlp --guard-off --only phalanx_ddp # the non-finite guard's cost
    .venv/bin/python benchmarks/bench_ddp.py --workload mlp --watchdog-rows --only phalanx_ddp   # the hang watchdog's

Each configuration runs in fresh processes started by phalanx.spawn (2 ranks with 1 thread each, or 1 process
with 1 or 2 threads). Runs are interleaved: every round runs every configuration once, in a rotated order, so
background load hits all of them alike. See benchmarks/README.md for what the columns mean.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # so that spawned processes (which inherit sys.path) import ddp_workers

import ddp_workers  # noqa: E402
from harness import (  # noqa: E402
    RANK_THREADS,
    add_output_flags,
    add_round_flags,
    environment,
    free_port,
    git_state,
    interleaved_rounds,
    mean_over_ranks,
    per_rank_median,
    slowest_rank,
    spawn_ranks,
    watchdog_rows,
    write_result,
)

WORKLOADS: dict[str, dict[str, Any]] = {
    # 8 x Linear(1024, 1024): 8.4M parameters, 33.6 MB of fp32 gradients per step.
    "mlp": {"global_batch": 64, "lr": 1e-3, "warmup": 5, "steps": 30},
    # phalanx.demo.TinyGPT(GPTConfig()): 0.84M parameters, 128-token byte sequences.
    "gpt": {"global_batch": 16, "lr": 1e-3, "warmup": 3, "steps": 15},
}


def accelerate_status() -> tuple[bool, str]:
    try:
        import accelerate

        return True, f"accelerate {accelerate.__version__}"
    except Exception as e:  # noqa: BLE001
        return (
            False,
            f"accelerate is not importable ({type(e).__name__}: {e}); install it with a constraints file pinning torch",
        )


def configurations(args: argparse.Namespace, gb: int, nranks: int) -> list[dict[str, Any]]:
    per_rank = gb // nranks
    configs = [
        {"name": "1 proc, 1 thread", "kind": "single", "nprocs": 1, "threads": 1, "local_batch": gb},
        {"name": "1 proc, 2 threads", "kind": "single", "nprocs": 1, "threads": 2, "local_batch": gb},
        {
            "name": "1 proc, 1 thread, per-rank batch",
            "kind": "single",
            "nprocs": 1,
            "threads": 1,
            "local_batch": per_rank,
            "trains_subset": True,
        },
        {"name": "torch DDP", "kind": "torch_ddp", "nprocs": nranks, "threads": RANK_THREADS, "local_batch": per_rank},
        {
            "name": "phalanx ddp",
            "kind": "phalanx_ddp",
            "nprocs": nranks,
            "threads": RANK_THREADS,
            "local_batch": per_rank,
        },
    ]
    if args.torch_bucket_view:
        configs.append(
            {
                "name": "torch DDP gradient_as_bucket_view",
                "kind": "torch_ddp",
                "nprocs": nranks,
                "threads": RANK_THREADS,
                "local_batch": per_rank,
                "ddp_kwargs": {"gradient_as_bucket_view": True},
            }
        )
    for mb in args.bucket_mb:
        configs.append(
            {
                "name": f"phalanx ddp bucket_mb={mb:g}",
                "kind": "phalanx_ddp",
                "nprocs": nranks,
                "threads": RANK_THREADS,
                "local_batch": per_rank,
                "bucket_mb": mb,
            }
        )
    if args.guard_off:
        configs.append(
            {
                "name": "phalanx ddp on_nonfinite=ignore",
                "kind": "phalanx_ddp",
                "nprocs": nranks,
                "threads": RANK_THREADS,
                "local_batch": per_rank,
                "on_nonfinite": "ignore",
            }
        )
    if args.watchdog_rows:
        for name, kw in watchdog_rows():
            configs.append(
                {
                    "name": f"phalanx ddp {name}",
                    "kind": "phalanx_ddp",
                    "nprocs": nranks,
                    "threads": RANK_THREADS,
                    "local_batch": per_rank,
                    "engine_kwargs": kw,
                }
            )
    if not args.no_accelerate:
        ok, why = accelerate_status()
        if ok:
            configs.append(
                {
                    "name": "accelerate",
                    "kind": "accelerate",
                    "nprocs": nranks,
                    "threads": RANK_THREADS,
                    "local_batch": per_rank,
                }
            )
        else:
            print(f"[skip] accelerate: {why}")
    else:
        print("[skip] accelerate: --no-accelerate")
    if args.only:
        keep = [s.strip() for s in args.only.split(",")]
        configs = [c for c in configs if c["kind"] in keep or c["name"] in keep]
    return configs


def run_config(
    workload: str, base: dict[str, Any], cfg: dict[str, Any], timeout: float, profile_dir: str | None = None
) -> list[dict[str, Any]]:
    spec = dict(base, local_batch=cfg["local_batch"])
    if "bucket_mb" in cfg:
        spec["bucket_mb"] = cfg["bucket_mb"]
    if "ddp_kwargs" in cfg:
        spec["ddp_kwargs"] = cfg["ddp_kwargs"]
    if "on_nonfinite" in cfg:
        spec["on_nonfinite"] = cfg["on_nonfinite"]
    if "engine_kwargs" in cfg:
        spec["engine_kwargs"] = cfg["engine_kwargs"]
    if cfg["kind"] == "accelerate":
        spec["master_port"] = free_port()
    if profile_dir:
        slug = "".join(ch if ch.isalnum() else "_" for ch in cfg["name"]).strip("_")
        spec["profile"] = str(Path(profile_dir) / f"{workload}-{slug}")
    return spawn_ranks(ddp_workers.run, cfg["nprocs"], (cfg["kind"], workload, spec), timeout, threads=cfg["threads"])


def summarize_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    per_step = slowest_rank(results)
    losses = mean_over_ranks(results)  # equal local batches
    return {
        "median_ms": 1e3 * statistics.median(per_step),
        "step_ms": [1e3 * t for t in per_step],
        "peak_rss_mib": [r["peak_rss_mib"] for r in results],
        "cpu_ms_per_step": [1e3 * r["cpu_per_step"] for r in results],
        "minor_faults_per_step": [r["minor_faults_per_step"] for r in results],
        "losses": losses,
        "param_checksum": results[0]["param_checksum"],
        "threads": results[0]["threads"],
        **({"describe": results[0]["describe"]} if "describe" in results[0] else {}),
        **({"distributed_type": results[0]["distributed_type"]} if "distributed_type" in results[0] else {}),
    }


def base_spec(workload: str, args: argparse.Namespace, nranks: int = 2) -> dict[str, Any]:
    """What every configuration of ``workload`` trains: seed, global batch, lr, warm-up and timed steps, data, AdamW."""
    w = WORKLOADS[workload]
    gb = args.global_batch or w["global_batch"]
    if gb % nranks:
        raise SystemExit(f"--global-batch {gb} must be divisible by {nranks}")
    return {
        "seed": args.seed,
        "global_batch": gb,
        "lr": w["lr"],
        "warmup": args.warmup if args.warmup is not None else w["warmup"],
        "steps": args.steps if args.steps is not None else w["steps"],
        "gpt_data": args.gpt_data,
        "adamw": args.adamw,
    }


def bench_workload(workload: str, args: argparse.Namespace) -> dict[str, Any]:
    nranks = 2
    base = base_spec(workload, args, nranks)
    gb = base["global_batch"]
    configs = configurations(args, gb, nranks)
    print(
        f"\n=== workload {workload}: global batch {gb}, {nranks} ranks on gloo, {base['warmup']} warm-up + "
        f"{base['steps']} timed steps, {args.rounds} rounds, {len(configs)} configurations, AdamW {args.adamw} ===",
        flush=True,
    )
    commit_start = git_state()
    print(f"phalanx checkout: {commit_start}", flush=True)
    rounds, _, wall = interleaved_rounds(
        configs,
        args,
        lambda cfg: run_config(workload, base, cfg, args.timeout, args.profile),
        summarize_round,
        lambda s: f"{s['median_ms']:8.1f} ms/step",
        keep_going=False,
    )
    commit_end = git_state()
    if commit_end != commit_start:
        print(
            f"WARNING: the phalanx checkout changed during the run ({commit_start} -> {commit_end}); "
            "the phalanx rows mix two versions of the code. Run it again."
        )

    # -------- aggregate: the median over rounds of each round's median step
    rows = []
    for cfg in configs:
        rs = rounds[cfg["name"]]
        meds = [r["median_ms"] for r in rs]
        nproc = cfg["nprocs"]
        rss = per_rank_median(rs, "peak_rss_mib", nproc)
        cpu = per_rank_median(rs, "cpu_ms_per_step", nproc)
        faults = per_rank_median(rs, "minor_faults_per_step", nproc)
        rows.append(
            {
                **{k: v for k, v in cfg.items()},
                "median_ms": statistics.median(meds),
                "min_ms": min(meds),
                "round_medians_ms": meds,
                "peak_rss_mib_per_rank": rss,
                "cpu_ms_per_step_per_rank": cpu,
                "minor_faults_per_step_per_rank": faults,
                "foreign_load_cores": [r["foreign_load_cores"] for r in rs],
                "steal_cores": [r["steal_cores"] for r in rs],
                "final_loss": rs[0]["losses"][-1],
                "first_loss": rs[0]["losses"][0],
                "losses": rs[0]["losses"],
                "param_checksum": rs[0]["param_checksum"],
                "threads_seen": rs[0]["threads"],
                **({"describe": rs[0]["describe"]} if "describe" in rs[0] else {}),
                **({"distributed_type": rs[0]["distributed_type"]} if "distributed_type" in rs[0] else {}),
            }
        )
    by = {r["name"]: r for r in rows}
    ddp_ms = by["torch DDP"]["median_ms"] if "torch DDP" in by else None
    for r in rows:
        r["x_torch_ddp"] = r["median_ms"] / ddp_ms if ddp_ms else None

    # -------- setup check: every full-batch configuration trains the same model on the same data
    ref = by.get("1 proc, 1 thread")
    checks = []
    if ref is not None:
        for r in rows:
            if r is ref or r.get("trains_subset"):
                continue
            d_first = abs(r["first_loss"] - ref["first_loss"]) / abs(ref["first_loss"])
            d_last = abs(r["final_loss"] - ref["final_loss"]) / abs(ref["final_loss"])
            d_sum = abs(r["param_checksum"] - ref["param_checksum"]) / max(1e-12, abs(ref["param_checksum"]))
            ok = d_first < 1e-5 and d_last < 1e-3
            checks.append(
                {
                    "name": r["name"],
                    "first_loss_rel_diff": d_first,
                    "final_loss_rel_diff": d_last,
                    "param_checksum_rel_diff": d_sum,
                    "ok": ok,
                }
            )

    # -------- scaling efficiency: 1-process step at the per-rank batch (1 thread) / 2-rank step
    t1_local = by.get("1 proc, 1 thread, per-rank batch", {}).get("median_ms")
    for r in rows:
        r["scaling_efficiency"] = (t1_local / r["median_ms"]) if (t1_local and r["nprocs"] > 1) else None

    # -------- print
    print(
        f"\nworkload {workload}: median over {args.rounds} rounds of the median step time "
        f"(after {base['warmup']} warm-up steps, {base['steps']} timed steps per round); wall {wall:.0f} s"
    )
    hdr = (
        f"{'configuration':<34} {'procs x thr':>11} {'batch/proc':>10} {'median ms':>10} {'rounds min-max':>15} "
        f"{'x torch DDP':>11} {'scaling eff':>11} {'peak RSS MiB/rank':>18} {'CPU ms/step/rank':>17} "
        f"{'faults/step/rank':>17} {'final loss':>11}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        spread = f"{min(r['round_medians_ms']):.1f}-{max(r['round_medians_ms']):.1f}"
        xd = f"{r['x_torch_ddp']:.3f}" if r["x_torch_ddp"] is not None else "-"
        se = f"{r['scaling_efficiency']:.3f}" if r["scaling_efficiency"] is not None else "-"
        rss = "/".join(f"{v:.0f}" for v in r["peak_rss_mib_per_rank"])
        cpu = "/".join(f"{v:.0f}" for v in r["cpu_ms_per_step_per_rank"])
        flt = "/".join(f"{v:.0f}" for v in r["minor_faults_per_step_per_rank"])
        print(
            f"{r['name']:<34} {str(r['nprocs']) + ' x ' + str(r['threads']):>11} {r['local_batch']:>10} "
            f"{r['median_ms']:>10.1f} {spread:>15} {xd:>11} {se:>11} {rss:>18} {cpu:>17} {flt:>17} "
            f"{r['final_loss']:>11.5f}"
        )
    headline: dict[str, Any] = {}
    if "phalanx ddp" in by and ddp_ms:
        headline["phalanx_ddp_over_torch_ddp"] = by["phalanx ddp"]["median_ms"] / ddp_ms
        # The same ratio per round (the two runs were close in time), then the median: less sensitive to drift.
        paired = [a["median_ms"] / b["median_ms"] for a, b in zip(rounds["phalanx ddp"], rounds["torch DDP"])]
        headline["phalanx_ddp_over_torch_ddp_paired"] = statistics.median(paired)
        headline["phalanx_ddp_over_torch_ddp_per_round"] = paired
        headline["phalanx_ddp_scaling_efficiency"] = by["phalanx ddp"]["scaling_efficiency"]
        headline["torch_ddp_scaling_efficiency"] = by["torch DDP"]["scaling_efficiency"]
        verdict = "meets" if headline["phalanx_ddp_over_torch_ddp"] <= 1.0 else "MISSES"
        print(
            f"\nheadline  phalanx ddp / torch DDP = {headline['phalanx_ddp_over_torch_ddp']:.3f}  "
            f"(target <= 1.00: {verdict}); per round: {', '.join(f'{x:.3f}' for x in paired)} "
            f"(median {headline['phalanx_ddp_over_torch_ddp_paired']:.3f})"
        )
    if t1_local:
        effs = ", ".join(
            f"{r['name']} {r['scaling_efficiency']:.3f}" for r in rows if r["scaling_efficiency"] is not None
        )
        print(
            f"scaling efficiency = T(1 proc, 1 thread, per-rank batch {gb // nranks}) / T(2 ranks, batch "
            f"{gb // nranks} each): {effs}  (1.0 = perfect: 2 ranks do twice the work in the same time)"
        )
    if checks:
        bad = [c for c in checks if not c["ok"]]
        print(
            "setup check vs '1 proc, 1 thread' (same init, same global batches): "
            + ("OK" if not bad else "FAILED for " + ", ".join(c["name"] for c in bad))
        )
        for c in checks:
            print(
                f"  {c['name']:<34} first loss rel diff {c['first_loss_rel_diff']:.1e}, final loss rel diff "
                f"{c['final_loss_rel_diff']:.1e}, param checksum rel diff {c['param_checksum_rel_diff']:.1e}"
            )

    return {
        "workload": workload,
        "base_spec": base,
        "nranks": nranks,
        "rounds": args.rounds,
        "wall_s": wall,
        "definitions": {
            "median_ms": "median over rounds of (median over timed steps of the step time, the slowest rank per step); "
            "a step is forward + backward + optimizer.step() + zero_grad()",
            "x_torch_ddp": "median_ms / median_ms of torch DDP (lower is better)",
            "scaling_efficiency": "median_ms of '1 proc, 1 thread, per-rank batch' / median_ms of the 2-rank "
            "configuration (same per-rank batch; 1.0 is perfect scaling)",
            "peak_rss_mib_per_rank": "resource.getrusage(RUSAGE_SELF).ru_maxrss of each rank, median over rounds",
            "cpu_ms_per_step_per_rank": "time.process_time() of each rank (all its threads, gloo's included) per timed "
            "step, median over rounds; CPU time above the step time means the rank ran "
            "more than one thread at once",
            "minor_faults_per_step_per_rank": "minor page faults per timed step of each rank (ru_minflt), median over "
            "rounds: memory the allocator took fresh from the kernel",
            "foreign_load_cores": "per round: CPU time used by processes other than this benchmark during the run / "
            "wall time (0 = the machine was ours; 1 = another process kept a whole core busy)",
        },
        "headline": headline,
        "phalanx_commit": commit_start if commit_start == commit_end else f"{commit_start} -> {commit_end} (changed)",
        "setup_checks": checks,
        "configs": rows,
        "raw_rounds": rounds,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["mlp", "gpt", "all"], default="all")
    add_round_flags(p, rounds=5, timeout=600.0)
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: per workload)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps per run (default: per workload)")
    p.add_argument("--global-batch", type=int, default=None, help="global batch (default: mlp 64, gpt 16)")
    p.add_argument(
        "--watchdog-rows",
        action="store_true",
        help="add rows with the hang watchdog off (hang_timeout_s=0) and with debug_collectives: their cost",
    )
    p.add_argument(
        "--guard-off",
        action="store_true",
        help="add a row of phalanx ddp with on_nonfinite='ignore': the non-finite guard's cost, side by side",
    )
    p.add_argument(
        "--bucket-mb",
        type=lambda s: [float(x) for x in s.split(",") if x],
        default=[],
        help="extra phalanx ddp configurations with these bucket sizes, e.g. 4,8,50",
    )
    p.add_argument(
        "--torch-bucket-view",
        action="store_true",
        help="add a torch DDP row with gradient_as_bucket_view=True (no gradient copies, like phalanx)",
    )
    p.add_argument(
        "--gpt-data",
        choices=["stdlib", "random"],
        default="stdlib",
        help="gpt tokens: windows of the stdlib source (phalanx.demo.load_stdlib_bytes) or random bytes",
    )
    p.add_argument(
        "--adamw",
        choices=["default", "foreach", "fused"],
        default="default",
        help="AdamW implementation for every configuration (default: torch's per-tensor loop on CPU)",
    )
    p.add_argument(
        "--only", default="", help="comma-separated kinds or names to run (single, torch_ddp, phalanx_ddp, ...)"
    )
    p.add_argument("--no-accelerate", action="store_true")
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="record the timed steps with torch.profiler: DIR/<workload>-<config>.rank<r>.{txt,json} "
        "(slows the steps down; use with --rounds 1 and --no-json)",
    )
    p.add_argument("--seed", type=int, default=1234)
    add_output_flags(p, HERE / "results", "ddp-<workload>")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)

    env = environment(accelerate=accelerate_status()[1])
    workloads = ["mlp", "gpt"] if args.workload == "all" else [args.workload]
    for wl in workloads:
        write_result(bench_workload(wl, args), args, f"ddp-{wl}", env, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
