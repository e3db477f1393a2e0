"""Engine: the one object a training script talks to.

    engine = phalanx.Engine(strategy="ddp", precision="bf16-mixed", grad_accum_steps=4)
    model, optimizer, loader, scheduler = engine.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with engine.accumulate():
            loss = model(batch).loss
            engine.backward(loss)                 # or engine.backward(loss_sum, items=n_tokens)
            engine.clip_grad_norm_(1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

Run it with ``python train.py`` (one process) or ``phalanx launch -n 4 train.py`` (four); nothing changes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import weakref
from collections.abc import Callable, Iterator
from numbers import Number
from typing import IO, Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, IterableDataset

import phalanx.engine.collectives as collectives
from phalanx.checkpoint.resume import Resumer
from phalanx.config.dialects.dummies import DummyOptim, DummyScheduler, realise_optimizer, realise_scheduler
from phalanx.config.mesh import Mesh
from phalanx.config.registry import get_strategy_class
from phalanx.config.settings import EngineConfig, resolve_config
from phalanx.engine.activation import checkpoint_blocks, offload_activations
from phalanx.engine.data import ActiveLoaders, PreparedDataLoader, PreparedIterableLoader
from phalanx.engine.guards import (
    as_prepared,
    check_backward_has_a_model,
    check_loader_batch,
    check_materialised,
    check_not_released,
    check_prepared_models,
    check_train_step,
    warn_accumulation_unused,
)
from phalanx.engine.nonfinite import NonFiniteGuard
from phalanx.engine.precision import Precision, agree_found_inf, loss_scaling, precision_report
from phalanx.engine.prepared import PreparedOptimizer, PreparedScheduler, autocast_forward, kind_of
from phalanx.engine.state_calls import StateCalls
from phalanx.engine.tensor_parallel import TensorParallelState
from phalanx.logging import configure_logging, warn_once
from phalanx.runtime import nccl_rules
from phalanx.runtime.comm import all_reduce
from phalanx.runtime.memory import peak_memory_bytes, set_mmap_threshold
from phalanx.runtime.topology import Topology
from phalanx.runtime.watchdog import start_watchdog
from phalanx.runtime.world import WorldInfo, detect_world, init_distributed, pick_device, seed_everything
from phalanx.strategies.base import drop_hooks_of
from phalanx.strategies.context_parallel.context import context_parallel_of
from phalanx.strategies.deferred_init import (
    DeferredInit,
    check_init_fn_applies,
    check_initialised,
    has_meta,
    uninitialised,
)

__all__ = ["Engine", "PreparedOptimizer", "PreparedScheduler"]  # the last two live in prepared.py


class Engine(StateCalls):
    """Trains with one strategy and one precision on whatever world the launcher started.

    Keyword arguments override the config file and ``PHALANX_*`` environment variables handed down by
    ``phalanx launch``; with none, ``Engine()`` runs on the resolved config (or the defaults).

    Its calls, in the order of the sections below: ``prepare``; the training loop (``accumulate``, ``backward``,
    ``clip_grad_norm_``, ``train_step``); who this process is (``rank``, ``num_processes``, ...); the collectives
    (``gather``, ``reduce``, ``wait_for_everyone``, ``save``, ...: ``collectives.py`` does the work); the state
    (``get_state_dict``, ``save_state``/``load_state``, ``save_model``, ``epoch``: ``phalanx/checkpoint`` does
    the work); and the reports.
    """

    def __init__(
        self,
        strategy: str | None = None,
        precision: str | None = None,
        grad_accum_steps: int | None = None,
        seed: int | None = None,
        config_file: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        if isinstance(options.get("tp_plan"), dict):  # a plan given as a dict travels as JSON, as in a config file
            options["tp_plan"] = json.dumps(options["tp_plan"])
        overrides = dict(
            strategy=strategy, precision=precision, grad_accum_steps=grad_accum_steps, seed=seed, **options
        )
        resolved = resolve_config(file=config_file, cli=overrides, cli_origin="argument")
        self.config: EngineConfig = resolved.engine
        self._origins = resolved.origins
        self.world: WorldInfo = detect_world()
        configure_logging(self.world.rank, self.config.log_all_ranks)
        for line in resolved.overrides + resolved.notes:
            warn_once(line)
        if self.config.nccl_rules:
            nccl_rules.enable()
        self.device = pick_device(self.config.device, self.world)
        if self.config.host_mmap_threshold_mb and not set_mmap_threshold(self.config.host_mmap_threshold_mb):
            warn_once(
                f"host_mmap_threshold_mb={self.config.host_mmap_threshold_mb:g} has no effect here: it sets glibc's "
                "mmap threshold, and this process has no glibc (Linux with glibc only); leave it unset"
            )
        init_distributed(self.world, self.device, self.config.timeout_s)
        self.topology = Topology(Mesh.of(self.config, self.world.world_size, self._origins), self.world.rank)
        self.topology.build_groups(self.device.type)
        self.context_parallel = context_parallel_of(self.topology)
        """The cp axis's state (ring or Ulysses; strategies/context_parallel/context.py), None without one."""
        start_watchdog(
            self.world.rank,
            self.world.world_size,
            self.device.type,
            self.config.hang_timeout_s,
            self.config.debug_collectives,
            self.topology,
        )
        self._checkpointed: list[Any] = []  # register_for_checkpointing
        self._resumer = Resumer(self.config.resume_from)
        self._tp = TensorParallelState(self.config, self.topology, self.device)
        self._released: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models given up by free_memory
        self._start_training_state()
        seed_everything(self.config.seed)

    def _start_training_state(self) -> None:
        """A fresh strategy, precision and training loop state, with nothing prepared (at start, and free_memory)."""
        strategy_cls = get_strategy_class(self.config.strategy)
        self.precision = Precision(self.config.precision, self.device, loss_scaling(self.config))
        self._nonfinite = NonFiniteGuard(self.config.on_nonfinite, self.device, self.precision.scaler is not None)
        if self.precision.scaler is not None and self._origins.get("on_nonfinite", "default") != "default":
            warn_once(
                f"on_nonfinite={self.config.on_nonfinite!r} ({self._origins['on_nonfinite']}) does not apply under "
                f"precision={self.config.precision!r}: its loss scaler skips every step whose gradients hold an "
                "inf or NaN and lowers the scale (engine.step_was_skipped tells when); use bf16-mixed for the guard"
            )
        self.strategy = strategy_cls(self.config, self.topology, self.device, self.precision)
        agree_found_inf(self.precision, self.strategy, self.topology)
        self._models: list[nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._prepared_loaders: list[PreparedDataLoader | PreparedIterableLoader] = []
        self._loaders = ActiveLoaders()
        self.global_step = 0
        """Optimizer steps taken (of the first prepared optimizer), skipped fp16 steps included; saved in
        checkpoints."""
        self.sync_gradients = True
        """Whether gradients are reduced and optimizers step on this micro-batch (Accelerate's name and meaning).

        True outside any accumulation window: before the first ``accumulate()``, and after a window's last
        micro-batch. Inside ``accumulate()`` it is False until the window's last micro-batch (or the DataLoader's
        last batch); it keeps its value after the ``with`` block until the next ``accumulate()``, so that
        ``if engine.sync_gradients:`` after the block counts optimizer steps, as in Accelerate's examples."""
        self.step_was_skipped = False
        """True when the last optimizer step was skipped because fp16 gradients overflowed."""
        self._micro_steps = 0
        self._in_accumulate = False
        self._window_items: torch.Tensor | None = None
        self._window_mode: str | None = None
        self._stepped: set[int] = set()  # optimizers that stepped and whose schedulers have not yet counted it
        self._no_sync_depth = 0
        self._clipped = False  # clip_grad_norm_ ran since the last round of optimizer steps
        self._round: set[int] = set()  # optimizers that stepped in this round

    # ---------------------------------------------------------------- prepare
    def prepare(self, *objects: Any, param_init_fn: Callable[[nn.Module], Any] | None = None) -> Any:
        """Prepare models, optimizers, DataLoaders and LR schedulers, returned in the order given.

        A model built on the meta device (``with torch.device("meta")`` or ``phalanx.init_empty_weights()``) is
        given its values here, part by part under zero3, by each module's ``reset_parameters()`` or by
        ``param_init_fn(module)``: see ``phalanx/strategies/deferred_init.py``."""
        kinds = [kind_of(o) for o in objects]
        if param_init_fn is not None:
            check_init_fn_applies(
                [o for o, k in zip(objects, kinds) if k == "model"], self.strategy.name, self.strategy.materialises_meta
            )
        out: list[Any] = list(objects)
        for kind in ("model", "optimizer", "scheduler", "loader"):
            for i, obj in enumerate(objects):
                if kinds[i] == kind:
                    out[i] = (
                        self.prepare_model(obj, param_init_fn=param_init_fn)
                        if kind == "model"
                        else getattr(self, f"prepare_{kind}")(obj)
                    )
        self._resume_if_ready()
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(
        self,
        model: nn.Module | list[nn.Module] | tuple[nn.Module, ...],
        param_init_fn: Callable[[nn.Module], Any] | None = None,
    ) -> nn.Module:
        if isinstance(model, (list, tuple)):
            model = nn.Sequential(*model)  # a list of blocks runs as nn.Sequential runs them
        check_not_released(model, self._released)
        if has_meta(model) and not self.strategy.materialises_meta:
            init = DeferredInit(model, param_init_fn)
            if self.strategy.defers_init:
                init.attach()  # the strategy materialises it one part at a time
            else:
                init.materialise_through(None, torch.device("cpu"))
        check_materialised(model, self.strategy.name, self.strategy.materialises_meta or self.strategy.defers_init)
        model = self.strategy.place_model(self._tp.split(model, self.strategy))
        checkpoint_blocks(model, self.config.activation_checkpointing, self.config.zero3_unit_classes)
        wrapped = self.strategy.wrap_model(model)
        if uninitialised(model):
            model.register_forward_pre_hook(lambda m, args: check_initialised(m, "forward"), prepend=True)
        if self.precision.compute_dtype is not None:
            autocast_forward(self.unwrap_model(wrapped), self.precision)
        offload_activations(self.unwrap_model(wrapped), self.config.activation_offload, self.device)
        if self.context_parallel is not None:  # its attention runs over the cp ranks
            self.context_parallel.adopt(self.unwrap_model(wrapped))
        self._models.append(wrapped)
        return wrapped

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer | DummyOptim) -> PreparedOptimizer:
        optimizer = realise_optimizer(optimizer, self.config.deepspeed)
        self._tp.adopt(optimizer)
        prepared = PreparedOptimizer(self.strategy.wrap_optimizer(optimizer), self)
        self._optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: LRScheduler | DummyScheduler) -> PreparedScheduler:
        prepared = PreparedScheduler(realise_scheduler(scheduler, self.config.deepspeed), self)
        self._schedulers.append(prepared)
        return prepared

    def prepare_loader(self, loader: DataLoader) -> PreparedDataLoader | PreparedIterableLoader:
        """A DataLoader whose every global batch (``batch_size`` x the data-parallel world) is split over the ranks,
        in an order drawn from the seed and the epoch. A sharded stream (``ShardedStream``, ``FileShards``, a
        ``datasets.IterableDataset``) is dealt out by shard over the ranks and their workers, each sample read once;
        any other ``IterableDataset`` is read whole by every rank, which keeps its slice (see docs/engine.md,
        Streams). A loader this engine prepared already is returned as it is."""
        if any(loader is p for p in self._prepared_loaders):
            return loader  # type: ignore[return-value]
        check_loader_batch(loader, self.config, self._origins)
        prepared: PreparedDataLoader | PreparedIterableLoader
        if isinstance(loader.dataset, IterableDataset):
            prepared = PreparedIterableLoader(
                loader,
                self.topology.data_rank,
                self.topology.data_size,
                self.device,
                self._loaders,
                self.topology.data_cpu_group,
            )
        else:
            prepared = PreparedDataLoader(
                loader, self.topology.data_rank, self.topology.data_size, self.config.seed, self.device, self._loaders
            )
        prepared.transform = self.context_parallel.cut if self.context_parallel is not None else None
        self._prepared_loaders.append(prepared)
        return prepared

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop the engine's references to everything prepared, collect garbage and empty the CUDA cache, as
        Accelerate's ``free_memory``; returns ``[None] * len(objects)``: ``model, optimizer = engine.free_memory(
        model, optimizer)`` drops your references too.

        For a second training with new models in one process: the strategy, the loss scaler, ``global_step`` and
        the accumulation window start afresh, and models prepared before cannot be prepared again. Registered
        checkpoint objects stay registered. Call it on every rank.
        """
        for model in self._models:
            self._released.add(self.unwrap_model(model))
            drop_hooks_of(self.strategy, model)
        self._start_training_state()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return [None for _ in objects]

    # -------------------------------------------------------- the train loop
    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-batch of an accumulation window of ``grad_accum_steps``.

        Inside the window, backward only accumulates local gradients, and ``optimizer.step()``,
        ``zero_grad()``, ``scheduler.step()`` and ``clip_grad_norm_`` do nothing. The window's last
        micro-batch (or the last batch of the DataLoader) reduces the gradients and steps; ``sync_gradients``
        says which this one is. ``accumulate(model)``, Accelerate's form, takes the prepared models too: they are
        checked (each must come from ``engine.prepare``), and every prepared model accumulates as without them.
        """
        check_prepared_models(models, self._models, self.unwrap_model)
        self._refuse_manual_backward("engine.accumulate()")
        if self._in_accumulate:
            raise RuntimeError("engine.accumulate() is already active; do not nest it")
        self._micro_steps += 1
        self.sync_gradients = self._micro_steps >= self.config.grad_accum_steps or self._loaders.end_of_dataloader
        self._in_accumulate = True
        try:
            with contextlib.nullcontext() if self.sync_gradients else self.strategy.no_sync():
                yield
        finally:
            self._in_accumulate = False
            if self.sync_gradients:
                self._micro_steps = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside only accumulates local gradients; the next backward outside reduces them all."""
        self._no_sync_depth += 1
        try:
            with self.strategy.no_sync():
                yield
        finally:
            self._no_sync_depth -= 1

    def autocast(self) -> Any:
        """The forward-pass autocast of the configured precision (prepared models already use it)."""
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor, items: int | torch.Tensor | None = None, **kwargs: Any) -> None:
        """Backward of a mean loss, or of a summed loss with ``items`` (e.g. the number of tokens in it).

        With ``items``, the window's gradients are divided by the item count summed over every micro-batch
        of the window and every rank: exactly the gradient of the mean over all items of the global batch.
        """
        self._refuse_manual_backward("engine.backward")
        check_backward_has_a_model(len(self._models), self.topology.dp_size)
        if not self._resumer.done:
            self._check_resumed()
        mode = "sum" if items is not None else "mean"
        if self._window_mode not in (None, mode):
            raise ValueError(
                "engine.backward was called with items= and without it in one accumulation window; use "
                "backward(loss_sum, items=n) for every micro-batch of a window, or backward(mean_loss) for every one"
            )
        self._window_mode = mode
        in_window = self._in_accumulate
        window_len = self._micro_steps if in_window else 1
        boundary = self.sync_gradients and self._no_sync_depth == 0  # this backward reduces the gradients
        # The factors below follow the one gradient scale contract, written in strategies/_grads.py.
        if mode == "mean":
            # Averaging over the window is folded into the loss, as Accelerate divides it; averaging over the
            # replicas happens in the reduction, so that a model that was not prepared (and is not reduced) gets
            # plain gradients, not gradients divided by the world size.
            accum = self.config.grad_accum_steps if in_window else 1
            loss = loss * (1.0 / accum) if accum > 1 else loss
            if self.context_parallel is not None and (weight := self.context_parallel.weight()) is not None:
                loss = loss * weight  # this rank's share of the whole sequence's targets (context.py)
            if boundary:
                self.strategy.set_grad_scale(self._short_window(accum, window_len) / self.topology.dp_size)
        else:
            if isinstance(items, torch.Tensor):
                n = items.to(self.device, torch.float64).reshape(())
            else:  # filled on the device: a Python number copied there makes the host wait for the GPU
                n = torch.full((), float(items or 0), dtype=torch.float64, device=self.device)
            self._window_items = n if self._window_items is None else self._window_items + n
            if boundary:
                total = self._window_items.clone()
                all_reduce(total, "sum", group=self.topology.dp_group)
                self.strategy.set_grad_scale((1.0 / total).to(torch.float32))
        if boundary:
            self._window_items, self._window_mode = None, None
        self._nonfinite.note_loss(loss)
        self.precision.scale_loss(loss).backward(**kwargs)
        if boundary:
            self.finish_gradient_sync()
            if not self.strategy.shards_gradients:  # zero2/3 keep no whole gradients to compare
                self._tp.check_once([self.unwrap_model(m) for m in self._models])

    def finish_gradient_sync(self) -> None:
        """Wait for every gradient reduction of this step, then sum over the tp ranks the tp-replicated gradients
        that arrived since the last sum. Idempotent."""
        self.strategy.finish_gradient_sync()
        self._tp.sum_deferred(self.strategy, self._models)

    def _short_window(self, accum: int, window_len: int) -> float:
        """A short last window (the DataLoader ran out) still averages over the micro-batches it had."""
        return accum / window_len

    def _refuse_manual_backward(self, what: str) -> None:
        if self.strategy.drives_backward:
            raise RuntimeError(
                f"{what} is not available under strategy={self.strategy.name!r}: the schedule runs forward and "
                "backward itself, micro-batch by micro-batch on every stage. Train with loss = "
                "engine.train_step(batch, loss_fn), where loss_fn(model, batch) returns the loss of one micro-batch; "
                "it also clips, steps and zeroes"
            )

    def clip_grad_norm_(self, *args: Any, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip to the global gradient norm; returns that norm (before clipping).

        ``engine.clip_grad_norm_(max_norm)`` clips every prepared model's parameters, and the Accelerate
        form ``engine.clip_grad_norm_(parameters, max_norm)`` clips the given ones. Inside an accumulation
        window, before its last micro-batch, gradients are partial: nothing is clipped and None is returned.
        """
        if len(args) == 1 and isinstance(args[0], (int, float)):
            max_norm, params = float(args[0]), [p for m in self._models for p in m.parameters()]
        elif len(args) == 2:
            params, max_norm = list(args[0]), float(args[1])
        else:
            raise TypeError("use engine.clip_grad_norm_(max_norm) or engine.clip_grad_norm_(parameters, max_norm)")
        if not self.sync_gradients:
            return None
        self.finish_gradient_sync()
        for opt in self._optimizers:
            self.precision.unscale_(opt.optimizer)  # clip the true gradients, not the loss-scaled ones
        every = len(args) == 1
        if not every:
            self._check_nonfinite()  # these parameters' norm is not every gradient's: look at them all
        self._clipped = True
        total = self.strategy.clip_grad_norm_(params, max_norm, norm_type)
        if every:
            self._check_nonfinite(total)  # the global norm says it; a non-finite one left the gradients unscaled
        return total

    def _check_nonfinite(self, norm: torch.Tensor | None = None) -> bool:
        """on_nonfinite, once per round of optimizer steps: True when the step must be skipped (or raise). ``norm``:
        the global norm of every gradient, when clipping computed it (else the gradients are read once)."""
        return self._nonfinite.check(
            lambda: [
                p.grad for o in self._optimizers for g in o.param_groups for p in g["params"] if p.grad is not None
            ],
            self.global_step + 1,
            lambda: [n for m in self._models for n in self.strategy.nonfinite_grad_names(m, 4)],
            norm,
        )

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.config.grad_accum_steps > 1 and not self._in_accumulate:
            warn_accumulation_unused(self.config.grad_accum_steps, self._origins.get("grad_accum_steps", "default"))
        if self.config.max_grad_norm is not None and not self._clipped:
            # max_grad_norm (DeepSpeed's gradient_clipping) is honoured in a hand-written loop too.
            self.clip_grad_norm_(self.config.max_grad_norm)
        self.finish_gradient_sync()
        skip = self._check_nonfinite()
        if optimizer is self._optimizers[0].optimizer:
            self.global_step += 1
        self._round.add(id(optimizer))
        round_done = self._round >= {id(o.optimizer) for o in self._optimizers}
        if round_done:
            self._clipped, self._round = False, set()  # every optimizer stepped: the next step clips afresh
            self._nonfinite.end_round()
        self.step_was_skipped = True if skip else self.precision.step(optimizer)
        if not self.step_was_skipped:
            self._stepped.add(id(optimizer))
        self.precision.end_round_if_complete([o.optimizer for o in self._optimizers])
        self.strategy.after_optimizer_step(optimizer)

    def _consume_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """True once for each real step of ``optimizer``: its scheduler counts that step."""
        if id(optimizer) in self._stepped:
            self._stepped.discard(id(optimizer))
            return True
        return False

    def train_step(
        self, batch: Any, loss_fn: Callable[[nn.Module, Any], Any], optimizer_step: bool = True
    ) -> torch.Tensor:
        """One micro-batch of training: forward, backward and, at the window's end, clip and step.

        ``loss_fn(model, batch)`` returns a mean loss, or a tuple ``(loss_sum, items)``. Returns the
        detached loss (the mean over items in the second form). Needs exactly one prepared model and
        optimizer; a prepared scheduler, if any, steps with them. Under ``strategy="pipeline"`` one call
        is a whole step: the batch is split into micro-batches that the schedule pushes through the stages,
        ``loss_fn`` runs once per micro-batch, and the step's mean loss is returned on every stage.
        ``optimizer_step=False`` (pipeline only, as torch's ``schedule.step()``) stops after the gradients are
        reduced: the caller then calls ``optimizer.step()`` (which clips to ``max_grad_norm``), the scheduler's
        ``step()`` and ``optimizer.zero_grad()``.
        """
        if not self._resumer.done:
            self._check_resumed()
        check_train_step(optimizer_step, self.strategy.drives_backward, self.config.strategy, self._models,
                         self._optimizers)  # fmt: skip
        model, optimizer = self._models[0], self._optimizers[0]
        if self.strategy.drives_backward:
            loss = self.strategy.train_step(model, batch, loss_fn)
            if optimizer_step:
                self._clip_step_zero(optimizer)
            return loss
        with self.accumulate():
            out = loss_fn(model, batch)
            if isinstance(out, tuple):
                loss_sum, items = out
                self.backward(loss_sum, items=items)
                loss = loss_sum.detach() / (items.to(loss_sum.device) if isinstance(items, torch.Tensor) else items)
            else:
                self.backward(out)
                loss = out.detach()
            self._clip_step_zero(optimizer)
        return loss

    def _clip_step_zero(self, optimizer: PreparedOptimizer) -> None:
        if self.config.max_grad_norm is not None:
            self.clip_grad_norm_(self.config.max_grad_norm)
        optimizer.step()
        for sched in optimizer.schedulers:
            sched.step()
        optimizer.zero_grad()

    # ------------------------------------------------------------------ world
    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def local_rank(self) -> int:
        return self.world.local_rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    # Accelerate's names for world_size, rank and local_rank.
    num_processes = property(lambda self: self.world.world_size, doc="The number of processes in the job.")
    process_index = property(lambda self: self.world.rank, doc="This process's index in the job.")
    local_process_index = property(lambda self: self.world.local_rank, doc="This process's index on its machine.")

    @property
    def is_main_process(self) -> bool:
        return self.world.rank == 0

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the batch just read from a prepared DataLoader is its last (Accelerate's
        ``gradient_state.end_of_dataloader``); with loaders inside one another, the innermost one's."""
        return self._loaders.end_of_dataloader

    @property
    def is_local_main_process(self) -> bool:
        """True on the first process of each machine."""
        return self.world.local_rank == 0

    # ------------------------------------------------------------ collectives
    def gather(self, data: Any) -> Any:
        """Accelerate's ``gather``: every process's tensors, concatenated along dim 0 in rank order.

        Takes a tensor or nested lists, tuples and dicts of tensors, and returns the same structure. A 0-d tensor
        becomes 1-d (one item per process). The first dimension may differ between processes; the others and the
        dtype must agree. Nothing is dropped: after a pass over a prepared DataLoader the padding that evened out
        the last batch is still there (``gather_for_metrics`` drops it). Every process must call it.
        """
        return collectives.gather(data, self.device)

    def gather_for_metrics(self, data: Any) -> Any:
        """Gather tensors (or nested lists/dicts/tuples of them) from every rank, in global sample order.

        The padding that evened out the last batch is dropped, so a pass over a prepared DataLoader gives
        exactly ``len(dataset)`` items, each once.
        """
        return collectives.gather_for_metrics(data, self.device, self.topology, self._loaders)

    def reduce(self, tensor: torch.Tensor | Number, op: str = "mean") -> torch.Tensor:
        """All-reduce a copy of ``tensor`` over the data-parallel ranks with op in sum, mean, max, min."""
        return collectives.reduce_copy(tensor, op, self.device, self.topology.dp_group)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def wait(self) -> None:
        """Wait until every rank gets here."""
        collectives.barrier()

    def wait_for_everyone(self) -> None:
        """Accelerate's name for ``wait``: return once every process has called it."""
        collectives.barrier()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on rank 0 first (e.g. to download or cache data), then on the other ranks."""
        return collectives.first_then_rest(self.is_main_process)

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on the first process of each machine first, then on the others (e.g. to fill a cache on
        each machine's local disk)."""
        return collectives.first_then_rest(self.is_local_main_process)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's share of ``inputs`` (a list, tuple, tensor or dict of them), for data-parallel inference,
        as Accelerate's: contiguous pieces in rank order, the first ``len % world`` ranks one item more. With
        ``apply_padding`` every rank gets the same count (its last item repeated), so that ``gather`` lines up;
        drop the padding from the gathered result (``gather_for_metrics`` does it for a prepared loader)."""
        yield collectives.share(inputs, self.world.rank, self.world.world_size, apply_padding)

    def save(self, obj: Any, f: str | os.PathLike[str] | IO[bytes], safe_serialization: bool | None = None) -> None:
        """Accelerate's ``save``: write ``obj`` to ``f`` on the main process only, in place of ``torch.save``.

        A dict of tensors to a path ending in ``.safetensors`` (or with ``safe_serialization=True``) is written with
        safetensors, with the metadata ``{"format": "pt"}``; anything else goes through ``torch.save``, a pickle,
        as under Accelerate (load it with ``torch.load(f, weights_only=False)`` when it holds more than tensors).
        No barrier: the other processes return at once, so call ``engine.wait_for_everyone()`` before they read it.
        For a prepared model's weights use ``engine.save_model`` (or ``engine.get_state_dict`` on every rank):
        under zero3 no rank holds them whole.
        """
        collectives.save_object(obj, f, safe_serialization, self.is_main_process)

    # ------------------------------------------------------------- state
    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's own module, without anything phalanx wrapped around it. Under zero3 its parameters hold only
        this rank's shard between forwards: its ``state_dict()`` (and a transformers ``save_pretrained`` without
        ``state_dict=``) is refused; use ``engine.save_model`` or ``engine.get_state_dict`` on every rank. A
        ``torch.compile`` of the prepared model unwraps to the same module."""
        return self.strategy.unwrap_model(as_prepared(model, self._models))

    def get_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unsharded state dict, on CPU, on every rank, under every strategy. A collective: every rank
        calls it (e.g. ``unwrapped.save_pretrained(d, state_dict=engine.get_state_dict(model))`` on every rank).
        Tied keys share one tensor, as in ``model.state_dict()``, so that transformers saves a tied weight once."""
        model = as_prepared(model, self._models)
        state = self._tp.state_view(self.strategy).full_state_dict(model)
        for key, held_as in self.strategy.state_dict_keys(model).items():
            if key != held_as and key in state and held_as in state:
                state[key] = state[held_as]
        return state

    @property
    def epoch(self) -> int:
        """The epoch the run is in, counting from 0: the passes completed over the first prepared DataLoader.

        It is the loader's own epoch, which ``save_state``/``load_state`` restore on any world size: after a resume
        in the middle of epoch 3 it is 3, and the loader goes on from where that epoch stopped, so that
        ``for epoch in range(engine.epoch, num_epochs): for batch in loader: ...`` resumes exactly. It moves to
        the next epoch when a pass over the loader ends (or ``loader.set_epoch`` sets it). With several loaders it
        follows the first one prepared (prepare the training loader first); with none prepared it is an error.
        """
        if not self._prepared_loaders:
            raise RuntimeError(
                "engine.epoch counts passes over the first prepared DataLoader, and no DataLoader was prepared; pass "
                "the training loader to engine.prepare, or count epochs in your own loop"
            )
        return self._prepared_loaders[0].epoch

    # --------------------------------------------------------------- reports
    def memory_report(self) -> dict[str, Any]:
        """Bytes this rank holds, by kind, next to what the ZeRO paper's model predicts for the strategy.

        ``held`` has ``params``, ``grads``, ``optimizer_state`` (fp32 master copies included),
        ``comm_buffers`` (the largest transient buffers of a step: gathered zero3 units, zero2 buckets)
        and ``offloaded_to_disk``. ``predicted`` applies the formulas (ddp (p+g+K)Ψ, zero1 (p+g)Ψ + KΨ/N,
        zero2 pΨ + (g+K)Ψ/N, zero3 (p+g+K)Ψ/N) to this model; they agree up to padding to multiples of N.
        ``peak`` is measured from the process: its peak resident bytes (``rss``) and, on CUDA, peak allocated bytes.
        """
        report = self.strategy.memory_report([o.optimizer for o in self._optimizers])
        report["peak"] = peak_memory_bytes(self.device)
        report["mesh"] = self.topology.mesh.as_dict()
        return report

    def precision_report(self) -> dict[str, str]:
        """The dtypes actually in use: parameters, gradients, optimizer state, compute and communication."""
        return precision_report(self.precision, self._models, self._optimizers, self.strategy.comm_dtype())
