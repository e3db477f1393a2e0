"""Checkpoint benchmark: phalanx save_state/load_state against torch.save from rank 0 and torch.distributed.checkpoint
(DCP), on the same 50.4M-parameter training state, 2 ranks (gloo, CPU).

    .venv/bin/python benchmarks/bench_checkpoint.py                         # 3 rounds (about 4 min on 2 idle cores)
    .venv/bin/python benchmarks/bench_checkpoint.py --rounds 5
    .venv/bin/python benchmarks/bench_checkpoint.py --rounds 1 --layers 2 --d 512 --no-json   # smoke run
    .venv/bin/python benchmarks/bench_checkpoint.py --async --layers 8 --d 1024 --tag async-100mb   # async, 100 MB
    .venv/bin/python benchmarks/bench_checkpoint.py --async --layers 12 --d 2736 --tag async-1gb    # async, 1 GB

Replicated state (what DDP holds on every rank) is compared three ways: torch.save of the full state dicts from rank
0, DCP with its default planner (replicated tensors are written once), and phalanx ddp (the replicas split the bytes).
Sharded state (ZeRO-3 / FSDP) is compared two ways: DCP of an FSDP2 model, and phalanx zero3. The workers are in
checkpoint_workers.py; the round loop is harness.py's. See benchmarks/README.md for the columns.

``--async`` adds the asynchronous saves: DCP's ``async_save`` (on a gloo group of its own, as its docs advise) and
phalanx's ``save_state(async_save=True)``, on the replicated and the sharded state. Each of their runs saves the same
state synchronously and then asynchronously, repeat by repeat, and takes a training step right after the asynchronous
call; ``blocked s`` is the time training stops for: the call until it returns, plus the time that step's
``optimizer.step()`` is held before it may change the state (phalanx holds it until its thread has copied the
parameters and optimizer state). The target is blocked <= 10% of the same method's synchronous save in the same run
(results/checkpoint-async.md). ``--only dcp_async,phalanx_ddp_async,...`` runs just those.
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
ASYNC_CONFIGS: list[dict[str, Any]] = [
    {"key": "dcp_async", "name": "DCP async", "kind": "dcp", "async": True, "state": "replicated"},
    {"key": "phalanx_ddp_async", "name": "phalanx ddp async", "kind": "phalanx", "strategy": "ddp", "async": True,
     "state": "replicated"},
    {"key": "dcp_fsdp2_async", "name": "DCP + FSDP2 async", "kind": "dcp", "fsdp2": True, "async": True,
     "state": "sharded"},
    {"key": "phalanx_zero3_async", "name": "phalanx zero3 async", "kind": "phalanx", "strategy": "zero3",
     "async": True, "state": "sharded"},
]  # fmt: skip
TARGETS = {  # (numerator, its measure, denominator, its measure, limit)
    "phalanx_ddp_over_dcp_save": ("phalanx ddp", "save_s", "DCP", "save_s", 1.0),
    "phalanx_zero3_over_dcp_fsdp2_save": ("phalanx zero3", "save_s", "DCP + FSDP2", "save_s", 1.0),
    "phalanx_ddp_async_blocked_over_sync_save": (
        "phalanx ddp async",
        "blocked_s",
        "phalanx ddp async",
        "sync_save_s",
        0.10,
    ),
    "phalanx_zero3_async_blocked_over_sync_save": (
        "phalanx zero3 async",
        "blocked_s",
        "phalanx zero3 async",
        "sync_save_s",
        0.10,
    ),
    "dcp_async_blocked_over_sync_save": ("DCP async", "blocked_s", "DCP async", "sync_save_s", 0.10),
    "dcp_fsdp2_async_blocked_over_sync_save": (
        "DCP + FSDP2 async",
        "blocked_s",
        "DCP + FSDP2 async",
        "sync_save_s",
        0.10,
    ),
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
    every = CONFIGS + (ASYNC_CONFIGS if args.async_ else [])
    configs = [c for c in every if not args.only or c["key"] in args.only.split(",")]
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
            **{k: v for k, v in cfg.items() if k in ("strategy", "fsdp2", "async")},
        )
        return spawn_ranks(checkpoint_workers.run, NRANKS, (cfg["kind"], s), args.timeout)

    def headline(s: dict[str, Any]) -> str:
        blocked = f"  blocked {s['blocked_s']:6.3f} s" if "blocked_s" in s else ""
        return f"save {s['save_s']:6.2f} s{blocked}  load {s['load_s']:6.2f} s  {s['bytes'] / 2**20:7.1f} MiB"

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
    for tname, (num, what, den, den_what, limit) in TARGETS.items():
        if num in by and den in by:
            paired = [a[what] / b[den_what] for a, b in zip(rounds[num], rounds[den])]
            ratio = by[num][what] / by[den][den_what]
            targets[tname] = {"ratio": ratio, "target": limit, "meets": ratio <= limit, "per_round": paired}

    print(f"\n### checkpoint, {nparams:,} parameters + AdamW state, {NRANKS} ranks x 1 thread, gloo, CPU\n")
    print(
        f"median over {args.rounds} rounds of the median of {args.repeats} saves and loads per run; times are "
        "barrier to barrier (the slower rank); loads read files evicted from the page cache; "
        f"wall {wall:.0f} s\n"
    )
    print(
        "| configuration | state | save s | blocked s | blocked / its sync save | load s | load s, no checksums | "
        "MiB on disk | save x DCP (same state) | load x DCP (same state) | save x torch.save |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['name']} | {r['state']} | FAILED | | | | | | | | |")
            continue
        ref = by.get("DCP" if r["state"] == "replicated" else "DCP + FSDP2")
        ts = by.get("torch.save (rank 0)")

        def ratio(other: dict[str, Any] | None, what: str, row: dict[str, Any] = r) -> str:
            return f"{row[what] / other[what]:.2f}" if other else "-"

        nov = f"{r['load_noverify_s']:.2f}" if "load_noverify_s" in r else "-"
        blocked = f"{r['blocked_s']:.3f}" if "blocked_s" in r else "-"
        of_sync = f"{r['blocked_s'] / r['sync_save_s']:.3f} (of {r['sync_save_s']:.2f} s)" if "blocked_s" in r else "-"
        ref_name = ("DCP async" if r["state"] == "replicated" else "DCP + FSDP2 async") if r.get("async") else ""
        ref = by.get(ref_name) or ref
        print(
            f"| {r['name']} | {r['state']} | {r['save_s']:.2f} | {blocked} | {of_sync} | {r['load_s']:.2f} | {nov} | "
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
            "blocked_s": "async configurations: call_s + held_s, what training waits for (the slower rank); their "
            "save_s runs from the call until the wait for the checkpoint returns (a training step taken in between), "
            "and sync_save_s is a synchronous save of the same state in the same repeat, barrier to barrier",
            "call_s": "async configurations: barrier, then the save call until it returns",
            "held_s": "async configurations: how long the training step right after the call waited inside "
            "optimizer.step() before changing the state (between a step pre-hook registered before the save and "
            "one registered after it)",
            "bytes": "bytes of every file the save wrote",
            "targets": {k: f"{v[0]} {v[1]} / {v[2]} {v[3]} <= {v[4]}" for k, v in TARGETS.items()},
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
    p.add_argument(
        "--only", default="", help="comma-separated keys: " + ", ".join(c["key"] for c in CONFIGS + ASYNC_CONFIGS)
    )
    p.add_argument("--async", dest="async_", action="store_true", help="also the asynchronous saves (DCP's and ours)")
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
