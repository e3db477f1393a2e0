"""Resuming a stream at 90% of an epoch: a sharded stream seeks each shard, today's (unsharded) way reads the stream
again from its start (issue 40, item 2).

    .venv/bin/python benchmarks/bench_streams.py               # 16 shards x 250 samples at 1 ms each (about 30 s)
    .venv/bin/python benchmarks/bench_streams.py --smoke       # small sizes, writes nothing

The stream is synthetic: ``--shards`` shards of ``--per-shard`` samples, and reading a sample costs ``--sample-ms``
(a sleep: a read from disk or the network, not compute). One process, CPU, batch size 8, no model. Each round:

- **straight**: read the whole epoch once (the time a first read takes);
- **sharded resume**: read 90% of the epoch through a prepared loader over a ``ShardedStream``, take its
  ``state_dict()`` through JSON (as a checkpoint holds it), and time a fresh loader from ``load_state_dict`` to its
  first batch, then to the end of the epoch; count the samples the source serves and the shards it opens;
- **whole-stream resume** (phalanx before this change, and still the way of an unsharded stream): the same over an
  ``IterableDataset`` without shards, resumed from its ``samples_done``: it reads the stream from its start.
- **sharded resume, 2 workers**: the sharded resume with ``num_workers=2`` (forked workers), to first batch.

The times to first batch are medians over ``--rounds`` rounds. Writes ``results/streams.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from phalanx.engine.data import ActiveLoaders, PreparedIterableLoader
from phalanx.engine.streams import ShardedStream

HERE = Path(__file__).resolve().parent
BATCH = 8


class _Costly:
    def __init__(self, shards: int, per_shard: int, sample_s: float) -> None:
        self.n, self.per_shard, self.sample_s = shards, per_shard, sample_s
        self.served = self.opened = 0

    def samples(self, shard: int, offset: int) -> Any:
        self.opened += 1
        for k in range(offset, self.per_shard):
            time.sleep(self.sample_s)
            self.served += 1
            yield torch.tensor([shard * 1_000_000 + k])


class Sharded(ShardedStream):
    def __init__(self, costly: _Costly) -> None:
        self.costly = costly

    def shards(self) -> list[int]:
        return list(range(self.costly.n))

    def open(self, shard: Any, offset: int) -> Any:
        return self.costly.samples(int(shard), offset)


class Whole(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, costly: _Costly) -> None:
        self.costly = costly

    def __iter__(self) -> Any:
        for s in range(self.costly.n):
            yield from self.costly.samples(s, 0)


def _loader(dataset: Any, workers: int = 0) -> PreparedIterableLoader:
    extra: dict[str, Any] = {"num_workers": workers, "multiprocessing_context": "fork"} if workers else {}
    return PreparedIterableLoader(
        DataLoader(dataset, batch_size=BATCH, **extra), 0, 1, torch.device("cpu"), ActiveLoaders()
    )


def _resume(kind: str, args: argparse.Namespace, workers: int = 0) -> dict[str, float]:
    make = Sharded if kind == "sharded" else Whole
    sample_s = args.sample_ms / 1000
    total = args.shards * args.per_shard
    head = int(0.9 * total) // BATCH
    first = _loader(make(_Costly(args.shards, args.per_shard, 0.0)))  # the first 90% (not timed: no read cost)
    it = iter(first)
    for _ in range(head):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    del it
    costly = _Costly(args.shards, args.per_shard, sample_s)
    t0 = time.perf_counter()
    loader = _loader(make(costly), workers)
    loader.load_state_dict(state)
    it = iter(loader)
    rest = len(next(it))
    to_first = time.perf_counter() - t0
    rest += sum(len(b) for b in it)
    to_end = time.perf_counter() - t0
    assert rest == total - head * BATCH, (rest, total, head)  # every sample left, once
    return {"to_first": to_first, "to_end": to_end, "served": costly.served, "opened": costly.opened}


def _straight(args: argparse.Namespace) -> float:
    costly = _Costly(args.shards, args.per_shard, args.sample_ms / 1000)
    t0 = time.perf_counter()
    n = sum(1 for _ in _loader(Sharded(costly)))
    assert n * BATCH >= args.shards * args.per_shard
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--per-shard", type=int, default=250)
    parser.add_argument("--sample-ms", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="small sizes, one round, write nothing")
    args = parser.parse_args()
    if args.smoke:
        args.shards, args.per_shard, args.sample_ms, args.rounds = 4, 20, 0.2, 1
    rows: dict[str, list[dict[str, float]]] = {"sharded": [], "whole": [], "sharded-2w": []}
    straight = []
    for _ in range(args.rounds):  # the kinds alternate within each round
        straight.append(_straight(args))
        rows["sharded"].append(_resume("sharded", args))
        rows["whole"].append(_resume("whole", args))
        rows["sharded-2w"].append(_resume("sharded", args, workers=2))

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[kind])

    read = statistics.median(straight)
    total = args.shards * args.per_shard
    lines = [
        "# Resuming a stream at 90% of an epoch",
        "",
        f"`benchmarks/bench_streams.py`: {args.shards} shards x {args.per_shard} samples, {args.sample_ms} ms to read "
        f"a sample (a sleep), batch size {BATCH}, one process on CPU; medians of {args.rounds} rounds. Reading the "
        f"whole epoch took **{read:.2f} s**.",
        "",
        "| resume at 90% | to first batch (s) | to end of epoch (s) | samples the source served | shards opened |",
        "|---|---:|---:|---:|---:|",
    ]
    names = {
        "sharded": "sharded stream (seeks each shard)",
        "sharded-2w": "sharded stream, 2 workers",
        "whole": "unsharded stream (re-reads from the start: phalanx before issue 40)",
    }
    for kind in ("sharded", "sharded-2w", "whole"):
        # With workers, the source is read (and counts) in the worker processes.
        served = f"{int(med(kind, 'served'))} of {total}" if kind != "sharded-2w" else "(in the workers)"
        opened = str(int(med(kind, "opened"))) if kind != "sharded-2w" else ""
        lines.append(
            f"| {names[kind]} | {med(kind, 'to_first'):.3f} | {med(kind, 'to_end'):.2f} | {served} | {opened} |"
        )
    first_ratio = med("sharded", "to_first") / med("whole", "to_first")
    lines += [
        "",
        f"The sharded resume reached its first batch in {first_ratio:.3f}x the time of the whole-stream resume, and "
        f"the source served only the {total - int(0.9 * total) // BATCH * BATCH} samples left. Its time to the first "
        "batch does not grow with the stream: it opens the shard in progress at its position and reads one batch "
        f"({BATCH} samples). The whole-stream resume reads 90% of the stream before its first batch: on a stream "
        "that takes 60 s to read, about 54 s, where the sharded resume still reads one batch "
        f"({med('sharded', 'to_first'):.3f} s here; {med('sharded-2w', 'to_first'):.2f} s with 2 workers, mostly "
        "starting them). The sleeps overshoot on a loaded machine (the straight read and the resumes were measured "
        "under the same load, alternated round by round), so compare within a row's round, not across machines.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.smoke:
        (HERE / "results" / "streams.md").write_text(text)


if __name__ == "__main__":
    main()
