"""Which ``checkpoint-<step>`` directories to delete under ``save_total_limit``: never the best, never the newest.

    found = sorted_checkpoints("out")                          # [(100, Path("out/checkpoint-100")), ...]
    doomed = checkpoints_to_delete(found, save_total_limit=2, best_checkpoint=state.best_model_checkpoint)

How this differs from the HF Trainer, each at a place its users reported:

- The best checkpoint and the newest one are both always kept, so ``save_total_limit`` is a bound on the *other*
  checkpoints: at most ``max(save_total_limit, number protected)`` remain. With ``save_total_limit=1`` and a best that
  is not the newest, two remain. HF keeps the same two while training, but at the end of ``train()`` it deletes every
  checkpoint except the best, the newest included (the behaviour discussed in transformers #35070), so a finished
  run can no longer be resumed or extended; we never delete the newest, at the end or otherwise.
- Older HF releases rotated the best checkpoint away when it was not among the newest (transformers #15089);
  here the best one is protected by its path, compared after normalisation, so ``out/checkpoint-5`` and
  ``/abs/out/checkpoint-5/`` are the same checkpoint.
- Order is by the step in the name, never by modification time or string order (transformers #26961, #27138 lost
  the newest checkpoints to those), and only complete phalanx checkpoints count: a save interrupted before its
  rename is never listed, so it can neither be chosen as the newest nor push a good checkpoint out.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from phalanx.checkpoint.format import is_checkpoint

__all__ = ["PREFIX_CHECKPOINT_DIR", "checkpoints_to_delete", "sorted_checkpoints", "rotate_checkpoints"]

PREFIX_CHECKPOINT_DIR = "checkpoint"
_NAME = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")
# A crash between the two renames of a save leaves the previous checkpoint at .NAME.old and no NAME
# (checkpoint/format.py).
_OLD_NAME = re.compile(rf"\.({PREFIX_CHECKPOINT_DIR}-(\d+))\.old")

PathLike = str | os.PathLike[str]


def _same(path: PathLike) -> str:
    return os.path.normpath(os.path.abspath(os.fspath(path)))


def checkpoints_to_delete(
    checkpoints: Sequence[tuple[int, PathLike]],
    save_total_limit: int | None,
    best_checkpoint: PathLike | None = None,
) -> list[PathLike]:
    """The checkpoints to delete, oldest first, so that at most ``save_total_limit`` remain besides the protected.

    ``checkpoints`` are ``(step, path)`` pairs in any order; ``best_checkpoint`` is the best model's directory (or
    None). The newest (highest step) and the best are never returned. ``save_total_limit=None`` keeps everything.
    Pure: it looks at no file.
    """
    if save_total_limit is None:
        return []
    if isinstance(save_total_limit, bool) or not isinstance(save_total_limit, int) or save_total_limit < 1:
        raise ValueError(
            f"save_total_limit must be None (keep every checkpoint) or an int >= 1; got {save_total_limit!r} "
            "(the newest and the best checkpoint are always kept, whatever the limit)"
        )
    ordered = sorted(checkpoints, key=lambda sp: (sp[0], _same(sp[1])))
    if len(ordered) <= save_total_limit:
        return []
    best = _same(best_checkpoint) if best_checkpoint is not None else None
    protected = {_same(ordered[-1][1])} | (
        {best} if best is not None and any(_same(p) == best for _, p in ordered) else set()
    )
    room = max(0, save_total_limit - len(protected))
    unprotected = [p for _, p in ordered if _same(p) not in protected]
    # The newest `room` of the unprotected stay; the rest go, oldest first.
    return unprotected[: len(unprotected) - room] if room else unprotected


def sorted_checkpoints(output_dir: PathLike) -> list[tuple[int, Path]]:
    """The complete ``checkpoint-<step>`` directories directly in ``output_dir`` as ``(step, path)``, oldest first.

    Complete means a phalanx checkpoint whose manifest was written (``checkpoint.format.is_checkpoint``); staging
    directories and other names are skipped. A ``.checkpoint-<step>.old`` left by a crash mid-swap stands in for its
    step when ``checkpoint-<step>`` itself is missing, as ``latest_checkpoint`` treats it.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found: list[tuple[int, Path]] = []
    for d in root.iterdir():
        m = _NAME.fullmatch(d.name)
        if m is None:
            old = _OLD_NAME.fullmatch(d.name)
            if old is None or (root / old.group(1)).exists():
                continue
            m = _NAME.fullmatch(old.group(1))
            assert m is not None
        if d.is_dir() and is_checkpoint(d):
            found.append((int(m.group(1)), d))
    return sorted(found, key=lambda sp: (sp[0], sp[1].name))


def rotate_checkpoints(
    output_dir: PathLike, save_total_limit: int | None, best_checkpoint: PathLike | None = None
) -> list[Path]:
    """Delete what :func:`checkpoints_to_delete` chooses among :func:`sorted_checkpoints`; return the deleted paths.
    Rank 0 calls it, after the newest checkpoint is complete."""
    doomed = [Path(p) for p in checkpoints_to_delete(sorted_checkpoints(output_dir), save_total_limit, best_checkpoint)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        # A stale copy left by an interrupted swap would otherwise stand in for the step just deleted.
        shutil.rmtree(path.parent / f".{path.name}.old", ignore_errors=True)
    return doomed
