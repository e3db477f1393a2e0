"""What a foreign config file says, in phalanx's settings: the values it maps to, and the keys it ignores and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phalanx.config.options import ConfigError
from phalanx.config.registry import shards

__all__ = ["Mapped", "offload_for"]


@dataclass
class Mapped:
    """The translation of one Accelerate YAML or DeepSpeed JSON file.

    ``values`` are ``(phalanx key, value, the foreign key it came from)``; launcher keys are spelled
    ``launch.<name>``. ``ignored`` are ``(foreign key, why)`` for keys that have no meaning in phalanx.
    ``notes`` say where phalanx does the same job another way, so that nobody is surprised later. ``fills`` are
    what an ``"auto"`` becomes when nothing else sets that key (the HF Trainer's arguments, the launcher's flags):
    the value Accelerate would fill in.
    """

    dialect: str
    values: list[tuple[str, Any, str]] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fills: list[tuple[str, Any, str]] = field(default_factory=list)

    def set(self, key: str, value: Any, source: str) -> None:
        self.values.append((key, value, source))

    def fill(self, key: str, value: Any, source: str) -> None:
        self.fills.append((key, value, source))

    def ignore(self, key: str, why: str) -> None:
        self.ignored.append((key, why))

    def merge(self, other: Mapped, prefix: str = "") -> None:
        """Take in what a nested file maps to (Accelerate's ``deepspeed_config_file``)."""
        self.values += [(k, v, prefix + s) for k, v, s in other.values]
        self.fills += [(k, v, prefix + s) for k, v, s in other.fills]
        self.ignored += [(prefix + k, why) for k, why in other.ignored]
        self.notes += other.notes

    def get(self, key: str, default: Any = None) -> Any:
        found = [v for k, v, _ in self.values if k == key]
        return found[-1] if found else default


def offload_for(out: Mapped, optimizer: str, params: str, strategy: str | None, source: str) -> None:
    """DeepSpeed offloads optimizer state and zero3 parameters separately; phalanx has one ``offload`` for both."""
    if params != "none" and strategy != "zero3":
        raise ConfigError(
            f"{source}: parameter offload ({params}) needs ZeRO stage 3; got strategy {strategy!r} "
            "(offload only the optimizer, or use stage 3)"
        )
    if "none" not in (optimizer, params) and optimizer != params:
        raise ConfigError(
            f"{source}: phalanx offloads optimizer state and zero3's parameter shards to one place; got "
            f"optimizer -> {optimizer}, parameters -> {params} (use the same device for both)"
        )
    chosen = params if optimizer == "none" else optimizer
    if strategy == "zero3" and chosen != "none" and "none" in (optimizer, params):
        out.notes.append(
            f"offload {chosen}: under zero3 phalanx keeps both the optimizer state and the parameter "
            "shards there (DeepSpeed allows one without the other)"
        )
    if chosen != "none" or shards(strategy):
        out.set("offload", chosen, source)
