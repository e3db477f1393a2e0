"""phalanx: one training script from a laptop CPU to a cluster.

    import phalanx
    engine = phalanx.Engine(strategy="ddp", precision="bf16-mixed")
    model, optimizer, loader = engine.prepare(model, optimizer, loader)

Run with ``python train.py`` or ``phalanx launch -n 4 train.py``.
"""

from phalanx import checkpoint
from phalanx._version import __version__
from phalanx.config.dialects.dummies import DummyOptim, DummyScheduler
from phalanx.engine.engine import Engine
from phalanx.engine.nonfinite import NonFiniteError
from phalanx.engine.streams import FileShards, ShardedStream
from phalanx.inference import dispatch, init_empty_weights, load_and_dispatch
from phalanx.launch.spawn import spawn
from phalanx.strategies.tensor_parallel import loss_parallel, vocab_parallel_cross_entropy
from phalanx.trainer.arguments import TrainingArguments
from phalanx.trainer.callbacks import EarlyStoppingCallback, TrainerCallback
from phalanx.trainer.state import TrainerControl, TrainerState
from phalanx.trainer.trainer import EvalPrediction, Trainer

__all__ = [
    "Engine",
    "NonFiniteError",
    "ShardedStream",
    "FileShards",
    "spawn",
    "checkpoint",
    "DummyOptim",
    "DummyScheduler",
    "TrainingArguments",
    "Trainer",
    "EvalPrediction",
    "TrainerCallback",
    "EarlyStoppingCallback",
    "TrainerState",
    "TrainerControl",
    "dispatch",
    "load_and_dispatch",
    "init_empty_weights",
    "loss_parallel",
    "vocab_parallel_cross_entropy",
    "__version__",
]
