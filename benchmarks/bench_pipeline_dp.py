"""Pipeline x data parallel benchmark: phalanx's pipeline with whole (pp_zero_stage 0) and sharded (pp_zero_stage 1,
ZeRO-1) stage optimizers, against DeepSpeed's PipelineEngine with ZeRO stage 0 and 1, pp=2 x dp=2 on 4 ranks.

    .venv/bin/python benchmarks/bench_pipeline_dp.py --rounds 3                 # about 6 min
    .venv/bin/python benchmarks/bench_pipeline_dp.py --only phalanx --rounds 3  # without DeepSpeed
    .venv/bin/python benchmarks/bench_pipeline_dp.py --rounds 1 --steps 3 --warmup 1 --no-json   # smoke run

4 processes on this machine's 2 cores (1 thread each) share the cores, so step times measure the total work of all
ranks more than the overlap; the ratios between rows are what to read. The memory columns do not depend on that:
``optimizer state`` is the bytes of AdamW moments each rank holds. DeepSpeed is skipped when it is not importable
(see benchmarks/README.md for installing it). The workers are in pipeline_dp_workers.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # so that spawned processes (which inherit sys.path) import the workers

import pipeline_dp_workers  # noqa: E402
from harness import (  # noqa: E402
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

STEM = "pipeline-dp-mlp"
DEFAULTS: dict[str, Any] = {"d": 512, "n_blocks": 8, "global_batch": 64, "microbatches": 8, "lr": 1e-3,
                            "warmup": 3, "steps": 15, "schedule": "1f1b", "pp": 2, "dp": 2}  # fmt: skip
TOL = 1e-5  # every row's per-step loss against phalanx pp_zero_stage=0's (relative)


def configurations(only: str) -> list[dict[str, Any]]:
    c = [
        {"key": "phalanx_pp", "name": "phalanx pipeline", "kind": "phalanx", "zero_stage": 0},
        {"key": "phalanx_pp_zero1", "name": "phalanx pipeline + zero1", "kind": "phalanx", "zero_stage": 1},
        {"key": "ds_pp", "name": "DeepSpeed pipeline", "kind": "deepspeed", "zero_stage": 0},
        {"key": "ds_pp_zero1", "name": "DeepSpeed pipeline + ZeRO-1", "kind": "deepspeed", "zero_stage": 1},
    ]
    if importlib.util.find_spec("deepspeed") is None:
        print("deepspeed is not importable: its rows are skipped", flush=True)
        c = [x for x in c if x["kind"] != "deepspeed"]
    keep = {s.strip() for s in only.split(",") if s.strip()}
    return [x for x in c if not keep or x["key"] in keep or x["kind"] in keep]


def summarize(results: list[dict[str, Any]], dp: int) -> dict[str, Any]:
    per_step = slowest_rank(results)
    losses = mean_over_ranks(results[-dp:])  # the last stage's replicas: the mean of their losses is the step's loss
    return {
        "median_ms": 1e3 * statistics.median(per_step),
        "losses": losses,
        "param_checksum": sum(r["param_checksum"] for r in results),
        "optimizer_state_mib": [r["optimizer_state_bytes"] / 2**20 for r in results],
        "stage_params": [r["n_stage_params"] for r in results],
        "peak_rss_mib": [r["peak_hwm_mib"] for r in results],
        "describe": results[0].get("describe"),
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    base = dict(DEFAULTS, seed=args.seed)
    for k in ("steps", "warmup"):
        if getattr(args, k) is not None:
            base[k] = getattr(args, k)
    world = base["pp"] * base["dp"]
    configs = configurations(args.only)
    d, nb = base["d"], base["n_blocks"]
    print(
        f"\n=== pipeline x dp: {nb} residual MLP blocks d={d} ({nb * (8 * d * d + 5 * d):,} parameters), "
        f"pp={base['pp']} x dp={base['dp']} on {world} ranks (gloo x 1 thread), {base['schedule']}, "
        f"m={base['microbatches']}, "
        f"global batch {base['global_batch']}, {base['warmup']} warm-up + {base['steps']} timed steps ===",
        flush=True,
    )
    start = source_state()

    def run(cfg: dict[str, Any]) -> list[dict[str, Any]]:
        spec = dict(base, zero_stage=cfg["zero_stage"])
        return spawn_ranks(pipeline_dp_workers.run, world, (cfg["kind"], spec), args.timeout)

    def headline(s: dict[str, Any]) -> str:
        opt = "/".join(f"{v:.1f}" for v in s["optimizer_state_mib"])
        return f"{s['median_ms']:8.1f} ms/step  optimizer state MiB/rank {opt}"

    rounds, failures, wall = interleaved_rounds(configs, args, run, lambda r: summarize(r, base["dp"]), headline)
    sources = source_record(start, source_state())
    rows = []
    for cfg in configs:
        rs = rounds[cfg["name"]]
        if not rs:
            rows.append({**cfg, "failed": failures.get(cfg["name"], "no result")})
            continue
        rows.append(
            {
                **cfg,
                "median_ms": statistics.median(r["median_ms"] for r in rs),
                "round_medians_ms": [r["median_ms"] for r in rs],
                "optimizer_state_mib_per_rank": rs[0]["optimizer_state_mib"],
                "peak_rss_mib_per_rank": [statistics.median(r["peak_rss_mib"][k] for r in rs) for k in range(world)],
                "losses": rs[0]["losses"],
                "param_checksum": rs[0]["param_checksum"],
                "stage_params": rs[0]["stage_params"],
                "describe": rs[0]["describe"],
            }
        )
    by = {r["key"]: r for r in rows if "failed" not in r}
    ref = by.get("phalanx_pp")
    checks = []
    for r in by.values():
        if ref is not None and r is not ref:
            d_loss = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
            d_sum = abs(r["param_checksum"] - ref["param_checksum"]) / abs(ref["param_checksum"])
            checks.append(
                {
                    "name": r["name"],
                    "max_step_loss_rel_diff": d_loss,
                    "param_checksum_rel_diff": d_sum,
                    "ok": d_loss < TOL,
                }
            )
    ratios: dict[str, Any] = {}
    for name, (num, den) in {
        "zero1_over_pp_step": ("phalanx_pp_zero1", "phalanx_pp"),
        "zero1_over_ds_zero1_step": ("phalanx_pp_zero1", "ds_pp_zero1"),
        "pp_over_ds_pp_step": ("phalanx_pp", "ds_pp"),
    }.items():
        if num in by and den in by:
            a, b = by[num], by[den]
            paired = [x["median_ms"] / y["median_ms"] for x, y in zip(rounds[a["name"]], rounds[b["name"]])]
            ratios[name] = {"ratio": a["median_ms"] / b["median_ms"], "per_round": paired}
    if "phalanx_pp_zero1" in by and "phalanx_pp" in by:
        ratios["zero1_over_pp_optimizer_state"] = {
            "ratio": max(by["phalanx_pp_zero1"]["optimizer_state_mib_per_rank"])
            / max(by["phalanx_pp"]["optimizer_state_mib_per_rank"])
        }

    print(
        f"\n### pp={base['pp']} x dp={base['dp']}, {world} ranks x 1 thread on {world // 2 if world > 2 else 1}x "
        f"oversubscribed cores; wall {wall:.0f} s\n"
    )
    print("| configuration | median ms/step | per round | optimizer state MiB per rank | peak RSS MiB per rank |")
    print("|---|---:|---|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['name']} | failed: {r['failed'][:120]} | | | |")
            continue
        print(
            f"| {r['name']} | {r['median_ms']:.1f} | {', '.join(f'{v:.0f}' for v in r['round_medians_ms'])} | "
            f"{' / '.join(f'{v:.1f}' for v in r['optimizer_state_mib_per_rank'])} | "
            f"{' / '.join(f'{v:.0f}' for v in r['peak_rss_mib_per_rank'])} |"
        )
    for name, v in ratios.items():
        per = f" (per round {', '.join(f'{x:.2f}' for x in v['per_round'])})" if "per_round" in v else ""
        print(f"- {name}: {v['ratio']:.2f}{per}")
    for c in checks:
        print(
            f"- same model as phalanx pipeline: {c['name']}: max step loss rel diff {c['max_step_loss_rel_diff']:.1e}, "
            f"checksum rel diff {c['param_checksum_rel_diff']:.1e}{'' if c['ok'] else '  MISMATCH'}"
        )
    return {
        "workload": base,
        "wall_s": wall,
        **sources,
        "ratios": ratios,
        "setup_checks": checks,
        "failures": failures,
        "configs": rows,
        "raw_rounds": rounds,
        "definitions": {
            "median_ms": "median over rounds of (median over timed steps of the slowest rank's step)",
            "optimizer_state_mib_per_rank": "bytes of tensors in the torch optimizer's state with dim "
            "> 0 (AdamW exp_avg, exp_avg_sq), rank order pp-major",
            "peak_rss_mib_per_rank": "VmHWM at the end of training, median over rounds",
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_flags(p, rounds=3)
    p.add_argument("--steps", type=int, default=None, help=f"timed steps per run ({DEFAULTS['steps']})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed warm-up steps per run ({DEFAULTS['warmup']})")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated keys or kinds: phalanx_pp, phalanx_pp_zero1, ds_pp, "
        "ds_pp_zero1 (kinds: phalanx, deepspeed)",
    )
    p.add_argument("--seed", type=int, default=1234)
    add_output_flags(p, HERE / "results", STEM)
    args = p.parse_args(argv)
    env = environment()
    result = bench(args)
    write_result(result, args, STEM, env, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
