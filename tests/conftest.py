"""Shared fixtures. ``run_ranks(fn, n, *args)`` runs ``fn(*args)`` on n gloo ranks and returns their results."""

from __future__ import annotations

from typing import Any, Callable

import pytest

import phalanx


@pytest.fixture
def run_ranks() -> Callable[..., list[Any]]:
    def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180) -> list[Any]:
        return phalanx.spawn(fn, nprocs=world_size, args=args, threads_per_proc=1, timeout=timeout)

    return run
