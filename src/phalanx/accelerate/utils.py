"""``from phalanx.accelerate.utils import set_seed, DistributedType, ...``: what scripts import from
``accelerate.utils`` (see :mod:`phalanx.compat.accelerate.utils`)."""

from phalanx.compat.accelerate.operations import *  # noqa: F403 - gather_object, pad_across_processes, tqdm, ...
from phalanx.compat.accelerate.operations import __all__ as _operations
from phalanx.compat.accelerate.utils import *  # noqa: F403 - the public name of compat/accelerate/utils
from phalanx.compat.accelerate.utils import __all__ as __all__
from phalanx.config.dialects.dummies import DummyOptim, DummyScheduler

__all__ = [*__all__, *_operations, "DummyOptim", "DummyScheduler"]  # noqa: PLE0605
