"""The face: ``phalanx launch`` (a thin layer over torch.distributed.run), ``phalanx.spawn`` and the ``phalanx``
command.

- ``launcher.py``  ``phalanx launch``: the resolved config handed to the workers, torchrun underneath, loopback
  rendezvous, a killed rank named, restarts summarised
- ``spawn.py``     ``phalanx.spawn(fn, nprocs=N)``: ranks from a notebook or a test, through a ``file://`` store
- ``cli.py``       the ``phalanx`` command: launch, config, demo, checkpoint, horovodrun, dispatch-plan, plot

``python -m phalanx.launch -n 2 train.py`` is ``phalanx launch -n 2 train.py``.
"""

from phalanx.launch.launcher import LaunchError, launch, torchrun_args
from phalanx.launch.spawn import SpawnError, spawn

__all__ = ["launch", "spawn", "SpawnError", "LaunchError", "torchrun_args"]
