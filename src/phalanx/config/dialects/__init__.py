"""The config dialects users bring: Accelerate's YAML and flags, DeepSpeed's JSON, torchrun's flags.

Each maps onto phalanx's own settings. A value phalanx cannot honour is an error that names the key and what to use
instead; a key that has no meaning here is accepted and reported as ignored, with why.

- ``accelerate.py``                  an ``accelerate config`` YAML
- ``deepspeed.py``, ``deepspeed_blocks.py``  a DeepSpeed JSON: its keys, and its optimizer, scheduler and fp16 blocks
- ``deepspeed_moe.py``               its AutoEP block (expert parallelism), read as ep_size
- ``batch.py``                       DeepSpeed's batch rule, checked against the world size the job will have
- ``flags.py``                       torchrun's and Accelerate's command-line spellings
- ``names.py``, ``mapping.py``       the names they share, and the record of where each value came from
- ``dummies.py``                     DummyOptim / DummyScheduler, realised from the DeepSpeed config's blocks
"""
