"""What the tensor- and expert-parallel plans share: their name patterns."""

from __future__ import annotations

__all__ = ["matches"]


def matches(pattern: str, name: str) -> bool:
    """Whether the module or parameter ``name`` matches a plan's ``pattern`` (``*`` stands for one dotted part)."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(a == "*" or a == b for a, b in zip(p, n, strict=True))
