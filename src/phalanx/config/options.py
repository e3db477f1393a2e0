"""How a group of settings is declared: a dataclass of :func:`option` fields, each with its doc and its allowed values.

The Engine's general settings (``general.py``) and each strategy's own knobs (``strategy_options.py``) are
declared this way. ``settings.py`` composes them: it reads every group from the strategy registry, layers file,
environment and flags over them, checks each field against its declaration, and asks the registry which
strategies accept a group, so it never names a strategy. ``phalanx config`` and ``phalanx launch --help`` list the
same fields, docs and choices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from phalanx.config.settings import EngineConfig

__all__ = ["Options", "option", "ConfigError"]


class ConfigError(ValueError):
    """A configuration value is wrong: the message names the key, the value, where it came from and the fix."""


def option(
    default: Any,
    doc: str,
    *,
    choices: tuple[Any, ...] | None = None,
    check: Callable[[Any], bool] | None = None,
    fix: str = "",
    is_set: Callable[[Any], bool] | None = None,
    elsewhere: str | None = None,
) -> Any:
    """A declared setting.

    ``choices``: the allowed values (None is also allowed when it is the default). ``check``: a predicate the
    value must meet, with ``fix`` saying what to use instead. ``is_set``: whether a value asks for something
    (default: it differs from the default); a value that is set under a strategy that does not accept the group
    is an error. ``elsewhere``: that error's text, with ``{key}``, ``{value}`` and ``{strategy}`` filled in.
    """
    return field(
        default=default,
        metadata={"doc": doc, "choices": choices, "check": check, "fix": fix, "is_set": is_set, "elsewhere": elsewhere},
    )


@dataclass
class Options:
    """A group of settings owned by one strategy or a family of them. Subclasses declare :func:`option` fields."""

    title: ClassVar[str] = "options"
    """A heading for help and ``phalanx config`` (e.g. "zero strategies")."""
    applies_to: ClassVar[str] = ""
    """Who accepts these settings, for errors (e.g. "the zero strategies", "strategy='zero3'")."""

    def check_fields(self) -> None:
        """Each field against its declared choices and check."""
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            choices = meta.get("choices")
            if choices is not None and value not in choices and not (value is None and f.default is None):
                raise ConfigError(f"invalid {f.name}: got {value!r} (use one of: {', '.join(map(str, choices))})")
            check = meta.get("check")
            if check is not None and value is not None and not check(value):
                raise ConfigError(f"invalid {f.name}: got {value!r} ({meta.get('fix') or 'see phalanx config'})")

    def check(self, config: EngineConfig) -> None:
        """Rules between fields, or with other groups of ``config`` (a ConfigError or ConfigError on failure)."""

    def set_fields(self) -> list[str]:
        """Names of the fields whose value asks for something (see :func:`option`'s ``is_set``)."""
        out = []
        for f in dataclasses.fields(self):
            value, is_set = getattr(self, f.name), f.metadata.get("is_set")
            if is_set(value) if is_set is not None else value != f.default:
                out.append(f.name)
        return out
