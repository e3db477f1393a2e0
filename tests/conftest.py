"""Shared fixtures. ``run_ranks(fn, n, *args)`` runs ``fn(*args)`` on n gloo ranks and returns their results.

The ranks are forked from a forkserver that imported torch once (``PHALANX_TEST_START_METHOD=spawn`` starts fresh
interpreters instead, as users' default): a fresh interpreter spends about 2 s importing torch, and the suite starts
several hundred ranks. Tests that measure a rank's resident memory against its baseline pass
``start_method="spawn"``: a forked rank's peak over its baseline measured about 4 MiB higher (zero3 in
tests/test_zero_memory.py: 168-171 MiB forked, 164-166 MiB fresh), with the formula's expectation unchanged."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

import phalanx

START_METHOD = os.environ.get("PHALANX_TEST_START_METHOD", "forkserver" if os.name == "posix" else "spawn")


@pytest.fixture
def run_ranks(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[Any]]:
    # Multi-rank tests run on gloo and the CPU everywhere, GPU machines included (tests/test_cuda.py covers CUDA).
    monkeypatch.setenv("PHALANX_DEVICE", "cpu")
    # ... and under NCCL's rules (phalanx/runtime/nccl_rules.py): what NCCL would refuse fails here too.
    # (PHALANX_NCCL_RULES=0 in the suite's environment turns them off, to measure what they cost.)
    monkeypatch.setenv("PHALANX_NCCL_RULES", os.environ.get("PHALANX_NCCL_RULES", "1"))

    def run(
        fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180, start_method: str | None = None
    ) -> list[Any]:
        return phalanx.spawn(
            fn,
            nprocs=world_size,
            args=args,
            threads_per_proc=1,
            timeout=timeout,
            start_method=start_method or START_METHOD,
        )

    return run
