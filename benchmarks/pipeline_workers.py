"""Worker functions for bench_pipeline.py: one training run of one pipeline-parallel configuration, in a process
started by phalanx.spawn (2 ranks = 2 pipeline stages, gloo, 1 thread each).

Every configuration trains the same model on the same data:
- the model is an ``nn.Sequential`` of ``n_blocks`` residual MLP blocks (``x + fc2(gelu(fc1(x)))``, ``d -> 4d -> d``),
  built whole on every rank with ``torch.manual_seed(seed)`` right before construction;
- stage ``r`` of ``p`` holds blocks ``r*n/p .. (r+1)*n/p - 1`` (equal parameter counts, so phalanx's default
  parameter-balanced partition gives the same split; the phalanx runner checks that it does);
- step ``s`` uses the global batch generated from ``seed * 1_000_003 + s`` (``randn`` inputs and targets), whole on
  every rank; MSE loss, mean over each micro-batch, gradients averaged over the ``m`` micro-batches;
- AdamW(lr, weight_decay=0.01) over the rank's own stage.

Each run (the loop is harness.train_loop) returns per-step times (the whole step: schedule + ``optimizer.step()`` +
``zero_grad()``), the schedule's own wall time and the time this rank spent blocked in p2p waits, per-step losses (the
last stage's; phalanx returns them on every rank), a checksum of the rank's parameters and its memory figures.

Every function here is module-level so that the spawn start method can import it by name.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import init_gloo, make_adamw, param_sum, train_loop, world
from torch import nn

# ------------------------------------------------------------------------------------------ workload


class ResBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))`` with ``fc1: d -> 4d``, ``fc2: 4d -> d`` (8 d^2 + 5 d parameters)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def build_model(spec: dict[str, Any]) -> nn.Sequential:
    torch.manual_seed(spec["seed"])
    return nn.Sequential(*[ResBlock(spec["d"]) for _ in range(spec["n_blocks"])])


def virtual_stages(spec: dict[str, Any]) -> int:
    """Chunks per rank: 2 under the interleaved schedule, else 1."""
    return 2 if spec["schedule"] == "interleaved_1f1b" else 1


def chunk_blocks(spec: dict[str, Any], chunk: int, nchunks: int) -> range:
    n = spec["n_blocks"]
    if n % nchunks:
        raise ValueError(f"{n} blocks do not split evenly over {nchunks} chunks")
    k = n // nchunks
    return range(chunk * k, (chunk + 1) * k)


def stage_blocks(spec: dict[str, Any], stage: int, nstages: int) -> list[int]:
    """The blocks rank ``stage`` holds: one run of blocks, or (interleaved) chunks stage, stage + p, ..."""
    v = virtual_stages(spec)
    return [i for c in range(stage, nstages * v, nstages) for i in chunk_blocks(spec, c, nstages * v)]


def make_batch(spec: dict[str, Any], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole global batch of ``step`` (every rank makes it; stage 0 uses x, the last stage y)."""
    g = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + step)
    x = torch.randn(spec["global_batch"], spec["d"], generator=g)
    y = torch.randn(spec["global_batch"], spec["d"], generator=g)
    return x, y


def _signature(params: list[torch.Tensor]) -> list[tuple[tuple[int, ...], float]]:
    """(shape, exact float64 sum) of each parameter in order: identifies a stage's tensors by value."""
    return [(tuple(p.shape), float(p.detach().double().sum())) for p in params]


# ------------------------------------------------------------------------------------------ the loop


StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[float, dict[str, float]]]
"""``step(x, y) -> (loss, {"schedule_s": ..., "wait_s": ...})``; the loss is nan on a rank that does not know it."""


def _train(spec: dict[str, Any], rank: int, step_fn: StepFn, params: list[torch.Tensor]) -> dict[str, Any]:
    """harness.train_loop on the whole global batch of each step; the checksum and the count are of ``params``."""
    out = train_loop(spec, rank, lambda s: make_batch(spec, s), step_fn, lambda: param_sum(params))
    out["n_stage_params"] = sum(p.numel() for p in params)
    return out


# ----------------------------------------------------------------------------------------- torch.distributed.pipelining


class _WaitTimer:
    """Wraps torch.distributed.pipelining.schedules._wait_batch_p2p (every p2p wait of the single-stage schedules:
    receives, and the sends fused with them in 1F1B) and adds up the wall time spent in it."""

    def __init__(self) -> None:
        from torch.distributed.pipelining import schedules

        self.total = 0.0
        self._mod = schedules
        self._orig = schedules._wait_batch_p2p

        def timed(work: list[Any]) -> None:
            t0 = time.perf_counter()
            try:
                self._orig(work)
            finally:
                self.total += time.perf_counter() - t0

        schedules._wait_batch_p2p = timed

    def restore(self) -> None:
        self._mod._wait_batch_p2p = self._orig


def run_torch(spec: dict[str, Any]) -> dict[str, Any]:
    """torch.distributed.pipelining: PipelineStage(stage Sequential) + ScheduleGPipe / Schedule1F1B /
    ScheduleInterleaved1F1B (two chunks per rank, r and r + p) / ScheduleInterleavedZeroBubble (one chunk per
    rank: its ZB-H1 form), then AdamW."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    rank, size = init_gloo()
    model = build_model(spec)
    idx = stage_blocks(spec, rank, size)
    v = virtual_stages(spec)
    chunks = [nn.Sequential(*[model[i] for i in chunk_blocks(spec, c, size * v)]) for c in range(rank, size * v, size)]
    stage_mod = nn.Sequential(*chunks)
    del model
    stages = [PipelineStage(ch, c, size * v, torch.device("cpu")) for ch, c in zip(chunks, range(rank, size * v, size))]
    cls: Any = {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "zb_h1": ScheduleInterleavedZeroBubble,
    }[spec["schedule"]]
    multi = spec["schedule"] in ("interleaved_1f1b", "zb_h1")
    schedule = cls(stages if multi else stages[0], n_microbatches=spec["microbatches"], loss_fn=F.mse_loss)
    opt = make_adamw(stage_mod.parameters(), spec)
    timer = _WaitTimer()
    first, last = rank == 0, rank == size - 1

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, float]]:
        w0 = timer.total
        t0 = time.perf_counter()
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if last else {}
        schedule.step(*args, return_outputs=False, **kwargs)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        loss = float(torch.stack([loss.detach() for loss in losses]).mean()) if last else float("nan")
        return loss, {"schedule_s": t1 - t0, "wait_s": timer.total - w0}

    out = _train(spec, rank, step, list(stage_mod.parameters()))
    timer.restore()
    out["describe"] = {"stage_blocks": list(idx), "schedule": cls.__name__, "microbatches": spec["microbatches"]}
    dist.barrier()
    return out


# ------------------------------------------------------------------------------------------ phalanx


def _mse(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(m(b[0]), b[1])


def phalanx_timing(engine: Any) -> dict[str, float]:
    """The last step's schedule wall time and time blocked on p2p receives, from ``last_step_timing``."""
    t = engine.strategy.last_step_timing
    out = {"schedule_s": float(t["step_s"]), "wait_s": float(t["idle_s"])}
    out.update({f"{k}_s": float(t[f"{k}_s"]) for k in ("F", "B", "W", "BW") if f"{k}_s" in t})
    return out


def run_phalanx(spec: dict[str, Any]) -> dict[str, Any]:
    """phalanx.Engine(strategy="pipeline", pp_size, pp_schedule, pp_microbatches); prepare(model, opt); train_step."""
    import phalanx

    rank, size = world()
    engine = phalanx.Engine(
        strategy="pipeline",
        pp_size=size,
        pp_schedule=spec["schedule"],
        pp_microbatches=spec["microbatches"],
        seed=spec["seed"],
    )
    model = build_model(spec)  # after Engine(), which reseeds
    stage_idx = engine.topology.pp_stage
    idx = stage_blocks(spec, stage_idx, size)
    expected = _signature([p for i in idx for p in model[i].parameters()])  # in the model's order
    opt = make_adamw(model.parameters(), spec)
    model, opt = engine.prepare(model, opt)
    kept = [p for p in model.parameters()]
    got = _signature(kept)
    split_ok = got == expected
    if not split_ok:
        raise RuntimeError(
            f"stage {stage_idx}: phalanx kept {len(got)} parameter tensors ({sum(p.numel() for p in kept):,} values), "
            f"not those of blocks {list(idx)} ({len(expected)} tensors); describe() = {engine.strategy.describe()}"
        )
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    if {id(p) for p in opt_params} != {id(p) for p in kept}:
        raise RuntimeError(
            f"stage {stage_idx}: the prepared optimizer holds {len(opt_params)} tensors, the stage {len(kept)}"
        )

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, float]]:
        loss = engine.train_step((x, y), _mse)
        return float(loss), phalanx_timing(engine)

    out = _train(spec, rank, step, kept)
    out["describe"] = engine.strategy.describe()
    out["split_check"] = {"stage": stage_idx, "blocks": list(idx), "ok": split_ok}
    out["per_stage_micro"] = spec["microbatches"]  # F_s, B_s, W_s, BW_s add up every micro-batch of a step
    return out


RUNNERS = {"torch": run_torch, "phalanx": run_phalanx}


def run(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The one entry point phalanx.spawn calls."""
    return RUNNERS[kind](spec)
