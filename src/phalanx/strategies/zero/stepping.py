"""Stepping the user's optimizer part by part: the tricks the zero strategies play with ``optimizer.step``.

- ``pipeline_steps`` (zero1/zero2): step one bucket at a time, first layers first, and start each bucket's
  all-gather as soon as its slice is updated, so that the gathers overlap the rest of the step.
- ``chunk_steps`` (``offload: disk``): step a chunk at a time and move each chunk's new state into the files,
  so that one chunk of optimizer state is resident at once.

Both narrow the optimizer's param groups to one part and call the original ``step``, which is exact for
elementwise optimizers (they see each piece once per step either way). A tensor-wise optimizer's step
(``tensorwise.py``, marked by ``replace_step(..., whole_tensors=True)``) is an exchange every rank joins, around
owners' parameters that are not a bucket's pieces: ``pipeline_steps`` leaves it whole.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from phalanx.strategies.zero.offload import StateStore

__all__ = ["chunk_steps", "pipeline_steps", "replace_step", "step_in_parts", "steps_whole_tensors"]


def pipeline_steps(
    optimizer: torch.optim.Optimizer,
    parts: Callable[[], list[tuple[Any, list[list[nn.Parameter]]]]],
    gather: Callable[[Any], None],
) -> None:
    """Make ``optimizer.step`` step each part of ``parts()`` in turn and call ``gather(part)`` after each; an optimizer
    that steps whole tensors on their owners is left as it is (see the module's docstring)."""
    if steps_whole_tensors(optimizer):
        return
    step = optimizer.step

    def pipelined_step(*args: Any, **kwargs: Any) -> Any:
        return step_in_parts(optimizer, lambda: step(*args, **kwargs), parts(), gather)

    replace_step(optimizer, pipelined_step)


def chunk_steps(optimizer: torch.optim.Optimizer, store: StateStore, chunk_mb: float) -> None:
    """Disk offload: step the pieces a chunk at a time, and move each chunk's new state into the files.

    Only one chunk of optimizer state is resident at once; the others stay in the page cache and out of
    this process's memory.
    """
    step = optimizer.step
    limit = chunk_mb * 2**20

    def chunked_step(*args: Any, **kwargs: Any) -> Any:
        groups = [g["params"] for g in optimizer.param_groups]
        order = [(gi, p) for gi, ps in enumerate(groups) for p in ps]
        chunks: list[list[tuple[int, nn.Parameter]]] = [[]]
        size = 0.0
        for gi, p in order:
            nbytes = p.numel() * 4 * 3
            if chunks[-1] and size + nbytes > limit:
                chunks.append([])
                size = 0.0
            chunks[-1].append((gi, p))
            size += nbytes

        def to_disk(chunk: list[tuple[int, nn.Parameter]]) -> None:
            for _, p in chunk:
                st = optimizer.state.get(p, {})
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and not store.owns(v):
                        st[k] = store.copy_of(v)
            store.release()

        parts = [(chunk, [[p for cgi, p in chunk if cgi == gi] for gi in range(len(groups))]) for chunk in chunks]
        return step_in_parts(optimizer, lambda: step(*args, **kwargs), parts, to_disk)

    replace_step(optimizer, chunked_step)


def replace_step(optimizer: torch.optim.Optimizer, step: Callable[..., Any], whole_tensors: bool = False) -> None:
    """Make ``step`` the optimizer's ``step``, bound to it as the original was: an LR scheduler built on this optimizer
    later wraps ``optimizer.step.__func__``, which a plain function lacks. ``whole_tensors``: ``step`` steps whole
    tensors on their owner ranks (``tensorwise.py``), and must not be cut into parts.

    An LR scheduler built *before* (on the user's optimizer, then prepared) wrapped the original step to count its
    calls, and warns that "optimizer.step() has been overridden" unless the step it sees carries its mark. Ours
    calls that wrapped step, so the count stays right: carry the mark over."""

    def replaced(_opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return step(*args, **kwargs)

    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        replaced._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    if whole_tensors:
        replaced._phalanx_whole_tensors = True  # type: ignore[attr-defined]
    optimizer.step = types.MethodType(replaced, optimizer)  # type: ignore[method-assign]


def steps_whole_tensors(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` is a tensor-wise owner step (``replace_step(..., whole_tensors=True)``)."""
    return bool(getattr(getattr(optimizer.step, "__func__", None), "_phalanx_whole_tensors", False))


def step_in_parts(
    optimizer: torch.optim.Optimizer,
    step: Callable[[], Any],
    parts: list[tuple[Any, list[list[nn.Parameter]]]],
    after: Callable[[Any], None],
) -> Any:
    """Step the optimizer once per part, its param groups narrowed to that part's pieces, then call ``after``.

    Exact for elementwise optimizers, which see each piece once per step either way. Parts with no piece
    here skip the step but still get ``after`` (which may be a collective every rank must join).
    """
    groups = [g["params"] for g in optimizer.param_groups]
    result = None
    try:
        for part, per_group in parts:
            if any(per_group):
                for g, ps in zip(optimizer.param_groups, per_group):
                    g["params"] = ps
                result = step()
            after(part)
    finally:
        for g, ps in zip(optimizer.param_groups, groups):
            g["params"] = ps
    return result
