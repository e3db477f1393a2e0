"""Checks that turn a silent wrong result into a clear error or a one-time warning.

Each names the setting, where it came from and the fix. They run where the Engine would otherwise go on quietly:
a script that never opens an accumulation window although ``grad_accum_steps`` asks for one, a backward on
several ranks with no prepared model to reduce its gradients, a model whose parameters were never materialised,
``accumulate(model)`` with a model that was never prepared, a model prepared again after ``free_memory``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from torch import nn

from phalanx.config.options import ConfigError
from phalanx.logging import warn_once
from phalanx.strategies.base import uncompiled

__all__ = [
    "check_loader_batch", "warn_accumulation_unused", "check_backward_has_a_model", "check_materialised",
    "check_prepared_models", "check_not_released", "as_prepared",
]  # fmt: skip


def as_prepared(model: nn.Module, prepared: Sequence[nn.Module]) -> nn.Module:
    """``model`` as the Engine knows it: ``torch.compile(model)`` after ``engine.prepare`` stands for the prepared
    model, so that ``get_state_dict``, ``unwrap_model``, ``accumulate`` ... take the compiled one too."""
    return model if any(model is m for m in prepared) else uncompiled(model)


def warn_accumulation_unused(grad_accum_steps: int, origin: str) -> None:
    """``optimizer.step()`` ran outside ``engine.accumulate()`` while ``grad_accum_steps`` > 1: every micro-batch
    steps, so the run takes ``grad_accum_steps`` times the optimizer steps the setting asked for."""
    warn_once(
        f"grad_accum_steps={grad_accum_steps} (from {origin}) has no effect: optimizer.step() ran outside "
        "engine.accumulate(), so every batch steps the optimizer. Wrap each micro-batch in `with "
        "engine.accumulate():` (or use engine.train_step), or set grad_accum_steps=1"
    )


def check_backward_has_a_model(prepared_models: int, dp_size: int) -> None:
    """On more than one data-parallel rank, a backward needs a prepared model: nothing else reduces gradients."""
    if prepared_models == 0 and dp_size > 1:
        raise RuntimeError(
            f"engine.backward on {dp_size} data-parallel ranks, but no model was passed to engine.prepare: nothing "
            "would average the gradients over the ranks, and the replicas would silently diverge. Call "
            "model, optimizer = engine.prepare(model, optimizer) before training"
        )


def check_materialised(model: nn.Module, strategy: str, materialises: bool) -> None:
    """A model built under ``torch.device("meta")`` has no values; only a strategy that materialises it may take it."""
    if materialises:
        return
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        shown = ", ".join(meta[:3]) + (f" and {len(meta) - 3} more" if len(meta) > 3 else "")
        raise ValueError(
            f"{type(model).__name__} has tensors on the meta device ({shown}): they hold no values, and "
            f"strategy={strategy!r} does not materialise them. Build the model on a real device (drop "
            "`with torch.device('meta')`), load its weights into it before engine.prepare, or use "
            "strategy='pipeline', which materialises each stage's blocks itself"
        )


def check_prepared_models(
    models: Sequence[Any], prepared: Sequence[nn.Module], unwrap: Callable[[nn.Module], nn.Module]
) -> None:
    """``engine.accumulate(model)``: each model passed must be one that ``engine.prepare`` returned (or its
    unwrapped module); gradients of any other would never be reduced."""
    known = {id(m) for m in prepared} | {id(unwrap(m)) for m in prepared}
    for i, model in enumerate(models):
        if id(as_prepared(model, prepared)) not in known:
            what = type(model).__name__
            raise ValueError(
                f"engine.accumulate got a {what} (argument {i}) that engine.prepare did not return: its gradients "
                f"would never be reduced or stepped. Pass the model that `model = engine.prepare(model)` gave back "
                f"({len(prepared)} prepared so far), or call engine.accumulate() with no arguments"
            )


def check_not_released(model: nn.Module, released: Collection[nn.Module]) -> None:
    """A model given up by ``engine.free_memory`` still carries the old strategy's hooks and buffers."""
    if model in released:
        raise ValueError(
            f"this {type(model).__name__} was prepared before engine.free_memory, and still carries that preparation "
            "(hooks, flat buffers); build a new model to prepare, or load its weights into a fresh copy"
        )


def check_loader_batch(loader: Any, config: Any, origins: dict[str, str]) -> None:
    """The DataLoader's batch size is the per-rank micro batch; a config that names another one disagrees with it."""
    wanted, got = config.micro_batch_size, getattr(loader, "batch_size", None)
    if wanted is None or got is None or wanted == got:
        return
    origin = origins.get("micro_batch_size", "default")
    raise ConfigError(
        f"micro_batch_size={wanted} (from {origin}) but the DataLoader has batch_size={got}: the loader's batch is "
        f"each rank's micro batch. Make them agree: DataLoader(..., batch_size={wanted}), or set "
        f'train_micro_batch_size_per_gpu to "auto" (or {got}) in the DeepSpeed config'
    )


def check_checkpointable(obj: Any) -> None:
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(
            f"register_for_checkpointing needs objects with state_dict() and load_state_dict(); "
            f"{type(obj).__name__} has {'neither' if not hasattr(obj, 'state_dict') else 'not both'}"
        )


def save_model_arguments(args: tuple[Any, ...], models: Sequence[nn.Module]) -> tuple[nn.Module, Any]:
    """(model, directory) from ``save_model(save_directory)`` or ``save_model(model, save_directory)``."""
    if len(args) == 2 and isinstance(args[0], nn.Module):
        return args[0], args[1]
    if len(args) == 1 and len(models) == 1:
        return models[0], args[0]
    raise TypeError(
        f"use engine.save_model(save_directory) with one prepared model, or engine.save_model(model, "
        f"save_directory); got {len(args)} argument(s) with {len(models)} prepared model(s)"
    )


def check_train_step(
    optimizer_step: bool, drives_backward: bool, strategy: str, models: Sequence[Any], optimizers: Sequence[Any]
) -> None:
    if not optimizer_step and not drives_backward:
        raise ValueError(
            f"engine.train_step(optimizer_step=False) is for strategy='pipeline', where one call is a whole step; "
            f"under strategy={strategy!r} write engine.backward(loss) inside engine.accumulate() "
            "and step the optimizer yourself"
        )
    if len(models) != 1 or len(optimizers) != 1:
        raise RuntimeError(
            f"engine.train_step needs exactly one prepared model and one optimizer; got {len(models)} "
            f"model(s) and {len(optimizers)} optimizer(s) (write the loop with engine.backward instead)"
        )


def prepared_index(model: nn.Module | None, models: Sequence[nn.Module], unwrap: Any) -> int:
    """Which prepared model ``engine.load_model(path, model=...)`` means (the only one when ``model`` is None)."""
    if model is None:
        if len(models) != 1:
            raise TypeError(
                f"engine.load_model(path) needs one prepared model; {len(models)} are prepared: pass model="
            )
        model = models[0]
    model = as_prepared(model, models)
    index = next((i for i, m in enumerate(models) if model is m or model is unwrap(m)), None)
    if index is None:
        raise ValueError("engine.load_model(model=...) got a model that engine.prepare did not return")
    return index
