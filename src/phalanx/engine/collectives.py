"""The collectives a training script calls through the Engine, under Accelerate's names too.

    all_preds = engine.gather(preds)                 # every rank's tensors, concatenated in rank order
    preds = engine.gather_for_metrics(preds)         # the same, without the padding of the last batch
    engine.wait_for_everyone()                       # also engine.wait()
    engine.save(obj, "out/extra.safetensors")        # written once, by the main process

The Engine's methods of those names document them and call the functions here with its device, topology and
loaders.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from numbers import Number
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from phalanx.checkpoint.format import save_model_file
from phalanx.engine.data import ActiveLoaders
from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import REDUCE_OPS, all_gather_varlen, all_reduce
from phalanx.runtime.topology import Topology

__all__ = ["gather", "gather_for_metrics", "reduce_copy", "barrier", "first_then_rest", "share", "save_object"]


def gather(data: Any, device: torch.device) -> Any:
    """Every process's tensors in ``data`` (nested lists, tuples and dicts), concatenated along dim 0 in rank order."""
    if isinstance(data, torch.Tensor):
        # NCCL gathers device tensors only; CPU tensors travel through the engine's device.
        t = data.detach().to(device)
        return all_gather_varlen(t.reshape(1) if t.dim() == 0 else t)
    if isinstance(data, Mapping):
        return type(data)({k: gather(v, device) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
        return type(data)(*(gather(v, device) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(gather(v, device) for v in data)
    raise TypeError(
        f"engine.gather takes tensors, or lists, tuples and dicts of them; got {type(data).__name__} (make it a "
        "tensor, or gather a list of Python objects with engine.gather_for_metrics)"
    )


def gather_for_metrics(data: Any, device: torch.device, topology: Topology, loaders: ActiveLoaders) -> Any:
    """The data-parallel ranks' ``data`` in global sample order, without the padding of the last batch."""
    if isinstance(data, torch.Tensor):
        if topology.data_size == 1:  # its group is None then, which c10d reads as the whole world
            return data[: loaders.trim(data.shape[0])] if data.dim() else data
        # NCCL gathers device tensors only; CPU metrics travel through the engine's device.
        gathered = all_gather_varlen(data.to(device), group=topology.data_group)
        return gathered[: loaders.trim(gathered.shape[0])]
    if isinstance(data, Mapping):
        return type(data)({k: gather_for_metrics(v, device, topology, loaders) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, (list, tuple)) and data and all(isinstance(x, torch.Tensor) for x in data):
        return type(data)(gather_for_metrics(x, device, topology, loaders) for x in data)
    if isinstance(data, list):
        if topology.data_size == 1:
            return data
        parts: list[Any] = [None] * topology.data_size
        watched(dist.all_gather_object, parts, data, group=topology.data_group)
        flat = [x for part in parts for x in part]
        return flat[: loaders.trim(len(flat))]
    raise TypeError(f"gather_for_metrics takes tensors, or lists, tuples and dicts of them; got {type(data).__name__}")


def reduce_copy(tensor: torch.Tensor | Number, op: str, device: torch.device, group: Any) -> torch.Tensor:
    """A copy of ``tensor`` all-reduced over ``group`` with op in sum, mean, max, min."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; valid ops: {', '.join(REDUCE_OPS)}")
    t = torch.as_tensor(tensor, device=device).detach().clone()
    if op == "mean" and not t.is_floating_point():
        t = t.double()
    all_reduce(t, op, group=group)
    return t


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for without a process group)."""
    if dist.is_initialized():
        watched(dist.barrier)


@contextlib.contextmanager
def first_then_rest(leads: bool) -> Iterator[None]:
    """Run the block on the leaders first, then on the others. Every process meets one barrier: the others wait at
    it before the block, the leaders after it."""
    if not leads:
        barrier()
    try:
        yield
    finally:
        if leads:
            barrier()


def save_object(
    obj: Any, f: str | os.PathLike[str] | IO[bytes], safe_serialization: bool | None, is_main: bool
) -> None:
    """Accelerate's ``save``: safetensors for a dict of tensors to a ``.safetensors`` name (or when asked), else
    ``torch.save``; written by the main process, checked on every process."""
    is_path = isinstance(f, (str, os.PathLike))
    named_safetensors = is_path and os.fspath(f).endswith(".safetensors")  # type: ignore[arg-type]
    if safe_serialization is False and named_safetensors:
        raise ValueError(
            f"engine.save to {os.fspath(f)!r} (a .safetensors name) with safe_serialization=False would write a "  # type: ignore[arg-type]
            "pickle under a safetensors name; drop safe_serialization=False, or choose a name ending in .pt"
        )
    use_safetensors = bool(safe_serialization) or named_safetensors
    if use_safetensors:
        if not is_path:
            raise TypeError(f"safetensors writes to a path; engine.save got a {type(f).__name__} (pass a file name)")
        if not (
            isinstance(obj, Mapping) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
        ):
            raise TypeError(
                f"safetensors holds a dict of str -> tensor; engine.save got a {type(obj).__name__} for "
                f"{os.fspath(f)!r}{_first_odd_item(obj)} (save it to a name ending in .pt for torch.save, or "  # type: ignore[arg-type]
                "keep only the tensors)"
            )
    if not is_main:
        return
    if use_safetensors:
        save_model_file(dict(obj), Path(os.fspath(f)), {"format": "pt"})  # type: ignore[arg-type]
    else:
        torch.save(obj, f)


def _first_odd_item(obj: Any) -> str:
    if not isinstance(obj, Mapping):
        return ""
    for k, v in obj.items():
        if not (isinstance(k, str) and isinstance(v, torch.Tensor)):
            return f" whose item {k!r} is a {type(v).__name__}"
    return ""


def share(inputs: Any, rank: int, world: int, pad: bool) -> Any:
    """This rank's contiguous share of ``inputs`` (see ``Engine.split_between_processes``)."""
    if isinstance(inputs, dict):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                f"split_between_processes got a dict whose values differ in length ({sorted(lengths)}): "
                "every value must have one entry per item"
            )
        return {k: share(v, rank, world, pad) for k, v in inputs.items()}
    if not hasattr(inputs, "__len__") or not hasattr(inputs, "__getitem__"):
        raise TypeError(
            f"split_between_processes needs a list, tuple, tensor or dict of them; got {type(inputs).__name__}"
        )
    n = len(inputs)
    per, extra = divmod(n, world)
    start = rank * per + min(rank, extra)
    part = inputs[start : start + per + (1 if rank < extra else 0)]
    if pad and extra and rank >= extra and n:
        last = part[-1:] if len(part) else inputs[-1:]  # its own last item, as Accelerate pads a list
        part = torch.cat([part, last]) if isinstance(part, torch.Tensor) else part + type(part)(last)
    return part
