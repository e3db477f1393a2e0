"""Worker functions for bench_pipeline_dp.py: one training run of a pipeline x data-parallel configuration (pp=2 x
dp=2 on 4 ranks by default), in a process started by phalanx.spawn (gloo, 1 thread each).

The workload is pipeline_workers.py's (residual MLP blocks, seeded build, per-step seeded global batch, MSE, AdamW),
with one difference: the global batch is split between the data-parallel replicas, replica ``r`` of ``dp`` taking rows
``r*B/dp .. (r+1)*B/dp - 1``, which it splits into ``m`` micro-batches. Ranks are pp-major in both phalanx and
DeepSpeed (ranks ``0..dp-1`` are stage 0), so rank ``k`` holds the same blocks under both.

Each run returns what pipeline_workers._train (harness.train_loop) returns (per-step times, losses, checksum, memory)
plus the bytes of optimizer state (AdamW's moments) the rank holds.

Every function here is module-level so that the spawn start method can import it by name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import make_adamw, world
from pipeline_workers import _mse, _train, build_model, phalanx_timing, stage_blocks
from zero_workers import deepspeed_config, init_deepspeed


def _replica_rows(spec: dict[str, Any], dp_rank: int) -> slice:
    per = spec["global_batch"] // spec["dp"]
    return slice(dp_rank * per, (dp_rank + 1) * per)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for st in optimizer.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )


def run_phalanx(spec: dict[str, Any]) -> dict[str, Any]:
    """phalanx.Engine(strategy="pipeline", pp_size, pp_zero_stage, pp_schedule, pp_microbatches); train_step."""
    import phalanx

    rank, size = world()
    pp = size // spec["dp"]
    engine = phalanx.Engine(
        strategy="pipeline",
        pp_size=pp,
        pp_zero_stage=spec["zero_stage"],
        pp_schedule=spec["schedule"],
        pp_microbatches=spec["microbatches"],
        seed=spec["seed"],
    )
    model = build_model(spec)
    stage_idx, rows = engine.topology.pp_stage, _replica_rows(spec, engine.topology.dp_rank)
    idx = stage_blocks(spec, stage_idx, pp)
    expected = sorted(f"{i}.{n}" for i in idx for n, _ in model[i].named_parameters())
    opt = make_adamw(model.parameters(), spec)
    model, opt = engine.prepare(model, opt)
    kept = list(model.parameters())
    if sorted(n for n, _ in model.named_parameters()) != expected:
        raise RuntimeError(
            f"rank {rank}: phalanx kept {[n for n, _ in model.named_parameters()]}, not blocks {list(idx)}"
        )

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, float]]:
        loss = engine.train_step((x[rows], y[rows]), _mse)
        return float(loss), phalanx_timing(engine)

    out = _train(spec, rank, step, kept)
    out["optimizer_state_bytes"] = _state_bytes(opt.optimizer)
    out["describe"] = engine.strategy.describe()
    return out


def run_deepspeed(spec: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's PipelineModule (uniform partition) and PipelineEngine.train_batch, ZeRO stage 0 or 1, fp32,
    a torch AdamW with zero_allow_untested_optimizer, no gradient clipping."""
    deepspeed = init_deepspeed()
    from deepspeed.pipe import PipelineModule

    rank, size = world()
    pp, m = size // spec["dp"], spec["microbatches"]
    model = build_model(spec)
    net = PipelineModule(layers=list(model), num_stages=pp, loss_fn=F.mse_loss, partition_method="uniform")
    del model
    opt = make_adamw([p for p in net.parameters() if p.requires_grad], spec)
    per_replica = spec["global_batch"] // spec["dp"]
    config = deepspeed_config(spec["global_batch"], per_replica // m, m, spec["zero_stage"])
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    dp_rank = engine.grid.get_data_parallel_rank()
    rows = _replica_rows(spec, dp_rank)

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, float]]:
        xs, ys = x[rows].chunk(m), y[rows].chunk(m)
        loss = engine.train_batch(data_iter=iter(list(zip(xs, ys))))
        return float(loss), {"schedule_s": float("nan"), "wait_s": float("nan")}

    params = [p for p in net.parameters()]
    out = _train(spec, rank, step, params)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    out["optimizer_state_bytes"] = _state_bytes(inner)
    out["describe"] = {
        "zero_stage": engine.zero_optimization_stage(),
        "deepspeed": deepspeed.__version__,
        "stage": engine.grid.get_pipe_parallel_rank(),
        "dp_rank": dp_rank,
    }
    dist.barrier()
    return out


RUNNERS = {"phalanx": run_phalanx, "deepspeed": run_deepspeed}


def run(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The one entry point phalanx.spawn calls."""
    return RUNNERS[kind](spec)
