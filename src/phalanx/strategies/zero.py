"""ZeRO stages 1-3: optimizer state, gradients and parameters sharded over the data-parallel ranks.

Layout. Parameters are packed into flat *segments*: gradient buckets in reverse parameter order for
zero1/zero2 (as ddp's buckets), and one segment per unit and dtype for zero3. Each segment is padded to a
multiple of the data-parallel size N, and rank r owns the contiguous slice ``[r*s, (r+1)*s)`` of it
(s = padded/N). The optimizer steps fp32 *master* copies of the rank's slices only, so its state exists
for 1/N of the model. The user's optimizer is kept: its param groups are given the rank's pieces of the
slices that belong to each group, so each group keeps its own lr and weight decay. This is exact for
elementwise optimizers (SGD, Adam, AdamW, ...), which are the ones accepted.

- zero1: gradients accumulate in full flat buffers (``param.grad`` is a view, as in ddp). At the end of an
  accumulation window they are reduce-scattered, each rank steps its slice, and the parameters are
  all-gathered back into the flat buffers that the model's parameters view.
- zero2: as zero1, but each bucket is reduce-scattered as soon as backward fills it, and the full gradient
  is dropped: only the rank's fp32 gradient slice persists. This happens on every backward, also inside
  accumulation windows and ``no_sync`` (keeping full gradients until the boundary would be zero1).
- zero3: parameters are sharded at rest too. A unit (by default each child module that holds parameters,
  looking inside ModuleList/Sequential/ModuleDict) is all-gathered before its forward and freed after it,
  gathered again when backward reaches it and freed when its backward is done, when its gradients are
  reduce-scattered. The next unit is prefetched. Parameters shared by two units (tied embeddings) and
  those of no unit belong to the root unit, which stays gathered from the forward to the end of backward.
  Reduce-scatters happen on every backward, as for zero2.

Collectives. ``zero_collectives="native"`` uses reduce-scatter and all-gather (the ZeRO traffic: 2Ψ(N-1)/N
per step for zero1/2, 3Ψ(N-1)/N for zero3). On gloo these are about three times slower than an all-reduce
of the same buffer (measured: 81 and 76 ms against 25 ms for 33.6 MB on 2 ranks), so ``auto`` (the
default) emulates both with all-reduce on gloo (reduce-scatter: all-reduce and keep the slice; all-gather:
all-reduce of a zeroed buffer holding the rank's slice), and uses the native ones on NCCL.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
import warnings
from typing import Any, Callable, ClassVar, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils import _pytree as pytree

from phalanx.comm import broadcast_coalesced
from phalanx.strategies.base import ShardEntry, StateReader, Strategy, optimizer_list, read_into, read_optimizer_state
from phalanx.strategies.ddp import (
    _check_same_model,
    _group_rank0,
    _keys_by_param,
    _load_whole_tensors,
    _named_tensors,
    _whole,
)
from phalanx.strategies.offload import StateStore

__all__ = ["Zero1Strategy", "Zero2Strategy", "Zero3Strategy", "check_optimizer"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# torch.optim classes whose update of each element depends only on that element's gradient and state.
_ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam", "ASGD", "Rprop"}
_NOT_ELEMENTWISE = {
    "LBFGS": "runs a line search over the whole parameter vector with a closure",
    "SparseAdam": "needs sparse gradients",
    "Adafactor": "keeps factored row and column statistics of each whole tensor",
    "Muon": "orthogonalises each whole weight matrix",
    "Lamb": "scales each tensor's update by a trust ratio of whole-tensor norms",
    "LAMB": "scales each tensor's update by a trust ratio of whole-tensor norms",
    "Lars": "scales each tensor's update by a trust ratio of whole-tensor norms",
    "LARS": "scales each tensor's update by a trust ratio of whole-tensor norms",
    "Shampoo": "preconditions each whole tensor with matrix statistics",
}


def check_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool, whole: str = "strategy='ddp'") -> None:
    """Refuse optimizers whose update is not elementwise: a shard's update would silently differ. ``whole`` is the
    setting that keeps the optimizer state whole, for the error."""
    cls = type(optimizer)
    name = cls.__name__
    fix = f"use {whole} for {name}"
    if name in _NOT_ELEMENTWISE:
        raise ValueError(
            f"zero strategies cannot shard {name}: it {_NOT_ELEMENTWISE[name]}, but ZeRO steps each rank's "
            f"slice of a flat buffer on its own, which is exact only for elementwise optimizers such as SGD, "
            f"Adam and AdamW ({fix})"
        )
    if cls.__module__.startswith("torch.optim") and name in _ELEMENTWISE:
        return
    if not allow_untested:
        raise ValueError(
            f"zero strategies have not been checked with {cls.__module__}.{name}. ZeRO steps each rank's slice of a "
            "flat buffer on its own, which is exact only when every element's update depends on its own gradient "
            "and state alone (SGD, Adam, AdamW). If that holds for this optimizer, pass "
            f"zero_allow_untested_optimizer=True; if it uses per-tensor norms or shapes, {fix}"
        )


# ---------------------------------------------------------------------------------------------- segments
class _Segment:
    """A flat run of same-dtype parameters, padded to a multiple of N; this rank owns ``[lo, hi)`` of it."""

    def __init__(self, index: int, params: list[nn.Parameter], world: int, rank: int) -> None:
        self.index = index
        self.params = params
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.offsets: list[int] = []
        self.shapes = [p.shape for p in params]  # zero3 swaps in empty tensors while a unit is freed
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.padded = -(-offset // world) * world
        self.shard_numel = self.padded // world
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.trainable = [p.requires_grad for p in params]
        self.full = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for i, p in enumerate(params):
                self.view_of(i, self.full).copy_(p.detach())
                p.data = self.view_of(i, self.full)  # the original storage is released as we go
        self.attach_views()
        # Set by the strategy:
        self.master: torch.Tensor | None = None  # fp32 slice the optimizer steps (None: nothing trainable)
        self.master_is_full_slice = False  # master is a view of full[lo:hi] (zero1/2, fp32, no offload)
        self.master_grad: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []  # zero1: each parameter's .grad, a view into grad_full
        self.shard_param: torch.Tensor | None = None  # zero3: the at-rest slice in the parameters' dtype
        self.pending = 0
        self.ready: list[bool] = []
        self.owner: _ModelState | None = None
        self.work: Any = None
        self.work_out: torch.Tensor | None = None

    @property
    def has_trainable(self) -> bool:
        return any(self.trainable)

    def view_of(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        shape, o = self.shapes[i], self.offsets[i]
        return flat[o : o + shape.numel()].view(shape)

    def attach_views(self) -> None:
        for i, p in enumerate(self.params):
            p.data = self.view_of(i, self.full)
        self.pointers = [p.data_ptr() for p in self.params]

    def param_runs(self, a: int, b: int) -> Iterator[tuple[int, int, int, int, int]]:
        """For shard range ``[a, b)``: (param index, start, stop in the flattened param, start, stop in the shard)."""
        for i, o in enumerate(self.offsets):
            ga, gb = max(o, self.lo + a), min(o + self.shapes[i].numel(), self.lo + b)
            if ga < gb:
                yield i, ga - o, gb - o, ga - self.lo, gb - self.lo

    def local_runs(self, params: set[nn.Parameter] | None = None) -> list[tuple[int, int, int]]:
        """(param index, start, stop) in shard coordinates for each trainable parameter's part of this slice."""
        runs = []
        for i, (p, o) in enumerate(zip(self.params, self.offsets)):
            if not self.trainable[i] or (params is not None and p not in params):
                continue
            a, b = max(o, self.lo), min(o + self.shapes[i].numel(), self.hi)
            if a < b:
                runs.append((i, a - self.lo, b - self.lo))
        return runs


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once backward has passed through the whole unit."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.callback()
        return (None, *grads)


class _Unit:
    """zero3: a module whose parameters are gathered together around its forward and its backward."""

    FREE, GATHERING, GATHERED = 0, 1, 2

    def __init__(self, index: int, module: nn.Module, name: str, segments: list[_Segment], is_root: bool) -> None:
        self.index, self.module, self.name, self.segments, self.is_root = index, module, name, segments, is_root
        self.state = _Unit.FREE
        self.works: list[Any] = []
        self.touched = False  # backward reached it in the running backward pass
        self.owner: _ModelState | None = None

    @property
    def full_bytes(self) -> int:
        return sum(s.padded * s.full.element_size() for s in self.segments)


class _ModelState:
    """One prepared model: its segments (and zero3 units), and where its running backward stands."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], segments: list[_Segment]) -> None:
        self.model, self.params, self.segments = model, params, segments
        self.units: list[_Unit] = []
        self.next_segment = 0  # zero1/2: the next bucket to launch, in order
        self.touched = False  # got gradients in the running backward
        self.reduced = False  # reduced at a window's end, and not yet consumed by a step or zero_grad
        self.order: list[_Unit] = []  # zero3: units in the order the first forward ran them (for prefetch)
        self.order_fixed = False


# ---------------------------------------------------------------------------------------------- strategy
class _ZeroStrategy(Strategy):
    stage: ClassVar[int]
    shards_gradients: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        topo, cfg = self.topology, self.config
        self.group, self.world, self.rank = topo.dp_group, topo.dp_size, topo.dp_rank
        if self.world == 1:
            what, fix = self._no_sharding_hint()
            warnings.warn(
                f"{what} on one data-parallel rank shards nothing: it trains correctly but saves no memory ({fix})",
                stacklevel=3,
            )
        mode = cfg.zero_collectives
        if mode == "auto":
            mode = "allreduce" if (dist.is_initialized() and dist.get_backend(self.group) == "gloo") else "native"
        self.collectives = mode
        self.comm_dtype_ = _DTYPES[cfg.comm_dtype] if cfg.comm_dtype else None
        if cfg.offload != "none" and self.device.type == "cuda" and self.precision.scaler is not None:
            raise ValueError(
                f"offload={cfg.offload!r} with precision='fp16-mixed' on CUDA is not supported: the loss scaler checks "
                "gradients on the GPU, and offloaded gradient shards live on the host. Use precision='bf16-mixed' "
                "(no loss scaling needed) with offload, or offload='none' with fp16"
            )
        self.store = StateStore(cfg.offload, self.device, cfg.offload_dir, rank=topo.rank)
        self.segments: list[_Segment] = []
        self.units: list[_Unit] = []
        self._loc: dict[nn.Parameter, tuple[_Segment, int]] = {}
        self._names: dict[nn.Parameter, str] = {}
        self._models: dict[int, _ModelState] = {}
        self._optimizers: list[tuple[torch.optim.Optimizer, list[list[tuple[_Segment, int, int]]], set[nn.Parameter]]] = []
        self.require_sync = True
        self.grad_scale: float | torch.Tensor = 1.0 / self.world
        self._callback_queued = False
        self._inflight: list[_Segment] = []
        self._missing: list[str] = []
        self._clean: set[int] = set()  # optimizers whose gradient ranges are zero since their last step
        self._early_gathers: dict[int, _Done] = {}  # segment index -> gather started by a pipelined step
        self._window_seen: set[nn.Parameter] = set()  # zero1: parameters that got a gradient with require_sync off

    _whole_state_setting = "strategy='ddp'"
    """The setting that trains without sharding optimizer state, for errors about optimizers."""

    def _no_sharding_hint(self) -> tuple[str, str]:
        """What shards nothing on one data-parallel rank, and how to fix that, for the warning."""
        return f"strategy {self.name!r}", "launch more processes, e.g. phalanx launch -n 2, or use strategy='ddp'"

    # -------------------------------------------------------------------- collectives
    def _reduce_scatter(self, seg: _Segment, flat: torch.Tensor) -> None:
        """Start summing ``flat`` (the full padded gradient) over ranks; this rank keeps its slice."""
        if self.comm_dtype_ is not None and flat.dtype != self.comm_dtype_:
            flat = flat.to(self.comm_dtype_)
        if self.world == 1:
            seg.work, seg.work_out = None, flat[seg.lo : seg.hi]
        elif self.collectives == "allreduce":
            self.stats.record("all_reduce", flat, self.world)
            seg.work = dist.all_reduce(flat, group=self.group, async_op=True)
            seg.work_out = flat[seg.lo : seg.hi]
        else:
            out = flat.new_empty(seg.shard_numel)
            self.stats.record("reduce_scatter", flat, self.world)
            seg.work = _reduce_scatter_single(out, flat, self.group)
            seg.work_out = out
        self._inflight.append(seg)

    def _finish_reduce(self, seg: _Segment) -> None:
        if seg.work is not None:
            seg.work.wait()
        out, seg.work, seg.work_out = seg.work_out, None, None
        assert out is not None and seg.master_grad is not None
        if out.data_ptr() != seg.master_grad.data_ptr():
            if self.stage == 1:  # zero1's full buffer already held the whole window
                seg.master_grad.copy_(out)
            else:  # zero2/3 add each backward's share (offloaded slices live on the host)
                seg.master_grad.add_(out.to(device=seg.master_grad.device, dtype=seg.master_grad.dtype))
        if self.stage >= 2:
            seg.grad_full = None

    def _wait_inflight(self, keep: int = 0) -> None:
        while len(self._inflight) > keep:
            self._finish_reduce(self._inflight.pop(0))

    def _gather_params(self, seg: _Segment, async_op: bool = False) -> Any:
        """Fill ``seg.full`` with every rank's slice (this rank's from its master or at-rest shard)."""
        src = seg.shard_param if seg.shard_param is not None else seg.master
        if src is None:
            src = seg.full[seg.lo : seg.hi]  # frozen: nothing changes, but zero3 still needs the whole unit
        wire = self.comm_dtype_ or seg.dtype
        full = seg.full if wire == seg.dtype else torch.empty(seg.padded, dtype=wire, device=seg.device)
        local = src.to(device=seg.device, dtype=wire, non_blocking=True)
        if self.world == 1:
            if local.data_ptr() != full.data_ptr():
                full.copy_(local)
            work = None
        elif self.collectives == "allreduce":
            if local.data_ptr() == full[seg.lo :].data_ptr():
                full[: seg.lo].zero_()
                full[seg.hi :].zero_()
            else:
                full[: seg.lo].zero_()
                full[seg.hi :].zero_()
                full[seg.lo : seg.hi].copy_(local)
            self.stats.record("all_reduce", full, self.world)
            work = dist.all_reduce(full, group=self.group, async_op=True)
        else:
            if local.data_ptr() == full[seg.lo :].data_ptr():
                local = local.clone()
            self.stats.record("all_gather", full, self.world)
            work = _all_gather_single(full, local, self.group)
        done = _Done(work, None if full is seg.full else (lambda: seg.full.copy_(full)))
        if not async_op:
            done.wait()
        return done

    # -------------------------------------------------------------------- model
    def _prepare_common(self, model: nn.Module, sharded: set[nn.Parameter]) -> list[nn.Parameter]:
        """Checks, and rank 0's buffers and unsharded parameters; sharded ones are broadcast flat, in place."""
        if id(model) in self._models:
            raise ValueError(f"{type(model).__name__} was already passed to engine.prepare; prepare each model once")
        if self.world > 1:
            _check_same_model(model, self.group, self.device)
            broadcast_coalesced(
                [t.data for t in model.parameters() if t not in sharded] + list(model.buffers()),
                src=_group_rank0(self.group),
                group=self.group,
                stats=self.stats,
            )
            if self.config.broadcast_buffers and any(True for _ in model.buffers()):
                model.register_forward_pre_hook(self._broadcast_buffers_hook)
        for name, p in model.named_parameters():
            self._names.setdefault(p, name)
        params = list(model.parameters())
        if not any(p.requires_grad for p in params):
            raise ValueError(
                f"{type(model).__name__} has no parameter with requires_grad=True, so there is nothing to train "
                "or shard (unfreeze some parameters, or do not pass this model to engine.prepare)"
            )
        return params

    def _broadcast_buffers_hook(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            with torch.no_grad():
                broadcast_coalesced(list(module.buffers()), src=_group_rank0(self.group), group=self.group, stats=self.stats)

    def _add_segments(self, segments: list[_Segment]) -> None:
        for s in segments:
            if self.world > 1:  # every replica starts from rank 0's values: one in-place broadcast per flat buffer
                self.stats.record("broadcast", s.full)
                dist.broadcast(s.full, src=_group_rank0(self.group), group=self.group)
            s.index = len(self.segments)
            self.segments.append(s)
            for i, p in enumerate(s.params):
                self._loc[p] = (s, i)
            if s.has_trainable:
                self._make_master(s)

    def _register(self, model: nn.Module, params: list[nn.Parameter], segments: list[_Segment]) -> _ModelState:
        state = _ModelState(model, params, segments)
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

    def _make_master(self, seg: _Segment) -> None:
        master_dtype = torch.promote_types(seg.dtype, torch.float32)
        alias = (
            self.stage < 3 and master_dtype == seg.dtype and self.store.mode == "none" and self.comm_dtype_ is None
        )
        if alias:
            seg.master, seg.master_is_full_slice = seg.full[seg.lo : seg.hi], True
        else:
            seg.master = self.store.zeros(seg.shard_numel, master_dtype)
            seg.master.copy_(seg.full[seg.lo : seg.hi])
        if self.stage == 1 and alias and self.collectives == "allreduce":
            seg.grad_full = torch.zeros(seg.padded, dtype=seg.dtype, device=seg.device)
            seg.master_grad = seg.grad_full[seg.lo : seg.hi]  # the all-reduce leaves the slice in place
        else:
            seg.master_grad = torch.zeros(seg.shard_numel, dtype=master_dtype, device=seg.master.device)
            if self.stage == 1:
                seg.grad_full = torch.zeros(seg.padded, dtype=seg.dtype, device=seg.device)
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
        if self.stage < 3:
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
        check_optimizer(optimizer, self.config.zero_allow_untested_optimizer, self._whole_state_setting)
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError(
                f"{type(optimizer).__name__} already has state (it has stepped); {self.name} must shard it before the "
                "first step: call engine.prepare before optimizer.step()"
            )
        max_piece = int(self.config.offload_chunk_mb * 2**20 / 4) if self.store.mode == "disk" else None
        layout: list[list[tuple[_Segment, int, int]]] = []
        seen: set[nn.Parameter] = set()
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
            pieces: list[tuple[_Segment, int, int]] = []
            for seg in self.segments:
                for _, a, b in _merge_runs(seg.local_runs(group_params)):
                    step = max_piece or (b - a)
                    pieces.extend((seg, x, min(x + step, b)) for x in range(a, b, step))
            layout.append(pieces)
            group["params"] = [self._piece(seg, a, b) for seg, a, b in pieces]
        if not any(layout):
            # This rank's slices hold none of this optimizer's elements. A zero-size piece keeps the rank in
            # step with the others (fp16 overflow checks are all-reduced per optimizer).
            placeholder = nn.Parameter(torch.zeros(0, device=self.store.device))
            placeholder.grad = torch.zeros(0, device=self.store.device)
            optimizer.param_groups[0]["params"] = [placeholder]
        optimizer.state.clear()
        self._optimizers.append((optimizer, layout, seen))
        if self.store.mode == "disk":
            _chunk_steps(optimizer, self.store, self.config.offload_chunk_mb)
        return optimizer

    @staticmethod
    def _piece(seg: _Segment, a: int, b: int) -> nn.Parameter:
        assert seg.master is not None and seg.master_grad is not None
        piece = nn.Parameter(seg.master[a:b])
        piece.grad = seg.master_grad[a:b]
        return piece

    def _entry(self, optimizer: torch.optim.Optimizer) -> tuple[list[tuple[_Segment, int, int]], set[nn.Parameter]]:
        optimizer = getattr(optimizer, "optimizer", optimizer)
        for opt, layout, params in self._optimizers:
            if opt is optimizer:
                return [piece for pieces in layout for piece in pieces], params
        return [], set()

    def _attach_piece_grads(self) -> None:
        for opt, layout, _ in self._optimizers:
            for group, pieces in zip(opt.param_groups, layout):
                for piece, (seg, a, b) in zip(group["params"], pieces):
                    if piece.grad is None:
                        assert seg.master_grad is not None
                        piece.grad = seg.master_grad[a:b]

    def _zero_ranges(
        self, ranges: list[tuple[_Segment, int, int]], optimizer: torch.optim.Optimizer | None, params: Iterable[nn.Parameter]
    ) -> None:
        """Zero the reduced slices in ``ranges`` and, for zero1, the whole gradients of ``params``."""
        for seg, a, b in ranges:
            if seg.master_grad is not None:
                seg.master_grad[a:b].zero_()
        if self.stage == 1:
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
        self._zero_ranges(ranges, optimizer, params)
        # From the parameters, not from this rank's pieces: a rank that holds none of a segment must still
        # take part in gathering it.
        segments = sorted({id(seg): seg for seg, _ in (self._loc[p] for p in params if p in self._loc)}.values(), key=lambda seg: seg.index)
        if self.stage < 3:
            early, self._early_gathers = self._early_gathers, {}
            if self.comm_dtype_ is None:
                works = [early.pop(seg.index, None) or self._gather_params(seg, async_op=True) for seg in segments]
                for w in works + list(early.values()):
                    w.wait()
            else:  # one full-size conversion buffer at a time
                for seg in segments:
                    self._gather_params(seg)
        else:
            for seg in segments:
                if seg.shard_param is not None and seg.master is not None:
                    seg.shard_param.copy_(seg.master)
        self.store.release()

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
        self.grad_scale = scale

    def _queue_final_callback(self, ms: _ModelState) -> None:
        if ms.reduced:
            raise RuntimeError(
                f"a second backward reached gradients that {self.name} already reduced in this step. Step or zero the "
                "optimizer between backwards, put the earlier backwards under engine.no_sync() (or "
                "engine.accumulate()), and use activation checkpointing with use_reentrant=False"
            )
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
        self._wait_inflight()
        if self.require_sync:
            scale = self.grad_scale
            if self.stage >= 2 and not (isinstance(scale, float) and scale == 1.0):
                # zero2/3 added up each backward's reduced share unscaled; the window's factor applies once here.
                for ms in touched:
                    for seg in ms.segments:
                        if seg.master_grad is not None:
                            seg.master_grad.mul_(scale.to(seg.master_grad.device) if isinstance(scale, torch.Tensor) else scale)
            self.grad_scale = 1.0 / self.world
            for ms in touched:
                ms.reduced = True
        for ms in touched:
            ms.touched = False
        missing, self._missing = self._missing, []
        if missing and not self.config.find_unused_parameters:
            raise RuntimeError(
                f"these trainable parameters received no gradient in this backward pass: {', '.join(missing)}. "
                f"{self.name} reduces every parameter with requires_grad=True. Make sure the forward uses them, "
                "freeze them with requires_grad_(False) before engine.prepare, or set find_unused_parameters=True"
            )

    def _finish_backward_reductions(self, ms: _ModelState) -> None:
        raise NotImplementedError

    def finish_gradient_sync(self) -> None:
        self._wait_inflight()
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
        slices = []
        for s in self.segments:
            if s.master_grad is not None:
                slices += [s.master_grad[a:b] for _, a, b in s.local_runs(wanted)]
        norm_type = float(norm_type)
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
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in slices:
            g.mul_(coef.to(g.device))
        return total

    def _all_reduce_norm(self, total: torch.Tensor, op: Any) -> None:
        """Combine the ranks' parts of the gradient norm (``total``: a max, or a sum of powers) in place."""
        if self.world > 1:
            dist.all_reduce(total, op=op, group=self.group)

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
        self.finish_gradient_sync()
        segments = self._models[id(model)].segments
        entries = []
        for s in segments:
            at_rest = self._at_rest(s)
            for i, pa, pb, xa, xb in s.param_runs(0, s.shard_numel):
                name, shape = self._names[s.params[i]], tuple(s.shapes[i])
                entries.append(ShardEntry(f"model/{name}", shape, pa, pb, at_rest[xa:xb].detach()))
                if s.master is not None and s.master.dtype != s.dtype and s.trainable[i]:
                    entries.append(ShardEntry(f"optim/{name}/master", shape, pa, pb, s.master[xa:xb].detach()))
        if self.rank == 0:
            ours = {p for s in segments for p in s.params}
            entries += [_whole(f"model/{k}", v) for k, v in _named_tensors(model) if v not in ours]
        for opt, group, piece, (seg, a, b) in self._pieces_of(model, optimizers):
            state = opt.state.get(piece, {})
            for i, pa, pb, xa, xb in seg.param_runs(a, b):
                name, shape = self._names[seg.params[i]], tuple(seg.shapes[i])
                for k, v in state.items():
                    if not isinstance(v, torch.Tensor):
                        continue
                    if v.shape == piece.shape:
                        entries.append(ShardEntry(f"optim/{name}/{k}", shape, pa, pb, v[xa - a : xb - a].detach()))
                    elif v.dim() == 0 and pa == 0:  # per-tensor scalars (step): from the rank holding element 0
                        entries.append(_whole(f"optim/{name}/{k}", v))
        return entries

    def _pieces_of(self, model: nn.Module, optimizers: Any) -> Iterator[tuple[torch.optim.Optimizer, dict[str, Any], nn.Parameter, tuple[_Segment, int, int]]]:
        """(optimizer, param group, piece, (segment, start, stop)) of every piece of ``optimizers`` in ``model``'s segments."""
        wanted, owner = optimizer_list(optimizers), self._models[id(model)]
        for opt, layout, _ in self._optimizers:
            if not any(opt is o for o in wanted):
                continue
            for group, pieces in zip(opt.param_groups, layout):
                for piece, where in zip(group["params"], pieces):
                    if where[0].owner is owner:
                        yield opt, group, piece, where

    def state_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        shapes = {self._names[p]: tuple(s.shapes[i]) for s in self._models[id(model)].segments for i, p in enumerate(s.params)}
        return {name: shapes.get(name, tuple(t.shape)) for name, t in _named_tensors(model)}

    def _at_rest(self, s: _Segment) -> torch.Tensor:
        """This rank's slice of the segment's parameter values, in their dtype."""
        if self.stage < 3:
            return s.full[s.lo : s.hi]
        return s.shard_param if s.shard_param is not None else s.master  # type: ignore[return-value]

    def load_sharded_state(self, model: nn.Module, optimizers: Any, reader: StateReader) -> None:
        """Read exactly this rank's slices: no rank ever holds more than its shard plus one slice in transit."""
        self.finish_gradient_sync()
        segments = self._models[id(model)].segments
        available = set(reader.keys())
        problems = []
        for s in segments:
            for i, shape in enumerate(s.shapes):
                key = f"model/{self._names[s.params[i]]}"
                if key not in available:
                    problems.append(f"{key[6:]}: not in the checkpoint")
                elif tuple(reader.shape(key)) != tuple(shape):
                    problems.append(f"{key[6:]}: shape {tuple(reader.shape(key))} in the checkpoint, {tuple(shape)} in the model")
        if problems:
            raise ValueError("the checkpoint does not match the model: " + "; ".join(problems[:5]))
        with torch.no_grad():
            for s in segments:
                at_rest = self._at_rest(s)
                for i, pa, pb, xa, xb in s.param_runs(0, s.shard_numel):
                    name = self._names[s.params[i]]
                    read_into(reader, f"model/{name}", pa, pb, at_rest[xa:xb])
                    if s.master is not None and s.master.data_ptr() != at_rest.data_ptr():
                        master_key = f"optim/{name}/master"
                        if master_key in available:
                            read_into(reader, master_key, pa, pb, s.master[xa:xb])
                        else:
                            s.master[xa:xb].copy_(at_rest[xa:xb])
            ours = {p for s in segments for p in s.params}
            _load_whole_tensors(model, reader, skip=ours)
        if self.stage < 3:
            for w in [self._gather_params(s, async_op=True) for s in segments]:
                w.wait()
        keys = _keys_by_param(reader)
        for opt, group, piece, (seg, a, b) in self._pieces_of(model, optimizers):
            runs = [(self._names[seg.params[i]], pa, pb, xa, xb) for i, pa, pb, xa, xb in seg.param_runs(a, b)]
            # A piece may span parameters whose state differs (one never got a gradient): the union of the kinds,
            # zeros where a parameter has none.
            kinds = list(dict.fromkeys(k for name, *_ in runs for k in keys.get(name, []) if k != "master"))
            state: dict[str, Any] = {}
            for k in kinds:
                holders = [r for r in runs if k in keys.get(r[0], [])]
                if reader.shape(f"optim/{holders[0][0]}/{k}") == ():  # a per-tensor scalar (step)
                    state[k] = read_optimizer_state(reader, f"optim/{holders[0][0]}/{k}", piece, group)
                    continue
                # On disk with offload=disk. Padding past the last parameter is in no run: it must be zero.
                covered = len(holders) == len(runs) and sum(xb - xa for *_, xa, xb in runs) == b - a
                buf = (self.store.empty if covered else self.store.zeros)(piece.numel(), piece.dtype)
                for name, pa, pb, xa, xb in holders:
                    read_into(reader, f"optim/{name}/{k}", pa, pb, buf[xa - a : xb - a])
                state[k] = buf
            if state:
                opt.state[piece] = state
        self.store.release()

    def _gathered_cpu_params(self, model: nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        segments = self._models[id(model)].segments
        return {p: p.detach().to("cpu", copy=True) for s in segments for p in s.params}

    def comm_dtype(self) -> torch.dtype | None:
        if self.world == 1 or not self.segments:
            return None
        return self.comm_dtype_ or self.segments[0].dtype

    def describe(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "segments": len(self.segments),
            "segment_numel": [s.numel for s in self.segments],
            "padded_numel": [s.padded for s in self.segments],
            "units": [u.name for u in self.units],
            "collectives": self.collectives,
            "offload": self.store.mode,
        }

    # -------------------------------------------------------------------- memory
    def memory_report(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        trainable = sum(s.shapes[i].numel() for s in self.segments for i in range(len(s.params)) if s.trainable[i])
        state = _state_tensors(optimizers)
        in_ram = [t for t in state if not self.store.owns(t)]
        masters = [s.master for s in self.segments if s.master is not None and not s.master_is_full_slice]
        held = {
            "params": self._param_bytes(),
            "grads": self._grad_bytes(),
            "optimizer_state": _nbytes(in_ram) + _nbytes(m for m in masters if not self.store.owns(m)),
            "comm_buffers": self._comm_buffer_bytes(),
            "offloaded_to_disk": _nbytes(t for t in state if self.store.owns(t)) + _nbytes(m for m in masters if self.store.owns(m)),
        }
        p = self.segments[0].full.element_size() if self.segments else 4
        k = _state_bytes_per_element(optimizers, state, sum(s.shard_numel for s in self.segments if s.has_trainable))
        k += 4 if p < 4 else 0  # fp32 master copies of low-precision parameters
        n = self.world
        # Reduced gradient slices are kept in fp32 (g = 4) even for bf16/fp16 parameters, so that accumulation
        # over micro-batches does not round; the paper counts them at the parameters' width (2Ψ/N).
        g = max(p, 4)
        per_stage = {
            1: {"params": p * trainable, "grads": p * trainable + (g * trainable / n if p < 4 else 0)},
            2: {"params": p * trainable, "grads": g * trainable / n},
            3: {"params": p * trainable / n, "grads": g * trainable / n},
        }[self.stage]
        per_stage["optimizer_state"] = k * trainable / n
        return _report(self.name, trainable, n, p, k, held, per_stage, self.store.mode)

    def _param_bytes(self) -> int:
        return sum(s.full.numel() * s.full.element_size() for s in self.segments)

    def _grad_bytes(self) -> int:
        total = 0
        for s in self.segments:
            if s.grad_full is not None:
                total += s.grad_full.numel() * s.grad_full.element_size()
            if s.master_grad is not None and not (s.grad_full is not None and s.master_grad.data_ptr() == s.grad_full[s.lo :].data_ptr()):
                total += s.master_grad.numel() * s.master_grad.element_size()
        return total

    def _comm_buffer_bytes(self) -> int:
        return 0


class _Done:
    """A collective's handle plus what to do once it has finished."""

    def __init__(self, work: Any, then: Callable[[], Any] | None) -> None:
        self.work, self.then = work, then

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.then is not None:
            self.then()
            self.then = None


class _BucketedZero(_ZeroStrategy):
    """zero1 and zero2: the parameters stay whole; gradients are reduced bucket by bucket in backward."""

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer = super().wrap_optimizer(optimizer)
        if self.world > 1 and self.store.mode != "disk" and self.comm_dtype_ is None:
            self._pipeline_steps(optimizer)
        return optimizer

    def _pipeline_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Step one bucket at a time, first layers first, and start each bucket's all-gather as soon as its
        slice is updated, so that the gathers overlap the rest of the step."""
        step = optimizer.step
        layout, params = self._optimizers[-1][1], self._optimizers[-1][2]
        segments = sorted({seg.index: seg for seg, _ in (self._loc[p] for p in params if p in self._loc)}.values(),
                          key=lambda seg: -seg.index)  # buckets are in reverse order: the last one holds the first layers

        def pipelined_step(*args: Any, **kwargs: Any) -> Any:
            groups = [g["params"] for g in optimizer.param_groups]
            parts = [
                (target, [[piece for piece, (seg, _, _) in zip(ps, pieces) if seg is target] for ps, pieces in zip(groups, layout)])
                for target in segments
            ]

            def gather(seg: _Segment) -> None:
                self._early_gathers[seg.index] = self._gather_params(seg, async_op=True)

            return _step_in_parts(optimizer, lambda: step(*args, **kwargs), parts, gather)

        _replace_step(optimizer, pipelined_step)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        trainable = [p for p in model.parameters() if p.requires_grad]
        params = self._prepare_common(model, set(trainable))
        segments = []
        for bucket in _buckets(trainable[::-1], int(self.config.bucket_mb * 2**20)):
            segments.append(_Segment(0, bucket, self.world, self.rank))
            self._add_segments(segments[-1:])
        self._register(model, params, segments)
        for s in segments:
            s.ready = [False] * len(s.params)
            s.pending = len(s.params)
            if self.stage == 1:
                for i, p in enumerate(s.params):
                    p.grad = s.grad_views[i]
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        return model

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        seg, i = self._loc[param]  # type: ignore[index]
        grad = param.grad
        assert grad is not None
        ms = seg.owner
        assert ms is not None
        if self.stage == 1:
            view = seg.grad_views[i]
            if grad is not view:  # gradients were dropped (after a step, or set_to_none): move autograd's tensor in
                view.copy_(grad)
                param.grad = view
            if not self.require_sync:
                self._clean.clear()
                self._window_seen.add(param)  # type: ignore[arg-type]
                return
        else:
            if seg.grad_full is None:
                seg.grad_full = _padded_empty(seg)
            seg.view_of(i, seg.grad_full).copy_(grad)
            param.grad = None  # only this rank's slice of the reduced gradient is kept
        self._queue_final_callback(ms)
        if not seg.ready[i]:
            seg.ready[i] = True
            seg.pending -= 1
            if seg.pending == 0:
                self._launch_ready(ms)

    def _launch_ready(self, ms: _ModelState) -> None:
        # Strictly in segment order, so that every rank issues the same collectives in the same order.
        while ms.next_segment < len(ms.segments) and ms.segments[ms.next_segment].pending == 0:
            seg = ms.segments[ms.next_segment]
            assert seg.grad_full is not None
            if self.stage == 1:
                # The window is complete and its factor known: scale before the reduction, as ddp does, so that
                # an all-reduced buffer holds the mean.
                scale = self.grad_scale
                if not (isinstance(scale, float) and scale == 1.0):
                    seg.grad_full.mul_(scale)
            self._reduce_scatter(seg, seg.grad_full)
            ms.next_segment += 1
            if self.stage >= 2:
                self._wait_inflight(keep=1)  # bound the full-size gradient buffers alive at once

    def _finish_backward_reductions(self, ms: _ModelState) -> None:
        for s in ms.segments:
            if not s.pending:
                continue
            for i, p in enumerate(s.params):
                if s.ready[i]:
                    continue
                if p.requires_grad:
                    self._missing.append(self._names.get(p, "?"))
                else:
                    self._missing.append(f"{self._names.get(p, '?')} (frozen after engine.prepare: freeze before it)")
                if self.stage == 1:
                    view = s.grad_views[i]
                    if p.grad is not view:
                        view.zero_()
                        p.grad = view
                else:
                    if s.grad_full is None:
                        s.grad_full = _padded_empty(s)
                    s.view_of(i, s.grad_full).zero_()
            s.pending = 0
        # Launch and wait even when about to raise: peers that did see these gradients wait in the same collectives.
        self._launch_ready(ms)
        for s in ms.segments:
            s.ready = [False] * len(s.params)
            s.pending = len(s.params)
        ms.next_segment = 0

    def reduce_window(self) -> None:
        """zero1 for a driver that ran every backward of the window with ``require_sync`` off (the pipeline
        schedule): the window's gradients are complete in the bucket buffers, so reduce-scatter them all now.
        Ends as the backward of a synced window would: reduced slices in place, unused parameters reported."""
        assert self.stage == 1
        for ms in self._models.values():
            if ms.reduced:
                raise RuntimeError(
                    f"{self.name} already reduced this step's gradients; step or zero the optimizer before the next step"
                )
            for s in ms.segments:
                s.ready = [p in self._window_seen for p in s.params]
                s.pending = s.ready.count(False)
            ms.touched = True
        self._window_seen.clear()
        self._finalize_backward()

    def _comm_buffer_bytes(self) -> int:
        if self.stage == 1 or not self.segments:
            return 0
        sizes = sorted((s.padded * s.full.element_size() for s in self.segments), reverse=True)
        return sum(sizes[:2])  # up to two full-size bucket gradients are alive during backward


class Zero1Strategy(_BucketedZero):
    """``strategy="zero1"``: optimizer state sharded; gradients reduce-scattered once per optimizer step."""

    name = "zero1"
    stage = 1


class Zero2Strategy(_BucketedZero):
    """``strategy="zero2"``: optimizer state and gradients sharded; buckets reduce-scattered during backward."""

    name = "zero2"
    stage = 2


class Zero3Strategy(_ZeroStrategy):
    """``strategy="zero3"``: parameters, gradients and optimizer state all sharded; units gathered on demand."""

    name = "zero3"
    stage = 3

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._empty: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def wrap_model(self, model: nn.Module) -> nn.Module:
        params = self._prepare_common(model, set(model.parameters()))
        unit_modules = _unit_modules(model, self.config.zero3_unit_classes)
        owners: dict[nn.Parameter, set[int]] = {}
        for ui, (_, m) in enumerate(unit_modules):
            for p in m.parameters():
                owners.setdefault(p, set()).add(ui)
        members: list[list[nn.Parameter]] = [[] for _ in unit_modules]
        root_params: list[nn.Parameter] = []
        for p in params:
            where = owners.get(p, set())
            (members[next(iter(where))] if len(where) == 1 else root_params).append(p)
        units: list[_Unit] = []
        all_segments: list[_Segment] = []
        # One unit at a time: lay out, take rank 0's values, keep this rank's slice, free the rest. Only one
        # unit is ever whole here, beside the not yet sharded parameters the user built.
        for (name, module), ps in [(("<root>", model), root_params)] + list(zip(unit_modules, members)):
            segs = [_Segment(0, group, self.world, self.rank) for group in _by_dtype(ps)]
            self._add_segments(segs)
            for seg in segs:
                # The at-rest slice is the fp32 master itself when the dtypes agree (on the host with offload);
                # otherwise a copy in the parameters' dtype, in the offload tier when there is one.
                keeps_slice = seg.master is not None and seg.master.dtype == seg.dtype
                seg.shard_param = None if keeps_slice else self.store.copy_of(seg.full[seg.lo : seg.hi])
            all_segments += segs
            unit = _Unit(len(self.units) + len(units), module, name, segs, is_root=module is model)
            self._free(unit)
            if segs or unit.is_root:
                units.append(unit)
        state = self._register(model, params, all_segments)
        state.units = units
        root = units[0]
        for u in units:
            u.owner = state
            self.units.append(u)
            if not u.is_root:
                u.module.register_forward_pre_hook(self._make_pre_forward(u), with_kwargs=True, prepend=True)
                u.module.register_forward_hook(self._make_post_forward(u))
        model.register_forward_pre_hook(self._make_root_pre_forward(root), prepend=True)
        model.register_forward_hook(self._make_root_post_forward(root))
        forward = model.forward

        @functools.wraps(forward)
        def explained_forward(*args: Any, **kwargs: Any) -> Any:
            try:
                return forward(*args, **kwargs)
            except RuntimeError as e:
                raise RuntimeError(
                    f"{e}\n(zero3: outside its own module's forward, a parameter of a zero3 unit is an empty tensor. "
                    "If this forward uses another module's parameter directly, e.g. F.linear(h, self.wte.weight), "
                    "make it a parameter of the module that uses it (self.head.weight = self.wte.weight), or choose "
                    "units with zero3_unit_classes so that both modules sit in one unit)"
                ) from e

        model.forward = explained_forward  # type: ignore[method-assign]
        return model

    # ---- gather / free
    def _gather(self, unit: _Unit) -> None:
        if unit.state == _Unit.FREE:
            for s in unit.segments:
                s.full.untyped_storage().resize_(s.padded * s.full.element_size())
                s.attach_views()
            unit.works = [self._gather_params(s, async_op=True) for s in unit.segments]
            unit.state = _Unit.GATHERING

    def _wait_gathered(self, unit: _Unit) -> None:
        self._gather(unit)
        if unit.state == _Unit.GATHERING:
            for w in unit.works:
                w.wait()
            unit.works = []
            unit.state = _Unit.GATHERED
            self.store.release()

    def _free(self, unit: _Unit) -> None:
        if unit.state == _Unit.GATHERING:
            for w in unit.works:
                w.wait()
            unit.works = []
        for s in unit.segments:
            empty = self._empty.setdefault((s.dtype, s.device), torch.empty(0, dtype=s.dtype, device=s.device))
            for p in s.params:
                p.data = empty
            s.full.untyped_storage().resize_(0)
        unit.state = _Unit.FREE

    def _prefetch(self, unit: _Unit, step: int) -> None:
        ms = unit.owner
        if ms is None or not (ms.order_fixed and self.config.zero3_prefetch):
            return
        try:
            pos = ms.order.index(unit)
        except ValueError:
            return
        nxt = pos + step
        if 0 <= nxt < len(ms.order):
            self._gather(ms.order[nxt])

    # ---- hooks
    def _make_root_pre_forward(self, root: _Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            ms = root.owner
            if ms is not None and ms.order and not ms.order_fixed:
                ms.order_fixed = True  # the second forward on: the first one recorded the order
            self._wait_gathered(root)

        return hook

    def _make_root_post_forward(self, root: _Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if not torch.is_grad_enabled():
                self._free(root)
                return output
            return self._hook_outputs(root, output)

        return hook

    def _make_pre_forward(self, unit: _Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if _in_backward():  # activation checkpointing recomputes this forward: gather, nothing else
                self._wait_gathered(unit)
                return None
            ms = unit.owner
            if ms is not None and not ms.order_fixed and unit not in ms.order:
                ms.order.append(unit)
            self._wait_gathered(unit)
            self._prefetch(unit, +1)
            if not torch.is_grad_enabled():
                return None
            flat, spec = pytree.tree_flatten((args, kwargs))
            idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not idx:
                return None
            passed = _PostBackward.apply(lambda: self._post_backward(unit), *[flat[i] for i in idx])
            for i, t in zip(idx, passed):
                flat[i] = t
            return pytree.tree_unflatten(flat, spec)

        return hook

    def _make_post_forward(self, unit: _Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if _in_backward():  # a recomputation: the unit's own backward is about to use it
                return output
            self._free(unit)
            if not torch.is_grad_enabled():
                return output
            return self._hook_outputs(unit, output)

        return hook

    def _hook_outputs(self, unit: _Unit, output: Any) -> Any:
        for t in pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, u=unit: self._pre_backward(u))
        return output

    def _pre_backward(self, unit: _Unit) -> None:
        assert unit.owner is not None
        self._queue_final_callback(unit.owner)
        unit.touched = True
        if unit.state != _Unit.GATHERED:
            self._wait_gathered(unit)
        self._prefetch(unit, -1)

    def _post_backward(self, unit: _Unit) -> None:
        """Backward is done with ``unit``: reduce-scatter the gradients it got, and free its parameters.

        It may run more than once in a backward (a module called twice, a retained graph): each share of
        the gradient is reduced when it is complete, and the shares add up in the reduced slices.
        """
        grads = [p.grad for s in unit.segments for p in s.params]
        if any(g is not None for g in grads):
            for s in unit.segments:
                if not s.has_trainable:
                    continue
                flat = _padded_empty(s)
                for i, p in enumerate(s.params):
                    if p.grad is not None:
                        s.view_of(i, flat).copy_(p.grad)
                        p.grad = None
                    else:
                        s.view_of(i, flat).zero_()
                        if s.trainable[i]:
                            self._missing.append(self._names.get(p, "?"))
                self._reduce_scatter(s, flat)
                self._wait_inflight(keep=1)
        if not unit.is_root:
            self._free(unit)

    def _finish_backward_reductions(self, ms: _ModelState) -> None:
        # Units whose post-backward did not fire (their inputs needed no gradient), then the root, in a fixed
        # order; a unit with no gradients communicates nothing, on every rank alike.
        for u in sorted(ms.units, key=lambda u: -u.index):
            if u.is_root or u.touched or any(p.grad is not None for s in u.segments for p in s.params):
                self._post_backward(u)
        for u in ms.units:
            u.touched = False
            if u.state != _Unit.FREE:
                self._free(u)

    # ---- state
    def _gathered_cpu_params(self, model: nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        out: dict[torch.Tensor, torch.Tensor] = {}
        for u in self._models[id(model)].units:  # one unit whole at a time
            was_free = u.state == _Unit.FREE
            self._wait_gathered(u)
            for s in u.segments:
                for p in s.params:
                    out[p] = p.detach().to("cpu", copy=True)
            if was_free:
                self._free(u)
        return out

    def _param_bytes(self) -> int:
        total = 0
        for s in self.segments:
            at_rest = s.shard_param if s.shard_param is not None else s.master
            if at_rest is not None and not self.store.owns(at_rest):
                total += at_rest.numel() * at_rest.element_size()
        return total

    def _comm_buffer_bytes(self) -> int:
        sizes = sorted((u.full_bytes for u in self.units if not u.is_root), reverse=True)
        root = sum(u.full_bytes for u in self.units if u.is_root)
        # Gathered during a step: the root, the unit computing and the one prefetched, and a gradient in flight.
        return root + sum(sizes[:2]) + (sizes[0] if sizes else 0)

    def memory_report(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        report = super().memory_report(optimizers)
        # zero3's fp32 master is the at-rest parameter slice itself: count it once, under params.
        for s in self.segments:
            if s.shard_param is None and s.master is not None and not self.store.owns(s.master):
                report["held"]["optimizer_state"] -= s.master.numel() * s.master.element_size()
        report["held_total"] = sum(v for k, v in report["held"].items() if k not in ("comm_buffers", "offloaded_to_disk"))
        return report


# ---------------------------------------------------------------------------------------------- helpers
def _padded_empty(seg: _Segment) -> torch.Tensor:
    """A full-size gradient buffer whose padding is zero; every parameter's view is written before use."""
    flat = torch.empty(seg.padded, dtype=seg.dtype, device=seg.device)
    flat[seg.numel :].zero_()
    return flat


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (e.g. when checkpointing recomputes a forward)."""
    return torch._C._current_graph_task_id() != -1


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=True)


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    out: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > bucket_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        out.append(current)
    return out


def _by_dtype(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    groups: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    return list(groups.values())


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _unit_modules(model: nn.Module, classes: str | None) -> list[tuple[str, nn.Module]]:
    """The modules zero3 gathers one at a time, outermost first, in registration order."""
    if classes:
        wanted = {c.strip() for c in classes.split(",") if c.strip()}
        found: list[tuple[str, nn.Module]] = []
        taken: list[str] = []
        for name, m in model.named_modules():
            if m is model or type(m).__name__ not in wanted:
                continue
            if any(name.startswith(t + ".") for t in taken):
                continue
            taken.append(name)
            found.append((name, m))
        present = {type(m).__name__ for _, m in found}
        unknown = wanted - present
        if unknown:
            raise ValueError(
                f"zero3_unit_classes names {', '.join(sorted(unknown))}, but the model has no module of that class; "
                f"module classes in the model: {', '.join(sorted({type(m).__name__ for m in model.modules()}))}"
            )
        return found

    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, _CONTAINERS):
                walk(full + ".", child)
            elif any(True for _ in child.parameters()):
                out.append((full, child))

    walk("", model)
    return out


def _merge_runs(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    merged: list[tuple[int, int, int]] = []
    for i, a, b in runs:
        if merged and merged[-1][2] == a:
            merged[-1] = (merged[-1][0], merged[-1][1], b)
        else:
            merged.append((i, a, b))
    return merged


def _chunk_steps(optimizer: torch.optim.Optimizer, store: StateStore, chunk_mb: float) -> None:
    """Disk offload: step the pieces a chunk at a time, and move each chunk's new state into the files.

    Only one chunk of optimizer state is resident at once; the others stay in the page cache and out of
    this process's memory.
    """
    step = optimizer.step
    limit = chunk_mb * 2**20

    def chunked_step(*args: Any, **kwargs: Any) -> Any:
        groups = [g["params"] for g in optimizer.param_groups]
        order = [(gi, p) for gi, ps in enumerate(groups) for p in ps]
        chunks: list[list[tuple[int, nn.Parameter]]] = [[]]
        size = 0.0
        for gi, p in order:
            nbytes = p.numel() * 4 * 3
            if chunks[-1] and size + nbytes > limit:
                chunks.append([])
                size = 0.0
            chunks[-1].append((gi, p))
            size += nbytes
        def to_disk(chunk: list[tuple[int, nn.Parameter]]) -> None:
            for _, p in chunk:
                st = optimizer.state.get(p, {})
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and not store.owns(v):
                        st[k] = store.copy_of(v)
            store.release()

        parts = [(chunk, [[p for cgi, p in chunk if cgi == gi] for gi in range(len(groups))]) for chunk in chunks]
        return _step_in_parts(optimizer, lambda: step(*args, **kwargs), parts, to_disk)

    _replace_step(optimizer, chunked_step)


def _replace_step(optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> None:
    """Make ``step`` the optimizer's ``step``, bound to it as the original was: an LR scheduler built on this optimizer
    later wraps ``optimizer.step.__func__``, which a plain function lacks."""
    optimizer.step = types.MethodType(lambda _opt, *args, **kwargs: step(*args, **kwargs), optimizer)  # type: ignore[method-assign]


def _step_in_parts(
    optimizer: torch.optim.Optimizer, step: Callable[[], Any], parts: list[tuple[Any, list[list[nn.Parameter]]]],
    after: Callable[[Any], None],
) -> Any:
    """Step the optimizer once per part, its param groups narrowed to that part's pieces, then call ``after``.

    Exact for elementwise optimizers, which see each piece once per step either way. Parts with no piece
    here skip the step but still get ``after`` (which may be a collective every rank must join).
    """
    groups = [g["params"] for g in optimizer.param_groups]
    result = None
    try:
        for part, per_group in parts:
            if any(per_group):
                for g, ps in zip(optimizer.param_groups, per_group):
                    g["params"] = ps
                result = step()
            after(part)
    finally:
        for g, ps in zip(optimizer.param_groups, groups):
            g["params"] = ps
    return result


def _state_tensors(optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    return [
        v
        for opt in optimizers
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_bytes_per_element(optimizers: list[torch.optim.Optimizer], state: list[torch.Tensor], numel: int) -> float:
    """Optimizer state bytes per parameter element: from the optimizer's kind, else measured."""
    per = []
    for opt in optimizers:
        name, d = type(opt).__name__, opt.defaults
        if name in ("Adam", "AdamW"):
            per.append(4 * (3 if d.get("amsgrad") else 2))
        elif name == "SGD":
            per.append(4 if d.get("momentum", 0) else 0)
    if len(per) == len(optimizers) and len(set(per)) == 1:
        return float(per[0])
    return _nbytes(state) / numel if numel else 0.0


def _report(
    name: str, psi: int, n: int, p: int, k: float, held: dict[str, int], predicted: dict[str, float], offload: str
) -> dict[str, Any]:
    return {
        "strategy": name,
        "world_size": n,
        "trainable_params": psi,
        "param_bytes_per_element": p,
        "state_bytes_per_element": k,
        "offload": offload,
        "held": held,
        "held_total": sum(v for key, v in held.items() if key not in ("comm_buffers", "offloaded_to_disk")),
        "predicted": {key: int(v) for key, v in predicted.items()},
        "predicted_total": int(sum(predicted.values())),
    }
