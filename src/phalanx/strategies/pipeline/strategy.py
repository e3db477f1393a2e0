"""Pipeline parallelism: an ``nn.Sequential`` split into stages, micro-batches pushed through by GPipe or 1F1B.

    engine = phalanx.Engine(strategy="pipeline", pp_size=2, pp_schedule="1f1b", pp_microbatches=8)
    model, optimizer = engine.prepare(nn.Sequential(*blocks), optimizer)
    loss = engine.train_step((x, y), lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]))

Run it with ``phalanx launch -n 4 train.py --config pp.yaml`` (pp_size: 2 gives two stages of two
data-parallel replicas each). The training script is the one ddp runs: ``loss_fn(model, batch)`` is called
once per micro-batch on every stage. On every stage but the last, ``model(...)`` runs this stage's blocks,
hands the output to the schedule and ends ``loss_fn`` there; on the last stage it returns the real output
and ``loss_fn`` computes the loss as usual.

- Partition (``partition.py``): contiguous blocks, balanced by parameter count (``pp_partition: parameters``), by
  block count (``uniform``), by measured forward+backward time (``time``: measured on the first micro-batch of the
  first step, before the model is split), or at explicit cut points (``"3,6"``: stage 1 starts at block 3, stage 2
  at 6).
- Each rank keeps only its stage's blocks; the other blocks' parameters move to the meta device. A model built
  under ``torch.device("meta")`` gets the values of the same model built on the CPU (``partition.materialise_stage``:
  every block in order on the host, one at a time), so no rank ever allocates the whole model.
- Communication (``p2p.py``): ``isend``/``irecv`` between neighbouring stages. Shapes and dtypes cross once per distinct
  micro-batch signature and are cached.
- The schedules (``schedules.py``) order each stage's forwards and backwards; this file runs one micro-batch's
  forward or backward for them. The stage module ``model(...)`` calls, micro-batch bookkeeping and batch
  splitting are in ``microbatch.py``.
- Data parallel (``sync.py``): the ranks of one stage reduce its gradients once per step, after the schedule; rank
  layout is pp-major (see ``runtime/topology.py``). The pipeline holds a sync object for that: ddp buckets, or
  zero1's with ``pp_zero_stage: 1``, so that each replica keeps and steps the optimizer state of its slice only.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.checkpoint.shards import ShardEntry, StateReader
from phalanx.config.strategy_options import PipelineOptions, parse_partition
from phalanx.logging import get_logger
from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import broadcast_coalesced
from phalanx.runtime.placement import place_module
from phalanx.strategies._replicas import group_rank0
from phalanx.strategies.base import Strategy
from phalanx.strategies.context_parallel.context import check_even_targets
from phalanx.strategies.pipeline.actions import Action, schedule_orders
from phalanx.strategies.pipeline.hf_plan import block_homes, has_pp_plan, sequential_from_pp_plan
from phalanx.strategies.pipeline.lanes import ChunkLink, build_lanes
from phalanx.strategies.pipeline.microbatch import (
    MicroBatch,
    NoBackward,
    PipelineStage,
    StageDone,
    map_floats,
    signature,
    split_batch,
)
from phalanx.strategies.pipeline.p2p import StageLink, boundary_tensors, decode_meta, encode_meta, flat_tensors, meta_of
from phalanx.strategies.pipeline.partition import (
    block_costs,
    check_no_shared_parameters,
    materialise_stage,
    partition_blocks,
    time_blocks,
)
from phalanx.strategies.pipeline.schedules import ACTION_SCHEDULES, SCHEDULE_RUNS
from phalanx.strategies.pipeline.split_backward import backward_inputs
from phalanx.strategies.pipeline.sync import stage_sync

if TYPE_CHECKING:
    pass

__all__ = ["PipelineStrategy", "PipelineStage"]


class PipelineStrategy(Strategy):
    """``strategy="pipeline"``: stages over ``pp_size`` ranks, each stage data-parallel over ``dp_size`` ranks. How a
    stage's replicas reduce its gradients is the sync object's business (``sync.py``): ddp buckets, or zero1 with
    ``pp_zero_stage: 1``."""

    name = "pipeline"
    supports_pipeline = True
    shards_gradients = True  # each stage holds only its own gradients: an fp16 overflow anywhere skips every stage
    drives_backward = True
    materialises_meta = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        topo = self.topology
        self.opts = self.config.options(PipelineOptions)
        self.sync = stage_sync(self.config, topo, self.device, self.precision)
        self.sync.strategy.stats = self.stats  # one count of everything this rank sends
        self.pp_size, self.stage_index = topo.pp_size, topo.pp_stage
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == self.pp_size - 1
        self.schedule = self.opts.pp_schedule
        self.microbatches = self.opts.pp_microbatches or 2 * self.pp_size
        self.virtual_stages = self.opts.virtual_stages()
        self.num_chunks = self.pp_size * self.virtual_stages
        """Chunks of the model over the pipeline: chunk c runs on stage c % pp_size (pp_size without virtual stages)."""
        self.my_chunks = list(range(self.stage_index, self.num_chunks, self.pp_size))
        self.action_orders: list[list[Action]] | None = None
        if self.schedule in ACTION_SCHEDULES:
            # Checked now, on every rank alike: the micro-batch count against the schedule's rule.
            self.action_orders = schedule_orders(self.schedule, self.pp_size, self.virtual_stages, self.microbatches)
        self.partition = parse_partition(self.opts.pp_partition)
        # The same (dp, tp) coordinates in the previous and next stage.
        here = topo.coordinates(topo.rank)
        self.prev_rank = topo.mesh.rank_at((here[0] - 1, *here[1:])) if not self.is_first else None
        self.next_rank = topo.mesh.rank_at((here[0] + 1, *here[1:])) if not self.is_last else None
        self.last_rank = topo.mesh.rank_at((self.pp_size - 1, *here[1:]))
        self.stage_module: PipelineStage | None = None
        self.stage_starts: list[int] = []
        self.block_names: list[str] = []
        self.block_costs: list[float] = []
        self.last_step_timing: dict[str, float] = {}
        """``step_s`` (the schedule's wall time) and ``idle_s`` (time blocked on receives) of the last train_step;
        under interleaved_1f1b and zb_h1 also ``F_s``, ``B_s``, ``W_s`` and ``BW_s``: the time in each kind of work."""
        self.kind_s: dict[str, float] = {}
        self.peak_in_flight = 0
        """The most micro-batches whose activations this stage held at once in the last train_step."""
        self._pending_partition: nn.Sequential | None = None  # pp_partition=time: split at the first step
        self._remote: dict[int, weakref.ref[torch.Tensor]] = {}
        self._pp_optimizers: list[torch.optim.Optimizer] = []
        self._layout: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = []  # per stage: state_dict entries
        self._order: list[str] = []  # every state_dict key, in the model's order
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._sd_keys: dict[str, str] = {}
        self.link = StageLink(self.stage_index, self.prev_rank, self.next_rank, self.device, self.stats)
        self.chunk_link: ChunkLink | None = None
        self._records: dict[tuple[int, int], MicroBatch] = {}
        if self.action_orders is not None or self.virtual_stages > 1:
            column = topo.axis_ranks(("pp",))
            lanes: dict[str, Any] = {}
            if self.pp_size > 1:
                columns = list(dict.fromkeys(tuple(topo.axis_ranks(("pp",), r)) for r in range(topo.world_size)))
                lanes = build_lanes([list(c) for c in columns], topo.rank, wrap=self.virtual_stages > 1)
            self.chunk_link = ChunkLink(
                self.stage_index,
                column,
                lanes,
                self.device,
                self.stats,
                lambda c, i: self._records[(c, i)].outputs_flat,
            )
        self._out_meta: dict[Any, Any] = {}
        self._active: MicroBatch | None = None
        self._in_flight = 0
        self._items: torch.Tensor | None = None  # loss_fn returned (loss_sum, items): the step's item count so far
        self._scale_ready = False

    # ------------------------------------------------------------------------------------- wrapping
    def place_model(self, model: nn.Module) -> nn.Module:
        return model  # only this stage's blocks go to the device, once the model is split

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if self.stage_module is not None or self._pending_partition is not None:
            raise ValueError(
                "strategy='pipeline' splits one model into stages; a second model was passed to engine.prepare "
                "(prepare only the pipelined model with this Engine)"
            )
        if isinstance(model, nn.ModuleList):
            model = nn.Sequential(*model)
        elif not isinstance(model, nn.Sequential) and has_pp_plan(model):
            model = sequential_from_pp_plan(model)  # a transformers model, by its base_model_pp_plan
        if not isinstance(model, nn.Sequential):
            raise TypeError(
                "strategy='pipeline' splits an nn.Sequential (or a list of blocks, or a transformers model with a "
                f"base_model_pp_plan) into stages; got {type(model).__name__}. Write the model as "
                "nn.Sequential(block0, block1, ...), where each block takes the previous block's output (a tensor or "
                "a tuple of tensors)"
            )
        blocks = list(model.named_children())
        if len(blocks) < self.num_chunks:
            per = f" x pp_virtual_stages={self.virtual_stages} chunks" if self.virtual_stages > 1 else " stages"
            raise ValueError(
                f"cannot split {len(blocks)} blocks into pp_size={self.pp_size}{per}: every chunk needs at least one "
                f"block (use pp_size{' x pp_virtual_stages' if self.virtual_stages > 1 else ''} <= {len(blocks)}, or "
                "split the model into more blocks)"
            )
        self.block_names = [n for n, _ in blocks]
        if self.partition == "time":
            if any(p.is_meta for p in model.parameters()):
                raise ValueError(
                    "pp_partition='time' runs every block once to time it, so the model cannot be on the meta "
                    "device (build it for real, or use pp_partition='parameters' or explicit cut points)"
                )
            place_module(model, self.device, what="pipeline: the whole model, to time its blocks")
            self._pending_partition = model
            stage = PipelineStage(blocks, self, block_homes(model))  # every block, until the first step timed them
            self._adopt_config(stage, model)
            self.stage_module = stage
            return stage
        if isinstance(self.partition, list):
            starts = [0, *self.partition]
            if len(starts) != self.num_chunks or starts[-1] >= len(blocks):
                raise ValueError(
                    f"pp_partition={self.opts.pp_partition!r} gives {len(starts)} stages over {len(blocks)} blocks; "
                    f"pp_size={self.pp_size}"
                    + (f" x pp_virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else "")
                    + f" needs {self.num_chunks - 1} cut points, each below {len(blocks)}"
                )
            self.block_costs = block_costs("parameters", [b for _, b in blocks])
        else:
            self.block_costs = block_costs(self.partition, [b for _, b in blocks])
            starts = partition_blocks(self.block_costs, self.num_chunks)
        return self._split(model, starts)

    def _split(self, model: nn.Sequential, starts: list[int]) -> PipelineStage:
        blocks = list(model.named_children())
        self.stage_starts = starts
        bounds = [*starts, len(blocks)]
        chunk_of_block = [c for c in range(self.num_chunks) for _ in range(bounds[c], bounds[c + 1])]
        stage_of_block = [c % self.pp_size for c in chunk_of_block]
        homes = block_homes(model)
        check_no_shared_parameters(blocks, stage_of_block, homes)
        held = {i for i, s in enumerate(stage_of_block) if s == self.stage_index}
        mine = [b for i, b in enumerate(blocks) if i in held]
        others = [b for i, b in enumerate(blocks) if i not in held]
        # Every stage's state_dict layout (names, shapes, dtypes), kept so that any rank can rebuild the whole. The
        # names are those the stage module gives: each block's modules at their places in the model (``homes``).
        self._layout = [[] for _ in range(self.pp_size)]
        self._order = []
        for (name, _block), s in zip(blocks, stage_of_block):
            for path, module in homes[name]:
                for k, v in module.state_dict(keep_vars=True).items():
                    self._layout[s].append((f"{path}.{k}", tuple(v.shape), v.dtype))
                    self._order.append(f"{path}.{k}")
        # The whole model's saved tensors (what each stage's sharded_state gives: parameters once, every buffer)
        # and how its state_dict keys map to them, for checkpoints.
        # A tensor shared by two blocks (of one stage) is saved once, under its first name, as named_parameters
        # of the stage gives it.
        self._shapes, self._sd_keys, first = {}, {}, {}
        for name, _block in blocks:
            for path, module in homes[name]:
                for k, t in [*module.named_parameters(), *module.named_buffers()]:
                    if id(t) not in first:
                        first[id(t)] = f"{path}.{k}"
                        self._shapes[f"{path}.{k}"] = tuple(t.shape)
        for name, _block in blocks:
            for path, module in homes[name]:
                self._sd_keys.update(
                    {
                        f"{path}.{k}": first.get(id(v), f"{path}.{k}")
                        for k, v in module.state_dict(keep_vars=True).items()
                    }
                )
        # Every block initialised in order on the host (a meta-built model gets the values of a CPU build), this
        # stage's on the device; the others end on meta, their parameter objects kept: this rank never holds
        # another stage's parameters.
        materialise_stage(model, 0, 0, self.device, held=held)
        for _name, block in others:
            for p in block.parameters():
                self._remote[id(p)] = weakref.ref(p)
        if self.stage_module is not None:  # pp_partition=time: drop the blocks of the other stages from the timed stage
            self.stage_module.drop_blocks([name for name, _ in others])
            stage = self.stage_module
        else:
            stage = PipelineStage(mine, self, homes)
            self._adopt_config(stage, model)
        if self.virtual_stages > 1:
            stage.chunk_blocks.update(
                {c: [blocks[i][0] for i in range(bounds[c], bounds[c + 1])] for c in self.my_chunks}
            )
        self.stage_module = stage
        self._pending_partition = None
        if any(p.requires_grad for p in stage.parameters()):
            self.sync.wrap_stage(stage)  # broadcast from the stage's first replica; gradients over its dp group
        elif self.topology.dp_size > 1:
            # Nothing to train in this stage: its replicas only need the same weights and buffers.
            tensors = [t.data for t in stage.parameters()] + list(stage.buffers())
            broadcast_coalesced(tensors, src=group_rank0(self.topology.dp_group), group=self.topology.dp_group)
        for opt in self._pp_optimizers:  # pp_partition=time: the optimizers were prepared before the split
            self._adopt_optimizer(opt)
        get_logger().debug(
            f"pipeline stage {self.stage_index}/{self.pp_size}: blocks {sorted(held)}, "
            f"{sum(p.numel() for p in stage.parameters())} parameters"
        )
        return stage

    @staticmethod
    def _adopt_config(stage: PipelineStage, model: nn.Sequential) -> None:
        """A transformers model's config on the stage, so that ``engine.save_model`` writes its ``config.json``
        beside the weights (which carry the model's own names) and ``from_pretrained`` loads the directory."""
        config = getattr(model, "config", None)
        if config is not None:
            stage.config = config

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.sync.check_optimizer(optimizer)  # now, even when pp_partition=time adopts it only at the first step
        self._pp_optimizers.append(optimizer)
        if self._pending_partition is None:
            return self._adopt_optimizer(optimizer)
        return optimizer  # pp_partition=time: adopted once the first step has split the model

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Drop the other stages' parameters from ``optimizer``, then let the data-parallel side take it."""
        self._drop_remote(optimizer)
        return self.sync.strategy.wrap_optimizer(optimizer)

    def _drop_remote(self, optimizer: torch.optim.Optimizer) -> None:
        def remote(p: torch.Tensor) -> bool:
            ref = self._remote.get(id(p))
            return ref is not None and ref() is p

        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if not remote(p)]
        for p in [p for p in optimizer.state if remote(p)]:
            del optimizer.state[p]

    # ------------------------------------------------------------------------------------ the schedule
    def train_step(self, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any]) -> torch.Tensor:
        """Forward and backward of every micro-batch of ``batch`` by the configured schedule; reduce gradients
        over the stage's data-parallel ranks. Returns the mean loss of the step on every stage."""
        if model is not self.stage_module:
            raise ValueError("engine.train_step under strategy='pipeline' needs the model that engine.prepare returned")
        micro = split_batch(batch, self.microbatches, self.topology.dp_size)
        if self._pending_partition is not None:
            self._partition_by_time(micro[0], loss_fn)
        assert self.stage_module is not None
        key = ("train", self.stage_module.training, signature(micro[0]))
        self.link.idle_s, self.peak_in_flight, self._in_flight, self._items = 0.0, 0, 0, None
        if self.chunk_link is not None:
            self.chunk_link.idle_s = 0.0
        self.kind_s = dict.fromkeys(("F", "B", "W", "BW"), 0.0)
        if self.precision.scaler is not None and not self.is_last and not self._scale_ready:
            self.precision.scale_loss(torch.zeros((), device=self.device))  # creates the scale that unscale_ reads
            self._scale_ready = True
        t0 = time.perf_counter()
        self.sync.hold(True)  # micro-batches only accumulate; the reduction runs once, below
        mbs: list[MicroBatch] = []
        try:
            SCHEDULE_RUNS[self.schedule](self, micro, mbs, loss_fn, key)
            self.link.wait_sends()
            if self.chunk_link is not None:
                self.chunk_link.wait_sends()
        finally:
            self.sync.hold(False)
            self._active = None
            self._records.clear()
        # The last stage knows the loss and the item count (1 per replica when loss_fn returned a mean, which was
        # divided by m already): every stage learns both, without waiting on the device. Summed over the replicas,
        # the count is the gradients' divisor either way: the items of the whole step, or dp_size.
        summary = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, items, loss_fn gave means
        if self.is_last:
            losses = torch.stack([mb.loss for mb in mbs if mb.loss is not None]).double()
            items = self._items if self._items is not None else torch.ones((), device=self.device)
            means = torch.full((), float(self._items is None), dtype=torch.float64, device=self.device)
            summary = torch.stack([losses.sum(), items.to(device=self.device, dtype=torch.float64).reshape(()), means])
        if self.pp_size > 1:
            watched(dist.broadcast, summary, src=self.last_rank, group=self.topology.pp_group)
        if self.topology.cp_size > 1 and bool(summary[2]):  # means of cp chunks: exact when the chunks are even
            check_even_targets("strategy='pipeline'")  # on every stage alike
        total = summary[1:2].clone()
        if self.topology.dp_size > 1:
            watched(dist.all_reduce, total, group=self.topology.dp_group)
        self.set_grad_scale((1.0 / total[0]).to(torch.float32))
        self.sync.reduce()
        idle = self.link.idle_s + (self.chunk_link.idle_s if self.chunk_link is not None else 0.0)
        self.last_step_timing = {"step_s": time.perf_counter() - t0, "idle_s": idle}
        if self.action_orders is not None:
            self.last_step_timing.update({f"{k}_s": v for k, v in self.kind_s.items()})
        return (summary[0] / summary[1]).to(torch.float32)

    def _forward(
        self, index: int, batch: Any, received: Any, loss_fn: Callable[..., Any], key: Any, chunk: int | None = None
    ) -> MicroBatch:
        assert self.stage_module is not None
        mb = MicroBatch(index, received, self.stage_index if chunk is None else chunk)
        mb.inputs_flat = flat_tensors(received) if received is not None else []
        self._active = mb
        try:
            result = loss_fn(self.stage_module, batch)
        except StageDone:
            result = None
        finally:
            self._active = None
        if not mb.called:
            raise RuntimeError(
                "loss_fn(model, batch) did not call model(...): under strategy='pipeline' it must call the model "
                "exactly once per micro-batch"
            )
        if mb.chunk == self.num_chunks - 1:
            mb.loss = self._loss_of(result)
        else:
            mb.outputs_flat = boundary_tensors(mb.output, mb.chunk)
            mb.is_tuple, mb.output = isinstance(mb.output, (tuple, list)), None
        self._in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        return mb

    def _loss_of(self, result: Any) -> torch.Tensor:
        """The tensor to backward from for one micro-batch: mean loss / m, or the loss sum (scaled later)."""
        if isinstance(result, tuple):
            if len(result) != 2:
                raise ValueError(f"loss_fn returned a tuple of {len(result)}; return a mean loss, or (loss_sum, items)")
            loss_sum, items = result
            n = torch.as_tensor(items, dtype=torch.float64, device=self.device).detach().reshape(())
            self._items = n if self._items is None else self._items + n  # no host sync per micro-batch
            return loss_sum
        if not isinstance(result, torch.Tensor) or result.numel() != 1:
            raise ValueError(
                f"loss_fn must return a scalar loss tensor (or (loss_sum, items)); got {type(result).__name__}"
                + (f" of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else "")
            )
        return result.reshape(()) / self.microbatches

    def _backward(self, mb: MicroBatch, grads: list[torch.Tensor] | None) -> list[torch.Tensor]:
        if mb.chunk == self.num_chunks - 1:
            assert mb.loss is not None
            self.precision.scale_loss(mb.loss).backward()
            mb.loss = mb.loss.detach()
        else:
            assert grads is not None
            pairs = [(o, g) for o, g in zip(mb.outputs_flat, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], grad_tensors=[g for _, g in pairs])
            mb.outputs_flat = []
        input_grads = [
            (t.grad if t.grad is not None else torch.zeros_like(t)) for t in mb.inputs_flat if t.requires_grad
        ]
        mb.inputs_flat, mb.input = [], None
        self._in_flight -= 1
        return input_grads

    def _backward_input(self, mb: MicroBatch, grads: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Zero-bubble B: the gradients of this chunk's inputs only; the weights' part is kept in ``mb.weights``
        for ``_backward_weight``."""
        if mb.chunk == self.num_chunks - 1:
            assert mb.loss is not None
            roots: list[torch.Tensor] = [self.precision.scale_loss(mb.loss)]
            root_grads: list[torch.Tensor | None] = [None]
            mb.loss = mb.loss.detach()
        else:
            assert grads is not None
            pairs = [(o, g) for o, g in zip(mb.outputs_flat, grads) if o.requires_grad]
            roots, root_grads = [o for o, _ in pairs], [g for _, g in pairs]  # type: ignore[misc]
            mb.outputs_flat = []
        inputs = [t for t in mb.inputs_flat if t.requires_grad]
        found, mb.weights = backward_inputs(roots, list(root_grads), inputs, self._chunk_parameters(mb.chunk))
        mb.inputs_flat, mb.input = [], None
        return [g if g is not None else torch.zeros_like(t) for g, t in zip(found, inputs)]

    def _chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        stage = self.stage_module
        assert stage is not None
        names = stage.chunk_blocks.get(chunk)
        if names is None:
            return list(stage.parameters())
        return [p for n in names for p in stage.block(n).parameters()]

    def _backward_weight(self, mb: MicroBatch) -> None:
        """Zero-bubble W: the weight gradients that ``_backward_input`` left; the micro-batch's graph goes with it."""
        if mb.weights is not None:
            mb.weights.run()
            mb.weights = None
        self._in_flight -= 1

    # ------------------------------------------------------------------------- calls of model(...)
    def _model_call(self, stage: PipelineStage, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mb = self._active
        if mb is None:
            return self._forward_only(stage, args, kwargs)
        if mb.called:
            raise RuntimeError(
                "loss_fn called model(...) twice in one micro-batch; under strategy='pipeline' call it once"
            )
        mb.called = True
        mb.output = (
            stage.run_chunk(mb.chunk, args, kwargs) if mb.chunk == 0 else stage.run_chunk(mb.chunk, (mb.input,), {})
        )
        if mb.chunk != self.num_chunks - 1:
            raise StageDone
        return mb.output

    def _forward_only(self, stage: PipelineStage, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``model(x)`` outside train_step (evaluation, sampling): the whole pipeline on one micro-batch; the
        output is returned on every stage. Every rank of the pipeline must make the call."""
        self._require_split("model(...) outside engine.train_step")
        grad = torch.is_grad_enabled()
        key = ("forward", stage.training, signature((args, kwargs)))
        if self.virtual_stages > 1:
            return self._forward_only_chunks(stage, args, kwargs, key, grad)
        with torch.no_grad():
            x = stage.run_blocks(*args, **kwargs) if self.is_first else stage.run_blocks(self.link.recv_forward(key))
            if not self.is_last:
                self.link.send_forward(boundary_tensors(x, self.stage_index), isinstance(x, (tuple, list)), key)
                self.link.wait_sends()
            out = self._broadcast_output(x if self.is_last else None, key)
        if grad:
            return map_floats(out, lambda t: NoBackward.apply(t.requires_grad_(True)))
        return out

    def _forward_only_chunks(
        self, stage: PipelineStage, args: tuple[Any, ...], kwargs: dict[str, Any], key: Any, grad: bool
    ) -> Any:
        """``model(x)`` outside train_step under virtual stages: the batch goes round the ranks, chunk by chunk."""
        link = self.chunk_link
        assert link is not None
        link.start(
            [[("F", c, 0) for c in range(r, self.num_chunks, self.pp_size)] for r in range(self.pp_size)],
            self.num_chunks,
            key,
        )
        x: Any = None
        with torch.no_grad():
            for c in self.my_chunks:
                x = stage.run_chunk(c, args, kwargs) if c == 0 else stage.run_chunk(c, (link.recv_forward(c, 0),), {})
                if c < self.num_chunks - 1:
                    link.send_forward(c, 0, boundary_tensors(x, c), isinstance(x, (tuple, list)))
            link.wait_sends()
            out = self._broadcast_output(x if self.is_last else None, key)
        if grad:
            return map_floats(out, lambda t: NoBackward.apply(t.requires_grad_(True)))
        return out

    def _broadcast_output(self, out: Any, key: Any) -> Any:
        if self.pp_size == 1:
            return out
        group, src = self.topology.pp_group, self.last_rank
        if key not in self._out_meta:
            meta = (
                encode_meta(meta_of(boundary_tensors(out, self.stage_index), isinstance(out, tuple)))
                if self.is_last
                else None
            )
            length = torch.tensor([len(meta) if meta is not None else 0], dtype=torch.int64, device=self.device)
            watched(dist.broadcast, length, src=src, group=group)
            vec = (
                meta.to(self.device)
                if meta is not None
                else torch.empty(int(length), dtype=torch.int64, device=self.device)
            )
            watched(dist.broadcast, vec, src=src, group=group)
            self._out_meta[key] = decode_meta(vec.cpu())
        is_tuple, specs = self._out_meta[key]
        tensors = (
            boundary_tensors(out, self.stage_index)
            if self.is_last
            else [torch.empty(shape, dtype=dtype, device=self.device) for dtype, _, shape in specs]
        )
        for t in tensors:
            watched(dist.broadcast, t.contiguous() if self.is_last else t, src=src, group=group)
        return tuple(tensors) if is_tuple else tensors[0]

    def _partition_by_time(self, batch: Any, loss_fn: Callable[..., Any]) -> None:
        """Time each block's forward and backward on one micro-batch (on every rank, averaged), then split."""
        model = self._pending_partition
        assert model is not None
        times = time_blocks(list(model.children()), batch, loss_fn, self.device)
        if dist.is_initialized() and self.topology.world_size > 1:
            times = times.to(self.device)  # NCCL reduces device tensors only
            watched(dist.all_reduce, times)  # every rank must cut at the same blocks: use the mean over ranks
            times = times.cpu() / self.topology.world_size
        self.block_costs = times.tolist()
        self._split(model, partition_blocks(self.block_costs, self.num_chunks))

    # --------------------------------------------------------------------------- strategy interface
    def grad_shard_group(self) -> Any:
        return None  # the whole world: stages hold different gradients, replicas reduce theirs

    def reduced_grad_views(self, params: list[nn.Parameter]) -> list[torch.Tensor] | None:
        if self.stage_module is None:
            return None
        held = set(self.stage_module.parameters())
        return self.sync.strategy.reduced_grad_views([p for p in params if p in held])

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every stage's tensors, broadcast along the pipeline, so that each rank returns the whole state dict."""
        self._require_split("engine.get_state_dict")
        if self.pp_size == 1:
            return self.sync.full_state_dict(model)
        assert self.stage_module is not None
        out: dict[str, torch.Tensor] = {}
        local = self.stage_module.state_dict()
        for s, layout in enumerate(self._layout):
            src = self.topology.mesh.rank_at((s, *self.topology.coordinates(self.topology.rank)[1:]))
            by_dtype: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
            for name, shape, dtype in layout:
                by_dtype.setdefault(dtype, []).append((name, shape))
            for dtype, entries in by_dtype.items():
                if s == self.stage_index:
                    flat = torch.cat([local[n].detach().reshape(-1).to(self.device) for n, _ in entries])
                else:
                    flat = torch.empty(sum(math.prod(sh) for _, sh in entries), dtype=dtype, device=self.device)
                watched(dist.broadcast, flat, src=src, group=self.topology.pp_group)
                flat, offset = flat.cpu(), 0
                for name, shape in entries:
                    n = math.prod(shape)
                    out[name] = flat[offset : offset + n].view(shape).clone()
                    offset += n
        return {k: out[k] for k in self._order}  # the model's order (a stage's chunks are not contiguous)

    def sharded_state(self, model: nn.Module, optimizers: Any = None) -> list[ShardEntry]:
        self._require_split("saving the state")
        return self.sync.sharded_state(model, optimizers)  # each stage's replicas split its blocks' bytes

    def load_sharded_state(self, model: nn.Module, optimizers: Any, reader: StateReader) -> None:
        self._require_split("loading the state")
        self.sync.load_sharded_state(model, optimizers, reader)

    def state_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        self._require_split("checking a checkpoint against the model")
        return dict(self._shapes)

    def state_dict_keys(self, model: nn.Module) -> dict[str, str]:
        self._require_split("saving the state")
        return dict(self._sd_keys)

    def _require_split(self, what: str) -> None:
        if self._pending_partition is not None:
            raise RuntimeError(
                f"{what} needs the model split into stages, and pp_partition='time' splits it at the first "
                "engine.train_step (run one first, or partition by parameters or cut points)"
            )

    # The gradients, the optimizer and the memory are the data-parallel side's (sync.py).
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.sync.strategy.no_sync():
            yield

    def set_grad_scale(self, scale: float | torch.Tensor) -> None:
        self.sync.strategy.set_grad_scale(scale)

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.sync.strategy.after_optimizer_step(optimizer)

    def finish_gradient_sync(self) -> None:
        self.sync.strategy.finish_gradient_sync()

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        self.sync.strategy.zero_grad(optimizer, set_to_none)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        return self.sync.clip_grad_norm_(parameters, max_norm, norm_type)

    def memory_report(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        return self.sync.strategy.memory_report(optimizers)

    def comm_dtype(self) -> torch.dtype | None:
        return self.sync.strategy.comm_dtype()

    def describe(self) -> dict[str, Any]:
        bounds = [*self.stage_starts, len(self.block_names)]
        return {
            **self.sync.strategy.describe(),
            "strategy": self.name,
            "pp_size": self.pp_size,
            "dp_size": self.topology.dp_size,
            "stage": self.stage_index,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "microbatches": self.microbatches,
            "partition": self.opts.pp_partition,
            "pp_zero_stage": self.opts.pp_zero_stage,
            "stage_blocks": [self.block_names[a:b] for a, b in zip(bounds, bounds[1:])] if self.stage_starts else None,
            "stage_costs": [sum(self.block_costs[a:b]) for a, b in zip(bounds, bounds[1:])]
            if self.stage_starts
            else None,
        }
