"""Data parallel: every rank holds the whole model; gradients are averaged by bucketed, overlapped all-reduce.

Each trainable parameter's gradient lives in a flat bucket (``param.grad`` is a view into it). Buckets are
filled in reverse parameter order, which is roughly the order backward produces gradients, so the first
bucket is complete early. When a bucket's last gradient lands, its all-reduce starts asynchronously and
runs while backward computes the rest. One callback at the end of backward waits for them all.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from phalanx.comm import CommStats, broadcast_coalesced
from phalanx.strategies.base import ShardEntry, StateReader, Strategy, optimizer_list, read_into, read_optimizer_state

__all__ = ["DDPStrategy", "GradReducer"]


class _Bucket:
    __slots__ = ("index", "params", "views", "flat", "pending", "ready", "work")

    def __init__(self, index: int, params: list[nn.Parameter]) -> None:
        self.index = index
        self.params = params
        first = params[0]
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
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
    """Owns the gradient buckets of one model and reduces them over ``group``."""

    def __init__(
        self,
        module: nn.Module,
        bucket_bytes: int,
        group: Any,
        world_size: int,
        stats: CommStats,
        find_unused_parameters: bool = False,
    ) -> None:
        self.group, self.world_size, self.stats = group, world_size, stats
        self.find_unused_parameters = find_unused_parameters
        self.names: dict[torch.Tensor, str] = {p: n for n, p in module.named_parameters()}
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(
                f"{type(module).__name__} has no parameter with requires_grad=True, so there is nothing to train "
                "or reduce (unfreeze some parameters, or do not pass this model to engine.prepare)"
            )
        self.buckets = self._build_buckets(params[::-1], bucket_bytes)
        self._bucket_of: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if p.grad is not None:
                    b.views[i].copy_(p.grad)
                p.grad = b.views[i]
                self._bucket_of[p] = (b, i)
        self.require_sync = True
        self.grad_scale: float | torch.Tensor = 1.0 / world_size
        self._reduced = False  # this step's gradients were already reduced
        self._next_bucket = 0
        self._callback_queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    @staticmethod
    def _build_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            starts_new = current and (
                size + nbytes > bucket_bytes or p.dtype != current[0].dtype or p.device != current[0].device
            )
            if starts_new:
                buckets.append(_Bucket(len(buckets), current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(_Bucket(len(buckets), current))
        return buckets

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
            raise RuntimeError(
                "a second backward reached gradients that were already all-reduced in this step (parameter "
                f"{self.names.get(param, '?')!r}). Step or zero the optimizer between backwards, put the earlier "
                "backwards under engine.no_sync(), and use activation checkpointing with use_reentrant=False "
                "(reentrant checkpointing runs a nested backward that would reduce some gradients twice)"
            )
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
        scale = self.grad_scale
        if not (isinstance(scale, float) and scale == 1.0):
            bucket.flat.mul_(scale)
        if self.world_size > 1:
            self.stats.record("all_reduce", bucket.flat, self.world_size)
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

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
        self.grad_scale = 1.0 / self.world_size
        if missing and not self.find_unused_parameters:
            frozen = [self.names.get(b.params[i], "?") for b, i in missing if not b.params[i].requires_grad]
            if frozen:
                raise RuntimeError(
                    f"parameters frozen after engine.prepare: {', '.join(frozen)}. ddp lays out gradient buckets "
                    "at prepare time; set requires_grad_(False) before engine.prepare"
                )
            names = ", ".join(self.names.get(b.params[i], "?") for b, i in missing)
            raise RuntimeError(
                f"these trainable parameters received no gradient in this backward pass: {names}. "
                "phalanx ddp reduces every parameter with requires_grad=True on every step. Make sure the "
                "forward uses them and the loss depends on them, freeze them with requires_grad_(False) before "
                "engine.prepare, or set find_unused_parameters=True to reduce them as zeros"
            )

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
        self.grad_scale = 1.0 / self.world_size
        if unused and not self.find_unused_parameters:
            self.wait()  # peers are in these same all-reduces; finish them before raising
            raise RuntimeError(
                f"these trainable parameters received no gradient in this step: {', '.join(unused)}. Make sure the "
                "forward uses them and the loss depends on them, freeze them with requires_grad_(False) before "
                "engine.prepare, or set find_unused_parameters=True to reduce them as zeros"
            )

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


class DDPStrategy(Strategy):
    """``strategy="ddp"``: replicate the model, average gradients with :class:`GradReducer`."""

    name = "ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reducers: dict[int, GradReducer] = {}

    @property
    def reducers(self) -> list[GradReducer]:
        return list(self._reducers.values())

    def wrap_model(self, model: nn.Module) -> nn.Module:
        topo = self.topology
        if id(model) in self._reducers:
            raise ValueError(f"{type(model).__name__} was already passed to engine.prepare; prepare each model once")
        if topo.dp_size > 1:
            _check_same_model(model, topo.dp_group, self.device)
            # Every replica starts from rank 0's weights and buffers, whatever each rank initialised.
            broadcast_coalesced(
                [t.data for t in model.parameters()] + list(model.buffers()),
                src=_group_rank0(topo.dp_group),
                group=topo.dp_group,
                stats=self.stats,
            )
            if self.config.broadcast_buffers and any(True for _ in model.buffers()):
                model.register_forward_pre_hook(self._broadcast_buffers_hook)
        self._reducers[id(model)] = GradReducer(
            model,
            bucket_bytes=int(self.config.bucket_mb * 2**20),
            group=topo.dp_group,
            world_size=topo.dp_size,
            stats=self.stats,
            find_unused_parameters=self.config.find_unused_parameters,
        )
        return model

    def _broadcast_buffers_hook(self, module: nn.Module, args: Any) -> None:
        # As torch DDP does: keep BatchNorm statistics and the like identical to rank 0's on every replica.
        if module.training and torch.is_grad_enabled():
            with torch.no_grad():
                broadcast_coalesced(
                    list(module.buffers()), src=_group_rank0(self.topology.dp_group), group=self.topology.dp_group, stats=self.stats
                )

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
            r.grad_scale = scale

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
        # After the all-reduce every replica holds the same gradients, so the local norm is the global one.
        return torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None], max_norm, norm_type=norm_type)

    def sharded_state(self, model: nn.Module, optimizers: Any = None) -> list[ShardEntry]:
        # Every replica holds everything. So that a save writes in parallel, the replicas split the bytes evenly:
        # rank r of the data-parallel group gives the r-th of dp_size equal runs of the tensors laid end to end.
        self.finish_gradient_sync()
        tensors = [(f"model/{k}", v) for k, v in _named_tensors(model)]
        names: dict[Any, str] = {p: n for n, p in model.named_parameters()}
        for opt in optimizer_list(optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    if p in names:
                        state = opt.state.get(p, {}).items()
                        tensors += [(f"optim/{names[p]}/{k}", v) for k, v in state if isinstance(v, torch.Tensor)]
        return _balanced_slices(tensors, self.topology.dp_rank, self.topology.dp_size)

    def load_sharded_state(self, model: nn.Module, optimizers: Any, reader: StateReader) -> None:
        _load_whole_tensors(model, reader)
        keys = _keys_by_param(reader)
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
        return {name: tuple(t.shape) for name, t in _named_tensors(model)}

    def memory_report(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        from phalanx.strategies.zero import _nbytes, _report, _state_bytes_per_element, _state_tensors

        params = [p for r in self.reducers for b in r.buckets for p in b.params]
        psi = sum(p.numel() for p in params)
        p_bytes = params[0].element_size() if params else 4
        state = _state_tensors(optimizers)
        k = _state_bytes_per_element(optimizers, state, psi)
        held = {
            "params": _nbytes(params),
            "grads": sum(b.flat.numel() * b.flat.element_size() for r in self.reducers for b in r.buckets),
            "optimizer_state": _nbytes(state),
            "comm_buffers": 0,  # buckets are the gradients themselves
            "offloaded_to_disk": 0,
        }
        predicted = {"params": p_bytes * psi, "grads": p_bytes * psi, "optimizer_state": k * psi}
        return _report(self.name, psi, self.topology.dp_size, p_bytes, k, held, predicted, "none")

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


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (each tied one once, under its first name) and buffers."""
    return list(model.named_parameters()) + list(model.named_buffers())


def _balanced_slices(tensors: list[tuple[str, torch.Tensor]], rank: int, n: int) -> list[ShardEntry]:
    """Rank ``rank``'s share when the tensors are laid end to end and cut into ``n`` runs of equal bytes: each
    element goes to the rank whose run holds its first byte, so every element is given exactly once."""
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    lo, hi = total * rank // n, total * (rank + 1) // n
    out, pos = [], 0
    for key, t in tensors:
        size, numel = t.element_size(), t.numel()
        a = min(numel, max(0, -(-(lo - pos) // size)))
        b = min(numel, max(0, -(-(hi - pos) // size)))
        if a < b or (numel == 0 and rank == 0):  # an empty tensor is still listed, by rank 0
            out.append(ShardEntry(key, tuple(t.shape), a, b, t.detach().reshape(-1)[a:b]))
        pos += numel * size
    return out


def _whole(key: str, t: torch.Tensor) -> ShardEntry:
    return ShardEntry(key, tuple(t.shape), 0, t.numel(), t.detach().reshape(-1))


def _read_whole(reader: StateReader, key: str) -> torch.Tensor:
    shape = reader.shape(key)
    return reader.read(key, 0, math.prod(shape)).reshape(shape)


def _keys_by_param(reader: StateReader) -> dict[str, list[str]]:
    """``optim/<name>/<state>`` keys grouped as {name: [state, ...]}."""
    out: dict[str, list[str]] = {}
    for key in reader.keys():
        if key.startswith("optim/"):
            name, _, state = key[len("optim/") :].rpartition("/")
            out.setdefault(name, []).append(state)
    return out


def _load_whole_tensors(model: nn.Module, reader: StateReader, skip: set[Any] | None = None) -> None:
    """Copy whole parameters and buffers from ``reader``; the error lists what is missing or mis-shaped."""
    problems = []
    wanted = [(n, t) for n, t in _named_tensors(model) if skip is None or t not in skip]
    available = set(reader.keys())
    for name, t in wanted:
        key = f"model/{name}"
        if key not in available:
            problems.append(f"{name}: not in the checkpoint")
        elif tuple(reader.shape(key)) != tuple(t.shape):
            problems.append(f"{name}: shape {tuple(reader.shape(key))} in the checkpoint, {tuple(t.shape)} in the model")
    if problems:
        raise ValueError("the checkpoint does not match the model: " + "; ".join(problems[:5]))
    with torch.no_grad():
        for name, t in wanted:
            if t.is_contiguous():
                read_into(reader, f"model/{name}", 0, t.numel(), t.view(-1))
            else:
                t.copy_(_read_whole(reader, f"model/{name}"))


def _group_rank0(group: Any) -> int:
    """The global rank of the first member of ``group`` (the source of broadcasts)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def _check_same_model(model: nn.Module, group: Any, device: torch.device) -> None:
    """Refuse replicas that differ in shape before any broadcast could pair mismatched tensors."""
    shapes = [tuple(p.shape) for p in model.parameters()] + [tuple(b.shape) for b in model.buffers()]
    signature = torch.tensor([len(shapes), sum(hash(s) % 1_000_003 for s in shapes)], dtype=torch.long, device=device)
    lo, hi = signature.clone(), signature.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise RuntimeError(
            f"the model passed to engine.prepare differs between ranks (this rank: {int(signature[0])} tensors); "
            "build the same architecture on every rank before prepare"
        )
