"""The API fronts for other libraries' users: their calls, under their names, on phalanx's own strategies.

- ``horovod/``  ``import phalanx.horovod as hvd``: Horovod's PyTorch API (init, DistributedOptimizer, broadcasts,
  allreduce/allgather/broadcast ops, elastic state)

The config dialects (Accelerate YAML, DeepSpeed JSON, torchrun flags) are settings, not calls: they live in
``phalanx/config/dialects/``.
"""
