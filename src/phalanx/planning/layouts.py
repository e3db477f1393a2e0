"""Which layouts a model and a world allow, each estimated, and the one to use.

The data-parallel layouts always: ddp, zero1, zero2, zero3, and zero2 and zero3 with their state offloaded to the
host. Then each model-parallel degree the mesh and the model allow, over zero1 (Megatron-LM's distributed optimizer,
and the pipeline's ``pp_zero_stage=1``):

- tp: a power of two that divides the processes per machine (tensor parallelism stays inside a machine's links) and
  the model's attention heads and key/value heads;
- cp: divides the world, with the sequence split into 2 x cp chunks (zig-zag);
- pp: divides the world, with a layer or more per stage, under each schedule asked for (``pp_schedules``; by
  default 1f1b, interleaved_1f1b with ``pp_virtual_stages`` chunks a rank, a layer or more each, and zb_h1);
- ep: divides the data-parallel ranks and the model's experts.

The recommendation is the layout that fits with the fewest bytes sent per step; among equals, one that keeps its state
on the device, then the least recomputation, then the least memory. A pipeline whose stages would idle more than
``max_bubble`` of the step (a quarter by default: (pp - 1) / (m + pp - 1) under 1F1B, with m micro-batches a step;
``schedules.py`` has the others') is left out, as its idle time costs more than the traffic it saves; more
micro-batches a step (``--grad-accum``), interleaving or ZB-H1 shrink it.
"""

from __future__ import annotations

from phalanx.planning.activations import POLICIES
from phalanx.planning.estimate import Estimate, Layout, Workload, World, estimate
from phalanx.planning.model import ModelShape, PlanError
from phalanx.planning.schedules import SCHEDULES

__all__ = ["DEFAULT_SCHEDULES", "candidate_layouts", "plan", "recommend"]

DEFAULT_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1")
"""The schedules a pipeline layout is planned under unless told: gpipe idles as 1F1B does and holds more."""


def _degrees(limit: int) -> list[int]:
    """Powers of two above 1 that divide ``limit``."""
    out, d = [], 2
    while d <= limit and limit % d == 0:
        out.append(d)
        d *= 2
    return out


def candidate_layouts(
    shape: ModelShape,
    world: World,
    work: Workload,
    pp_schedules: tuple[str, ...] = DEFAULT_SCHEDULES,
    pp_virtual_stages: int = 2,
) -> list[Layout]:
    """The layouts to estimate; each pipeline degree once for each of ``pp_schedules``, interleaved_1f1b with
    ``pp_virtual_stages`` chunks a rank (where the layers allow a layer a chunk)."""
    for schedule in pp_schedules:
        if schedule not in SCHEDULES:
            raise PlanError(f"pp_schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    if "interleaved_1f1b" in pp_schedules and pp_virtual_stages < 2:
        raise PlanError(
            f"pp_virtual_stages={pp_virtual_stages}: interleaved_1f1b needs 2 or more chunks a rank (use 2 or more, "
            "or another --pp-schedule)"
        )
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
        for schedule in pp_schedules:
            v = pp_virtual_stages if schedule == "interleaved_1f1b" else 1
            if d * v <= stages:
                layouts.append(Layout("zero1", pp=d, schedule=schedule, virtual_stages=v))
    if shape.experts:
        for d in _degrees(world.size):
            if shape.experts % d == 0:
                layouts.append(Layout("zero1", ep=d))
    return layouts


def plan(
    shape: ModelShape,
    world: World,
    work: Workload,
    pp_schedules: tuple[str, ...] = DEFAULT_SCHEDULES,
    pp_virtual_stages: int = 2,
) -> list[Estimate]:
    """Every candidate layout, estimated (pipelines under each of ``pp_schedules``)."""
    layouts = candidate_layouts(shape, world, work, pp_schedules, pp_virtual_stages)
    return [estimate(shape, world, work, layout) for layout in layouts]


def recommend(estimates: list[Estimate], max_bubble: float = 0.25) -> Estimate | None:
    """The fitting layout with the fewest bytes sent per step (then: no offload, the least recomputation, the least
    memory), among those whose pipeline bubble is at most ``max_bubble`` (each pipeline under its own schedule) and
    whose costs are all counted (not a pipeline of a model whose activations are unknown); None when none fits."""
    fitting = [e for e in estimates if e.fits and e.counted and e.bubble <= max_bubble]
    if not fitting:
        return None
    return min(fitting, key=lambda e: (round(e.sent), e.layout.offload, POLICIES.index(e.policy or "full"), e.total()))
