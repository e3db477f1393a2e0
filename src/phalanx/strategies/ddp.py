"""Data parallel: every rank holds the whole model; gradients are averaged by bucketed, overlapped all-reduce.

Each trainable parameter's gradient lives in a flat bucket (``param.grad`` is a view into it). Buckets are
filled in reverse parameter order, which is roughly the order backward produces gradients, so the first
bucket is complete early. When a bucket's last gradient lands, its all-reduce starts asynchronously and
runs while backward computes the rest. One callback at the end of backward waits for them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from phalanx.checkpoint.shards import (
    ShardEntry,
    StateReader,
    balanced_slices,
    keys_by_param,
    load_whole_tensors,
    named_tensors,
    read_optimizer_state,
)
from phalanx.config.strategy_options import DataParallelOptions
from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import CommStats, broadcast_coalesced
from phalanx.runtime.placement import LEDGER
from phalanx.strategies._grads import (
    GradScale,
    build_buckets,
    clip_to_norm_,
    frozen_after_prepare_error,
    mesh_norm,
    mesh_pieces,
    second_backward_error,
    unused_parameters_error,
)
from phalanx.strategies._memory import memory_report_dict, nbytes, state_bytes_per_element, state_tensors
from phalanx.strategies._replicas import (
    check_prepared_once,
    check_trainable,
    group_rank0,
    optimizer_list,
    replicate_from_first,
)
from phalanx.strategies.base import Strategy
from phalanx.strategies.expert_parallel.params import expert_report, is_expert, kind_runs, split_dense_experts

__all__ = ["DDPStrategy", "GradReducer"]


class _Bucket:
    __slots__ = ("index", "params", "views", "flat", "pending", "ready", "work", "group", "size")

    def __init__(self, index: int, params: list[nn.Parameter], group: Any = None, size: int = 1) -> None:
        self.index = index
        self.params = params
        self.group, self.size = group, size  # the ranks this bucket is summed over
        first = params[0]
        self.flat = LEDGER.record(
            torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device), "ddp gradient bucket"
        )
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = len(params)
        self.ready = [False] * len(params)
        self.work: Any = None

    def reset(self) -> None:
        self.pending = len(self.params)
        self.ready = [False] * len(self.params)


class GradReducer:
    """Owns the gradient buckets of one model and reduces them over ``group``.

    ``experts``: (group, size) of the ranks that hold the same experts (expert parallelism): expert parameters get
    buckets of their own, summed over that group instead; every gradient is still divided by ``world_size``, the
    ranks whose tokens reached it."""

    def __init__(
        self,
        module: nn.Module,
        bucket_bytes: int,
        group: Any,
        world_size: int,
        stats: CommStats,
        find_unused_parameters: bool = False,
        experts: tuple[Any, int] | None = None,
    ) -> None:
        self.group, self.world_size, self.stats = group, world_size, stats
        self.find_unused_parameters = find_unused_parameters
        self.names: dict[torch.Tensor, str] = {p: n for n, p in module.named_parameters()}
        check_trainable(module, "reduce")
        params = [p for p in module.parameters() if p.requires_grad]
        runs = kind_runs(params[::-1]) if experts is not None else [(False, params[::-1])]  # reverse order
        self.buckets: list[_Bucket] = []
        for kind, run in runs:
            g, n = experts if kind and experts is not None else (group, world_size)
            for chunk in build_buckets(run, bucket_bytes):
                self.buckets.append(_Bucket(len(self.buckets), chunk, g, n))
        self._bucket_of: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if p.grad is not None:
                    b.views[i].copy_(p.grad)
                p.grad = b.views[i]
                self._bucket_of[p] = (b, i)
        self.require_sync = True
        self.reduce_again = False
        """A backward after one already reduced in this step reduces the sum again, as torch DDP does (the Accelerate
        front): with the default factor 1/dp, what was reduced stays, and the new gradients add their mean. The
        Engine refuses such a backward instead."""
        self.scale = GradScale(world_size)  # the window's factor, applied before the all-reduce
        self._reduced = False  # this step's gradients were already reduced
        self._next_bucket = 0
        self._callback_queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket, i = self._bucket_of[param]  # type: ignore[index]
        view = bucket.views[i]
        grad = param.grad
        assert grad is not None, "a post-accumulate-grad hook always sees a gradient"
        if grad is not view:
            # zero_grad(set_to_none=True) dropped the view, so autograd put a fresh tensor here; move it back in.
            view.copy_(grad)
            param.grad = view
            self._reduced = False  # gradients were dropped: this is a new step
        if not self.require_sync:
            return
        if self._reduced:
            if not self.reduce_again:
                raise second_backward_error("ddp", self.names.get(param, "?"))
            self._reduced = False
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finalize_backward)
        if not bucket.ready[i]:
            bucket.ready[i] = True
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready()

    def _launch_ready(self) -> None:
        # Launch strictly in bucket order: every rank must issue the same collectives in the same order.
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            self._launch(self.buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: _Bucket) -> None:
        self.scale.apply_(bucket.flat)
        if bucket.size > 1:
            self.stats.record("all_reduce", bucket.flat, bucket.size)
            bucket.work = watched(
                dist.all_reduce, bucket.flat, group=bucket.group, async_op=True, label=f"ddp bucket {bucket.index}"
            )

    def _finalize_backward(self) -> None:
        self._callback_queued = False
        missing = [(b, i) for b in self.buckets if b.pending for i, r in enumerate(b.ready) if not r]
        for b, i in missing:
            p = b.params[i]
            if p.grad is not b.views[i]:  # no gradient since the last set_to_none: it is zero
                b.views[i].zero_()
                p.grad = b.views[i]
            b.ready[i] = True
            b.pending = 0
        if missing:
            # Launch and wait even when we are about to raise: peers that did see these gradients are
            # waiting in the same collectives, and must not hang on us.
            self._launch_ready()
        self.wait()
        self._reduced = True
        self.scale.reset()
        if missing and not self.find_unused_parameters:
            frozen = [self.names.get(b.params[i], "?") for b, i in missing if not b.params[i].requires_grad]
            if frozen:
                raise frozen_after_prepare_error("ddp", frozen)
            raise unused_parameters_error("ddp", [self.names.get(b.params[i], "?") for b, i in missing])

    def launch_all(self) -> None:
        """Reduce every bucket now, whatever the hooks saw: a pipeline stage accumulates all its micro-batches
        under ``require_sync=False`` and reduces once, after its schedule. ``wait`` (or the next
        ``finish_gradient_sync``) completes it."""
        unused = []
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if p.grad is not b.views[i]:  # no gradient since the last set_to_none: it is zero
                    b.views[i].zero_()
                    p.grad = b.views[i]
                    unused.append(self.names.get(p, "?"))
        for b in self.buckets:
            self._launch(b)
        self._reduced = True
        self.scale.reset()
        if unused and not self.find_unused_parameters:
            self.wait()  # peers are in these same all-reduces; finish them before raising
            raise unused_parameters_error("ddp", unused, "in this step")

    def shadow_reduce(self) -> None:
        """All-reduce zeros in place of every bucket, in bucket order: the share of a rank that has run out of data
        (Accelerate's ``join_uneven_inputs``, torch's ``Join``) in the reduction its peers' backward runs. The peers
        still divide by the whole group, as torch DDP does under ``Join`` by default."""
        for b in self.buckets:
            if b.size == 1:
                continue
            zeros = torch.zeros_like(b.flat)
            self.stats.record("all_reduce", zeros, b.size)
            watched(dist.all_reduce, zeros, group=b.group, label=f"ddp bucket {b.index}")

    def wait(self) -> None:
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        self._reset()

    def _reset(self) -> None:
        for b in self.buckets:
            b.reset()
        self._next_bucket = 0

    def zero_grad(self, params: set[torch.Tensor] | None = None, set_to_none: bool = True) -> None:
        """Drop the gradients (the next hook copies autograd's fresh tensor into the bucket), or zero them."""
        self._reduced = False
        for b in self.buckets:
            whole = params is None or all(p in params for p in b.params)
            if whole and not set_to_none:
                b.flat.zero_()
            for p, v in zip(b.params, b.views):
                if params is None or p in params:
                    if set_to_none:
                        p.grad = None
                    else:
                        if not whole:
                            v.zero_()
                        p.grad = v

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def broadcast_experts(experts: list[torch.Tensor], topo: Any, stats: CommStats) -> None:
    """The first expert replica's experts to the others (the dp ranks that hold the same experts)."""
    group = topo.expert_dp_group
    broadcast_coalesced([p.data for p in experts], src=group_rank0(group), group=group, stats=stats)


class DDPStrategy(Strategy):
    """``strategy="ddp"``: replicate the model, average gradients with :class:`GradReducer`."""

    name = "ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.opts = self.config.options(DataParallelOptions)
        self._reducers: dict[int, GradReducer] = {}

    @property
    def reducers(self) -> list[GradReducer]:
        return list(self._reducers.values())

    def reducer_of(self, model: nn.Module) -> GradReducer | None:
        """The reducer of a model this strategy wrapped (None for any other)."""
        return self._reducers.get(id(model))

    def wrap_model(self, model: nn.Module) -> nn.Module:
        topo = self.topology
        check_prepared_once(model, self._reducers)
        experts = split_dense_experts(model.parameters())[1] if topo.ep_size > 1 else []
        if topo.dp_size > 1:
            # Every replica starts from rank 0's weights and buffers, whatever each rank initialised; experts from
            # the first rank that holds the same ones.
            replicate_from_first(
                model, topo.dp_group, self.device, self.stats, self.opts.broadcast_buffers, skip=experts
            )
            if experts and topo.expert_dp_size > 1:
                broadcast_experts(experts, topo, self.stats)
        self._reducers[id(model)] = GradReducer(
            model,
            bucket_bytes=int(self.opts.bucket_mb * 2**20),
            group=topo.dp_group,
            world_size=topo.dp_size,
            stats=self.stats,
            find_unused_parameters=self.opts.find_unused_parameters,
            experts=(topo.expert_dp_group, topo.expert_dp_size) if experts else None,
        )
        return model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = [r.require_sync for r in self.reducers]
        for r in self.reducers:
            r.require_sync = False
        try:
            yield
        finally:
            for r, prev in zip(self.reducers, previous):
                r.require_sync = prev

    def set_grad_scale(self, scale: float | torch.Tensor) -> None:
        for r in self.reducers:
            r.scale.set(scale)

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        for r in self.reducers:
            r._reduced = False

    def finish_gradient_sync(self) -> None:
        for r in self.reducers:
            if any(b.work is not None for b in r.buckets):
                r.wait()

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        params = {p for group in optimizer.param_groups for p in group["params"]}
        bucketed: set[torch.Tensor] = set()
        for r in self.reducers:
            r.zero_grad(params, set_to_none)
            bucketed.update(p for b in r.buckets for p in b.params)
        # Gradients that live outside our buckets get the optimizer's usual treatment.
        for p in params - bucketed:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        # After the all-reduce every replica holds the same gradients, so the local norm is the global one; under
        # tensor parallelism the tp ranks hold different pieces, each replicated piece counted once.
        # Under expert parallelism the ep ranks hold different experts: a dense piece is counted 1/ep times on each.
        params = [p for p in parameters if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        topo = self.topology
        if topo.tp_size > 1 or topo.ep_size > 1:
            pieces, groups = mesh_pieces(params, grads, topo)
            total = mesh_norm(pieces, float(norm_type), self.device, groups)
            total = total.to(grads[0].dtype if grads else torch.float32)
            clip_to_norm_(grads, max_norm, total)
            return total
        if not grads:
            return torch.zeros((), device=self.device)
        total = torch.nn.utils.get_total_norm(grads, norm_type)
        clip_to_norm_(grads, max_norm, total)
        return total

    def reduced_grad_views(self, params: list[nn.Parameter]) -> list[torch.Tensor] | None:
        out = []
        for p in params:
            if p.grad is None:  # unused in this step (find_unused_parameters): its reduced gradient is zero
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def sharded_state(self, model: nn.Module, optimizers: Any = None) -> list[ShardEntry]:
        # Every replica holds everything. So that a save writes in parallel, the replicas split the bytes evenly:
        # rank r of the data-parallel group gives the r-th of dp_size equal runs of the tensors laid end to end.
        # Under expert parallelism, expert tensors are split the same way over the ranks that hold the same experts.
        self.finish_gradient_sync()
        experts = {n for n, p in model.named_parameters() if is_expert(p)}
        tensors = [(f"model/{k}", v) for k, v in named_tensors(model)]
        names: dict[Any, str] = {p: n for n, p in model.named_parameters()}
        for opt in optimizer_list(optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    if p in names:
                        state = opt.state.get(p, {}).items()
                        tensors += [(f"optim/{names[p]}/{k}", v) for k, v in state if isinstance(v, torch.Tensor)]
        topo = self.topology
        if not experts:
            return balanced_slices(tensors, topo.dp_rank, topo.dp_size)
        expert_tensors = [(k, v) for k, v in tensors if k.split("/")[1] in experts]
        dense = [(k, v) for k, v in tensors if k.split("/")[1] not in experts]
        return balanced_slices(dense, topo.dp_rank, topo.dp_size) + balanced_slices(
            expert_tensors, topo.expert_dp_rank, topo.expert_dp_size
        )

    def load_sharded_state(self, model: nn.Module, optimizers: Any, reader: StateReader) -> None:
        load_whole_tensors(model, reader)
        keys = keys_by_param(reader)
        names: dict[Any, str] = {p: n for n, p in model.named_parameters()}
        for opt in optimizer_list(optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    name = names.get(p)
                    if name is None or name not in keys:
                        continue
                    # New memory: the optimizer must own its state, never alias the reader's tensors (which may be
                    # a caller's, or shared memory).
                    opt.state[p] = {
                        k: read_optimizer_state(reader, f"optim/{name}/{k}", p, group)
                        for k in keys[name]
                        if k != "master"  # zero's fp32 copy of a low-precision parameter: the parameter itself here
                    }

    def state_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in named_tensors(model)}

    def memory_report(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        params = [p for r in self.reducers for b in r.buckets for p in b.params]
        psi = sum(p.numel() for p in params)
        p_bytes = params[0].element_size() if params else 4
        state = state_tensors(optimizers)
        k = state_bytes_per_element(optimizers, state, psi)
        held = {
            "params": nbytes(params),
            "grads": sum(b.flat.numel() * b.flat.element_size() for r in self.reducers for b in r.buckets),
            "optimizer_state": nbytes(state),
            "comm_buffers": 0,  # buckets are the gradients themselves
            "offloaded_to_disk": 0,
        }
        predicted = {"params": p_bytes * psi, "grads": p_bytes * psi, "optimizer_state": k * psi}
        report = memory_report_dict(self.name, psi, self.topology.dp_size, p_bytes, k, held, predicted, "none")
        if self.topology.ep_size > 1:
            report["experts"] = expert_report([p for p in params if is_expert(p)], self.topology)
        return report

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def comm_dtype(self) -> torch.dtype | None:
        if self.topology.dp_size == 1 or not self._reducers:
            return None
        return self.reducers[0].buckets[0].flat.dtype

    def describe(self) -> dict[str, Any]:
        buckets = [b for r in self.reducers for b in r.buckets]
        return {
            "strategy": self.name,
            "buckets": len(buckets),
            "bucket_bytes": [b.flat.numel() * b.flat.element_size() for b in buckets],
        }
