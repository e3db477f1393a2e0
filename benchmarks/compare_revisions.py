"""phalanx against a baseline revision of itself, side by side in one run: the phalanx rows of bench_ddp (phalanx ddp),
bench_zero (phalanx zero3) or bench_pipeline (phalanx gpipe and 1f1b), run alternately with phalanx imported from the
baseline's src/ and from the current tree's src/.

    .venv/bin/python benchmarks/compare_revisions.py --baseline main~1 --bench ddp              # 4 rounds, mlp
    .venv/bin/python benchmarks/compare_revisions.py --baseline <rev> --bench ddp,zero3,pipeline --rounds 6
    .venv/bin/python benchmarks/compare_revisions.py --baseline HEAD --bench pipeline --rounds 1 --steps 2 --warmup 1 \\
        --quiet-wait 0 --no-json                                                                # smoke run

The baseline is checked out with ``git worktree add --detach`` (``--worktree``, /tmp/phalanx-baseline; removed at the
end unless --keep-worktree). Both sides run the benchmark code of this tree (its workers, harness.py's loop), so the
only difference is the phalanx package. Every run is a child process with PYTHONPATH=<tree>/src, which starts the
ranks with phalanx.spawn; each rank reports the phalanx.__file__ it imported, the run fails when that is not under the
intended tree, and each run prints the files its ranks imported. Rounds are harness.py's (the configurations in an
order rotated each round, the quiet wait, the foreign-load retry); one run of a configuration in a round is a pair,
the two sides back to back, the side that goes first alternating. A verdict needs 3 or more rounds. Peers (torch DDP,
FSDP2, torch.distributed.pipelining) are not part of this comparison. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from harness import (  # noqa: E402
    add_output_flags,
    add_round_flags,
    environment,
    git_state,
    interleaved_rounds,
    src_digest,
    write_result,
)

# bench key -> (benchmark module, its arguments that keep the phalanx rows only, workloads)
BENCHES: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
    "ddp": ("bench_ddp", ["--only", "phalanx_ddp", "--no-accelerate"], ("mlp", "gpt")),
    "zero3": ("bench_zero", ["--only", "zero3", "--no-deepspeed"], ("mlp", "gpt", "gpt20m")),
    "pipeline": ("bench_pipeline", ["--only", "phalanx"], ("mlp",)),
}
SIDES = ("current", "baseline")


# ------------------------------------------------------------------------------------------ the benchmarks' own plans


def plan(bench: str, bench_argv: list[str]) -> tuple[list[dict[str, Any]], Callable[[dict[str, Any]], Any], Any]:
    """The benchmark's configurations for ``bench_argv`` (its own parser, defaults and filters), how it runs one
    (spawned ranks, their results) and how it summarizes one run."""
    module, _, _ = BENCHES[bench]
    with contextlib.redirect_stdout(io.StringIO()):  # the benchmarks print their [skip] lines
        if module == "bench_ddp":
            import bench_ddp

            args = bench_ddp.build_parser().parse_args(bench_argv)
            base = bench_ddp.base_spec(args.workload, args)
            configs = bench_ddp.configurations(args, base["global_batch"], 2)
            return (
                configs,
                lambda c: bench_ddp.run_config(args.workload, base, c, args.timeout),
                bench_ddp.summarize_round,
            )
        if module == "bench_zero":
            import bench_zero

            args = bench_zero.build_parser().parse_args(bench_argv)
            base = bench_zero.base_spec(args.workload, args)
            configs = bench_zero.configurations(args, base["global_batch"], 2, False, "--no-deepspeed")
            return (
                configs,
                lambda c: bench_zero.run_config(args.workload, base, c, args.timeout),
                bench_zero.summarize_round,
            )
        import bench_pipeline

        args = bench_pipeline.build_parser().parse_args(bench_argv)
        base = bench_pipeline.base_spec(args)
        configs = bench_pipeline.configurations(args)
        return configs, lambda c: bench_pipeline.run_config(base, c, args.timeout), bench_pipeline.summarize_round


def bench_argv(bench: str, args: argparse.Namespace) -> list[str]:
    _, only, workloads = BENCHES[bench]
    argv = list(only) if not args.only else ["--only", args.only] + [a for a in only if a.startswith("--no-")]
    if len(workloads) > 1:
        argv += ["--workload", args.workload]
    for flag in ("steps", "warmup"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag}", str(getattr(args, flag))]
    return argv + ["--timeout", str(args.timeout)] + shlex.split(args.bench_args)


# ------------------------------------------------------------------------------------------ one run (child process)


def run_one(request_path: str) -> int:
    """Runs in a child process whose PYTHONPATH starts with the side's src/: one configuration, one run."""
    req = json.loads(Path(request_path).read_text())
    src = Path(req["src"]).resolve()
    import phalanx

    here = Path(phalanx.__file__).resolve()
    if src not in here.parents:
        raise SystemExit(f"this process imported phalanx from {here}, not from {src}")
    configs, run, summarize = plan(req["bench"], req["bench_argv"])
    cfg = next(c for c in configs if c["name"] == req["config"])
    results = run(cfg)
    files = [r.get("phalanx_file") for r in results]
    wrong = [f for f in files if f is None or src not in Path(f).resolve().parents]
    if wrong:
        raise SystemExit(f"ranks imported phalanx from {files}, not from {src}")
    s = summarize(results)
    out = {k: s[k] for k in ("median_ms", "step_ms", "losses", "param_checksum", "peak_rss_mib", "cpu_ms_per_step")}
    out.update(phalanx_file_driver=str(here), phalanx_file_ranks=files)
    Path(req["out"]).write_text(json.dumps(out, default=str))
    return 0


# ------------------------------------------------------------------------------------------ worktrees


def _git(*argv: str, cwd: Path = REPO) -> str:
    p = subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"git {' '.join(argv)} failed: {p.stderr.strip()}")
    return p.stdout.strip()


def _worktrees() -> dict[Path, str]:
    """Registered worktrees of this repository: path -> HEAD."""
    out: dict[Path, str] = {}
    path = None
    for line in _git("worktree", "list", "--porcelain").splitlines():
        if line.startswith("worktree "):
            path = Path(line[len("worktree ") :]).resolve()
        elif line.startswith("HEAD ") and path is not None:
            out[path] = line[len("HEAD ") :]
    return out


def add_worktree(rev: str, path: Path) -> str:
    """``git worktree add --detach path rev`` (reusing ``path`` when it is a clean worktree at that commit already,
    e.g. from --keep-worktree). Returns the commit."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = path.resolve()
    existing = _worktrees()
    if path in existing:
        if existing[path] == sha and not _git("status", "--porcelain", cwd=path):
            print(f"reusing the worktree {path} at {sha[:10]}", flush=True)
            return sha
        _git("worktree", "remove", "--force", str(path))
    elif path.exists():
        raise SystemExit(f"{path} exists and is not a worktree of {REPO}; remove it or pass another --worktree")
    _git("worktree", "add", "--detach", str(path), sha)
    print(f"git worktree add --detach {path} {rev} ({sha[:10]})", flush=True)
    return sha


def remove_worktree(path: Path) -> None:
    _git("worktree", "remove", "--force", str(path.resolve()))
    print(f"removed the worktree {path}", flush=True)


# ------------------------------------------------------------------------------------------ one benchmark, both sides


def verdict(ratios: list[float], tolerance: float) -> str:
    """From the per-round current/baseline ratios: a slowdown is one the median shows beyond ``tolerance`` and every
    round agrees with; fewer than 3 rounds give no verdict."""
    n, med = len(ratios), statistics.median(ratios)
    if n < 3:
        return f"no verdict ({n} round{'s' if n > 1 else ''}; 3 or more needed)"
    if med <= 1.0 + tolerance:
        return "no slowdown beyond noise"
    if all(x > 1.0 for x in ratios):
        return f"SLOWER: median ratio above 1 + {tolerance:g} and slower in every round"
    return f"unclear: median ratio above 1 + {tolerance:g}, not slower in every round; run more rounds"


def _tree_state(root: Path) -> dict[str, str]:
    return {"checkout": git_state(root), "src_sha256": src_digest(root / "src" / "phalanx")}


def compare(
    bench: str,
    args: argparse.Namespace,
    trees: dict[str, Path],
    revs: dict[str, dict[str, Any]],
    env: dict[str, Any],
    argv: list[str] | None,
) -> dict[str, Any]:
    b_argv = bench_argv(bench, args)
    configs, _, _ = plan(bench, b_argv)
    rows = [c["name"] for c in configs]
    if not rows:
        raise SystemExit(f"--only {args.only!r} leaves no configuration of {bench}")
    workload = args.workload if len(BENCHES[bench][2]) > 1 else BENCHES[bench][2][0]
    start = {side: _tree_state(trees[side]) for side in SIDES}
    same = start["current"]["src_sha256"] == start["baseline"]["src_sha256"]
    print(
        f"\n=== {bench} ({BENCHES[bench][0]} {' '.join(b_argv)}): {', '.join(rows)}; "
        + " vs ".join(
            f"{side} {trees[side] / 'src'} ({start[side]['checkout']}, sources {start[side]['src_sha256']})"
            for side in SIDES
        )
        + f"; {args.rounds} rounds ==="
        + ("\n(the two src/ trees are identical: the ratios measure the noise)" if same else ""),
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="phalanx-compare-"))

    def run_side(row: str, side: str) -> dict[str, Any]:
        req = work / "request.json"
        out = work / f"{side}.json"
        out.unlink(missing_ok=True)
        src = trees[side] / "src"
        req.write_text(
            json.dumps({"bench": bench, "bench_argv": b_argv, "config": row, "src": str(src), "out": str(out)})
        )
        pypath = os.environ.get("PYTHONPATH")
        child_env = dict(os.environ, PYTHONPATH=str(src) + (os.pathsep + pypath if pypath else ""))
        try:
            p = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--run-one", str(req)],
                env=child_env,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=args.timeout + 300,
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"the {side} run did not finish within {args.timeout + 300:.0f} s") from e
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"the {side} run failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
        res = json.loads(out.read_text())
        files = res["phalanx_file_ranks"]
        print(
            f"    {side:<8} {row}: ranks 0-{len(files) - 1} imported phalanx from {', '.join(sorted(set(files)))}",
            flush=True,
        )
        return res

    calls: dict[str, int] = {}

    def run(cfg: dict[str, Any]) -> dict[str, Any]:
        """One run per side, back to back; which side goes first alternates from one call to the next."""
        n = calls[cfg["name"]] = calls.get(cfg["name"], 0) + 1
        order = SIDES if n % 2 else SIDES[::-1]
        pair: dict[str, Any] = {"first": order[0]}
        for side in order:
            pair[side] = run_side(cfg["name"], side)
        pair["ratio"] = pair["current"]["median_ms"] / pair["baseline"]["median_ms"]
        return pair

    def headline(s: dict[str, Any]) -> str:
        return (
            f"current {s['current']['median_ms']:7.1f} / baseline {s['baseline']['median_ms']:7.1f} ms/step = "
            f"{s['ratio']:.3f} ({s['first']} ran first)"
        )

    try:
        rounds, failures, wall = interleaved_rounds([{"name": row} for row in rows], args, run, lambda s: s, headline)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    end = {side: _tree_state(trees[side]) for side in SIDES}
    for side in SIDES:
        if end[side] != start[side]:
            print(
                f"WARNING: the {side} sources changed during the run ({start[side]['checkout']} "
                f"{start[side]['src_sha256']} -> {end[side]['checkout']} {end[side]['src_sha256']}); run it again."
            )

    results = []
    for row in rows:
        pairs = rounds[row]
        r: dict[str, Any] = {
            "name": row,
            "baseline_ms_per_round": [x["baseline"]["median_ms"] for x in pairs],
            "current_ms_per_round": [x["current"]["median_ms"] for x in pairs],
            "first_per_round": [x["first"] for x in pairs],
        }
        if pairs:
            paired = [x["ratio"] for x in pairs]
            med = statistics.median(paired)
            cur, base = pairs[0]["current"], pairs[0]["baseline"]
            r.update(
                ratio_per_round=paired,
                median_ratio=med,
                ratio_of_medians=statistics.median(r["current_ms_per_round"])
                / statistics.median(r["baseline_ms_per_round"]),
                rounds_current_slower=sum(x > 1.0 for x in paired),
                verdict=verdict(paired, args.tolerance),
                loss_max_rel_diff=max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(cur["losses"], base["losses"])),
                phalanx_files={"current": cur["phalanx_file_ranks"], "baseline": base["phalanx_file_ranks"]},
            )
        else:
            r["verdict"] = "no result: " + failures.get(row, "")[:300]
        results.append(r)

    print(
        f"\n### {bench} `{workload}`: current ({start['current']['checkout']}, src {start['current']['src_sha256']}) "
        f"/ baseline ({revs['baseline']['rev']} = {start['baseline']['checkout']}, src "
        f"{start['baseline']['src_sha256']}); median step ms per run, {args.rounds} rounds; wall {wall:.0f} s\n"
    )
    print(
        "| configuration | baseline ms per round | current ms per round | current / baseline per round | median "
        "ratio | ratio of medians | verdict |\n|---|---|---|---|---:|---:|---|"
    )

    def fmt(vals: list[float], f: str = "{:.1f}") -> str:
        return ", ".join(f.format(x) for x in vals)

    for r in results:
        if "median_ratio" not in r:
            print(
                f"| {r['name']} | {fmt(r['baseline_ms_per_round'])} | {fmt(r['current_ms_per_round'])} | | | | "
                f"{r['verdict']} |"
            )
            continue
        print(
            f"| {r['name']} | {fmt(r['baseline_ms_per_round'])} | {fmt(r['current_ms_per_round'])} | "
            f"{fmt(r['ratio_per_round'], '{:.3f}')} | {r['median_ratio']:.3f} | {r['ratio_of_medians']:.3f} | "
            f"{r['verdict']} |"
        )
    for r in results:
        if "loss_max_rel_diff" in r:
            d = r["loss_max_rel_diff"]
            print(
                f"losses {r['name']}: "
                + (
                    "identical on both sides"
                    if d == 0
                    else f"max rel diff {d:.1e} between "
                    "the sides" + ("  <-- the restructure changed the numbers" if d > 1e-5 else "")
                )
            )
    if failures:
        print("\nfailed runs:")
        for name, err in failures.items():
            print(f"  {name}: {err[-3000:]}")
    result = {
        "bench": bench,
        "workload": workload,
        "bench_argv": b_argv,
        "rounds": args.rounds,
        "tolerance": args.tolerance,
        "wall_s": wall,
        "baseline": {**revs["baseline"], **start["baseline"], "src": str(trees["baseline"] / "src")},
        "current": {
            **revs["current"],
            **start["current"],
            "src": str(trees["current"] / "src"),
            **({"src_sha256_end": end["current"]["src_sha256"]} if end["current"] != start["current"] else {}),
        },
        "identical_sources": same,
        "definitions": {
            "ms_per_round": "each run's median over its timed steps of the step time (the slowest rank per step), "
            "as in the benchmark",
            "ratio_per_round": "current / baseline of the two back-to-back runs of a round (first_per_round: which "
            "side ran first; it alternates)",
            "median_ratio": "median of ratio_per_round",
            "verdict": "fewer than 3 rounds: none; median_ratio <= 1 + tolerance: no slowdown beyond noise; above it "
            "and current slower in every round: SLOWER; else unclear (run more rounds)",
            "ratio_of_medians": "median of current_ms_per_round / median of baseline_ms_per_round",
            "loss_max_rel_diff": "largest relative difference of the per-step losses of the first runs of both sides",
        },
        "rows": results,
        "failures": failures,
        "raw_rounds": rounds,
    }
    write_result(result, args, f"compare-{bench}-{workload}", env, argv)
    return result


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--run-one":
        return run_one(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git revision to compare against (e.g. main~1, a commit)")
    p.add_argument(
        "--current",
        default="",
        help="git revision of the current side (default: this working tree, uncommitted changes included)",
    )
    p.add_argument(
        "--bench",
        default="ddp",
        help="ddp, zero3, pipeline, or several comma-separated (run one after the other, one result file each)",
    )
    p.add_argument("--workload", default="mlp", help="workload of bench_ddp / bench_zero (mlp, gpt; zero3: gpt20m)")
    add_round_flags(p, rounds=4, timeout=600.0)
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: the benchmark's)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps per run (default: the benchmark's)")
    p.add_argument("--only", default="", help="the benchmark's --only instead of its phalanx rows (e.g. phalanx_1f1b)")
    p.add_argument("--bench-args", default="", help="more arguments for the benchmark, e.g. '--adamw fused'")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="a median current/baseline ratio up to 1 + this is no slowdown (0.05); see the verdicts",
    )
    p.add_argument("--worktree", default="/tmp/phalanx-baseline", help="where the baseline is checked out")
    p.add_argument("--keep-worktree", action="store_true", help="leave the worktree(s) in place at the end")
    add_output_flags(p, HERE / "results", "compare-<bench>-<workload>")
    args = p.parse_args(argv)
    benches = [b.strip() for b in args.bench.split(",") if b.strip()]
    bad = [b for b in benches if b not in BENCHES]
    if bad or not benches:
        raise SystemExit(f"--bench: {bad or args.bench!r} not in {', '.join(BENCHES)}")
    for b in benches:
        if len(BENCHES[b][2]) > 1 and args.workload not in BENCHES[b][2]:
            raise SystemExit(f"--workload {args.workload} is not a workload of {b} ({', '.join(BENCHES[b][2])})")

    env = environment(with_phalanx=False)
    made: list[Path] = []
    trees: dict[str, Path] = {}
    revs: dict[str, dict[str, Any]] = {}
    try:
        wt = Path(args.worktree)
        sha = add_worktree(args.baseline, wt)
        made.append(wt)
        trees["baseline"], revs["baseline"] = wt.resolve(), {"rev": args.baseline, "commit": sha}
        if args.current:
            wt_cur = Path(f"{args.worktree}-current")
            sha = add_worktree(args.current, wt_cur)
            made.append(wt_cur)
            trees["current"], revs["current"] = wt_cur.resolve(), {"rev": args.current, "commit": sha}
        else:
            trees["current"], revs["current"] = REPO, {"rev": "working tree", "commit": _git("rev-parse", "HEAD")}
        t0 = time.perf_counter()
        for b in benches:
            compare(b, args, trees, revs, env, argv)
        print(f"\ncompare_revisions: {', '.join(benches)} in {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        if not args.keep_worktree:
            for wt in made:
                remove_worktree(wt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
