"""The Engine, the one object a training script talks to, and what it hands back from ``prepare``.

- ``engine.py``       Engine: prepare, accumulate, backward, clip, step, train_step; the collectives calls
- ``state_calls.py``  the Engine's state calls: save_state (async too), load_state (other tools' runs too),
                      resume_from, load_model, save_model
- ``collectives.py``  gather, gather_for_metrics, reduce, split_between_processes, save: the work behind those calls
- ``prepared.py``     PreparedOptimizer and PreparedScheduler
- ``data.py``         the prepared DataLoader: the global sample order, sharded over the data-parallel ranks
- ``streams.py``      sharded streams (ShardedStream, FileShards, datasets' IterableDataset): shards dealt over the
                      ranks and their workers, each shard's position saved, a resume that seeks
- ``precision.py``    autocast, loss scaling, the dtype report
- ``nonfinite.py``    on_nonfinite: a NaN or inf loss or gradient caught before the optimizer steps
- ``guards.py``       the checks that turn a silent wrong result into a clear error or a one-time warning
- ``activation.py``   activation checkpointing (full, every:k, selective) of the model's blocks, activation offload,
                      and the bytes each policy keeps
- ``tensor_parallel.py``  the tensor-parallel split of a model at prepare, its RNG trackers and replicated gradients
- ``expert_parallel.py``  the experts split over the ep ranks at prepare, and the global load-balancing loss
- ``trackers.py``     Weights & Biases and MLflow (and TensorBoard) for the Trainer's report_to and the Accelerate
                      front's log_with: the main process logs, the others import nothing
"""

from phalanx.engine.engine import Engine

__all__ = ["Engine"]
