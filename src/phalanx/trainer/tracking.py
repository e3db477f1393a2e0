"""Rank-0 progress and metrics: a tqdm bar, an optional JSONL sink, and a throughput meter (the Trainer's and the
demo's). Per-rank peak memory is measured in ``runtime/memory.py``.

    bar = ProgressBar(total=steps, enabled=engine.is_main_process, desc="train")
    ...
    if step % 10 == 0:                      # read the loss now and then, not on every step
        bar.update(10, loss=loss.item(), tokens_per_s=tps)
    bar.close()

Nothing here talks to other ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["ProgressBar", "JsonlMetrics", "Throughput", "format_count"]


def format_count(n: float) -> str:
    """``12345`` -> ``12.3k``, ``4.2e6`` -> ``4.20M``: short human-readable counts."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= limit:
            value = n / limit
            return f"{value:.2f}{suffix}" if value < 10 else f"{value:.1f}{suffix}"
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.3g}"


class ProgressBar:
    """A tqdm bar on the main process, nothing elsewhere; ``update`` shows the latest loss and tokens/s.

    When the stream is not a terminal (a log file, CI), without tqdm, or with ``plain=True``, it prints one plain
    line every ``print_every_s`` seconds and one at the end instead: a bar redraws itself with carriage returns and,
    nested (an evaluation inside training), moves the cursor up, which a log file keeps as escape codes.
    """

    def __init__(
        self,
        total: int,
        enabled: bool = True,
        desc: str = "train",
        unit: str = "step",
        file: IO[str] | None = None,
        plain: bool = False,
        print_every_s: float = 10.0,
    ) -> None:
        self.total, self.enabled, self.desc, self.unit = total, enabled, desc, unit
        self.file = file if file is not None else sys.stderr
        self.n = 0
        self.postfix: dict[str, str] = {}
        self._bar: Any = None
        self._print_every_s = print_every_s
        self._last_print = time.perf_counter()
        self._start = self._last_print
        if not enabled:
            return
        tty = hasattr(self.file, "isatty") and self.file.isatty()
        if not plain and tty:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    total=total,
                    desc=desc,
                    unit=unit,
                    file=self.file,
                    dynamic_ncols=True,
                    mininterval=0.2,
                    smoothing=0.1,
                )

    def update(self, n: int = 1, **metrics: Any) -> None:
        """Advance by ``n`` and, when metrics are given, show them (``loss=2.31, tokens_per_s=24000.0``)."""
        if not self.enabled:
            return
        self.n += n
        if metrics:
            self.postfix = {k: _fmt_metric(k, v) for k, v in metrics.items() if v is not None}
        if self._bar is not None:
            if metrics:
                self._bar.set_postfix(self.postfix, refresh=False)
            self._bar.update(n)
            return
        now = time.perf_counter()
        if now - self._last_print >= self._print_every_s or self.n >= self.total:
            self._last_print = now
            shown = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            units = f"{self.unit}es" if self.unit.endswith(("ch", "sh", "s", "x")) else f"{self.unit}s"
            print(
                f"{self.desc}: {self.n}/{self.total} {units} [{now - self._start:.0f}s] {shown}".rstrip(),
                file=self.file,
                flush=True,
            )

    def write(self, message: str) -> None:
        """Print a line above the bar (main process only) without breaking it."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.file)
        else:
            print(message, file=self.file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _fmt_metric(key: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float):
        if key.endswith("per_s") or key.endswith("/s"):
            return format_count(value)
        if key == "lr":
            return f"{value:.2e}"
        return f"{value:.4f}"
    return str(value)


class JsonlMetrics:
    """Appends one JSON object per ``log`` call to a file, on the main process only (a no-op elsewhere)."""

    def __init__(self, path: str | os.PathLike[str] | None, enabled: bool = True) -> None:
        self.path = Path(path) if path is not None else None
        self.enabled = enabled and self.path is not None
        self._fh: IO[str] | None = None
        if self.enabled:
            assert self.path is not None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8")

    def log(self, **record: Any) -> None:
        if self._fh is None:
            return
        clean = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in record.items()}
        self._fh.write(json.dumps({"time": round(time.time(), 3), **clean}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> JsonlMetrics:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Throughput:
    """Tokens per second over the interval since the last ``rate`` call, and over the whole run."""

    def __init__(self) -> None:
        self.start = self._mark = time.perf_counter()
        self.total_tokens = 0
        self._mark_tokens = 0

    def add(self, tokens: int) -> None:
        self.total_tokens += tokens

    def rate(self) -> float:
        """Tokens/s since the previous call (or the start), then start a new interval."""
        now = time.perf_counter()
        dt, dn = now - self._mark, self.total_tokens - self._mark_tokens
        self._mark, self._mark_tokens = now, self.total_tokens
        return dn / dt if dt > 0 else 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def overall(self) -> float:
        dt = self.elapsed()
        return self.total_tokens / dt if dt > 0 else 0.0
