"""What the collective log and the hang watchdog cost, measured piece by piece on one process.

    .venv/bin/python benchmarks/bench_collective_log.py

- per collective: ``watched(dist.all_reduce, t)`` against ``dist.all_reduce(t)`` on a one-rank gloo group, with the
  log on (what every collective pays while the watchdog runs) and off, called from a script frame as a user's
  ``engine.reduce`` would be; the difference is the hot-path cost. With the log's ring file too (what every rank of
  ``phalanx launch`` and ``phalanx.spawn`` pays, so that the launcher can name a crash's collectives): the ring's own
  cost is the difference between those two rows, measured in alternating rounds so that the machine's load falls on
  both alike;
- per optimizer step: the hook that counts steps in the ring (the straggler watch's step numbers);
- per watchdog tick (about once a second on each rank, on its own thread): one round of the store protocol on a
  ``file://`` store (what ``phalanx.spawn`` uses) and on a TCP store (what ``phalanx launch`` uses).

The step-level cost, side by side with the watchdog off, is ``bench_ddp.py --watchdog-rows``.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from phalanx.runtime.collective_log import LOG, _stepped, watched
from phalanx.runtime.watchdog import Watchdog


def per_call_us(fn, n: int = 20000, repeats: int = 7) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def main(rounds: int = 9) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        t = torch.ones(16)
        LOG.on = False
        direct = per_call_us(lambda: dist.all_reduce(t))
        off = per_call_us(lambda: watched(dist.all_reduce, t))
        LOG.on = True
        on = per_call_us(lambda: watched(dist.all_reduce, t))
        on_async = per_call_us(lambda: watched(dist.all_reduce, t, async_op=True).wait())
        # Today's default (the log on) against the log with its ring, round by round.
        no_ring, with_ring = [], []
        for _ in range(rounds):
            LOG.ring = None
            no_ring.append(per_call_us(lambda: watched(dist.all_reduce, t), n=5000, repeats=3))
            LOG.open_ring(tmp, 0)
            with_ring.append(per_call_us(lambda: watched(dist.all_reduce, t), n=5000, repeats=3))
        ring_us = statistics.median(w - n for w, n in zip(with_ring, no_ring))
        step_us = per_call_us(lambda: _stepped(opt, (), {}), n=20000)
        ring, entry = LOG.ring, LOG.recent[-1]
        assert ring is not None
        group = (1, 1, b"rank 0")
        put_us = per_call_us(lambda: ring.end(ring.put(entry, group), False), n=20000)
        LOG.ring = None
        LOG.on = False
        print(f"dist.all_reduce (1 rank, 16 floats), direct:       {direct:6.2f} us per call")
        print(f"watched(...) with the log off:                     {off:6.2f} us  (+{off - direct:.2f})")
        print(f"watched(...) with the log on:                      {on:6.2f} us  (+{on - direct:.2f})")
        print(f"watched(..., async_op=True).wait() with the log on: {on_async:6.2f} us")
        print(
            f"the ring file (log on, ring on - log on), {rounds} alternating rounds: median {ring_us:+.2f} us per "
            f"collective (rounds: log on {statistics.median(no_ring):.2f} us, with ring "
            f"{statistics.median(with_ring):.2f} us)"
        )
        print(f"the ring alone (put + end of one entry):            {put_us:6.2f} us per collective")
        print(f"the step hook (counts optimizer steps in the ring):  {step_us:6.2f} us per optimizer step")

        stores = {"file:// store": dist.distributed_c10d._get_default_store()}
        server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
        stores["TCP store"] = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=30))
        for name, store in stores.items():
            dog = Watchdog(dist.PrefixStore("bench/", store), 0, 1, 300.0, {})
            tick = per_call_us(dog._tick, n=200, repeats=5)
            print(
                f"one watchdog tick, {name + ':':15}             {tick:8.1f} us  "
                f"(once a second: {tick / 1e4:.3f}% of one core)"
            )
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
