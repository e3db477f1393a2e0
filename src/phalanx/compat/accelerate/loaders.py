"""The loaders the Accelerate front prepares follow Accelerate's rules for padding and order (the Engine's own
rules are in ``engine/data.py``), so that a ported script sees Accelerate's batches, in Accelerate's order.

- **Padding.** A short last global batch is padded to ``batch_size`` on every process, by wrapping around to the
  epoch's first samples, as Accelerate's ``BatchSamplerShard`` does; with ``even_batches=False`` it is not padded,
  and the processes past its end get one batch fewer.
- **Order.** A shuffled loader without ``use_seedable_sampler`` draws its order from one ``torch.Generator``,
  seeded at ``prepare`` with a draw from the global RNG (process 0's, broadcast), and drawn on epoch after epoch: a
  ``RandomSampler`` with a generator, as Accelerate gives it one. A generator the sampler already had is taken over
  as it stands. On one process Accelerate gives no generator: each pass draws its order's seed from the global
  RNG, and so does the front. With ``use_seedable_sampler=True`` the order of epoch ``e`` comes from
  ``data_seed + e`` (or the global seed + e), Accelerate's ``SeedableRandomSampler``, which is the Engine's rule.
- **The global RNG.** Each pass draws its workers' seed from the global RNG, as a torch DataLoader without a
  generator does, so that the global RNG (dropout's) moves as under Accelerate.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from phalanx.compat.accelerate.utils import DataLoaderConfiguration
from phalanx.engine.data import PreparedDataLoader
from phalanx.logging import warn_once
from phalanx.runtime.comm import broadcast_coalesced
from phalanx.strategies._replicas import group_rank0

__all__ = ["accelerate_loader_rules", "keep_global_rngs"]


def _random_sampler(loader: DataLoader) -> RandomSampler | None:
    sampler = loader.sampler
    if isinstance(sampler, BatchSampler):
        sampler = sampler.sampler
    elif loader.batch_size is None and isinstance(loader.batch_sampler, BatchSampler):
        sampler = loader.batch_sampler.sampler
    return sampler if isinstance(sampler, RandomSampler) else None


def accelerate_loader_rules(
    prepared: PreparedDataLoader, loader: DataLoader, config: DataLoaderConfiguration, group: Any, size: int
) -> None:
    """Give ``prepared`` (made from ``loader`` by the Engine) Accelerate's padding and order (module docstring).
    ``group`` holds the ``size`` data ranks the loader is split over."""
    sampler = prepared.global_sampler
    one_process = size == 1
    sampler.pad_to_global_batch = not one_process  # one process: Accelerate leaves the loader's batches as they are
    sampler.even_batches = config.even_batches
    prepared.seed_from_global_rng = loader.generator is None
    if not one_process and not config.even_batches and sampler.global_batches:
        if sampler.real_size(sampler.global_batches - 1) <= (sampler.world_size - 1) * sampler.batch_size:
            warn_once(
                f"even_batches=False: this loader ({sampler.num_samples} samples, batch_size {sampler.batch_size}) "
                "gives the last processes one batch fewer; a loop that runs collectives (a backward through a "
                "prepared model, gather) must run inside accelerator.join_uneven_inputs([model]), or the other "
                "processes wait for them"
            )
    shuffled = _random_sampler(loader)
    if shuffled is None or not sampler.shuffle:
        return
    if config.use_seedable_sampler:
        sampler.seed = config.data_seed if config.data_seed is not None else torch.initial_seed()
        return
    generator = shuffled.generator
    if generator is None and one_process:
        sampler.order_per_pass = True  # Accelerate leaves the sampler without a generator: a seed drawn each pass
        return
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
    state = generator.get_state()
    if not one_process:
        broadcast_coalesced([state], src=group_rank0(group), group=group)  # process 0's order, as Accelerate syncs
    sampler.order_stream = state


@contextlib.contextmanager
def keep_global_rngs() -> Iterator[None]:
    """Python's, NumPy's and torch's global RNGs (the CUDA ones too, once CUDA is up) as they were before."""
    py, np_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py)
    np.random.set_state(np_state)
