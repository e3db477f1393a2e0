"""Sharded streams (engine/streams.py): read once over ranks and workers, resumed by seeking, on any world size."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

import phalanx
from phalanx.engine.data import ActiveLoaders, PreparedIterableLoader
from phalanx.engine.streams import FileShards, ShardedStream


class _Tagged(ShardedStream):
    """``shards`` shards of ``per_shard`` samples; sample k of shard s is [s * 100 + k, the worker that read it].
    ``served`` counts the samples it gave and ``opened`` the shards it opened (in this process)."""

    def __init__(self, shards: int, per_shard: int) -> None:
        self.n, self.per_shard = shards, per_shard
        self.served, self.opened = 0, 0

    def shards(self) -> list[str]:
        return [f"part-{s:03d}" for s in range(self.n)]

    def open(self, shard: str, offset: int):  # type: ignore[no-untyped-def]
        self.opened += 1
        s = int(shard.split("-")[1])
        info = get_worker_info()
        worker = 0 if info is None else info.id
        for k in range(offset, self.per_shard):
            self.served += 1
            yield torch.tensor([s * 100 + k, worker])


def _workers(n: int) -> dict:
    """DataLoader workers forked from the rank: a forkserver (the ranks' default here) starts each one as a fresh
    interpreter that imports torch, which takes tens of seconds on a busy two-core machine."""
    return {"num_workers": n, "multiprocessing_context": "fork"} if n else {}


def _ids(batches: list[torch.Tensor]) -> list[int]:
    return [int(v) for b in batches for v in b[:, 0]]


def _loader(dataset, batch_size: int, workers: int = 0) -> PreparedIterableLoader:  # type: ignore[no-untyped-def]
    loader = DataLoader(dataset, batch_size=batch_size, **_workers(workers))
    return PreparedIterableLoader(loader, 0, 1, torch.device("cpu"), ActiveLoaders())


# ------------------------------------------------------------------------------------------------ ranks x workers
def _read_epoch(shards: int, per_shard: int, workers: int, tp_size: int = 1) -> list[list[int]]:
    engine = phalanx.Engine(seed=0, tp_size=tp_size)
    loader = engine.prepare(DataLoader(_Tagged(shards, per_shard), batch_size=3, **_workers(workers)))
    assert loader.sharded
    return [b.tolist() for b in loader]


def test_two_ranks_of_two_workers_each_read_a_quarter_of_a_16_shard_stream(run_ranks):
    ranks = run_ranks(_read_epoch, 2, 16, 6, 2)
    readers = Counter((rank, row[1]) for rank, batches in enumerate(ranks) for b in batches for row in b)
    assert readers == {(r, w): 24 for r in (0, 1) for w in (0, 1)}, readers  # 96 samples, 1/4 each, counted
    seen = Counter(row[0] for batches in ranks for b in batches for row in b)
    assert seen == Counter(s * 100 + k for s in range(16) for k in range(6))  # each sample read once, none lost
    # Reader (rank, worker) reads shards i with i % 4 == rank * 2 + worker.
    for rank, batches in enumerate(ranks):
        for b in batches:
            for sample, worker in b:
                assert (sample // 100) % 4 == rank * 2 + worker


def test_tp_peers_read_the_same_shards_and_only_the_data_ranks_split_them(run_ranks):
    # 4 ranks as tp2 x dp2: the positions are exchanged over the data group (ranks 0,2 and 1,3), not the world.
    ranks = run_ranks(_read_epoch, 4, 8, 3, 0, 2)
    assert ranks[0] == ranks[1] and ranks[2] == ranks[3]  # a tp pair is one data rank: the same batches
    seen = Counter(row[0] for batches in (ranks[0], ranks[2]) for b in batches for row in b)
    assert seen == Counter(s * 100 + k for s in range(8) for k in range(3))  # each sample read once, none lost


# ------------------------------------------------------------------------------------------------ resume in O(1)
def test_a_resume_at_90_percent_reads_only_what_is_left():
    straight = _loader(_Tagged(16, 10), batch_size=4)
    everything = _ids(list(straight))
    assert sorted(everything) == [s * 100 + k for s in range(16) for k in range(10)]

    first = _loader(_Tagged(16, 10), batch_size=4)
    it = iter(first)
    head = [next(it) for _ in range(36)]  # 36 of 40 batches: 90% of the epoch
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint's manifest holds it
    del it
    source = _Tagged(16, 10)
    resumed = _loader(source, batch_size=4)
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert _ids(head) + _ids(tail) == everything  # the same batches as the straight run
    assert source.served == 16 and source.opened == 2  # the last 16 samples, from 2 shards: nothing read again

    # Today's way (a stream without shards, read whole): the resume reads the stream from its start.
    class Whole(torch.utils.data.IterableDataset):
        served = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            for s in range(16):
                for k in range(10):
                    Whole.served += 1
                    yield torch.tensor([s * 100 + k, 0])

    old = _loader(Whole(), batch_size=4)
    old.load_state_dict({"epoch": 0, "samples_done": 36 * 4, "seed": 0})
    assert _ids(list(old)) == everything[36 * 4 :] and Whole.served == 160


def test_positions_belong_to_shards_and_bad_positions_are_refused():
    loader = _loader(_Tagged(4, 3), batch_size=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["positions"] == {"part-000": {"offset": 2, "done": False}}
    with pytest.raises(ValueError, match="shards changed since the save: it had 4 shards, it has 5"):
        _loader(_Tagged(5, 3), batch_size=2).load_state_dict(state)
    # A position in samples alone (a transformers checkpoint's): the epoch's first steps are read again and skipped.
    counted = _loader(_Tagged(4, 3), batch_size=2)
    counted.load_state_dict({"epoch": 0, "samples_done": 4, "seed": 0})
    assert _ids(list(counted)) == [101, 102, 200, 201, 202, 300, 301, 302]
    with pytest.raises(ValueError, match="cannot resume at sample 3 of the stream: it is not a multiple of the global"):
        counted.load_state_dict({"epoch": 0, "samples_done": 3, "seed": 0})
    assert loader.resume_problem(state) is None


# ------------------------------------------------------------------------------------------------ resumed twice
def _part(world_dir: str, load: str | None, save: str | None, steps: int | None, workers: int) -> dict:
    engine = phalanx.Engine(seed=0)
    loader = engine.prepare(DataLoader(_Tagged(16, 5), batch_size=2, **_workers(workers)))
    if load is not None:
        engine.load_state(load)
    out: dict = {"batches": [], "padding": []}
    for i, batch in enumerate(loader):
        out["batches"].append(batch[:, 0].tolist())
        out["padding"].append(loader.padding)
        if steps is not None and i + 1 == steps:
            break
    if save is not None:
        engine.save_state(save)
    out["epoch"] = engine.epoch
    return out


def test_a_run_resumed_twice_on_another_world_size_sees_the_samples_of_the_straight_run(run_ranks, tmp_path):
    straight = run_ranks(_part, 2, str(tmp_path), None, None, None, 2)
    everything = sorted(v for r in straight for b in r["batches"] for v in b)
    assert everything == [s * 100 + k for s in range(16) for k in range(5)]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    a = run_ranks(_part, 2, str(tmp_path), None, one, 3, 2)  # 3 steps on 2 ranks x 2 workers
    b = run_ranks(_part, 2, str(tmp_path), one, two, 4, 2)  # 4 more, same layout
    c = run_ranks(_part, 3, str(tmp_path), two, None, None, 1)  # the rest on 3 ranks x 1 worker
    for rank in range(2):  # on the same layout, the same batches as the straight run
        assert a[rank]["batches"] + b[rank]["batches"] == straight[rank]["batches"][:7]
    real = [
        v for run in (a, b, c) for r in run for batch, pad in zip(r["batches"], r["padding"]) if not pad for v in batch
    ]
    assert sorted(real) == everything  # no sample lost, none read twice
    assert all(r["epoch"] == 1 for r in c)
    lengths = {len(r["batches"]) for r in c}
    assert len(lengths) == 1  # every rank took the same steps (uneven shards: the ones out early repeat, as padding)
    assert any(pad for r in c for pad in r["padding"])  # 16 shards over 3 readers: some ran out first


# ------------------------------------------------------------------------------------------------ datasets, files
def test_a_datasets_iterable_dataset_is_read_by_shard_and_resumed_by_its_own_state():
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({"x": list(range(64))}).to_iterable_dataset(num_shards=8)
    straight = [int(v) for b in _loader(rows, batch_size=4) for v in b["x"]]
    assert sorted(straight) == list(range(64))
    first = _loader(rows, batch_size=4)
    it = iter(first)
    head = [int(v) for _ in range(9) for v in next(it)["x"]]
    state = json.loads(json.dumps(first.state_dict()))
    del it
    assert all("state" in p for p in state["positions"].values())  # datasets' own state_dict, per shard
    resumed = _loader(rows, batch_size=4)
    resumed.load_state_dict(state)
    assert head + [int(v) for b in resumed for v in b["x"]] == straight
    # With workers, each reads its own shards: the same samples.
    with_workers = [int(v) for b in _loader(rows, batch_size=4, workers=2) for v in b["x"]]
    assert sorted(with_workers) == list(range(64))


def test_a_datasets_iterable_dataset_already_split_by_node_is_refused():
    datasets = pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    rows = datasets.Dataset.from_dict({"x": list(range(8))}).to_iterable_dataset(num_shards=4)
    with pytest.raises(ValueError, match="already split with split_dataset_by_node"):
        _loader(split_dataset_by_node(rows, rank=0, world_size=2), batch_size=2)


def _lines_of(path: str) -> list[str]:
    return Path(path).read_text().splitlines()


def test_a_list_of_files_is_a_sharded_stream(tmp_path):
    paths = []
    for f in range(6):
        path = tmp_path / f"part{f}.txt"
        path.write_text("".join(f"{f}:{k}\n" for k in range(7)))
        paths.append(path)
    expected = sorted(f"{f}:{k}" for f in range(6) for k in range(7))
    for read in (None, _lines_of):  # lines skipped as bytes, or the samples of your read(path)
        straight = [s for b in _loader(FileShards(paths, read=read), batch_size=5) for s in b]
        assert sorted(straight) == expected
        first = _loader(FileShards(paths, read=read), batch_size=5)
        it = iter(first)
        head = [s for _ in range(4) for s in next(it)]
        state = first.state_dict()
        del it
        resumed = _loader(FileShards(paths, read=read), batch_size=5)
        resumed.load_state_dict(state)
        assert head + [s for b in resumed for s in b] == straight
        workers = [s for b in _loader(FileShards(paths, read=read), batch_size=5, workers=2) for s in b]
        assert sorted(workers) == expected
    with pytest.raises(ValueError, match="the same file more than once"):
        FileShards([paths[0], paths[0]])
    with pytest.raises(ValueError, match="at least one file"):
        FileShards([])


# ------------------------------------------------------------------------------------------------ unsharded, Accelerate
def test_an_unsharded_stream_keeps_today_s_reading_with_a_warning_that_names_the_fix(monkeypatch):
    said: list[str] = []
    monkeypatch.setattr("phalanx.engine.data.warn_once", said.append)

    class Plain(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(torch.arange(6))

    loader = _loader(Plain(), batch_size=2)
    assert not loader.sharded and [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    assert len(said) == 1 and "Plain is not sharded" in said[0] and "ShardedStream" in said[0]
    with pytest.raises(ValueError, match="unsharded IterableDataset .* num_workers=2 .* make the stream sharded"):
        _loader(Plain(), batch_size=2, workers=2)
    _loader(_Tagged(1, 3), batch_size=2, workers=2)
    assert "1 shards for 1 ranks x 2 workers: some workers read nothing" in said[-1]


def test_accelerate_s_dispatch_batches_and_stateful_loader_options():
    from phalanx.accelerate import Accelerator
    from phalanx.accelerate.utils import DataLoaderConfiguration

    def prepared(**options):  # type: ignore[no-untyped-def]
        acc = Accelerator(dataloader_config=DataLoaderConfiguration(**options))
        return acc.prepare(DataLoader(_Tagged(4, 3), batch_size=2))

    assert prepared().sharded and prepared(dispatch_batches=False).sharded
    assert prepared(use_stateful_dataloader=True).sharded and "positions" in prepared().state_dict()
    whole = prepared(dispatch_batches=True)  # the dispatcher's batches: the stream in order, read whole
    assert not whole.sharded and [b[:, 0].tolist() for b in whole][:2] == [[0, 1], [2, 100]]
    with pytest.raises(TypeError, match="dispatch_batches='yes'"):
        DataLoaderConfiguration(dispatch_batches="yes")  # type: ignore[arg-type]
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    with pytest.raises(ValueError, match="num_workers=2"):
        acc.prepare(DataLoader(_Tagged(4, 3), batch_size=2, num_workers=2))


# ------------------------------------------------------------------------------------------------ the Trainer
class _Rows(ShardedStream):
    """8 shards of 4 rows ({"x", "labels"}), the same rows on every read."""

    def shards(self) -> list[int]:
        return list(range(8))

    def open(self, shard: int, offset: int):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(int(shard))
        x, y = torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)
        for k in range(offset, 4):
            yield {"x": x[k], "labels": y[k]}


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.fc(x)
        return torch.nn.functional.cross_entropy(logits, labels), logits


def test_the_trainer_reads_a_sharded_stream_with_workers_and_resumes_it_where_it_stopped(tmp_path):
    def trainer() -> phalanx.Trainer:
        args = phalanx.TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=6,
            per_device_train_batch_size=2,
            learning_rate=0.1,
            lr_scheduler_type="constant",
            save_strategy="steps",
            save_steps=3,
            dataloader_num_workers=2,
            disable_tqdm=True,
            report_to=[],
        )
        return phalanx.Trainer(_Net(), args, train_dataset=_Rows())

    straight = trainer()
    straight.train()
    assert straight._train_loader.sharded
    resumed = trainer()
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    for name, value in straight.engine.get_state_dict(straight.model).items():
        # Steps 4 to 6 read the same rows as the straight run's (a wrong position would read others).
        torch.testing.assert_close(resumed.engine.get_state_dict(resumed.model)[name], value, rtol=0, atol=1e-6)
