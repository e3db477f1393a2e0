"""Shared fixtures. ``run_ranks(fn, n, *args)`` runs ``fn(*args)`` on n gloo ranks and returns their results.

The ranks are forked from a forkserver that imported torch, phalanx and transformers' model code once
(``PHALANX_TEST_START_METHOD=spawn`` starts fresh interpreters instead, as users' default): a fresh interpreter spends
about 2 s importing torch, and the suite starts several hundred ranks. Tests that measure a rank's resident memory
against its baseline pass ``start_method="spawn"``: a forked rank's peak over its baseline measured about 4 MiB
higher (zero3 in tests/test_zero_memory.py: 168-171 MiB forked, 164-166 MiB fresh), with the formula's expectation
unchanged."""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing.forkserver
import os
from collections.abc import Callable
from typing import Any

import pytest

import phalanx

spawn_module = importlib.import_module("phalanx.launch.spawn")  # phalanx.launch.spawn is also the function's name

START_METHOD = os.environ.get("PHALANX_TEST_START_METHOD", "forkserver" if os.name == "posix" else "spawn")

# What the tests' forkserver imports once: phalanx.spawn's own list, and transformers' model code, which the ranks of
# a third of the test files import (about 3.6 s of CPU in each forked rank, 0.2 s more per model class).
_PRELOAD = ["torch", "torch._dynamo", "phalanx", "transformers.modeling_utils"]

# Files that hold the suite's longest tests (20-130 s each) run first. pytest-xdist hands tests out in collection
# order, so a long test collected last (test_zero_memory.py sorts near the end) would run alone while the other
# worker has finished. Each file stays whole and in its own order (module fixtures are set up once).
LONGEST_FIRST = (
    "test_plan.py",
    "test_blog_bert.py",
    "test_zero_memory.py",
    "test_auto_resume.py",
    "test_horovod.py",
    "test_context_parallel_fronts.py",
    "test_zero.py",
    "test_context_parallel.py",
    "test_zero3_compile.py",
    "test_accelerate_names.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the other files keep their order


def _start_forkserver() -> None:
    """Starts the forkserver with ``_PRELOAD`` before phalanx.spawn's first call in this process would start it with
    its own list (the server takes the list it starts with); from then on phalanx.spawn forks from this one. Started
    just before that call, so the environment phalanx.spawn records for the server is the one it started with."""
    if spawn_module._forkserver_environ is not None:
        return
    names = [m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0]) is not None]
    multiprocessing.forkserver.set_forkserver_preload(names)
    multiprocessing.forkserver.ensure_running()


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
        if (start_method or START_METHOD) == "forkserver":
            _start_forkserver()
        return phalanx.spawn(
            fn,
            nprocs=world_size,
            args=args,
            threads_per_proc=1,
            timeout=timeout,
            start_method=start_method or START_METHOD,
        )

    return run
