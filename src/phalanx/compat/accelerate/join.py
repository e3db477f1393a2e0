"""Accelerate's ``join_uneven_inputs`` on phalanx's ddp: the ranks whose loaders ran out first stand in for the
collectives of the ranks still training, as torch's ``Join`` makes the finished ranks of a DDP model do.

Every step below is one c10d call on the data-parallel group, made by every rank:
- a rank still training announces each forward of a joined model with one all-reduce of
  ``[1, then for each model: buffers, reduces]`` (it will broadcast the model's buffers before that forward, and
  all-reduce its gradient buckets in the backward after it);
- a finished rank all-reduces zeros in its place, then takes part in what was announced: the buffers' broadcast,
  and one all-reduce of zeros per gradient bucket. The others divide by the whole group as always, so a step with
  a rank finished averages in a zero for it: torch DDP's default under ``Join`` (``divide_by_initial_world_size``),
  which is what Accelerate runs;
- when that all-reduce counts no rank still training, every rank has finished, and every replica takes the weights
  and buffers of the last rank to finish (the highest such rank), as torch's ``Join`` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.engine.engine import Engine
from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import broadcast_coalesced
from phalanx.strategies._replicas import group_rank0
from phalanx.strategies.ddp import DDPStrategy, GradReducer

__all__ = ["UnevenInputsJoin"]


class UnevenInputsJoin:
    """The join of ``models`` (prepared under ddp) on ``engine``'s data-parallel group, for one ``with`` block."""

    def __init__(self, engine: Engine, models: list[nn.Module]) -> None:
        assert isinstance(engine.strategy, DDPStrategy)
        self.group = engine.topology.dp_group
        self.stats = engine.strategy.stats
        self.models = models
        self.index = {id(m): i for i, m in enumerate(models)}
        reducers = [engine.strategy.reducer_of(m) for m in models]
        assert all(r is not None for r in reducers), "every joined model was prepared under ddp"
        self.reducers: list[GradReducer] = reducers  # type: ignore[assignment]
        self.broadcast_buffers = engine.strategy.opts.broadcast_buffers
        self.device = engine.device  # the flags are all-reduced: on NCCL they must be on the GPU

    def _flags(self) -> torch.Tensor:
        return torch.zeros(1 + 2 * len(self.models), dtype=torch.int64, device=self.device)

    def notify(self, model: nn.Module) -> None:
        """Before a forward of ``model`` on a rank still training (a forward pre-hook, ahead of the buffers')."""
        i = self.index.get(id(model))
        if i is None:
            return
        values = [0] * (1 + 2 * len(self.models))
        values[0] = 1
        if torch.is_grad_enabled():
            buffers = self.broadcast_buffers and model.training and any(True for _ in model.buffers())
            values[1 + 2 * i] = int(buffers)
            values[2 + 2 * i] = int(self.reducers[i].require_sync)
        flags = torch.tensor(values, dtype=torch.int64, device=self.device)  # one copy to the device, not one a flag
        watched(dist.all_reduce, flags, group=self.group, label="join: still training")

    def finish(self) -> None:
        """This rank's loop has ended: stand in for the others until every rank has, then take the replica of the
        last one to finish."""
        last = True
        while True:
            flags = self._flags()
            watched(dist.all_reduce, flags, group=self.group, label="join: still training")
            values = flags.tolist()
            if values[0] == 0:
                break
            last = False
            for i, model in enumerate(self.models):
                if values[1 + 2 * i]:
                    broadcast_coalesced(list(model.buffers()), src=group_rank0(self.group), group=self.group)
                if values[2 + 2 * i]:
                    self.reducers[i].shadow_reduce()
        # The last to finish trained on every step; ties go to the highest rank, as in torch's Join.
        candidate = torch.tensor([dist.get_rank() if last else -1], dtype=torch.int64, device=self.device)
        watched(dist.all_reduce, candidate, op=dist.ReduceOp.MAX, group=self.group, label="join: last to finish")
        src = int(candidate)
        for model in self.models:
            tensors = [p.data for p in model.parameters()] + list(model.buffers())
            broadcast_coalesced(tensors, src=src, group=self.group, stats=self.stats)


def joined_models(joinables: Any, models: list[nn.Module], optimizers: list[Any]) -> list[nn.Module]:
    """The prepared models among ``joinables``; prepared optimizers need no stand-in under ddp. Anything else is
    refused, naming it."""
    out = []
    for obj in joinables:
        if any(obj is m for m in models):
            out.append(obj)
        elif not any(obj is o or obj is getattr(o, "optimizer", None) for o in optimizers):
            raise TypeError(
                f"join_uneven_inputs takes the models (and optimizers) that accelerator.prepare returned; got a "
                f"{type(obj).__name__} that it did not prepare (prepare it first, or leave it out)"
            )
    return out
