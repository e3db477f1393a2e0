"""``accelerate.utils`` operations and helpers that training scripts call, with Accelerate's meaning, on c10d.

    from phalanx.accelerate.utils import gather_object, pad_across_processes, tqdm
    from phalanx.accelerate import get_logger           # was: from accelerate.logging import get_logger

Each collective here must be called by every process, as in Accelerate.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from phalanx.engine.data import map_tensors, move_to_device
from phalanx.runtime.collective_log import watched

__all__ = [
    "pad_across_processes", "gather_object", "broadcast_object_list", "send_to_device", "release_memory",
    "find_executable_batch_size", "tqdm", "get_logger", "MultiProcessAdapter",
]  # fmt: skip


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad every tensor in ``tensor`` (nested lists, tuples and dicts) along ``dim`` to the largest size any process
    holds, with ``pad_index``, at the end (or the start with ``pad_first``), so that they can be gathered."""

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or not -t.dim() <= dim < t.dim():
            return t  # Accelerate leaves a tensor without that dimension as it is
        d = dim % t.dim()
        size = torch.tensor([t.shape[d]], dtype=torch.int64, device=t.device)  # NCCL reduces device tensors only
        if dist.is_initialized() and dist.get_world_size() > 1:
            watched(dist.all_reduce, size, op=dist.ReduceOp.MAX, label="pad_across_processes")
        longest = int(size)
        if longest == t.shape[d]:
            return t
        shape = list(t.shape)
        shape[d] = longest
        out = t.new_full(shape, pad_index)
        index = [slice(None)] * t.dim()
        index[d] = slice(longest - t.shape[d], longest) if pad_first else slice(0, t.shape[d])
        out[tuple(index)] = t
        return out

    return map_tensors(tensor, pad)


def gather_object(obj: Any) -> list[Any]:
    """Every process's list ``obj``, concatenated in process order (Accelerate's ``gather_object``: any picklable
    items)."""
    if not isinstance(obj, (list, tuple)):
        raise TypeError(
            f"gather_object takes a list (or tuple) of picklable objects from each process; got a "
            f"{type(obj).__name__} (wrap it: gather_object([obj]))"
        )
    rank, world = _world()
    if world == 1:
        return list(obj)
    everyone: list[Any] = [None] * world
    watched(dist.all_gather_object, everyone, list(obj))
    return [item for part in everyone for item in part]


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Process ``from_process``'s ``object_list``, in place on every process (and returned)."""
    if not isinstance(object_list, list):
        raise TypeError(f"broadcast_object_list takes a list; got a {type(object_list).__name__}")
    rank, world = _world()
    if world > 1:
        if not 0 <= from_process < world:
            raise ValueError(f"broadcast_object_list: from_process={from_process} is not a process of 0..{world - 1}")
        watched(dist.broadcast_object_list, object_list, src=from_process)
    return object_list


def send_to_device(
    tensor: Any, device: torch.device | str, non_blocking: bool = False, skip_keys: list[str] | str | None = None
) -> Any:
    """Every tensor in ``tensor`` on ``device`` (the keys ``skip_keys`` of a dict stay where they are)."""
    if isinstance(tensor, Mapping) and skip_keys:
        skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys)
        return type(tensor)(  # type: ignore[call-arg]
            {k: v if k in skip else send_to_device(v, device, non_blocking) for k, v in tensor.items()}
        )
    return move_to_device(tensor, torch.device(device), non_blocking)


def release_memory(*objects: Any) -> list[None]:
    """``a, b = release_memory(a, b)``: drop the references, collect garbage and empty the CUDA cache."""
    count = len(objects)
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [None] * count


_OOM = ("CUDA out of memory.", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.", "DefaultCPUAllocator: can't allocate memory")


def _out_of_memory(e: BaseException) -> bool:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and len(e.args) == 1 and any(s in str(e.args[0]) for s in _OOM)


def find_executable_batch_size(
    function: Callable[..., Any] | None = None, starting_batch_size: int = 128, reduce_batch_size_fn: Any = None
) -> Any:
    """Decorator: call ``function(batch_size, ...)`` from ``starting_batch_size``, and again with 90% of it after an
    out-of-memory error, until it runs (Accelerate's rule); a batch size of 0 raises."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    reduce = reduce_batch_size_fn or (lambda size: int(size * 0.9))

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        batch_size = starting_batch_size
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            raise TypeError(
                f"find_executable_batch_size passes the batch size as the first argument of {function.__name__}; "
                f"call it without that argument: {function.__name__}({', '.join(params[1:])})"
            )
        while True:
            if batch_size == 0:
                raise RuntimeError("find_executable_batch_size: no batch size ran (out of memory down to 0)")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:
                if not _out_of_memory(e):
                    raise
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                batch_size = reduce(batch_size)

    return run


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm``, shown on the main process only (unless ``main_process_only=False``)."""
    from tqdm.auto import tqdm as _tqdm

    if main_process_only and _world()[0] != 0:
        kwargs["disable"] = True
    return _tqdm(*args, **kwargs)


class MultiProcessAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Accelerate's logger: ``logger.info(msg, main_process_only=True)`` logs on the main process only, and
    ``in_order=True`` on every process, one after another."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        rank, world = _world()
        if main_only and not in_order:
            if rank == 0:
                message, extra = self.process(msg, kwargs)
                self.logger.log(level, message, *args, **extra)
            return
        for turn in range(world if in_order else 1):
            if not in_order or turn == rank:
                message, extra = self.process(msg, kwargs)
                self.logger.log(level, message, *args, **extra)
            if in_order and world > 1:
                watched(dist.barrier)

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        key = (args, tuple(sorted(kwargs.items())))
        said: set[Any] = self.__dict__.setdefault("_said", set())
        if key not in said:
            said.add(key)
            self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """Accelerate's ``get_logger``: a standard logger by ``name`` (at ``log_level``) whose calls take
    ``main_process_only`` and ``in_order``."""
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logger.root.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
