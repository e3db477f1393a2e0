"""The pipeline schedules: in which order each stage runs the forwards and backwards of a step's micro-batches.

GPipe and 1F1B have the bubble (pp-1)/(m+pp-1) for pp stages and m micro-batches.

- GPipe: every forward, then every backward; each stage holds the activations of all m micro-batches.
- 1F1B: a warm-up of (pp - stage - 1) forwards, then one forward and one backward in turn, then the remaining
  backwards; a stage holds at most pp - stage micro-batches. In the steady state a send and the receive of the
  opposite direction are posted together (``StageLink.send_forward_recv_backward``), so neither side blocks the
  other.

- Interleaved 1F1B and ZB-H1: each rank runs its list of actions (``actions.py``, which also states their
  bubbles) through :func:`run_actions`; ``pipe.chunk_link`` (``lanes.py``) moves the tensors between chunks.

A schedule only orders the work: ``pipe._forward`` and ``pipe._backward`` (or ``_backward_input`` and
``_backward_weight``) run one micro-batch on this stage, and ``pipe.link`` moves the boundary tensors. A new
schedule is a new function here, or a new list of actions in ``actions.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx.config.strategy_options import SCHEDULES
from phalanx.strategies.pipeline.microbatch import MicroBatch

if TYPE_CHECKING:
    from phalanx.strategies.pipeline.strategy import PipelineStrategy

__all__ = ["run_gpipe", "run_1f1b", "run_actions", "SCHEDULE_RUNS", "ACTION_SCHEDULES"]

ACTION_SCHEDULES = ("interleaved_1f1b", "zb_h1")
"""The schedules that run a list of actions per rank (``actions.py``)."""


def run_gpipe(
    pipe: PipelineStrategy, micro: list[Any], mbs: list[MicroBatch], loss_fn: Callable[..., Any], key: Any
) -> None:
    link = pipe.link
    for i in range(len(micro)):
        mbs.append(pipe._forward(i, micro[i], link.recv_forward(key), loss_fn, key))
        link.send_forward(mbs[i].outputs_flat, mbs[i].is_tuple, key)
    for i in range(len(micro)):
        link.send_backward(pipe._backward(mbs[i], link.recv_backward(mbs[i].outputs_flat)))


def run_1f1b(
    pipe: PipelineStrategy, micro: list[Any], mbs: list[MicroBatch], loss_fn: Callable[..., Any], key: Any
) -> None:
    link, m = pipe.link, len(micro)
    warmup = min(pipe.pp_size - pipe.stage_index - 1, m)
    for i in range(warmup):
        mbs.append(pipe._forward(i, micro[i], link.recv_forward(key), loss_fn, key))
        link.send_forward(mbs[i].outputs_flat, mbs[i].is_tuple, key)
    steady = m - warmup
    received = link.recv_forward(key) if steady > 0 else None
    for k in range(steady):
        i = warmup + k
        mbs.append(pipe._forward(i, micro[i], received, loss_fn, key))
        grads = link.send_forward_recv_backward(mbs[i].outputs_flat, mbs[i].is_tuple, key, mbs[k].outputs_flat)
        input_grads = pipe._backward(mbs[k], grads)
        if k == steady - 1:
            link.send_backward(input_grads)
        else:
            received = link.send_backward_recv_forward(input_grads, key)
    for k in range(steady, m):
        link.send_backward(pipe._backward(mbs[k], link.recv_backward(mbs[k].outputs_flat)))


def run_actions(
    pipe: PipelineStrategy, micro: list[Any], mbs: list[MicroBatch], loss_fn: Callable[..., Any], key: Any
) -> None:
    """This rank's list of actions: F, B (input gradients), W (weight gradients) or BW (both) of (chunk, micro)."""
    link, orders, records = pipe.chunk_link, pipe.action_orders, pipe._records
    assert link is not None and orders is not None
    last = pipe.num_chunks - 1
    link.start(orders, pipe.num_chunks, key)
    clock, spent = time.perf_counter, pipe.kind_s
    for kind, c, i in orders[pipe.stage_index]:
        if kind == "F":
            received = link.recv_forward(c, i) if c > 0 else None
            t0 = clock()
            mb = records[(c, i)] = pipe._forward(i, micro[i], received, loss_fn, key, chunk=c)
            spent["F"] += clock() - t0
            if c < last:
                link.send_forward(c, i, mb.outputs_flat, mb.is_tuple)
            else:
                mbs.append(mb)  # the losses
        elif kind == "W":
            t0 = clock()
            pipe._backward_weight(records.pop((c, i)))
            spent["W"] += clock() - t0
        else:
            mb = records[(c, i)]
            grads = link.recv_backward(c, i) if c < last else None
            t0 = clock()
            input_grads = pipe._backward(mb, grads) if kind == "BW" else pipe._backward_input(mb, grads)
            spent[kind] += clock() - t0
            if kind == "BW":
                del records[(c, i)]
            if c > 0:
                link.send_backward(c, i, input_grads)
    assert not records, f"micro-batches left without their weight gradients: {sorted(records)}"


SCHEDULE_RUNS: dict[str, Callable[[PipelineStrategy, list[Any], list[MicroBatch], Callable[..., Any], Any], None]] = {
    "gpipe": run_gpipe,
    "1f1b": run_1f1b,
    "interleaved_1f1b": run_actions,
    "zb_h1": run_actions,
}
assert set(SCHEDULE_RUNS) == set(SCHEDULES), "every schedule the options allow has a run function"
