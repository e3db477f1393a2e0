"""Reading other tools' pickles without running their code: the one way phalanx opens a foreign ``.pt`` or a DCP
``.metadata`` file.

Two forms reach us:

- a ``torch.save`` zip (DeepSpeed's ``*_model_states.pt`` and ``*_optim_states.pt``, Accelerate's ``optimizer.bin``,
  the items inside a DCP ``.distcp`` file) is read with ``torch.load(weights_only=True)``, which rebuilds tensors and
  plain containers only. The few DeepSpeed classes its files hold (the loss scaler, the ZeRO stage enum, a fragment
  address) are admitted under their names as inert stand-ins defined here: their state is kept as data, and
  DeepSpeed itself is never imported.
- a plain pickle (DCP's ``.metadata``, written by ``pickle.dump``) goes through :class:`RestrictedUnpickler`, whose
  ``find_class`` answers exactly the names in its allowlist (torch's DCP metadata dataclasses, ``torch.Size``, the
  dtypes and layouts) and refuses every other name before anything is called.

Anything else (a reduce that names ``os.system``, ``builtins.eval``, a class of the writer's own) is refused with a
:class:`~phalanx.checkpoint.format.CheckpointError` that names the global, the file and the way out.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from phalanx.checkpoint.format import CheckpointError

__all__ = ["RestrictedUnpickler", "load_pickle", "load_torch_file", "Opaque"]


class Opaque:
    """A stand-in for an object of another tool's class (DeepSpeed's ``LossScaler``): its constructor arguments and
    state are kept as plain data, and none of its methods exist."""

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"Opaque({self.state!r})"


class _LossScaler(Opaque):
    pass


class _FragmentAddress(Opaque):
    """DeepSpeed's ``tensor_fragment.fragment_address`` (where a parameter lies in a flat partition: two ints)."""


def _zero_stage(value: int) -> int:
    """DeepSpeed's ``ZeroStageEnum(value)``, read as the plain int it wraps."""
    return int(value)


_DEEPSPEED: list[Any] = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def _numpy_globals() -> list[Any]:
    """numpy's generator state (Accelerate's and transformers' RNG files): arrays and dtypes, no code."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_torch_file(path: str | Path, data: bytes | None = None) -> Any:
    """A ``torch.save`` file (or its bytes), with ``torch.load(weights_only=True)``: tensors, containers, numbers,
    strings and DeepSpeed's few metadata classes as stand-ins; anything else is refused."""
    source: Any = io.BytesIO(data) if data is not None else path
    try:
        with torch.serialization.safe_globals([*_DEEPSPEED, *_numpy_globals()]):
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch's reason (the global it refused) is the useful part
        reason = str(e).strip().splitlines()
        short = next(
            (x for x in reason if "Unsupported global" in x or "unrecognized" in x), reason[0] if reason else ""
        )
        raise CheckpointError(
            f"{path} was refused: phalanx reads another tool's pickle only with torch.load(weights_only=True), which "
            f"rebuilds tensors and plain data and runs no code, and this file needs more ({type(e).__name__}: "
            f"{short}). A file that names a function or class to call can run any code when unpickled, so it is "
            "never read; if the file is yours and trusted, convert it to safetensors with the tool that wrote it"
        ) from None


def _dcp_allowlist() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    names: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("pathlib", "PosixPath"): PurePosixPath,  # the checkpoint's own path, kept as a name and never touched
        ("pathlib", "WindowsPath"): PureWindowsPath,
        ("pathlib", "PurePosixPath"): PurePosixPath,
        ("pathlib", "PureWindowsPath"): PureWindowsPath,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
    }
    for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"):  # fmt: skip
        if hasattr(metadata, name):
            names[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    for attr in dir(torch):
        value = getattr(torch, attr, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            names[("torch", attr)] = value
    return names


class RestrictedUnpickler(pickle.Unpickler):
    """A plain pickle that may name only the globals of its ``allowlist``; every other global is refused before it
    is looked up, so no reduce can call anything outside it. The default allowlist is torch DCP's ``.metadata``:
    its dataclasses, ``torch.Size``, dtypes, layouts and memory formats."""

    def __init__(self, file: Any, where: str, allowlist: dict[tuple[str, str], Any] | None = None) -> None:
        super().__init__(file)
        self.where = where
        self.allowlist = _dcp_allowlist() if allowlist is None else allowlist

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowlist.get((module, name))
        if found is None:
            raise CheckpointError(
                f"{self.where} was refused: it names {module}.{name}, which is not one of the metadata classes "
                "phalanx allows in this file. Unpickling it could run any code, so it is never read (a genuine "
                "torch DCP .metadata names only torch's checkpoint metadata classes; was the file replaced?)"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(
            f"{self.where} was refused: it holds a persistent id ({pid!r}), which a .metadata has not"
        )


def load_pickle(path: str | Path, allowlist: dict[tuple[str, str], Any] | None = None) -> Any:
    """A plain pickle file through :class:`RestrictedUnpickler` (a ``torch.save`` zip through ``load_torch_file``)."""
    p = Path(path)
    if zipfile.is_zipfile(p):
        return load_torch_file(p)
    with open(p, "rb") as f:
        try:
            return RestrictedUnpickler(f, str(p), allowlist).load()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged file: say which, and what failed
            raise CheckpointError(
                f"{p} could not be read as a pickle ({type(e).__name__}: {e}); is it damaged?"
            ) from None
