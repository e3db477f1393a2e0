"""What Horovod's cross-rank checks cost in phalanx.horovod: the same work with the checks on and off, 2 gloo ranks.

    .venv/bin/python benchmarks/bench_horovod_checks.py   # prints the ratios, writes results/horovod-checks.json

- synthetic: Horovod's pytorch_synthetic_benchmark.py loop (a model, DistributedOptimizer, forward, backward, step) on
  an MLP of 4 x Linear(1024, 1024), batch 32; the gradients go through phalanx's reducer, unchecked bucket by bucket;
  the checks cost one coordinator round per step (every rank must be in the same step, or joined);
- synthetic_step: the same loop with the checks on and off in alternate steps (the median step of each);
- allreduce: hvd.allreduce of one tensor per call (64 KiB and 4 MiB), where every call pays one round;
- allreduce_async16: 16 hvd.allreduce_async of 64 KiB, then synchronize each: the 16 start in one round;
- broadcast_parameters: the model's parameters broadcast from rank 0 (two rounds: the layout, then the buffers).

On and off alternate in rounds (this machine is noisy, and shared); each figure is the median over rounds of the
slower rank's time, and the ratio on / off is what to read. ``ratio_of_fastest`` compares the fastest round of each,
the least disturbed by other processes, which on a shared machine is the steadier of the two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import phalanx

RESULTS = Path(__file__).parent / "results" / "horovod-checks.json"


def _rank_work(rounds: int, steps: int, calls: int) -> dict:
    import phalanx.horovod as hvd
    from phalanx.compat.horovod import coordinator

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    x, y = torch.randn(32, 1024), torch.randn(32, 1024)
    small, large = torch.randn(16 * 1024), torch.randn(1024 * 1024)

    def synthetic() -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()

    def allreduce(t: torch.Tensor) -> None:
        for _ in range(calls):
            hvd.allreduce(t, op=hvd.Sum)

    work = {
        "synthetic": synthetic,
        "allreduce_64KiB": lambda: allreduce(small),
        "allreduce_4MiB": lambda: allreduce(large),
        "allreduce_async16": lambda: [
            [hvd.synchronize(h) for h in [hvd.allreduce_async(small, op=hvd.Sum) for _ in range(16)]]
            for _ in range(calls // 16)
        ],
        "broadcast_parameters": lambda: [hvd.broadcast_parameters(model.state_dict(), 0) for _ in range(calls)],
    }
    times: dict[str, dict[str, list[float]]] = {k: {"on": [], "off": []} for k in work}
    for r in range(rounds + 1):  # round 0 warms up
        for name, fn in work.items():
            for mode in ("on", "off") if r % 2 else ("off", "on"):
                coordinator.CHECKS = mode == "on"
                hvd.allreduce(torch.zeros(1))  # line the ranks up
                t0 = time.perf_counter()
                fn()
                if r:
                    times[name][mode].append(time.perf_counter() - t0)
    # The synthetic loop again, the checks on and off in alternate steps: neighbouring steps see the same load on
    # this shared machine, so the medians of many single steps compare them more steadily than whole rounds do.
    steps_times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * rounds * steps):
        mode = "on" if i % 2 else "off"
        coordinator.CHECKS = mode == "on"
        t0 = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        steps_times[mode].append(time.perf_counter() - t0)
    coordinator.CHECKS = True
    times["synthetic_step"] = steps_times
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args()
    ranks = phalanx.spawn(_rank_work, nprocs=2, args=(args.rounds, args.steps, args.calls), threads_per_proc=1)
    rows = {}
    step = {mode: [max(r["synthetic_step"][mode][i] for r in ranks) for i in range(args.rounds * args.steps)]
            for mode in ("on", "off")}  # fmt: skip
    for name in [k for k in ranks[0] if k != "synthetic_step"]:
        per_round = {mode: [max(r[name][mode][i] for r in ranks) for i in range(args.rounds)] for mode in ("on", "off")}
        on, off = statistics.median(per_round["on"]), statistics.median(per_round["off"])
        ratios = sorted(a / b for a, b in zip(per_round["on"], per_round["off"]))
        fastest = min(per_round["on"]) / min(per_round["off"])
        rows[name] = {"on_s": on, "off_s": off, "ratio": on / off, "ratio_range": [ratios[0], ratios[-1]],
                      "ratio_of_fastest": fastest}  # fmt: skip
        print(f"{name:22s} checks on {on * 1e3:8.2f} ms  off {off * 1e3:8.2f} ms  ratio {on / off:.3f} "
              f"(rounds {ratios[0]:.3f} to {ratios[-1]:.3f}; fastest rounds {fastest:.3f})")  # fmt: skip
    on, off = statistics.median(step["on"]), statistics.median(step["off"])
    rows["synthetic_step"] = {"on_s": on, "off_s": off, "ratio": on / off, "steps_each": len(step["on"])}
    print(f"{'synthetic_step':22s} checks on {on * 1e3:8.2f} ms  off {off * 1e3:8.2f} ms  ratio {on / off:.3f} "
          f"(median of {len(step['on'])} steps each, alternating)")  # fmt: skip
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "world_size": 2, "backend": "gloo", "rows": rows}, indent=1))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
