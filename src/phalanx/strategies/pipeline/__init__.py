"""Pipeline parallelism: the model split into stages over ranks, micro-batches pushed through by GPipe, 1F1B,
interleaved 1F1B (several chunks per rank) or ZB-H1 (zero bubble).

The rooms, each one idea:

- ``partition.py``      which contiguous blocks form each stage or chunk (parameters, blocks, time, cut points)
- ``p2p.py``            point-to-point between neighbouring stages, with the boundary shapes sent once
- ``lanes.py``          point-to-point between chunks, for the schedules that run lists of actions
- ``microbatch.py``     the stage module that ``model(...)`` calls, micro-batch bookkeeping, batch splitting
- ``schedules.py``      GPipe and 1F1B, and the runner of action lists: the order of work on each stage
- ``actions.py``        interleaved 1F1B and ZB-H1 as lists of actions per rank; their bubbles; a simulator
- ``split_backward.py`` a backward in two parts: input gradients now, weight gradients later (ZB-H1)
- ``hf_plan.py``        a transformers model as pipeline blocks, from its ``base_model_pp_plan``
- ``sync.py``           a stage's data-parallel replicas: whole-state (ddp) or zero1 gradient sync
- ``strategy.py``       the strategy: splits the model, runs one micro-batch, reduces once per step

Its settings (pp_size, pp_schedule, pp_virtual_stages, pp_microbatches, pp_partition, pp_zero_stage) are declared in
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
