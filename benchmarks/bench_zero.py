"""Sharded data parallel benchmark: phalanx zero1/zero2/zero3 against torch DDP, phalanx ddp, DDP +
ZeroRedundancyOptimizer, torch FSDP2 and DeepSpeed ZeRO 1/2/3, on CPU over gloo.

    .venv/bin/python benchmarks/bench_zero.py                                   # mlp, gpt and gpt20m, 5 rounds
    .venv/bin/python benchmarks/bench_zero.py --workload gpt20m --rounds 3
    .venv/bin/python benchmarks/bench_zero.py --workload mlp --only torch_ddp,zero3,fsdp2
    .venv/bin/python benchmarks/bench_zero.py --rounds 1 --steps 3 --warmup 1 --no-json   # smoke run
    .venv/bin/python benchmarks/bench_zero.py --workload mlp --compile --only zero3,fsdp2,zero3_compiled,fsdp2_compiled
    .venv/bin/python benchmarks/bench_zero.py --workload gpt --floor --only phalanx_ddp,zero3,fsdp2,floor --rounds 3

Every configuration runs in fresh processes started by phalanx.spawn (2 ranks, gloo, 1 thread each); runs are
interleaved (every round runs every configuration once, in a rotated order), as in bench_ddp.py. See
benchmarks/README.md for the columns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # so that spawned processes (which inherit sys.path) import zero_workers


import zero_workers  # noqa: E402
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
    watchdog_rows,
    write_result,
)

WORKLOADS: dict[str, dict[str, Any]] = {
    # 8 x Linear(1024, 1024): 8.4M parameters.
    "mlp": {"global_batch": 64, "lr": 1e-3, "warmup": 5, "steps": 30},
    # phalanx.demo.TinyGPT(GPTConfig()): 0.84M parameters, 128-token byte sequences.
    "gpt": {"global_batch": 16, "lr": 1e-3, "warmup": 3, "steps": 15},
    # TinyGPT(n_embd=512, n_layer=7, n_head=8, block_size=128): 22.3M parameters; 4 x 128 tokens per step
    # (2 sequences per rank), so that a step is a few hundred ms on one core.
    "gpt20m": {"global_batch": 4, "lr": 1e-3, "warmup": 3, "steps": 10},
}
MIN_GPT20M_PARAMS = 20_000_000
# --floor: plain torch on each rank's share, no communication. Not a strategy: the time no strategy can beat here.
FLOOR = "plain torch, no communication"

# First/final loss of every configuration against torch DDP's (relative): the same as bench_ddp's setup check.
TOL_FIRST, TOL_FINAL = 1e-5, 1e-3

# Compiled rows (--compile) against their uncompiled twins and against each other: reported, no target.
COMPILE_RATIOS = {
    "zero3_compiled_over_zero3_step": ("phalanx zero3 compiled", "phalanx zero3"),
    "fsdp2_compiled_over_fsdp2_step": ("FSDP2 per block compiled", "FSDP2 per block"),
    "zero3_compiled_over_fsdp2_compiled_step": ("phalanx zero3 compiled", "FSDP2 per block compiled"),
    "zero3_over_fsdp2_step": ("phalanx zero3", "FSDP2 per block"),
}

TARGETS = {
    "zero3_over_fsdp2_step": ("phalanx zero3", "FSDP2 per block", "median_ms", 0.6),
    "zero3_over_phalanx_ddp_step": ("phalanx zero3", "phalanx ddp", "median_ms", 1.0),
    "zero3_over_fsdp2_peak_rss": ("phalanx zero3", "FSDP2 per block", "peak_rss", 1.0),
    "zero1_over_phalanx_ddp_step": ("phalanx zero1", "phalanx ddp", "median_ms", 1.1),
    "zero2_over_phalanx_ddp_step": ("phalanx zero2", "phalanx ddp", "median_ms", 1.1),
}


def deepspeed_status() -> tuple[bool, str]:
    """Import DeepSpeed in a child process (not here: the driver's RSS is a floor under the ranks' ru_maxrss)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    code = "import deepspeed; print(deepspeed.__version__)"
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"could not run a Python to import deepspeed ({e})"
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"deepspeed is not importable ({last})"
    return True, f"deepspeed {p.stdout.strip().splitlines()[-1]}"


def configurations(args: argparse.Namespace, gb: int, nranks: int, ds_ok: bool, ds_why: str) -> list[dict[str, Any]]:
    per_rank = gb // nranks
    c: list[dict[str, Any]] = [
        {"key": "torch_ddp", "name": "torch DDP", "kind": "torch_ddp"},
        {"key": "phalanx_ddp", "name": "phalanx ddp", "kind": "phalanx", "strategy": "ddp"},
        {"key": "zero1", "name": "phalanx zero1", "kind": "phalanx", "strategy": "zero1"},
        {"key": "zero2", "name": "phalanx zero2", "kind": "phalanx", "strategy": "zero2"},
        {"key": "zero3", "name": "phalanx zero3", "kind": "phalanx", "strategy": "zero3"},
    ]
    if args.zero_native:
        for s in ("zero1", "zero2", "zero3"):
            c.append(
                {
                    "key": f"{s}_native",
                    "name": f"phalanx {s} native",
                    "kind": "phalanx",
                    "strategy": s,
                    "engine_kwargs": {"zero_collectives": "native"},
                }
            )
    for cls in args.zero3_units:
        c.append(
            {
                "key": f"zero3_units_{cls}",
                "name": f"phalanx zero3 units={cls}",
                "kind": "phalanx",
                "strategy": "zero3",
                "engine_kwargs": {"zero3_unit_classes": cls},
            }
        )
    if args.watchdog_rows:
        for s in ("ddp", "zero3"):
            for name, kw in watchdog_rows():
                key = f"{s}_{name.replace(' ', '_')}"
                c.append(
                    {"key": key, "name": f"phalanx {s} {name}", "kind": "phalanx", "strategy": s, "engine_kwargs": kw}
                )
    if args.malloc_rows:  # glibc's mmap threshold fixed at 1 MiB (host_mmap_threshold_mb=1): its cost in step time
        for s in ("zero2", "zero3"):
            c.append(
                {
                    "key": f"{s}_mmap_1mib",
                    "name": f"phalanx {s} mmap threshold 1 MiB",
                    "kind": "phalanx",
                    "strategy": s,
                    "engine_kwargs": {"host_mmap_threshold_mb": 1},
                }
            )
    c += [
        {"key": "zero_redundancy", "name": "DDP + ZeroRedundancyOpt", "kind": "torch_zero"},
        {"key": "fsdp2", "name": "FSDP2 per block", "kind": "fsdp2"},
    ]
    if args.compile:  # torch.compile(model) after engine.prepare / after fully_shard; the warm-up steps compile
        c += [
            {
                "key": "zero3_compiled",
                "name": "phalanx zero3 compiled",
                "kind": "phalanx",
                "strategy": "zero3",
                "compile": args.compile,
            },
            {"key": "fsdp2_compiled", "name": "FSDP2 per block compiled", "kind": "fsdp2", "compile": args.compile},
        ]
    if args.floor:
        c.append({"key": "floor", "name": FLOOR, "kind": "local"})
    ds = [{"key": f"ds{s}", "name": f"DeepSpeed ZeRO-{s}", "kind": "deepspeed", "ds_stage": s} for s in (1, 2, 3)]
    if args.no_deepspeed:
        print("[skip] DeepSpeed: --no-deepspeed")
    elif not ds_ok:
        print(f"[skip] DeepSpeed: {ds_why}")
    else:
        c += ds
    for cfg in c:
        cfg.update(nprocs=nranks, threads=RANK_THREADS, local_batch=per_rank)
    if args.only:
        keep = {s.strip() for s in args.only.split(",") if s.strip()}
        if "deepspeed" in keep and not ds_ok:
            print(f"[skip] DeepSpeed: {ds_why}")
        c = [x for x in c if x["key"] in keep or x["kind"] in keep or x["name"] in keep]
    return c


def run_config(
    workload: str, base: dict[str, Any], cfg: dict[str, Any], timeout: float, overrides: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    spec = dict(base, local_batch=cfg["local_batch"], **(overrides or {}))
    for k in ("strategy", "engine_kwargs", "ds_stage", "compile"):
        if k in cfg:
            spec[k] = cfg[k]
    return spawn_ranks(zero_workers.run, cfg["nprocs"], (cfg["kind"], workload, spec), timeout, threads=cfg["threads"])


def summarize_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    per_step = slowest_rank(results)
    losses = mean_over_ranks(results)
    out = {
        "median_ms": 1e3 * statistics.median(per_step),
        "step_ms": [1e3 * t for t in per_step],
        "peak_rss_mib": [r["peak_hwm_mib"] for r in results],
        "ru_maxrss_mib": [r["peak_rss_mib"] for r in results],
        "setup_peak_rss_mib": [r["setup_peak_hwm_mib"] for r in results],
        "rss_end_mib": [r["rss_end_mib"] for r in results],
        "cpu_ms_per_step": [1e3 * r["cpu_per_step"] for r in results],
        "minor_faults_per_step": [r["minor_faults_per_step"] for r in results],
        "losses": losses,
        "param_checksum": results[0]["param_checksum"],
        "threads": [r["threads"] for r in results],
        "n_params": results[0].get("n_params"),
    }
    if "describe" in results[0]:
        out["describe"] = results[0]["describe"]
    for k in ("fwd_bwd_s", "optimizer_s"):  # the floor row's parts of a step
        if k in results[0]:
            out[k.replace("_s", "_ms")] = 1e3 * statistics.median(slowest_rank(results, k))
    if "memory_report" in results[0]:
        out["memory_report"] = [r.get("memory_report") for r in results]
    return out


def _mib(b: float | None) -> float | None:
    return None if b is None else b / 2**20


def _fmt_pair(vals: list[Any], fmt: str = "{:.0f}") -> str:
    return "/".join("-" if v is None else fmt.format(v) for v in vals)


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


def bench_workload(
    workload: str, args: argparse.Namespace, ds: tuple[bool, str], ds_warm: dict[str, Any]
) -> dict[str, Any]:
    nranks = 2
    base = base_spec(workload, args, nranks)
    gb = base["global_batch"]
    configs = configurations(args, gb, nranks, *ds)
    print(
        f"\n=== workload {workload}: global batch {gb}, {nranks} ranks on gloo x 1 thread, {base['warmup']} warm-up + "
        f"{base['steps']} timed steps, {args.rounds} rounds, {len(configs)} configurations, AdamW {args.adamw} ===",
        flush=True,
    )
    start = source_state()
    print(f"phalanx checkout: {start[0]}, sources {start[1]}", flush=True)

    # DeepSpeed JIT-compiles a CPU extension (into ~/.cache/torch_extensions) on its first run: once, untimed.
    ds_cfgs = [c for c in configs if c["kind"] == "deepspeed"]
    if ds_cfgs and not args.no_ds_warm and not ds_warm.get("done"):
        t0 = time.perf_counter()
        try:
            run_config(workload, base, ds_cfgs[0], args.timeout, {"warmup": 0, "steps": 1})
            ds_warm.update(done=True, seconds=time.perf_counter() - t0)
            print(
                f"DeepSpeed warm-up run (untimed, builds/loads its extensions): {ds_warm['seconds']:.1f} s", flush=True
            )
        except Exception as e:  # noqa: BLE001 - the timed runs report the failure per configuration
            ds_warm.update(done=True, error=f"{type(e).__name__}: {e}")
            print(f"DeepSpeed warm-up run failed: {type(e).__name__}: {str(e)[-2000:]}", flush=True)

    rounds, failures, wall = interleaved_rounds(
        configs,
        args,
        lambda cfg: run_config(workload, base, cfg, args.timeout),
        summarize_round,
        lambda s: f"{s['median_ms']:8.1f} ms/step",
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
        n = cfg["nprocs"]
        row = {
            **cfg,
            "median_ms": statistics.median(meds),
            "min_ms": min(meds),
            "round_medians_ms": meds,
            "peak_rss_mib_per_rank": per_rank_median(rs, "peak_rss_mib", n),
            "ru_maxrss_mib_per_rank": per_rank_median(rs, "ru_maxrss_mib", n),
            "setup_peak_rss_mib_per_rank": per_rank_median(rs, "setup_peak_rss_mib", n),
            "rss_end_mib_per_rank": per_rank_median(rs, "rss_end_mib", n),
            "cpu_ms_per_step_per_rank": per_rank_median(rs, "cpu_ms_per_step", n),
            "minor_faults_per_step_per_rank": per_rank_median(rs, "minor_faults_per_step", n),
            "foreign_load_cores": [r["foreign_load_cores"] for r in rs],
            "first_loss": rs[0]["losses"][0],
            "final_loss": rs[0]["losses"][-1],
            "losses": rs[0]["losses"],
            "param_checksum": rs[0]["param_checksum"],
            "threads_seen": rs[0]["threads"],
            "n_params": rs[0]["n_params"],
            **({"describe": rs[0]["describe"]} if "describe" in rs[0] else {}),
            **({"failed_later": failures[cfg["name"]]} if cfg["name"] in failures else {}),
        }
        for k in ("fwd_bwd_ms", "optimizer_ms"):
            if k in rs[0]:
                row[k] = statistics.median(r[k] for r in rs)
        if "memory_report" in rs[0]:
            reps = rs[0]["memory_report"]
            row["memory_report"] = reps
            row["held_total_mib_per_rank"] = [_mib(r.get("held_total")) if r else None for r in reps]
            row["predicted_total_mib_per_rank"] = [_mib(r.get("predicted_total")) if r else None for r in reps]
        rows.append(row)
    ok_rows = [r for r in rows if "failed" not in r]
    by = {r["name"]: r for r in ok_rows}
    ref = by.get("torch DDP")
    for r in ok_rows:
        r["x_torch_ddp"] = r["median_ms"] / ref["median_ms"] if ref else None

    # -------- setup check: every configuration trains the same model as torch DDP
    checks = []
    if ref is not None:
        for r in ok_rows:
            if r is ref:
                continue
            d_first = abs(r["first_loss"] - ref["first_loss"]) / abs(ref["first_loss"])
            d_last = abs(r["final_loss"] - ref["final_loss"]) / abs(ref["final_loss"])
            d_max = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
            d_sum = (
                abs(r["param_checksum"] - ref["param_checksum"]) / max(1e-12, abs(ref["param_checksum"]))
                if r["param_checksum"] is not None and ref["param_checksum"] is not None
                else None
            )
            # The floor's ranks do not average their gradients: only its first loss is ddp's.
            ok = d_first < TOL_FIRST and (d_last < TOL_FINAL or r["kind"] == "local")
            checks.append(
                {
                    "name": r["name"],
                    "first_loss_rel_diff": d_first,
                    "final_loss_rel_diff": d_last,
                    "max_step_loss_rel_diff": d_max,
                    "param_checksum_rel_diff": d_sum,
                    "ok": ok,
                }
            )

    # -------- target ratios
    def peak(r: dict[str, Any], key: str = "peak_rss_mib_per_rank") -> float | None:
        vals = [v for v in r[key] if v is not None]
        return max(vals) if vals else None

    targets: dict[str, Any] = {}
    for tname, (num, den, what, limit) in TARGETS.items():
        if num not in by or den not in by:
            continue
        if what == "median_ms":
            ratio = by[num]["median_ms"] / by[den]["median_ms"]
            paired = [a["median_ms"] / b["median_ms"] for a, b in zip(rounds[num], rounds[den])]
        else:
            a, b = peak(by[num]), peak(by[den])
            ratio = a / b if a and b else None
            paired = []
            am, bm = peak(by[num], "ru_maxrss_mib_per_rank"), peak(by[den], "ru_maxrss_mib_per_rank")
            targets[tname + "_ru_maxrss"] = am / bm if am and bm else None
        targets[tname] = {
            "ratio": ratio,
            "target": limit,
            "meets": ratio is not None and ratio <= limit,
            "per_round": paired,
            "numerator": num,
            "denominator": den,
        }

    ratios: dict[str, Any] = {}
    for tname, (num, den) in COMPILE_RATIOS.items() if args.compile else ():
        if num in by and den in by:
            paired = [a["median_ms"] / b["median_ms"] for a, b in zip(rounds[num], rounds[den])]
            ratios[tname] = {
                "ratio": by[num]["median_ms"] / by[den]["median_ms"],
                "per_round": paired,
                "numerator": num,
                "denominator": den,
            }

    floor = floor_ratios(by, nranks)

    # -------- print (markdown)
    nparams = zero_param_count(workload, ok_rows)
    print(
        f"\n### workload `{workload}` ({nparams:,} parameters), global batch {gb}, 2 ranks x 1 thread, gloo\n"
        if nparams
        else f"\n### workload `{workload}`\n"
    )
    if workload == "gpt20m" and nparams:
        print(
            f"gpt20m parameter count {nparams:,} {'>=' if nparams >= MIN_GPT20M_PARAMS else '< (TOO SMALL)'} "
            f"{MIN_GPT20M_PARAMS:,}\n"
        )
    print(
        f"median over {args.rounds} rounds of the median step time (slower rank per step; {base['warmup']} warm-up + "
        f"{base['steps']} timed steps per run); wall {wall:.0f} s\n"
    )
    cols = [
        "configuration",
        "median ms",
        "rounds min-max",
        "x torch DDP",
        "peak RSS MiB/rank",
        "ru_maxrss MiB/rank",
        "held MiB/rank",
        "predicted MiB/rank",
        "CPU ms/step/rank",
        "final loss",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['name']} | FAILED | | | | | | | | |")
            continue
        spread = f"{min(r['round_medians_ms']):.1f}-{max(r['round_medians_ms']):.1f}"
        xd = f"{r['x_torch_ddp']:.3f}" if r["x_torch_ddp"] is not None else "-"
        held = _fmt_pair(r["held_total_mib_per_rank"], "{:.1f}") if "held_total_mib_per_rank" in r else "-"
        pred = _fmt_pair(r["predicted_total_mib_per_rank"], "{:.1f}") if "predicted_total_mib_per_rank" in r else "-"
        print(
            f"| {r['name']} | {r['median_ms']:.1f} | {spread} | {xd} | {_fmt_pair(r['peak_rss_mib_per_rank'])} | "
            f"{_fmt_pair(r['ru_maxrss_mib_per_rank'])} | {held} | {pred} | "
            f"{_fmt_pair(r['cpu_ms_per_step_per_rank'])} | {r['final_loss']:.5f} |"
        )
    if targets:
        print("\n| target | ratio | target | verdict | per round |\n|---|---:|---:|---|---|")
        for tname, t in targets.items():
            if not isinstance(t, dict):
                continue
            ratio = "-" if t["ratio"] is None else f"{t['ratio']:.3f}"
            label = {"median_ms": "step time"}.get(TARGETS[tname][2], "peak RSS (max over ranks)")
            per = ", ".join(f"{x:.3f}" for x in t["per_round"]) or "-"
            print(
                f"| {t['numerator']} / {t['denominator']} {label} | {ratio} | <= {t['target']} | "
                f"{'meets' if t['meets'] else 'MISSES'} | {per} |"
            )
        if targets.get("zero3_over_fsdp2_peak_rss_ru_maxrss") is not None:
            print(
                "\n(zero3 / FSDP2 with ru_maxrss instead of VmHWM: "
                f"{targets['zero3_over_fsdp2_peak_rss_ru_maxrss']:.3f})"
            )
    if ratios:
        print("\n| compiled step time | ratio of medians | per round (paired) | min-max |\n|---|---:|---|---|")
        for t in ratios.values():
            per = t["per_round"]
            spread = f"{min(per):.3f}-{max(per):.3f}" if per else "-"
            print(
                f"| {t['numerator']} / {t['denominator']} | {t['ratio']:.3f} | "
                f"{', '.join(f'{x:.3f}' for x in per) or '-'} | {spread} |"
            )
    if floor:
        f = by[FLOOR]
        print(
            f"\nfloor: forward + backward {f['fwd_bwd_ms']:.1f} ms, AdamW {f['optimizer_ms']:.1f} ms per step "
            f"(plain torch, no communication); a sharded floor steps 1/{nranks} of the parameters: "
            f"{floor['sharded_floor_ms']:.1f} ms"
        )
        print("\n| floor ratio | ratio |\n|---|---:|")
        for k, v in floor.items():
            if k != "sharded_floor_ms":
                print(f"| {k} | {v:.3f} |")
    if checks:
        bad = [c for c in checks if not c["ok"]]
        print(
            f"\nsetup check vs torch DDP (same init, same global batches; first loss rel diff < {TOL_FIRST:g}, final "
            f"< {TOL_FINAL:g}): " + ("OK" if not bad else "FAILED for " + ", ".join(c["name"] for c in bad))
        )
        for c in checks:
            ds = "-" if c["param_checksum_rel_diff"] is None else f"{c['param_checksum_rel_diff']:.1e}"
            print(
                f"  {c['name']:<28} first {c['first_loss_rel_diff']:.1e}, final {c['final_loss_rel_diff']:.1e}, "
                f"max over steps {c['max_step_loss_rel_diff']:.1e}, param checksum {ds}"
                + ("" if c["ok"] else "   <-- MISMATCH")
            )
    if failures:
        print("\nfailed configurations:")
        for name, err in failures.items():
            print(f"  {name}: {err[-3000:]}")

    return {
        "workload": workload,
        "param_count": nparams,
        "base_spec": base,
        "nranks": nranks,
        "rounds": args.rounds,
        "wall_s": wall,
        "deepspeed_warmup": ds_warm,
        "definitions": {
            "median_ms": "median over rounds of (median over timed steps of the step time, the slowest rank per step); "
            "a step is forward + backward + optimizer step + zero_grad (DeepSpeed: engine.backward + "
            "engine.step)",
            "x_torch_ddp": "median_ms / median_ms of torch DDP (lower is better)",
            "peak_rss_mib_per_rank": "VmHWM of /proc/self/status at the end of training (this process's own peak "
            "resident set), median over rounds",
            "ru_maxrss_mib_per_rank": "getrusage(RUSAGE_SELF).ru_maxrss at the end of training, median over rounds; "
            "never below the driver's RSS at spawn time (Linux carries the forking "
            "process's high-water mark across exec)",
            "setup_peak_rss_mib_per_rank": "VmHWM before the first step (model built and prepared/sharded)",
            "held_total_mib_per_rank": "phalanx only: engine.memory_report()['held_total'] after the last step",
            "predicted_total_mib_per_rank": "phalanx only: engine.memory_report()['predicted_total']",
            "targets": {k: f"{v[0]} / {v[1]} {v[2]} <= {v[3]}" for k, v in TARGETS.items()},
            "compile_ratios": "with --compile: median_ms of one row / median_ms of another, and the same per round "
            "(rounds pair runs made back to back in one rotation); compiled rows are "
            "torch.compile(model, backend=--compile) after engine.prepare / fully_shard, compiled "
            "during the warm-up steps",
            "setup_checks": f"first and final loss relative to torch DDP's: < {TOL_FIRST:g} and < {TOL_FINAL:g}",
        },
        **sources,
        "targets": targets,
        "compile_ratios": ratios,
        "floor": floor,
        "setup_checks": checks,
        "failures": failures,
        "configs": rows,
        "raw_rounds": rounds,
    }


def floor_ratios(by: dict[str, dict[str, Any]], nranks: int) -> dict[str, float]:
    """With --floor: what the rows cost over the compute floor, and the zero3 / FSDP2 ratio that zero3 would reach if
    its communication cost nothing (forward + backward + AdamW over 1/nranks of the parameters, over FSDP2)."""
    f = by.get(FLOOR)
    if f is None or "fwd_bwd_ms" not in f:
        return {}
    sharded = f["fwd_bwd_ms"] + f["optimizer_ms"] / nranks
    out = {"sharded_floor_ms": sharded}
    for name in ("phalanx ddp", "phalanx zero3", "FSDP2 per block"):
        if name in by:
            floor = f["median_ms"] if name == "phalanx ddp" else sharded
            out[f"{name} / its floor"] = by[name]["median_ms"] / floor
    if "FSDP2 per block" in by:
        out["sharded floor / FSDP2 (zero3 / FSDP2 with free communication)"] = (
            sharded / by["FSDP2 per block"]["median_ms"]
        )
    return out


def zero_param_count(workload: str, rows: list[dict[str, Any]]) -> int | None:
    for r in rows:
        if r.get("n_params"):
            return int(r["n_params"])
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["mlp", "gpt", "gpt20m", "all"], default="all")
    add_round_flags(p, rounds=5)
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: per workload)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps per run (default: per workload)")
    p.add_argument("--global-batch", type=int, default=None, help="global batch (default: mlp 64, gpt 16, gpt20m 4)")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated keys, kinds or names: torch_ddp, phalanx_ddp, zero1, zero2, zero3, "
        "zero_redundancy, fsdp2, ds1, ds2, ds3 (kinds: phalanx, deepspeed, ...)",
    )
    p.add_argument(
        "--zero-native",
        action="store_true",
        help="add phalanx zero1/2/3 rows with zero_collectives='native' (reduce-scatter/all-gather on gloo)",
    )
    p.add_argument(
        "--zero3-units",
        type=lambda s: [x for x in s.split(";") if x],
        default=[],
        help="extra phalanx zero3 rows with these zero3_unit_classes, ';'-separated, e.g. _Block",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="add 'phalanx zero3 compiled' and 'FSDP2 per block compiled' rows (keys zero3_compiled, "
        "fsdp2_compiled): torch.compile(model, backend=BACKEND, default inductor) after "
        "engine.prepare / fully_shard; the warm-up steps compile",
    )
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument(
        "--malloc-rows",
        action="store_true",
        help="add zero2 and zero3 rows with glibc's mmap threshold fixed at 1 MiB (host_mmap_threshold_mb=1)",
    )
    p.add_argument(
        "--watchdog-rows",
        action="store_true",
        help="add ddp and zero3 rows with the hang watchdog off (hang_timeout_s=0) and with debug_collectives",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="add the compute floor (key floor): plain torch on each rank's share, no communication, forward + "
        "backward and AdamW timed apart",
    )
    p.add_argument("--no-ds-warm", action="store_true", help="skip the untimed DeepSpeed warm-up run")
    p.add_argument("--gpt-data", choices=["stdlib", "random"], default="stdlib")
    p.add_argument("--adamw", choices=["default", "foreach", "fused"], default="default")
    p.add_argument("--seed", type=int, default=1234)
    add_output_flags(p, HERE / "results", "zero-<workload>")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    ds = (False, "--no-deepspeed") if args.no_deepspeed else deepspeed_status()
    env = {**environment(), "deepspeed": ds[1]}
    workloads = ["mlp", "gpt", "gpt20m"] if args.workload == "all" else [args.workload]
    ds_warm: dict[str, Any] = {}
    for wl in workloads:
        write_result(bench_workload(wl, args, ds, ds_warm), args, f"zero-{wl}", env, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
