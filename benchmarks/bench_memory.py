"""Memory and step time of the zero strategies, before and after a change, in one run (issue 39, item 1).

    .venv/bin/python benchmarks/bench_memory.py                     # c973218 against 98270af, 10 cases, 2 rounds
    .venv/bin/python benchmarks/bench_memory.py --cases zero3_2,zero3_4,zero3_bf16_2,zero3_bf16_4 --rounds 3
    .venv/bin/python benchmarks/bench_memory.py --smoke             # 1 case, 1 round, 3 steps; writes nothing

Two phalanx revisions side by side: ``--before`` (default c973218, the commit before "zero buffers come from a
pool") and ``--after`` (default 98270af, that commit), each checked out with ``git worktree add --detach`` under
``--worktrees`` (reused when already there; removed at the end unless --keep-worktrees). Each side has one server
process (``bench_memory.py --serve``, PYTHONPATH=<side>/src, ``PHALANX_DEVICE=cpu``) that imported that side's
phalanx once; for every run it calls ``phalanx.spawn(memory_workers.run, nprocs=N, threads_per_proc=1,
start_method="spawn")``, so every measured run is a fresh process group of fresh interpreters, and checks that every
rank imported phalanx from its side's tree.

The model is issue 39's (24 x Linear(1024) with tanh, on the meta device, AdamW, batch 8 x 1024; see
memory_workers.py for what a run measures). Rounds: every case once per round in an order rotated each round, both
sides of a case back to back, the side that goes first alternating from round to round. The machine is shared, so
the load average and the foreign load (CPU time of processes other than this benchmark, in cores) are recorded with
every run; only ratios within a round are worth much, and CPU time per step is less sensitive to load than wall time.

Writes ``results/zero-pool.json`` (every run, rank and phase) and ``results/zero-pool.md`` (the tables). See
benchmarks/README.md ("bench_memory.py").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # so that spawned processes (which inherit sys.path) import memory_workers

from compare_revisions import _tree_state, add_worktree, remove_worktree  # noqa: E402
from harness import (  # noqa: E402
    RANK_THREADS,
    _cpu_times,
    add_output_flags,
    add_round_flags,
    environment,
    git_state,
    per_rank_median,
    slowest_rank,
    wait_quiet,
    write_result,
)

STEM = "zero-pool"
SIDES = ("before", "after")
MiB = 2**20

# key -> (ranks, strategy, Engine options beyond strategy and seed, build on meta)
CASES: dict[str, dict[str, Any]] = {
    "zero1_2": {"nprocs": 2, "strategy": "zero1", "engine": {}},
    "zero2_2": {"nprocs": 2, "strategy": "zero2", "engine": {}},
    "zero3_2": {"nprocs": 2, "strategy": "zero3", "engine": {}},
    "zero1_4": {"nprocs": 4, "strategy": "zero1", "engine": {}},
    "zero2_4": {"nprocs": 4, "strategy": "zero2", "engine": {}},
    "zero3_4": {"nprocs": 4, "strategy": "zero3", "engine": {}},
    "zero3_offload_2": {"nprocs": 2, "strategy": "zero3", "engine": {"offload": "cpu"}},
    "zero3_hybrid_4": {"nprocs": 4, "strategy": "zero3", "engine": {"dp_replicate_size": 2}},
    # tensor parallelism splits initialised weights, so this model is built whole on every rank (not on meta)
    "zero3_tp2_4": {"nprocs": 4, "strategy": "zero3", "engine": {"tp_size": 2, "tp_plan_stack": True}, "meta": False},
    "zero1_bf16_2": {"nprocs": 2, "strategy": "zero1", "engine": {"precision": "bf16-mixed"}},
    "zero2_bf16_2": {"nprocs": 2, "strategy": "zero2", "engine": {"precision": "bf16-mixed"}},
    "zero3_bf16_2": {"nprocs": 2, "strategy": "zero3", "engine": {"precision": "bf16-mixed"}},
    "zero3_bf16_4": {"nprocs": 4, "strategy": "zero3", "engine": {"precision": "bf16-mixed"}},
    "zero3_mmap_2": {"nprocs": 2, "strategy": "zero3", "engine": {"host_mmap_threshold_mb": 1}},
    "zero3_mmap_4": {"nprocs": 4, "strategy": "zero3", "engine": {"host_mmap_threshold_mb": 1}},
}
# About 20 minutes for 2 rounds on 2 loaded cores (a 4-rank spawn alone takes 10-20 s there); zero1_4, zero2_4,
# zero3_mmap_4 and the bf16 zero1/zero2 cases are in --cases all.
DEFAULT_CASES = [
    "zero3_2",
    "zero3_4",
    "zero3_bf16_2",
    "zero3_bf16_4",
    "zero1_2",
    "zero2_2",
    "zero3_offload_2",
    "zero3_mmap_2",
    "zero3_hybrid_4",
    "zero3_tp2_4",
]


def describe_case(key: str) -> str:
    c = CASES[key]
    opts = {k: v for k, v in c["engine"].items() if k != "tp_plan_stack"}
    if c["engine"].get("tp_plan_stack"):
        opts["tp_plan"] = "even colwise / odd rowwise"
    extra = ", ".join(f"{k}={v!r}" for k, v in opts.items())
    return (
        f"{c['strategy']}, {c['nprocs']} ranks"
        + (f", {extra}" if extra else "")
        + ("" if c.get("meta", True) else ", built whole")
    )


# ------------------------------------------------------------------------------------------ the side's server


def serve(src: str) -> int:
    """``--serve SRC``: import phalanx (from SRC, via PYTHONPATH), then one phalanx.spawn per request line."""
    import memory_workers

    import phalanx

    src_path = Path(src).resolve()
    here = Path(phalanx.__file__).resolve()
    if src_path not in here.parents:
        raise SystemExit(f"this server imported phalanx from {here}, not from {src_path}")
    print("@@ready " + json.dumps({"phalanx_file": str(here)}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        c0 = _own_cpu()
        t0 = time.perf_counter()
        try:
            ranks = phalanx.spawn(
                memory_workers.run,
                nprocs=req["nprocs"],
                args=(req["spec"],),
                threads_per_proc=RANK_THREADS,
                timeout=req["timeout"],
                start_method="spawn",
            )
            wrong = [r["phalanx_file"] for r in ranks if src_path not in Path(r["phalanx_file"]).resolve().parents]
            out: dict[str, Any] = (
                {"ok": False, "error": f"ranks imported phalanx from {wrong}, not from {src_path}"}
                if wrong
                else {"ok": True, "ranks": ranks}
            )
        except Exception as e:  # noqa: BLE001 - reported to the driver, which goes on with the other cases
            out = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-3000:]}"}
        out.update(wall_s=time.perf_counter() - t0, cpu_s=_own_cpu() - c0)
        print("@@result " + json.dumps(out, default=str), flush=True)
    return 0


def _own_cpu() -> float:
    """CPU seconds of this process and of its children that ended (the ranks, once spawn joined them)."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


class Server:
    """The driver's handle on one side's server: requests on its stdin, results (and the ranks' output) on its
    stdout, read by a thread."""

    def __init__(self, side: str, tree: Path, verbose: bool) -> None:
        self.side, self.tree, self.verbose = side, tree, verbose
        self.tail: collections.deque[str] = collections.deque(maxlen=80)
        self.start()

    def start(self) -> None:
        src = self.tree / "src"
        env = dict(os.environ, PHALANX_DEVICE="cpu", PYTHONPATH=os.pathsep.join([str(src), str(HERE)]))
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", str(src)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env=env,
        )
        self.replies: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        kind, info = self.replies.get(timeout=300)
        if kind != "ready":
            raise RuntimeError(f"the {self.side} server did not start:\n" + "\n".join(self.tail))
        self.phalanx_file = info["phalanx_file"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ready "):
                self.replies.put(("ready", json.loads(line[len("@@ready ") :])))
            elif line.startswith("@@result "):
                self.replies.put(("result", json.loads(line[len("@@result ") :])))
            else:
                self.tail.append(line.rstrip())
                if self.verbose:
                    print(f"    [{self.side}] {line.rstrip()}", flush=True)
        self.replies.put(("exit", {}))

    def request(self, nprocs: int, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"nprocs": nprocs, "spec": spec, "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        try:
            kind, out = self.replies.get(timeout=timeout + 120)
        except queue.Empty:
            kind, out = "timeout", {}
        if kind != "result":
            self.close()
            self.start()  # a fresh server for the next runs
            return {"ok": False, "error": f"the {self.side} server {kind}:\n" + "\n".join(self.tail)}
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------------------------------ load around a run


class Load:
    """Around one run: the load average, and the CPU other processes used (in cores; the servers' own CPU, their
    ranks' included, is ours) and the hypervisor's steal."""

    def __init__(self) -> None:
        self.loadavg0 = os.getloadavg()
        try:
            self.busy0: int | None
            self.busy0, _, self.steal0 = _cpu_times()
        except (OSError, ValueError, IndexError):
            self.busy0 = None
        self.ours0 = _own_cpu()
        self.t0 = time.monotonic()

    def stop(self, server_cpu_s: float) -> dict[str, Any]:
        out: dict[str, Any] = {"loadavg_start": self.loadavg0, "loadavg_end": os.getloadavg()}
        if self.busy0 is None:
            return out
        busy1, _, steal1 = _cpu_times()
        wall = max(time.monotonic() - self.t0, 1e-9)
        hz = os.sysconf("SC_CLK_TCK")
        ours = _own_cpu() - self.ours0 + server_cpu_s
        out.update(
            foreign_load_cores=max(0.0, ((busy1 - self.busy0) / hz - ours) / wall),
            steal_cores=(steal1 - self.steal0) / hz / wall,
            ours_cores=ours / wall,
        )
        return out


# ------------------------------------------------------------------------------------------ what a run gave


def summarize_run(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    per_step = slowest_rank(ranks)

    def col(key: str) -> list[Any]:
        return [r.get(key) for r in ranks]

    return {
        "median_ms": 1e3 * statistics.median(per_step),
        "step_ms": [1e3 * t for t in per_step],
        "cpu_ms_per_step": [1e3 * statistics.fmean(r["cpu"]) for r in ranks],
        "cpu_ms_median_step": [1e3 * statistics.median(r["cpu"]) for r in ranks],
        "losses": ranks[0]["losses"],
        "minor_faults_per_step": col("minor_faults_per_step"),
        "prepare_s": col("prepare_s"),
        "hwm_mib": [r["hwm_over_base"] / MiB for r in ranks],
        "steps_hwm_mib": [r["steps_hwm_over_base"] / MiB for r in ranks],
        "allocated_mib": [r["allocated_peak_over_base"] / MiB for r in ranks],
        "steps_allocated_mib": [r["steps_allocated_peak_over_base"] / MiB for r in ranks],
        "rss_end_mib": [r["rss_end_over_base"] / MiB for r in ranks],
        "rss_after_step_mib": [[x / MiB for x in r["rss_after_step_over_base"]] for r in ranks],
        "expected_peak_mib": [r["expected_peak"] / MiB if r["expected_peak"] is not None else None for r in ranks],
        "held_total_mib": [r["held_total"] / MiB if r["held_total"] is not None else None for r in ranks],
        "comm_buffers_mib": [r["comm_buffers"] / MiB if r["comm_buffers"] is not None else None for r in ranks],
        "pool_mib": [r["pool_bytes"] / MiB if r.get("pool_bytes") is not None else None for r in ranks],
        "base_rss_mib": [r["base_rss"] / MiB for r in ranks],
        "phases": col("phases"),
        "heap": [{"base": r["base_heap"], "end": r["end_heap"]} for r in ranks],
        "describe": ranks[0]["describe"],
        "phalanx_files": sorted({str(r["phalanx_file"]) for r in ranks}),
    }


def _headline(side: str, s: dict[str, Any]) -> str:
    exp = max(x for x in s["expected_peak_mib"] if x is not None) if any(s["expected_peak_mib"]) else float("nan")
    return (
        f"{side} {s['median_ms']:6.0f} ms/step, CPU {statistics.fmean(s['cpu_ms_per_step']):5.0f} ms/rank, "
        f"VmHWM {max(s['hwm_mib']):5.0f}, allocated {max(s['allocated_mib']):5.0f}, expected {exp:5.0f} MiB"
    )


def run_rounds(
    keys: list[str], args: argparse.Namespace, servers: dict[str, Server], base: dict[str, Any]
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str], float]:
    """Every case once per round (rotated order), both sides back to back (alternating which goes first)."""
    rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    failures: dict[str, str] = {}
    width = max(len(k) for k in keys) + 2
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        live = [k for k in keys if k not in failures]
        shift = rnd % max(1, len(live))
        for key in live[shift:] + live[:shift]:
            case = CASES[key]
            order = SIDES if (rnd + keys.index(key)) % 2 == 0 else SIDES[::-1]  # flips every round
            spec = dict(base, strategy=case["strategy"], engine=case["engine"], meta=case.get("meta", True))
            pair: dict[str, Any] = {"first": order[0], "round": rnd + 1}
            for side in order:
                busy = wait_quiet(args.quiet_wait, args.quiet_threshold) if args.quiet_wait > 0 else None
                load = Load()
                res = servers[side].request(case["nprocs"], spec, args.timeout)
                figures = load.stop(res.get("cpu_s", 0.0))
                if not res.get("ok"):
                    failures[key] = f"{side}: {res.get('error')}"
                    print(f"  round {rnd + 1}/{args.rounds}  {key:<{width}} {side} FAILED: {res.get('error')}")
                    break
                s = summarize_run(res["ranks"])
                s.update(figures, cpu_busy_before=busy, server_wall_s=res["wall_s"])
                pair[side] = s
                la = figures["loadavg_end"][0]
                fl = figures.get("foreign_load_cores")
                print(
                    f"  round {rnd + 1}/{args.rounds}  {key:<{width}} {_headline(side, s)}  "
                    f"(wall {res['wall_s']:4.0f} s, load avg {la:.1f}"
                    + (f", foreign {fl:.2f} cores" if fl is not None else "")
                    + ")",
                    flush=True,
                )
            if key in failures:
                continue
            pair["step_ratio"] = pair["after"]["median_ms"] / pair["before"]["median_ms"]
            pair["cpu_ratio"] = statistics.fmean(pair["after"]["cpu_ms_per_step"]) / statistics.fmean(
                pair["before"]["cpu_ms_per_step"]
            )
            rounds[key].append(pair)
    return rounds, failures, time.perf_counter() - t_start


# ------------------------------------------------------------------------------------------ the rows


def _max(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return max(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


MEM_FIGURES = ("hwm_mib", "steps_hwm_mib", "allocated_mib", "steps_allocated_mib", "rss_end_mib")


def build_row(key: str, pairs: list[dict[str, Any]]) -> dict[str, Any]:
    case = CASES[key]
    n = case["nprocs"]
    row: dict[str, Any] = {"case": key, "describe": describe_case(key), "nprocs": n, "rounds": len(pairs)}
    for side in SIDES:
        runs = [p[side] for p in pairs]
        meds = [r["median_ms"] for r in runs]
        side_row: dict[str, Any] = {
            "median_ms": statistics.median(meds),
            "ms_per_round": meds,
            "cpu_ms_per_step_per_rank": per_rank_median(runs, "cpu_ms_per_step", n),
            "cpu_ms_per_step_mean_ranks_per_round": [statistics.fmean(r["cpu_ms_per_step"]) for r in runs],
            "minor_faults_per_step_per_rank": per_rank_median(runs, "minor_faults_per_step", n),
            "expected_peak_mib_per_rank": runs[0]["expected_peak_mib"],
            "held_total_mib_per_rank": runs[0]["held_total_mib"],
            "comm_buffers_mib_per_rank": runs[0]["comm_buffers_mib"],
            "pool_mib_per_rank": runs[0]["pool_mib"],
            "rss_after_step_mib_round1": runs[0]["rss_after_step_mib"],
            "loadavg_1min_per_round": [r["loadavg_end"][0] for r in runs],
            "foreign_load_cores_per_round": [r.get("foreign_load_cores") for r in runs],
        }
        side_row["cpu_ms_per_step_mean_ranks"] = statistics.median(side_row["cpu_ms_per_step_mean_ranks_per_round"])
        exp = runs[0]["expected_peak_mib"]
        for fig in MEM_FIGURES:
            per_rank = per_rank_median(runs, fig, n)
            side_row[f"{fig}_per_rank"] = per_rank
            side_row[f"{fig}_max_rank"] = _max(per_rank)
            side_row[f"{fig}_over_expected_max_rank"] = _max(
                [_ratio(v, e) for v, e in zip(per_rank, exp)] if exp else []
            )
        # growth of the resident size over the timed steps: the last step's VmRSS minus the first's, max rank
        side_row["rss_growth_timed_mib"] = statistics.median(
            max(steps[-1] - steps[0] for steps in r["rss_after_step_mib"]) for r in runs
        )
        row[side] = side_row
    b, a = row["before"], row["after"]
    step_ratios = [p["step_ratio"] for p in pairs]
    cpu_ratios = [p["cpu_ratio"] for p in pairs]
    row.update(
        step_ratio_per_round=step_ratios,
        step_ratio_median_of_rounds=statistics.median(step_ratios),
        step_ratio_of_medians=a["median_ms"] / b["median_ms"],
        cpu_ratio_per_round=cpu_ratios,
        cpu_ratio_median_of_rounds=statistics.median(cpu_ratios),
        first_per_round=[p["first"] for p in pairs],
        losses_max_rel_diff=max(
            abs(x - y) / max(abs(y), 1e-12) for x, y in zip(pairs[0]["after"]["losses"], pairs[0]["before"]["losses"])
        ),
    )
    for fig in MEM_FIGURES:
        row[f"{fig}_ratio"] = _ratio(a[f"{fig}_max_rank"], b[f"{fig}_max_rank"])
    row["expected_peak_ratio"] = _ratio(_max(a["expected_peak_mib_per_rank"]), _max(b["expected_peak_mib_per_rank"]))
    return row


# ------------------------------------------------------------------------------------------ tables


def _f(x: float | None, fmt: str = "{:.0f}") -> str:
    return fmt.format(x) if x is not None else "-"


def _list(xs: list[float | None], fmt: str = "{:.3f}") -> str:
    return ", ".join(_f(x, fmt) for x in xs)


def tables(result: dict[str, Any]) -> list[str]:
    out: list[str] = []
    a = out.append
    spec = result["spec"]
    rows = result["rows"]
    a(
        f"Model: {spec['layers']} x nn.Linear({spec['width']}, {spec['width']}) with tanh, built on the meta device "
        f"(25.2M parameters, 96 MiB fp32), AdamW(lr=1e-3), batch {spec['batch']} x {spec['width']} per rank, "
        f"{spec['warmup']} warm-up + {spec['steps']} timed + {spec['tail']} tail steps per run; "
        f'{RANK_THREADS} thread per rank, gloo, `phalanx.spawn(start_method="spawn")`, PHALANX_DEVICE=cpu. '
        f"before = {result['before']['rev']} ({result['before']['checkout']}, sources "
        f"{result['before']['src_sha256']}), after = {result['after']['rev']} ({result['after']['checkout']}, sources "
        f"{result['after']['src_sha256']}). {result['rounds']} rounds."
    )
    a("")
    ld = result["load"]
    a(
        f"Load during the run: 1-minute load average {ld['loadavg_1min_min']:.1f}-{ld['loadavg_1min_max']:.1f} "
        f"(median {ld['loadavg_1min_median']:.1f}) on {result['environment'].get('cpu_count')} cores; foreign load "
        f"(CPU of other processes) median {_f(ld['foreign_median'], '{:.2f}')}, max {_f(ld['foreign_max'], '{:.2f}')} "
        "cores."
    )
    a("")
    a("### Step time (after / before)")
    a("")
    a(
        "| case | ranks | before ms/step (per round) | after ms/step (per round) | after / before per round | median "
        "| CPU ms/step/rank before | after | CPU after / before per round | median |"
    )
    a("|---|---:|---|---|---|---:|---:|---:|---|---:|")
    for r in rows.values():
        if "failed" in r:
            a(f"| {r['case']} | {r['nprocs']} | FAILED: {r['failed'][:300]} | | | | | | | |")
            continue
        b, af = r["before"], r["after"]
        a(
            f"| {r['describe']} | {r['nprocs']} | {_list(b['ms_per_round'], '{:.0f}')} | "
            f"{_list(af['ms_per_round'], '{:.0f}')} | {_list(r['step_ratio_per_round'])} | "
            f"**{r['step_ratio_median_of_rounds']:.3f}** | {b['cpu_ms_per_step_mean_ranks']:.0f} | "
            f"{af['cpu_ms_per_step_mean_ranks']:.0f} | {_list(r['cpu_ratio_per_round'])} | "
            f"**{r['cpu_ratio_median_of_rounds']:.3f}** |"
        )
    a("")
    a(
        "ms/step: the median over the timed steps of the slowest rank's step, per round. CPU ms/step/rank: "
        "getrusage(RUSAGE_SELF) user + sys over the timed steps / steps, mean of the ranks (median of rounds). "
        "Ratios pair the two back-to-back runs of a round."
    )
    a("")
    a("### Peak memory over the runtime's baseline (MiB, the rank with the most; median of rounds)")
    a("")
    a(
        "| case | expected_peak before / after | VmHWM before | after | after / before | VmHWM / expected "
        "before | after | allocated before | after | after / before | allocated / expected before | after |"
    )
    a("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows.values():
        if "failed" in r:
            continue
        b, af = r["before"], r["after"]
        a(
            f"| {r['describe']} | {_f(_max(b['expected_peak_mib_per_rank']), '{:.1f}')} / "
            f"{_f(_max(af['expected_peak_mib_per_rank']), '{:.1f}')} | {_f(b['hwm_mib_max_rank'])} | "
            f"{_f(af['hwm_mib_max_rank'])} | **{_f(r['hwm_mib_ratio'], '{:.3f}')}** | "
            f"{_f(b['hwm_mib_over_expected_max_rank'], '{:.2f}')} | "
            f"{_f(af['hwm_mib_over_expected_max_rank'], '{:.2f}')} | "
            f"{_f(b['allocated_mib_max_rank'], '{:.1f}')} | {_f(af['allocated_mib_max_rank'], '{:.1f}')} | "
            f"**{_f(r['allocated_mib_ratio'], '{:.3f}')}** | "
            f"{_f(b['allocated_mib_over_expected_max_rank'], '{:.3f}')} | "
            f"{_f(af['allocated_mib_over_expected_max_rank'], '{:.3f}')} |"
        )
    a("")
    a(
        "VmHWM: peak resident memory of the whole run (prepare and every step) minus VmRSS at the baseline, where "
        "VmHWM was reset (`/proc/self/clear_refs` 5). allocated: the most bytes held from glibc (mallinfo2 "
        "`uordblks + hblkhd`), read after every torch op of prepare, the warm-up and the tail steps, minus the "
        "baseline's. expected_peak: each revision's own `engine.memory_report()[\"expected_peak\"]` (the formula "
        "changed with the pool). X / expected: the largest over ranks of each rank's own ratio."
    )
    a("")
    a("### The steps alone, and what stays resident")
    a("")
    a(
        "| case | steps' VmHWM before | after | after / before | steps' allocated before | after | VmRSS at the end "
        "before | after | VmRSS growth over the timed steps before | after | minor faults/step before | after |"
    )
    a("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows.values():
        if "failed" in r:
            continue
        b, af = r["before"], r["after"]
        a(
            f"| {r['describe']} | {_f(b['steps_hwm_mib_max_rank'])} | {_f(af['steps_hwm_mib_max_rank'])} | "
            f"{_f(r['steps_hwm_mib_ratio'], '{:.3f}')} | {_f(b['steps_allocated_mib_max_rank'], '{:.1f}')} | "
            f"{_f(af['steps_allocated_mib_max_rank'], '{:.1f}')} | {_f(b['rss_end_mib_max_rank'])} | "
            f"{_f(af['rss_end_mib_max_rank'])} | {b['rss_growth_timed_mib']:+.0f} | "
            f"{af['rss_growth_timed_mib']:+.0f} | "
            f"{_f(_max(b['minor_faults_per_step_per_rank']))} | {_f(_max(af['minor_faults_per_step_per_rank']))} |"
        )
    a("")
    a(
        "steps' VmHWM: VmHWM reset again after prepare, so the peak of the steps alone (for the tp case, whose model "
        "is built whole before prepare, this is the figure to read). VmRSS growth: the last timed step's VmRSS minus "
        "the first's (largest rank)."
    )
    a("")
    a("### Checks")
    a("")
    for r in rows.values():
        if "failed" in r:
            continue
        d = r["losses_max_rel_diff"]
        a(
            f"- {r['describe']}: losses before / after "
            + ("identical" if d == 0 else f"max rel diff {d:.1e}")
            + f"; first ran: {', '.join(r['first_per_round'])}"
        )
    return out


def write_markdown(result: dict[str, Any], args: argparse.Namespace) -> None:
    if args.no_json:
        return
    lines = [
        "# Zero strategies before and after the buffer pool: memory and step time (bench_memory.py)",
        "",
        f"Command: `{result['command']}`; benchmark code {result['benchmark_checkout']}, finished "
        f"{result.get('finished', '')}, wall {result['wall_s']:.0f} s. Full figures: `{STEM}.json`.",
        "",
        *tables(result),
        "",
        "### Definitions",
        "",
        *(f"- `{k}`: {v}" for k, v in result["definitions"].items()),
        "",
    ]
    path = Path(args.out) / (f"{STEM}-{args.tag}.md" if args.tag else f"{STEM}.md")
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


DEFINITIONS = {
    "baseline": "in each rank after phalanx.Engine(...) (the process group), an AdamW's first use and gc.collect(): "
    "VmRSS and mallinfo2 are read there and VmHWM is reset to it; every memory figure is over it",
    "median_ms": "median over the timed steps of the slowest rank's step time (time.perf_counter around forward, "
    "engine.backward, opt.step, opt.zero_grad); per round, then the median of rounds",
    "cpu_ms_per_step": "getrusage(RUSAGE_SELF) ru_utime + ru_stime of the rank over each timed step (every thread: "
    "gloo's included), mean over the steps",
    "step_ratio / cpu_ratio": "after / before of the two back-to-back runs of a round (which side ran first "
    "alternates); median of rounds",
    "hwm": "VmHWM of the whole run over the baseline RSS (prepare: the larger of prepare's and the steps' peaks)",
    "allocated": "largest glibc mallinfo2 uordblks + hblkhd (every arena) sampled after each torch op by a "
    "TorchDispatchMode over prepare, the warm-up and the tail steps, minus the baseline's",
    "expected_peak": "engine.memory_report()['expected_peak'] of the revision that ran (held bytes + the plan's "
    "buffers + a step's transients)",
    "foreign_load_cores": "CPU time used by processes other than this benchmark (its servers and their ranks) during "
    "a run, / wall time",
}


# ------------------------------------------------------------------------------------------ main


def bench(args: argparse.Namespace, trees: dict[str, Path], revs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    keys = DEFAULT_CASES if args.cases == "default" else list(CASES) if args.cases == "all" else args.cases.split(",")
    bad = [k for k in keys if k not in CASES]
    if bad:
        raise SystemExit(f"--cases: unknown {bad}; known: {', '.join(CASES)}")
    base = {"seed": args.seed, "warmup": args.warmup, "steps": args.steps, "tail": args.tail}
    start = {side: _tree_state(trees[side]) for side in SIDES}
    print(
        f"=== zero pool: {len(keys)} cases x {args.rounds} rounds; "
        + " vs ".join(f"{side} {revs[side]['rev']} ({start[side]['checkout']})" for side in SIDES)
        + f"; load average {os.getloadavg()[0]:.1f} ===",
        flush=True,
    )
    servers: dict[str, Server] = {}
    t0 = time.perf_counter()
    try:
        for side in SIDES:
            servers[side] = Server(side, trees[side], args.verbose)
            print(f"  {side} server: phalanx from {servers[side].phalanx_file}", flush=True)
        rounds, failures, wall = run_rounds(keys, args, servers, base)
    finally:
        for s in servers.values():
            s.close()
    end = {side: _tree_state(trees[side]) for side in SIDES}
    for side in SIDES:
        if end[side] != start[side]:
            print(f"WARNING: the {side} sources changed during the run ({start[side]} -> {end[side]})")
    rows = {}
    for key in keys:
        if rounds[key] and key not in failures:
            rows[key] = build_row(key, rounds[key])
        else:
            rows[key] = {"case": key, "nprocs": CASES[key]["nprocs"], "failed": failures.get(key, "no result")}
    runs = [p[side] for pairs in rounds.values() for p in pairs for side in SIDES if side in p]
    la = [r["loadavg_end"][0] for r in runs] + [r["loadavg_start"][0] for r in runs]
    fl = [r["foreign_load_cores"] for r in runs if r.get("foreign_load_cores") is not None]
    result = {
        "benchmark": "bench_memory",
        "command": " ".join([".venv/bin/python benchmarks/bench_memory.py", *map(shlex.quote, args.argv)]).strip(),
        "spec": {**base, "layers": 24, "width": 1024, "batch": 8, "cases": keys},
        "cases": {k: CASES[k] for k in keys},
        "rounds": args.rounds,
        "threads_per_rank": RANK_THREADS,
        "before": {**revs["before"], **start["before"], "src": str(trees["before"] / "src")},
        "after": {**revs["after"], **start["after"], "src": str(trees["after"] / "src")},
        "sources_changed": {side: end[side] for side in SIDES if end[side] != start[side]},
        "benchmark_checkout": git_state(REPO),
        "load": {
            "loadavg_1min_min": min(la) if la else None,
            "loadavg_1min_max": max(la) if la else None,
            "loadavg_1min_median": statistics.median(la) if la else None,
            "foreign_median": statistics.median(fl) if fl else None,
            "foreign_max": max(fl) if fl else None,
        },
        "rows": rows,
        "failures": failures,
        "raw_rounds": rounds,
        "wall_s": time.perf_counter() - t0,
        "rounds_wall_s": wall,
        "definitions": DEFINITIONS,
    }
    return result


SMOKE = {"rounds": 1, "warmup": 1, "steps": 1, "tail": 1, "cases": "zero3_2", "no_json": True}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="c973218", help="the revision before the change")
    p.add_argument("--after", default="98270af", help="the revision with the change")
    p.add_argument(
        "--cases",
        default="default",
        help=f"comma-separated, 'default' ({', '.join(DEFAULT_CASES)}) or 'all' ({', '.join(CASES)})",
    )
    add_round_flags(p, rounds=2, timeout=600.0)
    # a shared machine: waiting for quiet or running a loaded run again doubles the time; the load is recorded
    p.set_defaults(quiet_wait=0.0, retries=0)
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps (allocated peak sampled)")
    p.add_argument("--steps", type=int, default=7, help="timed steps")
    p.add_argument("--tail", type=int, default=1, help="steps after the timed ones (allocated peak sampled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="zero3 on 2 ranks, 1 round, 3 steps; writes nothing")
    p.add_argument("--worktrees", default="/tmp/phalanx-pool", help="the sides are checked out at <this>-<side>")
    p.add_argument("--keep-worktrees", action="store_true", help="leave the worktrees in place at the end")
    p.add_argument("--verbose", action="store_true", help="print the ranks' output")
    add_output_flags(p, HERE / "results", STEM)
    return p


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if len(raw) == 2 and raw[0] == "--serve":
        return serve(raw[1])
    args = build_parser().parse_args(raw)
    args.argv = raw
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    env = environment(with_phalanx=False)
    trees: dict[str, Path] = {}
    revs: dict[str, dict[str, Any]] = {}
    try:
        for side in SIDES:
            rev = getattr(args, side)
            wt = Path(f"{args.worktrees}-{side}")
            sha = add_worktree(rev, wt)
            trees[side], revs[side] = wt.resolve(), {"rev": rev, "commit": sha}
        result = bench(args, trees, revs)
        print("\n" + "\n".join(tables({**result, "environment": env})))
        write_result(result, args, STEM, env, raw)
        write_markdown(result, args)
    finally:
        if not args.keep_worktrees:
            for wt in trees.values():
                remove_worktree(wt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
