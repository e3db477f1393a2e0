"""One rank-aware logger: ``[phalanx rank R]`` prefixes, quiet off rank 0 unless asked, and ``warn_once``."""

from __future__ import annotations

import logging
import sys

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
    """Install the rank prefix. Called by the runtime once the rank is known."""
    for h in list(_LOGGER.handlers):
        _LOGGER.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[phalanx rank %(rank)s] %(levelname)s %(message)s"))
    handler.addFilter(_RankFilter(rank, all_ranks))
    _LOGGER.addHandler(handler)
    _LOGGER.setLevel(level)
    _LOGGER.propagate = False


def get_logger() -> logging.Logger:
    if not _LOGGER.handlers:
        configure_logging(rank=0)
    return _LOGGER


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        get_logger().warning(message)
