"""``phalanx plan``: will the model fit, on which layout, and what each layout costs.

    phalanx plan --model tests/data/plan/llama3-8b/config.json --nproc-per-node 8 --device-memory 80GB \\
        --micro-batch-size 1 --seq-len 8192

One row per layout (see ``layouts.py``), in GB (10^9 bytes) per rank: the model states, the activations under each
checkpointing policy, the buffers and transients, the peak under the lightest policy that fits, the host memory a
machine needs (offload), the bytes each rank sends per step, and whether it fits; then the recommended layout and
the same model's states by the ZeRO paper's formulas and by DeepSpeed's estimators. ``--json`` prints all of it as
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from phalanx.config.general import PRECISIONS
from phalanx.inference.plan import DispatchError, parse_bytes
from phalanx.planning.activations import POLICIES
from phalanx.planning.estimate import (
    BACKENDS,
    OPTIMIZER_STATE_BYTES,
    PARAM_DTYPES,
    Estimate,
    Workload,
    World,
)
from phalanx.planning.layouts import DEFAULT_SCHEDULES, plan, recommend
from phalanx.planning.model import ModelShape, PlanError, human_count, load_shape
from phalanx.planning.reference import deepspeed_rows, zero_paper_bytes
from phalanx.planning.schedules import SCHEDULES

__all__ = ["add_plan_flags", "plan_command", "plan_report", "plan_text"]

_DEFAULT_SEQ = 2048


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="a factory pkg.module:function (called on the meta device), a transformers config.json or a directory "
        "with one, a phalanx checkpoint or a directory of safetensors weights, or a transformers config name",
    )
    p.add_argument("-n", "--nproc-per-node", type=int, default=1, help="processes (devices) per machine (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="machines (default 1)")
    p.add_argument("--device-memory", help="memory of one device, e.g. 80GB or 80GiB (default: not checked)")
    p.add_argument("--host-memory", help="host memory of one machine, e.g. 1TB (default: not checked)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences a rank runs at once (default 1)")
    p.add_argument("--seq-len", type=int, help=f"tokens a sequence (default the model's context, else {_DEFAULT_SEQ})")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed", help="compute precision (bf16-mixed)")
    p.add_argument(
        "--param-dtype",
        choices=list(PARAM_DTYPES),
        default="auto",
        help="how parameters are stored: auto (16-bit with fp32 masters under a mixed precision, the ZeRO paper's "
        "mixed-precision training; fp32 under fp32), or fp32 for an fp32 model under autocast",
    )
    p.add_argument("--optimizer", choices=list(OPTIMIZER_STATE_BYTES), default="adamw", help="(default adamw)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MiB (default 25)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="nccl",
        help="nccl (CUDA devices, the default) or gloo (CPU ranks: zero's collectives are point-to-point there)",
    )
    p.add_argument(
        "--max-bubble",
        type=float,
        default=0.25,
        help="recommend no pipeline whose stages idle more than this share of a step (default 0.25)",
    )
    p.add_argument(
        "--pp-schedule",
        choices=["all", *SCHEDULES],
        default="all",
        help="the pipeline schedule (the engine's pp_schedule) to plan pipeline layouts under; all (the default): "
        f"each of {', '.join(DEFAULT_SCHEDULES)}",
    )
    p.add_argument(
        "--pp-virtual-stages",
        type=int,
        help="model chunks a rank for interleaved_1f1b (the engine's pp_virtual_stages; default 2)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _bytes(flag: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except DispatchError as e:
        raise PlanError(f"{flag} {value!r}: {e}") from e


def plan_command(ns: argparse.Namespace) -> int:
    """Run ``phalanx plan`` from its parsed flags; prints the table (or JSON) and returns the exit status."""
    try:
        shape = load_shape(ns.model)
        world = World(
            nproc_per_node=ns.nproc_per_node,
            nnodes=ns.nnodes,
            device_bytes=_bytes("--device-memory", ns.device_memory),
            host_bytes=_bytes("--host-memory", ns.host_memory),
            backend=ns.backend,
        )
        work = Workload(
            micro_batch_size=ns.micro_batch_size,
            seq_len=ns.seq_len or shape.max_positions or _DEFAULT_SEQ,
            grad_accum=ns.grad_accum,
            precision=ns.precision,
            param_dtype=ns.param_dtype,
            optimizer=ns.optimizer,
            bucket_mb=ns.bucket_mb,
        )
        schedules = DEFAULT_SCHEDULES if ns.pp_schedule == "all" else (ns.pp_schedule,)
        virtual = ns.pp_virtual_stages
        if virtual is not None and "interleaved_1f1b" not in schedules:
            raise PlanError(
                f"--pp-virtual-stages {virtual} applies to --pp-schedule interleaved_1f1b (or all) only; got "
                f"--pp-schedule {ns.pp_schedule} (leave --pp-virtual-stages out)"
            )
        if virtual is not None and virtual < 2:
            raise PlanError(
                f"--pp-virtual-stages {virtual}: interleaved_1f1b needs 2 or more chunks a rank (use 2 or more, or "
                "--pp-schedule 1f1b for one chunk)"
            )
        if not 0 <= ns.max_bubble <= 1:
            raise PlanError(f"--max-bubble {ns.max_bubble}: a share of the step, between 0 and 1 (e.g. 0.25)")
        estimates = plan(shape, world, work, schedules, virtual or 2)
    except PlanError as e:
        print(f"phalanx plan: {e}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(plan_report(shape, world, work, estimates, ns.max_bubble), indent=1))
    else:
        print(plan_text(shape, world, work, estimates, ns.max_bubble))
    return 0


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _unit(estimates: list[Estimate]) -> tuple[str, float]:
    """GB for a table whose largest total reaches 1 GB, else MB."""
    return ("GB", 1e9) if max((e.total() for e in estimates), default=0) >= 1e9 else ("MB", 1e6)


def _references(shape: ModelShape, world: World) -> dict[str, Any]:
    return {
        "zero_paper_k12": {k: int(v) for k, v in zero_paper_bytes(shape.params, world.size).items()},
        "deepspeed": [
            asdict(r) for r in deepspeed_rows(shape.params, shape.largest_layer, world.nproc_per_node, world.nnodes)
        ],
    }


def plan_report(
    shape: ModelShape, world: World, work: Workload, estimates: list[Estimate], max_bubble: float = 0.25
) -> dict[str, Any]:
    """Everything ``phalanx plan --json`` prints."""
    best = recommend(estimates, max_bubble)
    model = {k: v for k, v in asdict(shape).items() if k not in ("param_numels", "units")}
    model["units"] = len(shape.units)
    model["largest_unit"] = max(shape.units, default=0)
    return {
        "model": model,
        "world": {**asdict(world), "size": world.size},
        "workload": {**asdict(work), "param_bytes": work.param_bytes, "state_bytes": work.state_bytes},
        "layouts": [e.as_dict() for e in estimates],
        "recommended": best.layout.name if best else None,
        "recommended_settings": ({**best.layout.settings(), "activation_checkpointing": best.policy} if best else None),
        "references": _references(shape, world),
    }


def _describe(shape: ModelShape, world: World, work: Workload) -> list[str]:
    dims = f"{human_count(shape.params)} trainable parameters"
    if shape.is_decoder:
        heads = f", {shape.heads} heads ({shape.kv_heads} kv)" if shape.heads else ""
        dims += f", {shape.layers} layers, hidden {shape.hidden}{heads}, vocab {shape.vocab}"
        if shape.experts:
            dims += f", {shape.experts} experts ({shape.experts_per_token} a token)"
    device = f", {_gb(world.device_bytes)} GB a device" if world.device_bytes else ""
    host = f", {_gb(world.host_bytes)} GB of host memory a machine" if world.host_bytes else ""
    p = {4: "fp32", 2: "16-bit"}[work.param_bytes]
    masters = " with fp32 masters" if work.param_bytes < 4 else ""
    return [
        f"phalanx plan: {shape.source}: {dims}",
        f"world: {world.nnodes} machine(s) x {world.nproc_per_node} process(es){device}{host}, backend {world.backend}",
        f"step: micro-batch {work.micro_batch_size} x {work.seq_len} tokens, {work.precision}, {p} parameters"
        f"{masters}, {work.optimizer} (K={work.state_bytes}); the same global batch on every layout "
        f"({work.micro_batch_size * world.size * work.grad_accum} sequences a step)",
    ]


def plan_text(
    shape: ModelShape, world: World, work: Workload, estimates: list[Estimate], max_bubble: float = 0.25
) -> str:
    """The table ``phalanx plan`` prints."""
    header = ["layout", "params", "grads", "optim", "activations n/s/f", "buffers", "trans.", "total", "host/node",
              "sent/step", "bubble", "fits"]  # fmt: skip
    unit, scale = _unit(estimates)

    def num(n: float) -> str:
        return f"{n / scale:.2f}"

    rows = []
    for e in estimates:
        acts = " / ".join(f"{e.activations[p] / scale:.1f}" for p in POLICIES) if shape.is_decoder else "-"
        host = num(e.host * world.nproc_per_node) if e.host else "-"
        fits = "no" if not e.fits else ("yes" if e.policy == "none" else f"yes ({e.policy})")
        bubble = f"{e.bubble:.0%}" if e.layout.pp > 1 else "-"
        rows.append([e.layout.name, num(e.params), num(e.grads), num(e.optimizer), acts, num(e.buffers),
                     num(e.transient), num(e.total()), host, num(e.sent), bubble, fits])  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:{'<' if i in (0, len(header) - 1) else '>'}{w}}}" for i, w in enumerate(widths))
    out = _describe(shape, world, work)
    out.append(
        f"{unit} (10^{9 if unit == 'GB' else 6} bytes) per rank; activations without checkpointing / selective / full"
    )
    out += [""] + [line.format(*r).rstrip() for r in [header, *rows]]
    notes = sorted({f"{e.layout.strategy}: {n}" for e in estimates for n in e.notes} | set(shape.notes))
    out += [f"  note: {n}" for n in notes]
    best = recommend(estimates, max_bubble)
    out.append("")
    if best is not None:
        settings = {**best.layout.settings()}
        if best.policy != "none":
            settings["activation_checkpointing"] = best.policy
        room = f" of {num(world.device_bytes)}" if world.device_bytes else ""
        out.append(
            f"recommended: {best.layout.name}: {num(best.total())}{room} {unit} a device, sends {num(best.sent)} "
            f"{unit} a rank per step ({', '.join(f'{k}={v}' for k, v in settings.items())})"
        )
    elif any(e.fits and e.counted for e in estimates):
        out.append(
            f"recommended: none: only pipelines fit, and their stages idle more than {max_bubble:.0%} of a step "
            "(raise --grad-accum for more micro-batches a step, plan another --pp-schedule, or raise --max-bubble)"
        )
    elif any(e.fits for e in estimates):
        out.append(
            "recommended: none: only pipelines fit, and their activations and messages are not counted for a model "
            "that is not a decoder stack (give its transformers config)"
        )
    else:
        smallest = min(estimates, key=lambda e: e.total("full"))
        out.append(
            f"nothing fits: the smallest is {smallest.layout.name} at {num(smallest.total('full'))} {unit} a device "
            "with full checkpointing (add devices or machines, or lower --micro-batch-size or --seq-len)"
        )
    refs = _references(shape, world)
    paper = refs["zero_paper_k12"]
    out += [
        "",
        f"model states by the book (Psi = {human_count(shape.params)}, N = {world.size}), {unit} per rank:",
        f"  ZeRO paper, K=12: baseline {num(paper['baseline'])}, P_os {num(paper['os'])}, P_os+g {num(paper['os+g'])}"
        f", P_os+g+p {num(paper['os+g+p'])}",
        f"  DeepSpeed 0.19.6 estimators (largest layer {human_count(shape.largest_layer)} parameters), per CPU | "
        "per GPU:",
    ]
    for row in refs["deepspeed"]:
        out.append(f"    zero{row['stage']} {row['options']:<58} {num(row['cpu_bytes']):>8} | {num(row['gpu_bytes'])}")
    return "\n".join(out)
