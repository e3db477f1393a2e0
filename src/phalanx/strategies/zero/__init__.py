"""ZeRO stages 1-3: optimizer state, gradients and parameters sharded over the data-parallel ranks.

The rooms, each one idea:

- ``layout.py``       flat segments: parameters packed, padded to a multiple of N, rank r owning slice r
- ``collectives.py``  reduce-scatter of gradients and all-gather of parameters on segments
- ``pool.py``         the flat buffers they reuse (gathered units, gradient buffers), lent only when unreferenced
- ``base.py``         what every stage shares: the optimizer's pieces, the end of backward, clipping, memory
- ``state.py``        the checkpoint hooks: each rank gives and takes its own slices
- ``bucketed.py``     zero1 and zero2: buckets reduced as backward fills them
- ``zero3.py``        zero3: units gathered around their forward and backward, with prefetch
- ``stepping.py``     stepping the optimizer part by part (bucket-pipelined steps, disk chunks)
- ``optimizers.py``   which optimizers can be sharded: elementwise ones, and tensor-wise ones stepped whole
- ``tensorwise.py``   tensor-wise optimizers (Muon, Adafactor): each whole parameter stepped on one owner rank
- ``offload.py``      where optimizer state lives: the device, host memory or memory-mapped files

Their settings (offload, comm_dtype, zero_collectives, zero3_unit_classes, ...) are declared in
``phalanx/config/strategy_options.py``. The strategies load on first use
(``from phalanx.strategies.zero import Zero3Strategy``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Zero1Strategy", "Zero2Strategy", "Zero3Strategy", "check_optimizer"]

_WHERE = {
    "Zero1Strategy": "bucketed",
    "Zero2Strategy": "bucketed",
    "Zero3Strategy": "zero3",
    "check_optimizer": "optimizers",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
