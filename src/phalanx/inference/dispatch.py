"""Run a model placed by a device map: weights on GPUs stay there; weights on disk (and, when a GPU computes, weights
in host memory) are brought to the module's execution device just before its forward and released after it.

    with phalanx.init_empty_weights():
        model = build_model()
    model = phalanx.load_and_dispatch(model, "weights/", max_memory={"cpu": "60MB"}, no_split_module_classes=["Block"])
    model(x)                                  # model.hf_device_map says where each part lives

Disk weights are read straight from the safetensors files they came from (or, for ``dispatch`` of a model already in
memory, from files written once to ``offload_dir``), by their offsets, into fresh tensors: nothing is pickled or
memory-mapped into the process, so the resident memory holds the placed weights plus the module being run. While one
module computes, a background thread reads the next one's weights (the order of the first forward is recorded).
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.checkpoint.shards import StateReader, read_into, read_new
from phalanx.inference.plan import DispatchError, plan_device_map

__all__ = ["dispatch", "load_and_dispatch"]


def _place_of(name: str, device_map: Mapping[str, Any]) -> Any:
    """The map's entry for tensor ``name``: the longest key that is the name or one of its parents."""
    best, where = -1, None
    for key, device in device_map.items():
        if key == "" or name == key or name.startswith(key + "."):
            if len(key) > best:
                best, where = len(key), device
    if where is None:
        raise DispatchError(f"the device map does not place {name}")
    return where


def _device(place: Any) -> torch.device:
    if isinstance(place, int):
        return torch.device("cuda", place)
    return torch.device(place) if place not in ("disk",) else torch.device("cpu")


class _Tensors:
    """Each tensor of the model by its first name: every (module, attribute) that holds it (tied weights: several),
    whether it is a parameter, and where it lives."""

    def __init__(self, model: nn.Module) -> None:
        self.holders: dict[str, list[tuple[nn.Module, str]]] = {}
        self.names_of: dict[str, list[str]] = {}  # first name -> every full name (a tied weight has several)
        self.by_holder: dict[tuple[int, str], str] = {}  # (id of a module, attribute) -> first name
        self.is_param: dict[str, bool] = {}
        self.persistent: set[str] = set()
        first: dict[int, str] = {}
        for mod_name, module in model.named_modules(remove_duplicate=False):
            prefix = mod_name + "." if mod_name else ""
            for attr, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is None:
                    continue
                name = first.setdefault(id(t), prefix + attr)
                self.names_of.setdefault(name, []).append(prefix + attr)
                self.by_holder[(id(module), attr)] = name
                holders = self.holders.setdefault(name, [])
                if (module, attr) not in holders:
                    holders.append((module, attr))
                self.is_param[name] = attr in module._parameters
                if attr not in getattr(module, "_non_persistent_buffers_set", set()):
                    self.persistent.add(prefix + attr)
        self.first = first

    def get(self, name: str) -> torch.Tensor:
        module, attr = self.holders[name][0]
        t = module._parameters.get(attr) if self.is_param[name] else module._buffers.get(attr)
        assert t is not None
        return t

    def set(self, name: str, value: torch.Tensor) -> None:
        new: torch.Tensor = nn.Parameter(value, requires_grad=False) if self.is_param[name] else value
        for module, attr in self.holders[name]:
            if self.is_param[name]:
                module._parameters[attr] = new  # type: ignore[assignment]
            else:
                module._buffers[attr] = new


class _Streamer:
    """Brings the weights of hooked modules in and out, and reads the next module's while the current one runs."""

    def __init__(self, tensors: _Tensors, reader: StateReader | None, dtype: torch.dtype | None) -> None:
        self.tensors, self.reader, self.dtype = tensors, reader, dtype
        self.host: dict[str, torch.Tensor] = {}
        """Weights kept in host memory and copied to the GPU for each forward (a GPU computes, the map says cpu)."""
        self.workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phalanx-prefetch")
        self.pending: dict[int, Future[dict[str, torch.Tensor]]] = {}
        self.order: list[int] = []  # modules by id, in the order of the first forward
        self.lock = threading.Lock()
        self.meta: dict[str, torch.Tensor] = {}
        self.pool: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    def _read(self, names: Sequence[str], device: torch.device) -> dict[str, torch.Tensor]:
        # Ordinary tensors, never inference tensors: the buffers move between threads, and inference mode is a
        # property of the thread that made them.
        with torch.inference_mode(False):
            return self._read_plain(names, device)

    def _read_plain(self, names: Sequence[str], device: torch.device) -> dict[str, torch.Tensor]:
        """Read ``names`` into host buffers (reused from released modules of the same shapes, so that streaming
        allocates nothing after the first pass and the process does not grow), then to ``device``."""
        out = {}
        for n in names:
            if n in self.host:
                out[n] = self.host[n].to(device)
                continue
            assert self.reader is not None
            shape = tuple(self.reader.shape("model/" + n))
            dtype = self._dtype_for(n) or self.reader.dtype("model/" + n)  # type: ignore[attr-defined]
            with self.lock:
                free = self.pool.get((shape, dtype))
                buf = free.pop() if free else None
            if buf is None:
                buf = torch.empty(shape, dtype=dtype)
            read_into(self.reader, "model/" + n, 0, buf.numel(), buf.view(-1))
            if device.type != "cpu":  # a synchronous copy: the host buffer is reused once this returns
                gpu = buf.to(device)
                with self.lock:
                    self.pool.setdefault((shape, dtype), []).append(buf)
                buf = gpu
            out[n] = buf
        return out

    def _dtype_for(self, name: str) -> torch.dtype | None:
        assert self.reader is not None
        saved = self.reader.dtype("model/" + name) if hasattr(self.reader, "dtype") else None  # type: ignore[attr-defined]
        if self.dtype is not None and saved is not None and saved.is_floating_point:
            return self.dtype
        return None

    def bring(
        self, key: int, names: Sequence[str], device: torch.device, next_up: tuple[int, Sequence[str]] | None
    ) -> None:
        future = self.pending.pop(key, None)
        values = future.result() if future is not None else self._read(names, device)
        for n, v in values.items():
            self.meta.setdefault(n, self.tensors.get(n))
            self.tensors.set(n, v)
        if next_up is not None and next_up[0] not in self.pending:
            self.pending[next_up[0]] = self.workers.submit(self._read, next_up[1], device)

    def release(self, names: Sequence[str]) -> None:
        # A buffer is reused only where nothing can still refer to it: no autograd graph records weights under
        # inference_mode or no_grad.
        reuse = torch.is_inference_mode_enabled() or not torch.is_grad_enabled()
        for n in names:
            t = self.tensors.get(n)
            self.tensors.set(n, self.meta[n])
            if reuse and t.device.type == "cpu" and not t.is_meta:
                with self.lock:
                    self.pool.setdefault((tuple(t.shape), t.dtype), []).append(t.data)


def _needs_move(obj: Any, device: torch.device) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device != device and not obj.is_meta
    if isinstance(obj, (list, tuple)):
        return any(_needs_move(o, device) for o in obj)
    if isinstance(obj, Mapping):
        return any(_needs_move(v, device) for v in obj.values())
    return False


def _move(obj: Any, device: torch.device) -> Any:
    """Tensors in ``obj`` (nested lists, tuples, named tuples, dicts, a transformers ModelOutput) moved to ``device``;
    ``obj`` itself when nothing has to move."""
    if not _needs_move(obj, device):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        moved = [_move(o, device) for o in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    out = copy.copy(obj)  # keeps the mapping's own class (a ModelOutput)
    for k, v in obj.items():
        out[k] = _move(v, device)
    return out


def _attach(
    model: nn.Module, device_map: Mapping[str, Any], tensors: _Tensors, streamer: _Streamer | None, main: torch.device
) -> None:
    """Hooks on every module that holds streamed tensors of its own (disk ones; host ones too when a GPU computes),
    on every part placed on a GPU (its inputs go there), and on the model (outputs come back)."""
    streaming = ("disk", "cpu") if main.type == "cuda" else ("disk",)
    streamed = {n for n in tensors.holders if _place_of(n, device_map) in streaming}
    hooked: list[tuple[int, list[str]]] = []
    for module in model.modules():
        own = [
            n
            for attr in [*module._parameters, *module._buffers]
            if (n := tensors.by_holder.get((id(module), attr))) is not None and n in streamed
        ]
        if own and streamer is not None:
            hooked.append((id(module), own))
            _hook_streamed(module, own, streamer, main, hooked)
    modules = dict(model.named_modules())
    for key, place in device_map.items():
        if isinstance(place, int) and key in modules:
            device = torch.device("cuda", place)
            modules[key].register_forward_pre_hook(
                lambda mod, args, kwargs, device=device: (_move(args, device), _move(kwargs, device)), with_kwargs=True
            )
    _hook_root(model)


def _hook_streamed(
    module: nn.Module, own: list[str], streamer: _Streamer, device: torch.device, hooked: list[tuple[int, list[str]]]
) -> None:
    key = id(module)

    def pre(mod: nn.Module, args: Any, kwargs: Any) -> Any:
        if key not in streamer.order:
            streamer.order.append(key)
        nxt = None
        order = streamer.order if len(streamer.order) == len(hooked) else [k for k, _ in hooked]
        i = order.index(key) if key in order else -1
        if 0 <= i < len(order) - 1:
            nxt_key = order[i + 1]
            nxt = (nxt_key, next(names for k, names in hooked if k == nxt_key))
        streamer.bring(key, own, device, nxt)
        return _move(args, device), _move(kwargs, device)

    def post(mod: nn.Module, args: Any, output: Any) -> Any:
        streamer.release(own)
        return output

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post)


def _hook_root(model: nn.Module) -> None:
    """The model's outputs come back to the device its first input came from (Accelerate's io_same_device)."""
    state: dict[str, torch.device | None] = {"device": None}

    def pre(mod: nn.Module, args: Any, kwargs: Any) -> None:
        first = next((a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), None)
        state["device"] = first.device if first is not None else None

    def post(mod: nn.Module, args: Any, output: Any) -> Any:
        return _move(output, state["device"]) if state["device"] is not None else output

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post)


def _open(checkpoint: str | os.PathLike[str], tensors: _Tensors) -> StateReader:
    from phalanx.checkpoint.format import MANIFEST
    from phalanx.checkpoint.model_files import open_weights
    from phalanx.checkpoint.read import Checkpoint

    path = Path(checkpoint).expanduser()
    if (path / MANIFEST).is_file():
        return Checkpoint(path).reader(0)
    stored = {full: first for first, fulls in tensors.names_of.items() for full in fulls if full in tensors.persistent}
    buffers = {n: tensors.get(n) for n in tensors.holders if not tensors.is_param[n]}
    reader, missing, _ = open_weights(path, stored, buffers, tensors.persistent)
    if missing:
        raise DispatchError(f"{path} lacks {len(missing)} weight(s) the model has: {', '.join(missing[:5])}")
    return reader


def load_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: str | Mapping[str, Any] = "auto",
    max_memory: Mapping[Any, Any] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Fill ``model`` (built under ``init_empty_weights``, or real) from ``checkpoint`` part by part and place it:
    placed weights are read onto their device, disk weights stay in the checkpoint's files and are read at each
    forward. ``checkpoint``: a phalanx checkpoint directory, a ``.safetensors`` file, or a directory of safetensors
    shards with ``model.safetensors.index.json``."""
    plan = plan_device_map(model, device_map, max_memory, no_split_module_classes, dtype, offload=True)
    tensors = _Tensors(model)
    reader = _open(checkpoint, tensors)
    main = _main_device(plan)
    for name in tensors.holders:
        place = _place_of(name, plan)
        if place == "disk":
            if not tensors.get(name).is_meta:
                tensors.set(name, tensors.get(name).to("meta"))
            continue
        saved = reader.dtype("model/" + name) if hasattr(reader, "dtype") else None  # type: ignore[attr-defined]
        want = dtype if dtype is not None and saved is not None and saved.is_floating_point else None
        tensors.set(name, read_new(reader, "model/" + name, _device(place), want))
    streamer = _Streamer(tensors, reader, dtype)
    _keep_on_host(streamer, tensors, plan, main)
    _attach(model, plan, tensors, streamer, main)
    model.hf_device_map = dict(plan)  # type: ignore[assignment]
    model._phalanx_streamer = streamer  # type: ignore[assignment]  # keeps the reader and the prefetch thread alive
    return model


def _keep_on_host(streamer: _Streamer, tensors: _Tensors, plan: Mapping[str, Any], main: torch.device) -> None:
    """When a GPU computes, the weights the map puts on "cpu" stay in (pinned) host memory and are copied to the GPU
    for each forward, as Accelerate's CPU offload does."""
    if main.type != "cuda":
        return
    for name in tensors.holders:
        if _place_of(name, plan) == "cpu":
            host = tensors.get(name).detach()
            host = host.pin_memory() if not host.is_pinned() else host
            tensors.set(name, host)
            streamer.host[name] = host


def _main_device(plan: Mapping[str, Any]) -> torch.device:
    gpus = sorted(d for d in plan.values() if isinstance(d, int))
    return torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")


def dispatch(
    model: nn.Module,
    device_map: str | Mapping[str, Any] = "auto",
    max_memory: Mapping[Any, Any] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Place a model whose weights are in memory: GPU parts move there, disk parts are written once to
    ``offload_dir`` (safetensors) and released, then read back at each forward."""
    from safetensors.torch import save_file

    plan = plan_device_map(
        model, device_map, max_memory, no_split_module_classes, dtype, offload=offload_dir is not None
    )
    tensors = _Tensors(model)
    on_disk = [n for n in tensors.holders if _place_of(n, plan) == "disk"]
    if on_disk and offload_dir is None:
        raise DispatchError(
            f"the device map puts {len(on_disk)} tensor(s) on disk ({on_disk[0]}, ...): pass "
            "offload_dir=... for their files"
        )
    if on_disk:
        assert offload_dir is not None
        directory = Path(offload_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "offloaded.safetensors"
        save_file(
            {n: tensors.get(n).detach().to(dtype or tensors.get(n).dtype).contiguous().cpu() for n in on_disk}, path
        )
        for n in on_disk:
            tensors.set(n, tensors.get(n).to("meta"))
    main = _main_device(plan)
    for name in tensors.holders:
        place = _place_of(name, plan)
        if place not in ("disk", "cpu"):
            tensors.set(
                name,
                tensors.get(name)
                .detach()
                .to(_device(place), dtype=dtype if tensors.get(name).is_floating_point() else None),
            )
    streamer = None
    if on_disk or main.type == "cuda":
        from phalanx.checkpoint.model_files import open_weights

        reader = None
        if on_disk:
            where = Path(offload_dir) / "offloaded.safetensors"  # type: ignore[arg-type]
            reader, _, _ = open_weights(where, {n: n for n in on_disk}, {}, set(on_disk))
        streamer = _Streamer(tensors, reader, None)
        _keep_on_host(streamer, tensors, plan, main)
    _attach(model, plan, tensors, streamer, main)
    model.hf_device_map = dict(plan)  # type: ignore[assignment]
    model._phalanx_streamer = streamer  # type: ignore[assignment]
    return model
