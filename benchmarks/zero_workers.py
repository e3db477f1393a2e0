"""Worker functions for bench_zero.py: one training run of one sharded-training configuration, in a process
started by phalanx.spawn (2 ranks, gloo, 1 thread each).

The workloads, batches, losses and optimizers are those of ddp_workers.py (same model from the same seed, step ``s``
gets the same global batch everywhere, rank ``r`` takes its half), plus ``gpt20m``, a 22.3M-parameter TinyGPT.
The loop is harness.train_loop: every run returns its per-step times and losses, its memory figures (``ru_maxrss``
and ``VmHWM``, after setup and at the end) and, for phalanx, ``engine.memory_report()``.

Every function here is module-level so that the spawn start method can import it by name.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import ddp_workers
import torch
import torch.distributed as dist
from ddp_workers import _train, loss_of
from harness import adamw_kwargs, init_gloo, init_method, make_adamw, param_sum, world
from torch import nn

# ------------------------------------------------------------------------------------------ workloads

GPT20M = {"n_embd": 512, "n_layer": 7, "n_head": 8, "block_size": 128}  # 22,264,320 parameters (tied head)


_LAST_NPARAMS: int | None = None  # parameters of the last model built here (reported with every run)


def build_model(workload: str, seed: int) -> nn.Module:
    global _LAST_NPARAMS
    if workload == "gpt20m":
        from phalanx.demo import GPTConfig, TinyGPT

        torch.manual_seed(seed)
        model: nn.Module = TinyGPT(GPTConfig(**GPT20M))
    else:
        model = ddp_workers.build_model(workload, seed)
    _LAST_NPARAMS = sum(p.numel() for p in model.parameters())
    return model


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one ("per block"): each Linear of the MLP, each transformer block of a GPT."""
    if hasattr(model, "blocks"):
        return list(model.blocks)  # type: ignore[arg-type]
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


# ------------------------------------------------------------------------------------------ configurations


def run_torch_ddp(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """torch DistributedDataParallel with its defaults (the reference for every ratio)."""
    return _run_under_torch_ddp(workload, spec, lambda params: make_adamw(params, spec))


def run_torch_zero_redundancy(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW): optimizer state sharded (ZeRO-1)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return _run_under_torch_ddp(
        workload,
        spec,
        lambda params: ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, lr=spec["lr"], weight_decay=0.01, **adamw_kwargs(spec)
        ),
    )


def _run_under_torch_ddp(workload: str, spec: dict[str, Any], make_opt: Any) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, size = init_gloo()
    model = build_model(workload, spec["seed"])
    ddp = DDP(model)
    opt = make_opt(ddp.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(workload, ddp, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    out = _train(workload, spec, rank, size, step, lambda: param_sum(model.parameters()))
    dist.barrier()
    return out


def run_fsdp2(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """torch FSDP2, per block: fully_shard each Linear (mlp) / each transformer block (gpt), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, size = init_gloo()
    mesh = init_device_mesh("cpu", (size,))
    model = build_model(workload, spec["seed"])
    blocks = block_modules(model)
    for m in blocks:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_adamw(model.parameters(), spec)
    run_model = _compiled(model, spec)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(workload, run_model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def checksum() -> float:
        return param_sum(p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters())

    out = _train(workload, spec, rank, size, step, checksum)
    out["describe"] = {"fully_shard_units": len(blocks), "root": True, "compile": spec.get("compile")}
    dist.barrier()
    return out


def _compiled(model: nn.Module, spec: dict[str, Any]) -> nn.Module:
    """``torch.compile(model, backend=spec["compile"])`` when the configuration compiles (bench_zero --compile)."""
    if not spec.get("compile"):
        return model
    return torch.compile(model, backend=spec["compile"])  # type: ignore[return-value]


def run_phalanx(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """phalanx.Engine(strategy=ddp|zero1|zero2|zero3): prepare(model, opt); backward(loss); opt.step();
    opt.zero_grad()."""
    import phalanx

    rank, size = world()
    kwargs: dict[str, Any] = {"strategy": spec["strategy"]}
    kwargs.update(spec.get("engine_kwargs", {}))
    engine = phalanx.Engine(**kwargs)
    model = build_model(workload, spec["seed"])  # after Engine(), which reseeds
    opt = make_adamw(model.parameters(), spec)
    names = [n for n, _ in model.named_parameters()]
    model, opt = engine.prepare(model, opt)
    model = _compiled(model, spec)  # get_state_dict takes the compiled model too

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(workload, model, x, y)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def checksum() -> float:
        sd = engine.get_state_dict(model)  # full, unsharded, on every rank (a collective under zero3)
        return param_sum(sd[n] for n in names)

    out = _train(workload, spec, rank, size, step, checksum)
    out["describe"] = {**engine.strategy.describe(), "compile": spec.get("compile")}
    try:
        out["memory_report"] = engine.memory_report()
    except Exception as e:  # noqa: BLE001
        out["memory_report"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def init_deepspeed() -> Any:
    """Import DeepSpeed on its CPU accelerator, quiet, with its process group on gloo at phalanx.spawn's rendezvous
    (no MPI discovery: there is no MPI, and no launcher's env://). Returns the module."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    rank, size = world()
    deepspeed.init_distributed(
        dist_backend="gloo",
        auto_mpi_discovery=False,
        verbose=False,
        init_method=init_method(),
        rank=rank,
        world_size=size,
    )
    return deepspeed


def deepspeed_config(global_batch: int, micro_batch: int, accumulation: int, stage: int) -> dict[str, Any]:
    """fp32, ZeRO ``stage``, a torch optimizer allowed, no clipping, no logging."""
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        # DeepSpeed 0.19's default is 1.0 (clip to global norm 1), which no other configuration does.
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def run_deepspeed(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed ZeRO stage 1/2/3, fp32, CPU accelerator, gloo, with a torch AdamW (zero_allow_untested_optimizer)."""
    deepspeed = init_deepspeed()
    rank, size = world()
    model = build_model(workload, spec["seed"])
    opt = make_adamw(model.parameters(), spec)
    cfg = deepspeed_config(spec["global_batch"], spec["local_batch"], 1, spec["ds_stage"])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(workload, engine, x, y)
        engine.backward(loss)
        engine.step()  # optimizer step + zero_grad
        return loss.detach()

    def checksum() -> float:
        params = list(engine.module.parameters())
        if spec["ds_stage"] == 3:
            with deepspeed.zero.GatheredParameters(params):
                return param_sum(params)
        return param_sum(params)

    out = _train(workload, spec, rank, size, step, checksum)
    out["describe"] = {
        "zero_stage": engine.zero_optimization_stage(),
        "deepspeed": deepspeed.__version__,
        "accelerator": type(deepspeed.get_accelerator()).__name__,
        "optimizer": type(engine.optimizer).__name__,
    }
    dist.barrier()
    return out


def run_local(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The compute floor (bench_zero --floor): each rank trains its own copy on its share of the batch with plain torch,
    no process group and no communication, at the same time as the other ranks (they share the cores as in every
    row). Forward + backward and the AdamW step are timed apart, so that a sharded strategy's floor, whose optimizer
    steps 1/world of the parameters, can be read off too. Its losses leave ddp's after the first step."""
    import time

    rank, size = world()
    model = build_model(workload, spec["seed"])
    opt = make_adamw(model.parameters(), spec)

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        t0 = time.perf_counter()
        loss = loss_of(workload, model, x, y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return loss.detach(), {"fwd_bwd_s": t1 - t0, "optimizer_s": time.perf_counter() - t1}

    return _train(workload, spec, rank, size, step, lambda: param_sum(model.parameters()))


RUNNERS = {
    "torch_ddp": run_torch_ddp,
    "torch_zero": run_torch_zero_redundancy,
    "fsdp2": run_fsdp2,
    "phalanx": run_phalanx,
    "deepspeed": run_deepspeed,
    "local": run_local,
}


def run(kind: str, workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The one entry point phalanx.spawn calls."""
    # FSDP2 and DeepSpeed call the collectives torch 2.13 renamed; one warning per call would flood the output.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    out = RUNNERS[kind](workload, spec)
    out["n_params"] = _LAST_NPARAMS
    return out
