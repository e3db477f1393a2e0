"""The round loop the benchmarks share: every configuration once per round, in an order rotated each round, each run
in fresh processes after waiting for a quiet CPU, and run again once when other processes loaded the machine."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import phalanx
from bench_ddp import ForeignLoad, git_state, wait_quiet


def src_digest() -> str:
    """sha256 (12 hex) of every .py under the imported phalanx package: '+dirty' in git_state() does not say whether
    uncommitted sources changed during a run, this does."""
    root = Path(phalanx.__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def source_state() -> tuple[str, str]:
    """(git checkout, source digest): taken before and after a run."""
    return git_state(), src_digest()


def source_record(start: tuple[str, str], end: tuple[str, str]) -> dict[str, str]:
    """What the result file says of the sources; a warning is printed when they changed during the run."""
    if start != end:
        print(f"WARNING: the phalanx sources changed during the run ({start[0]} {start[1]} -> {end[0]} {end[1]}); "
              "run it again.")  # fmt: skip
    return {
        "phalanx_commit": start[0] if start[0] == end[0] else f"{start[0]} -> {end[0]} (changed)",
        "phalanx_src_sha256": start[1] if start[1] == end[1] else f"{start[1]} -> {end[1]} (changed)",
    }


def environment() -> dict[str, Any]:
    """Versions and machine, printed at the start of a benchmark and stored with its results."""
    env = {
        "torch": torch.__version__, "phalanx": phalanx.__version__, "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "machine": platform.machine(), "platform": platform.platform(),
        "phalanx_checkout": git_state(),
        "driver_ru_maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1),
    }  # fmt: skip
    print("environment:", ", ".join(f"{k}={v}" for k, v in env.items()))
    return env


def add_output_flags(p: argparse.ArgumentParser, out: Path, stem: str) -> None:
    p.add_argument("--out", default=str(out), help=f"directory for {stem}.json")
    p.add_argument("--no-json", action="store_true")
    p.add_argument("--tag", default="", help=f"write {stem}-<tag>.json")


def write_result(result: dict[str, Any], args: argparse.Namespace, stem: str, env: dict[str, Any],
                 argv: list[str] | None) -> None:  # fmt: skip
    """Add the environment, arguments and finish time, and write ``<out>/<stem>[-<tag>].json`` unless --no-json."""
    result.update(environment=env, argv=sys.argv[1:] if argv is None else argv,
                  finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))  # fmt: skip
    if args.no_json:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / (f"{stem}-{args.tag}.json" if args.tag else f"{stem}.json")
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")


def add_round_flags(p: argparse.ArgumentParser, rounds: int) -> None:
    p.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (every configuration once per round)")
    p.add_argument("--quiet-wait", type=float, default=30.0, help="seconds to wait for a quiet CPU before each run")
    p.add_argument("--quiet-threshold", type=float, default=0.15)
    p.add_argument("--max-foreign", type=float, default=0.25,
                   help="cores used by other processes during a run above which it is run again")  # fmt: skip
    p.add_argument("--retries", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one spawned run may take")


def interleaved_rounds(
    configs: list[dict[str, Any]],
    args: argparse.Namespace,
    run: Callable[[dict[str, Any]], Any],
    summarize: Callable[[Any], dict[str, Any]],
    headline: Callable[[dict[str, Any]], str],
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str], float]:
    """``run(cfg)`` once per configuration and round; ``summarize`` its result; print ``headline(summary)``.

    Returns the summaries by configuration name (each with the CPU load around its run), the failures (a failing
    configuration is dropped from later rounds) and the wall time.
    """
    rounds: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in configs}
    failures: dict[str, str] = {}
    width = max((len(c["name"]) for c in configs), default=10) + 2
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        live = [c for c in configs if c["name"] not in failures]
        shift = rnd % max(1, len(live))
        for cfg in live[shift:] + live[:shift]:
            res, busy, foreign, probe, attempt = None, None, None, None, 0
            for attempt in range(args.retries + 1):
                busy = wait_quiet(args.quiet_wait, args.quiet_threshold) if args.quiet_wait > 0 else None
                probe = ForeignLoad()
                t0 = time.perf_counter()
                try:
                    res = run(cfg)
                except Exception as e:  # noqa: BLE001 - a crashing configuration is reported, the others go on
                    failures[cfg["name"]] = f"{type(e).__name__}: {e}"
                    print(f"  round {rnd + 1}/{args.rounds}  {cfg['name']:<{width}} FAILED: {type(e).__name__}: "
                          f"{str(e)[-3000:]}", flush=True)  # fmt: skip
                    res = None
                    break
                foreign = probe.stop()
                if foreign is None or foreign <= args.max_foreign or attempt == args.retries:
                    break
                print(f"  round {rnd + 1}/{args.rounds}  {cfg['name']:<{width}} discarded: other processes used "
                      f"{foreign:.2f} cores meanwhile (> --max-foreign {args.max_foreign}); running it again", flush=True)
            if res is None:
                continue
            s = summarize(res)
            s.update(cpu_busy_before=busy, foreign_load_cores=foreign,
                     steal_cores=probe.steal_cores if probe else None, attempts=attempt + 1)  # fmt: skip
            rounds[cfg["name"]].append(s)
            load = f", busy before {100 * busy:3.0f}%" if busy is not None else ""
            load += f", foreign load {foreign:.2f} cores" if foreign is not None else ""
            print(f"  round {rnd + 1}/{args.rounds}  {cfg['name']:<{width}} {headline(s)}  "
                  f"(wall {time.perf_counter() - t0:5.1f} s{load})", flush=True)
    return rounds, failures, time.perf_counter() - t_start
