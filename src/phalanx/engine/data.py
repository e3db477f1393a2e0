"""World-size-independent data order, per-rank sharding of every global batch, and exact metric gathers.

The global order of samples is a permutation drawn from ``seed + epoch`` (or the dataset order when the
loader did not shuffle). Global batch ``b`` is the chunk ``order[b*G:(b+1)*G]`` with ``G = batch_size *
world_size``, and rank ``r`` takes the ``r``-th contiguous slice of it. So the sequence of global batches
is the same on 1, 2 or 4 ranks, as long as the global batch size is.

The last chunk may be short. Unless the loader drops it, it is padded by wrapping around to the start of
the order so that every rank gets the same number of samples (no rank starves, no collective hangs);
:meth:`LoaderState.trim` lets ``gather_for_metrics`` drop the padding again.

These rules are there for the Accelerate front (``phalanx.accelerate``), which follows Accelerate's:
- ``pad_to_global_batch``: the short last chunk is padded to a whole global batch (every rank gets ``batch_size``
  samples), where the Engine pads only to a multiple of the world size;
- ``even_batches=False``: the short last chunk is not padded; each rank takes its ``batch_size`` slice of what is
  there, so the ranks past the end get one batch fewer (``join_uneven_inputs`` keeps their collectives in step);
- ``order_stream``: the shuffled order of epoch ``e`` is the ``e``-th pass of one ``torch.Generator``, started once
  (as a ``RandomSampler`` with a generator draws it), where the Engine draws each epoch from ``seed + epoch``;
  ``order_per_pass``: each pass draws its order's seed from the global RNG (a ``RandomSampler`` without one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, SequentialSampler

from phalanx.engine.streams import StreamReader, sharded_source
from phalanx.logging import warn_once

__all__ = [
    "ActiveLoaders",
    "GlobalBatchSampler",
    "PreparedDataLoader",
    "PreparedIterableLoader",
    "LoaderState",
    "map_tensors",
    "move_to_device",
]


@dataclass
class LoaderState:
    """What the most recently yielded batch was: used by ``gather_for_metrics`` to drop tail padding."""

    padded_size: int = 0
    """Samples in the current global batch including padding (per-rank batch * world size)."""
    real_size: int = 0
    """Samples in the current global batch that are real."""
    end_of_dataloader: bool = False
    loader: Any = None
    """The prepared loader this state belongs to (Accelerate's ``gradient_state.active_dataloader``)."""

    def trim(self, gathered_len: int) -> int:
        """How many leading items of a gathered batch-shaped result to keep."""
        if self.real_size < self.padded_size and gathered_len == self.padded_size:
            return self.real_size
        return gathered_len


class ActiveLoaders:
    """The prepared loaders now being iterated, innermost last (e.g. an eval pass inside a training epoch).

    ``gather_for_metrics`` trims and ``accumulate`` ends a window by the innermost one; once a pass ends
    (or is abandoned) its loader leaves the stack, so a later gather of other data is never trimmed.
    """

    def __init__(self) -> None:
        self._stack: list[LoaderState] = []

    def enter(self, state: LoaderState) -> None:
        self._stack.append(state)

    def leave(self, state: LoaderState) -> None:
        self._stack = [s for s in self._stack if s is not state]

    def trim(self, gathered_len: int) -> int:
        return self._stack[-1].trim(gathered_len) if self._stack else gathered_len

    @property
    def end_of_dataloader(self) -> bool:
        return bool(self._stack) and self._stack[-1].end_of_dataloader

    @property
    def active(self) -> Any:
        """The innermost prepared loader being iterated, or None."""
        return self._stack[-1].loader if self._stack else None


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's share of each global batch; see the module docstring for the layout."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        base_sampler: Sampler[int] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.base_sampler = base_sampler
        self.epoch = 0
        self.start_batch = 0
        self.even_batches = True
        """False: a short last global batch is not padded, and the ranks past its end get no batch from it."""
        self.pad_to_global_batch = False
        """True: a short last global batch is padded to ``batch_size`` on every rank (Accelerate's padding)."""
        self.order_stream: torch.Tensor | None = None
        """The state of a ``torch.Generator`` whose successive passes give the shuffled orders (Accelerate's)."""
        self._stream_at: tuple[int, torch.Tensor] | None = None  # (epoch, generator state before its permutation)
        self.order_per_pass = False
        """Each pass draws its order's seed from the global RNG (Accelerate's one process); a resumed pass reuses
        ``pass_order_seed``, the one its epoch drew."""
        self.pass_order_seed: int | None = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def total_batch_size(self) -> int:
        """The global batch (Accelerate's name)."""
        return self.global_batch_size

    def global_order(self, epoch: int) -> list[int]:
        if self.base_sampler is not None:
            if hasattr(self.base_sampler, "set_epoch"):
                self.base_sampler.set_epoch(epoch)
            return list(self.base_sampler)
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator()
        if self.order_stream is not None:
            return self._streamed_order(epoch, g)
        g.manual_seed(
            self.pass_order_seed if self.order_per_pass and self.pass_order_seed is not None else self.seed + epoch
        )
        return torch.randperm(self.num_samples, generator=g).tolist()

    def _streamed_order(self, epoch: int, g: torch.Generator) -> list[int]:
        assert self.order_stream is not None
        at, state = (0, self.order_stream) if self._stream_at is None or self._stream_at[0] > epoch else self._stream_at
        g.set_state(state)
        for _ in range(at, epoch):
            # A RandomSampler draws two permutations per pass: its order, and an empty slice of a second at the end.
            torch.randperm(self.num_samples, generator=g)
            torch.randperm(self.num_samples, generator=g)
        self._stream_at = (epoch, g.get_state())
        return torch.randperm(self.num_samples, generator=g).tolist()

    @property
    def global_batches(self) -> int:
        """Global batches in an epoch (the last one may be short unless dropped)."""
        g = self.global_batch_size
        return self.num_samples // g if self.drop_last else math.ceil(self.num_samples / g)

    def __len__(self) -> int:
        """This rank's batches in an epoch: the global batches, less the last one where it holds nothing for this
        rank (``even_batches=False``)."""
        n = self.global_batches
        if n and not self.even_batches and self.real_size(n - 1) <= self.rank * self.batch_size:
            return n - 1
        return n

    def real_size(self, batch: int) -> int:
        """Real (unpadded) samples in global batch ``batch``."""
        return min(self.global_batch_size, self.num_samples - batch * self.global_batch_size)

    def padded_size(self, real: int) -> int:
        """Samples in a global batch holding ``real`` real ones, once padded to split evenly over ranks."""
        g = self.global_batch_size
        if real >= g or not self.even_batches:
            return min(real, g)
        return g if self.pad_to_global_batch else math.ceil(real / self.world_size) * self.world_size

    def chunks(self, epoch: int, start: int = 0) -> Iterator[tuple[list[int], int]]:
        """(this rank's indices, real samples in the global batch) for each batch from ``start``."""
        if self.order_per_pass and self.shuffle and (start == 0 or self.pass_order_seed is None):
            self.pass_order_seed = int(torch.empty((), dtype=torch.int64).random_().item())
        order = self.global_order(epoch)
        g = self.global_batch_size
        for b in range(start, len(self)):
            chunk = order[b * g : (b + 1) * g]
            real = self.real_size(b)
            if not self.even_batches and real < g:  # each rank its batch_size slice of what there is
                yield chunk[self.rank * self.batch_size : (self.rank + 1) * self.batch_size], real
                continue
            per_rank = self.padded_size(real) // self.world_size
            need = per_rank * self.world_size - real
            chunk = chunk + [order[i % len(order)] for i in range(need)]
            yield chunk[self.rank * per_rank : (self.rank + 1) * per_rank], real

    def __iter__(self) -> Iterator[list[int]]:
        # A resume point (start_batch, set by load_state_dict) serves one pass; a pass abandoned and begun again
        # starts the epoch over, as a torch DataLoader does.
        start, self.start_batch = self.start_batch, 0
        return (indices for indices, _ in self.chunks(self.epoch, start))


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in a nested structure of dicts, lists, tuples and namedtuples."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return type(obj)({k: map_tensors(v, fn) for k, v in obj.items()})  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def move_to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) batch to ``device``; objects with their own ``.to`` (e.g. BatchEncoding) too."""
    if not isinstance(obj, (torch.Tensor, Mapping, list, tuple)) and callable(getattr(obj, "to", None)):
        return obj.to(device)
    return map_tensors(obj, lambda t: t.to(device, non_blocking=non_blocking))


class _Transformed:
    transform: Callable[[Any], Any] | None = None
    """Applied to every batch once it is on the device: the Engine sets it (context parallelism cuts each sequence
    over the cp ranks here)."""

    def _transformed(self, batch: Any) -> Any:
        return batch if self.transform is None else self.transform(batch)


class PreparedDataLoader(_Transformed, DataLoader):
    """A DataLoader that yields this rank's share of each global batch, on the Engine's device.

    ``set_epoch`` happens by itself at the start of each pass; call it yourself to pick an epoch.
    ``state_dict()`` gives the position in the epoch in samples, which resumes on any world size.
    """

    def __init__(
        self, loader: DataLoader, rank: int, world_size: int, seed: int, device: torch.device, active: ActiveLoaders
    ) -> None:
        batch_size, drop_last, sampler = loader.batch_size, loader.drop_last, loader.sampler
        # DataLoader(sampler=BatchSampler(...), batch_size=None): the dataset is indexed by whole batches of indices
        # (no automatic collation); the prepared loader keeps that, with the global batches in the sampler's place.
        self._sampler_batches = (
            batch_size is None and loader.batch_sampler is None and isinstance(sampler, BatchSampler)
        )
        if batch_size is None:
            inner = loader.sampler if self._sampler_batches else loader.batch_sampler
            if not isinstance(inner, BatchSampler):
                raise TypeError(
                    f"engine.prepare needs a DataLoader with batch_size or a torch BatchSampler; got batch_sampler "
                    f"of type {type(inner).__name__} (pass batch_size=..., and a sampler= for a custom order)"
                )
            batch_size, drop_last, sampler = inner.batch_size, inner.drop_last, inner.sampler
        shuffle = isinstance(sampler, RandomSampler)
        base: Any = None if isinstance(sampler, (RandomSampler, SequentialSampler)) else sampler
        if base is not None:
            warn_once(
                f"using the order of the custom sampler {type(sampler).__name__} as the global order; it must give "
                "the same order on every rank (seed it the same everywhere)"
            )
        # A custom sampler may pick a subset, or draw more samples than the dataset holds: count what it yields.
        num_samples = len(base) if base is not None else len(loader.dataset)  # type: ignore[arg-type]
        batch_sampler = GlobalBatchSampler(num_samples, batch_size, rank, world_size, shuffle, seed, drop_last, base)
        pin = loader.pin_memory or device.type == "cuda"
        order: dict[str, Any] = (
            {"sampler": batch_sampler, "batch_size": None}
            if self._sampler_batches
            else {"batch_sampler": batch_sampler}
        )
        kwargs: dict[str, Any] = dict(
            **order,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=pin,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            # Starting an iterator draws a seed for the workers from this generator. With none given, torch draws
            # from the global RNG, so that a resumed run (whose iterator starts after the RNG was restored) would
            # see different dropout than the straight one: draw from our own generator, seeded per epoch.
            generator=loader.generator if loader.generator is not None else torch.Generator(),
            persistent_workers=loader.persistent_workers,
        )
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
            kwargs["multiprocessing_context"] = loader.multiprocessing_context
        super().__init__(loader.dataset, **kwargs)
        self.device = device
        self._non_blocking = pin and device.type == "cuda"
        self._own_generator = loader.generator is None
        self.seed_from_global_rng = False
        """Draw each pass's worker seed from the global RNG, as a torch DataLoader does (the Accelerate front)."""
        self._pass_seed: int | None = None
        self._state = LoaderState(loader=self)
        self._active = active
        self._batches_done = 0

    @property
    def global_sampler(self) -> GlobalBatchSampler:
        return self.sampler if self._sampler_batches else self.batch_sampler  # type: ignore[return-value]

    @property
    def epoch(self) -> int:
        """Passes over the data completed (the epoch being read)."""
        return self.global_sampler.epoch

    @property
    def total_batch_size(self) -> int:
        """The global batch: ``batch_size`` x the data-parallel world (Accelerate's name)."""
        return self.global_sampler.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        self.global_sampler.epoch = epoch

    def __len__(self) -> int:
        return len(self.global_sampler)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.global_sampler
        start = self._batches_done = sampler.start_batch
        if self._own_generator:
            assert self.generator is not None
            if self.seed_from_global_rng:
                # As a torch DataLoader without a generator: a pass draws its workers' seed from the global RNG. A
                # resumed pass takes the one its epoch drew, and leaves the global RNG as the checkpoint left it.
                if start == 0 or self._pass_seed is None:
                    self._pass_seed = int(torch.empty((), dtype=torch.int64).random_().item())
                self.generator.manual_seed(self._pass_seed)
            else:
                self.generator.manual_seed(sampler.seed * 1_000_003 + sampler.epoch)
        total = len(sampler)
        state = self._state
        self._active.enter(state)
        try:
            for i, batch in enumerate(super().__iter__()):
                index = start + i
                state.real_size = sampler.real_size(index)
                state.padded_size = sampler.padded_size(state.real_size)
                state.end_of_dataloader = index == total - 1
                self._batches_done = index + 1
                yield self._transformed(move_to_device(batch, self.device, self._non_blocking))
        finally:
            self._active.leave(state)
            state.real_size = state.padded_size = 0
            state.end_of_dataloader = False
        # The pass is over: the next one starts a new epoch from its first batch.
        sampler.start_batch = 0
        self._batches_done = 0
        sampler.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        sampler = self.global_sampler
        state = {
            "epoch": sampler.epoch,
            "samples_done": self._batches_done * sampler.global_batch_size,
            "seed": sampler.seed,
        }
        if self.seed_from_global_rng and self._pass_seed is not None:
            state["pass_seed"] = self._pass_seed
        if sampler.order_per_pass and sampler.pass_order_seed is not None:
            state["order_seed"] = sampler.pass_order_seed
        return state

    def resume_problem(self, state: Mapping[str, Any]) -> str | None:
        """Why this loader cannot resume at ``state`` (None when it can)."""
        sampler = self.global_sampler
        g = sampler.global_batch_size
        if state["samples_done"] % g:
            return (
                f"cannot resume at sample {state['samples_done']} of the epoch: it is not a multiple of the global "
                f"batch size {g} (batch_size {sampler.batch_size} x world size {sampler.world_size}); keep the global "
                "batch size a divisor of the saved position"
            )
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        sampler = self.global_sampler
        problem = self.resume_problem(state)
        if problem:
            raise ValueError(problem)
        g = sampler.global_batch_size
        sampler.epoch = int(state["epoch"])
        sampler.seed = int(state["seed"])
        sampler.start_batch = state["samples_done"] // g
        self._batches_done = sampler.start_batch
        if "pass_seed" in state:
            self._pass_seed = int(state["pass_seed"])
        if "order_seed" in state:
            sampler.pass_order_seed = int(state["order_seed"])


class PreparedIterableLoader(_Transformed):
    """A DataLoader over an ``IterableDataset``.

    A sharded stream (``engine/streams.py``: a ``ShardedStream``, ``FileShards``, or a ``datasets.IterableDataset``
    with ``n_shards``) is read once: each rank, and each of its DataLoader workers, reads its own shards; positions are
    kept per shard, so that a resume seeks each shard to where it stopped, on any world size.

    Any other stream is sharded as a map-style loader is: every rank reads the same stream, groups it into global
    batches of ``batch_size x world_size`` samples, and keeps its own slice of each, so that the global batches are the
    same on any world size. The stream must give every rank the same samples in the same order (seed any shuffling
    the same on every rank). A short last global batch is padded, as a map-style loader's is, with the epoch's first
    samples (``gather_for_metrics`` drops them again), or dropped with ``drop_last``. A resume skips the global
    batches already read, reading them again from the stream's start.

    It has no length. A dataset with ``set_epoch`` is told each epoch.
    """

    def __init__(
        self,
        loader: DataLoader,
        rank: int,
        world_size: int,
        device: torch.device,
        active: ActiveLoaders,
        data_cpu_group: Callable[[], Any] = lambda: None,
    ) -> None:
        """``data_cpu_group``: the data ranks' gloo group (``Topology.data_cpu_group``), asked for (collectively)
        only when the stream is sharded, for the ranks' exchange of positions."""
        if loader.batch_size is None:
            raise TypeError("engine.prepare needs a DataLoader with batch_size over an IterableDataset")
        name = type(loader.dataset).__name__
        source = sharded_source(loader.dataset)
        shards = len(source.names()) if source is not None else 0
        self._stream: StreamReader | None = None
        if source is not None and shards >= world_size:
            self._stream = StreamReader(loader, source, rank, world_size, data_cpu_group())
            if shards < world_size * max(1, loader.num_workers):
                warn_once(
                    f"{name} has {shards} shards for {world_size} ranks x {loader.num_workers} workers: some workers "
                    "read nothing (make the shards a multiple of ranks x workers)"
                )
        elif source is not None:
            warn_once(
                f"{name} has {shards} shards, fewer than the {world_size} data ranks: every rank reads the whole "
                "stream and a resume re-reads it (reshard it into a multiple of ranks x workers)"
            )
        else:
            warn_once(
                f"{name} is not sharded: every rank reads the whole stream and a resume re-reads it (give it shards() "
                "and open(shard, offset), phalanx.engine.streams.ShardedStream, or use FileShards or a "
                "datasets.IterableDataset)"
            )
        if self._stream is None:
            self._refuse_workers(loader)
        self.dataset, self.batch_size, self.drop_last = loader.dataset, loader.batch_size, loader.drop_last
        self.collate_fn = loader.collate_fn
        self.rank, self.world_size, self.device = rank, world_size, device
        self.epoch = 0
        self._batches_done = 0
        self._skip = 0
        self._non_blocking = loader.pin_memory and device.type == "cuda"
        self._state = LoaderState(loader=self)
        self._active = active

    @staticmethod
    def _refuse_workers(loader: DataLoader) -> None:
        if loader.num_workers > 0:
            raise ValueError(
                f"engine.prepare reads an unsharded IterableDataset ({type(loader.dataset).__name__}) in the training "
                f"process, so that every rank sees the same stream; got num_workers={loader.num_workers} (use 0, or "
                "make the stream sharded: phalanx.engine.streams.ShardedStream, FileShards, or a "
                "datasets.IterableDataset with n_shards)"
            )

    @property
    def sharded(self) -> bool:
        """Whether the stream is read by shard (each sample once over all ranks) rather than whole on every rank."""
        return self._stream is not None

    @property
    def padding(self) -> bool:
        """The batch just handed over repeats samples: this rank's shards ran out before the other ranks' did, and
        it takes the same steps as they do (a sharded stream's uneven end; see ``engine/streams.py``)."""
        return self._stream is not None and self._stream.padding

    def read_whole_stream(self, loader: DataLoader) -> None:
        """Read the stream whole on every rank, keeping each rank's slice of every global batch, even if it is
        sharded: the batches of one reader (Accelerate's ``dispatch_batches=True``). Before the first pass."""
        if self._stream is not None:
            self._refuse_workers(loader)
            self._stream = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        raise TypeError(
            f"a prepared loader over an IterableDataset ({type(self.dataset).__name__}) has no length: count steps "
            "(TrainingArguments(max_steps=...)) rather than epochs"
        )

    def _global_batches(self) -> Iterator[tuple[list[Any], int]]:
        """(the global batch, padded to split evenly over the ranks; its real samples), from the stream."""
        g = self.global_batch_size
        first: list[Any] = []  # the epoch's first samples, to pad a short last batch with (as a map-style loader)
        chunk: list[Any] = []
        for sample in self.dataset:  # type: ignore[attr-defined]
            if len(first) < g:
                first.append(sample)
            chunk.append(sample)
            if len(chunk) == g:
                yield chunk, g
                chunk = []
        if chunk and not self.drop_last:
            real = len(chunk)
            need = -real % self.world_size
            yield chunk + [first[i % len(first)] for i in range(need)], real

    def _sharded_pass(self, stream: StreamReader) -> Iterator[Any]:
        state = self._state
        self._active.enter(state)
        try:
            for batch, real in stream.batches(self.epoch):
                # Each rank's own batches, not one global batch cut in slices: nothing to trim in a gather.
                state.real_size = state.padded_size = real
                yield self._transformed(move_to_device(batch, self.device, self._non_blocking))
        finally:
            self._active.leave(state)
            state.real_size = state.padded_size = 0
            state.end_of_dataloader = False
        stream.end_epoch()
        self.epoch += 1

    def __iter__(self) -> Iterator[Any]:
        if self._stream is not None:
            return self._sharded_pass(self._stream)
        return self._whole_pass()

    def _whole_pass(self) -> Iterator[Any]:
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(self.epoch)  # type: ignore[attr-defined]
        skip, self._skip = self._skip, 0
        self._batches_done = skip
        state = self._state
        self._active.enter(state)
        try:
            batches = self._global_batches()
            ahead = next(batches, None)  # one global batch ahead, to know which is the last
            index = 0
            while ahead is not None:
                chunk, real = ahead
                ahead = next(batches, None)
                if index >= skip:
                    per_rank = len(chunk) // self.world_size
                    mine = chunk[self.rank * per_rank : (self.rank + 1) * per_rank]
                    state.real_size, state.padded_size = real, len(chunk)
                    state.end_of_dataloader = ahead is None
                    self._batches_done = index + 1
                    yield self._transformed(move_to_device(self.collate_fn(mine), self.device, self._non_blocking))
                index += 1
        finally:
            self._active.leave(state)
            state.real_size = state.padded_size = 0
            state.end_of_dataloader = False
        self._batches_done = 0
        self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch: for a sharded stream, every shard's (the same on every rank, and resumable on
        any world size); otherwise the samples of the stream read so far."""
        if self._stream is not None:
            return {"epoch": self.epoch, "seed": 0, **self._stream.state_dict()}
        return {"epoch": self.epoch, "samples_done": self._batches_done * self.global_batch_size, "seed": 0}

    def resume_problem(self, state: Mapping[str, Any]) -> str | None:
        if self._stream is not None:
            return self._stream.resume_problem(state)
        if state.get("sharded"):
            return (
                "the checkpoint holds the positions of a sharded stream, and this loader reads its stream whole "
                f"({type(self.dataset).__name__}); resume with the sharded stream it was saved with"
            )
        if state["samples_done"] % self.global_batch_size:
            return (
                f"cannot resume at sample {state['samples_done']} of the stream: it is not a multiple of the global "
                f"batch size {self.global_batch_size} (batch_size {self.batch_size} x world size {self.world_size})"
            )
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        problem = self.resume_problem(state)
        if problem:
            raise ValueError(problem)
        self.epoch = int(state["epoch"])
        if self._stream is not None:
            self._stream.load_state_dict(state)
            return
        self._skip = self._batches_done = state["samples_done"] // self.global_batch_size
