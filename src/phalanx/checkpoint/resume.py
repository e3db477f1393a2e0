"""``resume_from``: a restarted job continues from the newest complete checkpoint in a directory, with no resume code.

    phalanx launch -n 4 --max-restarts 3 --resume-from ckpt/ train.py      # or Engine(resume_from="ckpt/")

The script saves into that directory as usual, ``engine.save_state(f"ckpt/step-{engine.global_step}", keep_last=2)``.
``engine.prepare`` loads the newest complete checkpoint there as soon as everything it holds (models, optimizers,
schedulers, loaders, registered objects) is prepared, so that ``range(engine.epoch, epochs)``, the loader's position,
the step count and every rank's RNG are right before the loop begins. A directory with no checkpoint is a fresh
start. A backward before everything is prepared is an error that says what is missing: loading later would make
the loop start in the wrong place without a word.

Each resume appends one line to ``DIR/.phalanx-resumes.jsonl``; ``phalanx launch`` reads the lines of its own run and
says how many restarts happened and what each cost. The Trainer resumes the same way from its ``output_dir``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from phalanx.checkpoint.format import MANIFEST
from phalanx.checkpoint.read import latest_checkpoint
from phalanx.logging import get_logger

__all__ = ["Resumer", "RECORD", "ENV_LAUNCH_ID", "restart_summary", "check_trainer_resume_dir"]

RECORD = ".phalanx-resumes.jsonl"
ENV_LAUNCH_ID = "PHALANX_LAUNCH_ID"
"""Set by ``phalanx launch`` for its workers: which run a line of the record belongs to."""
_KINDS = (("model", "models"), ("optimizer", "optimizers"), ("LR scheduler", "schedulers"), ("DataLoader", "loaders"),
          ("registered object", "objects"))  # fmt: skip


class Resumer:
    """One Engine's ``resume_from``: find the newest checkpoint once, load it when everything it holds is prepared."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self.pending: Path | None = None
        self.saved: dict[str, int] = {}
        self.done = directory is None
        self._looked = False
        self.started = time.time()

    def look(self, rank: int, share: Callable[[str], str] | None = None) -> None:
        """Find the newest complete checkpoint. ``share`` hands rank 0's choice to every rank, so that all load the
        same one even where their views of the directory differ (a network file system's cache)."""
        if self._looked:
            return
        self._looked = True
        assert self.directory is not None
        latest = latest_checkpoint(self.directory)
        if share is not None:
            chosen = share(str(latest) if latest is not None else "")
            latest = Path(chosen) if chosen else None
        if latest is None:
            self.done = True
            if rank == 0:
                get_logger().info(
                    f"resume_from={self.directory} holds no checkpoint yet: training starts from the beginning"
                )
            return
        manifest = json.loads((latest / MANIFEST).read_text())
        self.pending, self.saved = latest, {key: len(manifest[key]) for _, key in _KINDS}

    def hand_over(self, output_dir: str) -> Resumer | None:
        """The Trainer resumes itself (its checkpoints hold its own state too): the Engine leaves this one alone."""
        check_trainer_resume_dir(self.directory, output_dir)
        mine = self if not self.done else None
        self.done = True
        return mine

    def ready(self, prepared: dict[str, int]) -> bool:
        return all(prepared[key] >= n for key, n in self.saved.items())

    def missing(self, prepared: dict[str, int]) -> str:
        return ", ".join(
            f"{n - prepared[key]} more {kind}(s)" for kind, key in _KINDS if prepared[key] < (n := self.saved[key])
        )

    def loaded(self, rank: int, world: int, global_step: int) -> None:
        """Say what was resumed (rank 0) and append it to the record that ``phalanx launch`` reads."""
        assert self.pending is not None
        path, self.pending, self.done = self.pending, None, True
        if rank != 0:
            return
        manifest = json.loads((path / MANIFEST).read_text())
        now = time.time()
        line = {
            "launch": os.environ.get(ENV_LAUNCH_ID),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "checkpoint": path.name,
            "global_step": global_step,
            "saved_world_size": manifest["world_size"],
            "world_size": world,
            "checkpoint_age_s": round(now - manifest["saved_at"], 2),
            "startup_s": round(now - self.started, 2),
            "at": now,
        }
        get_logger().info(
            f"resume_from={self.directory}: resumed from {path.name} (global step {global_step}, saved "
            f"{line['checkpoint_age_s']:.1f} s ago on {manifest['world_size']} rank(s); now {world})"
        )
        try:
            with open(Path(self.directory or ".") / RECORD, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:  # the resume itself has worked; only the launcher's summary will lack this line
            get_logger().warning(f"could not append to {Path(self.directory or '.') / RECORD}: {e}")


def restart_summary(directory: str, launch_id: str, max_restarts: int) -> str | None:
    """The launcher's closing line about restarts of run ``launch_id``: how many, from where, and what each cost."""
    try:
        lines = (Path(directory) / RECORD).read_text().splitlines()
    except OSError:
        return None
    records = []
    for x in lines:
        try:
            records.append(json.loads(x))
        except ValueError:
            continue  # a line cut short (a rank killed while writing it): the others still tell
    mine = [r for r in records if isinstance(r, dict) and r.get("launch") == launch_id and r.get("restart", 0) > 0]
    if not mine:
        return None
    parts = [
        f"restart {r['restart']} resumed from {r['checkpoint']} (global step {r['global_step']}) on {r['world_size']} "
        f"rank(s), {r['startup_s']:.1f} s after its processes started; the checkpoint was "
        f"{r['checkpoint_age_s']:.1f} s old, so at most that much work was lost and done again"
        for r in mine
    ]
    n = len(mine)
    return (
        f"phalanx launch: {n} restart{'s' if n > 1 else ''} (--max-restarts {max_restarts}): " + "; ".join(parts) + "."
    )


def check_trainer_resume_dir(resume_from: str | None, output_dir: str) -> None:
    """The Trainer saves in ``output_dir``: a ``resume_from`` elsewhere would find no checkpoint of this run."""
    if resume_from is not None and Path(resume_from).resolve() != Path(output_dir).resolve():
        raise ValueError(
            f"resume_from={resume_from!r} but the Trainer saves its checkpoints in output_dir={output_dir!r}, so a "
            "restart would not find this run's checkpoints there: pass --resume-from with the output_dir (or leave "
            "resume_from unset and use resume_from_checkpoint)"
        )
