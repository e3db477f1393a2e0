"""Pipeline parallelism: the model split into stages over ranks, micro-batches pushed through by GPipe or 1F1B.

The rooms, each one idea:

- ``partition.py``   which contiguous blocks form each stage (parameters, blocks, time, cut points)
- ``p2p.py``         point-to-point between neighbouring stages, with the boundary shapes sent once
- ``microbatch.py``  the stage module that ``model(...)`` calls, micro-batch bookkeeping, batch splitting
- ``schedules.py``   GPipe and 1F1B: the order of forwards and backwards on each stage
- ``sync.py``        a stage's data-parallel replicas: whole-state (ddp) or zero1 gradient sync
- ``strategy.py``    the strategy: splits the model, runs one micro-batch, reduces once per step

Its settings (pp_size, pp_schedule, pp_microbatches, pp_partition, pp_zero_stage) are declared in
``phalanx/config/strategy_options.py``. The strategy loads on first use
(``from phalanx.strategies.pipeline import PipelineStrategy``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PipelineStrategy", "PipelineStage"]

_WHERE = {"PipelineStrategy": "strategy", "PipelineStage": "microbatch"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
