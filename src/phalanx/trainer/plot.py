"""``phalanx plot OUTPUT_DIR``: a PNG of the run's training and eval loss, learning rate and throughput against the
optimizer step, from the Trainer's ``log.jsonl``, so that people can look instead of read. matplotlib is an optional
extra (``pip install phalanx[plot]``); reading the log needs nothing."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_log", "plot", "PANELS"]

# Each panel: its title and the logged keys it draws.
PANELS = (
    ("loss", ("loss", "eval_loss")),
    ("learning rate", ("learning_rate",)),
    ("throughput (optimizer steps / s)", ("steps_per_second",)),
)


def read_log(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every numeric key of ``log.jsonl`` as a series of (optimizer step, value), in the order logged."""
    p = Path(path)
    if p.is_dir():
        p = p / "log.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"no Trainer log at {str(p)!r} (phalanx.Trainer writes output_dir/log.jsonl on rank 0)")
    series: dict[str, list[tuple[int, float]]] = {}
    for number, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{p}:{number} is not a JSON record: {line[:80]!r}") from None
        step = int(record.get("step", 0))
        for key, value in record.items():
            if key not in ("step", "epoch", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, []).append((step, float(value)))
    return series


def plot(output_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the PNG (default ``output_dir/training.png``) and return its path."""
    series = read_log(output_dir)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "phalanx plot draws with matplotlib, which is not installed (pip install phalanx[plot])"
        ) from None
    target = Path(out) if out is not None else Path(output_dir) / "training.png"
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(8, 3 * len(PANELS)), sharex=True)
    for ax, (title, keys) in zip(axes, PANELS):
        drawn = False
        for key in keys:
            if series.get(key):
                steps, values = zip(*series[key])
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=key)
                drawn = True
        ax.set_title(title)
        if drawn:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(target)
    plt.close(fig)
    return target
