"""Worker functions for bench_zero.py: one training run of one sharded-training configuration, in a process
started by phalanx.spawn (2 ranks, gloo, 1 thread each).

The workloads, batches, losses and optimizers are those of ddp_workers.py (same model from the same seed, step ``s``
gets the same global batch everywhere, rank ``r`` takes its half), plus ``gpt20m``, a 22.3M-parameter TinyGPT.
Every run returns its per-step times and losses, its memory figures (``ru_maxrss`` and ``VmHWM``, after setup and at
the end) and, for phalanx, ``engine.memory_report()``.

Every function here is module-level so that the spawn start method can import it by name.
"""

from __future__ import annotations

import os
import resource
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import ddp_workers
from ddp_workers import _world, loss_of, make_batch

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


def _adamw_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    impl = spec.get("adamw", "default")
    return {"foreach": True} if impl == "foreach" else {"fused": True} if impl == "fused" else {}


def make_optimizer(params: Any, spec: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.01, **_adamw_kwargs(spec))


# ------------------------------------------------------------------------------------------ memory


def _status_kib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def memory_now() -> dict[str, float | None]:
    """MiB: ru_maxrss (the spec's figure), VmHWM (peak RSS of this process image only) and VmRSS (now).

    ru_maxrss of a process started by exec after vfork also counts the parent's resident set at that moment (Linux
    carries the old mm's high-water mark into the new image), so it is never below the benchmark driver's own RSS;
    VmHWM is this interpreter's own peak.
    """
    hwm, rss = _status_kib("VmHWM"), _status_kib("VmRSS")
    return {
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "vm_hwm_mib": hwm / 1024.0 if hwm is not None else None,
        "vm_rss_mib": rss / 1024.0 if rss is not None else None,
    }


# ------------------------------------------------------------------------------------------ the loop


def _train(
    workload: str,
    spec: dict[str, Any],
    rank: int,
    nranks: int,
    step_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    checksum_fn: Callable[[], float | None],
) -> dict[str, Any]:
    total = spec["warmup"] + spec["steps"]
    times, losses = [], []
    mem_setup = memory_now()
    cpu0, faults0 = 0.0, 0
    for s in range(total):
        if s == spec["warmup"]:
            cpu0 = time.process_time()
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x, y = make_batch(workload, spec, s, rank, nranks)
        t0 = time.perf_counter()
        loss = step_fn(x, y)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        losses.append(float(loss))
    cpu_total = time.process_time() - cpu0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    mem_end = memory_now()  # before the checksum, which may gather a sharded model
    try:
        checksum = checksum_fn()
    except Exception as e:  # noqa: BLE001 - reported, not fatal: the checksum is informative only
        checksum = None
        print(f"[rank {rank}] parameter checksum failed: {type(e).__name__}: {e}", flush=True)
    return {
        "rank": rank,
        "times": times[spec["warmup"] :],
        "losses": losses,
        "peak_rss_mib": mem_end["ru_maxrss_mib"],
        "peak_hwm_mib": mem_end["vm_hwm_mib"],
        "rss_end_mib": mem_end["vm_rss_mib"],
        "setup_peak_hwm_mib": mem_setup["vm_hwm_mib"],
        "setup_rss_mib": mem_setup["vm_rss_mib"],
        "cpu_per_step": cpu_total / max(1, spec["steps"]),
        "minor_faults_per_step": faults / max(1, spec["steps"]),
        "param_checksum": checksum,
        "threads": torch.get_num_threads(),
    }


def _init_gloo() -> tuple[int, int]:
    rank, world = _world()
    dist.init_process_group("gloo", init_method=os.environ["PHALANX_INIT_METHOD"], rank=rank, world_size=world)
    return rank, world


def _sum_params(named: list[tuple[str, torch.Tensor]]) -> float:
    return float(sum(t.detach().double().sum() for _, t in named))


# ------------------------------------------------------------------------------------------ configurations


def run_torch_ddp(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """torch DistributedDataParallel with its defaults (the reference for every ratio)."""
    return _run_under_torch_ddp(workload, spec, lambda params: make_optimizer(params, spec))


def run_torch_zero_redundancy(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW): optimizer state sharded (ZeRO-1)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return _run_under_torch_ddp(
        workload,
        spec,
        lambda params: ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, lr=spec["lr"], weight_decay=0.01, **_adamw_kwargs(spec)
        ),
    )


def _run_under_torch_ddp(workload: str, spec: dict[str, Any], make_opt: Any) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = _init_gloo()
    model = build_model(workload, spec["seed"])
    ddp = DDP(model)
    opt = make_opt(ddp.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(workload, ddp, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    out = _train(workload, spec, rank, world, step, lambda: _sum_params(list(model.named_parameters())))
    dist.barrier()
    return out


def run_fsdp2(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """torch FSDP2, per block: fully_shard each Linear (mlp) / each transformer block (gpt), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = _init_gloo()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(workload, spec["seed"])
    blocks = block_modules(model)
    for m in blocks:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(model.parameters(), spec)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(workload, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def checksum() -> float:
        return _sum_params([(n, p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in model.named_parameters()])

    out = _train(workload, spec, rank, world, step, checksum)
    out["describe"] = {"fully_shard_units": len(blocks), "root": True}
    dist.barrier()
    return out


def run_phalanx(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """phalanx.Engine(strategy=ddp|zero1|zero2|zero3): prepare(model, opt); backward(loss); opt.step(); opt.zero_grad()."""
    import phalanx

    rank, world = _world()
    kwargs: dict[str, Any] = {"strategy": spec["strategy"]}
    kwargs.update(spec.get("engine_kwargs", {}))
    engine = phalanx.Engine(**kwargs)
    model = build_model(workload, spec["seed"])  # after Engine(), which reseeds
    opt = make_optimizer(model.parameters(), spec)
    names = [n for n, _ in model.named_parameters()]
    model, opt = engine.prepare(model, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(workload, model, x, y)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def checksum() -> float:
        sd = engine.get_state_dict(model)  # full, unsharded, on every rank (a collective under zero3)
        return _sum_params([(n, sd[n]) for n in names])

    out = _train(workload, spec, rank, world, step, checksum)
    out["describe"] = engine.strategy.describe()
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
    rank, world = _world()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               init_method=os.environ["PHALANX_INIT_METHOD"], rank=rank, world_size=world)
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
    rank, world = _world()
    model = build_model(workload, spec["seed"])
    opt = make_optimizer(model.parameters(), spec)
    cfg = deepspeed_config(spec["global_batch"], spec["local_batch"], 1, spec["ds_stage"])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(workload, engine, x, y)
        engine.backward(loss)
        engine.step()  # optimizer step + zero_grad
        return loss.detach()

    def checksum() -> float:
        params = list(engine.module.named_parameters())
        if spec["ds_stage"] == 3:
            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                return _sum_params(params)
        return _sum_params(params)

    out = _train(workload, spec, rank, world, step, checksum)
    out["describe"] = {"zero_stage": engine.zero_optimization_stage(), "deepspeed": deepspeed.__version__,
                       "accelerator": type(deepspeed.get_accelerator()).__name__,
                       "optimizer": type(engine.optimizer).__name__}
    dist.barrier()
    return out


RUNNERS = {
    "torch_ddp": run_torch_ddp,
    "torch_zero": run_torch_zero_redundancy,
    "fsdp2": run_fsdp2,
    "phalanx": run_phalanx,
    "deepspeed": run_deepspeed,
}


def run(kind: str, workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The one entry point phalanx.spawn calls."""
    # FSDP2 and DeepSpeed call the collectives torch 2.13 renamed; one warning per call would flood the output.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    out = RUNNERS[kind](workload, spec)
    out["n_params"] = _LAST_NPARAMS
    return out
