"""Which layouts a model and a world allow, each estimated, and the one to use.

The data-parallel layouts always: ddp, zero1, zero2, zero3, and zero2 and zero3 with their state offloaded to the
host. Then each model-parallel degree the mesh and the model allow, over zero1 (Megatron-LM's distributed optimizer,
and the pipeline's ``pp_zero_stage=1``):

- tp: a power of two that divides the processes per machine (tensor parallelism stays inside a machine's links) and
  the model's attention heads and key/value heads;
- cp: divides the world, with the sequence split into 2 x cp chunks (zig-zag);
- pp: divides the world, with a layer or more per stage;
- ep: divides the data-parallel ranks and the model's experts.

The recommendation is the layout that fits with the fewest bytes sent per step; among equals, one that keeps its state
on the device, then the least recomputation, then the least memory. A pipeline whose stages would idle more than
``max_bubble`` of the step (a quarter by default: (pp - 1) / (m + pp - 1), with m micro-batches a step) is left out,
as its idle time costs more than the traffic it saves; more micro-batches a step (``--grad-accum``) shrink it.
"""

from __future__ import annotations

from phalanx.planning.activations import POLICIES
from phalanx.planning.estimate import Estimate, Layout, Workload, World, estimate
from phalanx.planning.model import ModelShape

__all__ = ["candidate_layouts", "plan", "recommend"]


def _degrees(limit: int) -> list[int]:
    """Powers of two above 1 that divide ``limit``."""
    out, d = [], 2
    while d <= limit and limit % d == 0:
        out.append(d)
        d *= 2
    return out


def candidate_layouts(shape: ModelShape, world: World, work: Workload) -> list[Layout]:
    layouts = [Layout(s) for s in ("ddp", "zero1", "zero2", "zero3")]
    layouts += [Layout("zero2", offload=True), Layout("zero3", offload=True)]
    if shape.is_decoder:
        for d in _degrees(world.nproc_per_node):
            if shape.heads and shape.heads % d == 0 and (shape.kv_heads or shape.heads) % d == 0:
                layouts.append(Layout("zero1", tp=d))
        for d in _degrees(world.size):
            if work.seq_len % (2 * d) == 0:
                layouts.append(Layout("zero1", cp=d))
    stages = shape.layers or len(shape.units)
    for d in _degrees(world.size):
        if d <= stages:
            layouts.append(Layout("zero1", pp=d))
    if shape.experts:
        for d in _degrees(world.size):
            if shape.experts % d == 0:
                layouts.append(Layout("zero1", ep=d))
    return layouts


def plan(shape: ModelShape, world: World, work: Workload) -> list[Estimate]:
    """Every candidate layout, estimated."""
    return [estimate(shape, world, work, layout) for layout in candidate_layouts(shape, world, work)]


def recommend(estimates: list[Estimate], max_bubble: float = 0.25) -> Estimate | None:
    """The fitting layout with the fewest bytes sent per step (then: no offload, the least recomputation, the least
    memory), among those whose pipeline bubble is at most ``max_bubble``; None when none fits."""
    fitting = [e for e in estimates if e.fits and e.bubble <= max_bubble]
    if not fitting:
        return None
    return min(fitting, key=lambda e: (round(e.sent), e.layout.offload, POLICIES.index(e.policy or "full"), e.total()))
