"""How a pipeline stage's data-parallel replicas share its gradients: the pipeline holds one of these.

A sync object wraps a data-parallel strategy that runs over the stage's replicas only (``within_stage``), and
adds what the schedule needs: hold the reduction while micro-batches accumulate, reduce once per step, and clip
to the norm across every stage. A new data-parallel flavour for the pipeline is a new class here, not a new
pipeline.

- :class:`WholeStageSync` (``pp_zero_stage: 0``): ddp buckets; every replica steps the whole stage.
- :class:`Zero1StageSync` (``pp_zero_stage: 1``): zero1 buckets; each replica keeps and steps the optimizer
  state of its slice only, as DeepSpeed's pipeline engine allows with ZeRO stage 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.checkpoint.shards import ShardEntry, StateReader, balanced_slices, load_whole_tensors, named_tensors
from phalanx.config.strategy_options import PipelineOptions
from phalanx.runtime.collective_log import watched
from phalanx.strategies._grads import clip_to_norm_, mesh_norm, mesh_pieces
from phalanx.strategies.base import Strategy
from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.zero.bucketed import Zero1Strategy
from phalanx.strategies.zero.optimizers import check_optimizer

if TYPE_CHECKING:
    from phalanx.config.settings import EngineConfig
    from phalanx.engine.precision import Precision
    from phalanx.runtime.topology import Topology

__all__ = ["StageSync", "WholeStageSync", "Zero1StageSync", "stage_sync"]


class StageSync:
    """The data-parallel side of a pipeline stage. ``strategy`` holds the stage's gradients and optimizer."""

    strategy: Strategy

    def hold(self, on: bool) -> None:
        """Hold (True) or allow (False) the reduction in the backwards of the schedule."""
        raise NotImplementedError

    def reduce(self) -> None:
        """Reduce the stage's accumulated gradients over its replicas, once per step."""
        raise NotImplementedError

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer this sync cannot take, before the model is split (pp_partition: time)."""

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        raise NotImplementedError

    def wrap_stage(self, stage: nn.Module) -> None:
        self.strategy.wrap_model(stage)

    def sharded_state(self, model: nn.Module, optimizers: Any) -> list[ShardEntry]:
        return self.strategy.sharded_state(model, optimizers)

    def load_sharded_state(self, model: nn.Module, optimizers: Any, reader: StateReader) -> None:
        self.strategy.load_sharded_state(model, optimizers, reader)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.strategy.full_state_dict(model)


class WholeStageSync(StageSync):
    def __init__(self, config: EngineConfig, topology: Topology, device: torch.device, precision: Precision) -> None:
        self.strategy = self.ddp = DDPStrategy(config, topology, device, precision, within_stage=True)
        self.topology, self.device = topology, device

    def hold(self, on: bool) -> None:
        for r in self.ddp.reducers:
            r.require_sync = not on

    def reduce(self) -> None:
        for r in self.ddp.reducers:
            r.launch_all()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        params = [p for p in parameters if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        norm_type = float(norm_type)
        topo = self.topology
        if topo.tp_size > 1 or topo.ep_size > 1:
            # stages, tp ranks and ep ranks hold different pieces; a tp-replicated one counts once, a dense one (the
            # same on every ep rank) 1/ep times on each
            pieces, groups = mesh_pieces(params, grads, topo, stages=topo.pp_size > 1)
            total = mesh_norm(pieces, norm_type, self.device, groups).to(grads[0].dtype if grads else torch.float32)
            clip_to_norm_(grads, max_norm, total)
            return total
        if grads:
            local = torch.nn.utils.get_total_norm(grads, norm_type).to(torch.float64)
        else:
            local = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.topology.pp_size > 1:
            # Every stage holds different gradients (identical across its dp replicas after the reduction).
            if math.isinf(norm_type):
                watched(dist.all_reduce, local, op=dist.ReduceOp.MAX, group=self.topology.pp_group)
                total = local
            else:
                powered = local**norm_type
                watched(dist.all_reduce, powered, group=self.topology.pp_group)
                total = powered ** (1.0 / norm_type)
        else:
            total = local
        total = total.to(grads[0].dtype if grads else torch.float32)
        clip_to_norm_(grads, max_norm, total)
        return total


class _StageZero1(Zero1Strategy):
    """zero1 over one stage's replicas: the norm is combined over every rank, and the messages name the
    pipeline's settings."""

    whole_state_setting = "pp_zero_stage=0"

    def _no_sharding_hint(self) -> tuple[str, str]:
        pp = self.topology.pp_size
        if self.config.options(PipelineOptions).pp_size is None:
            fix = (
                f"pp_size defaults to the world size, {pp}, which leaves one replica per stage: set pp_size so that "
                "the world size is 2 or more times pp_size, or use pp_zero_stage=0"
            )
        else:
            fix = f"launch a multiple of {2 * pp} processes, or use pp_zero_stage=0"
        return f"strategy 'pipeline' with pp_zero_stage=1 and pp_size={pp}", fix

    def _all_reduce_norm(self, total: torch.Tensor, op: Any) -> None:
        # Slices differ across a stage's replicas and stages differ along the pipeline: sum over every rank.
        if self.topology.world_size > 1:
            watched(dist.all_reduce, total, op=op)


class Zero1StageSync(StageSync):
    def __init__(self, config: EngineConfig, topology: Topology, device: torch.device, precision: Precision) -> None:
        self.strategy = self.zero = _StageZero1(config, topology, device, precision, within_stage=True)
        self.topology = topology

    def hold(self, on: bool) -> None:
        self.zero.require_sync = not on

    def reduce(self) -> None:
        self.zero.reduce_window()

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        check_optimizer(optimizer, self.zero.shard_opts.zero_allow_untested_optimizer, self.zero.whole_state_setting)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        return self.zero.clip_grad_norm_(parameters, max_norm, norm_type)

    # A stage with nothing to train is not given to zero1 (it would refuse it): its replicas hold it whole, as
    # under ddp, and these give and take its tensors that way.
    def _holds(self, model: nn.Module) -> bool:
        return id(model) in self.zero._models

    def sharded_state(self, model: nn.Module, optimizers: Any) -> list[ShardEntry]:
        if self._holds(model):
            return self.zero.sharded_state(model, optimizers)
        topo = self.topology
        return balanced_slices([(f"model/{k}", v) for k, v in named_tensors(model)], topo.dp_rank, topo.dp_size)

    def load_sharded_state(self, model: nn.Module, optimizers: Any, reader: StateReader) -> None:
        if self._holds(model):
            self.zero.load_sharded_state(model, optimizers, reader)
        else:
            load_whole_tensors(model, reader)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if self._holds(model):
            return self.zero.full_state_dict(model)
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def stage_sync(config: EngineConfig, topology: Topology, device: torch.device, precision: Precision) -> StageSync:
    """The sync object ``pp_zero_stage`` asks for."""
    cls = Zero1StageSync if config.options(PipelineOptions).pp_zero_stage == 1 else WholeStageSync
    return cls(config, topology, device, precision)
