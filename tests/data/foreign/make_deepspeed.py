"""Writes the DeepSpeed ZeRO-1/2/3 checkpoints in this folder, and each one's anchor: DeepSpeed resuming its own
checkpoint and taking 3 steps (losses and final parameters), which tests/test_foreign_checkpoints.py compares phalanx
against. DeepSpeed is not a phalanx dependency; run this with a venv that has it (docs/foreign-checkpoints.md):

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0 numpy einops hjson msgpack ninja safetensors
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu /tmp/dsvenv/bin/pip install --no-build-isolation deepspeed==0.19.8
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/foreign/make_deepspeed.py

Each stage runs on 2 gloo ranks on the CPU in fp32 with torch's AdamW: 2 steps, save, then a fresh engine loads that
checkpoint and takes 3 more steps. The model, the data and the optimizer's settings are defined here and imported by
the test, so both sides train the same thing. Nothing here imports DeepSpeed until ``main`` runs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
GLOBAL_BATCH = 8
LR, WEIGHT_DECAY, BETAS, EPS = 1e-2, 0.1, (0.9, 0.99), 1e-8
SAVED_AT = 2  # optimizer steps before the checkpoint
RESUMED = 3  # steps the anchor takes after resuming


class TinyNet(nn.Module):
    """6 -> 10 -> 3, with a persistent buffer used in forward: 103 parameters, so the checkpoints stay a few KB."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)) * self.scale)


def tiny_model() -> TinyNet:
    torch.manual_seed(7)
    return TinyNet()


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows of global batch ``step`` (the same rows whatever the world size, split in order)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def loss_fn(model: nn.Module, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    x, y = batch(step, rank, world)
    return F.mse_loss(model(x), y)


def adamw(params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


# ------------------------------------------------------------------------------------ DeepSpeed (main only)
def _config(stage: int) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _engine(stage: int):  # type: ignore[no-untyped-def]
    import deepspeed

    model = tiny_model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=_config(stage))
    return engine


def _step(engine, step: int) -> float:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    loss = loss_fn(engine, step, dist.get_rank(), dist.get_world_size())
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def _full_params(engine, stage: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        return {n: p.detach().clone().contiguous() for n, p in engine.module.named_parameters()}


def _run(stage: int, out: Path) -> None:
    import deepspeed
    import torch.distributed as dist
    from safetensors.torch import save_file

    rank = dist.get_rank()
    engine = _engine(stage)
    for step in range(SAVED_AT):
        _step(engine, step)
    saved = _full_params(engine, stage)
    engine.save_checkpoint(str(out), tag=f"global_step{SAVED_AT}")
    dist.barrier()
    if rank == 0:  # DeepSpeed copies its conversion scripts beside every checkpoint: not test data
        for script in out.glob("zero_to_*.py"):
            script.unlink()
    del engine
    resumed = _engine(stage)
    resumed.load_checkpoint(str(out))
    losses = [_step(resumed, step) for step in range(SAVED_AT, SAVED_AT + RESUMED)]
    params = _full_params(resumed, stage)
    if rank == 0:
        anchor = out.parent / f"{out.name}.anchor"
        anchor.mkdir(exist_ok=True)
        save_file(params, str(anchor / "params.safetensors"))
        save_file(saved, str(anchor / "saved_params.safetensors"))  # the weights at the checkpoint itself
        (anchor / "anchor.json").write_text(
            json.dumps(
                {
                    "deepspeed_version": deepspeed.__version__,
                    "torch_version": torch.__version__,
                    "zero_stage": stage,
                    "world_size": dist.get_world_size(),
                    "saved_at_step": SAVED_AT,
                    "losses": losses,
                },
                indent=1,
            )
            + "\n"
        )
    dist.barrier()


def main() -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    for stage in (1, 2, 3):
        out = HERE / f"deepspeed_zero{stage}"
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(HERE / f"{out.name}.anchor", ignore_errors=True)
        dist.barrier()
        _run(stage, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:  # relaunch itself on 2 ranks
        import subprocess

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", "29561", __file__]  # fmt: skip
        raise SystemExit(subprocess.call(cmd, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}))
    main()
