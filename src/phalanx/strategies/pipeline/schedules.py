"""The pipeline schedules: in which order each stage runs the forwards and backwards of a step's micro-batches.

Both have the bubble (pp-1)/(m+pp-1) for pp stages and m micro-batches.

- GPipe: every forward, then every backward; each stage holds the activations of all m micro-batches.
- 1F1B: a warm-up of (pp - stage - 1) forwards, then one forward and one backward in turn, then the remaining
  backwards; a stage holds at most pp - stage micro-batches. In the steady state a send and the receive of the
  opposite direction are posted together (``StageLink.send_forward_recv_backward``), so neither side blocks the
  other.

A schedule only orders the work: ``pipe._forward`` and ``pipe._backward`` run one micro-batch on this stage, and
``pipe.link`` moves the boundary tensors. A new schedule (interleaved, zero-bubble) is a new function here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx.config.strategy_options import SCHEDULES
from phalanx.strategies.pipeline.microbatch import MicroBatch

if TYPE_CHECKING:
    from phalanx.strategies.pipeline.strategy import PipelineStrategy

__all__ = ["run_gpipe", "run_1f1b", "SCHEDULE_RUNS"]


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


SCHEDULE_RUNS: dict[str, Callable[[PipelineStrategy, list[Any], list[MicroBatch], Callable[..., Any], Any], None]] = {
    "gpipe": run_gpipe,
    "1f1b": run_1f1b,
}
assert set(SCHEDULE_RUNS) == set(SCHEDULES), "every schedule the options allow has a run function"
