"""What a pipeline schedule costs: the share of a step its ranks idle, and how many micro-batches each rank holds.

For p pipeline ranks, m micro-batches a step and v model chunks a rank (``pp_virtual_stages``), with a micro-batch's
forward, input-gradient backward and weight-gradient backward costing the same on a stage (F = B = W, the zero-bubble
paper's working assumption), the idle share of a step is:

- ``gpipe``, ``1f1b``: (p - 1) / (m + p - 1);
- ``interleaved_1f1b``: (p - 1) / (v m + p - 1): each warm-up and cool-down hop moves a chunk, 1/v of a stage;
- ``zb_h1``: (p - 1 + d) / (3 m + p - 1 + d), d = max(0, p - m): the weight gradients fill all of the cool-down but
  (p - 1)(F + B - W); with fewer micro-batches than ranks there are too few of them to fill it.

These are the idle times of ``strategies/pipeline/actions.py``'s orders as its ``simulate()`` runs them, which
``tests/test_plan_schedules.py`` checks for many (p, m, v).

What each rank holds at its peak (:func:`in_flight`), read off the same orders:

- ``gpipe``: all m micro-batches, on every rank (the last one with the head and the loss of each);
- ``1f1b``: rank r holds min(m, p - r); the last rank one, with its head;
- ``interleaved_1f1b``: rank r holds min(2 (p - r - 1) + (v - 1) p + 1, v m) chunks, each 1/v of a stage (Megatron-LM's
  warm-up plus the one in steady state; rank 0 holds p + (p - 1)/v stages' worth); the last rank one head;
- ``zb_h1``: every rank holds min(m, p) micro-batches from their forward until their weight gradient (W) runs,
  and rank r has up to min(m, r + 1) of them between B and W: their whole graph is still alive (B runs with
  ``retain_graph``), and the gradient that reached each weight's node is kept for W. The last rank runs its first
  p - 1 weight gradients late, so it holds min(m, p) heads and losses where 1F1B holds one.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.config.strategy_options import SCHEDULES
from phalanx.planning.model import PlanError

__all__ = ["SCHEDULES", "InFlight", "check_schedule", "bubble", "in_flight"]


@dataclass(frozen=True)
class InFlight:
    """What one pipeline rank holds at its peak."""

    chunks: int
    """Chunks of forward activations alive at once (a chunk is the whole stage unless v > 1)."""
    heads: int
    """Of those, the micro-batches whose head and loss activations this rank holds (the last rank only)."""
    deferred: int
    """Micro-batches whose input gradient (B) has run and whose weight gradient (W) waits (zb_h1)."""


def check_schedule(schedule: str, pp: int, m: int, v: int) -> None:
    """Raise PlanError if ``schedule`` cannot run p = ``pp`` ranks, m micro-batches and v chunks a rank, as the
    engine's own checks would."""
    if schedule not in SCHEDULES:
        raise PlanError(f"pp_schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    if pp < 1 or m < 1:
        raise PlanError(f"a pipeline needs pp >= 1 and 1 or more micro-batches; got pp={pp}, micro-batches={m}")
    if schedule == "interleaved_1f1b":
        if v < 2:
            raise PlanError(
                f"pp_schedule='interleaved_1f1b' needs pp_virtual_stages >= 2 chunks per rank; got {v} (use 2 or "
                "more, or pp_schedule='1f1b' for one chunk)"
            )
        if m % pp:
            raise PlanError(
                f"pp_schedule='interleaved_1f1b' sends micro-batches round the {pp} ranks in groups of pp_size, so "
                f"the micro-batches a step must be a multiple of {pp}; got {m} (raise --grad-accum)"
            )
    elif v != 1:
        raise PlanError(
            f"pp_virtual_stages={v} applies to pp_schedule='interleaved_1f1b' only; got pp_schedule={schedule!r} "
            "(leave pp_virtual_stages unset)"
        )


def bubble(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """The share of a step each rank of a ``pp``-rank pipeline idles, with ``m`` micro-batches a step, F = B = W."""
    check_schedule(schedule, pp, m, v)
    if pp == 1:
        return 0.0
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (v * m + pp - 1)
    if schedule == "zb_h1":
        idle = pp - 1 + max(0, pp - m)  # in units of one W (= F = B) of a stage
        return idle / (3 * m + idle)
    return (pp - 1) / (m + pp - 1)


def in_flight(schedule: str, pp: int, m: int, v: int = 1) -> list[InFlight]:
    """Each rank's peak holding (rank 0 first), for ``m`` micro-batches on ``pp`` ranks of ``v`` chunks each; the
    counts are reached together, so the peak bytes are their sum."""
    check_schedule(schedule, pp, m, v)
    out = []
    for r in range(pp):
        last = r == pp - 1
        if schedule == "gpipe":
            held, heads, deferred = m, m if last else 0, 0
        elif schedule == "1f1b":
            held, heads, deferred = min(m, pp - r), 1 if last else 0, 0
        elif schedule == "interleaved_1f1b":
            held, heads, deferred = min(2 * (pp - r - 1) + (v - 1) * pp + 1, v * m), 1 if last else 0, 0
        else:  # zb_h1
            held, deferred = min(m, pp), min(m, r + 1)
            heads = held if last else 0
        out.append(InFlight(held, heads, deferred))
    return out
