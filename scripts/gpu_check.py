"""The device check of issue 36: what only a GPU shows, in one run that fits one 8-minute call on one GPU machine.

    bash scripts/gpu_check.sh              # sets up .venv when missing, then runs this file
    bash scripts/gpu_check.sh --dry-run    # any machine, no CUDA: syntax, imports, configs (tests/test_gpu_check.py)

Sections, each run in a child process of its own (a CUDA error or an NCCL hang then costs one section, and a
section's process group cannot leak into the next), cheapest first so that a slow one cannot starve the others:

- ``ledger``: ``phalanx.runtime.placement.LEDGER`` against ``torch.cuda.memory_allocated()`` across
  ``engine.prepare`` of a host-built model under zero3, with and without ``offload="cpu"`` (B2). Absent: FAIL.
- ``nccl1``: a world-size-1 NCCL process group (file:// store); a few steps of every strategy through
  ``phalanx.Engine`` on it must give the losses of the same run without a group. Also, timed behind GPU work queued
  with ``torch.cuda._sleep``: ``wait()`` on NCCL is a stream wait and ``barrier()`` holds the host; the collective
  log's hold on NCCL works (S1); one visible GPU per process (B3).
- ``matrix``: every strategy x every precision on one process, a few steps each, counting host syncs per step with
  ``torch.cuda.set_sync_debug_mode("warn")`` and naming the ``file:line`` in phalanx that made them (S5). That mode
  sees the syncs made through c10's ``memcpy_and_sync`` and ``stream_synchronize`` (``.item()``, ``.cpu()``,
  ``.tolist()``, blocking device-to-host copies), not ``torch.cuda.synchronize()`` or what NCCL does in C++: the
  counts are a floor.
- ``test_cuda``: ``pytest -p no:xdist tests/test_cuda.py``.

The whole run is time-boxed (``--budget``, default 420 s, counted from when ``gpu_check.sh`` started): a section
that would start with less time left than it needs is skipped with a message, a running one is stopped at the
deadline. Exit status: 0 when every section passed, 1 when one failed, 2 when none failed but some did not run.
Results also go to ``$OUT/gpu_check.json`` (``--out``). ``--device cpu`` runs the sections' logic on the CPU (gloo
for NCCL, no sync counts): a check of this script, not of the device.
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import dataclasses
import gc
import importlib
import json
import os
import py_compile
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve()
MiB = 2**20

# ------------------------------------------------------------------------------------------------------ the runs


@dataclasses.dataclass(frozen=True)
class RunSpec:
    label: str
    options: dict[str, Any]
    pipeline: bool = False  # trained through engine.train_step (engine.backward raises under the pipeline)


MATRIX: tuple[RunSpec, ...] = (
    RunSpec("ddp", {"strategy": "ddp"}),
    RunSpec("zero1", {"strategy": "zero1"}),
    RunSpec("zero2", {"strategy": "zero2"}),
    RunSpec("zero3", {"strategy": "zero3"}),
    RunSpec("zero3+offload", {"strategy": "zero3", "offload": "cpu"}),
    RunSpec("pipeline", {"strategy": "pipeline", "pp_size": 1, "pp_microbatches": 2}, pipeline=True),
    RunSpec("ddp tp1", {"strategy": "ddp", "tp_size": 1}),
)
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
REFUSED_ON_CUDA = {
    ("zero3+offload", "fp16-mixed"): "zero/base.py refuses offload with fp16-mixed on CUDA (its loss scaler)",
}
"""Combinations phalanx refuses by design on CUDA: a refusal there is reported, not failed. Any other is a failure."""

WIDTH, BATCH, OUT_DIM = 1024, 16, 8  # 4.2 M parameters: S2's 2 bytes a parameter (8 MiB) stand out of the noise
LEDGER_TOLERANCE = (2 * MiB, 0.05)
"""Ledger vs allocator: the ledger counts storages' exact bytes, the caching allocator whole blocks (rounded up to
512 B), and a copy prepare makes and drops is the allocator's peak without being a placement."""


def _mlp() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, OUT_DIM))


# ---------------------------------------------------------------------------------------------- host syncs


class SyncCapture:
    """Counts the host syncs that torch's sync debug mode reports while ``watching()``, by the phalanx line that made
    each. ``cuda=False`` captures the warnings without turning the debug mode on (tests feed it warnings)."""

    def __init__(self, cuda: bool = True) -> None:
        self.cuda = cuda
        self.count = 0
        self.sites: collections.Counter[str] = collections.Counter()
        self.chains: dict[str, str] = {}
        self.other_warnings = 0
        self._package = _phalanx_dir()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        with warnings.catch_warnings():
            # "always": every sync counts, not only the first at each line.
            warnings.simplefilter("always")
            warnings.showwarning = self._record
            if self.cuda:
                import torch

                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if self.cuda:
                    import torch

                    torch.cuda.set_sync_debug_mode("default")

    def _record(
        self, message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if "synchroniz" not in str(message):
            self.other_warnings += 1
            return
        # Called where the warning was raised: the stack still holds the Python frames that led to the sync.
        stack = traceback.extract_stack()[:-1]
        site, chain = site_of(stack, self._package)
        self.count += 1
        self.sites[site] += 1
        self.chains.setdefault(site, chain)


def _phalanx_dir() -> str:
    import phalanx

    return str(Path(phalanx.__file__).resolve().parent)


def _shown_path(filename: str, package: str) -> str:
    path = Path(filename).resolve()
    for base in (ROOT, Path(package).parent):
        with contextlib.suppress(ValueError):
            return str(path.relative_to(base))
    return str(path)


def site_of(stack: list[traceback.FrameSummary], package: str) -> tuple[str, str]:
    """(the innermost phalanx frame as ``file:line``, the chain of phalanx frames innermost first); without a phalanx
    frame, the innermost frame outside torch and this script's capture, marked as outside phalanx."""
    prefix = package.rstrip(os.sep) + os.sep
    ours = [f for f in reversed(stack) if str(Path(f.filename).resolve()).startswith(prefix)]
    if ours:
        shown = [f"{_shown_path(f.filename, package)}:{f.lineno}" for f in ours]
        return shown[0], " < ".join(shown[:4])
    import torch

    skip = (str(Path(torch.__file__).resolve().parent) + os.sep, str(Path(warnings.__file__).resolve()))
    for f in reversed(stack):
        name = str(Path(f.filename).resolve())
        if not name.startswith(skip) and f.name not in ("_record", "watching"):
            where = f"{Path(f.filename).name}:{f.lineno} (outside phalanx)"
            return where, where
    return "<no Python frame>", "<no Python frame>"


# ------------------------------------------------------------------------------------------------ one run


@dataclasses.dataclass
class Ctx:
    device: str  # "cuda" or "cpu"
    deadline: float
    steps: int
    warmup: int

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def left(self) -> float:
        return self.deadline - time.time()


def train(spec: RunSpec, precision: str, ctx: Ctx, steps: int, warmup: int) -> dict[str, Any]:
    """``warmup`` + ``steps`` optimizer steps of ``spec``; host syncs are counted over the last ``steps`` only (the
    first steps build lazy state: optimizer moments, the allocator's pools, dynamo's import)."""
    import torch
    import torch.nn.functional as F

    import phalanx

    dev = torch.device(ctx.device)
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if ctx.cuda else 0
    engine = phalanx.Engine(device=ctx.device, seed=0, precision=precision, **spec.options)
    model = _mlp()
    model, optimizer = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(BATCH, WIDTH, generator=g).to(dev), torch.randn(BATCH, OUT_DIM, generator=g).to(dev))
        for _ in range(warmup + steps)
    ]

    def loss_fn(m: Any, b: tuple[Any, Any]) -> Any:
        return F.mse_loss(m(b[0]).float(), b[1])

    capture = SyncCapture(cuda=ctx.cuda)
    losses, times = [], []
    for i, batch in enumerate(batches):
        measured = i >= warmup
        t0 = time.perf_counter()
        with capture.watching() if measured and ctx.cuda else contextlib.nullcontext():
            if spec.pipeline:
                loss = engine.train_step(batch, loss_fn)
            else:
                loss = loss_fn(model, batch)
                engine.backward(loss)
                engine.clip_grad_norm_(1.0)
                optimizer.step()
                optimizer.zero_grad()
        if ctx.cuda:
            torch.cuda.synchronize()  # outside the capture: the step's time, not a sync of the step
        if measured:
            times.append(time.perf_counter() - t0)
        losses.append(torch.as_tensor(loss).detach())
    values = [float(v) for v in torch.stack([v.float().reshape(()) for v in losses]).cpu()]
    out: dict[str, Any] = {
        "steps": steps,
        "losses": values,
        "finite": all(v == v and abs(v) != float("inf") for v in values),
        "syncs_per_step": round(capture.count / steps, 2) if ctx.cuda and steps else None,
        "sites": dict(capture.sites.most_common(6)),
        "chains": {k: capture.chains[k] for k, _ in capture.sites.most_common(6)},
        "ms_per_step": round(1000 * sorted(times)[len(times) // 2], 2) if times else None,
        "peak_mib": round((torch.cuda.max_memory_allocated() - base) / MiB, 1) if ctx.cuda else None,
        "world": engine.world.source,
    }
    engine.free_memory(model, optimizer)
    del engine, model, optimizer, batches
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    return out


def _sites_text(sites: dict[str, int], steps: int, n: int = 3) -> str:
    return ", ".join(f"{s} x{c / steps:g}" for s, c in list(sites.items())[:n]) or "-"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ sections


class CheckFailed(Exception):
    """A section's own verdict: what was wrong, the values, and where to look."""


Result = dict[str, Any]


def section_matrix(ctx: Ctx) -> Result:
    """Every strategy x precision on one process: runs, finite losses, host syncs per step and where (S5)."""
    warnings.filterwarnings("ignore", message="strategy .* shards nothing")
    rows: list[list[Any]] = []
    runs: dict[str, Any] = {}
    failed, skipped, refused, late = [], [], [], []
    for spec in MATRIX:
        for precision in PRECISIONS:
            key = f"{spec.label}/{precision}"
            if ctx.left() < 10:
                late.append(key)
                rows.append([spec.label, precision, "SKIP (budget)", None, None, None, None, None])
                continue
            try:
                r = train(spec, precision, ctx, ctx.steps, ctx.warmup)
            except Exception as e:  # noqa: BLE001 - every run is reported, whatever it raised
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
                if ctx.cuda and (spec.label, precision) in REFUSED_ON_CUDA and isinstance(e, ValueError):
                    refused.append(key)
                    status = "refused"
                elif spec.pipeline and isinstance(e, (ValueError, TypeError)):
                    skipped.append(key)
                    status = "SKIP"  # the pipeline may refuse a single stage: say why, do not fail
                else:
                    failed.append(key)
                    status = "FAIL"
                    print(f"FAIL matrix {key}:\n" + "".join(traceback.format_exc().splitlines(True)[-6:]), flush=True)
                runs[key] = {"status": status, "error": reason}
                rows.append([spec.label, precision, f"{status}: {reason}", None, None, None, None, None])
                continue
            status = "ok" if r["finite"] else "FAIL (non-finite loss)"
            if not r["finite"]:
                failed.append(key)
            if ctx.cuda and (spec.label, precision) in REFUSED_ON_CUDA:
                status += " (was refused by design: now runs)"
            runs[key] = {"status": status, **r}
            rows.append(
                [
                    spec.label,
                    precision,
                    status,
                    r["steps"],
                    r["syncs_per_step"],
                    r["ms_per_step"],
                    r["peak_mib"],
                    _sites_text(r["sites"], r["steps"]),
                ]
            )
            print(f"matrix {key}: {status}, syncs/step {r['syncs_per_step']}", flush=True)
    header = ["strategy", "precision", "status", "steps", "syncs/step", "ms/step*", "peak MiB", "top sync sites"]
    print(_table(header, rows), flush=True)
    print("* under the sync debug mode, which costs a stack walk per sync: not a benchmark", flush=True)
    s2 = _s2_note(runs)
    if s2:
        print(s2, flush=True)
    note = f"{len(rows)} runs: {len(rows) - len(failed) - len(skipped) - len(refused) - len(late)} ok"
    note += f", {len(refused)} refused by design" if refused else ""
    note += f", {len(skipped)} skipped ({', '.join(skipped)})" if skipped else ""
    if failed:
        raise CheckFailed(f"{note}; failed: {', '.join(failed)} (tracebacks above)")
    if late:  # not a failure, not a pass: the exit status says the check is incomplete
        return {"status": "SKIP", "note": f"over budget: {len(late)} runs not run; {note}", "runs": runs, "s2": s2}
    return {"status": "PASS", "note": note, "runs": runs, "s2": s2}


def _s2_note(runs: dict[str, Any]) -> str | None:
    """S2 read off the matrix: zero3's peak under bf16 autocast against fp32 (the saved bf16 casts of gathered
    weights stay until backward: about 2 bytes a parameter more, where fp32 saves the freed parameters themselves)."""
    fp32, bf16 = runs.get("zero3/fp32", {}), runs.get("zero3/bf16-mixed", {})
    if fp32.get("peak_mib") is None or bf16.get("peak_mib") is None:
        return None
    copy = 2 * sum(p.numel() for p in _mlp().parameters()) / MiB
    excess = bf16["peak_mib"] - fp32["peak_mib"]
    verdict = "open" if excess >= copy / 2 else "not seen"
    return (
        f"S2: {verdict}: zero3's peak is {bf16['peak_mib']} MiB under bf16-mixed, {fp32['peak_mib']} MiB under fp32: "
        f"{excess:+.1f} MiB, against {copy:.1f} MiB for a bf16 copy of the model"
    )


def section_nccl1(ctx: Ctx) -> Result:
    """A world-size-1 process group (NCCL on CUDA): each strategy's losses equal the run without a group."""
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message="strategy .* shards nothing")
    rows: list[list[Any]] = []
    failed: list[str] = []
    findings: list[str] = []
    late: list[str] = []

    def guarded(what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or None with the failure recorded and its traceback's last lines printed: the rest still runs."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one strategy's failure must not hide the others'
            failed.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200])
            print(f"FAIL nccl1 {what}:\n" + "".join(traceback.format_exc().splitlines(True)[-6:]), flush=True)
            return None

    plain = {
        spec.label: guarded(f"{spec.label} without a group", lambda s=spec: train(s, "fp32", ctx, 2, 1))
        for spec in MATRIX
    }
    backend = "nccl" if ctx.cuda else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        kwargs: dict[str, Any] = {"device_id": torch.device("cuda", 0)} if ctx.cuda else {}
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1, **kwargs)
        try:
            for spec in MATRIX:
                if ctx.left() < 10:
                    rows.append([spec.label, "SKIP (budget)", None, None, None])
                    late.append(spec.label)
                    continue
                got = guarded(f"{spec.label} on {backend}", lambda s=spec: train(s, "fp32", ctx, 2, 1))
                want = plain[spec.label]
                if got is None or want is None:
                    rows.append([spec.label, "FAIL", "did not run (above)", None, None])
                    continue
                diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got["losses"], want["losses"]))
                ok = got["world"] == "existing" and diff <= 1e-6
                verdict = "bitwise" if diff == 0 else f"rel diff {diff:.1e}"
                if not ok:
                    failed.append(f"{spec.label}: losses {verdict} (at most 1e-6), world {got['world']!r}")
                row = [spec.label, "ok" if ok else "FAIL", verdict, got["syncs_per_step"], want["syncs_per_step"]]
                rows.append(row)
            findings += guarded("wait() probe", lambda: _wait_is_a_stream_wait(ctx, failed)) or []
            findings.append(guarded("S1 probe", lambda: _s1_probe(ctx)) or "S1: probe failed (above)")
            findings.append(guarded("B3 probe", lambda: _b3_probe(ctx)) or "B3: probe failed (above)")
        finally:
            dist.destroy_process_group()
    print(f"process group: {backend}, world size 1, file:// store", flush=True)
    print(_table(["strategy", "status", "loss vs no group", "syncs/step", "no group"], rows), flush=True)
    for line in findings:
        print(line, flush=True)
    matched = sum(1 for r in rows if r[1] == "ok")
    note = f"{backend} world 1: {matched}/{len(rows)} strategies match the run without a group"
    if failed:
        raise CheckFailed(f"{note}; failed: {'; '.join(failed)}")
    if late:
        return {"status": "SKIP", "note": f"over budget: {', '.join(late)} not run; {note}", "findings": findings}
    return {"status": "PASS", "note": note, "findings": findings}


def _wait_is_a_stream_wait(ctx: Ctx, failed: list[str]) -> list[str]:
    """docs/gpus.md says ``wait()`` on an NCCL work makes the current stream wait, not the host, and that
    ``barrier()`` does hold the host: check both by timing the host behind ~200 ms of queued GPU work
    (``torch.cuda._sleep``). The sync debug mode alone cannot tell: it sees only syncs made through c10's
    ``memcpy_and_sync`` and ``stream_synchronize``, not what ProcessGroupNCCL does in C++."""
    if not ctx.cuda:
        return ["wait(): not checked (no CUDA)"]
    import torch
    import torch.distributed as dist

    from phalanx.runtime.collective_log import LOG, watched

    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t, async_op=True).wait()  # the first collective may set things up: not what is measured
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(10**8)
    torch.cuda.synchronize()
    cycles = int(10**8 * 0.2 / max(time.perf_counter() - t0, 1e-4))  # about 200 ms of GPU time

    def host_ms(op: Callable[[], Any]) -> tuple[float, float]:
        """(ms the host spent until ``op`` returned, ms queued on the device before it)."""
        start = time.perf_counter()
        torch.cuda._sleep(cycles)
        op()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        return 1000 * host, 1000 * (time.perf_counter() - start)

    capture = SyncCapture()
    was_on, LOG.on = LOG.on, True  # through the log's NCCL path, as under a multi-rank run's watchdog
    try:
        with capture.watching():
            waits = {
                "all_reduce(async_op=True).wait()": host_ms(lambda: dist.all_reduce(t, async_op=True).wait()),
                "watched(all_reduce, async_op=True).wait()": host_ms(
                    lambda: watched(dist.all_reduce, t, async_op=True, label="wait probe").wait()
                ),
                "watched(all_reduce)": host_ms(lambda: watched(dist.all_reduce, t, label="wait probe")),
            }
        barrier = host_ms(dist.barrier)
    finally:
        LOG.on = was_on
        LOG.reset()
    lines = []
    for what, (host, total) in waits.items():
        ok = host < 0.5 * total
        lines.append(f"wait(): {'ok' if ok else 'FAIL'}: {what}: the host waited {host:.0f} of {total:.0f} ms queued")
        if not ok:
            failed.append(
                f"{what} held the host {host:.0f} of {total:.0f} ms: docs/gpus.md#nccl-streams-and-overlap says "
                "wait() on NCCL is a stream wait; correct the page or the code"
            )
    if capture.count:
        failed.append(f"NCCL waits made {capture.count} host syncs ({_sites_text(dict(capture.sites), 1)})")
        lines.append(f"wait(): FAIL: {capture.count} host syncs seen by the sync debug mode")
    host, total = barrier
    blocks = host >= 0.5 * total
    lines.append(f"barrier(): {'ok' if blocks else 'FAIL'}: the host waited {host:.0f} of {total:.0f} ms queued")
    if not blocks:
        failed.append(
            f"barrier() returned after {host:.0f} of {total:.0f} ms queued: docs/gpus.md says it holds the host "
            "(engine.wait_for_everyone relies on it); correct the page or the code"
        )
    return lines


def _s1_probe(ctx: Ctx) -> str:
    """S1: the collective log keeps an NCCL work (and so its tensors) until it is swept."""
    if not ctx.cuda:
        return "S1: not checked (no CUDA)"
    import torch
    import torch.distributed as dist

    from phalanx.runtime.collective_log import LOG, watched

    was_on = LOG.on
    LOG.on = True
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        t = torch.ones(16 * MiB // 4, device="cuda")  # 16 MiB
        watched(dist.all_reduce, t, label="S1 probe")
        torch.cuda.synchronize()
        del t
        gc.collect()
        held = (torch.cuda.memory_allocated() - base) / MiB
        LOG.sweep()
        gc.collect()
        after = (torch.cuda.memory_allocated() - base) / MiB
    finally:
        LOG.on = was_on
        LOG.reset()
    state = "open" if held >= 8 else "not seen"
    return (
        f"S1: {state}: 16 MiB all-reduced through the log and dropped: {held:.1f} MiB still allocated, "
        f"{after:.1f} MiB after LOG.sweep()"
    )


def _b3_probe(ctx: Ctx) -> str:
    """B3: a process that sees one GPU uses it, whatever its local rank (srun --gpus-per-task=1)."""
    if not ctx.cuda:
        return "B3: not checked (no CUDA)"
    import torch

    import phalanx

    if torch.cuda.device_count() != 1:
        return f"B3: not checked ({torch.cuda.device_count()} GPUs visible; set CUDA_VISIBLE_DEVICES to one)"
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "3"
    try:
        engine = phalanx.Engine(device="cuda")
        return f"B3: fixed: LOCAL_RANK=3 with one visible GPU -> {engine.device}"
    except RuntimeError as e:
        return f"B3: open: LOCAL_RANK=3 with one visible GPU -> {str(e).splitlines()[0][:140]}"
    finally:
        if before is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = before


def ledger_contract_problems(ledger: Any) -> list[str]:
    """What ``LEDGER`` lacks of its contract: ``reset()``, ``live_bytes``, ``peak_bytes``, ``moves`` of (what, n)."""
    problems = []
    if not callable(getattr(ledger, "reset", None)):
        problems.append("LEDGER.reset() is missing or not callable")
    for name in ("live_bytes", "peak_bytes"):
        value = getattr(ledger, name, None)
        if not isinstance(value, int):
            problems.append(f"LEDGER.{name} must be an int of bytes; got {type(value).__name__}")
    moves = getattr(ledger, "moves", None)
    if not isinstance(moves, (list, tuple)):
        problems.append(f"LEDGER.moves must be a list of (what, nbytes); got {type(moves).__name__}")
    elif any(not (isinstance(m, tuple) and len(m) == 2 and isinstance(m[1], int)) for m in moves):
        problems.append(f"LEDGER.moves must hold (what, nbytes) pairs; got {list(moves)[:2]!r}")
    return problems


def section_ledger(ctx: Ctx) -> Result:
    """LEDGER's bytes moved onto the device during ``engine.prepare`` against the allocator's (B2)."""
    if not ctx.cuda:
        return {"status": "SKIP", "note": "the ledger is checked against torch.cuda.memory_allocated(): needs CUDA"}
    try:
        from phalanx.runtime.placement import LEDGER
    except ImportError as e:
        print("ledger: not available", flush=True)
        raise CheckFailed(
            f"ledger: not available (from phalanx.runtime.placement import LEDGER: {e}); "
            "the placement ledger of issue 36 is not in this tree"
        ) from None
    problems = ledger_contract_problems(LEDGER)
    if problems:
        raise CheckFailed("ledger: " + "; ".join(problems))
    warnings.filterwarnings("ignore", message="strategy .* shards nothing")
    absolute, relative = LEDGER_TOLERANCE
    tolerance = f"within {absolute // MiB} MiB + {relative:.0%}"
    rows, failed, b2 = [], [], []
    for offload in ("none", "cpu"):
        case = f"zero3 offload={offload}"
        try:
            row, verdicts, whole = _ledger_case(LEDGER, offload)
        except Exception as e:  # noqa: BLE001 - the other case still runs
            failed.append(f"{case}: {type(e).__name__}: {e}"[:300])
            print(f"FAIL ledger {case}:\n" + "".join(traceback.format_exc().splitlines(True)[-6:]), flush=True)
            continue
        rows.append([case, *row, "ok" if not verdicts else "FAIL"])
        failed += [f"{case}: {v}" for v in verdicts]
        b2.append(f"B2 ({case}): {whole}")
    header = ["case", "alloc live", "ledger live", "alloc peak", "ledger peak", "moves / bytes", "status"]
    print(_table(header, rows) + "\n" + "\n".join(b2), flush=True)
    if failed:
        raise CheckFailed(f"ledger vs allocator ({tolerance}): " + " | ".join(failed))
    return {"status": "PASS", "note": f"ledger agrees with the allocator {tolerance}; " + "; ".join(b2), "b2": b2}


def _ledger_case(ledger: Any, offload: str) -> tuple[list[str], list[str], str]:
    """prepare a 192 MiB model built on the host under zero3: (the table's cells, the disagreements, the B2 verdict)."""
    import torch
    from torch import nn

    import phalanx

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(12)])
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = phalanx.Engine(strategy="zero3", offload=offload, device="cuda", seed=0)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ledger.reset()
    prepared = engine.prepare(model)
    torch.cuda.synchronize()
    live = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    counted_live, counted_peak = int(ledger.live_bytes), int(ledger.peak_bytes)
    moves, moved = len(ledger.moves), sum(n for _, n in ledger.moves)
    absolute, relative = LEDGER_TOLERANCE
    verdicts = []
    for what, measured, counted in (("live", live, counted_live), ("peak", peak, counted_peak)):
        limit = absolute + relative * max(measured, counted)
        if abs(measured - counted) > limit:
            verdicts.append(
                f"{what}: ledger {counted / MiB:.1f} MiB, allocator {measured / MiB:.1f} MiB "
                f"(apart by more than {limit / MiB:.1f} MiB)"
            )
    whole = f"peak during prepare {peak / MiB:.1f} MiB for a {model_bytes / MiB:.0f} MiB model: "
    if offload == "none":  # at world size 1 this rank's shard is the whole model: only offload can tell
        whole += "no verdict (the shard is the whole model at world size 1)"
    else:  # nothing stays on the device: a peak near the model's size means it went there whole
        whole += "placed whole (open)" if peak >= 0.9 * model_bytes else "not placed whole (fixed)"
    engine.free_memory(prepared)
    del engine, prepared, model
    gc.collect()
    torch.cuda.empty_cache()
    cells = [f"{v / MiB:.1f}" for v in (live, counted_live, peak, counted_peak)] + [f"{moves} / {moved / MiB:.1f} MiB"]
    return cells, verdicts, whole


def section_test_cuda(ctx: Ctx) -> Result:
    """``tests/test_cuda.py`` under pytest, without xdist (one GPU; the 2-GPU test skips)."""
    if not ctx.cuda:
        return {"status": "SKIP", "note": "tests/test_cuda.py skips every test without CUDA"}
    import xml.etree.ElementTree as ET

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-rs"]
        cmd += ["--junitxml", str(report), "tests/test_cuda.py"]
        print("$ " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, timeout=max(ctx.left() - 5, 1))
        if not report.exists():
            raise CheckFailed(
                f"pytest wrote no report (exit {proc.returncode}): is pytest installed for {sys.executable}?"
            )
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    note = f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
    if proc.returncode != 0 or counts["tests"] == 0:
        raise CheckFailed(f"pytest exit {proc.returncode}: {note}")
    return {"status": "PASS", "note": note, **counts}


SECTIONS: dict[str, tuple[Callable[[Ctx], Result], int, int]] = {
    # name: (function, seconds it needs at least to be worth starting, seconds it may take at most)
    "ledger": (section_ledger, 20, 60),
    "nccl1": (section_nccl1, 30, 90),
    "matrix": (section_matrix, 45, 150),
    "test_cuda": (section_test_cuda, 60, 200),
}


def run_section(name: str, ctx: Ctx, result_path: Path) -> int:
    """The child's side: run one section, catch what it raises, write its result."""
    fn = SECTIONS[name][0]
    t0 = time.time()
    try:
        result = fn(ctx)
    except Exception as e:  # noqa: BLE001 - a section's failure is reported, never fatal to the run
        lines = traceback.format_exc().splitlines()
        detail = str(e) if isinstance(e, CheckFailed) else f"{type(e).__name__}: {e}"
        print(f"FAIL {name}: {detail}", flush=True)
        if not isinstance(e, CheckFailed):
            print("\n".join(lines[-8:]), flush=True)
        result = {"status": "FAIL", "note": detail.splitlines()[0][:300] if detail else type(e).__name__}
    result["seconds"] = round(time.time() - t0, 1)
    result_path.write_text(json.dumps(result, indent=1, default=str))
    return 0


# ------------------------------------------------------------------------------------------- the parent


def _run_child(name: str, args: argparse.Namespace, deadline: float, out_dir: Path) -> Result:
    need, cap = SECTIONS[name][1:]
    left = deadline - time.time()
    if left < need:
        return {
            "status": "SKIP",
            "note": f"over budget: {left:.0f} s left of --budget {args.budget:g} s, the section needs about {need} s "
            f"(rerun with --sections {name}, or a larger --budget)",
            "seconds": 0,
        }
    limit = min(cap, left)
    result_path = out_dir / f"{name}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(SELF), "--section", name, "--result", str(result_path), "--device", args.device]
    cmd += ["--deadline", str(time.time() + limit - 3), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    t0 = time.time()
    tail: collections.deque[str] = collections.deque(maxlen=20)
    with open(out_dir / f"{name}.log", "w") as log:
        # Its own session: a timeout kills pytest's children and any NCCL helper threads' process with it.
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)
                tail.append(line.rstrip())

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(timeout=5)
            return {
                "status": "FAIL",
                "note": f"timed out after {limit:.0f} s (a hang, or a slow machine: see {name}.log)",
                "seconds": round(time.time() - t0, 1),
            }
        reader.join(timeout=5)
    if not result_path.exists():
        last = " | ".join(list(tail)[-3:])
        return {
            "status": "FAIL",
            "note": f"the section's process died (exit {rc}) before writing a result: {last}"[:400],
            "seconds": round(time.time() - t0, 1),
        }
    return json.loads(result_path.read_text())


def _environment(device: str) -> str:
    import torch

    text = f"torch {torch.__version__}, python {sys.executable}"
    if device == "cuda":
        import torch.distributed as dist

        version = torch.cuda.nccl.version() if dist.is_nccl_available() else "absent"
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        text += (
            f", CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, NCCL {nccl}"
        )
    return text


def run_all(args: argparse.Namespace) -> int:
    t0 = float(os.environ.get("GPU_CHECK_T0") or time.time())  # gpu_check.sh's start: set-up counts
    deadline = t0 + args.budget
    out_dir = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-check-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    names = args.sections.split(",") if args.sections else list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        print(f"FAIL: unknown section(s) {unknown}; the sections are {', '.join(SECTIONS)}")
        return 1
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(
                f"FAIL: no CUDA device for torch {torch.__version__} (CUDA build: {torch.version.cuda}); run this on a "
                "GPU machine with a CUDA build of torch, or --dry-run here"
            )
            return 1
    print(f"== gpu_check: {_environment(args.device)}; budget {args.budget:g} s, results in {out_dir}", flush=True)
    results: dict[str, Result] = {}
    for name in names:
        print(f"\n== {name} [t={time.time() - t0:.0f} s, {deadline - time.time():.0f} s left]", flush=True)
        results[name] = _run_child(name, args, deadline, out_dir)
        r = results[name]
        print(f"== {name}: {r['status']} ({r.get('seconds', 0)} s): {r.get('note', '')}", flush=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\n== summary [t={time.time() - t0:.0f} s of --budget {args.budget:g} s]")
    rows = [[n, r["status"], r.get("seconds", 0), r.get("note", "")] for n, r in results.items()]
    print(_table(["section", "status", "seconds", "note"], rows))
    statuses = {r["status"] for r in results.values()}
    if "FAIL" in statuses:
        return 1
    if any(r["status"] == "SKIP" and r.get("note", "").startswith("over budget") for r in results.values()):
        print("some sections did not run (over budget): the check is incomplete")
        return 2
    return 0


# ------------------------------------------------------------------------------------------------ dry run


def phalanx_imports(path: Path) -> list[tuple[str, str | None]]:
    """Every ``import phalanx...``, ``from phalanx... import name`` and ``phalanx.name`` in ``path``, function bodies
    included: what the sections will import and use on the GPU machine."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "phalanx":
            found += [(node.module or "", a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "phalanx"]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "phalanx":
            if not node.attr.startswith("__"):  # phalanx.__file__ is the module's, not a name phalanx gives
                found.append(("phalanx", node.attr))
    return sorted(set(found), key=lambda x: (x[0], x[1] or ""))


def _resolve(module: str, name: str | None) -> str | None:
    """None when ``from module import name`` (or ``import module``) works here; else what went wrong."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return f"import {module}: {type(e).__name__}: {e}"
    if name is not None and not hasattr(mod, name):
        with contextlib.suppress(ImportError):
            importlib.import_module(f"{module}.{name}")  # a submodule imported by name
            return None
        return f"from {module} import {name}: {module} has no {name!r}"
    return None


def dry_run(also: list[str]) -> int:
    """Syntax, imports and configs, on any machine, without touching CUDA."""
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            py_compile.compile(str(SELF), cfile=str(Path(tmp) / "gpu_check.pyc"), doraise=True)
            print(f"dry-run: syntax ok: {SELF.relative_to(ROOT)}")
        except py_compile.PyCompileError as e:
            problems.append(f"syntax: {e.msg}")
    wanted = phalanx_imports(SELF)
    for spec in also:
        module, _, name = spec.partition(":")
        wanted.append((module, name or None))
    resolved = []
    for module, name in wanted:
        problem = _resolve(module, name)
        label = f"{module}.{name}" if name else module
        if problem is None:
            resolved.append(label)
        else:
            problems.append(problem)
    if any(m == "phalanx.runtime.placement" for m, _ in wanted) and "phalanx.runtime.placement.LEDGER" in resolved:
        from phalanx.runtime.placement import LEDGER

        contract = ledger_contract_problems(LEDGER)
        problems += [f"ledger contract: {p}" for p in contract]
        if not contract:
            print("ledger: importable; contract ok (reset(), live_bytes, peak_bytes, moves)")
    print(f"dry-run: imports ok: {len(resolved)} of {len(wanted)} phalanx names resolve ({', '.join(resolved)})")
    problems += _config_problems()
    if not (ROOT / "tests" / "test_cuda.py").exists():
        problems.append("tests/test_cuda.py is missing (the test_cuda section runs it)")
    for p in problems:
        print(f"FAIL dry-run: {p}")
    print("dry-run: PASS" if not problems else f"dry-run: FAIL ({len(problems)} problems)")
    return 1 if problems else 0


def _config_problems() -> list[str]:
    """Every Engine configuration the sections use must resolve (an option renamed in phalanx fails here)."""
    from phalanx.config.settings import resolve_config

    problems = []
    configs = [(s, p) for s in MATRIX for p in PRECISIONS]
    for spec, precision in configs:
        options = {"device": "cuda", "seed": 0, "precision": precision, **spec.options}
        try:
            resolve_config(cli=options, cli_origin="argument")
        except Exception as e:  # noqa: BLE001 - any refusal is the finding
            problems.append(f"config {spec.label}/{precision} {options}: {type(e).__name__}: {e}")
    for options in ({"strategy": "zero3", "offload": o, "device": "cuda", "seed": 0} for o in ("none", "cpu")):
        try:
            resolve_config(cli=options, cli_origin="argument")
        except Exception as e:  # noqa: BLE001
            problems.append(f"config {options}: {type(e).__name__}: {e}")
    if not problems:
        print(f"dry-run: configs ok: {len(configs)} matrix runs, {len(MATRIX)} nccl1 runs, 2 ledger cases")
    return problems


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="syntax, imports and configs only; no CUDA; exit 0 if ok")
    ap.add_argument("--also-import", action="append", default=[], metavar="MODULE[:NAME]", help="dry run: check more")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole check (default 420)")
    ap.add_argument("--sections", default="", help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the script's logic, no GPU")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per matrix run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps per matrix run")
    ap.add_argument("--out", default="", help="directory for gpu_check.json and the logs (default $OUT or a temp dir)")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # the child's side
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
        return dry_run(args.also_import)
    if args.section:
        ctx = Ctx(args.device, args.deadline or time.time() + 60, args.steps, args.warmup)
        return run_section(args.section, ctx, Path(args.result))
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
