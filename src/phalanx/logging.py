"""One rank-aware logger: ``[phalanx rank R]`` prefixes, quiet off rank 0 unless asked, and ``warn_once``.

Python warnings (``warnings.warn`` from torch, a library or the training script) go through it too on the ranks
other than 0, so that a warning prints once per job rather than once per rank; with ``log_all_ranks`` every rank
prints them, with its rank in the prefix. Rank 0 shows them as Python does.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TextIO

__all__ = ["get_logger", "configure_logging", "warn_once"]

_LOGGER = logging.getLogger("phalanx")
_WARNED: set[str] = set()


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, all_ranks: bool) -> None:
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return self.all_ranks or self.rank == 0 or record.levelno >= logging.ERROR


def configure_logging(rank: int, all_ranks: bool = False, level: int = logging.INFO) -> None:
    """Install the rank prefix, and route Python warnings through it off rank 0. Called by the runtime once the
    rank is known."""
    for h in list(_LOGGER.handlers):
        _LOGGER.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[phalanx rank %(rank)s] %(levelname)s %(message)s"))
    handler.addFilter(_RankFilter(rank, all_ranks))
    _LOGGER.addHandler(handler)
    _LOGGER.setLevel(level)
    _LOGGER.propagate = False
    _route_warnings(rank != 0)


_python_showwarning = warnings.showwarning


def _showwarning_through_logger(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    if file is not None:  # the caller chose where it goes
        _python_showwarning(message, category, filename, lineno, file, line)
        return
    get_logger().warning(warnings.formatwarning(message, category, filename, lineno, line).rstrip())


def _route_warnings(on: bool) -> None:
    """Show Python warnings through our logger (``on``), or as Python does; a hook someone else installed stays."""
    global _python_showwarning
    if on and warnings.showwarning is not _showwarning_through_logger:
        _python_showwarning = warnings.showwarning
        warnings.showwarning = _showwarning_through_logger
    elif not on and warnings.showwarning is _showwarning_through_logger:
        warnings.showwarning = _python_showwarning


def get_logger() -> logging.Logger:
    if not _LOGGER.handlers:
        configure_logging(rank=0)
    return _LOGGER


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        get_logger().warning(message)
