"""Model weights from files, for ``engine.load_model``: a phalanx checkpoint, one ``.safetensors`` file, or a
directory as ``save_model``/``save_pretrained`` write it (``model.safetensors``, or shards and
``model.safetensors.index.json``).

Each is opened as a StateReader (``model/<name>`` keys, flat element ranges), so a strategy reads only the slices
its rank holds, straight from the file by the offsets in its safetensors header: a zero3 rank never holds the
whole model. Nothing is unpickled: ``pytorch_model.bin`` and other pickles are refused with the way out.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.format import DTYPES, MANIFEST, SAFETENSORS_DTYPE, CheckpointError
from phalanx.checkpoint.read import _pread_exactly, _read_header

__all__ = ["SafetensorsReader", "WithOptimizerState", "open_weights"]

_FROM_SAFETENSORS = {code: DTYPES[name] for name, code in SAFETENSORS_DTYPE.items()}
INDEX = "model.safetensors.index.json"


class SafetensorsReader:
    """``model/<stored name>`` keys over safetensors files. ``names`` maps each stored name (the model's first
    name of a tensor) to the key it has in the files: the same, or another name of a tied weight that the writer
    kept instead. ``kept`` holds tensors read from the model itself (its non-persistent buffers, which no file
    holds), so that loading leaves them as they are."""

    def __init__(
        self, where: Path, files: dict[str, Path], names: dict[str, str], kept: dict[str, torch.Tensor]
    ) -> None:
        self.where, self._files, self._names, self._kept = where, files, names, kept
        self._headers: dict[Path, tuple[dict[str, Any], int]] = {}
        self._fds: dict[Path, int] = {}

    def keys(self) -> Iterable[str]:
        return [f"model/{n}" for n in [*self._names, *self._kept]]

    def _info(self, key: str) -> tuple[Path, dict[str, Any]]:
        file_key = self._names[key.removeprefix("model/")]
        path = self._files[file_key]
        if path not in self._headers:
            self._headers[path] = _read_header(path)
        info = self._headers[path][0].get(file_key)
        if info is None:
            raise CheckpointError(f"{path} has no tensor {file_key!r}, which its index places there")
        if info.get("dtype") not in _FROM_SAFETENSORS:
            raise CheckpointError(
                f"{path}: tensor {file_key!r} has dtype {info.get('dtype')!r}, which phalanx does not read"
            )
        return path, info

    def shape(self, key: str) -> tuple[int, ...]:
        name = key.removeprefix("model/")
        if name in self._kept:
            return tuple(self._kept[name].shape)
        return tuple(self._info(key)[1]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        name = key.removeprefix("model/")
        if name in self._kept:
            return self._kept[name].dtype
        return _FROM_SAFETENSORS[self._info(key)[1]["dtype"]]

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        out = torch.empty(stop - start, dtype=self.dtype(key))
        self.read_into(key, start, stop, out)
        return out

    def read_into(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of the flattened tensor into the 1-D ``out`` (through a buffer when ``out`` is
        on a GPU or of another dtype)."""
        name = key.removeprefix("model/")
        if name in self._kept:
            out.copy_(self._kept[name].reshape(-1)[start:stop])
            return
        if out.device.type != "cpu" or out.dtype != self.dtype(key) or not out.is_contiguous():
            out.copy_(self.read(key, start, stop))
            return
        path, info = self._info(key)
        size = out.element_size()
        begin, end = info["data_offsets"]
        if (end - begin) != math.prod(info["shape"]) * size or stop * size > end - begin:
            raise CheckpointError(
                f"{path}: tensor {self._names[name]!r} is shorter than its shape says; the file is damaged"
            )
        base = self._headers[path][1]
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        if out.numel():
            dst = memoryview(out.view(torch.uint8).numpy())  # type: ignore[arg-type]
            _pread_exactly(self._fds[path], dst, base + begin + start * size)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _weight_files(path: Path) -> tuple[Path, dict[str, Path]]:
    """Where each tensor key lives: ``(what was opened, {key: file})``."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(_refused(path))
        header, _ = _read_header(path)
        return path, {k: path for k in header}
    if not path.is_dir():
        raise CheckpointError(
            f"engine.load_model: {path} does not exist (give a phalanx checkpoint, a .safetensors file, "
            "or a directory that save_model or save_pretrained wrote)"
        )
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {k: path / v for k, v in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (a 'weight_map' of key -> file): {e}") from None
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise CheckpointError(f"{index} names files that are not there: {', '.join(missing[:3])}")
        return index, files
    single = path / "model.safetensors"
    if single.is_file():
        header, _ = _read_header(single)
        return single, {k: single for k in header}
    raise CheckpointError(_refused(path))


def _refused(path: Path) -> str:
    pickles = [
        p.name for p in ([path] if path.is_file() else path.iterdir()) if p.suffix in (".bin", ".pt", ".pth", ".ckpt")
    ]
    if pickles:
        return (
            f"engine.load_model: {path} holds {', '.join(pickles[:3])}, a pickle (torch.save) format that phalanx "
            "never loads, since unpickling can run arbitrary code. Convert it once where you trust it: "
            "safetensors.torch.save_file(torch.load(f, weights_only=True), 'model.safetensors')"
        )
    return (
        f"engine.load_model: {path} is neither a phalanx checkpoint ({MANIFEST}) nor safetensors weights "
        f"(a .safetensors file, a directory with model.safetensors, or with {INDEX})"
    )


def open_weights(
    path: str | os.PathLike[str], stored: dict[str, str], buffers: dict[str, torch.Tensor], persistent: set[str]
) -> tuple[SafetensorsReader, list[str], list[str]]:
    """A reader of the weights at ``path`` (not a phalanx checkpoint: the caller opens those) for a model whose
    ``stored`` maps each ``state_dict()`` key to its tensor's first name; ``buffers`` are the model's buffers by first
    name, ``persistent`` the first names that ``state_dict()`` holds. Returns the reader, the names the files lack
    and the keys they hold that the model has not."""
    where, files = _weight_files(Path(path).expanduser())
    names: dict[str, str] = {}
    for sd_key, first in stored.items():
        if first not in names and sd_key in files:
            names[first] = sd_key  # the first name, or the name of a tied weight the writer kept instead
    kept = {n: b.detach() for n, b in buffers.items() if n not in persistent and n not in names}
    missing = sorted({first for first in stored.values() if first not in names})
    unexpected = sorted(k for k in files if k not in stored)
    return SafetensorsReader(where, {k: files[k] for k in names.values()}, names, kept), missing, unexpected


class WithOptimizerState:
    """A weights reader plus optimizer state held in memory, as ``optim/<parameter name>/<state>`` keys: what a
    strategy's ``load_sharded_state`` reads to restore both (transformers' ``optimizer.pt`` beside its weights)."""

    def __init__(self, reader: Any, state: dict[str, dict[str, Any]]) -> None:
        self.reader = reader
        self.extra = {
            f"optim/{name}/{k}": (v if v.dim() else v.reshape(())).detach()
            for name, per_param in state.items()
            for k, v in per_param.items()
            if isinstance(v, torch.Tensor)
        }

    def keys(self) -> Iterable[str]:
        return [*self.reader.keys(), *self.extra]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.extra[key].shape) if key in self.extra else self.reader.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self.extra[key].dtype if key in self.extra else self.reader.dtype(key)

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        if key in self.extra:
            return self.extra[key].reshape(-1)[start:stop].clone()
        return self.reader.read(key, start, stop)

    def read_into(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        if key in self.extra:
            out.copy_(self.extra[key].reshape(-1)[start:stop])
        else:
            self.reader.read_into(key, start, stop, out)


def load_weights(
    strategy: Any,
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    model_index: int,
    device: torch.device,
    optimizers: list[Any] | None = None,
    optimizer_state: dict[str, dict[str, Any]] | None = None,
) -> None:
    """``engine.load_model``: check on every rank, then let the strategy read this rank's slices of the weights, and
    of ``optimizer_state`` (by parameter name) into ``optimizers`` when given."""
    import torch.distributed as dist

    from phalanx.checkpoint.read import Checkpoint
    from phalanx.checkpoint.state import agree
    from phalanx.runtime.collective_log import watched

    error: str | None = None
    reader: Any = None
    closer: Any = None
    try:
        p = Path(path).expanduser()
        wanted = strategy.state_shapes(model)
        if (p / MANIFEST).is_file():
            ck = closer = Checkpoint(p)
            count = len(ck.manifest["models"])
            index = model_index if count > 1 else 0
            if index >= count:
                raise CheckpointError(f"{p} holds {count} model(s); this is prepared model {model_index}")
            reader = ck.reader(index)
            held = {k.removeprefix("model/") for k in reader.keys() if k.startswith("model/")}
            missing, unexpected = sorted(set(wanted) - held), sorted(held - set(wanted))
        else:
            module = strategy.unwrap_model(model)
            stored = strategy.state_dict_keys(model)
            buffers = {n: b for n, b in module.named_buffers()}
            reader, missing, unexpected = open_weights(p, stored, buffers, set(stored.values()))
            closer = reader
        problems = [f"{n}: not in the file" for n in missing] + [
            f"{k}: in the file, not in the model" for k in unexpected
        ]
        available = set(reader.keys())
        problems += [
            f"{n}: shape {list(reader.shape('model/' + n))} in the file, {list(s)} in the model"
            for n, s in wanted.items()
            if f"model/{n}" in available and tuple(reader.shape("model/" + n)) != tuple(s)
        ]
        if optimizer_state is not None:
            params = {n for n, _ in strategy.unwrap_model(model).named_parameters()}
            problems += [
                f"{n}: optimizer state for a parameter the model has not" for n in optimizer_state if n not in params
            ]
            reader = WithOptimizerState(reader, optimizer_state)
        if problems:
            error = (
                f"{p} does not match {type(strategy.unwrap_model(model)).__name__} ({len(problems)} difference(s)): "
                + "; ".join(problems[:6])
            )
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it before anything is loaded
        error = f"{type(e).__name__}: {e}"
    try:
        agree(error, device, f"engine.load_model({str(path)!r})")
        assert reader is not None
        strategy.load_sharded_state(model, list(optimizers or []), reader)
    finally:
        if closer is not None:
            closer.close()
    if dist.is_initialized():
        watched(dist.barrier)
