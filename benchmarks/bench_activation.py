"""Activation checkpointing (``Engine(activation_checkpointing=...)``): peak memory against the predicted fall, on a
transformers Llama with sequence length 1024, on CPU (issue 39, item 3).

    .venv/bin/python benchmarks/bench_activation.py                      # 3 rounds of 4 policies (about 3 min, 2 cores)
    .venv/bin/python benchmarks/bench_activation.py --smoke              # small sizes, 1 round, writes nothing

Each run (``run``) is one fresh process from ``phalanx.spawn`` (one rank, ddp, ``host_mmap_threshold_mb=1`` so
that a freed activation leaves the resident set at once), on one policy: none, full, every:2, selective. It builds the
Llama (fp32, SDPA attention, no dropout, transformers' initialisation) after ``torch.manual_seed``, prepares it with
AdamW, takes ``--warmup`` steps (the optimizer state exists after the first), then, after ``gc.collect()``, resets
``VmHWM`` to the resident set (``/proc/self/clear_refs``) and takes one measured step: its peak is ``VmHWM`` over
the RSS it started from. Every policy trains on the same tokens and must give the same loss, bit for bit.

The prediction (``phalanx.engine.activation``): the driver measures one decoder layer (``measure_block``: what it
saves for backward, what a checkpointed layer keeps, what selective keeps) on the same batch, and
``activation_peak_bytes`` gives the most activation bytes held at once under each policy; the predicted fall is
none's minus the policy's. The result compares the measured fall of the peak with it: the done-when criterion is
"peak memory falls by the predicted share, within 10%".

Writes ``results/activation.json`` and ``results/activation.md``; docs/activation-checkpointing.md shows the figures.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # so that spawned processes import this module (and harness) by name

import torch  # noqa: E402
from harness import (  # noqa: E402
    add_output_flags,
    add_round_flags,
    environment,
    interleaved_rounds,
    make_adamw,
    memory_now,
    source_record,
    source_state,
    spawn_ranks,
    write_result,
)

STEM = "activation"
POLICIES = {"none": None, "full": "full", "every:2": "every:2", "selective": "selective"}
MIB = 2**20
TOLERANCE = 0.10  # the done-when criterion: the measured fall within 10% of the predicted one


# ------------------------------------------------------------------------------------------ worker side
def build_model(spec: dict[str, Any]) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    m = spec["model"]
    torch.manual_seed(spec["seed"])
    cfg = LlamaConfig(
        vocab_size=m["vocab"],
        hidden_size=m["hidden"],
        intermediate_size=m["intermediate"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        max_position_embeddings=spec["seq"],
        attention_dropout=0.0,
        use_cache=False,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def batch(spec: dict[str, Any], step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + step)
    return torch.randint(spec["model"]["vocab"], (spec["batch"], spec["seq"] + 1), generator=g)


def _reset_hwm() -> bool:
    """VmHWM back to the current RSS (Linux: ``5`` into ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """One policy in this fresh process: warm-up steps, then the measured step's peak over the RSS it starts from."""
    import torch.nn.functional as F

    import phalanx

    engine = phalanx.Engine(
        strategy="ddp", seed=spec["seed"], activation_checkpointing=spec["policy"], host_mmap_threshold_mb=1
    )
    model = build_model(spec)
    model, optimizer = engine.prepare(model, make_adamw(model.parameters(), spec))

    def step(s: int) -> tuple[float, float]:
        ids = batch(spec, s)
        t0 = time.perf_counter()
        logits = model(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        del logits
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach()), time.perf_counter() - t0

    losses, times = [], []
    for s in range(spec["warmup"]):
        loss, t = step(s)
        losses.append(loss)
        times.append(t)
    peaks = []
    for s in range(spec["warmup"], spec["warmup"] + spec["steps"]):
        gc.collect()
        start = memory_now()
        reset = _reset_hwm()
        loss, t = step(s)
        end = memory_now()
        losses.append(loss)
        times.append(t)
        if reset:
            peaks.append((end["vm_hwm_mib"] - start["vm_rss_mib"]) * MIB)
    return {
        "policy": spec["policy"],
        "losses": losses,
        "step_s": times[spec["warmup"] :],
        "peak_over_start_bytes": peaks,
        "rss_end_mib": memory_now()["vm_rss_mib"],
        "threads": torch.get_num_threads(),
        "phalanx_file": getattr(sys.modules.get("phalanx"), "__file__", None),
    }


# ------------------------------------------------------------------------------------------ driver side
def predict(spec: dict[str, Any]) -> dict[str, Any]:
    """One decoder layer measured on the benchmark's batch, and each policy's predicted activation peak."""
    from phalanx.engine.activation import activation_peak_bytes, measure_block

    model = build_model(spec)
    ids = batch(spec, 0)[:, :-1]
    block = measure_block(model.model.layers[0], lambda: model(input_ids=ids))
    layers = spec["model"]["layers"]
    peaks = {name: activation_peak_bytes(block, layers, policy) for name, policy in POLICIES.items()}
    return {
        "block": {k: getattr(block, k) for k in block.__dataclass_fields__},
        "layers": layers,
        "peak_bytes": peaks,
        "fall_bytes": {name: peaks["none"] - peak for name, peak in peaks.items()},
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import bench_activation  # this module by name: what the spawned processes import

    spec_base = {
        "seed": args.seed,
        "lr": 1e-3,
        "warmup": args.warmup,
        "steps": args.steps,
        "seq": args.seq,
        "batch": args.batch,
        "model": {
            "vocab": args.vocab,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
        },
    }
    start = source_state()
    prediction = predict(spec_base)
    configs = [{"name": name, "policy": policy} for name, policy in POLICIES.items()]

    def one(cfg: dict[str, Any]) -> dict[str, Any]:
        spec = {**spec_base, "policy": cfg["policy"]}
        return spawn_ranks(bench_activation.run, 1, (spec,), args.timeout, threads=args.threads)[0]

    def summarize(res: dict[str, Any]) -> dict[str, Any]:
        return {
            "peak_over_start_bytes": statistics.median(res["peak_over_start_bytes"]),
            "step_s": statistics.median(res["step_s"]),
            "losses": res["losses"],
        }

    def headline(s: dict[str, Any]) -> str:
        return f"peak over start {s['peak_over_start_bytes'] / MIB:7.1f} MiB, step {s['step_s']:.2f} s"

    rounds, failures, wall = interleaved_rounds(configs, args, one, summarize, headline)
    rows: dict[str, Any] = {}
    for name in POLICIES:
        runs = rounds.get(name, [])
        if not runs:
            rows[name] = {"failed": failures.get(name, "no run")}
            continue
        rows[name] = {
            "peak_over_start_bytes": statistics.median(r["peak_over_start_bytes"] for r in runs),
            "per_round_peak_bytes": [r["peak_over_start_bytes"] for r in runs],
            "step_s": statistics.median(r["step_s"] for r in runs),
            "losses": runs[0]["losses"],
        }
    none = rows["none"].get("peak_over_start_bytes")
    for name, row in rows.items():
        if "failed" in row or none is None:
            continue
        measured = none - row["peak_over_start_bytes"]
        predicted = prediction["fall_bytes"][name]
        row.update(
            measured_fall_bytes=measured,
            predicted_fall_bytes=predicted,
            measured_share=measured / none,
            predicted_share=predicted / none,
            fall_ratio=measured / predicted if predicted else None,
            within_tolerance=abs(measured - predicted) <= TOLERANCE * predicted if predicted else None,
            step_time_ratio=row["step_s"] / rows["none"]["step_s"],
            same_losses_as_none=row["losses"] == rows["none"]["losses"],
        )
    return {
        "spec": spec_base,
        "prediction": prediction,
        "rows": rows,
        "failures": failures,
        "wall_s": wall,
        "tolerance": TOLERANCE,
        **source_record(start, source_state()),
    }


def write_markdown(result: dict[str, Any], args: argparse.Namespace, argv: list[str] | None) -> None:
    if args.no_json:
        return
    spec, pred = result["spec"], result["prediction"]
    m, b = spec["model"], pred["block"]
    cmd = " ".join(["python benchmarks/bench_activation.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [
        "# Activation checkpointing: peak memory against the predicted fall (bench_activation.py)",
        "",
        f"Command: `.venv/bin/{cmd.strip()}`; phalanx {result['phalanx_commit']} (sources "
        f"{result['phalanx_src_sha256']}), finished {result.get('finished', '')}, wall {result['wall_s']:.0f} s. "
        "Full figures: `activation.json`.",
        "",
        f"A transformers Llama, hidden {m['hidden']}, intermediate {m['intermediate']}, {m['layers']} layers, "
        f"{m['heads']} heads ({m['kv_heads']} kv), vocab {m['vocab']}, fp32, SDPA; batch {spec['batch']} x "
        f"sequence {spec['seq']}; one process (ddp, {args.threads} threads), AdamW, {spec['warmup']} warm-up steps, "
        f"{spec['steps']} measured; {args.rounds} rounds, each run a fresh process. Peak: the measured step's "
        "VmHWM over the RSS it started from (median of rounds).",
        "",
        f"One decoder layer, measured (`measure_block`): saves {b['saved'] / MIB:.2f} MiB for backward; a "
        f"checkpointed layer keeps {b['kept_full'] / MIB:.2f} MiB (its input), a selective one "
        f"{b['kept_selective'] / MIB:.2f} MiB (its input and its matmul and attention outputs); shared inputs "
        f"(rotary tables) {b['shared'] / MIB:.2f} MiB.",
        "",
        "| policy | predicted activation peak (MiB) | measured peak (MiB) | predicted fall (MiB) | measured fall (MiB) "
        "| measured / predicted | predicted share | measured share | within 10% | step time vs none | same losses |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for name, row in result["rows"].items():
        if "failed" in row:
            lines.append(f"| {name} | failed: {row['failed']} |")
            continue
        ratio = row.get("fall_ratio")
        lines.append(
            f"| {name} | {pred['peak_bytes'][name] / MIB:.1f} | {row['peak_over_start_bytes'] / MIB:.1f} | "
            f"{row['predicted_fall_bytes'] / MIB:.1f} | {row['measured_fall_bytes'] / MIB:.1f} | "
            f"{'-' if ratio is None else f'{ratio:.3f}'} | {row['predicted_share']:.3f} | "
            f"{row['measured_share']:.3f} | {'-' if row['within_tolerance'] is None else row['within_tolerance']} | "
            f"{row['step_time_ratio']:.2f} | {row['same_losses_as_none']} |"
        )
    lines += [
        "",
        "Per round, the measured peak (MiB): "
        + "; ".join(
            f"{name} {', '.join(f'{x / MIB:.1f}' for x in row['per_round_peak_bytes'])}"
            for name, row in result["rows"].items()
            if "failed" not in row
        ),
        "",
    ]
    path = Path(args.out) / (f"{STEM}-{args.tag}.md" if args.tag else f"{STEM}.md")
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


SMOKE = {"rounds": 1, "steps": 1, "warmup": 1, "quiet_wait": 0.0, "retries": 0, "seq": 128, "hidden": 64}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_flags(p, rounds=3, timeout=600.0)
    p.set_defaults(quiet_wait=10.0)
    p.add_argument("--smoke", action="store_true", help="small sizes, 1 round, 1 step; writes nothing")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the one process")
    p.add_argument("--warmup", type=int, default=2, help="steps before the measured ones")
    p.add_argument("--steps", type=int, default=1, help="measured steps per run (median)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    add_output_flags(p, HERE / "results", STEM)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
        args.no_json = True
    env = environment(transformers=_version("transformers"))
    result = bench(args)
    write_result(result, args, STEM, env, argv)
    write_markdown(result, args, argv)
    return 0


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:  # noqa: BLE001 - recorded as unknown
        return None


if __name__ == "__main__":
    sys.exit(main())
