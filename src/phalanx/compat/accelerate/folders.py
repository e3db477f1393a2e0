"""Where the Accelerate front's ``save_state`` and ``load_state`` go: the folder every process names, or Accelerate's
automatic ``project_dir/checkpoints/checkpoint_<i>``.

A phalanx checkpoint is one folder that every process writes its part to. Accelerate lets each process name its
own (its main process writes the model there, every process its RNG): a script that does (Accelerate's own test
gives each process a temporary folder of its own) is told so, with the fix, before anything is written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from phalanx.compat.accelerate.utils import ProjectConfiguration
from phalanx.runtime.comm import all_gather_bytes

__all__ = ["automatic_folder", "latest_automatic", "same_folder_everywhere"]


def same_folder_everywhere(what: str, folder: str | os.PathLike[str], device: torch.device) -> None:
    """Refuse, on every process, folders that differ between processes."""
    mine = str(Path(folder).absolute())
    everyone = [b.decode() for b in all_gather_bytes(mine.encode(), device)]
    if len(set(everyone)) > 1:
        named = ", ".join(f"process {i}: {f}" for i, f in enumerate(everyone))
        raise ValueError(
            f"{what}: the processes name different folders ({named}); a phalanx checkpoint is one folder that every "
            "process writes its part to (Accelerate's per-process folders hold each one's RNG only). Pass the same "
            "path on every process, e.g. one made on the main process and shared with broadcast_object_list"
        )


def _numbered(parent: Path) -> list[tuple[int, Path]]:
    found = []
    for d in parent.iterdir() if parent.is_dir() else ():
        m = re.fullmatch(r"checkpoint_(\d+)", d.name)
        if m and d.is_dir():
            found.append((int(m.group(1)), d))
    return sorted(found)


def automatic_folder(config: ProjectConfiguration, what: str) -> Path:
    """``project_dir/checkpoints/checkpoint_<iteration>``, under ``automatic_checkpoint_naming``."""
    if not config.automatic_checkpoint_naming or config.project_dir is None:
        raise ValueError(
            f"{what}() needs a folder: pass one, or make the Accelerator with project_config=ProjectConfiguration("
            "project_dir=..., automatic_checkpoint_naming=True) for Accelerate's checkpoints/checkpoint_<i>"
        )
    folder = Path(config.project_dir) / "checkpoints" / f"checkpoint_{config.iteration}"
    if folder.exists():
        raise ValueError(
            f"{what}: {folder} exists already (automatic checkpoint naming counts from "
            f"ProjectConfiguration(iteration={config.iteration})); load_state() first to go on after it, or set "
            "iteration past it"
        )
    return folder


def latest_automatic(config: ProjectConfiguration) -> Path:
    """The newest ``checkpoint_<i>`` under ``project_dir/checkpoints``; the next save is numbered after it."""
    if not config.automatic_checkpoint_naming or config.project_dir is None:
        raise ValueError(
            "load_state() needs a folder: pass one, or make the Accelerator with project_config="
            "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True) to load the newest checkpoint"
        )
    found = _numbered(Path(config.project_dir) / "checkpoints")
    if not found:
        raise ValueError(f"load_state(): no checkpoint_<i> folder in {Path(config.project_dir) / 'checkpoints'}")
    number, folder = found[-1]
    config.iteration = number + 1
    return folder
