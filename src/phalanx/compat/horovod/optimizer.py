"""``hvd.DistributedOptimizer``: the user's optimizer, with gradients reduced over the ranks before it steps.

The reduction is phalanx's own ddp :class:`~phalanx.strategies.ddp.GradReducer`: gradients live in flat buckets, and
each bucket's all-reduce starts as soon as backward has produced its last gradient. Horovod's semantics on top:

- ``op=Average`` sums and then divides by the world size (``gradient_predivide_factor`` f moves a factor 1/f before
  the sum and f/size after it); ``op=Sum`` only sums.
- ``backward_passes_per_step=N``: the gradients of N backward passes add up locally and are reduced during the
  N-th; nothing is divided by N (scale the loss for a mean over the passes).
- ``step()`` reduces whatever was not reduced yet (fewer than N passes, or none), then steps. ``synchronize()``
  does the reduction alone, for clipping; ``with optimizer.skip_synchronize(): optimizer.step()`` then steps.
- ``compression``: each bucket travels compressed (fp16: half the bytes) and is decompressed before the division.
- ``process_set``: the gradients are reduced over that set's ranks; on a rank outside it the optimizer steps on
  its own gradients, as in Horovod.
- Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as Horovod does: every rank's indices and values
  gathered (the sum of sparse tensors), or, with ``sparse_as_dense=True``, densified and reduced in their bucket;
  the parameter gets a sparse gradient back either way.
- Each backward pass that reduces is first offered to the coordinator (one round), which checks that every rank
  is in the same step and lets a rank in ``hvd.join()`` stand in with zeros.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from phalanx.compat.horovod.coordinator import Op, digest_of
from phalanx.compat.horovod.more_ops import sparse_allreduce_async
from phalanx.compat.horovod.ops import Compression, _reduce_, c10d_op, check_compression, run
from phalanx.compat.horovod.process_sets import coordinator_of, global_process_set
from phalanx.compat.horovod.world import Average, ReduceOp, Sum, check_op, current
from phalanx.config.strategy_options import DataParallelOptions
from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import CommStats
from phalanx.strategies.ddp import GradReducer

__all__ = ["DistributedOptimizer"]

_BUCKET_BYTES = int(DataParallelOptions().bucket_mb * 2**20)


class _NamedParams(nn.Module):
    """What GradReducer reads from a model (parameters with names), made from an optimizer's param groups."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self._named = named  # a plain list, not registered: Horovod's names may contain dots

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._named)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for _, p in self._named)


class _Reduced:
    """A bucket's all-reduce in flight; ``wait`` brings the result back into the bucket, decompressed and scaled."""

    __slots__ = ("work", "wire", "ctx", "flat", "compression", "postscale")

    def __init__(
        self, work: Any, wire: torch.Tensor, ctx: Any, flat: torch.Tensor, compression: Any, postscale: float
    ) -> None:
        self.work, self.wire, self.ctx, self.flat = work, wire, ctx, flat
        self.compression, self.postscale = compression, postscale

    def wait(self) -> None:
        self.work.wait()
        out = self.compression.decompress(self.wire, self.ctx)
        if out is not self.flat:
            self.flat.copy_(out)
        if self.postscale != 1.0:
            self.flat.mul_(self.postscale)


class _HorovodReducer(GradReducer):
    """GradReducer with Horovod's reduction: any of Average/Sum/Min/Max/Product, a factor before and after the
    all-reduce, and compression on the wire. Parameters that get no gradient are reduced as zeros, as in Horovod."""

    def __init__(
        self,
        module: nn.Module,
        process_set: Any,
        op: ReduceOp,
        predivide: float,
        compression: Any,
        dense: bool,
    ) -> None:
        coord = coordinator_of(process_set, "hvd.DistributedOptimizer")
        gradless = [p for p in module.parameters() if p.grad is None]
        super().__init__(module, _BUCKET_BYTES, coord.group, coord.size, CommStats(), find_unused_parameters=True)
        for p in gradless:  # as they were: a sparse gradient accumulated into a dense bucket view would stay dense
            p.grad = None
        self.op, self.compression, self.coord, self.sparse_as_dense = op, compression, coord, dense
        self.process_set = process_set
        self.scale.default = self.scale.value = 1.0 / predivide if op is Average else 1.0
        self.postscale = predivide / coord.size if op is Average else 1.0
        self.sparse: dict[torch.Tensor, torch.Tensor] = {}  # this window's sparse gradients, by parameter
        self._negotiating: Op | None = None
        self.name = coord.auto_name("hvd.DistributedOptimizer")
        wires = [self.compression.compress(b.flat)[0] for b in self.buckets]
        self.plan = [(w.numel(), str(w.dtype).removeprefix("torch."), c10d_op(op).name) for w in wires]
        self.digest, self.text = digest_of("hvd.DistributedOptimizer", [b.flat for b in self.buckets], op=op)

    def negotiate(self, early: bool = False) -> None:
        """One coordinator round before a reducing pass: every rank must be in this step (or joined). ``early``:
        begin it now (the first gradient of the pass) and finish it before the first bucket's all-reduce, so
        that the exchange overlaps the rest of backward."""
        kind = "hvd.DistributedOptimizer"
        op = Op(kind, self.name, self.digest, self.text, lambda s: ([], lambda: None), plan=lambda: self.plan)
        if not early:
            run(self.coord, op)
            return
        if self._negotiating is not None:  # a pass that ended before its first bucket (an error in backward)
            self.coord.wait(self._negotiating)
        self._negotiating = self.coord.submit(op)
        self.coord.begin_round()

    def _launch(self, bucket: Any) -> None:
        if self._negotiating is not None:  # the step's round, begun at the first gradient
            op, self._negotiating = self._negotiating, None
            self.coord.wait(op)
        self._launch_reduce(bucket)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None and grad.is_sparse:
            bucket, i = self._bucket_of[param]  # type: ignore[index]
            view = bucket.views[i]
            self.sparse[param] = grad
            if self.sparse_as_dense:
                view.copy_(grad.to_dense())
            else:
                view.zero_()  # travels in its bucket as zeros; the sparse reduce carries it
            param.grad = view
            self._reduced = False
        super()._on_grad_ready(param)

    def restore_sparse(self) -> None:
        """After the buckets are reduced: give each sparse parameter its reduced gradient back, sparse."""
        for i, (p, g) in enumerate(self.sparse.items()):
            bucket, j = self._bucket_of[p]  # type: ignore[index]
            if self.sparse_as_dense:
                p.grad = bucket.views[j].to_sparse()
                continue
            op = ReduceOp.Average if self.op is Average else ReduceOp.Sum
            p.grad = sparse_allreduce_async(g, f"{self.name}.sparse.{i}", op, self.process_set)()
        self.sparse = {}

    def _launch_reduce(self, bucket: Any) -> None:
        self.scale.apply_(bucket.flat)
        wire, ctx = self.compression.compress(bucket.flat)
        self.stats.record("all_reduce", wire, self.world_size)
        work = watched(dist.all_reduce, wire, op=c10d_op(self.op), group=self.group, async_op=True)
        bucket.work = _Reduced(work, wire, ctx, bucket.flat, self.compression, self.postscale)

    def open_window(self) -> None:
        """The reduced gradients were consumed (a step or synchronize): later backward passes start a new window."""
        self._reduced = False


if TYPE_CHECKING:
    _OptimizerBase = torch.optim.Optimizer
else:
    _OptimizerBase = object


class _DistributedOptimizerMixin(_OptimizerBase):
    """Mixed in before the user's optimizer class, so that ``isinstance(opt, torch.optim.AdamW)`` still holds."""

    _hvd_reducer: _HorovodReducer | None
    _hvd_passes: int
    _hvd_pass_open: bool
    _hvd_synchronized: bool
    _hvd_should_synchronize: bool
    backward_passes_per_step: int

    def _hvd_on_grad(self, param: torch.Tensor) -> None:
        # Runs before the reducer's own hook on each gradient: the first gradient of a backward pass decides
        # whether this pass is the one that reduces.
        if self._hvd_pass_open:
            return
        reducer = self._hvd_reducer
        assert reducer is not None, "hooks are registered only with a reducer"
        if self._hvd_passes >= self.backward_passes_per_step:
            raise RuntimeError(
                f"backward ran {self._hvd_passes + 1} times since the last optimizer.step() (or synchronize()), but "
                f"backward_passes_per_step={self.backward_passes_per_step} and those gradients were already reduced "
                "(call optimizer.step() after that many backward passes, or raise backward_passes_per_step to "
                "accumulate more passes locally)"
            )
        self._hvd_pass_open = True
        reducer.require_sync = self._hvd_passes + 1 == self.backward_passes_per_step
        if reducer.require_sync:
            reducer.negotiate(early=True)
        Variable._execution_engine.queue_callback(self._hvd_close_pass)

    def _hvd_close_pass(self) -> None:
        self._hvd_pass_open = False
        self._hvd_passes += 1

    def synchronize(self) -> None:
        """Finish the all-reduce of every gradient (reducing now what backward did not), so that ``p.grad`` holds
        the reduced gradient; for clipping before ``with optimizer.skip_synchronize(): optimizer.step()``."""
        reducer = self._hvd_reducer
        if reducer is not None:
            if self._hvd_passes != self.backward_passes_per_step:  # not reduced during backward: reduce it all now
                reducer.negotiate()
                reducer.launch_all()
            reducer.wait()
            reducer.open_window()
            reducer.restore_sparse()
        self._hvd_passes = 0
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not synchronize (call ``synchronize()`` yourself before it)."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                # Horovod reduces a second time here; the gradients are already reduced, so we only warn (a Python
                # warning, with Horovod's words, so that code filtering or checking it keeps working).
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(); phalanx reduces the gradients once (wrap the step in "
                    "`with optimizer.skip_synchronize():` to say so)",
                    stacklevel=2,
                )
            else:
                self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_passes and not self._hvd_synchronized:
            raise RuntimeError(
                f"optimizer.zero_grad() after {self._hvd_passes} backward pass(es) whose gradients were not yet "
                "reduced and stepped would drop them on this rank only (call optimizer.step() or "
                "optimizer.synchronize() first, and zero_grad() at the start of each window of "
                f"backward_passes_per_step={self.backward_passes_per_step} passes)"
            )
        super().zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = _check_passes(passes)
        self._hvd_passes = 0

    def load_state_dict(self, state_dict: Any) -> None:
        self._hvd_passes, self._hvd_synchronized = 0, False
        super().load_state_dict(state_dict)


def _check_passes(passes: Any) -> int:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step={passes!r} must be a positive integer (use 1 to reduce every pass)")
    return passes


def _named(optimizer: torch.optim.Optimizer, named_parameters: Any) -> list[tuple[str, nn.Parameter]]:
    """Every parameter of ``optimizer`` with its name, after Horovod's checks on ``named_parameters``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        return [
            (f"allreduce.noname.{i}.{j}", p)
            for i, g in enumerate(optimizer.param_groups)
            for j, p in enumerate(g["params"])
        ]
    named = list(named_parameters)
    bad = [x for x in named if not (isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor))]
    if bad:
        raise ValueError(
            f"named_parameters must hold (name, parameter) pairs; got {type(bad[0]).__name__} {str(bad[0])[:60]!r} "
            "(pass model.named_parameters())"
        )
    seen: set[str] = set()
    dups = sorted({n for n, _ in named if n in seen or seen.add(n)})  # type: ignore[func-returns-value]
    if dups:
        raise ValueError(
            f"names in named_parameters must be unique; these appear more than once: {', '.join(dups)} (pass "
            "model.named_parameters() of one model, or prefix the names of each model you combine)"
        )
    name_of = {p: n for n, p in named}
    unnamed = [
        f"group {i} parameter {j} (shape {tuple(p.shape)})"
        for i, g in enumerate(optimizer.param_groups)
        for j, p in enumerate(g["params"])
        if p not in name_of
    ]
    if unnamed:
        raise ValueError(
            f"named_parameters does not name every parameter of the optimizer; missing: {'; '.join(unnamed)} (pass "
            "the named_parameters() of every model whose parameters the optimizer holds, or leave it out)"
        )
    return [(name_of[p], p) for p in params]


class _AdasumOptimizerMixin(_OptimizerBase):
    """``op=hvd.Adasum``, as Horovod's Adasum optimizer: each rank steps on its own gradients, then the ranks combine
    their steps (the change of each parameter) with Adasum, and every rank applies the combined step."""

    def synchronize(self) -> None:
        """Nothing to reduce before the step: Adasum combines the steps, not the gradients."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]  # type: ignore[attr-defined]
        starts = [p.detach().clone() for p in params]
        loss = super().step(closure)  # type: ignore[misc]
        world = current("hvd.DistributedOptimizer (Adasum)")
        if world.distributed:
            with torch.no_grad():
                for p, start in zip(params, starts):
                    change = p.detach() - start
                    _reduce_(change, ReduceOp.Adasum, 1.0, 1.0, world)
                    p.copy_(start + change)
        return loss


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that its gradients are reduced over all ranks (see the module's docstring).

    Returns an optimizer of a subclass of ``type(optimizer)`` that shares its param groups and state; use it in
    place of the original: ``optimizer = hvd.DistributedOptimizer(optimizer, model.named_parameters())``.
    """
    where = "hvd.DistributedOptimizer"
    world = current(where)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError(f"{where}: this optimizer is already a DistributedOptimizer (wrap the original only once)")
    reduce_op = check_op(op, where, (Average, Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product, ReduceOp.Adasum))
    if reduce_op is ReduceOp.Adasum:
        if compression is not Compression.none or gradient_predivide_factor != 1.0:
            raise ValueError(f"{where}: op=hvd.Adasum takes no compression and no gradient_predivide_factor")
        cls = type(type(optimizer).__name__, (_AdasumOptimizerMixin, type(optimizer)), {})
        adasum: Any = object.__new__(cls)
        adasum.__dict__.update(optimizer.__dict__)
        adasum.backward_passes_per_step = _check_passes(backward_passes_per_step)
        return adasum
    compressor = check_compression(compression, where)
    passes = _check_passes(backward_passes_per_step)
    if not gradient_predivide_factor > 0:
        raise ValueError(
            f"{where}: gradient_predivide_factor={gradient_predivide_factor!r} must be positive (1.0 is none)"
        )
    if gradient_predivide_factor != 1.0 and reduce_op is not Average:
        raise ValueError(
            f"{where}: gradient_predivide_factor={gradient_predivide_factor} splits an average, "
            f"but op=hvd.{reduce_op.name} (use op=hvd.Average, or gradient_predivide_factor=1.0)"
        )
    named = _named(optimizer, named_parameters)
    coord = coordinator_of(process_set, where) if process_set is None or process_set.included() is not False else None

    cls = type(type(optimizer).__name__, (_DistributedOptimizerMixin, type(optimizer)), {})
    wrapped: Any = object.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param groups, state and hooks, not copies
    wrapped.backward_passes_per_step = passes
    wrapped._hvd_passes, wrapped._hvd_pass_open = 0, False
    wrapped._hvd_synchronized, wrapped._hvd_should_synchronize = False, True
    wrapped._hvd_reducer = None
    wrapped._parameter_names = {p: n for n, p in named}  # Horovod's attribute, which its tests read
    trainable = [(n, p) for n, p in named if p.requires_grad]
    # One process, or a rank outside the set, has nothing to reduce, as in Horovod.
    if world.distributed and coord is not None and coord.size > 1 and trainable:
        for _, p in trainable:  # registered before the reducer's hooks, so they run first
            p.register_post_accumulate_grad_hook(wrapped._hvd_on_grad)
        wrapped._hvd_reducer = _HorovodReducer(
            _NamedParams(trainable),
            process_set,
            reduce_op,
            float(gradient_predivide_factor),
            compressor,
            sparse_as_dense,
        )
    return wrapped
