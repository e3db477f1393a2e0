"""Worker of bench_scaling.py: one training run of one (strategy, world size, model size), in a process started by
phalanx.spawn (gloo, 1 thread per rank).

The model is ``phalanx.demo.TinyGPT`` at the size the driver names (``spec["gpt"]``: n_embd, n_layer, n_head,
block_size), built from ``spec["seed"]`` in every configuration; step ``s`` feeds every configuration the same global
batch of random byte sequences, and rank ``r`` takes its ``spec["local_batch"]`` rows of it, so every strategy of a
(world size, model size) cell trains the same model on the same data. The optimizer is harness.make_adamw, the loop
harness.train_loop, the loss ddp_workers.loss_of; DeepSpeed's set-up is zero_workers'.

Memory: the peak resident set (VmHWM) is read once the model is built and wrapped, and then reset
(``/proc/self/clear_refs``), so that train_loop's end-of-run VmHWM is the peak of the training steps alone, apart from
the build (every configuration here builds the whole model on every rank before it shards it).

Every function here is module-level so that the spawn start method can import it by name.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from ddp_workers import loss_of
from harness import init_gloo, make_adamw, memory_now, train_loop, world
from torch import nn
from zero_workers import block_modules, deepspeed_config, init_deepspeed

_LOSS = "gpt"  # ddp_workers.loss_of: next-token cross entropy over the logits


def build_model(spec: dict[str, Any]) -> nn.Module:
    from phalanx.demo import GPTConfig, TinyGPT

    torch.manual_seed(spec["seed"])
    return TinyGPT(GPTConfig(**spec["gpt"]))


def make_batch(spec: dict[str, Any], step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch of random byte sequences (the same in every configuration)."""
    g = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + step)
    seqs = torch.randint(0, 256, (spec["global_batch"], spec["gpt"]["block_size"] + 1), generator=g)
    lb = spec["local_batch"]
    mine = seqs[rank * lb : (rank + 1) * lb]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


@dataclass
class _Wrapped:
    """A configuration once set up: what the forward calls, how a loss is backpropagated and the optimizer stepped
    (and its gradients zeroed), and what the run reports of itself afterwards."""

    model: nn.Module
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    report: Callable[[], dict[str, Any]] = field(default=dict)


def _step_and_zero(opt: torch.optim.Optimizer) -> Callable[[], None]:
    def step() -> None:
        opt.step()
        opt.zero_grad()

    return step


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


# ------------------------------------------------------------------------------------------ configurations


def setup_phalanx(spec: dict[str, Any]) -> _Wrapped:
    """phalanx.Engine(strategy=ddp|zero1|zero2|zero3) with its defaults: prepare(model, opt), backward(loss)."""
    import phalanx

    engine = phalanx.Engine(strategy=spec["strategy"])
    model = build_model(spec)  # after Engine(), which reseeds
    model, opt = engine.prepare(model, make_adamw(model.parameters(), spec))

    def report() -> dict[str, Any]:
        return {"describe": engine.strategy.describe(), "memory_report": engine.memory_report()}

    return _Wrapped(model, engine.backward, _step_and_zero(opt), report)


def setup_fsdp2(spec: dict[str, Any]) -> _Wrapped:
    """torch FSDP2 per block: fully_shard each transformer block, then the root (as bench_zero's FSDP2 row)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, size = init_gloo()
    mesh = init_device_mesh("cpu", (size,))
    model = build_model(spec)
    blocks = block_modules(model)
    for m in blocks:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_adamw(model.parameters(), spec)
    return _Wrapped(model, _backward, _step_and_zero(opt), lambda: {"describe": {"fully_shard_units": len(blocks) + 1}})


def setup_torch_ddp(spec: dict[str, Any]) -> _Wrapped:
    """torch DistributedDataParallel with its defaults."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_gloo()
    ddp = DDP(build_model(spec))
    return _Wrapped(ddp, _backward, _step_and_zero(make_adamw(ddp.parameters(), spec)))


def setup_deepspeed(spec: dict[str, Any]) -> _Wrapped:
    """DeepSpeed ZeRO stage ``spec["ds_stage"]``, fp32 on its CPU accelerator over gloo, torch AdamW (zero_workers)."""
    deepspeed = init_deepspeed()
    model = build_model(spec)
    cfg = deepspeed_config(spec["global_batch"], spec["local_batch"], 1, spec["ds_stage"])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_adamw(model.parameters(), spec), config=cfg)
    describe = {"zero_stage": engine.zero_optimization_stage(), "deepspeed": deepspeed.__version__}
    return _Wrapped(engine, engine.backward, engine.step, lambda: {"describe": describe})  # step zeroes the grads


SETUPS: dict[str, Callable[[dict[str, Any]], _Wrapped]] = {
    "phalanx": setup_phalanx,
    "fsdp2": setup_fsdp2,
    "torch_ddp": setup_torch_ddp,
    "deepspeed": setup_deepspeed,
}


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current resident set (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The one entry point phalanx.spawn calls: set ``kind`` up, train ``spec["warmup"]`` + ``spec["steps"]`` steps."""
    # FSDP2 and DeepSpeed call the collectives torch 2.13 renamed; one warning per call would flood the output.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    # zero1/2/3 on one rank say that they shard nothing: the world-1 cells are there to show just that.
    warnings.filterwarnings("ignore", message=r"strategy 'zero\d' on one data-parallel rank shards nothing")
    rank, _ = world()
    base = memory_now()  # the interpreter, torch and phalanx imported; nothing built yet
    wrapped = SETUPS[kind](spec)
    built = memory_now()
    reset = _reset_peak_rss()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(_LOSS, wrapped.model, x, y)
        wrapped.backward(loss)
        wrapped.step()
        return loss.detach()

    # No parameter checksum: gathering a sharded 200M model on every rank costs more than the run; the driver
    # compares the losses of the strategies instead.
    out = train_loop(spec, rank, lambda s: make_batch(spec, s, rank), step, lambda: None)
    out.update(wrapped.report())
    out.update(base_rss_mib=base["vm_rss_mib"], build_peak_hwm_mib=built["vm_hwm_mib"], hwm_reset=reset)
    if dist.is_initialized():
        dist.barrier()
    return out
