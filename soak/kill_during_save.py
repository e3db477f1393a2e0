"""Kill a random rank (SIGKILL) at a random moment of a save, many times: the last checkpoint must always load.

    .venv/bin/python soak/kill_during_save.py --runs 20 --seed 0
    .venv/bin/python soak/kill_during_save.py --runs 20 --seed 0 --async     # saves written on a thread

Each run: 2 ranks train an 8 x Linear(1024) MLP with AdamW (a checkpoint of about 100 MB), save ``step-1``, take
one more step and save ``step-2``; while the second save is under way, one rank, drawn at random, kills itself at a
delay drawn uniformly from 0 to 1.2 x the measured length of a save. With ``--async`` both saves are
``async_save=True``: the call returns at once, the thread copies the state (the next optimizer step waits for
that copy) and writes it while the ranks go on training (steps of the same model), and the delay is drawn over
1.2 x the measured time from the call until the checkpoint is in place (the handle's done callback), so that most
kills fall in the background write; a run that ends on ``step-1`` was killed before the write was complete.
Afterwards, in this process:
``latest_checkpoint`` must name a complete checkpoint (``step-1``, or ``step-2`` when the kill came after it was
complete), every file must pass its checksums, and ``load_state`` into a fresh model must give that step's weights.
Printed: how many runs ended on each checkpoint, and the number of corrupt or unloadable ones (the goal: 0).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import phalanx
from phalanx.checkpoint import Checkpoint, latest_checkpoint
from phalanx.launch.launcher import SpawnError


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(engine: phalanx.Engine, model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(seed + engine.rank))
    engine.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad()


def work(directory: str, victim: int, delay: float, background: bool = False) -> tuple[float, float]:
    """Returns (seconds from the call until the step-2 checkpoint was in place on this rank's view, seconds the save
    call blocked training)."""
    engine = phalanx.Engine(strategy="zero2")
    model, opt = engine.prepare(*build())
    step(engine, model, opt, 1)
    engine.save_state(f"{directory}/step-1", async_save=background)
    if background:
        engine.wait_for_checkpoint()  # step-1 is complete before any kill: it is the checkpoint that must survive
    step(engine, model, opt, 2)
    if engine.rank == victim:
        threading.Timer(delay, lambda: os.kill(os.getpid(), 9)).start()
    start = time.perf_counter()
    if background:
        saving = engine.save_state(f"{directory}/step-2", async_save=True)
        blocked = time.perf_counter() - start
        written: list[float] = []
        saving.add_done_callback(lambda _: written.append(time.perf_counter() - start))  # on the writer thread
        for i in range(3):  # training goes on while the thread writes (the checkpoint holds step 2's state)
            step(engine, model, opt, 10 + i)
        engine.wait_for_checkpoint()
        took = written[0]  # the background write alone: the kills are drawn over it
    else:
        engine.save_state(f"{directory}/step-2")
        took = blocked = time.perf_counter() - start
    if engine.rank == victim:
        time.sleep(delay + 1)  # the timer has not fired yet: let it (the save was complete before the kill)
    return took, blocked


def weights_of(path: Path) -> dict[str, torch.Tensor]:
    engine = phalanx.Engine(strategy="ddp")
    model, opt = engine.prepare(*build())
    engine.load_state(path)  # checks every file and checksum before anything is loaded
    return {k: v.clone() for k, v in engine.get_state_dict(model).items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async", dest="background", action="store_true", help="save with async_save=True")
    p.add_argument("--window", type=float, default=1.2, help="kills fall in 0-WINDOW x the measured save (1.2)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        calib = Path(tmp) / "calibration"
        # Ranks forked from a server that imported torch once: a loaded machine does not push a run past its timeout.
        times = phalanx.spawn(work, nprocs=2, args=(str(calib), -1, 0.0, args.background), start_method="forkserver")
        took = statistics.median(t for t, _ in times)
        blocked = max(b for _, b in times)
        reference = {name: weights_of(calib / name) for name in ("step-1", "step-2")}
        print(
            f"one {'asynchronous ' if args.background else ''}save takes {took:.2f} s (the call blocked training "
            f"{blocked:.2f} s); kills fall uniformly in 0-{args.window * took:.2f} s after the call"
        )
        ended: dict[str, int] = {}
        corrupt = 0
        for run in range(args.runs):
            directory = Path(tmp) / f"run{run}"
            victim, delay = rng.randrange(2), rng.uniform(0, args.window * took)
            try:
                phalanx.spawn(
                    work,
                    nprocs=2,
                    args=(str(directory), victim, delay, args.background),
                    timeout=600,
                    start_method="forkserver",
                )
                how = "no kill took effect"
            except SpawnError as e:
                how = str(e).splitlines()[0][:80]
            latest = latest_checkpoint(directory)
            verdict = "ok"
            if latest is None:
                verdict = "no checkpoint at all"
            else:
                with Checkpoint(latest) as ck:
                    problems = ck.verify(range(len(ck.files)))
                if problems:
                    verdict = f"corrupt: {problems[:2]}"
                else:
                    got = weights_of(latest)
                    if any(not torch.equal(got[k], v) for k, v in reference[latest.name].items()):
                        verdict = "loads, but not the weights of that step"
            corrupt += verdict != "ok"
            name = latest.name if latest else "-"
            ended[name] = ended.get(name, 0) + 1
            print(f"run {run:2}: rank {victim} killed at {delay:.2f} s ({how}); latest {name}: {verdict}")
            shutil.rmtree(directory, ignore_errors=True)
        print(f"{args.runs} runs: latest checkpoint {ended}; corrupt or unloadable: {corrupt}")
        return 1 if corrupt else 0


if __name__ == "__main__":
    sys.exit(main())
