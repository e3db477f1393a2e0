"""zero3: parameters, gradients and optimizer state all sharded; units gathered on demand.

A unit (by default each child module that holds parameters, looking inside ModuleList/Sequential/ModuleDict) is
all-gathered before its forward and freed after it, gathered again when backward reaches it and freed when its
backward is done, when its gradients are reduce-scattered. The next unit is prefetched. The forward's last unit
(from the second forward on, when the order is known) is the backward's first: it stays gathered between the two.
An optimizer step frees any unit still gathered, so that no forward runs on the values from before it. Parameters
shared by two units (tied embeddings) and those of no unit belong to the root unit, which stays gathered from the
forward to the end of backward. Reduce-scatters happen on every backward, as for zero2.

Between forwards each rank holds only its slices, and a parameter of a freed unit is an empty tensor. So a
``state_dict()`` of the model, or of any module in it, is refused (it would save empty tensors without a word, as a
transformers ``save_pretrained`` called on the main process would); ``engine.get_state_dict`` gathers the whole.

torch.compile, as with FSDP2: ``model = torch.compile(model)`` after ``engine.prepare``, or each unit compiled alone
(``block.compile()``, or ``block.forward = torch.compile(block.forward, fullgraph=True)``). The hooks that gather and
free run eagerly between the compiled graphs (``torch.compiler.disable``, as FSDP2's hooks): traced, a ``p.data = ...``
swap becomes a ``set_`` on a graph input whose version bump fails the backward of the graphs that saved it, and
collectives and storage resizes cannot be traced at all. A graph saves the parameter tensors themselves, whole again
when backward reaches their unit. So a model with zero3 units is several graphs: ``fullgraph=True`` on the whole model
is refused by dynamo with the reason and the fix (``_EAGER_REASON``). A model compiled before ``engine.prepare`` is
sharded by the units inside it (its state-dict keys keep torch's ``_orig_mod.`` prefix).
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from phalanx.config.strategy_options import Zero3Options
from phalanx.runtime.memory import release_free_heap
from phalanx.runtime.placement import LEDGER, place_buffers
from phalanx.strategies._replicas import replicate_from_first
from phalanx.strategies.base import uncompiled
from phalanx.strategies.deferred_init import pending_init
from phalanx.strategies.zero.base import ModelState, ZeroStrategy
from phalanx.strategies.zero.collectives import Done, SegmentComm
from phalanx.strategies.zero.layout import Segment, by_dtype, padded_empty
from phalanx.strategies.zero.offload import StateStore

__all__ = ["Zero3Strategy", "Unit", "UnitState", "unit_modules_of"]


class UnitState(enum.IntEnum):
    FREE = 0
    """Only this rank's slice exists; the parameters are empty tensors."""
    GATHERING = 1
    """The all-gathers are in flight; the parameters view buffers that are being filled."""
    GATHERED = 2
    """The parameters are whole."""


class Unit:
    """A module whose parameters are gathered together around its forward and its backward. It owns its state:
    ``gather`` starts the all-gathers (FREE -> GATHERING), ``wait`` finishes them (-> GATHERED), ``free`` drops the
    whole parameters (-> FREE), and ``prefetch`` starts its neighbour's gather. Each is a no-op in a state where it
    has nothing to do."""

    def __init__(
        self,
        index: int,
        module: nn.Module,
        name: str,
        segments: list[Segment],
        is_root: bool,
        comm: SegmentComm,
        store: StateStore,
        empty: dict[tuple[torch.dtype, torch.device], torch.Tensor],
        gathered: dict[int, Segment],
    ) -> None:
        """``gathered``: the strategy's map from each gathered segment's buffer (its data pointer) to the segment."""
        self.index, self.module, self.name, self.segments, self.is_root = index, module, name, segments, is_root
        self.comm, self.store, self._empty, self.gathered = comm, store, empty, gathered
        self.state = UnitState.FREE
        self.works: list[Done] = []
        self.touched = False  # backward reached it in the running backward pass
        self.owner: ModelState | None = None

    @property
    def full_bytes(self) -> int:
        return sum(s.padded * s.full.element_size() for s in self.segments)

    def gather(self) -> None:
        if self.state == UnitState.FREE:
            for s in self.segments:
                s.full = self.comm.pool.take(s.padded, s.dtype, s.device)
                self.gathered[s.full.data_ptr()] = s
                s.attach_views()
            self.works = [self.comm.gather(s, async_op=True) for s in self.segments]
            self.state = UnitState.GATHERING

    def wait(self) -> None:
        self.gather()
        if self.state == UnitState.GATHERING:
            for w in self.works:
                w.wait()
            self.works = []
            self.state = UnitState.GATHERED
            self.store.release()

    def prefetch(self, step: int, enabled: bool) -> None:
        """Start gathering the unit ``step`` places after this one in the order the first forward ran them (+1 in
        forward, -1 in backward); the order is known from the second forward on."""
        ms = self.owner
        if not enabled or ms is None or not ms.order_fixed or self not in ms.order:
            return
        nxt = ms.order.index(self) + step
        if 0 <= nxt < len(ms.order):
            ms.order[nxt].gather()

    def free(self) -> None:
        if self.state == UnitState.GATHERING:
            for w in self.works:
                w.wait()
            self.works = []
        for s in self.segments:
            empty = self._empty.setdefault((s.dtype, s.device), torch.empty(0, dtype=s.dtype, device=s.device))
            for p in s.params:
                p.data = empty
            # Back to the pool, lent again once nothing refers to it: what autograd saved of these parameters is a
            # marker (_SavedParam), read from the unit gathered again in backward.
            if self.gathered.pop(s.full.data_ptr(), None) is not None:
                self.comm.pool.give(s.full)
            elif s.full.numel():  # the buffer prepare laid the unit out in: released now, whoever still refers to it
                s.full.untyped_storage().resize_(0)
                LEDGER.resized(s.full)
            s.full = empty
        self.state = UnitState.FREE


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


class Zero3Strategy(ZeroStrategy):
    """``strategy="zero3"``: parameters, gradients and optimizer state all sharded; units gathered on demand."""

    name = "zero3"
    stage = 3
    params_whole = False
    defers_init = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unit_opts = self.config.options(Zero3Options)
        self._empty: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._gathered: dict[int, Segment] = {}  # see Unit
        self._own_reads = 0  # inside our own state_dict() reads, which put the gathered tensors in place

    def place_model(self, model: nn.Module) -> nn.Module:
        # Only the buffers (small, and broadcast from rank 0 on the device) go now. The parameters stay where they
        # were built, on the host or meta, and ``wrap_model`` places them one unit at a time, keeping this rank's
        # shard: moving the whole model first would not fit on the device for the very models zero3 is for.
        place_buffers(model, self.device, what="zero3")
        return model

    def wrap_model(self, model: nn.Module) -> nn.Module:
        init = pending_init(model)
        params = self._prepare_common(model, set(model.parameters()), replicate=init is None)
        unit_modules = unit_modules_of(model, self.unit_opts.zero3_unit_classes)
        owners: dict[nn.Parameter, set[int]] = {}
        for ui, (_, m) in enumerate(unit_modules):
            for p in m.parameters():
                owners.setdefault(p, set()).add(ui)
        members: list[list[nn.Parameter]] = [[] for _ in unit_modules]
        root_params: list[nn.Parameter] = []
        for p in params:
            where = owners.get(p, set())
            (members[next(iter(where))] if len(where) == 1 else root_params).append(p)
        units: list[Unit] = []
        all_segments: list[Segment] = []
        # One unit at a time: lay out, take rank 0's values, keep this rank's slice, free the rest. Only one
        # unit is ever whole on the device: its flat working buffer, made on the host from the parameters the user
        # built there (or that the deferred init gave values there, in the order the model was built) and placed
        # whole, because rank 0's values are broadcast on the device (NCCL). The rest of the model waits on the
        # host. The root unit is laid out last, when everything before it has its values.
        for (name, module), ps in list(zip(unit_modules, members)) + [(("<root>", model), root_params)]:
            if init is not None:
                init.materialise_through(None if module is model else module, torch.device("cpu"))
            what = f"zero3 unit {name}"
            segs = [self._segment(group, what, self.device) for group in by_dtype(ps)]
            self._add_segments(segs)
            for seg in segs:
                # The at-rest slice is the fp32 master itself when the dtypes agree (on the host with offload);
                # otherwise a copy in the parameters' dtype, in the offload tier when there is one.
                keeps_slice = seg.master is not None and seg.master.dtype == seg.dtype
                seg.shard_param = (
                    None
                    if keeps_slice
                    else self.store.placed(self.store.copy_of(seg.full[seg.lo : seg.hi]), f"{what} shard")
                )
            all_segments += segs
            unit = Unit(0, module, name, segs, module is model, self.comm, self.store, self._empty, self._gathered)
            unit.free()
            self.store.release()  # disk offload: what was written to the files leaves this process
            if segs or unit.is_root:
                units.append(unit)
        units.insert(0, units.pop())  # the root first
        release_free_heap()  # the units' temporaries on the host, laid out one by one, leave holes in the heap
        for i, u in enumerate(units):
            u.index = len(self.units) + i
        if init is not None:
            place_buffers(model, self.device, what="zero3")  # those the deferred init made, on the host
        if init is not None and self.topology.dp_size > 1:
            replicate_from_first(
                model, self.topology.dp_group, self.device, self.stats, self.dp_opts.broadcast_buffers, skip=params
            )
        state = self._register(model, params, all_segments)
        state.units = units
        root = units[0]
        for u in units:
            u.owner = state
            self.units.append(u)
            if not u.is_root:
                u.module.register_forward_pre_hook(_eager(self._make_pre_forward(u)), with_kwargs=True, prepend=True)
                u.module.register_forward_hook(_eager(self._make_post_forward(u)))
        model.register_forward_pre_hook(_eager(self._make_root_pre_forward(root)), prepend=True)
        model.register_forward_hook(_eager(self._make_root_post_forward(root)))
        sharded = set(self._loc)
        for m in model.modules():
            if any(p in sharded for p in m.parameters()):
                m.register_state_dict_pre_hook(self._refuse_partial_state_dict)
        forward = model.forward

        @functools.wraps(forward)
        def explained_forward(*args: Any, **kwargs: Any) -> Any:
            try:
                with self._saved_by_reference():
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

    # ---- what autograd saves of a gathered parameter
    def _saved_by_reference(self) -> contextlib.AbstractContextManager[Any]:
        """Autograd keeps, of a gathered parameter (or a view of it), a marker (``_SavedParam``) that reads the unit
        gathered again in backward, instead of the tensor: the unit's buffer goes back to the pool when the unit is
        freed, and is lent to the next unit. Were the tensor kept, the pool would have to pass the buffer over (it
        lends only what nothing refers to), so every unit would hold its own until backward.

        Under autocast, a matmul saves its bf16/fp16 cast of the weight, and autocast caches the cast until the
        forward ends: a copy of every gathered weight (2 bytes a parameter) alive whatever the shard count, though the
        unit itself is freed. Autograd saves a marker for it too (``_SavedCast``), and backward casts the regathered
        parameter again, the same values; each unit's post-forward clears autocast's cache. (FSDP2 gathers in the
        compute dtype for the same reason, which changes what runs in fp32; this keeps autocast's numerics bit for
        bit.) Hooks the caller set (``torch.autograd.graph.save_on_cpu``, say) still get every other saved tensor:
        only one pair of hooks applies at a time, so ours hand those on."""
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            # A compiled graph saves what it saves: the pool then passes its units' buffers over until backward.
            return contextlib.nullcontext()
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        autocast = torch.is_autocast_enabled(self.device.type)

        def pack(t: torch.Tensor) -> Any:
            saved: _SavedParam | _SavedCast | None = self._saved_param(t)
            if saved is None and autocast:
                saved = self._saved_cast(t)
            if saved is not None:
                return saved
            return t if outer is None else _Outer(outer[0](t))

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, _Outer):
                assert outer is not None
                return outer[1](saved.packed)
            return _unpack_saved(saved)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _saved_param(self, t: torch.Tensor) -> _SavedParam | None:
        """The marker for ``t`` when it views a gathered unit's buffer, else None."""
        if t.layout != torch.strided or t.is_meta:
            return None
        seg = self._gathered.get(t.untyped_storage().data_ptr())
        if seg is None or t.dtype != seg.dtype:
            return None
        return _SavedParam(
            seg, tuple(t.shape), t.stride(), int(t.storage_offset()), self._names.get(seg.params[0], "?")
        )

    def _saved_cast(self, t: torch.Tensor) -> _SavedCast | None:
        """The marker for ``t`` when it is (a view of) autocast's cast of a gathered parameter, else None."""
        base = t._base if t._base is not None else t
        fn = base.grad_fn
        if fn is None or fn.name() != "ToCopyBackward0":
            return None
        param = getattr(fn.next_functions[0][0], "variable", None)
        if param is None or param not in self._loc or base.dtype == param.dtype:
            return None
        return _SavedCast(param, t.dtype, tuple(t.shape), t.stride(), int(t.storage_offset() - base.storage_offset()))

    # ---- hooks
    def _make_root_pre_forward(self, root: Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            ms = root.owner
            if ms is not None and ms.order and not ms.order_fixed:
                ms.order_fixed = True  # the second forward on: the first one recorded the order
            root.wait()

        return hook

    def _make_root_post_forward(self, root: Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if not torch.is_grad_enabled():
                root.free()
                return output
            return self._hook_outputs(root, output)

        return hook

    def _make_pre_forward(self, unit: Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if _in_backward():  # activation checkpointing recomputes this forward: gather, nothing else
                unit.wait()
                return None
            ms = unit.owner
            if ms is not None and not ms.order_fixed and unit not in ms.order:
                ms.order.append(unit)
            unit.wait()
            unit.prefetch(+1, self.unit_opts.zero3_prefetch)
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

    def _make_post_forward(self, unit: Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if _in_backward():  # a recomputation: the unit's own backward is about to use it
                return output
            _drop_autocast_casts(
                self.device.type
            )  # this unit's casts: nothing needs them now (see _saved_by_reference)
            if not torch.is_grad_enabled():
                unit.free()
                return output
            ms = unit.owner
            if ms is None or not ms.order_fixed or ms.order[-1] is not unit:
                unit.free()  # the forward's last unit is the backward's first: it stays gathered for it
            return self._hook_outputs(unit, output)

        return hook

    def _hook_outputs(self, unit: Unit, output: Any) -> Any:
        for t in pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, u=unit: self._pre_backward(u))
        return output

    def _pre_backward(self, unit: Unit) -> None:
        assert unit.owner is not None
        self._queue_final_callback(unit.owner)
        unit.touched = True
        if unit.state != UnitState.GATHERED:
            unit.wait()
        unit.prefetch(-1, self.unit_opts.zero3_prefetch)

    def _post_backward(self, unit: Unit) -> None:
        """Backward is done with ``unit``: reduce-scatter the gradients it got, and free its parameters.

        It may run more than once in a backward (a module called twice, a retained graph): each share of
        the gradient is reduced when it is complete, and the shares add up in the reduced slices.
        """
        if any(p.grad is not None for s in unit.segments for p in s.params):
            for s in unit.segments:
                if not s.has_trainable:
                    continue
                grads: list[torch.Tensor | None] = []
                for i, p in enumerate(s.params):
                    grads.append(None if p.grad is None else p.grad.reshape(-1))
                    if p.grad is None and s.trainable[i]:
                        self._missing.append(self._names.get(p, "?"))
                    p.grad = None
                if self.comm.sends_pieces(s):  # p2p: each peer gets its parts of the gradients, no copy first
                    self.comm.reduce_scatter_pieces(s, grads)
                else:
                    flat = padded_empty(s, self.comm.pool)
                    for i, g in enumerate(grads):
                        if g is not None:
                            s.view_of(i, flat).view(-1).copy_(g)
                        else:
                            s.view_of(i, flat).zero_()
                    self.comm.reduce_scatter(s, flat)
                self.comm.wait_inflight(keep=1)
        if not unit.is_root:
            unit.free()

    def _finish_backward_reductions(self, ms: ModelState) -> None:
        # Units whose post-backward did not fire (their inputs needed no gradient), then the root, in a fixed
        # order; a unit with no gradients communicates nothing, on every rank alike.
        for u in sorted(ms.units, key=lambda u: -u.index):
            if u.is_root or u.touched or any(p.grad is not None for s in u.segments for p in s.params):
                self._post_backward(u)
        for u in ms.units:
            u.touched = False
            if u.state != UnitState.FREE:
                u.free()

    # ---- state
    @contextlib.contextmanager
    def _own_state_read(self) -> Iterator[None]:
        self._own_reads += 1
        try:
            yield
        finally:
            self._own_reads -= 1

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        with self._own_state_read():
            return super().full_state_dict(model)

    def state_dict_keys(self, model: nn.Module) -> dict[str, str]:
        with self._own_state_read():  # only the keys are read
            return super().state_dict_keys(model)

    def _refuse_partial_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """A state_dict pre-hook on every module holding zero3 parameters: refuse to hand out empty shards."""
        if self._own_reads:
            return
        empty = [n for n, p in module.named_parameters() if p in self._loc and p.numel() != self._whole_numel(p)]
        if not empty:
            return  # every unit it holds is gathered (e.g. inside its forward): the values are whole
        shown = ", ".join(empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
        raise RuntimeError(
            f"{type(module).__name__}.state_dict() under strategy='zero3' would hold empty tensors: between forwards "
            f"each rank keeps only its shard of the parameters ({shown} are empty on this rank). Gathering them is a "
            "collective that every rank must join, so it cannot happen inside a save called on the main process "
            "alone. On every rank, call engine.save_model(model, save_directory) (it writes model.safetensors and "
            "config.json from rank 0), or state = engine.get_state_dict(model) and then save that, e.g. "
            "unwrapped.save_pretrained(save_directory, state_dict=state, is_main_process=engine.is_main_process)"
        )

    def _whole_numel(self, p: nn.Parameter) -> int:
        seg, i = self._loc[p]
        return seg.shapes[i].numel()

    def _at_rest(self, s: Segment) -> torch.Tensor:
        return s.shard_param if s.shard_param is not None else s.master  # type: ignore[return-value]

    def _publish_params(self, segments: list[Segment]) -> None:
        # At rest each rank holds only its slice: the next forward gathers the new values. A unit still gathered
        # now (the root after a forward whose output was dropped, not backwarded) holds the old ones: free it, or
        # the next forward would run on them.
        for seg in segments:
            if seg.shard_param is not None and seg.master is not None:
                seg.shard_param.copy_(seg.master)
        changed = {id(seg) for seg in segments}
        for u in self.units:
            if u.state != UnitState.FREE and any(id(seg) in changed for seg in u.segments):
                u.free()

    def _predicted(self, p: int, g: int, psi: int, n: int) -> dict[str, float]:
        return {"params": p * psi / n, "grads": g * psi / n}

    def _gathered_cpu_params(self, model: nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        out: dict[torch.Tensor, torch.Tensor] = {}
        for u in self._models[id(model)].units:  # one unit whole at a time
            was_free = u.state == UnitState.FREE
            u.wait()
            for s in u.segments:
                for p in s.params:
                    out[p] = p.detach().to("cpu", copy=True)
            if was_free:
                u.free()
        return out

    def _param_bytes(self) -> int:
        total = 0
        for s in self.segments:
            if not s.has_trainable:
                continue  # frozen: counted under frozen_params
            at_rest = s.shard_param if s.shard_param is not None else s.master
            if at_rest is not None and not self.store.owns(at_rest):
                total += at_rest.numel() * at_rest.element_size()
        return total

    def _comm_buffer_bytes(self) -> int:
        """The plan's buffers at their peak in backward, from the unit sizes: the pool's blocks (the root, the unit
        computing and the one prefetched; the reduction in flight and the current one) and autograd's gradients of
        the units whose reductions are not finished. ``memory_report`` shows the pool's own size beside it."""
        units = sorted((u for u in self.units if not u.is_root), key=lambda u: -u.full_bytes)[:2]
        root = sum(u.full_bytes for u in self.units if u.is_root)
        gathered = sum(u.full_bytes for u in units)
        reducing = grads = 0
        for i, u in enumerate(units):
            for seg in u.segments:
                if not seg.has_trainable:
                    continue
                size, comm = seg.padded * seg.full.element_size(), self.comm._for(seg) or self.comm
                if comm.sends_pieces(seg):  # a buffer per rank for the slices; autograd's until they are sent
                    reducing += size
                    grads += seg.numel * seg.full.element_size()
                else:  # the full-size buffer, and where the peers' slices land
                    extra = {"p2p": comm.world - 1, "native": 1}.get(comm.mode, 0) if comm.world > 1 else 0
                    reducing += size + extra * seg.shard_numel * seg.full.element_size()
                    if i == 0:  # copied into the buffer and dropped: one unit's at a time
                        grads += seg.numel * seg.full.element_size()
        return root + gathered + reducing + grads

    def memory_report(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        report = super().memory_report(optimizers)
        # zero3's fp32 master is the at-rest parameter slice itself: count it once, under params.
        for s in self.segments:
            if s.shard_param is None and s.master is not None and not self.store.owns(s.master):
                report["held"]["optimizer_state"] -= s.master.numel() * s.master.element_size()
        report["held_total"] = sum(
            v for k, v in report["held"].items() if k not in ("comm_buffers", "offloaded_to_disk")
        )
        report["expected_peak"] = report["held_total"] + report["held"]["comm_buffers"] + report["transient"]
        return report


_EAGER_REASON = (
    "phalanx zero3 gathers each unit's parameters before its forward and frees them after, with collectives and "
    "storage resizes that cannot be traced; these hooks run between compiled graphs, so a model with zero3 units "
    "cannot be one graph. Compile with fullgraph=False (the default), or compile each unit's forward alone: "
    "unit.forward = torch.compile(unit.forward, fullgraph=True)"
)


class _Outer:
    """A tensor saved by the caller's own hooks, under ours."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


class _SavedCast:
    """What autograd keeps of a gathered parameter's autocast cast (or a view of it): the parameter and the cast."""

    __slots__ = ("dtype", "offset", "param", "shape", "stride")

    def __init__(
        self, param: nn.Parameter, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...], offset: int
    ) -> None:
        self.param, self.dtype, self.shape, self.stride, self.offset = param, dtype, shape, stride, offset


class _SavedParam:
    """What autograd keeps of a gathered parameter (or a view of it): where it lies in its segment's buffer."""

    __slots__ = ("name", "offset", "seg", "shape", "stride")

    def __init__(self, seg: Segment, shape: tuple[int, ...], stride: tuple[int, ...], offset: int, name: str) -> None:
        self.seg, self.shape, self.stride, self.offset, self.name = seg, shape, stride, offset, name


def _drop_autocast_casts(device_type: str) -> None:
    if torch.is_autocast_enabled(device_type):
        torch.clear_autocast_cache()


def _unpack_saved(saved: Any) -> torch.Tensor:
    if isinstance(saved, _SavedParam):
        full = saved.seg.full
        if full.numel() == 0:
            raise RuntimeError(
                f"zero3: backward needs a parameter of the unit holding {saved.name!r}, and that unit is not "
                "gathered (its forward ran outside the unit's own module?). Use the parameter inside the module that "
                "owns it, or choose units with zero3_unit_classes so that both modules sit in one unit"
            )
        return full.as_strided(saved.shape, saved.stride, saved.offset)
    if not isinstance(saved, _SavedCast):
        return saved
    p = saved.param
    if p.numel() == 0:
        raise RuntimeError(
            "zero3: backward needs the cast of a parameter whose unit is not gathered (its forward ran outside the "
            "unit's own module?). Use the parameter inside the module that owns it"
        )
    with torch.no_grad():
        cast = p.detach().to(saved.dtype)
    return cast.as_strided(saved.shape, saved.stride, saved.offset)


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run eagerly even inside torch.compile'd code: dynamo breaks the graph around it (as FSDP2's hooks)."""
    return torch.compiler.disable(hook, recursive=True, reason=_EAGER_REASON)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (e.g. when checkpointing recomputes a forward)."""
    return torch._C._current_graph_task_id() != -1


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def unit_modules_of(model: nn.Module, classes: str | None) -> list[tuple[str, nn.Module]]:
    """The modules zero3 gathers one at a time, outermost first, in registration order. Without ``classes``, a
    transformers model's ``_no_split_modules`` (its decoder layers: Accelerate's transformer-based wrap takes them
    the same way) that it has; otherwise each child module with parameters (a transformers causal LM's only such
    child is its whole base model, which would be gathered at once)."""
    if not classes:
        own = getattr(uncompiled(model), "_no_split_modules", None) or []
        present = {type(m).__name__ for m in model.modules()}
        if isinstance(own, (list, tuple, set)) and [c for c in own if c in present]:
            classes = ",".join(c for c in own if c in present)
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
            if uncompiled(child) is not child:  # compiled before engine.prepare: the unit is the module it compiled
                child, full = uncompiled(child), f"{full}._orig_mod"
            if isinstance(child, _CONTAINERS):
                walk(full + ".", child)
            elif any(True for _ in child.parameters()):
                out.append((full, child))

    inner = uncompiled(model)
    walk("" if inner is model else "_orig_mod.", inner)
    return out
