"""``from phalanx.accelerate.utils import set_seed, DistributedType, ...``: what scripts import from
``accelerate.utils`` (see :mod:`phalanx.compat.accelerate.utils`)."""

from phalanx.compat.accelerate.utils import *  # noqa: F403 - the public name of compat/accelerate/utils
from phalanx.compat.accelerate.utils import __all__ as __all__
from phalanx.config.dialects.dummies import DummyOptim, DummyScheduler

__all__ = [*__all__, "DummyOptim", "DummyScheduler"]  # noqa: PLE0605
