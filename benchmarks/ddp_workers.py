"""Worker functions for bench_ddp.py: one training run of one configuration, in a process started by phalanx.spawn.

Every function here is module-level so that the spawn start method can import it by name. Each run:
- builds the same model from the same seed (``torch.manual_seed(seed)`` right before construction),
- feeds step ``s`` the same global batch in every configuration (generated from ``seed + s``; rank ``r`` of
  ``n`` takes rows ``r*B/n .. (r+1)*B/n``), so the 2-rank runs compute the same averaged gradient as the
  one-process run on the full batch,
- times forward + backward + optimizer.step + zero_grad of each step in harness.train_loop (the loop every benchmark
  shares), which returns the per-step times, per-step local losses, peak RSS (``ru_maxrss``), CPU time and faults.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import env_rendezvous, init_gloo, make_adamw, param_sum, train_loop, world
from torch import nn

# ------------------------------------------------------------------------------------------ workloads


def build_model(workload: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if workload == "mlp":
        layers: list[nn.Module] = []
        for i in range(8):
            layers.append(nn.Linear(1024, 1024))
            if i < 7:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)
    if workload == "gpt":
        from phalanx.demo import GPTConfig, TinyGPT

        return TinyGPT(GPTConfig())
    raise ValueError(f"unknown workload {workload!r}")


_STDLIB: torch.Tensor | None = None


def make_batch(
    workload: str, spec: dict[str, Any], step: int, rank: int, nranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step`` (the same global batch in every configuration)."""
    global _STDLIB
    gb = spec["global_batch"]
    g = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + step)
    if workload == "mlp":
        x = torch.randn(gb, 1024, generator=g)
        y = torch.randn(gb, 1024, generator=g)
    else:
        block = 128
        if spec.get("gpt_data", "stdlib") == "stdlib":
            if _STDLIB is None:
                from phalanx.demo import load_stdlib_bytes

                _STDLIB = load_stdlib_bytes(2_000_000)
            starts = torch.randint(0, len(_STDLIB) - block - 1, (gb,), generator=g)
            chunks = torch.stack([_STDLIB[s : s + block + 1] for s in starts.tolist()]).long()
        else:
            chunks = torch.randint(0, 256, (gb, block + 1), generator=g)
        x, y = chunks[:, :-1], chunks[:, 1:]
    # The rows this rank owns. A one-process run with ``local_batch`` < global batch takes the first rows.
    lb = spec["local_batch"]
    return x[rank * lb : (rank + 1) * lb].contiguous(), y[rank * lb : (rank + 1) * lb].contiguous()


def loss_of(workload: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if workload == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make_optimizer(model: nn.Module, spec: dict[str, Any]) -> torch.optim.Optimizer:
    """The same AdamW in every configuration (harness.make_adamw)."""
    return make_adamw(model.parameters(), spec)


# ------------------------------------------------------------------------------------------ configurations


def _train(
    workload: str,
    spec: dict[str, Any],
    rank: int,
    nranks: int,
    step: Callable[..., Any],
    checksum: Callable[[], float | None],
) -> dict[str, Any]:
    """harness.train_loop on this rank's share of each global batch (bench_zero's workers use it too)."""
    return train_loop(
        spec, rank, lambda s: make_batch(workload, spec, s, rank, nranks), step, checksum, spec.get("profile")
    )


def run_single(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One process, no process group; trains on ``spec['local_batch']`` rows of each global batch."""
    model = build_model(workload, spec["seed"])
    opt = make_optimizer(model, spec)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(workload, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return _train(workload, spec, 0, 1, step, lambda: param_sum(model.parameters()))


def run_torch_ddp(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """torch.nn.parallel.DistributedDataParallel with its defaults (25 MiB buckets, 1 MiB first bucket)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, size = init_gloo()
    model = build_model(workload, spec["seed"])
    ddp = DDP(model, **spec.get("ddp_kwargs", {}))
    opt = make_optimizer(ddp, spec)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(workload, ddp, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    out = _train(workload, spec, rank, size, step, lambda: param_sum(model.parameters()))
    dist.barrier()
    return out


def run_phalanx_ddp(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """phalanx.Engine(strategy="ddp"): engine.prepare(model, opt); engine.backward(loss); opt.step();
    opt.zero_grad()."""
    import phalanx

    rank, size = world()
    kwargs: dict[str, Any] = {"strategy": "ddp"}
    if spec.get("bucket_mb") is not None:
        kwargs["bucket_mb"] = spec["bucket_mb"]
    if spec.get("on_nonfinite") is not None:
        kwargs["on_nonfinite"] = spec["on_nonfinite"]
    kwargs.update(spec.get("engine_kwargs", {}))
    engine = phalanx.Engine(**kwargs)
    model = build_model(workload, spec["seed"])  # after Engine(), which reseeds
    opt = make_optimizer(model, spec)
    model, opt = engine.prepare(model, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(workload, model, x, y)
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    out = _train(workload, spec, rank, size, step, lambda: param_sum(model.parameters()))
    out["describe"] = engine.strategy.describe()
    return out


def run_accelerate(workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """accelerate.Accelerator(cpu=True) in a real MULTI_CPU setup (env:// rendezvous on loopback)."""
    env_rendezvous(spec["master_port"])
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    rank, size = world()
    acc = Accelerator(cpu=True)
    if size > 1 and acc.distributed_type != DistributedType.MULTI_CPU:
        raise RuntimeError(f"accelerate picked {acc.distributed_type}, not MULTI_CPU: the comparison would be void")
    model = build_model(workload, spec["seed"])
    opt = make_optimizer(model, spec)
    model, opt = acc.prepare(model, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(workload, model, x, y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    out = _train(workload, spec, rank, size, step, lambda: param_sum(acc.unwrap_model(model).parameters()))
    out["distributed_type"] = str(acc.distributed_type)
    dist.barrier()
    return out


RUNNERS = {
    "single": run_single,
    "torch_ddp": run_torch_ddp,
    "phalanx_ddp": run_phalanx_ddp,
    "accelerate": run_accelerate,
}


def run(kind: str, workload: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The one entry point phalanx.spawn calls."""
    return RUNNERS[kind](workload, spec)
