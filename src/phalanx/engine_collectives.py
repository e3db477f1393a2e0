"""The Engine's view of the world and the collectives a training script calls, under Accelerate's names too.

    engine.num_processes, engine.process_index, engine.is_main_process   # also world_size, rank
    all_preds = engine.gather(preds)                 # every rank's tensors, concatenated in rank order
    preds = engine.gather_for_metrics(preds)         # the same, without the padding of the last batch
    engine.wait_for_everyone()                       # also engine.wait()
    engine.save(obj, "out/extra.safetensors")        # written once, by the main process

:class:`EngineCollectives` is mixed into :class:`phalanx.Engine`; it reads the Engine's ``world``, ``topology``,
``device`` and ``_loaders``.
"""

from __future__ import annotations

import contextlib
import os
from numbers import Number
from pathlib import Path
from typing import IO, Any, Iterator, Mapping

import torch
import torch.distributed as dist

from phalanx.collective_log import watched
from phalanx.checkpoint_io import save_model_file
from phalanx.comm import REDUCE_OPS, all_gather_varlen, all_reduce
from phalanx.data import ActiveLoaders
from phalanx.runtime import WorldInfo
from phalanx.topology import Topology

__all__ = ["EngineCollectives"]


class EngineCollectives:
    """Who this process is, and the collectives between processes (mixed into the Engine)."""

    world: WorldInfo
    topology: Topology
    device: torch.device
    """Where prepared models and batches live (Accelerate's ``accelerator.device``)."""
    _loaders: ActiveLoaders

    # ------------------------------------------------------------------ world
    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def local_rank(self) -> int:
        return self.world.local_rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def num_processes(self) -> int:
        """Accelerate's name for ``world_size``: the number of processes in the job."""
        return self.world.world_size

    @property
    def process_index(self) -> int:
        """Accelerate's name for ``rank``: this process's index in the job."""
        return self.world.rank

    @property
    def local_process_index(self) -> int:
        """Accelerate's name for ``local_rank``: this process's index on its machine."""
        return self.world.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.world.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on the first process of each machine."""
        return self.world.local_rank == 0

    # ------------------------------------------------------------ collectives
    def gather(self, data: Any) -> Any:
        """Accelerate's ``gather``: every process's tensors, concatenated along dim 0 in rank order.

        Takes a tensor or nested lists, tuples and dicts of tensors, and returns the same structure. A 0-d tensor
        becomes 1-d (one item per process). The first dimension may differ between processes; the others and the
        dtype must agree. Nothing is dropped: after a pass over a prepared DataLoader the padding that evened out
        the last batch is still there (``gather_for_metrics`` drops it). Every process must call it.
        """
        if isinstance(data, torch.Tensor):
            # NCCL gathers device tensors only; CPU tensors travel through the engine's device.
            t = data.detach().to(self.device)
            return all_gather_varlen(t.reshape(1) if t.dim() == 0 else t)
        if isinstance(data, Mapping):
            return type(data)({k: self.gather(v) for k, v in data.items()})  # type: ignore[call-arg]
        if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
            return type(data)(*(self.gather(v) for v in data))
        if isinstance(data, (list, tuple)):
            return type(data)(self.gather(v) for v in data)
        raise TypeError(
            f"engine.gather takes tensors, or lists, tuples and dicts of them; got {type(data).__name__} (make it a "
            "tensor, or gather a list of Python objects with engine.gather_for_metrics)"
        )

    def gather_for_metrics(self, data: Any) -> Any:
        """Gather tensors (or nested lists/dicts/tuples of them) from every rank, in global sample order.

        The padding that evened out the last batch is dropped, so a pass over a prepared DataLoader gives
        exactly ``len(dataset)`` items, each once.
        """
        if isinstance(data, torch.Tensor):
            # NCCL gathers device tensors only; CPU metrics travel through the engine's device.
            gathered = all_gather_varlen(data.to(self.device), group=self.topology.dp_group)
            return gathered[: self._loaders.trim(gathered.shape[0])]
        if isinstance(data, Mapping):
            return type(data)({k: self.gather_for_metrics(v) for k, v in data.items()})  # type: ignore[call-arg]
        if isinstance(data, (list, tuple)) and data and all(isinstance(x, torch.Tensor) for x in data):
            return type(data)(self.gather_for_metrics(x) for x in data)
        if isinstance(data, list):
            if self.topology.dp_size == 1:
                return data
            parts: list[Any] = [None] * self.topology.dp_size
            watched(dist.all_gather_object, parts, data, group=self.topology.dp_group)
            flat = [x for part in parts for x in part]
            return flat[: self._loaders.trim(len(flat))]
        raise TypeError(
            f"gather_for_metrics takes tensors, or lists, tuples and dicts of them; got {type(data).__name__}"
        )

    def reduce(self, tensor: torch.Tensor | Number, op: str = "mean") -> torch.Tensor:
        """All-reduce a copy of ``tensor`` over the data-parallel ranks with op in sum, mean, max, min."""
        if op not in REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; valid ops: {', '.join(REDUCE_OPS)}")
        t = torch.as_tensor(tensor, device=self.device).detach().clone()
        if op == "mean" and not t.is_floating_point():
            t = t.double()
        all_reduce(t, op, group=self.topology.dp_group)
        return t

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def wait(self) -> None:
        """Wait until every rank gets here."""
        if dist.is_initialized():
            watched(dist.barrier)

    def wait_for_everyone(self) -> None:
        """Accelerate's name for ``wait``: return once every process has called it."""
        self.wait()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on rank 0 first (e.g. to download or cache data), then on the other ranks."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the block on the first process of each machine first, then on the others (e.g. to fill a cache on
        each machine's local disk)."""
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's share of ``inputs`` (a list, tuple, tensor or dict of them), for data-parallel inference,
        as Accelerate's: contiguous pieces in rank order, the first ``len % world`` ranks one item more. With
        ``apply_padding`` every rank gets the same count (its last item repeated), so that ``gather`` lines up;
        drop the padding from the gathered result (``gather_for_metrics`` does it for a prepared loader)."""
        yield _share(inputs, self.world.rank, self.world.world_size, apply_padding)

    @contextlib.contextmanager
    def _first(self, leads: bool) -> Iterator[None]:
        # Every process meets one barrier: the others wait at it before the block, the leaders after it.
        if not leads:
            self.wait()
        try:
            yield
        finally:
            if leads:
                self.wait()

    # ------------------------------------------------------------------ files
    def save(self, obj: Any, f: str | os.PathLike[str] | IO[bytes], safe_serialization: bool | None = None) -> None:
        """Accelerate's ``save``: write ``obj`` to ``f`` on the main process only, in place of ``torch.save``.

        A dict of tensors to a path ending in ``.safetensors`` (or with ``safe_serialization=True``) is written with
        safetensors, with the metadata ``{"format": "pt"}``; anything else goes through ``torch.save``, a pickle,
        as under Accelerate (load it with ``torch.load(f, weights_only=False)`` when it holds more than tensors).
        No barrier: the other processes return at once, so call ``engine.wait_for_everyone()`` before they read it.
        For a prepared model's weights use ``engine.save_model`` (or ``engine.get_state_dict`` on every rank):
        under zero3 no rank holds them whole.
        """
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
            if not (isinstance(obj, Mapping) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())):
                raise TypeError(
                    f"safetensors holds a dict of str -> tensor; engine.save got a {type(obj).__name__} for "
                    f"{os.fspath(f)!r}{_first_odd_item(obj)} (save it to a name ending in .pt for torch.save, or "  # type: ignore[arg-type]
                    "keep only the tensors)"
                )
        if not self.is_main_process:
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


def _share(inputs: Any, rank: int, world: int, pad: bool) -> Any:
    if isinstance(inputs, dict):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(f"split_between_processes got a dict whose values differ in length ({sorted(lengths)}): "
                             "every value must have one entry per item")  # fmt: skip
        return {k: _share(v, rank, world, pad) for k, v in inputs.items()}
    if not hasattr(inputs, "__len__") or not hasattr(inputs, "__getitem__"):
        raise TypeError(f"split_between_processes needs a list, tuple, tensor or dict of them; got {type(inputs).__name__}")
    n = len(inputs)
    per, extra = divmod(n, world)
    start = rank * per + min(rank, extra)
    part = inputs[start : start + per + (1 if rank < extra else 0)]
    if pad and extra and rank >= extra and n:
        last = part[-1:] if len(part) else inputs[-1:]  # its own last item, as Accelerate pads a list
        part = torch.cat([part, last]) if isinstance(part, torch.Tensor) else part + type(part)(last)
    return part
