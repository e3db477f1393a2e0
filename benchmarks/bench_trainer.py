"""Trainer benchmark: phalanx.Trainer against the same work as a phalanx Engine loop and against the Hugging Face
Trainer, 2 ranks on gloo, 1 thread each.

    /tmp/tf-venv/bin/python benchmarks/bench_trainer.py --rounds 5         # 3 rows (about 5 min on 2 idle cores)
    /tmp/tf-venv/bin/python benchmarks/bench_trainer.py --rounds 5 --optim adamw_torch   # every row on AdamW's
                                                                                         # foreach kernel
    python benchmarks/bench_trainer.py --gpu --nprocs 1 --bf16 --d 4096 --batch 256   # one GPU, bf16 autocast
    .venv/bin/python benchmarks/bench_trainer.py --rounds 5                # without transformers: the HF row is skipped
    /tmp/tf-venv/bin/python benchmarks/bench_trainer.py --rounds 1 --only phalanx_trainer,engine_loop \
        --profile /tmp/trainer-prof --no-json                                # cProfile of rank 0's timed steps

Every run is ``python -m torch.distributed.run --nproc-per-node 2`` of trainer_workers.py (the HF Trainer needs its
env:// world, and one launcher for all rows keeps them alike), with OMP_NUM_THREADS=1 and torch.set_num_threads(1).
Rounds are interleaved (harness.interleaved_rounds). The targets: phalanx.Trainer / Engine loop - 1 below 3% (the
overhead per optimizer step), phalanx.Trainer / HF Trainer at most 1.0. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from harness import (  # noqa: E402
    RANK_THREADS,
    add_output_flags,
    add_round_flags,
    environment,
    free_port,
    interleaved_rounds,
    per_rank_median,
    slowest_rank,
    source_record,
    source_state,
    write_result,
)

WORKER = HERE / "trainer_workers.py"
NRANKS = 2  # the default of --nprocs
OVERHEAD_TARGET = 0.03
HF_RATIO_TARGET = 1.0


def hf_status() -> tuple[bool, str]:
    try:
        import accelerate
        import transformers

        return True, f"transformers {transformers.__version__}, accelerate {accelerate.__version__}"
    except Exception as e:  # noqa: BLE001 - any import failure means: no HF row
        return False, (
            f"transformers/accelerate not importable ({type(e).__name__}: {e}); run with /tmp/tf-venv/bin/python "
            "or install them with a constraints file pinning torch"
        )


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    configs = [
        {"name": "phalanx.Trainer", "kind": "phalanx_trainer"},
        {"name": "Engine loop", "kind": "engine_loop"},
    ]
    ok, why = hf_status()
    if ok:
        configs.append({"name": "HF Trainer", "kind": "hf_trainer"})
    else:
        print(f"[skip] HF Trainer: {why}")
    if args.only:
        keep = {s.strip() for s in args.only.split(",")}
        configs = [c for c in configs if c["kind"] in keep or c["name"] in keep]
    return configs


def run_config(cfg: dict[str, Any], base: dict[str, Any], timeout: float, nprocs: int) -> list[dict[str, Any]]:
    """One run: torch.distributed.run with ``nprocs`` ranks of trainer_workers.py; their results in rank order."""
    spec = dict(base)
    env = dict(os.environ, OMP_NUM_THREADS=str(RANK_THREADS), TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    for key in [k for k in env if k.startswith("PHALANX_")]:
        del env[key]  # the runs take their world from torch.distributed.run only
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as out:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nprocs),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(WORKER),
            "--kind",
            cfg["kind"],
            "--spec",
            json.dumps(spec),
            "--out",
            out,
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{cfg['name']} exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nprocs)]


def summarize_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    per_step = slowest_rank(results)
    extra = {
        k: results[0][k]
        for k in ("distributed_type", "backend", "hf_world_size", "transformers", "describe", "profile")
        if k in results[0]
    }
    return {
        "median_ms": 1e3 * statistics.median(per_step),
        "mean_ms": 1e3 * statistics.fmean(per_step),  # the logging steps included, amortised
        "step_ms": [1e3 * t for t in per_step],
        "cpu_ms_per_step": [1e3 * r["cpu_per_step"] for r in results],
        "peak_hwm_mib": [r["peak_hwm_mib"] for r in results],
        "logged_losses": results[0]["logged_losses"],
        "param_checksum": results[0]["param_checksum"],
        "optimizer": results[0]["optimizer"],
        "threads": [r["threads"] for r in results],
        "phalanx_file": results[0]["phalanx_file"],
        **extra,
    }


def _ratio(rounds: dict[str, list[dict[str, Any]]], num: str, den: str, key: str) -> dict[str, Any] | None:
    """num / den of ``key``: per round (the two runs were close in time) with its median and spread, and the ratio of
    the medians over rounds."""
    if not rounds.get(num) or not rounds.get(den):
        return None
    per_round = [a[key] / b[key] for a, b in zip(rounds[num], rounds[den])]
    return {
        "per_round": per_round,
        "median": statistics.median(per_round),
        "min": min(per_round),
        "max": max(per_round),
        "of_medians": statistics.median(r[key] for r in rounds[num]) / statistics.median(r[key] for r in rounds[den]),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_flags(p, rounds=5, timeout=600.0)
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps per run before the timed ones")
    p.add_argument("--batch", type=int, default=32, help="per-device micro-batch (global batch = batch x accum x 2)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps of every row")
    p.add_argument("--logging-steps", type=int, default=10, help="logging_steps of every row")
    p.add_argument("--d", type=int, default=1024, help="width of the MLP")
    p.add_argument("--layers", type=int, default=8, help="Linear layers of the MLP")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--only", default="", help="comma-separated kinds or names (phalanx_trainer, engine_loop, hf_trainer)"
    )
    p.add_argument(
        "--optim",
        default="adamw_torch_fused",
        choices=("adamw_torch_fused", "adamw_torch"),
        help="the AdamW kernel of every row (the Trainers' optim; the Engine loop's fused=); default: both "
        "Trainers' default, the fused kernel",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="cProfile of rank 0's timed steps into DIR/<kind>.rank0.{prof,txt} (use with --no-json)",
    )
    p.add_argument("--nprocs", type=int, default=NRANKS, help="ranks of every row")
    p.add_argument(
        "--gpu",
        action="store_true",
        help="one GPU per rank (NCCL; HF with use_cpu=False, pinned loaders); the step clock synchronises the GPU",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 autocast in every row (bf16=True, precision='bf16-mixed')")
    add_output_flags(p, HERE / "results", "trainer-mlp")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = environment(hf=hf_status()[1])
    base = {
        "seed": args.seed,
        "batch": args.batch,
        "grad_accum": args.grad_accum,
        "logging_steps": args.logging_steps,
        "d": args.d,
        "layers": args.layers,
        "lr": args.lr,
        "warmup": args.warmup,
        "steps": args.steps,
        "threads": RANK_THREADS,
        "gpu": args.gpu,
        "bf16": args.bf16,
        "optim": args.optim,
        **({"profile": str(Path(args.profile).resolve())} if args.profile else {}),
    }
    configs = configurations(args)
    NR = args.nprocs
    gb = args.batch * args.grad_accum * NR
    where = "one GPU each, NCCL" if args.gpu else f"{RANK_THREADS} thread on gloo"
    print(
        f"\n=== MLP {args.layers} x Linear({args.d}, {args.d}){' bf16' if args.bf16 else ''}, {NR} ranks x {where}, "
        f"global batch {gb} ({args.batch} x accum {args.grad_accum} per rank), logging every {args.logging_steps} "
        f"steps, {args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds ===",
        flush=True,
    )
    src_start = source_state()
    rounds, failures, wall = interleaved_rounds(
        configs,
        args,
        lambda cfg: run_config(cfg, base, args.timeout, NR),
        summarize_round,
        lambda s: f"median {s['median_ms']:7.1f} ms/step, mean {s['mean_ms']:7.1f}",
    )
    sources = source_record(src_start, source_state())

    rows = []
    for cfg in configs:
        rs = rounds[cfg["name"]]
        if not rs:
            continue
        meds, means = [r["median_ms"] for r in rs], [r["mean_ms"] for r in rs]
        rows.append(
            {
                **cfg,
                "median_ms": statistics.median(meds),
                "round_medians_ms": meds,
                "mean_ms": statistics.median(means),
                "round_means_ms": means,
                "cpu_ms_per_step_per_rank": per_rank_median(rs, "cpu_ms_per_step", NR),
                "peak_hwm_mib_per_rank": per_rank_median(rs, "peak_hwm_mib", NR),
                "logged_losses": rs[0]["logged_losses"],
                "param_checksum": rs[0]["param_checksum"],
                "optimizer": rs[0]["optimizer"],
                "threads": rs[0]["threads"],
                **{k: rs[0][k] for k in ("distributed_type", "backend", "hf_world_size", "describe") if k in rs[0]},
            }
        )
    by = {r["name"]: r for r in rows}

    print(
        f"\nmedian over {args.rounds} rounds of each round's median step (the slower rank per step); wall {wall:.0f} s"
    )
    hdr = (
        f"{'configuration':<28} {'median ms':>10} {'rounds min-max':>15} {'mean ms':>9} {'CPU ms/step/rank':>17} "
        f"{'VmHWM MiB/rank':>15} {'optimizer':<30} {'logged losses':<}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        spread = f"{min(r['round_medians_ms']):.1f}-{max(r['round_medians_ms']):.1f}"
        cpu = "/".join(f"{v:.0f}" for v in r["cpu_ms_per_step_per_rank"])
        hwm = "/".join(f"{v:.0f}" for v in r["peak_hwm_mib_per_rank"])
        losses = ", ".join(f"{loss:.5f}" for _, loss in r["logged_losses"])
        print(
            f"{r['name']:<28} {r['median_ms']:>10.1f} {spread:>15} {r['mean_ms']:>9.1f} {cpu:>17} {hwm:>15} "
            f"{r['optimizer']:<30} {losses}"
        )
    for r in rows:
        if "distributed_type" in r:
            print(f"  {r['name']}: {r['distributed_type']}, world_size {r['hf_world_size']}, backend {r['backend']}")

    headline: dict[str, Any] = {}
    for key, label in (("median_ms", "median step"), ("mean_ms", "mean step, logging included")):
        over = _ratio(rounds, "phalanx.Trainer", "Engine loop", key)
        hf = _ratio(rounds, "phalanx.Trainer", "HF Trainer", key)
        headline[key] = {"trainer_over_engine_loop": over, "trainer_over_hf_trainer": hf}
        if over:
            pct = 100 * (over["median"] - 1)
            verdict = "meets" if over["median"] - 1 < OVERHEAD_TARGET else "MISSES"
            print(
                f"\n[{label}] phalanx.Trainer overhead over the Engine loop: {pct:+.1f}% per optimizer step (target < "
                f"{100 * OVERHEAD_TARGET:.0f}%: {verdict}); per round "
                f"{', '.join(f'{100 * (x - 1):+.1f}%' for x in over['per_round'])}; ratio of medians "
                f"{over['of_medians']:.3f}"
            )
        if hf:
            verdict = "meets" if hf["median"] <= HF_RATIO_TARGET else "MISSES"
            print(
                f"[{label}] phalanx.Trainer / HF Trainer: {hf['median']:.3f} "
                f"(target <= {HF_RATIO_TARGET:.2f}: {verdict}); "
                f"per round {', '.join(f'{x:.3f}' for x in hf['per_round'])}; ratio of medians {hf['of_medians']:.3f}"
            )
        elif "HF Trainer" not in by:
            print(f"[{label}] phalanx.Trainer / HF Trainer: skipped (no HF Trainer row)")

    # The Trainer and the Engine loop train the same model on the same data in the same order: their logged losses
    # agree.
    checks = []
    ref = by.get("Engine loop")
    if ref is not None:
        for r in rows:
            if r is ref or r["kind"] != "phalanx_trainer":
                continue
            diffs = [abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(r["logged_losses"], ref["logged_losses"])]
            ok = bool(diffs) and max(diffs) < 1e-5 and len(r["logged_losses"]) == len(ref["logged_losses"])
            checks.append(
                {
                    "name": r["name"],
                    "against": ref["name"],
                    "max_logged_loss_rel_diff": max(diffs, default=None),
                    "ok": ok,
                }
            )
            print(
                f"setup check: {r['name']} logged losses vs {ref['name']}: max rel diff "
                f"{max(diffs, default=float('nan')):.1e} ({'OK' if ok else 'FAILED'})"
            )
    if failures:
        print("failures:", json.dumps(failures, indent=1))

    result = {
        "workload": {
            "model": f"MLPRegressor: {args.layers} x Linear({args.d}, {args.d}) with ReLU between, MSE",
            "data": "randn inputs and labels, one epoch covers every step",
            "global_batch": gb,
            **base,
        },
        "nranks": NR,
        "rounds": args.rounds,
        "wall_s": wall,
        "launcher": f"python -m torch.distributed.run --nproc-per-node {NR}",
        "definitions": {
            "step": "the interval between consecutive on_step_end events (the same TimingCallback in both Trainers; "
            "the Engine loop takes the clock at the same point): batch fetch, forward, backward, clipping, optimizer "
            "and scheduler step, bookkeeping and, every logging_steps, the log",
            "median_ms": "median over rounds of (median over timed steps of the step time, the slower rank per step)",
            "mean_ms": "median over rounds of the mean step time over the timed steps (the log steps amortised)",
            "trainer_over_engine_loop": "per round phalanx.Trainer / Engine loop, then median, min, max over rounds; "
            "overhead = ratio - 1, target < 0.03",
            "trainer_over_hf_trainer": "per round phalanx.Trainer / HF Trainer (the same optim, the same torch AdamW), "
            "median over rounds, target <= 1.0",
        },
        "headline": headline,
        "setup_checks": checks,
        "failures": failures,
        **sources,
        "configs": rows,
        "raw_rounds": rounds,
    }
    write_result(result, args, "trainer-mlp", env, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
