"""Checkpoint benchmark: phalanx save_state/load_state against torch.save from rank 0 and torch.distributed.checkpoint
(DCP), on the same 50.4M-parameter training state, 2 ranks (gloo, CPU).

    .venv/bin/python benchmarks/bench_checkpoint.py                         # 3 rounds (about 4 min on 2 idle cores)
    .venv/bin/python benchmarks/bench_checkpoint.py --rounds 5
    .venv/bin/python benchmarks/bench_checkpoint.py --rounds 1 --layers 2 --d 512 --no-json   # smoke run

Replicated state (what DDP holds on every rank) is compared three ways: torch.save of the full state dicts from rank
0, DCP with its default planner (replicated tensors are written once), and phalanx ddp (the replicas split the bytes).
Sharded state (ZeRO-3 / FSDP) is compared two ways: DCP of an FSDP2 model, and phalanx zero3. The workers are in
checkpoint_workers.py; the round loop is harness.py's. See benchmarks/README.md for the columns.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # so that spawned processes (which inherit sys.path) import the workers

import checkpoint_workers  # noqa: E402
from harness import (  # noqa: E402
    add_output_flags,
    add_round_flags,
    environment,
    interleaved_rounds,
    source_record,
    source_state,
    spawn_ranks,
    write_result,
)

NRANKS = 2
CONFIGS: list[dict[str, Any]] = [
    {"key": "torch_save", "name": "torch.save (rank 0)", "kind": "torch_save", "state": "replicated"},
    {"key": "dcp", "name": "DCP", "kind": "dcp", "state": "replicated"},
    {"key": "phalanx_ddp", "name": "phalanx ddp", "kind": "phalanx", "strategy": "ddp", "state": "replicated"},
    {"key": "dcp_fsdp2", "name": "DCP + FSDP2", "kind": "dcp", "fsdp2": True, "state": "sharded"},
    {"key": "phalanx_zero3", "name": "phalanx zero3", "kind": "phalanx", "strategy": "zero3", "state": "sharded"},
]
TARGETS = {  # (numerator, denominator, what, limit)
    "phalanx_ddp_over_dcp_save": ("phalanx ddp", "DCP", "save_s", 1.0),
    "phalanx_zero3_over_dcp_fsdp2_save": ("phalanx zero3", "DCP + FSDP2", "save_s", 1.0),
}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = results[0]
    # Per repeat the slower rank (barrier to barrier), then the median over the repeats of the run.
    out: dict[str, Any] = {
        k: statistics.median(max(ts) for ts in zip(*(r[k] for r in results))) for k in r0 if k.endswith("_s")
    }
    out["repeats"] = {k: [max(ts) for ts in zip(*(r[k] for r in results))] for k in r0 if k.endswith("_s")}
    out["bytes"] = r0["bytes"]
    out["checksum"] = r0["checksum_before"]
    out["peak_rss_mib"] = [r["memory"]["vm_hwm_mib"] for r in results]
    return out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    spec = {"d": args.d, "n_layers": args.layers, "batch": 8, "seed": args.seed, "repeats": args.repeats}
    nparams = args.layers * (args.d * args.d + args.d)
    configs = [c for c in CONFIGS if not args.only or c["key"] in args.only.split(",")]
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="phalanx-bench-ckpt-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"\n=== checkpoint: {args.layers} x Linear({args.d}, {args.d}) = {nparams:,} parameters + AdamW state "
        f"({3 * nparams * 4 / 2**20:.0f} MiB of fp32 tensors), {NRANKS} ranks (gloo x 1 thread), {args.rounds} rounds, "
        f"files in {workdir} ===",
        flush=True,
    )
    start = source_state()

    def run(cfg: dict[str, Any]) -> Any:
        s = dict(
            spec,
            path=str(workdir / f"{cfg['key']}{'.pt' if cfg['kind'] == 'torch_save' else ''}"),
            **{k: v for k, v in cfg.items() if k in ("strategy", "fsdp2")},
        )
        return spawn_ranks(checkpoint_workers.run, NRANKS, (cfg["kind"], s), args.timeout)

    def headline(s: dict[str, Any]) -> str:
        return f"save {s['save_s']:6.2f} s  load {s['load_s']:6.2f} s  {s['bytes'] / 2**20:7.1f} MiB"

    rounds, failures, wall = interleaved_rounds(configs, args, run, summarize, headline)
    sources = source_record(start, source_state())

    rows = []
    for cfg in configs:
        rs = rounds[cfg["name"]]
        if not rs:
            rows.append({**cfg, "failed": failures.get(cfg["name"], "no result")})
            continue
        row = {**cfg, "rounds": rs, "bytes": rs[0]["bytes"]}
        for k in rs[0]:
            if k.endswith("_s"):
                row[k] = statistics.median(r[k] for r in rs)
                row[f"{k}_range"] = [min(r[k] for r in rs), max(r[k] for r in rs)]
        rows.append(row)
    by = {r["name"]: r for r in rows if "failed" not in r}
    targets = {}
    for tname, (num, den, what, limit) in TARGETS.items():
        if num in by and den in by:
            paired = [a[what] / b[what] for a, b in zip(rounds[num], rounds[den])]
            ratio = by[num][what] / by[den][what]
            targets[tname] = {"ratio": ratio, "target": limit, "meets": ratio <= limit, "per_round": paired}

    print(f"\n### checkpoint, {nparams:,} parameters + AdamW state, {NRANKS} ranks x 1 thread, gloo, CPU\n")
    print(
        f"median over {args.rounds} rounds of the median of {args.repeats} saves and loads per run; times are "
        "barrier to barrier (the slower rank); loads read files evicted from the page cache; "
        f"wall {wall:.0f} s\n"
    )
    print(
        "| configuration | state | save s | load s | load s, no checksums | MiB on disk | save x DCP (same state) | "
        "load x DCP (same state) | save x torch.save |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['name']} | {r['state']} | FAILED | | | | | | |")
            continue
        ref = by.get("DCP" if r["state"] == "replicated" else "DCP + FSDP2")
        ts = by.get("torch.save (rank 0)")

        def ratio(other: dict[str, Any] | None, what: str, row: dict[str, Any] = r) -> str:
            return f"{row[what] / other[what]:.2f}" if other else "-"

        nov = f"{r['load_noverify_s']:.2f}" if "load_noverify_s" in r else "-"
        print(
            f"| {r['name']} | {r['state']} | {r['save_s']:.2f} | {r['load_s']:.2f} | {nov} | "
            f"{r['bytes'] / 2**20:.1f} | {ratio(ref, 'save_s')} | {ratio(ref, 'load_s')} | {ratio(ts, 'save_s')} |"
        )
    if targets:
        print("\n| target | ratio | per round | verdict |\n|---|---:|---|---|")
        for name, t in targets.items():
            print(
                f"| {name} <= {t['target']} | {t['ratio']:.2f} | {', '.join(f'{x:.2f}' for x in t['per_round'])} | "
                f"{'meets' if t['meets'] else 'MISSES'} |"
            )
    if failures:
        print("\nfailed configurations:")
        for name, err in failures.items():
            print(f"  {name}: {err[-3000:]}")
    return {
        "workload": {"n_layers": args.layers, "d": args.d, "parameters": nparams, "optimizer": "AdamW"},
        "ranks": NRANKS,
        "rounds": args.rounds,
        "wall_s": wall,
        **sources,
        "definitions": {
            "save_s": "barrier, save, barrier: the slower rank's wall time",
            "load_s": "barrier, build a fresh model and optimizer (other seed), load, barrier; files fsynced and "
            "evicted from the page cache (posix_fadvise DONTNEED) before",
            "load_noverify_s": "phalanx only: load_state(verify=False), again from evicted files",
            "bytes": "bytes of every file the save wrote",
            "targets": {k: f"{v[0]} / {v[1]} {v[2]} <= {v[3]}" for k, v in TARGETS.items()},
        },
        "targets": targets,
        "configs": rows,
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_flags(p, rounds=3)
    p.add_argument("--layers", type=int, default=12, help="Linear layers (12)")
    p.add_argument("--d", type=int, default=2048, help="their width (2048: 50.4M parameters with 12 layers)")
    p.add_argument("--only", default="", help="comma-separated keys: " + ", ".join(c["key"] for c in CONFIGS))
    p.add_argument("--repeats", type=int, default=3, help="saves and loads per run (the run reports their median)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dir", default="", help="where the checkpoints are written (default: a new temporary directory)")
    add_output_flags(p, HERE / "results", "checkpoint")
    args = p.parse_args(argv)
    env = environment()
    result = bench(args)
    write_result(result, args, "checkpoint", env, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
