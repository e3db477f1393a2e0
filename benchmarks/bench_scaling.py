"""Scaling curves: step time and peak memory per rank of phalanx ddp, zero1, zero2 and zero3 beside torch FSDP2 (and
DeepSpeed ZeRO-3 where it is installed), for world sizes 1-4 and GPT models from 8M to 200M parameters, on CPU
over gloo.

    .venv/bin/python benchmarks/bench_scaling.py                     # the full grid (64 min with ~1 core of other work)
    .venv/bin/python benchmarks/bench_scaling.py --quick             # 8M and 25M, world sizes 1 and 2 (about 5 min)
    .venv/bin/python benchmarks/bench_scaling.py --sizes 8m,50m --worlds 2,4 --strategies zero3,fsdp2
    .venv/bin/python benchmarks/bench_scaling.py --replot benchmarks/results/scaling-cpu.json   # table + plot again

Every (world size, model size) cell runs each strategy in fresh processes started by phalanx.spawn (1 thread per
rank), side by side: the rounds of a cell are harness.interleaved_rounds (every strategy once per round, in an order
rotated each round), so the strategies of a cell ran minutes apart at most; compare them by their ratios. Each rank
trains on the same number of tokens at every world size (weak scaling), so on 2 cores the 3- and 4-rank cells measure
the ranks' total work more than their overlap. Writes ``results/scaling-cpu.{json,md,png}`` (the plot needs
matplotlib: ``pip install -e .[plot]``; without it the JSON and the table are still written). See
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # so that spawned processes (which inherit sys.path) import scaling_workers

import scaling_workers  # noqa: E402
from bench_zero import TOL_FINAL, TOL_FIRST, deepspeed_status, summarize_round  # noqa: E402
from harness import (  # noqa: E402
    RANK_THREADS,
    add_output_flags,
    add_round_flags,
    environment,
    interleaved_rounds,
    per_rank_median,
    source_record,
    source_state,
    spawn_ranks,
    write_result,
)

STEM = "scaling-cpu"

# TinyGPT (byte vocabulary, tied head, head size 64) at five sizes; the block size is --seq.
SIZES: dict[str, dict[str, int]] = {
    "8m": {"n_embd": 256, "n_layer": 10, "n_head": 4},  # 8.0M parameters
    "25m": {"n_embd": 512, "n_layer": 8, "n_head": 8},  # 25.4M
    "50m": {"n_embd": 768, "n_layer": 7, "n_head": 12},  # 49.9M
    "100m": {"n_embd": 1024, "n_layer": 8, "n_head": 16},  # 101M
    "200m": {"n_embd": 1280, "n_layer": 10, "n_head": 20},  # 197M
}
# (warm-up, timed) steps per size: few for the big ones, whose 4-rank steps take seconds on 2 cores.
STEPS: dict[str, tuple[int, int]] = {"8m": (2, 6), "25m": (2, 5), "50m": (2, 4), "100m": (2, 3), "200m": (2, 3)}

# --strategies key: (row name, worker kind, what the worker's spec gets)
STRATEGIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "ddp": ("phalanx ddp", "phalanx", {"strategy": "ddp"}),
    "zero1": ("phalanx zero1", "phalanx", {"strategy": "zero1"}),
    "zero2": ("phalanx zero2", "phalanx", {"strategy": "zero2"}),
    "zero3": ("phalanx zero3", "phalanx", {"strategy": "zero3"}),
    "fsdp2": ("FSDP2 per block", "fsdp2", {}),
    "ds3": ("DeepSpeed ZeRO-3", "deepspeed", {"ds_stage": 3}),
    "torch_ddp": ("torch DDP", "torch_ddp", {}),
}
DEFAULT_STRATEGIES = "ddp,zero1,zero2,zero3,fsdp2,ds3"
QUICK = {"sizes": "8m,25m", "worlds": "1,2", "warmup": 1, "steps": 2}

# The ratios the table shows: numerator row / denominator row, at the same world size and model size.
PEER_RATIOS = [("phalanx zero3", "FSDP2 per block"), ("phalanx zero3", "DeepSpeed ZeRO-3")]


def param_count(size: str, seq: int) -> int:
    """Parameters of ``size`` (the tied head counted once), from a build on the meta device."""
    from phalanx.demo import GPTConfig, TinyGPT

    with torch.device("meta"):
        model = TinyGPT(GPTConfig(**SIZES[size], block_size=seq))
    return sum(p.numel() for p in model.parameters())


def _csv(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


# ================================================================================================ running


def run_cell(size: str, world: int, keys: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Every strategy of ``keys`` at one (model size, world size), in interleaved rounds; the cell's rows."""
    warmup, steps = STEPS[size]
    spec = {
        "seed": args.seed,
        "lr": 1e-3,
        "adamw": args.adamw,
        "gpt": {**SIZES[size], "block_size": args.seq},
        "local_batch": args.local_batch,
        "global_batch": args.local_batch * world,
        "warmup": args.warmup if args.warmup is not None else warmup,
        "steps": args.steps if args.steps is not None else steps,
    }
    n_params = param_count(size, args.seq)
    configs = []
    for k in keys:
        name, kind, extra = STRATEGIES[k]
        configs.append({"key": k, "name": name, "kind": kind, "spec": {**spec, **extra}})
    print(
        f"\n=== {size} ({n_params / 1e6:.1f}M parameters), world size {world}: {len(configs)} strategies, "
        f"{spec['warmup']} warm-up + {spec['steps']} timed steps, {args.rounds} round(s) ===",
        flush=True,
    )

    def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
        s = summarize_round(results)
        s.update(
            build_peak_rss_mib=[r["build_peak_hwm_mib"] for r in results],
            base_rss_mib=[r["base_rss_mib"] for r in results],
            hwm_reset=all(r["hwm_reset"] for r in results),
        )
        return s

    def headline(s: dict[str, Any]) -> str:
        run_peak = max(max(a, b) for a, b in zip(s["build_peak_rss_mib"], s["peak_rss_mib"]))
        return f"{s['median_ms']:9.1f} ms/step, peak {run_peak:6.0f} MiB/rank (steps {max(s['peak_rss_mib']):6.0f})"

    rounds, failures, wall = interleaved_rounds(
        configs,
        args,
        lambda cfg: spawn_ranks(scaling_workers.run, world, (cfg["kind"], cfg["spec"]), args.timeout),
        summarize,
        headline,
    )
    rows = [_row(cfg, rounds[cfg["name"]], failures.get(cfg["name"]), world) for cfg in configs]
    cell = {"size": size, "world": world, "n_params": n_params, "spec": spec, "wall_s": wall, "rows": rows}
    _add_ratios(cell)
    return cell


def _row(cfg: dict[str, Any], rs: list[dict[str, Any]], failure: str | None, n: int) -> dict[str, Any]:
    row: dict[str, Any] = {"key": cfg["key"], "name": cfg["name"], "kind": cfg["kind"]}
    if not rs:
        return {**row, "failed": failure or "no result"}
    train = per_rank_median(rs, "peak_rss_mib", n)
    build = per_rank_median(rs, "build_peak_rss_mib", n)
    base = per_rank_median(rs, "base_rss_mib", n)
    run_peak = [max(a, b) for a, b in zip(build, train)]  # type: ignore[type-var]
    row.update(
        median_ms=statistics.median(r["median_ms"] for r in rs),
        round_medians_ms=[r["median_ms"] for r in rs],
        step_ms=rs[0]["step_ms"],
        peak_rss_mib_per_rank=run_peak,
        steps_peak_rss_mib_per_rank=train,
        build_peak_rss_mib_per_rank=build,
        base_rss_mib_per_rank=base,
        peak_rss_mib=max(run_peak),
        steps_peak_rss_mib=max(train),  # type: ignore[type-var]
        steps_peak_above_base_mib=max(t - b for t, b in zip(train, base)),  # type: ignore[operator]
        cpu_ms_per_step_per_rank=per_rank_median(rs, "cpu_ms_per_step", n),
        foreign_load_cores=[r["foreign_load_cores"] for r in rs],
        hwm_reset=all(r["hwm_reset"] for r in rs),
        losses=rs[0]["losses"],
        **({"describe": rs[0]["describe"]} if "describe" in rs[0] else {}),
        **({"failed_later": failure} if failure else {}),
    )
    reports = rs[0].get("memory_report")
    if reports and all(r and "predicted_total" in r for r in reports):
        row["memory_report"] = reports
        row["predicted_mib"] = max(r["predicted_total"] for r in reports) / 2**20
        row["held_mib"] = max(r["held_total"] for r in reports) / 2**20
        row["report_peak_rss_mib"] = max(r["peak"]["rss"] for r in reports) / 2**20
    return row


def _add_ratios(cell: dict[str, Any]) -> None:
    """x our ddp per row, the zero3/peer ratios, and the loss check (every row against our ddp, else the first)."""
    ok = {r["name"]: r for r in cell["rows"] if "failed" not in r}
    ddp = ok.get("phalanx ddp")
    for r in ok.values():
        r["x_ddp"] = r["median_ms"] / ddp["median_ms"] if ddp else None
        r["peak_x_ddp"] = r["peak_rss_mib"] / ddp["peak_rss_mib"] if ddp else None
    cell["peer_ratios"] = {}
    for num, den in PEER_RATIOS:
        if num in ok and den in ok:
            a, b = ok[num], ok[den]
            cell["peer_ratios"][f"{num} / {den}"] = {
                "step": a["median_ms"] / b["median_ms"],
                "peak_rss": a["peak_rss_mib"] / b["peak_rss_mib"],
                "steps_peak_rss": a["steps_peak_rss_mib"] / b["steps_peak_rss_mib"],
            }
    ref = ddp or next(iter(ok.values()), None)
    cell["loss_reference"] = ref["name"] if ref else None
    for r in ok.values():
        first = abs(r["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
        final = abs(r["losses"][-1] - ref["losses"][-1]) / abs(ref["losses"][-1])
        r["loss_check"] = {
            "first_rel_diff": first,
            "final_rel_diff": final,
            "ok": first < TOL_FIRST and final < TOL_FINAL,
        }


# ================================================================================================ table


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def _sizes_of(result: dict[str, Any]) -> list[tuple[str, int]]:
    seen: dict[str, int] = {}
    for c in result["cells"]:
        seen.setdefault(c["size"], c["n_params"])
    return sorted(seen.items(), key=lambda kv: kv[1])


def _grid(
    result: dict[str, Any],
) -> tuple[list[int], list[tuple[str, int]], list[str], dict[tuple[int, str, str], Any]]:
    """World sizes, (size, parameters), row names (in --strategies order) and {(world, size, name): row}."""
    worlds = sorted({c["world"] for c in result["cells"]})
    names: list[str] = []
    by: dict[tuple[int, str, str], Any] = {}
    for c in result["cells"]:
        for r in c["rows"]:
            if r["name"] not in names:
                names.append(r["name"])
            by[(c["world"], c["size"], r["name"])] = r
    return worlds, _sizes_of(result), names, by


def _per_world_tables(result: dict[str, Any], figure: Callable[[dict[str, Any]], str]) -> list[str]:
    """One Markdown table per world size: a row per strategy, a column per model size, ``figure(row)`` in each."""
    worlds, sizes, names, by = _grid(result)
    out = []
    for w in worlds:
        out += [
            "",
            f"world size {w}",
            "",
            "| strategy | " + " | ".join(f"{n / 1e6:.0f}M" for _, n in sizes) + " |",
            "|---|" + "---:|" * len(sizes),
        ]
        for name in names:
            rows = [by.get((w, s, name)) for s, _ in sizes]
            cells = ["" if r is None else "FAILED" if "failed" in r else figure(r) for r in rows]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def markdown(result: dict[str, Any]) -> str:
    worlds, sizes, _, _ = _grid(result)
    st = result["settings"]
    steps = ", ".join(f"{s} {w}+{t}" for s, (w, t) in st["steps_per_size"].items())
    out = [
        "# Scaling curves on CPU: phalanx ddp / zero1 / zero2 / zero3 beside the peers",
        "",
        (
            f"`TinyGPT` (bytes, tied head) at {len(sizes)} sizes; every rank trains {st['local_batch']} sequence(s) of "
            f"{st['seq']} tokens per step at every world size (weak scaling: global batch = {st['local_batch']} x "
            f"world size); AdamW ({st['adamw']}), fp32, gloo, {RANK_THREADS} thread per rank on a "
            f"{result['environment']['cpu_count']}-core machine, so 3 and 4 ranks share 2 cores. Step time: the "
            f"slowest rank per step, median over the timed steps (warm-up + timed: {steps}), median "
            f"over {st['rounds']} round(s). Peak RSS: VmHWM of /proc/self/status, max over ranks."
        ),
        "",
        f"Peers: {'; '.join(f'{k}: {v}' for k, v in result['peers'].items())}.",
        "",
        _load_note(result),
        "",
        "## Step time, ms (x our ddp at the same world size and model size)",
    ]
    out += _per_world_tables(result, lambda r: f"{r['median_ms']:.0f} ({_fmt(r.get('x_ddp'), '.2f')})")
    out += [
        "",
        "## Peak RSS per rank, MiB (max over ranks): whole run / training steps only",
        "",
        (
            "The whole run includes building the full model on every rank (every row here does, before it shards); "
            "the training-steps figure is VmHWM after a reset once the model was built and wrapped."
        ),
        "",
        (
            "A phalanx row's third figure is `engine.memory_report()['predicted_total']` (the ZeRO paper's model: "
            "parameters, gradients and AdamW state this rank holds; no activations, buffers or the ~300 MiB of the "
            "torch import)."
        ),
    ]
    out += _per_world_tables(
        result,
        lambda r: (
            f"{r['peak_rss_mib']:.0f} / {r['steps_peak_rss_mib']:.0f}"
            + (f" / pred {r['predicted_mib']:.0f}" if "predicted_mib" in r else "")
        ),
    )
    for num, den in PEER_RATIOS:
        key = f"{num} / {den}"
        if not any(key in c["peer_ratios"] for c in result["cells"]):
            continue
        out += [
            "",
            f"## {key}: step time, peak RSS (whole run), peak RSS (steps)",
            "",
            "| world size | " + " | ".join(f"{n / 1e6:.0f}M" for _, n in sizes) + " |",
            "|---|" + "---:|" * len(sizes),
        ]
        for w in worlds:
            cells = []
            for s, _ in sizes:
                c = next((c for c in result["cells"] if c["world"] == w and c["size"] == s), None)
                pr = c["peer_ratios"].get(key) if c else None
                cells.append(
                    "" if pr is None else f"{pr['step']:.2f}, {pr['peak_rss']:.2f}, {pr['steps_peak_rss']:.2f}"
                )
            out.append(f"| {w} | " + " | ".join(cells) + " |")
    out += [
        "",
        "## Every row",
        "",
        (
            "| params | world | strategy | step ms | x our ddp | peak RSS MiB/rank | steps peak | steps peak above "
            "import | predicted MiB | held MiB | foreign load (cores) | loss vs our ddp |"
        ),
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in result["cells"]:
        for r in c["rows"]:
            lead = f"| {c['n_params'] / 1e6:.1f}M | {c['world']} | {r['name']} |"
            if "failed" in r:
                out.append(f"{lead} FAILED: {r['failed'].splitlines()[0][:120]} | | | | | | | | |")
                continue
            fl = [f for f in r["foreign_load_cores"] if f is not None]
            lc = r.get("loss_check")
            check = "-" if lc is None else ("ok" if lc["ok"] else "MISMATCH") + f" ({lc['final_rel_diff']:.0e})"
            out.append(
                f"{lead} {r['median_ms']:.1f} | {_fmt(r.get('x_ddp'), '.2f')} | {r['peak_rss_mib']:.0f} | "
                f"{r['steps_peak_rss_mib']:.0f} | {r['steps_peak_above_base_mib']:.0f} | "
                f"{_fmt(r.get('predicted_mib'))} | {_fmt(r.get('held_mib'))} | "
                f"{_fmt(max(fl) if fl else None, '.2f')} | {check} |"
            )
    out += [
        "",
        (
            f"phalanx {result['phalanx_commit']} (sources {result['phalanx_src_sha256']}), torch "
            f"{result['environment']['torch']}, finished {result.get('finished', '?')}; wall "
            f"{result['wall_s'] / 60:.1f} min."
        ),
        f"Command: `bench_scaling.py {' '.join(result.get('argv', []))}`",
        "",
    ]
    return "\n".join(out)


def _load_note(result: dict[str, Any]) -> str:
    loads = [f for c in result["cells"] for r in c["rows"] for f in r.get("foreign_load_cores", []) if f is not None]
    if not loads:
        return "Foreign load: not measured."
    busy = sum(1 for f in loads if f > result["settings"]["max_foreign"])
    return (
        f"The machine may have been shared with other work (tests, other benchmarks): the CPU time other "
        f"processes used during the runs was {statistics.median(loads):.2f} cores in the median run and "
        f"{max(loads):.2f} at most; {busy} of {len(loads)} runs saw more than {result['settings']['max_foreign']} "
        f"cores (their foreign load is in the last table). Read ratios within a cell, not absolute times."
    )


# ================================================================================================ plot


def plot(result: dict[str, Any], path: Path) -> str:
    """Step time, peak RSS per rank (whole run) and the training steps' peak above the import (with phalanx's
    predicted bytes, dotted) against the parameter count, one column per world size. Returns what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullLocator
    except ImportError as e:
        return f"PNG skipped: matplotlib is not installed ({e}); pip install -e '.[plot]'"
    worlds, sizes, names, by = _grid(result)
    panels = [
        ("median step time (s)", lambda r: r["median_ms"] / 1e3),
        ("peak RSS per rank, whole run (MiB)", lambda r: r["peak_rss_mib"]),
        ("training steps' peak RSS above the import (MiB)", lambda r: r["steps_peak_above_base_mib"]),
    ]
    fig, axes = plt.subplots(
        len(panels), len(worlds), figsize=(4.2 * len(worlds), 3.6 * len(panels)), squeeze=False, sharey="row"
    )
    colors = {n: plt.get_cmap("tab10")(i) for i, n in enumerate(names)}
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    # Between powers of ten, label 2x and 5x only: nine labels a decade crowd the panels.
    sparse = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else "")
    for j, w in enumerate(worlds):
        for i, (label, value) in enumerate(panels):
            ax = axes[i][j]
            for name in names:
                pts = [
                    (n, by[(w, s, name)]) for s, n in sizes if (w, s, name) in by and "failed" not in by[(w, s, name)]
                ]
                if not pts:
                    continue
                style = "--" if not name.startswith("phalanx") else "-"
                ax.plot(
                    [n / 1e6 for n, _ in pts],
                    [value(r) for _, r in pts],
                    style,
                    marker="o",
                    ms=3,
                    color=colors[name],
                    label=name,
                )
                if i == 2 and all("predicted_mib" in r for _, r in pts):
                    ax.plot(
                        [n / 1e6 for n, _ in pts],
                        [r["predicted_mib"] for _, r in pts],
                        ":",
                        color=colors[name],
                        label=f"{name} predicted",
                    )
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks([n / 1e6 for _, n in sizes], [f"{n / 1e6:.0f}M" for _, n in sizes])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(sparse)
            ax.grid(True, which="both", alpha=0.3)
            if i == 0:
                ax.set_title(f"world size {w}")
            if i == len(panels) - 1:
                ax.set_xlabel("parameters (M)")
            if j == 0:
                ax.set_ylabel(label)
    handles, labels = axes[-1][0].get_legend_handles_labels()
    ncol = max(1, min(len(labels), int(fig.get_figwidth() / 2.6)))
    legend_rows = -(-len(labels) // ncol)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
    fig.suptitle(
        f"phalanx vs peers on CPU (gloo, {RANK_THREADS} thread/rank, {result['environment']['cpu_count']} cores), "
        f"{result['settings']['local_batch']}x{result['settings']['seq']} tokens per rank per step"
    )
    fig.tight_layout(rect=(0, 0.01 + 0.022 * legend_rows, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def write_outputs(
    result: dict[str, Any],
    args: argparse.Namespace,
    env: dict[str, Any],
    argv: list[str] | None,
    plot_status: str | None = None,
) -> None:
    """The JSON (harness.write_result) and the Markdown table; the PNG too when ``plot_status`` is None, else that
    status (why there is no PNG) is recorded."""
    stem = Path(args.out) / (f"{STEM}-{args.tag}" if args.tag else STEM)
    if plot_status is None and not args.no_json:
        plot_status = plot(result, stem.with_suffix(".png"))
    if plot_status is not None:
        result["plot"] = plot_status
        print(plot_status)
    write_result(result, args, STEM, env, argv)
    if not args.no_json:
        stem.with_suffix(".md").write_text(markdown(result))
        print(f"wrote {stem.with_suffix('.md')}")


# ================================================================================================ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(SIZES), help=f"model sizes, comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--worlds", default="1,2,3,4", help="world sizes, comma-separated")
    p.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help=f"comma-separated, of {', '.join(STRATEGIES)} (ds3 is skipped when deepspeed is not importable)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: per size, 6 down to 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps per run (default 2)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="8m and 25m, world sizes 1 and 2, 1 warm-up + 2 timed steps; writes scaling-cpu-quick.*",
    )
    p.add_argument("--local-batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (the model's block size)")
    p.add_argument("--adamw", choices=["default", "foreach", "fused"], default="default")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-plot", action="store_true", help="write the JSON and the table, not the PNG")
    p.add_argument("--replot", metavar="JSON", help="write the table and the PNG again from a result file; run nothing")
    add_round_flags(p, rounds=1, timeout=900.0)
    # A cell's strategies run back to back, so a shared machine slows them alike; waiting for quiet before each of
    # ~100 runs and running disturbed ones again would double the wall time on a machine that other work keeps busy.
    # The foreign load of every run is recorded and shown instead (--quiet-wait 30 --retries 1 as elsewhere).
    p.set_defaults(quiet_wait=0.0, retries=0)
    add_output_flags(p, HERE / "results", STEM)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:
        path = Path(args.replot)
        result = json.loads(path.read_text())
        path.with_suffix(".md").write_text(markdown(result))
        print(f"wrote {path.with_suffix('.md')}")
        print(plot(result, path.with_suffix(".png")))
        return 0
    if args.quick:
        args.sizes, args.worlds = QUICK["sizes"], QUICK["worlds"]
        args.warmup = QUICK["warmup"] if args.warmup is None else args.warmup
        args.steps = QUICK["steps"] if args.steps is None else args.steps
        args.tag = args.tag or "quick"
    sizes, keys = _csv(args.sizes), _csv(args.strategies)
    worlds = [int(w) for w in _csv(args.worlds)]
    bad = [s for s in sizes if s not in SIZES] + [k for k in keys if k not in STRATEGIES]
    if bad or not worlds or min(worlds) < 1:
        raise SystemExit(
            f"unknown sizes/strategies {bad} or bad --worlds {args.worlds!r}; sizes: {', '.join(SIZES)}; "
            f"strategies: {', '.join(STRATEGIES)}"
        )
    peers: dict[str, str] = {}
    if "fsdp2" in keys:
        peers["FSDP2"] = "torch.distributed.fsdp.fully_shard per transformer block, then the root"
    if "ds3" in keys:
        ok, why = deepspeed_status()
        peers["DeepSpeed ZeRO-3"] = why if ok else f"skipped, {why}"
        if not ok:
            print(f"[skip] DeepSpeed ZeRO-3: {why}")
            keys.remove("ds3")
    with_plot, no_plot = not args.no_plot, "PNG skipped: --no-plot"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with_plot, no_plot = False, "PNG skipped: matplotlib is not installed (pip install -e '.[plot]')"
        print(f"[skip] {no_plot}; the JSON and the table are written")
    env = environment()
    start = source_state()
    print(
        f"phalanx checkout: {start[0]}, sources {start[1]}; sizes {sizes}, world sizes {worlds}, strategies {keys}",
        flush=True,
    )
    result: dict[str, Any] = {
        "settings": {
            "sizes": {s: {**SIZES[s], "block_size": args.seq} for s in sizes},
            "worlds": worlds,
            "strategies": keys,
            "local_batch": args.local_batch,
            "seq": args.seq,
            "adamw": args.adamw,
            "rounds": args.rounds,
            "steps_per_size": {
                s: (
                    args.warmup if args.warmup is not None else STEPS[s][0],
                    args.steps if args.steps is not None else STEPS[s][1],
                )
                for s in sizes
            },
            "threads_per_rank": RANK_THREADS,
            "max_foreign": args.max_foreign,
            "quiet_wait": args.quiet_wait,
        },
        "peers": peers,
        "definitions": {
            "median_ms": "median over rounds of (median over timed steps of the step time, the slowest rank per step); "
            "a step is forward + backward + optimizer step + zero_grad",
            "x_ddp": "median_ms / median_ms of phalanx ddp at the same world size and model size",
            "peak_rss_mib": "max over ranks of the process's peak resident set (VmHWM) over the whole run: "
            "max(peak after the model is built and wrapped, peak during the steps)",
            "steps_peak_rss_mib": "max over ranks of VmHWM at the end of training, reset (/proc/self/clear_refs) "
            "once the model was built and wrapped: the training steps' own peak",
            "steps_peak_above_base_mib": "max over ranks of (steps peak - RSS before anything was built)",
            "predicted_mib": "phalanx only: max over ranks of engine.memory_report()['predicted_total']",
            "held_mib": "phalanx only: max over ranks of engine.memory_report()['held_total'] after the last step",
            "peer_ratios": "phalanx zero3 / peer at the same cell: step time, peak RSS, steps peak RSS",
            "loss_check": f"first and final loss against phalanx ddp's (same model, same data): < {TOL_FIRST:g} and "
            f"< {TOL_FINAL:g} relative",
        },
        "cells": [],
    }
    t0 = time.perf_counter()
    for size in sizes:
        for world in worlds:
            result["cells"].append(run_cell(size, world, keys, args))
            result.update(source_record(start, source_state()), wall_s=time.perf_counter() - t0)
            # Partial results survive an interrupted run; the PNG comes at the end.
            write_outputs(result, args, env, argv, "PNG not written yet (the run is under way)")
    write_outputs(result, args, env, argv, None if with_plot else no_plot)
    print("\n" + markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
