"""Checkpoints: a directory of safetensors files and a JSON manifest; sharded, atomic, loadable on any world size.

    engine.save_state("ckpt/step-1000", keep_last=3)
    engine.load_state(phalanx.checkpoint.latest_checkpoint("ckpt"))

- ``shards.py``       the neutral exchange of state between the strategies and a checkpoint: ShardEntry, StateReader
- ``state.py``        save and load of the whole training state: every rank's shards, RNG, loaders, the checks
- ``async_save.py``   ``save_state(async_save=True)``: host copies, the writer thread, the ranks meeting in files
- ``format.py``       the on-disk format, writing: shard files, the atomic swap, rotation, state as JSON
- ``read.py``         the on-disk format, reading: the manifest and header checks, reads into tensors
- ``model_files.py``  weights only, from a checkpoint, a ``.safetensors`` file or a ``save_pretrained`` directory
- ``pretrained.py``   ``engine.save_model``: a directory that ``from_pretrained`` loads
- ``resume.py``       ``resume_from``: the newest complete checkpoint at prepare; the launcher's restart summary
- ``foreign/``        other tools' runs (torch DCP, Accelerate, DeepSpeed ZeRO) read by parameter name, their pickles
                      only through ``weights_only`` or an allowlist of metadata classes
"""

from phalanx.checkpoint.format import FORMAT, VERSION, CheckpointError
from phalanx.checkpoint.read import Checkpoint, latest_checkpoint

__all__ = ["Checkpoint", "CheckpointError", "latest_checkpoint", "FORMAT", "VERSION"]
