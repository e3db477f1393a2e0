"""Worker function for bench_memory.py: one run of one zero configuration, in processes started by phalanx.spawn
(fresh interpreters, 1 thread per rank, gloo, ``PHALANX_DEVICE=cpu``).

The same code runs against two phalanx revisions (the one before the zero buffer pool and the one that added it),
so it uses only what both have: ``phalanx.Engine`` and its ``prepare`` / ``backward`` / ``memory_report``. glibc's
``mallinfo2`` is read here with ctypes (``phalanx.runtime.memory.host_bytes_allocated`` is newer than the pool).

The model is issue 39's: ``Stack``, 24 x ``nn.Linear(1024, 1024)`` with tanh between, built on the meta device with
``torch.manual_seed(seed)`` right before, AdamW(lr=1e-3), loss ``(model(x) - y).square().mean()`` on a batch of
8 x 1024 drawn from ``(seed, step)`` (the same on every rank, so that the tp ranks of a tp group see one batch).

``run(spec)`` (every rank):

1. ``phalanx.Engine(strategy=..., seed=..., **engine)``, an AdamW's first use on a 1-element parameter (its imports
   belong to the runtime), ``gc.collect()``: the *baseline*. ``VmHWM`` is reset to the resident size there
   (``/proc/self/clear_refs`` "5"), and ``VmRSS`` and glibc's allocated bytes (``uordblks + hblkhd``) are read;
2. under ``Allocated`` (a TorchDispatchMode that reads ``mallinfo2`` after every torch op and keeps the largest):
   the model built on meta (whole under tensor parallelism, ``spec["meta"]`` False), AdamW, ``engine.prepare``;
   ``VmHWM`` is reset again, then ``spec["warmup"]`` untimed steps;
3. ``spec["steps"]`` timed steps without the mode: each step's wall time (``time.perf_counter``) and this process's
   CPU time (``getrusage(RUSAGE_SELF)`` user + sys, every thread, gloo's included), ``VmRSS`` after each step
   (read outside the timed region);
4. under the mode again, ``spec["tail"]`` more steps (the allocated peak once the steps have run many times);
5. ``VmHWM`` and ``VmRSS`` over the baseline, the allocated peaks over the baseline per phase, ``memory_report()``.

Every function here is module-level so that the spawn start method can import it by name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import resource
import sys
import time
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

LAYERS, WIDTH, BATCH = 24, 1024, 8

# ------------------------------------------------------------------------------------------ the process's memory


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        _LIBC = libc
    return _LIBC


def allocated_bytes() -> int:
    """Bytes this process holds from malloc now (glibc's mallinfo2, every arena: ``uordblks + hblkhd``), without
    the free room the allocator keeps resident: what phalanx.runtime.memory.host_bytes_allocated reads."""
    info = _libc().mallinfo2()
    return int(info.uordblks + info.hblkhd)


def heap_bytes() -> dict[str, int]:
    """mallinfo2's arena (heap obtained with sbrk/arenas), fordblks (free in it), hblkhd (mapped blocks)."""
    info = _libc().mallinfo2()
    return {"arena": int(info.arena), "free": int(info.fordblks), "mapped": int(info.hblkhd)}


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


class Allocated(TorchDispatchMode):
    """The most bytes held from the allocator after any torch op run under it (tests/test_zero_memory.py's)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = allocated_bytes()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        now = allocated_bytes()
        if now > self.peak:
            self.peak = now
        return out


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ------------------------------------------------------------------------------------------ the model


class Stack(nn.Module):
    def __init__(self, layers: int = LAYERS, width: int = WIDTH) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def tp_plan(layers: int = LAYERS) -> str:
    """Megatron's pairs on the stack: even layers colwise, odd layers rowwise (tanh is elementwise, so a colwise
    layer's split output feeds the next rowwise layer as is)."""
    return json.dumps({f"layers.{i}": ("colwise" if i % 2 == 0 else "rowwise") for i in range(layers)})


def batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


# ------------------------------------------------------------------------------------------ one run


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """The one entry point phalanx.spawn calls: see the module docstring."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    import os

    import phalanx

    rank = int(os.environ.get("RANK", "0"))
    engine_kwargs = dict(spec["engine"])
    if engine_kwargs.pop("tp_plan_stack", False):
        engine_kwargs["tp_plan"] = tp_plan()
    engine = phalanx.Engine(strategy=spec["strategy"], seed=spec["seed"], **engine_kwargs)
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # the optimizer's imports are the runtime's
    gc.collect()
    reset_hwm()
    base_rss = status_bytes("VmRSS")
    base_alloc = allocated_bytes()
    base_heap = heap_bytes()

    phases: dict[str, dict[str, Any]] = {}

    def phase_end(name: str, mode: Allocated | None) -> None:
        phases[name] = {
            "hwm_over_base": status_bytes("VmHWM") - base_rss,
            "rss_over_base": status_bytes("VmRSS") - base_rss,
            "allocated_now_over_base": allocated_bytes() - base_alloc,
            **({"allocated_peak_over_base": mode.peak - base_alloc, "ops": mode.ops} if mode else {}),
        }

    def step(s: int) -> float:
        x, y = batch(spec["seed"], s)
        loss = (model(x) - y).square().mean()
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    losses: list[float] = []
    mode = Allocated()
    with mode:
        torch.manual_seed(spec["seed"])
        if spec.get("meta", True):
            with torch.device("meta"):
                net = Stack()
        else:  # tensor parallelism splits initialised weights: the whole model is built on every rank
            net = Stack()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        t0 = time.perf_counter()
        model, opt = engine.prepare(net, opt)
        prepare_s = time.perf_counter() - t0
    phase_end("prepare", mode)
    reset_hwm()  # from here VmHWM is the steps' own peak (the run's is the larger of the two)
    mode = Allocated()
    with mode:
        for s in range(spec["warmup"]):
            losses.append(step(s))
    phase_end("warmup", mode)

    times: list[float] = []
    cpu: list[float] = []
    rss_after_step: list[int] = []
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for s in range(spec["warmup"], spec["warmup"] + spec["steps"]):
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        losses.append(step(s))
        times.append(time.perf_counter() - t0)
        cpu.append(cpu_seconds() - c0)
        rss_after_step.append(status_bytes("VmRSS") - base_rss)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    phase_end("timed", None)

    mode = Allocated()
    with mode:
        for s in range(spec["warmup"] + spec["steps"], spec["warmup"] + spec["steps"] + spec["tail"]):
            losses.append(step(s))
    phase_end("tail", mode)

    report = engine.memory_report()
    held = report.get("held", {})
    out = {
        "rank": rank,
        "times": times,
        "cpu": cpu,
        "losses": losses,
        "minor_faults_per_step": faults / max(1, spec["steps"]),
        "prepare_s": prepare_s,
        "base_rss": base_rss,
        "base_allocated": base_alloc,
        "base_heap": base_heap,
        "end_heap": heap_bytes(),
        "phases": phases,
        "rss_after_step_over_base": rss_after_step,
        # VmHWM over the baseline: of the steps (reset after prepare), and of the whole run (prepare included)
        "steps_hwm_over_base": status_bytes("VmHWM") - base_rss,
        "hwm_over_base": max(status_bytes("VmHWM") - base_rss, phases["prepare"]["hwm_over_base"]),
        "rss_end_over_base": status_bytes("VmRSS") - base_rss,
        # the allocated peak is sampled in prepare, the warm-up and the tail steps (not in the timed ones)
        "allocated_peak_over_base": max(p.get("allocated_peak_over_base", 0) for p in phases.values()),
        "steps_allocated_peak_over_base": max(phases[k]["allocated_peak_over_base"] for k in ("warmup", "tail")),
        "expected_peak": report.get("expected_peak"),
        "held_total": report.get("held_total"),
        "comm_buffers": held.get("comm_buffers"),
        "pool_bytes": report.get("pool_bytes"),
        "transient": report.get("transient"),
        "report_peak_rss": report.get("peak", {}).get("rss"),
        "describe": _describe(engine),
        "threads": torch.get_num_threads(),
        "phalanx_file": phalanx.__file__,
        "python": sys.version.split()[0],
    }
    return out


def _describe(engine: Any) -> dict[str, Any]:
    try:
        d = engine.strategy.describe()
        return json.loads(json.dumps(d, default=str))
    except Exception as e:  # noqa: BLE001 - informative only
        return {"error": f"{type(e).__name__}: {e}"}
