"""``phalanx dispatch-plan PATH --max-memory cpu=2GiB``: the device map and the bytes on each device, before anything
is loaded.

PATH is a directory that ``save_pretrained`` wrote (with ``config.json``: the model is built from it on the meta
device, so its ``_no_split_modules`` count, when transformers is installed), a ``.safetensors`` file, a directory
of safetensors shards with an index, or a phalanx checkpoint. Without a model class, the module tree comes from the
tensor names (``a.b.weight`` is tensor ``weight`` of module ``a.b``), with their shapes and dtypes from the headers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.inference.plan import DispatchError, fmt_bytes, init_empty_weights, parse_bytes, plan_device_map

__all__ = ["dispatch_plan_text", "parse_max_memory"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}  # fmt: skip


def parse_max_memory(items: Sequence[str]) -> dict[Any, int]:
    """``["cpu=2GiB", "0=20GiB"]`` -> ``{"cpu": 2147483648, 0: 21474836480}``."""
    out: dict[Any, int] = {}
    for item in items:
        device, sep, size = item.partition("=")
        if not sep or not device or not size:
            raise DispatchError(f"--max-memory {item!r}: write DEVICE=SIZE, e.g. cpu=2GiB or 0=20GiB")
        out[int(device) if device.isdigit() else device] = parse_bytes(size)
    return out


def _from_names(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> nn.Module:
    root = nn.Module()
    for name, (shape, dtype) in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        module.register_parameter(
            leaf, nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
        )
    return root


def _model_at(path: Path) -> tuple[nn.Module, str]:
    config = path / "config.json"
    if config.is_file():
        arch = (json.loads(config.read_text()).get("architectures") or [None])[0]
        try:
            import transformers

            cls = getattr(transformers, arch) if arch else None
        except ImportError:
            cls = None
        if cls is not None:
            with init_empty_weights(include_buffers=True):
                model = cls(transformers.AutoConfig.from_pretrained(path))
            return model, arch
    from phalanx.checkpoint.format import MANIFEST
    from phalanx.checkpoint.model_files import _FROM_SAFETENSORS, _weight_files
    from phalanx.checkpoint.read import Checkpoint, _read_header

    if (path / MANIFEST).is_file():
        ck = Checkpoint(path)
        try:
            dtypes = {
                k.removeprefix("model/"): v["dtype"]
                for k, v in ck.manifest["tensors"].items()
                if k.startswith("model/")
            }
            from phalanx.checkpoint.format import DTYPES

            shapes = {k: (tuple(s), DTYPES[dtypes[k]]) for k, s in ck.model_shapes(0).items()}
        finally:
            ck.close()
        return _from_names(shapes), "phalanx checkpoint"
    _, files = _weight_files(path)
    shapes = {}
    for key, file in files.items():
        info = _read_header(file)[0][key]
        shapes[key] = (tuple(info["shape"]), _FROM_SAFETENSORS[info["dtype"]])
    return _from_names(shapes), "safetensors weights"


def dispatch_plan_text(
    path: str, max_memory: Sequence[str] = (), no_split: Sequence[str] | None = None, dtype: str | None = None
) -> str:
    where = Path(path).expanduser()
    if not where.exists():
        raise DispatchError(
            f"{path} does not exist (give a save_pretrained directory, a .safetensors file, a directory "
            "of shards with model.safetensors.index.json, or a phalanx checkpoint)"
        )
    if dtype is not None and dtype not in _DTYPES:
        raise DispatchError(f"--dtype {dtype!r}: use one of {', '.join(_DTYPES)}")
    want = _DTYPES[dtype] if dtype else None
    model, what = _model_at(where)
    budgets = parse_max_memory(max_memory)
    plan = plan_device_map(model, "auto", budgets or None, no_split, want, offload=True)
    sizes: dict[str, int] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        from phalanx.inference.dispatch import _place_of

        device = str(_place_of(name, plan))
        size = t.numel() * (
            torch.empty(0, dtype=want).element_size() if want and t.is_floating_point() else t.element_size()
        )
        sizes[device] = sizes.get(device, 0) + size
    total = sum(sizes.values())
    width = max((len(k) for k in plan), default=1)
    lines = [f"dispatch plan for {path} ({what}, {fmt_bytes(total)}):"]
    lines += [f"  {name or '(the whole model)':{width}}  {device}" for name, device in plan.items()]
    given = {str(k): v for k, v in budgets.items()}
    per = ", ".join(
        f"{d} {fmt_bytes(b)}" + (f" (budget {fmt_bytes(given[d])})" if d in given else "") for d, b in sizes.items()
    )
    lines.append(f"bytes per device: {per}")
    return "\n".join(lines)
