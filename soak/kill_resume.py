"""Kill a random rank (SIGKILL) at a random step under ``--max-restarts 1 --resume-from``, many times: every run must
end with parameters bitwise equal to an uninterrupted run.

    .venv/bin/python soak/kill_resume.py --runs 10 --seed 0

The training script is the one of ``tests/test_auto_resume.py`` (no resume code; it saves every 4 steps and kills
the chosen rank at the chosen step on the first attempt only): 2 ranks under ddp, 36 steps.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_auto_resume import SCRIPT  # noqa: E402

PHALANX = [sys.executable, "-m", "phalanx"]


def launch(tmp: Path, name: str, kill: tuple[int, int], restarts: int) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PHALANX_DEVICE": "cpu", "PHALANX_STRATEGY": "ddp"}
    start = time.monotonic()
    proc = subprocess.run(
        [
            *PHALANX,
            "launch",
            "-n",
            "2",
            "--max-restarts",
            str(restarts),
            "--resume-from",
            str(tmp / f"{name}-ckpt"),
            "job.py",
            str(kill[0]),
            str(kill[1]),
            str(tmp / f"{name}.safetensors"),
        ],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    return proc, time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    failures = 0
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "job.py").write_text(SCRIPT)
        straight, took = launch(tmp, "straight", (-1, -1), 0)
        assert straight.returncode == 0, straight.stderr[-2000:]
        ref = load_file(tmp / "straight.safetensors")
        print(f"uninterrupted run: {took:.1f} s")
        for run in range(args.runs):
            rank, step = rng.randrange(2), rng.randint(1, 35)
            proc, took = launch(tmp, f"run{run}", (rank, step), 1)
            summary = next((line for line in proc.stderr.splitlines() if "restart" in line and "resumed" in line), "")
            if proc.returncode != 0:
                verdict = f"failed (exit code {proc.returncode}): {proc.stderr[-300:]}"
            else:
                got = load_file(tmp / f"run{run}.safetensors")
                same = all(torch.equal(got[k], v) for k, v in ref.items())
                verdict = "bitwise equal" if same else "DIFFERENT"
            failures += verdict != "bitwise equal"
            print(
                f"run {run}: rank {rank} killed at step {step}: {took:.1f} s, {verdict}; "
                f"{summary.removeprefix('phalanx launch: ')[:160]}"
            )
    print(f"{args.runs} runs: {args.runs - failures} bitwise equal to the uninterrupted run, {failures} not")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
