"""Where each part of a model goes, by memory: GPUs in order, then host memory, then disk.

    with phalanx.init_empty_weights():
        model = build_model()                      # parameters on the meta device: nothing allocated
    device_map = plan_device_map(model, max_memory={"cpu": "60MB"}, no_split_module_classes=["Block"])
    # {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "disk", ..., "head": "disk"}

A device map names modules (or single parameters and buffers) and their place: a GPU index, ``"cpu"`` or ``"disk"``,
as Accelerate's ``infer_auto_device_map`` does, so that maps written for Accelerate work here. The planner walks the
model in order and puts each part on the first device with room left; a part that does not fit is split into its
children, unless its class is in ``no_split_module_classes`` (by default a transformers model's
``_no_split_modules``), and then goes to the next device. Tied parameters are counted once and kept with the first
part that holds them. Every error names the part, its size and the budget.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["parse_bytes", "plan_device_map", "check_device_map", "init_empty_weights", "DispatchError", "fmt_bytes"]


class DispatchError(ValueError):
    """A device map or a memory budget that cannot work: the message names the module, its size and the fix."""


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | float | str) -> int:
    """``10GiB``, ``500MB``, ``1.5 GB``, ``123`` -> bytes. GB is 10**9 and GiB 2**30, as in Accelerate."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise DispatchError(f"a memory size must be 0 or more bytes; got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise DispatchError(
            f"cannot read the memory size {value!r}: use bytes or a number with a unit such as "
            "'500MB', '10GiB' (KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB of 1024)"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Build a model without allocating its weights: parameters (and, with ``include_buffers``, buffers) are created
    on the meta device. ``phalanx.load_and_dispatch`` then fills them from a checkpoint, part by part."""
    meta = torch.device("meta")
    old_param = nn.Module.register_parameter
    old_buffer = nn.Module.register_buffer

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        old_param(module, name, param)
        if param is not None and not param.is_meta:
            kwargs = {"requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to(meta), **kwargs)  # type: ignore[call-arg]

    def register_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        old_buffer(module, name, tensor.to(meta) if tensor is not None else None, persistent=persistent)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    if include_buffers:
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = old_param  # type: ignore[method-assign,assignment]
        nn.Module.register_buffer = old_buffer  # type: ignore[method-assign,assignment]


def _nbytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    size = (
        t.element_size() if dtype is None or not t.is_floating_point() else torch.empty(0, dtype=dtype).element_size()
    )
    return t.numel() * size


def _tensors(module: nn.Module, recurse: bool) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=recurse, remove_duplicate=False)
    yield from module.named_buffers(recurse=recurse, remove_duplicate=False)


GPU_HEADROOM = 0.1
"""The share of a GPU's free memory that an automatic device map leaves free (Accelerate keeps room too)."""


def _devices(max_memory: Mapping[Any, Any] | None, offload: bool) -> dict[Any, int]:
    """The devices in placement order with their budgets: GPUs, the host, and disk (no budget) when offloading."""
    given = {
        (int(k) if isinstance(k, str) and k.isdigit() else k): parse_bytes(v) for k, v in (max_memory or {}).items()
    }
    unknown = [k for k in given if not (isinstance(k, int) or k in ("cpu", "disk") or str(k).startswith("cuda"))]
    if unknown:
        raise DispatchError(
            f"max_memory has unknown device(s) {unknown}: use GPU indices (0, 1, ...), 'cpu' and 'disk'"
        )
    given = {(int(str(k).split(":")[1]) if str(k).startswith("cuda:") else k): v for k, v in given.items()}
    out: dict[Any, int] = {}
    for i in range(torch.cuda.device_count()):
        if i in given or max_memory is None:
            # A GPU not given a budget keeps GPU_HEADROOM of its free memory for the forward's activations and
            # the allocator's rounding: filled to the last byte with weights, the first forward runs out of memory.
            out[i] = given[i] if i in given else int(torch.cuda.mem_get_info(i)[0] * (1 - GPU_HEADROOM))
    out["cpu"] = given.get("cpu", _host_available())
    if offload:
        out["disk"] = given.get("disk", 2**62)
    return out


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_no_split(model: nn.Module) -> list[str]:
    """A transformers model's ``_no_split_modules`` (its decoder layers), as Accelerate's "auto" uses them."""
    names = getattr(model, "_no_split_modules", None) or []
    return [n for n in names if isinstance(n, str)]


def plan_device_map(
    model: nn.Module,
    device_map: str | Mapping[str, Any] = "auto",
    max_memory: Mapping[Any, Any] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
    offload: bool = True,
) -> dict[str, Any]:
    """The device map for ``model`` ("auto", "sequential", "balanced" or a dict, which is checked and returned)."""
    if isinstance(device_map, Mapping):
        check_device_map(model, device_map)
        return dict(device_map)
    if device_map not in ("auto", "sequential", "balanced"):
        raise DispatchError(
            f"device_map={device_map!r}: use 'auto', 'balanced', 'sequential' or a dict of module names"
        )
    no_split = set(no_split_module_classes if no_split_module_classes is not None else default_no_split(model))
    budgets = _devices(max_memory, offload)
    gpus = [d for d in budgets if isinstance(d, int)]
    seen: dict[int, str] = {}  # storage of a tensor already counted -> the part that holds it (tied weights)
    sizes = _part_sizes(model, dtype)
    if device_map == "balanced" and len(gpus) > 1:
        total = sizes[""]
        for g in gpus:
            budgets[g] = min(budgets[g], -(-total // len(gpus)) + max(_largest_unsplit(model, no_split, sizes), 0))
    order = list(budgets)
    placed: dict[str, Any] = {}
    left = dict(budgets)
    if offload and sizes[""] > sum(b for d, b in budgets.items() if d != "disk"):
        # Parts will stream from disk: the execution device holds the one running and the next one being read, so
        # their room comes out of its budget (max_memory then bounds every weight in memory, streamed ones too).
        run_on = gpus[0] if gpus else "cpu"
        leaf_name, leaf = _largest_leaf(model, dtype)
        if 2 * leaf > left[run_on]:
            raise DispatchError(
                f"max_memory[{run_on!r}]={fmt_bytes(left[run_on])} is too small to run the model from disk: "
                f"its largest layer, {leaf_name or 'the model'} ({fmt_bytes(leaf)}), is brought in for its forward "
                f"while the next one is read, so at least {fmt_bytes(2 * leaf)} ({2 * leaf} bytes) are needed there"
            )
        left[run_on] -= 2 * leaf
    queue: list[tuple[str, Any]] = _children_of("", model)
    d = 0
    while queue:
        name, part = queue.pop(0)
        size = _size_unseen(name, part, dtype, seen)
        tied_to = _tied_device(name, part, seen, placed)
        if tied_to is not None and size <= left[tied_to]:  # with the part that holds its tied weight
            placed[name] = tied_to
            left[tied_to] -= size
            _mark(name, part, seen)
            continue
        while d < len(order) and size > left[order[d]]:
            splittable = isinstance(part, nn.Module) and type(part).__name__ not in no_split and _has_children(part)
            if splittable:
                break
            d += 1
        if d == len(order):
            raise _does_not_fit(name, part, size, budgets, offload)
        if size > left[order[d]]:  # splittable and too big here: place its children instead
            queue = _children_of(name, part) + queue
            continue
        placed[name] = order[d]
        left[order[d]] -= size
        _mark(name, part, seen)
    return _merge(placed, model)


def _part_sizes(model: nn.Module, dtype: torch.dtype | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, module in model.named_modules():
        out[name] = sum(_nbytes(t, dtype) for _, t in module.named_parameters()) + sum(
            _nbytes(t, dtype) for _, t in module.named_buffers()
        )
    return out


def _largest_leaf(model: nn.Module, dtype: torch.dtype | None) -> tuple[str, int]:
    """The module that holds the most bytes itself (not counting its children), and how many: what one streamed
    forward brings in."""
    sizes = [(n, sum(_nbytes(t, dtype) for _, t in _tensors(m, recurse=False))) for n, m in model.named_modules()]
    return max(sizes, key=lambda s: s[1], default=("", 0))


def _largest_unsplit(model: nn.Module, no_split: set[str], sizes: dict[str, int]) -> int:
    return max((sizes[n] for n, m in model.named_modules() if type(m).__name__ in no_split), default=0)


def _has_children(module: nn.Module) -> bool:
    return any(True for _ in module.children())


def _children_of(prefix: str, module: nn.Module) -> list[tuple[str, Any]]:
    """The parts of ``module`` in order: its own parameters and buffers, then its children."""
    join = (prefix + ".") if prefix else ""
    own = [(join + n, t) for n, t in _tensors(module, recurse=False)]
    return own + [(join + n, m) for n, m in module.named_children()]


def _tensors_of(part: Any) -> list[torch.Tensor]:
    if isinstance(part, torch.Tensor):
        return [part]
    return [t for _, t in _tensors(part, recurse=True)]


def _key(t: torch.Tensor) -> int:
    return id(t)  # meta tensors share no storage; a tied weight is one Parameter object held twice


def _size_unseen(name: str, part: Any, dtype: torch.dtype | None, seen: dict[int, str]) -> int:
    done: set[int] = set()
    total = 0
    for t in _tensors_of(part):
        k = _key(t)
        if k in seen or k in done:
            continue
        done.add(k)
        total += _nbytes(t, dtype)
    return total


def _tied_device(name: str, part: Any, seen: dict[int, str], placed: dict[str, Any]) -> Any:
    for t in _tensors_of(part):
        holder = seen.get(_key(t))
        if holder is not None:
            return placed[holder]
    return None


def _mark(name: str, part: Any, seen: dict[int, str]) -> None:
    for t in _tensors_of(part):
        seen.setdefault(_key(t), name)


def _does_not_fit(name: str, part: Any, size: int, budgets: dict[Any, int], offload: bool) -> DispatchError:
    what = type(part).__name__
    room = ", ".join(f"{d}: {fmt_bytes(b)}" for d, b in budgets.items())
    fix = (
        "raise max_memory for one device to at least that"
        if offload
        else "pass offload_dir=... so that what does not fit goes to disk, or raise max_memory"
    )
    return DispatchError(
        f"{name or 'the model'} ({what}, {fmt_bytes(size)}) fits on no device (budgets: {room}) and "
        f"cannot be split; {fix}"
    )


def _merge(placed: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """Fold children that all went to one device back into their parent, as Accelerate's maps read."""
    names = [n for n, _ in model.named_modules() if n]
    for parent in sorted(names, key=lambda n: -n.count(".")):
        module = model.get_submodule(parent)
        kids = [n for n, _ in _children_of(parent, module)]
        if kids and all(k in placed for k in kids) and len({str(placed[k]) for k in kids}) == 1:
            device = placed[kids[0]]
            for k in kids:
                del placed[k]
            placed[parent] = device
    top = [n for n, _ in _children_of("", model)]
    if top and all(k in placed for k in top) and len({str(placed[k]) for k in top}) == 1:
        return {"": placed[top[0]]}
    order = {n: i for i, n in enumerate([n for n, _ in model.named_modules()] + [n for n, _ in _tensors(model, True)])}
    return {n: placed[n] for n in sorted(placed, key=lambda n: order.get(n, 10**9))}


def check_device_map(model: nn.Module, device_map: Mapping[str, Any]) -> None:
    """Every parameter and buffer must be covered by exactly one entry (a module or the tensor itself)."""
    names = [n for n, _ in _tensors(model, recurse=True)]
    unknown = [
        k for k in device_map if k and k not in dict(model.named_modules()) and k not in dict(_tensors(model, True))
    ]
    if unknown:
        raise DispatchError(f"the device map names {unknown[:5]}, which the model does not have")
    bad = {
        k: v
        for k, v in device_map.items()
        if not (isinstance(v, int) or v in ("cpu", "disk") or str(v).startswith("cuda"))
    }
    if bad:
        raise DispatchError(f"the device map places {bad} on unknown devices: use GPU indices, 'cpu' or 'disk'")

    def covered(n: str) -> bool:
        return "" in device_map or any(n == k or n.startswith(k + ".") for k in device_map)

    missing = [n for n in names if not covered(n)]
    if missing:
        lost = set(missing)
        parts: list[str] = []
        for n in missing:  # name the highest module all of whose tensors are missing
            top = n
            while "." in top:
                parent = top.rsplit(".", 1)[0]
                if not all(m in lost for m in names if m.startswith(parent + ".")):
                    break
                top = parent
            if top not in parts:
                parts.append(top)
        shown = ", ".join(parts[:5]) + (f" and {len(parts) - 5} more" if len(parts) > 5 else "")
        raise DispatchError(
            f"the device map does not place {shown}: add their modules (or a parent) to it, or use device_map='auto'"
        )
