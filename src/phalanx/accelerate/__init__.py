"""``from phalanx.accelerate import Accelerator``: Accelerate's API on phalanx (see :mod:`phalanx.compat.accelerate`).

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

Run with ``phalanx launch -n 2 train.py`` (or ``accelerate``'s own flags and YAML, which phalanx launch reads).
"""

from phalanx.compat.accelerate import *  # noqa: F403 - this package is the public name of compat/accelerate
from phalanx.compat.accelerate import __all__ as __all__
