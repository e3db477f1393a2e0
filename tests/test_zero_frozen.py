"""A mostly frozen model (LoRA adapters on a frozen base) under zero1/2/3: the frozen weights get no fp32 master,
gradient buffer or optimizer state, zero3 shards them like the rest, and training (SGD with momentum) equals one
process within 1e-6.

The model is 95% frozen: each layer is a frozen Linear(512) with a rank-8 adapter (A: 8 x 512, B: 512 x 8).
memory_report's held bytes are checked against the same model fully trainable in the same run: the trainable
kinds (params, grads, optimizer state) scale with the trainable elements only, and the frozen ones appear once,
under ``frozen_params``, whole under zero1/2 and sharded under zero3."""

from __future__ import annotations

import torch
from torch import nn

import phalanx

WIDTH, LAYERS, RANK, STEPS = 512, 6, 8, 3


class LoRALinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.a = nn.Parameter(torch.randn(RANK, WIDTH) * 0.02)
        self.b = nn.Parameter(torch.randn(WIDTH, RANK) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class Net(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([LoRALinear() for _ in range(LAYERS)])
        if frozen:
            for layer in self.layers:
                layer.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _batches(rank: int, world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    whole = [torch.randn(4 * world, WIDTH, generator=g) for _ in range(STEPS)]
    return [b[rank * 4 : (rank + 1) * 4] for b in whole]


def _train(engine: phalanx.Engine | None, frozen: bool, rank: int, world: int) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(0)
    model = Net(frozen)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    if engine is not None:
        model, optimizer = engine.prepare(model, optimizer)
    losses = []
    if engine is not None:
        batches = _batches(rank, world)
    else:  # one process: every rank's micro-batch at once
        per_rank = [_batches(r, world) for r in range(world)]
        batches = [torch.cat([b[i] for b in per_rank]) for i in range(STEPS)]
    for x in batches:
        loss = model(x).square().mean()
        (engine.backward(loss) if engine is not None else loss.backward())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return model, losses


def _ranks() -> dict[str, dict]:
    out = {}
    for strategy in ("zero1", "zero2", "zero3"):
        for frozen in (True, False):
            engine = phalanx.Engine(strategy=strategy, seed=0)
            model, losses = _train(engine, frozen, engine.rank, engine.world_size)
            report = engine.memory_report()
            out[f"{strategy}-{'lora' if frozen else 'full'}"] = {
                "losses": torch.stack([engine.reduce(x, "mean") for x in losses]).tolist(),
                "state": engine.get_state_dict(model),
                "held": report["held"],
                "predicted": report["predicted"],
                "trainable": report["trainable_params"],
            }
    return out


def test_frozen_weights_cost_no_master_gradient_or_state_and_train_as_one_process(run_ranks):
    world = 2
    results = run_ranks(_ranks, world)
    reference = {}
    for frozen in (True, False):
        model, losses = _train(None, frozen, 0, world)
        reference[frozen] = (model.state_dict(), [x.item() for x in losses])
    frozen_numel = LAYERS * (WIDTH * WIDTH + WIDTH)
    adapters = LAYERS * 2 * RANK * WIDTH
    for rank, res in enumerate(results):
        for key, r in res.items():
            strategy, kind = key.split("-")
            where = f"{key}, rank {rank}"
            state, losses = reference[kind == "lora"]
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), atol=1e-6, rtol=0, msg=where)
            for k, v in state.items():
                assert (r["state"][k] - v).abs().max() <= 1e-6, f"{where}: {k} {(r['state'][k] - v).abs().max()}"
            assert r["trainable"] == (adapters if kind == "lora" else adapters + frozen_numel), where
            for what in ("params", "grads", "optimizer_state", "frozen_params"):
                assert r["held"][what] == r["predicted"][what], f"{where}: {what} {r['held'][what]} held"
        for strategy in ("zero1", "zero2", "zero3"):
            lora, full = res[f"{strategy}-lora"], res[f"{strategy}-full"]
            share = adapters / (adapters + frozen_numel)
            for what in ("grads", "optimizer_state"):  # only the adapters' (within each rank's padding)
                assert lora["held"][what] <= 1.01 * share * full["held"][what] + 64, (strategy, what)
            whole = 1 if strategy != "zero3" else world
            assert lora["held"]["frozen_params"] == frozen_numel * 4 // whole, strategy
