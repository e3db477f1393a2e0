"""What the zero strategies share: a model's segments, the optimizer's pieces, the end of backward, clipping,
the state hooks and memory accounting.

The user's optimizer is kept: its param groups are given the rank's pieces of the fp32 master slices that
belong to each group (see ``layout.py``), so each group keeps its own lr and weight decay. This is exact for
elementwise optimizers (SGD, Adam, AdamW, ...); a tensor-wise one (Muon, Adafactor: ``optimizers.py``) is given
instead the whole parameters this rank owns, gathered for each step (``tensorwise.py``). The stages
(``bucketed.py``: zero1/zero2; ``zero3.py``) add how gradients are reduced during backward, and zero3 how
parameters are gathered.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from phalanx.checkpoint.shards import ShardEntry, StateReader, named_tensors
from phalanx.config.strategy_options import DataParallelOptions, ZeroOptions, ZeroShardOptions
from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import broadcast_coalesced
from phalanx.runtime.placement import LEDGER
from phalanx.strategies._grads import (
    GradScale,
    clip_to_norm_,
    mesh_norm,
    second_backward_error,
    tp_replicas,
    unused_parameters_error,
)
from phalanx.strategies._memory import (
    expected_peak,
    memory_report_dict,
    nbytes,
    segment_grad_bytes,
    state_bytes_per_element,
    state_tensors,
)
from phalanx.strategies._replicas import (
    check_prepared_once,
    check_trainable,
    group_rank0,
    optimizer_list,
    replicate_from_first,
)
from phalanx.strategies.base import Strategy
from phalanx.strategies.expert_parallel.params import expert_report, is_expert
from phalanx.strategies.zero import state
from phalanx.strategies.zero.collectives import DTYPES, Done, SegmentComm, resolve_collectives
from phalanx.strategies.zero.layout import Segment, merge_runs
from phalanx.strategies.zero.offload import StateStore
from phalanx.strategies.zero.optimizers import check_optimizer, is_tensorwise
from phalanx.strategies.zero.stepping import chunk_steps
from phalanx.strategies.zero.tensorwise import ShardGroup, TensorwisePlan

if TYPE_CHECKING:
    from phalanx.strategies.zero.zero3 import Unit

__all__ = ["ZeroStrategy", "ModelState"]


class ModelState:
    """One prepared model: its segments (and zero3 units), and where its running backward stands."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], segments: list[Segment]) -> None:
        self.model, self.params, self.segments = model, params, segments
        self.units: list[Unit] = []
        self.next_segment = 0  # zero1/2: the next bucket to launch, in order
        self.touched = False  # got gradients in the running backward
        self.reduced = False  # reduced at a window's end, and not yet consumed by a step or zero_grad
        self.order: list[Unit] = []  # zero3: units in the order the first forward ran them (for prefetch)
        self.order_fixed = False


# ---------------------------------------------------------------------------------------------- strategy
class ZeroStrategy(Strategy):
    """What zero1, zero2 and zero3 share: the segments, the optimizer's pieces, the end of backward, clipping,
    state and memory. A stage differs from the others by two flags and a few hooks, not by branches."""

    stage: ClassVar[int]
    shards_gradients: ClassVar[bool] = True
    params_whole: ClassVar[bool] = True
    """Parameters stay whole between steps (zero1/2); zero3 keeps only the rank's slice at rest."""
    grads_whole: ClassVar[bool] = False
    """Whole gradients accumulate over the window and are reduced once at its end (zero1); otherwise every
    backward reduces its share and only the rank's fp32 slice is kept (zero2/3)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        topo = self.topology
        self.dp_opts = self.config.options(DataParallelOptions)
        self.shard_opts = self.config.options(ZeroShardOptions)
        self.opts = cfg = self.config.options(ZeroOptions)
        self.group, self.world, self.rank = topo.dp_group, topo.dp_size, topo.dp_rank
        self.rep_group, self.rep_world, self.rep_rank = None, 1, 0
        assert topo.dp_replicate_size is not None and topo.dp_shard_size is not None
        if topo.dp_replicate_size > 1 and not self.within_stage:
            # Hybrid sharding: shards over dp_shard, whole replicas over dp_replicate. Gradients are reduce-scattered
            # within a replica and the shards then all-reduced across replicas (FSDP's HYBRID_SHARD).
            self.group, self.world, self.rank = topo.dp_shard_group, topo.dp_shard_size, topo.dp_shard_rank
            self.rep_group, self.rep_world, self.rep_rank = (
                topo.dp_replicate_group, topo.dp_replicate_size, topo.dp_replicate_rank,
            )  # fmt: skip
        if self.rep_world > 1 and self.grads_whole:
            raise ValueError(
                f"hybrid sharding (dp_replicate_size={topo.dp_replicate_size} x dp_shard_size={topo.dp_shard_size}) "
                f"applies to zero2 and zero3; strategy {self.name!r} keeps whole gradients on every rank. Use zero2 "
                f"(its optimizer state is sharded too), or leave dp_replicate_size unset to shard over all "
                f"{topo.dp_size} data-parallel ranks"
            )
        if self.world == 1 and self.rep_world == 1:
            what, fix = self._no_sharding_hint()
            warnings.warn(
                f"{what} on one data-parallel rank shards nothing: it trains correctly but saves no memory ({fix})",
                stacklevel=3,
            )
        self.comm_dtype_ = DTYPES[cfg.comm_dtype] if cfg.comm_dtype else None
        self.comm = SegmentComm(
            self.group,
            self.world,
            resolve_collectives(self.shard_opts.zero_collectives, self.group),
            self.comm_dtype_,
            self.stats,
            accumulates=not self.grads_whole,
            replicas=(self.rep_group, self.rep_world),
        )
        # Expert parallelism: expert segments shard over the shard ranks that hold the same experts.
        self.expert_world, self.expert_rank = self.world, self.rank
        if topo.ep_size > 1:
            if self.within_stage:
                raise ValueError(
                    f"ep_size={topo.ep_size} with the pipeline's zero1 (pp_zero_stage=1) is not supported: its stages "
                    "shard over their own replicas, not the expert-parallel groups; use pp_zero_stage=0 (each stage's "
                    "replicas hold whole state, experts reduced over the ranks that hold them)"
                )
            assert self.world % topo.ep_size == 0, "the mesh keeps the ep groups within zero's shard ranks"
            self.expert_world, self.expert_rank = topo.expert_shard_size, topo.expert_shard_rank
            self.comm.add_experts(
                topo.expert_shard_group,
                self.expert_world,
            )
        if cfg.offload != "none" and self.device.type == "cuda" and self.precision.scaler is not None:
            raise ValueError(
                f"offload={cfg.offload!r} with precision='fp16-mixed' on CUDA is not supported: the loss scaler checks "
                "gradients on the GPU, and offloaded gradient shards live on the host. Use precision='bf16-mixed' "
                "(no loss scaling needed) with offload, or offload='none' with fp16"
            )
        self.store = StateStore(cfg.offload, self.device, cfg.offload_dir, rank=topo.rank)
        self.segments: list[Segment] = []
        self.units: list[Any] = []  # zero3's units
        self._loc: dict[nn.Parameter, tuple[Segment, int]] = {}
        self._names: dict[nn.Parameter, str] = {}
        self._models: dict[int, ModelState] = {}
        self._optimizers: list[
            tuple[torch.optim.Optimizer, list[list[tuple[Segment, int, int]]], set[nn.Parameter]]
        ] = []
        self.require_sync = True
        self.scale = GradScale(topo.dp_size)  # applied after the reduction when it accumulates, before it otherwise
        self._callback_queued = False
        self._missing: list[str] = []
        self._clean: set[int] = set()  # optimizers whose gradient ranges are zero since their last step
        self._early_gathers: dict[int, Done] = {}  # segment index -> gather started by a pipelined step
        self._window_seen: set[nn.Parameter] = set()  # zero1: parameters that got a gradient with require_sync off
        self._tensorwise: dict[int, TensorwisePlan] = {}  # id(optimizer) -> its owners, for tensor-wise optimizers
        self._owner_loads: dict[bool, list[int]] = {}  # elements each rank owns for them, dense (False) and experts

    whole_state_setting = "strategy='ddp'"
    """The setting that trains without sharding optimizer state, for errors about optimizers."""

    def _no_sharding_hint(self) -> tuple[str, str]:
        """What shards nothing on one data-parallel rank, and how to fix that, for the warning."""
        return f"strategy {self.name!r}", "launch more processes, e.g. phalanx launch -n 2, or use strategy='ddp'"

    # -------------------------------------------------------------------- model
    def _prepare_common(
        self, model: nn.Module, sharded: set[nn.Parameter], replicate: bool = True
    ) -> list[nn.Parameter]:
        """Checks, and rank 0's buffers and unsharded parameters; sharded ones are broadcast flat, in place."""
        check_prepared_once(model, self._models)
        topo = self.topology
        experts = [p for p in model.parameters() if p not in sharded and is_expert(p)]  # frozen experts (zero1/2)
        if topo.dp_size > 1 and replicate:
            skip = sharded | set(experts)
            replicate_from_first(
                model, topo.dp_group, self.device, self.stats, self.dp_opts.broadcast_buffers, skip=skip
            )
            if experts and topo.expert_dp_size > 1:  # each ep rank's experts from the first rank that holds them
                broadcast_coalesced(
                    [p.data for p in experts], src=group_rank0(topo.expert_dp_group), group=topo.expert_dp_group,
                    stats=self.stats,
                )  # fmt: skip
        for name, p in model.named_parameters():
            self._names.setdefault(p, name)
        check_trainable(model, "shard")
        return list(model.parameters())

    def _segment(self, params: list[nn.Parameter], what: str, device: torch.device | None = None) -> Segment:
        """A segment of ``params`` (all experts or none), laid out over the ranks that shard them."""
        if self.topology.ep_size > 1 and is_expert(params[0]):
            return Segment(0, params, self.expert_world, self.expert_rank, device, what, expert=True)
        return Segment(0, params, self.world, self.rank, device, what)

    def _add_segments(self, segments: list[Segment]) -> None:
        for s in segments:
            topo = self.topology
            size, dp = (topo.expert_dp_size, topo.expert_dp_group) if s.expert else (topo.dp_size, topo.dp_group)
            if size > 1:  # every replica starts from the first one's values: one broadcast per flat buffer
                self.stats.record("broadcast", s.full)
                watched(dist.broadcast, s.full, src=group_rank0(dp), group=dp)
            s.index = len(self.segments)
            self.segments.append(s)
            for i, p in enumerate(s.params):
                self._loc[p] = (s, i)
            if s.has_trainable:
                self._make_master(s)

    def _register(self, model: nn.Module, params: list[nn.Parameter], segments: list[Segment]) -> ModelState:
        state = ModelState(model, params, segments)
        for s in segments:
            s.owner = state
        self._models[id(model)] = state
        model.register_forward_pre_hook(self._check_model_unchanged)
        # model.zero_grad() must also clear the reduced slices, which are not any parameter's .grad.
        original = model.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            original(set_to_none)
            self._zero_ranges([(seg, 0, seg.shard_numel) for seg in segments], None, state.params)
            state.reduced = False

        model.zero_grad = zero_grad  # type: ignore[method-assign]
        return state

    def _make_master(self, seg: Segment) -> None:
        master_dtype = torch.promote_types(seg.dtype, torch.float32)
        alias = (
            self.params_whole and master_dtype == seg.dtype and self.store.mode == "none" and self.comm_dtype_ is None
        )
        what = f"{self.name} segment {seg.index}"
        if alias:
            seg.master, seg.master_is_full_slice = seg.full[seg.lo : seg.hi], True
        else:
            seg.master = self.store.placed(self.store.zeros(seg.shard_numel, master_dtype), f"{what} master slice")
            seg.master.copy_(seg.full[seg.lo : seg.hi])
        if self.grads_whole and alias and self.comm.mode in ("allreduce", "p2p"):
            seg.grad_full = LEDGER.record(torch.zeros(seg.padded, dtype=seg.dtype, device=seg.device), f"{what} grads")
            seg.master_grad = seg.grad_full[seg.lo : seg.hi]  # the reduction leaves the slice in place
        else:
            if self.store.mode == "none":
                grad = torch.zeros(seg.shard_numel, dtype=master_dtype, device=seg.master.device)
                seg.master_grad = LEDGER.record(grad, f"{what} gradient slice")
            else:  # beside the offloaded master; each reduced gradient slice is copied into it from the device
                seg.master_grad = self.store.host_zeros(seg.shard_numel, master_dtype)
            if self.grads_whole:
                seg.grad_full = LEDGER.record(
                    torch.zeros(seg.padded, dtype=seg.dtype, device=seg.device), f"{what} grads"
                )
        if seg.grad_full is not None:
            seg.grad_views = [seg.view_of(i, seg.grad_full) for i in range(len(seg.params))]

    def _check_model_unchanged(self, module: nn.Module, args: Any) -> None:
        params = self._models[id(module)].params
        now = list(module.parameters())
        if len(now) != len(params) or any(a is not b for a, b in zip(now, params)):
            known = set(params)
            added = [n for n, p in module.named_parameters() if p not in known]
            raise RuntimeError(
                f"the model changed after engine.prepare (parameters added or replaced: {', '.join(added) or 'none'}; "
                f"{len(params)} parameters at prepare, {len(now)} now). {self.name} laid out flat shards at prepare "
                "time: build the whole model, then call engine.prepare"
            )
        if self.params_whole:
            for s in self._models[id(module)].segments:
                for p, ptr in zip(s.params, s.pointers):
                    if p.data_ptr() != ptr:
                        raise RuntimeError(
                            f"parameter {self._names.get(p, '?')!r} was given new storage after engine.prepare "
                            f"(e.g. param.data = ...); {self.name} keeps parameters in flat buffers: update them "
                            "in place with param.data.copy_(...) under torch.no_grad()"
                        )

    # -------------------------------------------------------------------- optimizer
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        check_optimizer(optimizer, self.shard_opts.zero_allow_untested_optimizer, self.whole_state_setting)
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError(
                f"{type(optimizer).__name__} already has state (it has stepped); {self.name} must shard it before the "
                "first step: call engine.prepare before optimizer.step()"
            )
        tensorwise = is_tensorwise(optimizer)
        if tensorwise:
            self._check_tensorwise(optimizer)
        max_piece = int(self.opts.offload_chunk_mb * 2**20 / 4) if self.store.mode == "disk" else None
        layout: list[list[tuple[Segment, int, int]]] = []
        seen: set[nn.Parameter] = set()
        trainable: list[list[nn.Parameter]] = []  # each group's, in its order
        for gi, group in enumerate(optimizer.param_groups):
            group_params: set[nn.Parameter] = set()
            for p in group["params"]:
                if p in seen:
                    raise ValueError(f"parameter {self._names.get(p, '?')!r} is in two param groups of the optimizer")
                seen.add(p)
                if p not in self._loc:
                    if p.requires_grad:
                        raise ValueError(
                            f"a trainable parameter in param group {gi} of {type(optimizer).__name__} (shape "
                            f"{tuple(p.shape)}) is not in any model passed to engine.prepare; pass the model to "
                            "engine.prepare together with its optimizer"
                        )
                    continue
                group_params.add(p)
            trainable.append([p for p in group["params"] if p in group_params and self._trainable(p)])
            pieces: list[tuple[Segment, int, int]] = []
            for seg in self.segments if not tensorwise else ():
                for _, a, b in merge_runs(seg.local_runs(group_params)):
                    step = max_piece or (b - a)
                    pieces.extend((seg, x, min(x + step, b)) for x in range(a, b, step))
            layout.append(pieces)
            group["params"] = [self._piece(seg, a, b) for seg, a, b in pieces]
        if tensorwise:
            plan = TensorwisePlan(
                optimizer, trainable, self._loc.__getitem__, self._shard_group, self._owner_loads, self.stats
            )
            self._tensorwise[id(optimizer)] = plan
            for group, owned in zip(optimizer.param_groups, plan.groups):
                group["params"] = owned
        if not any(g["params"] for g in optimizer.param_groups):
            # This rank holds none of this optimizer's elements (or owns none of its tensors). A placeholder keeps
            # the rank in step with the others (fp16 overflow checks are all-reduced per optimizer); 1 x 1 for a
            # tensor-wise one (Muon steps matrices only), which it steps as zeros.
            shape = (1, 1) if tensorwise else (0,)
            placeholder = nn.Parameter(torch.zeros(shape, device=self.store.device))
            placeholder.grad = torch.zeros(shape, device=self.store.device)
            optimizer.param_groups[0]["params"] = [placeholder]
        optimizer.state.clear()
        self._optimizers.append((optimizer, layout, seen))
        if self.store.mode == "disk":
            chunk_steps(optimizer, self.store, self.opts.offload_chunk_mb)
        return optimizer

    def _trainable(self, p: nn.Parameter) -> bool:
        seg, i = self._loc[p]
        return seg.trainable[i]

    def _shard_group(self, seg: Segment) -> ShardGroup:
        """The ranks that shard ``seg``: the expert shard ranks for experts, the shard ranks otherwise."""
        if seg.expert:
            return ShardGroup(self.topology.expert_shard_group, self.expert_world, self.expert_rank)
        return ShardGroup(self.group, self.world, self.rank)

    def _check_tensorwise(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse the settings under which no rank can hold a whole tensor for a tensor-wise optimizer."""
        name, topo = type(optimizer).__name__, self.topology
        if topo.tp_size > 1:
            raise ValueError(
                f"{name} updates each parameter from the whole tensor, and tp_size={topo.tp_size} splits the weights "
                f"over the tensor-parallel ranks, so that no rank holds a whole matrix under {self.name}. Use "
                "tp_size=1, or an elementwise optimizer (AdamW) with tensor parallelism"
            )
        if self.within_stage:
            raise ValueError(
                f"{name} (a tensor-wise optimizer) with the pipeline's zero1 (pp_zero_stage=1) is not supported; use "
                "pp_zero_stage=0, where each stage's replicas step its parameters whole"
            )
        if self.store.mode != "none":
            raise ValueError(
                f"{name} with offload={self.store.mode!r} is not supported: a tensor-wise optimizer steps each whole "
                f"parameter on its owner rank, on the device. Use offload='none' (the owners hold only their tensors' "
                f"state, about 1/{self.world} of it each), or an elementwise optimizer (AdamW) with offload"
            )

    def _plans(self, optimizers: Any) -> list[TensorwisePlan]:
        """The tensor-wise plans of ``optimizers`` (None, one, or a sequence; prepared or not)."""
        return [self._tensorwise[id(o)] for o in optimizer_list(optimizers) if id(o) in self._tensorwise]

    @staticmethod
    def _piece(seg: Segment, a: int, b: int) -> nn.Parameter:
        assert seg.master is not None and seg.master_grad is not None
        piece = nn.Parameter(seg.master[a:b])
        piece.grad = seg.master_grad[a:b]
        return piece

    def _entry(self, optimizer: torch.optim.Optimizer) -> tuple[list[tuple[Segment, int, int]], set[nn.Parameter]]:
        optimizer = getattr(optimizer, "optimizer", optimizer)
        for opt, layout, params in self._optimizers:
            if opt is optimizer:
                ranges = [piece for pieces in layout for piece in pieces]
                plan = self._tensorwise.get(id(opt))
                return ranges + (plan.local_ranges if plan is not None else []), params
        return [], set()

    def _attach_piece_grads(self) -> None:
        for opt, layout, _ in self._optimizers:
            for group, pieces in zip(opt.param_groups, layout):
                for piece, (seg, a, b) in zip(group["params"], pieces):
                    if piece.grad is None:
                        assert seg.master_grad is not None
                        piece.grad = seg.master_grad[a:b]

    def _zero_ranges(
        self,
        ranges: list[tuple[Segment, int, int]],
        optimizer: torch.optim.Optimizer | None,
        params: Iterable[nn.Parameter],
    ) -> None:
        """Zero the reduced slices in ``ranges`` and, for zero1, the whole gradients of ``params``."""
        for seg, a, b in ranges:
            if seg.master_grad is not None:
                seg.master_grad[a:b].zero_()
        for plan in self._tensorwise.values():  # and the owners' whole copies of them, while a step holds them
            plan.zero_grads(params)
        if self.grads_whole:
            # Drop rather than zero: the next backward's hook copies autograd's fresh gradient into the bucket
            # view (as ddp does after zero_grad(set_to_none=True)), which saves a pass over the whole buffer.
            for p in params:
                if p in self._loc:
                    p.grad = None
        # Decided from the parameters, not from this rank's slices, so that every rank agrees.
        for p in params:
            if p in self._loc and self._loc[p][0].owner is not None:
                self._loc[p][0].owner.reduced = False  # type: ignore[union-attr]
        if optimizer is not None:
            self._clean.add(id(optimizer))

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Gather the updated parameters, and consume the gradients this optimizer stepped with.

        Consuming (zeroing) them here means a backward after ``optimizer.step()`` starts afresh, whether or
        not ``zero_grad`` is called, and a bucket shared by two optimizers keeps the other one's gradients.
        """
        if optimizer is None:
            return
        ranges, params = self._entry(optimizer)
        plan = self._tensorwise.get(id(getattr(optimizer, "optimizer", optimizer)))
        if plan is not None:
            plan.release()  # stepped (or skipped): the owners' whole copies go, their gradients consumed
        self._zero_ranges(ranges, optimizer, params)
        # From the parameters, not from this rank's pieces: a rank that holds none of a segment must still
        # take part in gathering it.
        segments = sorted(
            {id(seg): seg for seg, _ in (self._loc[p] for p in params if p in self._loc)}.values(),
            key=lambda seg: seg.index,
        )
        self._publish_params(segments)
        self.store.release()

    def _publish_params(self, segments: list[Segment]) -> None:
        """The optimizer updated the masters of ``segments``: make every rank's parameters see the new values
        (zero1/2 all-gather them into the whole parameters; zero3 overrides this)."""
        early, self._early_gathers = self._early_gathers, {}
        if self.comm_dtype_ is None:
            works = [
                early.pop(seg.index) if seg.index in early else self.comm.gather(seg, async_op=True) for seg in segments
            ]
            for w in works + list(early.values()):
                w.wait()
        else:  # one full-size conversion buffer at a time
            for seg in segments:
                self.comm.gather(seg)

    # -------------------------------------------------------------------- gradients
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = previous

    def set_grad_scale(self, scale: float | torch.Tensor) -> None:
        self.scale.set(scale)

    def _queue_final_callback(self, ms: ModelState) -> None:
        if ms.reduced:
            raise second_backward_error(self.name)
        ms.touched = True
        self._clean.clear()
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finalize_backward)

    def _finalize_backward(self) -> None:
        self._callback_queued = False
        touched = [ms for ms in self._models.values() if ms.touched]
        for ms in touched:
            self._finish_backward_reductions(ms)
        self.comm.wait_inflight()
        for plan in self._tensorwise.values():
            plan.stale = True  # the owners must receive the new gradient slices before anything reads them
        if self.require_sync:
            if self.comm.accumulates:
                # Each backward's reduced share was added up unscaled; the window's factor applies once, here.
                for ms in touched:
                    for seg in ms.segments:
                        if seg.master_grad is not None:
                            self.scale.apply_(seg.master_grad)
            self.scale.reset()
            for ms in touched:
                ms.reduced = True
        for ms in touched:
            ms.touched = False
        missing, self._missing = self._missing, []
        if missing and not self.dp_opts.find_unused_parameters:
            raise unused_parameters_error(self.name, missing)

    def _finish_backward_reductions(self, ms: ModelState) -> None:
        """Reduce what this backward left unreduced in ``ms`` (the stages differ here)."""
        raise NotImplementedError

    def finish_gradient_sync(self) -> None:
        self.comm.wait_inflight()
        self.comm.fence_host_reads()  # before the optimizer writes offloaded masters (or a load does)
        for plan in self._tensorwise.values():
            if plan.stale:  # every rank alike: a backward reduced on all of them
                plan.gather()
        self._attach_piece_grads()

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        if id(getattr(optimizer, "optimizer", optimizer)) in self._clean:
            return  # already zeroed when it stepped, and no backward since
        ranges, params = self._entry(optimizer)
        self._zero_ranges(ranges, getattr(optimizer, "optimizer", optimizer), params)
        self._attach_piece_grads()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        # Each rank holds the reduced gradient of its slices only: combine the local norms over the ranks.
        self.finish_gradient_sync()
        wanted: set[Any] = set(parameters)
        # A tensor-wise optimizer's parameters count by the whole gradients their owners hold (and will step with).
        owned = [g.view(-1) for plan in self._tensorwise.values() for g in plan.grads(wanted)]
        elementwise = wanted.difference(*(plan.params for plan in self._tensorwise.values()))
        slices, pieces = [], []
        for s in self.segments:
            if s.master_grad is not None:
                for i, a, b in s.local_runs(elementwise):
                    slices.append(s.master_grad[a:b])
                    pieces.append((slices[-1], tp_replicas(s.params[i])))
        slices += owned  # none under tensor parallelism, which tensor-wise optimizers refuse
        norm_type = float(norm_type)
        if self.topology.tp_size > 1:  # the tp ranks hold different pieces; a replicated one counts once
            # Within a pipeline stage the pieces differ over every rank of the world (stages, shards, tp pieces).
            groups = (
                [None] if self.within_stage else [*([self.group] if self.world > 1 else []), self.topology.tp_group]
            )
            total = mesh_norm(pieces, norm_type, self.device, groups).float()
            clip_to_norm_([g for g in slices if g.numel()], max_norm, total)
            return total
        local = [g.float() for g in slices if g.numel()]
        if math.isinf(norm_type):
            total = max((g.abs().max().to(self.device) for g in local), default=torch.zeros((), device=self.device))
            self._all_reduce_norm(total, dist.ReduceOp.MAX)
        else:
            total = torch.zeros((), device=self.device)
            for g in local:
                total += (g.norm(norm_type) ** norm_type).to(self.device)
            self._all_reduce_norm(total, dist.ReduceOp.SUM)
            total = total ** (1.0 / norm_type)
        clip_to_norm_([g for g in slices if g.numel()], max_norm, total)
        return total

    def nonfinite_grad_names(self, model: nn.Module, limit: int) -> list[str]:
        return state.nonfinite_grad_names(self, model, limit)

    def reduced_grad_views(self, params: list[nn.Parameter]) -> list[torch.Tensor] | None:
        # This rank's reduced slices of them, segment by segment: the layout is the same on every rank whose local
        # parameters have the same shapes (the tp ranks of one data-parallel rank).
        wanted = set(params)
        return [
            s.master_grad[a:b] for s in self.segments if s.master_grad is not None for _, a, b in s.local_runs(wanted)
        ]

    def _all_reduce_norm(self, total: torch.Tensor, op: Any) -> None:  # the ranks' parts: a max, or a sum of powers
        if self.world > 1:
            watched(dist.all_reduce, total, op=op, group=self.group)

    # -------------------------------------------------------------------- state
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        self.finish_gradient_sync()
        gathered = self._gathered_cpu_params(model)
        out = {}
        for k, v in model.state_dict(keep_vars=True).items():
            out[k] = gathered[v] if v in gathered else v.detach().to("cpu", copy=True)
        return out

    def sharded_state(self, model: nn.Module, optimizers: Any = None) -> list[ShardEntry]:
        """Each rank gives its own slice of every parameter and optimizer state tensor; rank 0 the replicated rest."""
        return state.sharded_state(self, model, optimizers)

    def load_sharded_state(self, model: nn.Module, optimizers: Any, reader: StateReader) -> None:
        """Read exactly this rank's slices: no rank ever holds more than its shard plus one slice in transit."""
        state.load_sharded_state(self, model, optimizers, reader)

    def _pieces_of(
        self, model: nn.Module, optimizers: Any
    ) -> Iterator[tuple[torch.optim.Optimizer, dict[str, Any], nn.Parameter, tuple[Segment, int, int]]]:
        """(optimizer, param group, piece, (segment, start, stop)) of every piece of ``optimizers`` in ``model``'s
        segments."""
        wanted, owner = optimizer_list(optimizers), self._models[id(model)]
        for opt, layout, _ in self._optimizers:
            if not any(opt is o for o in wanted):
                continue
            for group, pieces in zip(opt.param_groups, layout):
                for piece, where in zip(group["params"], pieces):
                    if where[0].owner is owner:
                        yield opt, group, piece, where

    def state_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        shapes = {
            self._names[p]: tuple(s.shapes[i]) for s in self._models[id(model)].segments for i, p in enumerate(s.params)
        }
        return {name: shapes.get(name, tuple(t.shape)) for name, t in named_tensors(model)}

    def _at_rest(self, s: Segment) -> torch.Tensor:
        """This rank's slice of the segment's parameter values, in their dtype (zero3 overrides this)."""
        return s.full[s.lo : s.hi]

    def _gathered_cpu_params(self, model: nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        segments = self._models[id(model)].segments
        return {p: p.detach().to("cpu", copy=True) for s in segments for p in s.params}

    def comm_dtype(self) -> torch.dtype | None:
        if self.world == 1 or not self.segments:
            return None
        return self.comm_dtype_ or self.segments[0].dtype

    def describe(self) -> dict[str, Any]:
        out = {
            "strategy": self.name,
            "segments": len(self.segments),
            "segment_numel": [s.numel for s in self.segments],
            "padded_numel": [s.padded for s in self.segments],
            "units": [u.name for u in self.units],
            "collectives": self.comm.mode,
            "offload": self.store.mode,
        }
        if self._owner_loads:  # elements of tensor-wise optimizers' parameters each rank owns
            out["tensorwise_owner_numel"] = {"experts" if k else "dense": list(v) for k, v in self._owner_loads.items()}
        return out

    # -------------------------------------------------------------------- memory
    def memory_report(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        trainable = sum(s.shapes[i].numel() for s in self.segments for i in range(len(s.params)) if s.trainable[i])
        state = state_tensors(optimizers)
        in_ram = [t for t in state if not self.store.owns(t)]
        masters = [s.master for s in self.segments if s.master is not None and not s.master_is_full_slice]
        held = {
            "params": self._param_bytes(),
            "grads": self._grad_bytes(),
            "optimizer_state": nbytes(in_ram) + nbytes(m for m in masters if not self.store.owns(m)),
            "frozen_params": self._frozen_bytes(),
            "comm_buffers": self._comm_buffer_bytes(),
            "offloaded_to_disk": nbytes(t for t in state if self.store.owns(t))
            + nbytes(m for m in masters if self.store.owns(m)),
        }
        p = self.segments[0].full.element_size() if self.segments else 4
        k = state_bytes_per_element(optimizers, state, sum(s.shard_numel for s in self.segments if s.has_trainable))
        k += 4 if p < 4 else 0  # fp32 master copies of low-precision parameters
        n = self.world
        # Reduced gradient slices are kept in fp32 (g = 4) even for bf16/fp16 parameters, so that accumulation
        # over micro-batches does not round; the paper counts them at the parameters' width (2Ψ/N).
        g = max(p, 4)
        # Under expert parallelism the experts' segments are sharded over the ranks that hold the same experts.
        experts = sum(
            s.shapes[i].numel() for s in self.segments if s.expert for i in range(len(s.params)) if s.trainable[i]
        )
        dense, ne = trainable - experts, self.expert_world
        predicted = self._predicted(p, g, dense, n)
        if experts:
            predicted = {key: v + self._predicted(p, g, experts, ne)[key] for key, v in predicted.items()}
        predicted["optimizer_state"] = k * (dense / n + experts / ne)
        predicted["frozen_params"] = self._frozen_predicted()
        report = memory_report_dict(self.name, trainable, n, p, k, held, predicted, self.store.mode)
        if self.topology.ep_size > 1:
            report["experts"] = expert_report([q for s in self.segments if s.expert for q in s.params], self.topology)
        pieces = [b - a for _, layout, _ in self._optimizers for ps in layout for _, a, b in ps]
        grads = max((s.shapes[i].numel() * p for s in self.segments for i in range(len(s.params))), default=0)
        chunk = (
            min(int(2 * self.opts.offload_chunk_mb * 2**20), held["offloaded_to_disk"])
            if self.store.mode == "disk"
            else 0
        )
        report = expected_peak(report, optimizers, max(pieces, default=0), grads if self.params_whole else 0, chunk)
        owners = sum(plan.transient_bytes() for plan in self._plans(optimizers))  # a step's whole copies
        report["transient"] += owners
        report["expected_peak"] += owners
        report["pool_bytes"] = self.comm.pool.nbytes  # the buffers' pool now; comm_buffers is the plan's peak of it
        return report

    def _predicted(self, p: int, g: int, psi: int, n: int) -> dict[str, float]:
        """The ZeRO paper's bytes per rank for parameters and gradients (p, g: bytes per element; psi: trainable
        elements; n: ranks)."""
        raise NotImplementedError

    def _param_bytes(self) -> int:
        return sum(s.full.numel() * s.full.element_size() for s in self.segments)

    def _frozen(self) -> list[nn.Parameter]:
        return [p for ms in self._models.values() for p in ms.params if not p.requires_grad]

    def _frozen_bytes(self) -> int:
        """Frozen parameters held here: whole where they are in no segment (zero1/2), this rank's shard of the frozen
        segments (zero3). Neither has an fp32 master, a gradient or optimizer state."""
        whole = sum(p.numel() * p.element_size() for p in self._frozen() if p not in self._loc)
        return whole + sum(
            s.shard_param.numel() * s.shard_param.element_size()
            for s in self.segments
            if not s.has_trainable and s.shard_param is not None and not self.store.owns(s.shard_param)
        )

    def _frozen_predicted(self) -> float:
        """Frozen parameters' bytes: whole on every rank (zero1/2), or over the ranks that shard them (zero3)."""
        frozen = self._frozen()
        if self.params_whole:
            return float(sum(p.numel() * p.element_size() for p in frozen))
        return sum(
            self._loc[p][0].shapes[self._loc[p][1]].numel()
            * p.element_size()
            / (self.expert_world if is_expert(p) else self.world)
            for p in frozen
        )

    def _grad_bytes(self) -> int:
        return segment_grad_bytes(self.segments)

    def _comm_buffer_bytes(self) -> int:
        return 0
