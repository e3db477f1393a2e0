"""The on-disk format of a checkpoint: writing shard files atomically, and reading them back without running code.

A checkpoint directory holds ``manifest.json`` and ``shard-RRRRR-of-NNNNN.safetensors`` files (see ``state.py``
for what is in them). Here: the shard writer (safetensors, a crc32 per run, fsync), the atomic swap into place and
the rotation of old checkpoints, and the JSON encoding of non-tensor state (tensors inside it go to the shards). The
reader is ``read.py``. Nothing here unpickles.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.shards import ShardEntry

__all__ = ["CheckpointError", "save_model_file", "FORMAT", "VERSION", "MANIFEST"]

FORMAT = "phalanx-checkpoint"
VERSION = 2
"""The newest format version. 2 added runs that hold a chunk of a tensor (tensor parallelism: ``"chunk": [dim, parts,
packed, index]`` on a run, whose ``start``/``stop`` count in the flattened chunk); a checkpoint without such runs is
written as version 1, which every phalanx reads."""
READABLE = (1, 2)
MANIFEST = "manifest.json"
SHARD_NAME = re.compile(r"shard-\d{5}-of-\d{5}\.safetensors")
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file and says what to do."""


def model_key(kind: str, model_index: int, rest: str) -> str:
    return f"{kind}{model_index or ''}/{rest}"


# ------------------------------------------------------------------------------------------------ writing
def write_shard(directory: Path, rank: int, world: int, entries: list[ShardEntry]) -> dict[str, Any]:
    """One rank's safetensors file, fsynced, with a crc32 of each entry computed while the file goes to disk."""
    from safetensors.torch import save_file

    name = f"shard-{rank:05d}-of-{world:05d}.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    described: list[dict[str, Any]] = []
    on_device = False
    spans: set[tuple[int, int]] = set()
    for e in entries:
        if str(e.data.dtype).removeprefix("torch.") not in DTYPES:
            raise CheckpointError(f"cannot save {e.key}: dtype {e.data.dtype} is not supported in checkpoints")
        tname = e.key if e.key not in tensors else f"{e.key}@{e.start}"
        while tname in tensors:  # two runs of one tensor from one rank, in different chunks
            tname += "+"
        data = e.data.detach().reshape(-1)
        if data.device.type != "cpu":  # into pinned host memory, all copies in flight at once, one wait below
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=data.device.type == "cuda")
            data, on_device = host.copy_(data, non_blocking=True), True
        data = data.contiguous()  # a CPU tensor is written from its own memory, not copied
        span = (data.data_ptr(), data.numel() * data.element_size())
        if span in spans and span[1]:
            data = data.clone()  # one tensor given under two keys (zero's per-piece step): safetensors refuses aliases
        spans.add(span)
        tensors[tname] = data
        described.append(
            {
                "key": e.key,
                "name": tname,
                "shape": list(e.shape),
                "dtype": str(e.data.dtype).removeprefix("torch."),
                "start": e.start,
                "stop": e.stop,
                **({"chunk": list(e.chunk)} if e.chunk is not None else {}),
            }
        )
    if on_device and torch.cuda.is_available():
        torch.cuda.synchronize()
    path = directory / name
    save_file(tensors, str(path))
    # The checksums are CPU work and the fsync waits on the disk: overlap those two (both release the GIL), not the
    # checksums and the write, which both copy memory.
    failed: list[OSError] = []

    def flush() -> None:
        try:
            _fsync(path)
        except OSError as e:
            failed.append(e)

    flusher = threading.Thread(target=flush)
    flusher.start()
    crcs = {tname: _crc32(t) for tname, t in tensors.items()}
    flusher.join()
    if failed:
        raise failed[0]
    for d in described:
        d["crc32"] = crcs[d["name"]]
    return {"name": name, "bytes": path.stat().st_size, "tensors": described}


def _crc32(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return zlib.crc32(memoryview(t.view(torch.uint8).numpy()))  # type: ignore[arg-type]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def swap_into_place(staging: Path, target: Path) -> None:
    """Rename the finished staging directory to ``target``; an older checkpoint there is removed only after."""
    old = target.parent / f".{target.name}.old"
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.rename(staging, target)
    _fsync(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_interrupted_swap(target: Path) -> None:
    """A crash between the two renames of ``_swap_into_place`` leaves the previous checkpoint at ``.NAME.old``."""
    old = target.parent / f".{target.name}.old"
    if not target.exists() and (old / MANIFEST).exists():
        os.rename(old, target)


def rotate(target: Path, keep_last: int) -> None:
    """Delete the oldest (by save time) of the phalanx checkpoints beside ``target`` whose names differ from its only
    in their digits (``step-300`` rotates ``step-100`` and ``step-200``, never ``best`` or ``other-step-100``), so that
    ``keep_last`` remain."""
    parts = re.split(r"(\d+)", target.name)
    pattern = re.compile("".join(r"\d+" if p.isdigit() else re.escape(p) for p in parts))
    found = []
    for d in target.parent.iterdir():
        if not pattern.fullmatch(d.name):
            continue
        when = saved_at(d)
        if when is not None:
            found.append((when, d))
    found.sort()
    for _, d in found[: max(0, len(found) - keep_last)]:
        if d != target:
            shutil.rmtree(d, ignore_errors=True)


def saved_at(d: Path) -> float | None:
    """When the phalanx checkpoint ``d`` was saved; None if ``d`` is not one."""
    try:
        m = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        return None
    return float(m.get("saved_at", 0.0))


def is_checkpoint(d: Path) -> bool:
    return saved_at(d) is not None


# --------------------------------------------------------------------------------------- JSON state
def to_json(obj: Any, path: str, tensors: dict[str, torch.Tensor] | None) -> Any:
    """``obj`` as JSON. Tensors go to ``tensors`` under ``state/<path>`` and are referred to by that key; tuples
    and dicts with non-string keys are tagged so that they come back as they were."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        if tensors is None:
            raise CheckpointError(f"cannot save a tensor at {path} here")
        key = f"state/{path}"
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": key}
    if isinstance(obj, tuple):
        return {"__tuple__": [to_json(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_json(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: to_json(v, f"{path}/{k}", tensors) for k, v in obj.items()}
        return {
            "__items__": [
                [to_json(k, f"{path}/key{i}", tensors), to_json(v, f"{path}/item{i}", tensors)]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    if type(obj).__module__ == "numpy":
        if hasattr(obj, "shape") and obj.shape != ():
            return {"__ndarray__": to_json(torch.from_numpy(obj.copy()), path, tensors)}
        return obj.item()
    raise CheckpointError(
        f"cannot save {path}: a {type(obj).__name__} is not tensor, number, string, bool, None, list, tuple or dict "
        "(a state_dict() for a checkpoint holds only those; nothing is pickled)"
    )


def from_json(obj: Any, read_tensor: Callable[[str], torch.Tensor] | None) -> Any:
    if isinstance(obj, list):
        return [from_json(v, read_tensor) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        assert read_tensor is not None
        return read_tensor(obj["__tensor__"])
    if "__tuple__" in obj:
        return tuple(from_json(v, read_tensor) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {from_json(k, read_tensor): from_json(v, read_tensor) for k, v in obj["__items__"]}
    if "__ndarray__" in obj:
        return from_json(obj["__ndarray__"], read_tensor).numpy()
    return {k: from_json(v, read_tensor) for k, v in obj.items()}


# ------------------------------------------------------------------------------------------ model only
def save_model_file(state_dict: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """One plain safetensors state dict (tied keys as separate tensors), written under a temporary name first."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for k, v in state_dict.items():
        v = v.detach().cpu().contiguous()
        if v.untyped_storage().data_ptr() in seen:
            v = v.clone()  # safetensors refuses tensors that share memory
        seen.add(v.untyped_storage().data_ptr())
        tensors[k] = v
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    save_file(tensors, str(tmp), metadata=metadata)
    _fsync(tmp)
    os.replace(tmp, path)
