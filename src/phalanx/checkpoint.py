"""Checkpoints: a directory of safetensors files and a JSON manifest; sharded, atomic, loadable on any world size.

    engine.save_state("ckpt/step-1000", keep_last=3)   # every rank calls it
    engine.load_state("ckpt/step-1000")                # under any strategy, on any world size
    phalanx checkpoint info ckpt/step-1000
    phalanx checkpoint consolidate ckpt/step-1000 model.safetensors

A checkpoint directory holds:

- ``shard-RRRRR-of-NNNNN.safetensors``: rank R's slices of the training state, written by the ranks in parallel.
  Each entry is a 1-D run ``[start, stop)`` of a flattened tensor (a parameter, an optimizer state tensor, or a
  tensor found inside a scheduler's or a registered object's state).
- ``manifest.json``: the format and its version; the world size, mesh and strategy at save time; every tensor's
  whole shape and dtype and, for each file, which runs of which tensors it holds with a crc32 of each run; and
  the state that is not a tensor (step counter, loader positions, schedulers, loss scaler, each rank's RNG,
  optimizer hyper-parameters, registered objects) as JSON.

Saving writes into ``.NAME.partial`` beside the target and renames it into place only when every rank has written
its file and rank 0 the manifest; a crash at any point leaves the previous checkpoint untouched. Ranks exchange
what they wrote as JSON bytes over the process group, never pickled.

Loading never unpickles and never runs code: the manifest is JSON, and tensor files are read with safetensors
(a file that starts like a pickle or a ``torch.save`` zip is refused by its first bytes). Every check (format
version, each file present with its size, every checksum, names and shapes against the model, the number of
optimizers, schedulers, loaders and registered objects) passes on every rank before the first tensor is
copied: a checkpoint loads whole or not at all. Each rank reads only the runs that overlap its own shard.
"""

from __future__ import annotations

import base64
import json
import math
import mmap
import os
import random
import re
import shutil
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import all_gather_bytes
from phalanx.strategies.base import ShardEntry, Strategy
from phalanx.topology import Topology

__all__ = [
    "CheckpointError",
    "Checkpoint",
    "TrainingParts",
    "save_checkpoint",
    "load_checkpoint",
    "save_model_file",
    "agree",
    "latest_checkpoint",
    "FORMAT",
    "VERSION",
]

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


@dataclass
class TrainingParts:
    """Everything a checkpoint holds, as the Engine hands it over (optimizers unwrapped)."""

    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any] = field(default_factory=list)
    loaders: list[Any] = field(default_factory=list)
    objects: list[Any] = field(default_factory=list)
    precision: Any = None
    counters: dict[str, int] = field(default_factory=dict)
    seed: int = 0


# ------------------------------------------------------------------------------------------------ save
def save_checkpoint(
    path: str | os.PathLike[str], parts: TrainingParts, strategy: Strategy, topology: Topology,
    device: torch.device, keep_last: int | None = None,
) -> Path:  # fmt: skip
    """Write a checkpoint of ``parts`` to ``path``. A collective: every rank calls it, and every rank returns once
    the checkpoint is complete at ``path`` (or raises the same error)."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the number of checkpoints to keep); got {keep_last}")
    target = Path(os.path.abspath(os.path.expanduser(path)))
    rank, world = topology.rank, topology.world_size
    staging = target.parent / f".{target.name}.partial"

    # The tensors, each rank its share, and (rank 0's copy is the one saved) everything else as JSON. An error on
    # one rank must reach the others, which would otherwise wait for it in the next collective.
    entries: list[ShardEntry] = []
    state: dict[str, Any] | None = None
    error = None
    try:
        for i, model in enumerate(parts.models):
            entries += [_rekey(e, i) for e in strategy.sharded_state(model, parts.optimizers)]
        if rank == 0:
            extra: dict[str, torch.Tensor] = {}
            state = _global_state(parts, strategy, extra)
            entries += [ShardEntry(k, tuple(t.shape), 0, t.numel(), t.reshape(-1)) for k, t in extra.items()]
            _recover_interrupted_swap(target)
            if target.exists() and not _is_checkpoint(target):
                raise CheckpointError(
                    f"{target} exists and is not a phalanx checkpoint; save_state replaces only a checkpoint (choose "
                    "another directory, or remove this one yourself)"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # a save that crashed earlier
            staging.mkdir()
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    agree(error, device, f"saving the checkpoint {target}")

    written: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None
    try:
        written = _write_shard(staging, rank, world, entries) if entries else None
        rng = _rng_state(device)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others would wait forever
        error = f"{type(e).__name__}: {e}"
    reports = [json.loads(b) for b in all_gather_bytes(
        json.dumps({"error": error, "file": written, "rng": rng}).encode(), device
    )]  # fmt: skip
    failed = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if rep["error"]]
    if failed:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"saving the checkpoint {target} failed (nothing was replaced): " + "; ".join(failed))

    error = None
    if rank == 0:
        try:
            assert state is not None
            manifest = _manifest(state, reports, strategy, topology, parts)
            _write_json_durably(staging / MANIFEST, manifest)
            _swap_into_place(staging, target)
            if keep_last is not None:
                _rotate(target, keep_last)
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
    agree(error, device, f"saving the checkpoint {target}")
    return target


def _rekey(e: ShardEntry, model_index: int) -> ShardEntry:
    """``model/x`` and ``optim/x/k`` of the first model keep their names; the i-th model's are ``modelI/...``."""
    if model_index == 0:
        return e
    kind, _, rest = e.key.partition("/")
    return e._replace(key=f"{kind}{model_index}/{rest}")


def _model_key(kind: str, model_index: int, rest: str) -> str:
    return f"{kind}{model_index or ''}/{rest}"


def _global_state(parts: TrainingParts, strategy: Strategy, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Everything that is not a model or optimizer tensor, as JSON (tensors inside go to ``tensors``)."""
    return {
        "counters": dict(parts.counters),
        "seed": parts.seed,
        "models": [
            {"class": type(strategy.unwrap_model(m)).__name__, "state_dict_keys": strategy.state_dict_keys(m)}
            for m in parts.models
        ],
        "optimizers": [
            {
                "class": type(opt).__name__,
                "param_groups": [
                    _to_json({k: v for k, v in g.items() if k != "params"}, f"optimizer{j}/group{gi}", tensors)
                    for gi, g in enumerate(opt.param_groups)
                ],
            }
            for j, opt in enumerate(parts.optimizers)
        ],
        "schedulers": [_to_json(s.state_dict(), f"scheduler{i}", tensors) for i, s in enumerate(parts.schedulers)],
        "loaders": [_to_json(dl.state_dict(), f"loader{i}", tensors) for i, dl in enumerate(parts.loaders)],
        "objects": [
            {"class": type(o).__name__, "state": _to_json(o.state_dict(), f"object{i}", tensors)}
            for i, o in enumerate(parts.objects)
        ],
        "precision": _to_json(parts.precision.state_dict(), "precision", tensors) if parts.precision else None,
    }


def _manifest(
    state: dict[str, Any], reports: list[dict[str, Any]], strategy: Strategy, topology: Topology, parts: TrainingParts
) -> dict[str, Any]:
    import phalanx

    files: list[dict[str, Any]] = []
    tensors: dict[str, dict[str, Any]] = {}
    for rank, rep in enumerate(reports):
        f = rep["file"]
        if f is None:
            continue
        index = len(files)
        files.append({"name": f["name"], "rank": rank, "bytes": f["bytes"]})
        for t in f["tensors"]:
            info = tensors.setdefault(t["key"], {"shape": t["shape"], "dtype": t["dtype"], "slices": []})
            assert info["shape"] == t["shape"] and info["dtype"] == t["dtype"], (t, info)
            info["slices"].append({"file": index, "name": t["name"], "start": t["start"], "stop": t["stop"], "crc32": t["crc32"]})
    for key, info in tensors.items():
        info["slices"].sort(key=lambda s: s["start"])
        covered = 0
        for s in info["slices"]:  # our own invariant: the ranks' runs tile every tensor exactly
            assert s["start"] == covered, f"{key}: runs do not tile the tensor ({info['slices']})"
            covered = s["stop"]
        assert covered == math.prod(info["shape"]), f"{key}: runs cover {covered} of {info['shape']}"
    return {
        "format": FORMAT,
        "version": VERSION,
        "saved_at": time.time(),
        "phalanx_version": phalanx.__version__,
        "torch_version": torch.__version__,
        "world_size": topology.world_size,
        "pp_size": topology.pp_size,
        "dp_size": topology.dp_size,
        "strategy": strategy.name,
        **state,
        "rng": [rep["rng"] for rep in reports],
        "files": files,
        "tensors": dict(sorted(tensors.items())),
    }


def _write_shard(directory: Path, rank: int, world: int, entries: list[ShardEntry]) -> dict[str, Any]:
    """One rank's safetensors file, with a crc32 of each entry computed while the file is written; fsynced."""
    from safetensors.torch import save_file

    name = f"shard-{rank:05d}-of-{world:05d}.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    described = []
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
    crcs: dict[Any, int] = {}

    def checksum() -> None:  # zlib releases the GIL: this overlaps the write
        for tname, t in tensors.items():
            crcs[tname] = _crc32(t)

    worker = threading.Thread(target=checksum)
    worker.start()
    path = directory / name
    save_file(tensors, str(path))
    worker.join()
    _fsync(path)
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


def _write_json_durably(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _swap_into_place(staging: Path, target: Path) -> None:
    """Rename the finished staging directory to ``target``; an older checkpoint there is removed only after."""
    old = target.parent / f".{target.name}.old"
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.rename(staging, target)
    _fsync(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def _recover_interrupted_swap(target: Path) -> None:
    """A crash between the two renames of ``_swap_into_place`` leaves the previous checkpoint at ``.NAME.old``."""
    old = target.parent / f".{target.name}.old"
    if not target.exists() and (old / MANIFEST).exists():
        os.rename(old, target)


def _rotate(target: Path, keep_last: int) -> None:
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


def _is_checkpoint(d: Path) -> bool:
    return _saved_at(d) is not None


def agree(error: str | None, device: torch.device, what: str) -> None:
    """Raise the same CheckpointError on every rank if any rank had ``error``, naming the ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error:
            raise CheckpointError(f"{what} failed: {error}")
        return
    errors = [b.decode() for b in all_gather_bytes((error or "").encode(), device)]
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"{what} failed: " + "; ".join(failed))


# ---------------------------------------------------------------------------------------- RNG state
def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "python": _to_json(random.getstate(), "rng", None),
        "cuda": _b64(torch.cuda.get_rng_state(device)) if device.type == "cuda" else None,
        "numpy": None,
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
        state["numpy"] = [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    random.setstate(_from_json(state["python"], None))
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)
    if state.get("numpy") is not None:
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass


def _reseed(seed: int, step: int, rank: int, device: torch.device) -> None:
    """RNG for a run resumed on another mesh: a function of the seed, the global step and the rank."""
    value = ((seed * 1_000_003 + step) * 65_537 + rank) % 2**63  # torch takes seeds below 2**63
    random.seed(value)
    torch.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)
    try:
        import numpy as np

        np.random.seed(value % 2**32)
    except ImportError:
        pass


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


# --------------------------------------------------------------------------------------- JSON state
def _to_json(obj: Any, path: str, tensors: dict[str, torch.Tensor] | None) -> Any:
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
        return {"__tuple__": [_to_json(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_to_json(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _to_json(v, f"{path}/{k}", tensors) for k, v in obj.items()}
        return {"__items__": [[_to_json(k, f"{path}/key{i}", tensors), _to_json(v, f"{path}/item{i}", tensors)]
                              for i, (k, v) in enumerate(obj.items())]}  # fmt: skip
    if type(obj).__module__ == "numpy":
        if hasattr(obj, "shape") and obj.shape != ():
            return {"__ndarray__": _to_json(torch.from_numpy(obj.copy()), path, tensors)}
        return obj.item()
    raise CheckpointError(
        f"cannot save {path}: a {type(obj).__name__} is not tensor, number, string, bool, None, list, tuple or dict "
        "(a state_dict() for a checkpoint holds only those; nothing is pickled)"
    )


def _from_json(obj: Any, read_tensor: Callable[[str], torch.Tensor] | None) -> Any:
    if isinstance(obj, list):
        return [_from_json(v, read_tensor) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        assert read_tensor is not None
        return read_tensor(obj["__tensor__"])
    if "__tuple__" in obj:
        return tuple(_from_json(v, read_tensor) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_from_json(k, read_tensor): _from_json(v, read_tensor) for k, v in obj["__items__"]}
    if "__ndarray__" in obj:
        return _from_json(obj["__ndarray__"], read_tensor).numpy()
    return {k: _from_json(v, read_tensor) for k, v in obj.items()}


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
        prefix = _model_key("model", model_index, "")
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
            sd_key: self.read_whole(_model_key("model", model_index, stored))
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
            shown = ", ".join(f"{k}={_from_json(v, None)}" for k, v in hyper.items() if k in ("lr", "weight_decay", "momentum", "betas"))
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
        self.prefixes = {kind: _model_key(kind, model_index, "") for kind in ("model", "optim")}
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


# ------------------------------------------------------------------------------------------------ load
def load_checkpoint(
    path: str | os.PathLike[str], parts: TrainingParts, strategy: Strategy, topology: Topology,
    device: torch.device, verify: bool = True,
) -> dict[str, int]:  # fmt: skip
    """Load ``path`` into ``parts``: all checks first, on every rank, then the tensors. Returns the counters."""
    error, ck = None, None
    try:
        ck = Checkpoint(path)
        problems = _compatibility(ck, parts, strategy)
        if verify and not problems:
            mine = range(topology.rank, len(ck.files), topology.world_size)  # the ranks verify the files between them
            problems = ck.verify(mine)
        if problems:
            error = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it before anything is loaded
        error = f"{type(e).__name__}: {e}"
    agree(error, device, f"loading the checkpoint {path}")
    assert ck is not None
    m = ck.manifest

    try:
        for i, model in enumerate(parts.models):
            strategy.load_sharded_state(model, parts.optimizers, ck.reader(i))
        _load_json_state(ck, parts)
    finally:
        ck.close()
    counters = {k: int(v) for k, v in m["counters"].items()}
    same_mesh = (m["world_size"], m["pp_size"]) == (topology.world_size, topology.pp_size)
    if same_mesh:
        _set_rng_state(m["rng"][topology.rank], device)
    else:
        _reseed(m["seed"], counters.get("global_step", 0), topology.rank, device)
    if dist.is_initialized():
        dist.barrier()
    return counters


def _load_json_state(ck: Checkpoint, parts: TrainingParts) -> None:
    m, read_tensor = ck.manifest, ck.read_whole
    for opt, saved in zip(parts.optimizers, m["optimizers"]):
        for group, hyper in zip(opt.param_groups, saved["param_groups"]):
            group.update(_from_json(hyper, read_tensor))
    for sched, saved in zip(parts.schedulers, m["schedulers"]):
        sched.load_state_dict(_from_json(saved, read_tensor))
    for loader, saved in zip(parts.loaders, m["loaders"]):
        loader.load_state_dict(_from_json(saved, read_tensor))
    for obj, saved in zip(parts.objects, m["objects"]):
        obj.load_state_dict(_from_json(saved["state"], read_tensor))
    if parts.precision is not None and m["precision"] is not None:
        parts.precision.load_state_dict(_from_json(m["precision"], read_tensor))


def _compatibility(ck: Checkpoint, parts: TrainingParts, strategy: Strategy) -> list[str]:
    """Every difference between the checkpoint and what is being loaded into, before anything is loaded."""
    m, where, problems = ck.manifest, ck.path / MANIFEST, []
    for kind, n_saved, n_now in (
        ("model", len(m["models"]), len(parts.models)),
        ("optimizer", len(m["optimizers"]), len(parts.optimizers)),
        ("LR scheduler", len(m["schedulers"]), len(parts.schedulers)),
        ("DataLoader", len(m["loaders"]), len(parts.loaders)),
        ("registered object", len(m["objects"]), len(parts.objects)),
    ):
        if n_saved != n_now:
            problems.append(
                f"{where} holds {n_saved} {kind}(s), and {n_now} are prepared (or registered) now; prepare the same "
                f"objects in the same order as when it was saved"
            )
    if problems:
        return problems
    for i, model in enumerate(parts.models):
        saved, now = ck.model_shapes(i), strategy.state_shapes(model)
        diffs = [f"{k}: missing from the checkpoint" for k in now if k not in saved]
        diffs += [f"{k}: in the checkpoint, not in the model" for k in saved if k not in now]
        diffs += [f"{k}: shape {list(saved[k])} in the checkpoint, {list(now[k])} in the model"
                  for k in now if k in saved and tuple(saved[k]) != tuple(now[k])]  # fmt: skip
        if diffs:
            problems.append(
                f"model {i} ({type(strategy.unwrap_model(model)).__name__}) does not match {where} "
                f"({len(diffs)} difference(s)): " + "; ".join(diffs[:5])
            )
    for i, (loader, saved_loader) in enumerate(zip(parts.loaders, m["loaders"])):
        problem = loader.resume_problem(_from_json(saved_loader, None))
        if problem:
            problems.append(f"DataLoader {i}: {problem}")
    for j, (opt, saved_opt) in enumerate(zip(parts.optimizers, m["optimizers"])):
        if type(opt).__name__ != saved_opt["class"]:
            problems.append(f"optimizer {j} is {type(opt).__name__}; {where} holds the state of a {saved_opt['class']}")
        elif len(opt.param_groups) != len(saved_opt["param_groups"]):
            problems.append(
                f"optimizer {j} has {len(opt.param_groups)} param group(s); {where} holds {len(saved_opt['param_groups'])}"
            )
    return problems


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
