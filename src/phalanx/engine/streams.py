"""Sharded streams: an ``IterableDataset`` made of shards is read once, split by shard over the data-parallel ranks
and over each rank's DataLoader workers, and resumed by seeking each shard to where it stopped.

    class Tokens(ShardedStream):                        # or FileShards(paths), or a datasets.IterableDataset
        def shards(self): return self.paths             # stable names, the same on every rank
        def open(self, shard, offset): ...              # the samples of one shard, from sample `offset` on

    loader = engine.prepare(DataLoader(Tokens(paths), batch_size=8, num_workers=2))

A source is sharded when it is one of:

- a :class:`ShardedStream` (or any ``IterableDataset`` with ``shards()`` and ``open(shard, offset)``);
- :class:`FileShards`, a list of files, one shard each (text lines by default, or your ``read(path)``);
- a ``datasets.IterableDataset`` with ``n_shards`` of at least the data-parallel world size. Each shard is read
  with ``dataset.shard(n_shards, i)`` and its position is the shard's own ``state_dict()``, so that a resume goes
  through datasets' own seek (arrow and parquet shards seek; a generator shard is replayed up to its position).

**Who reads what.** With ``R`` data ranks of ``W`` workers there are ``R x W`` readers; reader ``rank x W + w``
reads shards ``i`` with ``i % (R x W) == rank x W + w``, one after another, and makes batches of ``batch_size`` from
them (a batch may span two shards). A rank's batches come from its workers in turn, as a torch DataLoader's do.

**Positions.** Each batch carries, from the worker that made it, how far it read in each shard it touched. The ranks
exchange these once per step (a few bytes over gloo, posted as the batch is handed over and waited on at the next
one, so that the step does not wait for it), so that every rank holds the position of every shard: ``state_dict()``
is the same on every rank and a checkpoint holds it whole. A position is counted in samples the training loop has
received; samples a worker read ahead are not counted and are read again.

**Resuming on another world size.** Positions belong to shards, not to ranks or workers. A resume on ``R'`` ranks of
``W'`` workers deals the shards out again by the rule above, and each shard goes on from its own position: a
finished shard is not read again, a shard in progress continues at its next sample, an unstarted one starts at 0.
No sample is lost or read twice; which samples share a batch may change, the set of samples of the epoch does not.
On the same world size and workers the batches are the same as an uninterrupted run's.

**Epoch end.** Every rank takes the same number of steps (or the others would wait for it in their next
collective): a rank whose shards run out while others still read repeats its first batch of the pass, marked as
padding (``loader.padding`` is True while it is handed over), until every rank is out. Shards of equal size, as many
as a multiple of ``R x W``, end together and need none. ``drop_last`` drops each reader's short last batch.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from phalanx.logging import warn_once
from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import all_gather_bytes

__all__ = ["FileShards", "ShardedSource", "ShardedStream", "StreamReader", "sharded_source"]


@runtime_checkable
class ShardedSource(Protocol):
    """What phalanx needs of a sharded stream: stable shard names, and each shard's samples from an offset on."""

    def shards(self) -> Sequence[Hashable]:
        """The shards, the same list in the same order on every rank and in every epoch (names or paths)."""
        ...

    def open(self, shard: Any, offset: int) -> Iterable[Any]:
        """The samples of ``shard`` from sample ``offset`` on (0 is its first); seek there rather than read up to it
        where the format allows."""
        ...


class ShardedStream(IterableDataset):  # type: ignore[type-arg]
    """Base class for a sharded stream: define ``shards()`` and ``open(shard, offset)`` (and ``set_epoch(epoch)`` if
    your order depends on the epoch). Read by a plain DataLoader, it gives every shard in order, split over the
    DataLoader's workers; prepared by phalanx, it is split over ranks and workers and resumed by seeking."""

    def shards(self) -> Sequence[Hashable]:
        raise NotImplementedError(f"{type(self).__name__} must define shards(): the list of its shards")

    def open(self, shard: Any, offset: int) -> Iterable[Any]:
        raise NotImplementedError(f"{type(self).__name__} must define open(shard, offset): a shard's samples")

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i, shard in enumerate(self.shards()):
            if i % workers == worker:
                yield from self.open(shard, 0)


def _lines(path: str, offset: int) -> Iterator[str]:
    """The lines of a text file from line ``offset`` on, without their line ends. The lines before are skipped as
    bytes, not decoded."""
    with open(path, "rb") as f:
        for _ in itertools.islice(f, offset):
            pass
        for raw in f:
            yield raw.decode("utf-8").rstrip("\r\n")


class FileShards(ShardedStream):
    """A list of files, one shard each, in the order given. By default each line of a text file is a sample (a
    resume skips the lines before its position as bytes); ``read(path)`` gives your own samples of one file (a
    resume then reads that file's samples up to its position, and only that file's)."""

    def __init__(self, paths: Iterable[str | Path], read: Callable[[str], Iterable[Any]] | None = None) -> None:
        self.paths = [str(p) for p in paths]
        if not self.paths:
            raise ValueError("FileShards needs at least one file; got an empty list")
        if len(set(self.paths)) != len(self.paths):
            twice = sorted({p for p in self.paths if self.paths.count(p) > 1})
            raise ValueError(f"FileShards got the same file more than once ({twice[:3]}): each file is one shard")
        self.read = read

    def shards(self) -> Sequence[str]:
        return self.paths

    def open(self, shard: Any, offset: int) -> Iterable[Any]:
        if self.read is None:
            return _lines(str(shard), offset)
        return itertools.islice(self.read(str(shard)), offset, None)


# ------------------------------------------------------------------------------------------------ the adapters
class _Adapter:
    """One interface over the three kinds of source: shard names, and an opened shard with its position."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def names(self) -> list[str]:
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)

    def open(self, index: int, position: Mapping[str, Any]) -> _Opened:
        raise NotImplementedError


class _Opened:
    """A shard being read: its samples, and its position after the last one taken."""

    def __init__(self, samples: Iterable[Any], offset: int) -> None:
        self._samples = iter(samples)
        self.offset = offset

    def __next__(self) -> Any:
        sample = next(self._samples)
        self.offset += 1
        return sample

    def position(self, done: bool) -> dict[str, Any]:
        return {"offset": self.offset, "done": done}


class _ProtocolAdapter(_Adapter):
    def __init__(self, dataset: Any) -> None:
        super().__init__(dataset)
        self._shards = list(dataset.shards())
        self._names = [str(s) for s in self._shards]
        if len(set(self._names)) != len(self._names):
            raise ValueError(
                f"{type(dataset).__name__}.shards() names a shard twice (as text): {self._names[:5]}...; each shard "
                "needs its own name, since positions are saved by name"
            )

    def names(self) -> list[str]:
        return self._names

    def open(self, index: int, position: Mapping[str, Any]) -> _Opened:
        offset = int(position.get("offset", 0))
        return _Opened(self.dataset.open(self._shards[index], offset), offset)


class _HFOpened(_Opened):
    def __init__(self, shard: Any, offset: int) -> None:
        # ``iter(batch_size=1)`` rather than ``iter(shard)``: in a DataLoader worker, datasets would split the one
        # shard over the workers again (and give all but one nothing).
        super().__init__((_unbatched(rows) for rows in shard.iter(batch_size=1)), offset)
        self._shard = shard

    def position(self, done: bool) -> dict[str, Any]:
        # datasets' own position of the shard, to seek with on resume; a copy, taken once per batch.
        return {"offset": self.offset, "done": done, "state": json.loads(json.dumps(self._shard.state_dict()))}


def _unbatched(rows: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v[0] for k, v in rows.items()}


class _HFAdapter(_Adapter):
    def names(self) -> list[str]:
        return [str(i) for i in range(self.dataset.n_shards)]

    def open(self, index: int, position: Mapping[str, Any]) -> _Opened:
        shard = self.dataset.shard(num_shards=self.dataset.n_shards, index=index, contiguous=True)
        if position.get("state") is not None:
            shard.load_state_dict(copy.deepcopy(position["state"]))
        return _HFOpened(shard, int(position.get("offset", 0)))


def _is_hf_iterable(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "n_shards")


def sharded_source(dataset: Any) -> _Adapter | None:
    """The adapter that reads ``dataset`` by shard, or None when it is not sharded (read as one stream)."""
    if callable(getattr(dataset, "shards", None)) and callable(getattr(dataset, "open", None)):
        return _ProtocolAdapter(dataset)
    if _is_hf_iterable(dataset):
        if getattr(dataset, "_distributed", None) is not None:
            raise ValueError(
                f"this datasets.IterableDataset was already split with split_dataset_by_node "
                f"({dataset._distributed}): every rank would read only its part, and phalanx splits it again; pass "
                "the whole dataset to the DataLoader, and phalanx gives each rank and worker its shards"
            )
        return _HFAdapter(dataset)
    return None


def shard_count(dataset: Any) -> int | None:
    """How many shards a dataset has, without reading it (None when it is not sharded)."""
    if callable(getattr(dataset, "shards", None)) and callable(getattr(dataset, "open", None)):
        return len(dataset.shards())
    if _is_hf_iterable(dataset):
        return int(dataset.n_shards)
    return None


# ------------------------------------------------------------------------------------------------ one pass's readers
def _as_is(item: Any) -> Any:
    return item


class _Readers(IterableDataset):  # type: ignore[type-arg]
    """One pass's dataset for the DataLoader: each of its workers is one reader (module docstring) and yields
    (a collated batch, the positions of the shards the batch read from)."""

    def __init__(
        self,
        source: _Adapter,
        rank: int,
        world_size: int,
        batch_size: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any],
        positions: Mapping[str, Mapping[str, Any]],
        epoch: int,
        rotation: int,
    ) -> None:
        self.source, self.rank, self.world_size = source, rank, world_size
        self.batch_size, self.drop_last, self.collate_fn = batch_size, drop_last, collate_fn
        self.positions, self.epoch, self.rotation = dict(positions), epoch, rotation

    def __iter__(self) -> Iterator[tuple[Any, dict[str, dict[str, Any]]]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        # A resumed pass turns the workers so that its first batch comes from the reader whose turn it was.
        reader = self.rank * workers + (worker + self.rotation) % workers
        readers = self.world_size * workers
        self.source.set_epoch(self.epoch)
        names = self.source.names()
        mine = [i for i in range(len(names)) if i % readers == reader]
        batch: list[Any] = []
        touched: dict[str, dict[str, Any]] = {}
        for index in mine:
            name = names[index]
            position = self.positions.get(name, {})
            if position.get("done"):
                continue
            opened = self.source.open(index, position)
            while True:
                try:
                    sample = next(opened)
                except StopIteration:
                    touched[name] = opened.position(done=True)
                    break
                batch.append(sample)
                if len(batch) == self.batch_size:
                    touched[name] = opened.position(done=False)
                    yield self.collate_fn(batch), touched
                    batch, touched = [], {}
        if batch and not self.drop_last:
            yield self.collate_fn(batch), touched
        elif touched:  # the last shards ended on a batch boundary (or their last batch is dropped): say they are done
            yield None, touched


# ------------------------------------------------------------------------------------------------ the main process
class StreamReader:
    """A rank's side of a sharded stream: runs the DataLoader of one pass, exchanges positions with the other ranks
    after each batch, and holds the position of every shard (module docstring)."""

    def __init__(self, loader: DataLoader, source: _Adapter, rank: int, world_size: int, group: Any = None) -> None:
        if loader.batch_size is None:
            raise TypeError("engine.prepare needs a DataLoader with batch_size over a sharded stream")
        self.loader, self.source = loader, source
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.drop_last = loader.batch_size, loader.drop_last
        self.names = source.names()
        if loader.persistent_workers:
            warn_once(
                "persistent_workers=True is not used for a sharded stream: each pass starts its workers at the "
                "shards' positions, which a kept worker would not see"
            )
        self.positions: dict[str, dict[str, Any]] = {}
        """Each shard's position in this epoch, by name (a shard not there has not been started)."""
        self.batches_done = 0
        self.samples_done = 0
        """Real samples handed over on all ranks in this epoch."""
        self.rotation = 0
        self._skip = 0
        self._exchange = _Exchange(world_size, group)
        self._loaded = False  # a position loaded by load_state_dict, for the next pass to start from
        self.padding = False
        """The batch being handed over is padding: this rank is out of samples and others are not (it repeats its
        first batch of the pass, so that every rank takes the same steps)."""

    @property
    def workers(self) -> int:
        return max(1, self.loader.num_workers)

    def _pass_loader(self, epoch: int) -> DataLoader:
        readers = _Readers(
            self.source,
            self.rank,
            self.world_size,
            self.batch_size,
            self.drop_last,
            self.loader.collate_fn,
            self.positions,
            epoch,
            self.rotation,
        )
        kwargs: dict[str, Any] = {}
        if self.loader.num_workers > 0:
            kwargs = {
                "prefetch_factor": self.loader.prefetch_factor,
                "multiprocessing_context": self.loader.multiprocessing_context,
                "worker_init_fn": self.loader.worker_init_fn,
                "timeout": self.loader.timeout,
            }
        return DataLoader(
            readers,
            batch_size=None,
            collate_fn=_as_is,
            num_workers=self.loader.num_workers,
            pin_memory=self.loader.pin_memory,
            **kwargs,
        )

    def _fetch(self, it: Iterator[Any] | None) -> tuple[Any, dict[str, Any], Iterator[Any] | None]:
        """This rank's next batch (None when it is out) and the positions after it."""
        batch: Any = None
        touched: dict[str, Any] = {}
        while batch is None and it is not None:  # a reader's last word may be positions alone (its shards ended)
            item = next(it, None)
            if item is None:
                return None, touched, None
            batch, more = item
            touched.update(more)
        return batch, touched, it

    def batches(self, epoch: int) -> Iterator[tuple[Any, int]]:
        """(this rank's batch, samples in the global batch) for each step of the pass; the positions move as each
        batch is handed over. A pass starts the epoch over, as a torch DataLoader's does, unless a position was
        loaded (``load_state_dict``) since the last one.

        One exchange per step, posted before the step's batch is handed over and waited on at the next one (or by
        ``state_dict``): it carries the positions after this batch and the size of the next batch, so that the step
        itself never waits for it. Its size was agreed one exchange earlier, so it never overflows."""
        if not self._loaded:
            self.end_epoch()
        self._loaded = False
        it: Iterator[Any] | None = iter(self._pass_loader(epoch))
        first: Any = None  # this rank's first batch of the pass: its padding once it runs out
        try:
            batch, touched, it = self._fetch(it)
            after = json.dumps(touched).encode()
            sizes, capacity = self._exchange.first(_size(batch), len(after))
            while max(sizes) >= 0:
                self.padding = batch is None
                if batch is None:
                    if first is None:
                        first = self._padding_batch()
                    warn_once(
                        f"rank {self.rank} ran out of its shards' samples before the other ranks: it repeats its "
                        "first batch of the pass (loader.padding is True for those batches) so that every rank "
                        "takes the same steps, and those samples count twice in the gradient; shards of equal size "
                        "avoid it"
                    )
                    batch = first
                elif first is None:
                    first = batch
                following, touched, it = self._fetch(it)
                ahead = json.dumps(touched).encode()
                self._exchange.post(after, _size(following), len(ahead), capacity)
                self.batches_done += 1
                real = sum(n for n in sizes if n > 0)
                self.samples_done += real
                if self._skip:  # a position given in samples (a transformers checkpoint's): read up to it
                    self._skip -= 1
                else:
                    yield batch, real
                sizes, capacity = self._settle()
                batch, after = following, ahead
        finally:
            self.padding = False
            del it  # stops the pass's workers

    def _settle(self) -> tuple[list[int], int]:
        """Wait for the exchange in flight, take in every rank's positions; the next batch's sizes and capacity."""
        reports, sizes, capacity = self._exchange.settle()
        for pos in reports:
            self.positions.update(pos)
        return sizes, capacity

    def _padding_batch(self) -> Any:
        """A batch to repeat on a rank that has read nothing in this pass: the first samples of its first shard,
        read here and not counted."""
        index = self.rank * self.workers % len(self.names)
        opened = self.source.open(index, {})
        return self.loader.collate_fn(list(itertools.islice(_samples(opened), self.batch_size)))

    def end_epoch(self) -> None:
        self.positions, self.batches_done, self.samples_done, self.rotation, self._skip = {}, 0, 0, 0, 0

    def state_dict(self) -> dict[str, Any]:
        self._settle()  # the positions after the batch last handed over (every rank posted them with it)
        return {
            "sharded": True,
            "shards": len(self.names),
            "batches_done": self.batches_done,
            "samples_done": self.samples_done,
            "workers": self.workers,
            "world_size": self.world_size,
            "positions": {k: dict(v) for k, v in sorted(self.positions.items())},
        }

    def resume_problem(self, state: Mapping[str, Any]) -> str | None:
        if not state.get("sharded"):
            g = self.batch_size * self.world_size
            if int(state["samples_done"]) % g:
                return (
                    f"cannot resume at sample {state['samples_done']} of the stream: it is not a multiple of the "
                    f"global batch size {g} (batch_size {self.batch_size} x world size {self.world_size})"
                )
            return None
        unknown = sorted(set(state["positions"]) - set(self.names))
        if int(state["shards"]) != len(self.names) or unknown:
            gone = f" (not there now: {unknown[:3]})" if unknown else ""
            return (
                f"the stream's shards changed since the save: it had {state['shards']} shards, it has "
                f"{len(self.names)} now{gone}; a position belongs to a shard by name, so resume on the same shards"
            )
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        problem = self.resume_problem(state)
        if problem:
            raise ValueError(problem)
        self._loaded = True
        if not state.get("sharded"):
            # A position in samples only (a transformers checkpoint's, or a loader that read the whole stream): the
            # epoch's first steps are read again and skipped, as transformers skips them.
            self.end_epoch()
            self._skip = int(state["samples_done"]) // (self.batch_size * self.world_size)
            return
        self.positions = {k: dict(v) for k, v in state["positions"].items()}
        self.samples_done = int(state.get("samples_done", 0))
        self.batches_done = int(state["batches_done"])
        same_layout = int(state["workers"]) == self.workers and int(state["world_size"]) == self.world_size
        self.rotation = self.batches_done % self.workers if same_layout else 0
        self._loaded = True


class _Exchange:
    """The ranks' exchange of positions, one per step, asynchronous, over gloo on the CPU (a NCCL world gets a gloo
    group: no device sync in the step). Each rank sends a header (the size of its next batch, -1 when it has none; the
    size of the positions it will send in the next exchange; the size of these) and its positions as JSON bytes, in a
    buffer whose size every rank learnt from the previous exchange. Nothing is pickled."""

    _HEADER = 3

    def __init__(self, world_size: int, group: Any) -> None:
        self.world_size = world_size
        self.group = group  # the data ranks on gloo (Topology.data_cpu_group): a tp or pp peer reads the same shards
        self._pending: tuple[Any, list[torch.Tensor]] | None = None
        self._settled: tuple[list[dict[str, Any]], list[int], int] = ([], [], 0)
        self._mine: tuple[bytes, int, int] = (b"", -1, 0)  # what this rank sent, when alone

    def first(self, size: int, next_len: int) -> tuple[list[int], int]:
        """The first exchange of a pass, synchronous: every rank's first batch size; the next exchange's capacity."""
        self._pending = None
        if self.world_size == 1:
            return [size], next_len
        blobs = all_gather_bytes(json.dumps([size, next_len]).encode(), torch.device("cpu"), self.group)
        heads = [json.loads(b) for b in blobs]
        return [h[0] for h in heads], max(h[1] for h in heads)

    def post(self, positions: bytes, size: int, next_len: int, capacity: int) -> None:
        assert len(positions) <= capacity, (len(positions), capacity)  # announced in the previous exchange
        self._settled = ([], [], 0)
        if self.world_size == 1:
            self._mine = (positions, size, next_len)
            self._pending = (None, [])
            return
        buffer = torch.zeros(self._HEADER * 8 + capacity, dtype=torch.uint8)
        buffer[: self._HEADER * 8].view(torch.int64).copy_(torch.tensor([size, next_len, len(positions)]))
        if positions:
            buffer[self._HEADER * 8 : self._HEADER * 8 + len(positions)] = torch.frombuffer(
                bytearray(positions), dtype=torch.uint8
            )
        out = [torch.empty_like(buffer) for _ in range(self.world_size)]
        work = watched(dist.all_gather, out, buffer, group=self.group, async_op=True, label="stream positions")
        self._pending = (work, out)

    def settle(self) -> tuple[list[dict[str, Any]], list[int], int]:
        """(every rank's positions, every rank's next batch size, the next capacity) of the exchange in flight; the
        same again until the next post (nothing when none was posted)."""
        if self._pending is None:
            return self._settled
        work, out = self._pending
        self._pending = None
        if work is None:  # one data rank: nothing to wait for
            positions, size, next_len = self._mine
            self._settled = ([json.loads(positions)] if positions else [], [size], next_len)
            return self._settled
        work.wait()
        reports, sizes, lengths = [], [], []
        for t in out:
            size, next_len, n = t[: self._HEADER * 8].view(torch.int64).tolist()
            sizes.append(size)
            lengths.append(next_len)
            if n:
                reports.append(json.loads(t[self._HEADER * 8 : self._HEADER * 8 + n].numpy().tobytes()))
        self._settled = (reports, sizes, max(lengths))
        return self._settled


def _size(batch: Any) -> int:
    return -1 if batch is None else _batch_len(batch)


def _samples(opened: _Opened) -> Iterator[Any]:
    while True:
        try:
            yield next(opened)
        except StopIteration:
            return


def _batch_len(batch: Any) -> int:
    """Samples in a collated batch (its first tensor's first dimension), for the global batch's size."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        return _batch_len(next(iter(batch.values()))) if batch else 0
    if isinstance(batch, (list, tuple)):
        return _batch_len(batch[0]) if batch and not isinstance(batch[0], (str, bytes, int, float)) else len(batch)
    return 1
