"""Stragglers named: a rank that keeps the others waiting is named in the run's log, with its rank and host, once
(and again only when it comes back after recovering), and ``phalanx launch`` ends with a per-rank summary.

The rule (``StragglerWatch``) is tested on ring files written here with chosen arrival times; one run through
``phalanx launch`` slows one rank of four by 20% and looks for its name in the log."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from phalanx.launch.launcher import StragglerWatch
from phalanx.runtime.collective_log import Entry, Ring

STEP_S = 0.020
GROUP = (777, 4, b"all 4 ranks")


def _run_steps(rings: dict[int, Ring], first: int, last: int, late: dict[int, float], seq0: int) -> int:
    """Steps ``first``..``last``: two collectives each (a ddp bucket, a small check); a rank in ``late`` arrives that
    many seconds after the others at both. A small spread (0.1 ms, rank by rank) stands for the ordinary jitter."""
    seq = seq0
    for step in range(first, last + 1):
        for k in range(2):
            seq += 1
            for rank, ring in rings.items():
                e = Entry((0, 1, 2, 3), seq, "all_reduce", 8, torch.float32, f"bucket {k}", ("/t/train.py", 30), None)
                e.t0 = 1000.0 + step * STEP_S + k * 0.002 + late.get(rank, 0.0) + rank * 1e-4
                ring.end(ring.put(e, GROUP), failed=False)
        for ring in rings.values():
            ring.stepped()
    return seq


def _watch(tmp_path) -> tuple[StragglerWatch, dict[int, Ring]]:
    rings = {r: Ring(str(tmp_path / f"rank-{r}.ring"), r) for r in range(4)}
    return StragglerWatch(str(tmp_path), 4), rings


def _named(err: str) -> list[tuple[int, int]]:
    """(rank, step) of each straggler line."""
    return [(int(r), int(s)) for r, s in re.findall(r"rank (\d+) \(host .*?\) is a straggler: .*?at step (\d+)\)", err)]


def test_a_rank_late_every_step_is_named_once_with_its_host(tmp_path, capsys):
    watch, rings = _watch(tmp_path)
    seq = 0
    for first in range(0, 40, 5):  # the watch polls as the ranks go: 5 steps at a time
        seq = _run_steps(rings, first, first + 4, {2: 0.2 * STEP_S}, seq)
        watch.poll(announce=True)
    err = capsys.readouterr().err
    named = _named(err)
    assert [r for r, _ in named] == [2], err  # once, not once per step
    # Steps 0-1 are warm-up; six late steps of ten name it, as soon as the step after them is seen.
    assert named[0][1] <= StragglerWatch.WARMUP_STEPS + StragglerWatch.LATE_IN + 5, err
    assert f"rank 2 (host {socket.gethostname()}, pid {os.getpid()}) is a straggler" in err, err
    assert re.search(r"reached the collectives last, 4\.\d ms \(2\d% of a 20\.0 ms step\) after the other ranks", err)
    summary = watch.stop()
    assert summary is not None
    rows = {
        int(m[0]): m for m in re.findall(r"^  (\d+)\s+\S+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%\s+(\d+)$", summary, re.M)
    }
    assert sorted(rows) == [0, 1, 2, 3], summary
    assert float(rows[2][1]) == pytest.approx(20.0, abs=0.1)  # the step, ms
    assert float(rows[2][2]) == pytest.approx(4.0, abs=0.2)  # its lag, ms
    assert int(rows[2][4]) >= 30 and all(int(rows[r][4]) == 0 for r in (0, 1, 3)), summary


def test_a_one_off_pause_is_not_named(tmp_path, capsys):
    watch, rings = _watch(tmp_path)
    seq = _run_steps(rings, 0, 10, {}, 0)
    seq = _run_steps(rings, 11, 11, {1: 10 * STEP_S}, seq)  # one long pause: a checkpoint write, an evaluation
    seq = _run_steps(rings, 12, 30, {}, seq)
    watch.poll(announce=True)
    err = capsys.readouterr().err
    assert _named(err) == [], err
    assert watch.stop() is not None  # the summary still comes, with no rank late by habit


def test_a_rank_is_named_again_when_it_comes_back(tmp_path, capsys):
    watch, rings = _watch(tmp_path)
    seq = 0
    for first, late in ((0, {2: 0.1 * STEP_S}), (20, {}), (40, {2: 0.1 * STEP_S}), (60, {0: 0.1 * STEP_S})):
        seq = _run_steps(rings, first, first + 19, late, seq)
        watch.poll(announce=True)
    err = capsys.readouterr().err
    assert [r for r, _ in _named(err)] == [2, 2, 0], err
    assert len(re.findall(r"rank 2 is no longer late", err)) >= 1, err


def test_a_restarted_rank_starts_the_watch_over(tmp_path, capsys):
    watch, rings = _watch(tmp_path)
    _run_steps(rings, 0, 30, {3: 0.2 * STEP_S}, 0)
    watch.poll(announce=True)
    for r in range(4):  # a restart: new files, new processes (here: their pids are read as new)
        rings[r] = Ring(str(tmp_path / f"rank-{r}.ring"), r)
    watch.pids = {r: -1 for r in watch.pids}
    _run_steps(rings, 0, 5, {}, 0)
    watch.poll(announce=True)
    assert watch.named is None and watch.decided < 6


def test_one_rank_or_a_short_run_gives_no_summary(tmp_path):
    watch = StragglerWatch(str(tmp_path), 1)
    ring = Ring(str(tmp_path / "rank-0.ring"), 0)
    _run_steps({0: ring}, 0, 30, {}, 0)
    assert watch.stop() is None  # nothing to compare a lone rank with
    (tmp_path / "short").mkdir()
    watch, rings = _watch(tmp_path / "short")
    _run_steps(rings, 0, 5, {}, 0)
    assert watch.stop() is None  # fewer than OF_LAST steps compared


SCRIPT = textwrap.dedent(
    """\
    import sys, time
    import torch
    import phalanx

    slow_rank, steps = int(sys.argv[1]), int(sys.argv[2])
    engine = phalanx.Engine()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, opt = engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    last, then = 0.02, time.monotonic()
    for step in range(steps):
        # One rank 20% slower: 20% of a step, the last one measured (on a loaded machine steps take longer than the
        # 20 ms sleep, and a fixed 4 ms would be less than 20% of them).
        time.sleep(0.02 + (0.2 * last if engine.rank == slow_rank else 0.0))
        engine.train_step(torch.randn(2, 4), lambda m, b: m(b).pow(2).mean())
        now = time.monotonic()
        last, then = now - then, now
    sys.stdout.write(f"finished {engine.rank}\\n"); sys.stdout.flush()
    """
)


@pytest.mark.serial  # timing: a loaded machine blurs the 4 ms that rank 2 is late by
def test_phalanx_launch_names_a_rank_slowed_by_20_percent_within_50_steps(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {**os.environ, "PHALANX_DEVICE": "cpu", "PHALANX_STRATEGY": "ddp"}
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "launch", "-n", "4", "job.py", "2", "50"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    err = proc.stderr
    assert proc.returncode == 0, err[-3000:]
    assert sorted(re.findall(r"finished (\d)", proc.stdout)) == ["0", "1", "2", "3"]
    # Named while the job ran (the last read, after the ranks ended, names no one): within its 50 steps.
    named = _named(err)
    assert named and named[0][0] == 2, err[-3000:]
    assert named[0][1] < 50
    summary = err[err.index("phalanx launch: per-rank summary") :]
    rows = {
        int(m[0]): int(m[1]) for m in re.findall(r"^  (\d+)\s+\S+\s+[\d.]+\s+[\d.]+\s+[\d.]+%\s+(\d+)$", summary, re.M)
    }
    assert sorted(rows) == [0, 1, 2, 3], summary
    assert rows[2] == max(rows.values()), summary  # late in more steps than any other rank
