"""A torch Distributed Checkpoint (DCP) directory, as FSDP2, torchtitan and Accelerate's FSDP write it: ``.metadata``
(a pickle of torch's metadata dataclasses) and ``__R_I.distcp`` files holding each tensor's chunks as ``torch.save``
blobs (or raw bytes) at the offsets the metadata gives.

``.metadata`` is read with the restricted unpickler (unpickle.py), each chunk with ``torch.load(weights_only=True)``.
A tensor is assembled whole from its chunks when a rank first asks for part of it; only the last one is kept.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.foreign.unpickle import load_pickle, load_torch_file
from phalanx.checkpoint.format import CheckpointError

__all__ = ["DcpCheckpoint", "METADATA"]

METADATA = ".metadata"


class DcpCheckpoint:
    """The keys of a DCP checkpoint (DCP's flattened names: ``model.fc1.weight``, ``optim.state.fc1.weight.exp_avg``,
    ``optim.param_groups.0.lr``), their shapes and dtypes, tensors read whole, and the small non-tensor items."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        meta_file = self.path / METADATA
        if not meta_file.is_file():
            raise CheckpointError(f"{self.path} has no {METADATA}, so it is no torch DCP checkpoint")
        meta = load_pickle(meta_file)
        if not hasattr(meta, "state_dict_metadata") or not hasattr(meta, "storage_data"):
            raise CheckpointError(f"{meta_file} holds a {type(meta).__name__}, not DCP's Metadata; is it damaged?")
        self.tensors: dict[str, Any] = {}
        self.bytes_items: dict[str, Any] = {}
        for key, md in meta.state_dict_metadata.items():
            if hasattr(md, "chunks"):
                self.tensors[key] = md
            else:
                self.bytes_items[key] = md
        self.storage: dict[tuple[str, tuple[int, ...]], Any] = {}
        for index, info in meta.storage_data.items():
            self.storage[(index.fqn, tuple(index.offset) if index.offset is not None else ())] = info
        self._cached: tuple[str, torch.Tensor] | None = None

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def _slice(self, key: str, info: Any) -> bytes:
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{self.path / info.relative_path}: {key} is stored with the transforms {info.transform_descriptors} "
                "(DCP's compression extensions), which phalanx does not read; save it again without them"
            )
        with open(self.path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise CheckpointError(
                f"{self.path / info.relative_path} ends before {key}'s bytes do ({info.offset} + {info.length}); the "
                "file is truncated: copy the whole checkpoint again"
            )
        return data

    def whole(self, key: str) -> torch.Tensor:
        """Tensor ``key``, assembled from every chunk that any rank wrote."""
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        md = self.tensors[key]
        shape, dtype = tuple(md.size), md.properties.dtype
        out = torch.zeros(shape, dtype=dtype)
        covered = 0
        for chunk in md.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            info = self.storage.get((key, offsets))
            if info is None:
                raise CheckpointError(
                    f"{self.path / METADATA} lists a chunk of {key} at {list(offsets)} with no storage"
                )
            data = self._slice(key, info)
            where = f"{self.path / info.relative_path} ({key})"
            if data[:4] == b"PK\x03\x04" and zipfile.is_zipfile(io.BytesIO(data)):
                piece = load_torch_file(where, data)
            else:  # DCP's raw serialization: the chunk's bytes as they lie in memory
                piece = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
            if not isinstance(piece, torch.Tensor) or piece.numel() != math.prod(sizes):
                raise CheckpointError(
                    f"{where}: a chunk of {list(sizes)} elements holds {type(piece).__name__} instead"
                )
            view = out
            for dim, (o, s) in enumerate(zip(offsets, sizes)):
                view = view.narrow(dim, o, s)
            view.copy_(piece.reshape(sizes))
            covered += math.prod(sizes)
        if covered != math.prod(shape):
            raise CheckpointError(
                f"{self.path}: the chunks of {key} cover {covered} of its {math.prod(shape)} elements; a rank's file "
                "is missing from the checkpoint"
            )
        self._cached = (key, out)
        return out

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self.whole(key).reshape(-1)[start:stop]

    def item(self, key: str) -> Any:
        """A non-tensor item (``optim.param_groups.0.lr``, torchtitan's ``train_state``), read with weights_only."""
        info = self.storage.get((key, ()))
        if info is None:
            info = next((v for (fqn, _), v in self.storage.items() if fqn == key), None)
        if info is None:
            raise CheckpointError(f"{self.path / METADATA} lists {key} with no storage")
        return load_torch_file(f"{self.path / info.relative_path} ({key})", self._slice(key, info))
