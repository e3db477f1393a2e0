"""The Engine's side of expert parallelism: cutting a model's experts over the ep ranks at prepare (each rank
receives its piece of the first ep rank's experts), and the load-balancing loss over every rank's tokens
(``moe_aux_loss="global"``). The dispatch, plans and checkpoint view are in ``strategies/expert_parallel/``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.config.options import ConfigError
from phalanx.config.settings import EngineConfig
from phalanx.config.strategy_options import ParallelOptions
from phalanx.runtime.collective_log import watched
from phalanx.runtime.topology import Topology
from phalanx.strategies._replicas import check_same_model, group_rank0
from phalanx.strategies.expert_parallel import apply_ep_plan, ep_param_info
from phalanx.strategies.expert_parallel.aux_loss import has_aux_loss, use_global_aux_loss

__all__ = ["global_aux_loss", "split_experts"]


def split_experts(model: nn.Module, config: EngineConfig, topology: Topology, device: torch.device) -> Any:
    """Cut ``model``'s experts in place over the ep group by its ep plan; None when it was cut already."""
    if any(ep_param_info(p) is not None for p in model.parameters()):
        return None
    if any(t.is_meta for t in model.parameters()):
        raise ValueError(
            f"ep_size={topology.ep_size}: the model is on the meta device, and expert parallelism cuts its initialised "
            "expert weights (so that every layout starts from the same values); build the model on the CPU (or load "
            "its weights) before engine.prepare"
        )
    group = topology.ep_group
    check_same_model(model, group, device)

    def agree(tensors: list[torch.Tensor]) -> None:
        # Every ep rank keeps its piece of the first ep rank's experts: one scatter per weight, so that a rank
        # receives only its piece (on the device, as NCCL needs it) and the first sends one weight at a time.
        ep, rank, src = topology.ep_size, topology.ep_rank, group_rank0(group)
        for t in tensors:
            mine = t.detach()[rank * (t.shape[0] // ep) : (rank + 1) * (t.shape[0] // ep)]
            out = torch.empty(mine.shape, dtype=t.dtype, device=device)
            parts = [c.to(device).contiguous() for c in t.detach().chunk(ep)] if rank == 0 else None
            watched(dist.scatter, out, parts, src=src, group=group, label="ep: experts from the first ep rank")
            mine.copy_(out)

    opts = config.options(ParallelOptions)
    return apply_ep_plan(
        model, group, topology.ep_size, topology.ep_rank, capacity_factor=opts.moe_capacity_factor, agree=agree
    )


def global_aux_loss(model: nn.Module, topology: Topology) -> None:
    """``moe_aux_loss="global"``: the model's load-balancing loss over the tokens of every dp (and cp) rank."""
    if not has_aux_loss(model):
        raise ConfigError(
            f"moe_aux_loss='global' applies to a transformers mixture-of-experts model (it replaces its modeling "
            f"module's load_balancing_loss_func), and {type(model).__name__} has none; compute your model's loss "
            "with phalanx.strategies.expert_parallel.global_load_balancing_loss(router_logits, num_experts, top_k, "
            "group=engine.topology.dp_group), or leave moe_aux_loss at 'rank'"
        )
    if topology.dp_size > 1:  # on one data-parallel rank its tokens are the whole batch's
        use_global_aux_loss(model, topology.dp_group)
