"""The on-disk format of a checkpoint: writing shard files atomically, and reading them back without running code.

A checkpoint directory holds ``manifest.json`` and ``shard-RRRRR-of-NNNNN.safetensors`` files (see ``checkpoint.py``
for what is in them). Here: the shard writer (safetensors, a crc32 per run, fsync), the atomic swap into place and
the rotation of old checkpoints, the JSON encoding of non-tensor state (tensors inside it go to the shards), and the
reader, which checks a checkpoint from its manifest and the files' own headers and reads runs straight into the
caller's tensors. Nothing here unpickles.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import shutil
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from phalanx.strategies.base import ShardEntry

__all__ = [
    "CheckpointError", "Checkpoint", "latest_checkpoint", "save_model_file", "FORMAT", "VERSION", "MANIFEST",
]  # fmt: skip

FORMAT = "phalanx-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_SHARD_NAME = re.compile(r"shard-\d{5}-of-\d{5}\.safetensors")
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool)
}  # fmt: skip
_SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
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
        if str(e.data.dtype).removeprefix("torch.") not in _DTYPES:
            raise CheckpointError(f"cannot save {e.key}: dtype {e.data.dtype} is not supported in checkpoints")
        tname = e.key if e.key not in tensors else f"{e.key}@{e.start}"
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
        described.append({"key": e.key, "name": tname, "shape": list(e.shape),
                          "dtype": str(e.data.dtype).removeprefix("torch."), "start": e.start, "stop": e.stop})  # fmt: skip
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
        saved_at = _saved_at(d)
        if saved_at is not None:
            found.append((saved_at, d))
    found.sort()
    for _, d in found[: max(0, len(found) - keep_last)]:
        if d != target:
            shutil.rmtree(d, ignore_errors=True)


def _saved_at(d: Path) -> float | None:
    """When the phalanx checkpoint ``d`` was saved; None if ``d`` is not one."""
    try:
        m = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        return None
    return float(m.get("saved_at", 0.0))


def is_checkpoint(d: Path) -> bool:
    return _saved_at(d) is not None


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
        return {"__items__": [[to_json(k, f"{path}/key{i}", tensors), to_json(v, f"{path}/item{i}", tensors)]
                              for i, (k, v) in enumerate(obj.items())]}  # fmt: skip
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


# ------------------------------------------------------------------------------------------ reading
class Checkpoint:
    """A checkpoint directory, opened by its manifest alone: nothing is unpickled and no code runs.

    ``Checkpoint(path)`` checks the format, the version, that every file is there with its recorded size, and
    that each file's safetensors header holds every run the manifest puts there, with its dtype and length;
    ``verify()`` checks the checksums; ``read``/``read_into`` read runs of tensors (``read_into`` straight from
    the file into the destination's memory); ``state_dict()`` gives a model's whole state dict.

    Files are read by offsets from their safetensors headers (parsed as JSON here), not through the
    safetensors library, which cannot read into memory the caller already has.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            raise CheckpointError(_not_a_checkpoint(self.path))
        try:
            m = json.loads(manifest.read_text())
        except ValueError as e:
            raise CheckpointError(f"{manifest} is not valid JSON ({e}); the checkpoint is damaged") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise CheckpointError(f"{manifest} is not a phalanx checkpoint manifest (format {m.get('format') if isinstance(m, dict) else None!r})")
        if m.get("version") != VERSION:
            raise CheckpointError(
                f"{manifest} has format version {m.get('version')!r}; this phalanx ({_phalanx_version()}) reads version "
                f"{VERSION} (load it with the phalanx version that wrote it, {m.get('phalanx_version')!r})"
            )
        self.manifest = m
        self._headers: list[tuple[dict[str, Any], int]] = []
        self._fds: dict[int, int] = {}
        try:
            self._check_files()
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{manifest} is malformed ({type(e).__name__}: {e}); the checkpoint is damaged") from None

    def _check_files(self) -> None:
        m = self.manifest
        for f in m["files"]:
            if not _SHARD_NAME.fullmatch(f["name"]):
                raise CheckpointError(f"{self.path / MANIFEST} lists a file named {f['name']!r}, not a shard name")
        self.files: list[Path] = [self.path / f["name"] for f in m["files"]]
        for f, p in zip(m["files"], self.files):
            if not p.is_file():
                raise CheckpointError(
                    f"{p} is missing: the checkpoint lists {len(self.files)} shard files and this one (rank "
                    f"{f['rank']}'s) is not there; copy the whole checkpoint directory"
                )
            self._headers.append(_read_header(p))  # first: a pickle in a shard's place is named as such
            size = p.stat().st_size
            if size != f["bytes"]:
                raise CheckpointError(f"{p} has {size} bytes, the manifest says {f['bytes']}: the file is truncated or was replaced")
        self.tensors: dict[str, dict[str, Any]] = m["tensors"]
        for key, info in self.tensors.items():
            itemsize = torch.empty((), dtype=_DTYPES[info["dtype"]]).element_size()
            for run in info["slices"]:
                header, base = self._headers[run["file"]]
                entry = header.get(run["name"])
                expect = (_SAFETENSORS_DTYPE[info["dtype"]], (run["stop"] - run["start"]) * itemsize)
                lo, hi = entry["data_offsets"] if entry is not None else (0, -1)
                if entry is None or (entry.get("dtype"), hi - lo) != expect or base + hi > m["files"][run["file"]]["bytes"]:
                    raise CheckpointError(
                        f"{self.files[run['file']]} does not hold {key} elements [{run['start']}, {run['stop']}) as the "
                        f"manifest says (expected {expect[0]} x {expect[1]} bytes under {run['name']!r}, found {entry}); "
                        "the file was replaced or the checkpoint is damaged"
                    )

    # ------------------------------------------------------------------ checks
    def verify(self, files: Iterable[int] | None = None) -> list[str]:
        """crc32 of every run in ``files`` (indices; default all). Returns the problems found (empty: intact)."""
        wanted = set(range(len(self.files)) if files is None else files)
        runs: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        for key, info in self.tensors.items():
            for s in info["slices"]:
                if s["file"] in wanted:
                    runs.setdefault(s["file"], []).append((key, s))
        problems = []
        for index, items in sorted(runs.items()):
            path = self.files[index]
            header, base = self._headers[index]
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    for key, s in items:
                        a, b = header[s["name"]]["data_offsets"]
                        crc = zlib.crc32(view[base + a : base + b])
                        if crc != s["crc32"]:
                            problems.append(
                                f"{path}: checksum mismatch in {key} elements [{s['start']}, {s['stop']}) (crc32 {crc:08x}, "
                                f"the manifest says {s['crc32']:08x}); the file is damaged"
                            )
                finally:
                    view.release()
        return problems

    def model_shapes(self, model_index: int = 0) -> dict[str, tuple[int, ...]]:
        prefix = model_key("model", model_index, "")
        return {k[len(prefix) :]: tuple(v["shape"]) for k, v in self.tensors.items() if k.startswith(prefix)}

    # ------------------------------------------------------------------ reading
    def reader(self, model_index: int = 0) -> _Reader:
        return _Reader(self, model_index)

    def dtype(self, key: str) -> torch.dtype:
        return _DTYPES[self.tensors[key]["dtype"]]

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key``, in new memory."""
        out = torch.empty(stop - start, dtype=self.dtype(key))
        self.read_into(key, start, stop, out)
        return out

    def read_into(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of ``key`` into the 1-D ``out``. The file's bytes go straight into ``out``'s
        memory when it is a contiguous CPU tensor of the saved dtype; otherwise through a buffer (another dtype
        is converted, a GPU tensor is copied to)."""
        if out.device.type != "cpu" or out.dtype != self.dtype(key) or not out.is_contiguous():
            out.copy_(self.read(key, start, stop))
            return
        if out.numel() != stop - start:
            raise ValueError(f"read_into({key!r}, {start}, {stop}) needs {stop - start} elements; out has {out.numel()}")
        size = out.element_size()
        dst = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")  # type: ignore[arg-type]
        for run in self.tensors[key]["slices"]:
            a, b = max(start, run["start"]), min(stop, run["stop"])
            if a < b:
                header, base = self._headers[run["file"]]
                offset = base + header[run["name"]]["data_offsets"][0] + (a - run["start"]) * size
                _pread_exactly(self._fd(run["file"]), dst[(a - start) * size : (b - start) * size], offset)

    def read_whole(self, key: str) -> torch.Tensor:
        shape = tuple(self.tensors[key]["shape"])
        return self.read(key, 0, math.prod(shape)).reshape(shape)

    def _fd(self, index: int) -> int:
        if index not in self._fds:
            self._fds[index] = os.open(self.files[index], os.O_RDONLY)
        return self._fds[index]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def state_dict(self, model_index: int = 0) -> dict[str, torch.Tensor]:
        """The whole ``state_dict()`` of a saved model (its tied keys as separate tensors), on CPU."""
        models = self.manifest["models"]
        if not 0 <= model_index < len(models):
            raise CheckpointError(f"{self.path} holds {len(models)} model(s); there is no model {model_index}")
        return {
            sd_key: self.read_whole(model_key("model", model_index, stored))
            for sd_key, stored in models[model_index]["state_dict_keys"].items()
        }

    def describe(self, tensors: bool = False) -> str:
        """What ``phalanx checkpoint info`` prints."""
        m = self.manifest
        total = sum(f["bytes"] for f in m["files"])
        lines = [
            f"checkpoint {self.path}",
            f"  format {m['format']} v{m['version']}, saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m['saved_at']))} "
            f"by phalanx {m['phalanx_version']} (torch {m['torch_version']})",
            f"  saved under strategy {m['strategy']} on world size {m['world_size']} (pp {m['pp_size']} x dp {m['dp_size']})",
            f"  counters: {', '.join(f'{k}={v}' for k, v in m['counters'].items()) or 'none'}",
            f"  files: {len(m['files'])} shard(s), {total / 2**20:.1f} MiB",
        ]
        for i, model in enumerate(m["models"]):
            shapes = self.model_shapes(i)
            params = sum(math.prod(s) for s in shapes.values())
            lines.append(f"  model {i}: {model['class']}, {len(model['state_dict_keys'])} state_dict keys, {params:,} elements")
        for opt in m["optimizers"]:
            hyper = opt["param_groups"][0] if opt["param_groups"] else {}
            shown = ", ".join(f"{k}={from_json(v, None)}" for k, v in hyper.items() if k in ("lr", "weight_decay", "momentum", "betas"))
            lines.append(f"  optimizer: {opt['class']}, {len(opt['param_groups'])} param group(s); the first has {shown}")
        lines += [f"  scheduler {i}: last_epoch={s.get('last_epoch')}" for i, s in enumerate(m["schedulers"])]
        lines += [f"  loader {i}: epoch {s['epoch']}, {s['samples_done']} samples into it" for i, s in enumerate(m["loaders"])]
        lines += [f"  registered object {i}: {o['class']}" for i, o in enumerate(m["objects"])]
        if tensors:
            lines.append("  tensors:")
            for key, info in self.tensors.items():
                lines.append(f"    {key} {info['dtype']}{info['shape']} in {len(info['slices'])} run(s)")
        return "\n".join(lines)


class _Reader:
    """The StateReader a strategy loads from: one model's ``model/`` and ``optim/`` keys."""

    def __init__(self, ck: Checkpoint, model_index: int) -> None:
        self.ck = ck
        self.prefixes = {kind: model_key(kind, model_index, "") for kind in ("model", "optim")}
        self._keys = {}
        for key in ck.tensors:
            for kind, prefix in self.prefixes.items():
                if key.startswith(prefix):
                    self._keys[f"{kind}/{key[len(prefix):]}"] = key

    def keys(self) -> Iterable[str]:
        return self._keys.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.ck.tensors[self._keys[key]]["shape"])

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self.ck.read(self._keys[key], start, stop)

    def read_into(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        self.ck.read_into(self._keys[key], start, stop, out)

    def dtype(self, key: str) -> torch.dtype:
        return self.ck.dtype(self._keys[key])


def _pread_exactly(fd: int, dst: memoryview, offset: int) -> None:
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"a checkpoint file ended {len(dst) - done} bytes early (read at offset {offset + done})")
        done += n


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header (JSON) and where the data starts; refuses anything that is not safetensors."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or n > size - 8 or n > 100 * 2**20:
            raise CheckpointError(_not_safetensors(path, head))
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError:
        raise CheckpointError(_not_safetensors(path, head)) from None
    if not isinstance(header, dict):
        raise CheckpointError(_not_safetensors(path, head))
    header.pop("__metadata__", None)
    return header, 8 + n


def _not_safetensors(path: Path, head: bytes) -> str:
    if head[:1] == b"\x80":
        kind = "a pickle"
    elif head[:4] == b"PK\x03\x04":
        kind = "a zip archive (torch.save writes these; they hold pickles)"
    else:
        kind = "not safetensors"
    return (
        f"{path} is {kind}, where the manifest expects a safetensors file. phalanx never unpickles checkpoint files "
        "(unpickling can run arbitrary code); the file was replaced or the checkpoint is damaged"
    )


def _not_a_checkpoint(path: Path) -> str:
    if not path.exists():
        old = path.parent / f".{path.name}.old"
        partial = path.parent / f".{path.name}.partial"
        if (old / MANIFEST).exists():
            return f"no checkpoint at {path}; a save there was interrupted and the previous checkpoint is at {old} (rename it back)"
        if partial.exists():
            return f"no checkpoint at {path}: a save there did not finish ({partial} is its incomplete staging directory)"
        return f"no checkpoint at {path}: the directory does not exist"
    inner = sorted(d.name for d in path.iterdir() if (d / MANIFEST).is_file()) if path.is_dir() else []
    hint = (f"; it holds checkpoints {', '.join(inner[:5])}: pass one of them, or phalanx.checkpoint.latest_checkpoint({str(path)!r})"
            if inner else "")  # fmt: skip
    return f"{path} is not a phalanx checkpoint (it has no {MANIFEST}){hint}"


def _phalanx_version() -> str:
    import phalanx

    return phalanx.__version__


def latest_checkpoint(parent: str | os.PathLike[str]) -> Path | None:
    """The most recently saved complete checkpoint directly inside ``parent`` (None if there is none)."""
    best: tuple[float, Path] | None = None
    root = Path(parent)
    if not root.is_dir():
        return None
    for d in root.iterdir():
        # A save interrupted between its two renames leaves the previous checkpoint at .NAME.old (and no NAME): it
        # counts, and loads from there (the next save to NAME renames it back). Staging directories never count.
        if d.name.startswith(".") and not (d.name.endswith(".old") and not (root / d.name[1:-4]).exists()):
            continue
        saved_at = _saved_at(d)
        if saved_at is not None and (best is None or saved_at > best[0]):
            best = (saved_at, d)
    return best[1] if best else None


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
