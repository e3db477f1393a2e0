"""``import phalanx.horovod as hvd``: Horovod's PyTorch API on phalanx (see :mod:`phalanx.compat.horovod`).

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

Run with ``phalanx launch -n 2 train.py``.
"""

from phalanx.compat.horovod import *  # noqa: F403 - this module is the public name of compat/horovod
from phalanx.compat.horovod import __all__ as __all__
