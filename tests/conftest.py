"""Shared fixtures. ``run_ranks(fn, n, *args)`` runs ``fn(*args)`` on n gloo ranks and returns their results."""

from __future__ import annotations

from typing import Any, Callable

import pytest

import phalanx


@pytest.fixture
def run_ranks(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[Any]]:
    # Multi-rank tests run on gloo and the CPU everywhere, GPU machines included (tests/test_cuda.py covers CUDA).
    monkeypatch.setenv("PHALANX_DEVICE", "cpu")

    def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180) -> list[Any]:
        return phalanx.spawn(fn, nprocs=world_size, args=args, threads_per_proc=1, timeout=timeout)

    return run
