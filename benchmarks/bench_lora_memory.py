"""Frozen weights under zero1/2/3: a LoRA-style model (95% frozen) against the same model fully trainable (issue 39).

    .venv/bin/python benchmarks/bench_lora_memory.py            # 2 ranks, zero1/2/3, both models (about 2 min)
    .venv/bin/python benchmarks/bench_lora_memory.py --smoke    # small sizes, writes nothing

Each configuration runs in fresh processes (``phalanx.spawn``, 2 ranks, gloo, 1 thread each): 16 layers of a
Linear(1024) with a rank-8 adapter (A: 8 x 1024, B: 1024 x 8), built on the meta device, AdamW, 4 steps of batch 8.
"lora" freezes every base Linear (the adapters train: 2.9% of the elements), "full" trains everything. Per rank:
``memory_report()``'s held bytes by kind and its ``expected_peak``, the peak resident memory (VmHWM) over the
baseline (the process with torch, phalanx, the process group and an optimizer's first use loaded, before the model),
and the peak of what the process holds from the allocator (glibc's ``mallinfo2``, sampled after every torch op).

Writes ``results/lora-memory.json`` and ``results/lora-memory.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

import phalanx  # noqa: E402
from phalanx.runtime.memory import host_bytes_allocated  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
STEM = "lora-memory"


class LoRALinear(nn.Module):
    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.a = nn.Parameter(torch.randn(rank, width) * 0.02)
        self.b = nn.Parameter(torch.zeros(width, rank))

    def reset_parameters(self) -> None:  # its own tensors, for the deferred init of a model built on meta
        with torch.no_grad():
            nn.init.normal_(self.a, std=0.02)
            nn.init.zeros_(self.b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class Net(nn.Module):
    def __init__(self, layers: int, width: int, rank: int, frozen: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([LoRALinear(width, rank) for _ in range(layers)])
        for layer in self.layers:
            layer.base.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _Allocated(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.peak = host_bytes_allocated() or 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, host_bytes_allocated() or 0)
        return out


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def run(strategy: str, frozen: bool, layers: int, width: int, rank: int, steps: int) -> dict[str, Any]:
    engine = phalanx.Engine(strategy=strategy, seed=0)
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # the optimizer's imports are the runtime's
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the resident size
    base_rss, base_alloc = _status("VmRSS"), host_bytes_allocated() or 0
    with _Allocated() as allocated:
        with torch.device("meta"):
            net = Net(layers, width, rank, frozen)
        optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
        model, optimizer = engine.prepare(net, optimizer)
        x = torch.randn(8, width)
        for _ in range(steps):
            engine.backward(model(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()
    report = engine.memory_report()
    return {
        "held": report["held"],
        "held_total": report["held_total"],
        "expected_peak": report["expected_peak"],
        "trainable_params": report["trainable_params"],
        "peak_rss": _status("VmHWM") - base_rss,
        "peak_allocated": allocated.peak - base_alloc,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="small sizes; writes nothing")
    harness.add_output_flags(p, OUT, STEM)
    args = p.parse_args(argv)
    if args.smoke:
        args.no_json = True
    layers, width, rank, steps = (2, 128, 4, 1) if args.smoke else (16, 1024, 8, 4)
    os.environ["PHALANX_DEVICE"] = "cpu"
    start = harness.source_state()
    rows: dict[str, Any] = {}
    for strategy in ("zero1", "zero2", "zero3"):
        for frozen in (True, False):
            key = f"{strategy} {'lora' if frozen else 'full'}"
            res = phalanx.spawn(
                run, nprocs=2, args=(strategy, frozen, layers, width, rank, steps), threads_per_proc=1,
                start_method="spawn", timeout=600,
            )  # fmt: skip
            rows[key] = res
            r = res[0]
            print(
                f"{key:12s} held {r['held_total'] / 2**20:7.1f} MiB  expected {r['expected_peak'] / 2**20:7.1f}  "
                f"rss {r['peak_rss'] / 2**20:7.1f}  allocated {r['peak_allocated'] / 2**20:7.1f}"
            )
    lines = [
        "# Frozen weights under zero: LoRA-style model against the same model fully trainable",
        "",
        f"2 ranks, gloo, CPU; {layers} x (Linear({width}) + rank-{rank} adapter), AdamW, {steps} steps. "
        "MiB per rank (rank 0); ratios lora / full.",
        "",
        "| strategy | model | trainable | params | grads | optimizer state | frozen params | held total | "
        "expected peak | peak RSS | peak allocated |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    mib = 2**20
    for key, res in rows.items():
        r, h = res[0], res[0]["held"]
        strategy, model = key.split()
        lines.append(
            f"| {strategy} | {model} | {r['trainable_params']:,} | {h['params'] / mib:.1f} | {h['grads'] / mib:.1f} | "
            f"{h['optimizer_state'] / mib:.1f} | {h['frozen_params'] / mib:.1f} | {r['held_total'] / mib:.1f} | "
            f"{r['expected_peak'] / mib:.1f} | {r['peak_rss'] / mib:.1f} | {r['peak_allocated'] / mib:.1f} |"
        )
    lines += ["", "| strategy | held total | expected peak | peak RSS | peak allocated |", "|---|---:|---:|---:|---:|"]
    for strategy in ("zero1", "zero2", "zero3"):
        lo, fu = rows[f"{strategy} lora"][0], rows[f"{strategy} full"][0]
        lines.append(
            f"| {strategy} | {lo['held_total'] / fu['held_total']:.2f} | "
            f"{lo['expected_peak'] / fu['expected_peak']:.2f} | {lo['peak_rss'] / fu['peak_rss']:.2f} | "
            f"{lo['peak_allocated'] / fu['peak_allocated']:.2f} |"
        )
    lines += [
        "",
        "Peak allocated includes prepare: under zero1/2 the frozen weights are broadcast from the first rank in",
        "buffers of at most 32 MiB (runtime/comm.py COALESCE_BYTES), one at a time, which expected_peak (a step's",
        "needs) leaves out.",
    ]
    print("\n".join(lines))
    env = harness.environment()
    result = {"rows": rows, "sources": harness.source_record(start, harness.source_state())}
    harness.write_result(result, args, STEM, env, argv)
    if not args.no_json:
        (Path(args.out) / f"{STEM}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
