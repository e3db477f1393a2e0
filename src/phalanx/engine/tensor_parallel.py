"""The Engine's side of tensor parallelism: reading the plan setting, splitting a model before the data-parallel
strategy wraps it (by its tp plan, then its experts by its ep plan: ``engine/expert_parallel.py``), and the
one-time check that replicated parameters got equal gradients on every tp rank.

The layers, plans, the vocab-parallel loss and the RNG tracker are in ``strategies/tensor_parallel/``; the mesh and
its tp group in ``runtime/topology.py``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.config.options import ConfigError
from phalanx.config.settings import EngineConfig
from phalanx.config.strategy_options import ParallelOptions
from phalanx.engine.expert_parallel import global_aux_loss, split_experts
from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import broadcast_coalesced
from phalanx.runtime.topology import Topology
from phalanx.strategies._replicas import check_same_model, group_rank0
from phalanx.strategies.base import Strategy

if TYPE_CHECKING:
    from phalanx.strategies.tensor_parallel import TPReport

__all__ = ["plan_setting", "split_model", "TensorParallelState"]


def plan_setting(value: str | None) -> dict[str, str] | None:
    """``tp_plan`` as a plan: None (the model's own), an inline JSON object, or a path to a JSON file of one."""
    if value is None:
        return None
    text = value.strip()
    where = "tp_plan"
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"tp_plan={value!r} is neither a JSON object nor a file: give the plan inline, e.g. "
                '\'{"layers.*.q_proj": "colwise"}\', or the path of a .json file that holds one'
            )
        text, where = path.read_text(), f"tp_plan file {str(path)!r}"
    try:
        plan = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{where} is not valid JSON ({e}); it must map module-name patterns to styles") from None
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise ConfigError(f"{where} must be a JSON object of module-name patterns to style names; got {plan!r:.200}")
    return plan


class TensorParallelState:
    """What the Engine keeps about its tensor-parallel models: each split's report (its RNG tracker, the vocab size
    the loss expects), and whether the replicated-gradient check has run."""

    def __init__(self, config: EngineConfig, topology: Topology, device: torch.device) -> None:
        self.config, self.topology, self.device = config, topology, device
        self.reports: list[TPReport] = []
        self.checked = False
        self._view: Any = None
        self.deferred: set[int] | None = None  # ids of parameters whose tp gradient sum is due (set by the backward)
        self.replaced: dict[int, nn.Parameter] = {}  # id of a parameter before the split -> its local piece
        self.ep_reports: list[Any] = []

    @property
    def active(self) -> bool:
        return self.topology.tp_size > 1

    def split(self, model: nn.Module, strategy: Any) -> nn.Module:
        if self.config.options(ParallelOptions).moe_aux_loss == "global":
            global_aux_loss(model, self.topology)
        if not self.active and self.topology.ep_size == 1:
            return model
        before = dict(model.named_parameters(remove_duplicate=False))
        if self.active:
            self.defer_sums(strategy)
            report = split_model(model, self.config, self.topology, self.device)
            if report is not None:
                self.reports.append(report)
        if self.topology.ep_size > 1:
            ep_report = split_experts(model, self.config, self.topology, self.device)
            if ep_report is not None:
                self.ep_reports.append(ep_report)
        after = dict(model.named_parameters(remove_duplicate=False))
        self.replaced.update({id(p): after[n] for n, p in before.items() if after.get(n) is not p})
        return model

    def defer_sums(self, strategy: Any) -> None:
        """Sum the replicated parameters' tp gradients once per step, in one all-reduce after the data-parallel
        reduction, instead of once per parameter and use in the backward, when the strategy can say where it keeps
        the reduced gradients."""
        if (
            self.active
            and self.deferred is None
            and type(strategy).reduced_grad_views is not Strategy.reduced_grad_views
        ):
            from phalanx.strategies.tensor_parallel import defer_grad_sums

            self.deferred = defer_grad_sums(self.topology.tp_group)

    def sum_deferred(self, strategy: Any, models: list[nn.Module]) -> None:
        """The tp sums of the gradients that arrived since the last sum: one coalesced all-reduce over the tp group
        (the backward on every tp rank marks the same parameters)."""
        if not self.deferred:
            return
        seen: set[int] = set()
        params = []
        for model in models:
            for p in model.parameters():
                if id(p) in self.deferred and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        self.deferred.clear()
        views = strategy.reduced_grad_views(params)
        if views is None:
            raise RuntimeError(
                f"strategy {strategy.name!r} could not give the reduced gradients of {len(params)} tp-replicated "
                "parameters whose sums over the tp ranks were deferred; this is a bug in phalanx, please report it"
            )
        views = [v for v in views if v.numel()]
        if not views:
            return
        dtype = functools.reduce(torch.promote_types, [v.dtype for v in views], torch.float32)
        flat = torch.cat([v.reshape(-1).to(self.device, dtype) for v in views])
        watched(dist.all_reduce, flat, group=self.topology.tp_group, label="tp: replicated parameter gradients")
        offset = 0
        for v in views:
            v.copy_(flat[offset : offset + v.numel()].view_as(v))
            offset += v.numel()

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer built on the model before ``prepare`` split it holds the whole parameters: point it at the
        local pieces (their state too, when it has any)."""
        if not self.replaced:
            return
        for group in optimizer.param_groups:
            group["params"] = [self.replaced.get(id(p), p) for p in group["params"]]
        for old in [p for p in optimizer.state if id(p) in self.replaced]:
            if optimizer.state[old]:
                raise ValueError(
                    "the optimizer holds state for whole parameters that tensor parallelism has just split; "
                    "prepare the model and optimizer before the first step (or build the optimizer after prepare)"
                )
            del optimizer.state[old]

    def check_once(self, models: list[nn.Module]) -> None:
        """After the first reduced backward: every replicated parameter's gradient is equal on its holders (a
        plan that leaves a partial gradient unsynchronised is named here, not discovered as silent drift)."""
        if self.checked or not self.active:
            return
        self.checked = True
        from phalanx.strategies.tensor_parallel import check_replicated_grads

        for model in models:
            check_replicated_grads(model, self.topology.tp_group)

    def state_view(self, strategy: Any) -> Any:
        """What the checkpoint code is handed for ``strategy``: under tp, a view that shows its local pieces as
        whole tensors (``TPCheckpointView``), so that a checkpoint loads on any layout; the strategy otherwise."""
        if not self.active and self.topology.ep_size == 1:
            return strategy
        if self._view is None or self._view.wrapped is not strategy:
            view = strategy
            if self.topology.ep_size > 1:  # whole experts first; the tp view then sees each tp piece whole
                from phalanx.strategies.expert_parallel.checkpoint import EPCheckpointView

                view = EPCheckpointView(view, self.topology)
            if self.active:
                from phalanx.strategies.tensor_parallel.checkpoint import TPCheckpointView

                view = TPCheckpointView(view, self.topology)
            view.wrapped = strategy
            self._view = view
        return self._view

    def trackers(self) -> list[Any]:
        return [r.tracker for r in self.reports]


def split_model(model: nn.Module, config: EngineConfig, topology: Topology, device: torch.device) -> TPReport | None:
    """Split ``model`` in place over the tp group by its plan; None when it was split already."""
    if any(getattr(p, "_phalanx_tp", None) is not None for p in model.parameters()):
        return None
    dtensors = [n for n, p in model.named_parameters() if type(p.data).__name__ == "DTensor"]
    if dtensors:
        raise ValueError(
            f"tp_size={topology.tp_size}: the model's parameters are already split by torch's DTensor (e.g. "
            f"{dtensors[0]}), as transformers' from_pretrained(tp_plan='auto') leaves them; load the model whole "
            "(without tp_plan or device_mesh) and let engine.prepare split it by its plan"
        )
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise ValueError(
            f"tp_size={topology.tp_size}: the model is on the meta device, and tensor parallelism splits its "
            "initialised weights (so that every layout starts from the same values); build the model on the CPU "
            "(or load its weights) before engine.prepare, or use tp_size=1 with deferred initialisation"
        )
    # The tp ranks split one set of weights: the first tp rank's (ranks may have been seeded apart).
    check_same_model(model, topology.tp_group, device)
    broadcast_coalesced(
        [t.data for t in model.parameters()] + list(model.buffers()),
        src=group_rank0(topology.tp_group),
        group=topology.tp_group,
        device=device,
    )
    from phalanx.strategies.tensor_parallel import apply_tp_plan

    opts = config.options(ParallelOptions)
    return apply_tp_plan(
        model,
        plan_setting(opts.tp_plan),
        topology.tp_group,
        sequence_parallel=opts.sequence_parallel,
        seed=config.seed,
    )
