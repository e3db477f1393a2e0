"""``engine.save_model``'s directory: one that transformers' ``from_pretrained`` loads, and plain torch too.

    engine.save_model("out/model")                          # every rank; rank 0 writes
    AutoModelForCausalLM.from_pretrained("out/model")       # a transformers model
    model.load_state_dict(safetensors.torch.load_file("out/model/model.safetensors"))   # any module

A transformers model is written by its own ``save_pretrained``, given the gathered state dict: transformers then
decides what its loader expects (``config.json``, the generation config, which name of a tied weight is kept, any
renaming of its weights). Any other module gets ``model.safetensors`` with every key of its ``state_dict()`` and
``config.json`` when it has a config that can write one.
"""

from __future__ import annotations

import copy
import json
import math
import os
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.checkpoint.format import SAFETENSORS_DTYPE, model_key, save_model_file, write_json_durably
from phalanx.checkpoint.model_files import INDEX
from phalanx.checkpoint.read import Checkpoint
from phalanx.checkpoint.state import agree

__all__ = [
    "write_model_dir",
    "is_transformers_model",
    "export_model_files",
    "model_files_writer",
    "write_safetensors_streamed",
]


def is_transformers_model(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (checked without importing transformers: the model's class did)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def write_model_dir(
    state: dict[str, torch.Tensor],
    module: nn.Module,
    directory: Path,
    metadata: dict[str, str] | None,
    is_main: bool,
    device: torch.device,
) -> Path:
    """Rank 0 writes ``state`` (the whole state dict, tied keys sharing one tensor as in ``module.state_dict()``) for
    ``module`` into ``directory``; every rank raises if that failed (call it on all). Returns the path of
    ``model.safetensors`` (transformers writes a model over its ``max_shard_size``, 50 GB by default in version 5, as
    shards and an index instead)."""
    hf = is_transformers_model(module)
    if hf and metadata:
        raise ValueError(
            f"engine.save_model(metadata={metadata!r}) with a transformers model: its save_pretrained writes the "
            "safetensors header itself ({'format': 'pt'}); drop metadata=, or, on every rank, state = "
            "engine.get_state_dict(model), then on the main process "
            "safetensors.torch.save_file(state, path, metadata=...)"
        )
    path = directory / "model.safetensors"
    error = None
    if is_main:
        try:
            if hf:
                # transformers keeps one name of each shared tensor (the one its loader re-ties the others to) and
                # pops what it writes from the dict it is given.
                module.save_pretrained(directory, state_dict=dict(state))  # type: ignore[operator]
            else:
                save_model_file(state, path, {"format": "pt", **(metadata or {})})
                _write_config(module, directory)
        except Exception as e:  # noqa: BLE001 - the other ranks must not wait for rank 0 forever
            error = f"{type(e).__name__}: {e}"
    agree(error, device, f"engine.save_model to {directory}")
    return path


def _write_config(module: nn.Module, directory: Path) -> None:
    """``config.json`` from a config object that can write one (a transformers ``PretrainedConfig``, say); for a
    transformers model, with the ``architectures`` and ``dtype`` its ``save_pretrained`` records, and its generation
    config when it generates."""
    config = getattr(module, "config", None)
    if is_transformers_model(module) and config is not None:
        config = copy.deepcopy(config)
        config.architectures = [type(module).__name__]
        config.dtype = str(next(iter(module.parameters()), torch.empty(0)).dtype).removeprefix("torch.")
        generation = getattr(module, "generation_config", None)
        if generation is not None and callable(getattr(module, "can_generate", None)) and module.can_generate():  # type: ignore[operator]
            generation.save_pretrained(directory)
    if callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(directory)  # type: ignore[union-attr]
    elif callable(getattr(config, "to_json_file", None)):
        directory.mkdir(parents=True, exist_ok=True)
        config.to_json_file(directory / "config.json")  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------ from a checkpoint, streamed
HF_SHARD_SIZE = 50 * 10**9  # transformers 5's default max_shard_size ("50GB")
_CHUNK_BYTES = 64 << 20


def export_model_files(
    ck: Checkpoint, module: nn.Module, directory: Path, model_index: int = 0, max_shard_size: int = HF_SHARD_SIZE
) -> list[Path]:
    """Write model ``model_index`` of the checkpoint ``ck`` into ``directory`` as ``save_pretrained`` would:
    ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``
    when over ``max_shard_size`` bytes) and ``config.json``, so that ``from_pretrained(directory)`` loads it.

    The tensors are streamed from the checkpoint's shard files in pieces of at most 64 MiB: no rank ever holds the
    whole model (under zero3 the shards are the only place it exists whole). A transformers model keeps one name of
    each tied weight and drops its ``_keys_to_ignore_on_save``, as its ``save_pretrained`` does; any other module
    gets every key of its ``state_dict()``. Returns the weight files written."""
    models = ck.manifest["models"]
    keys: dict[str, str] = models[model_index]["state_dict_keys"]  # state_dict key -> the name it is stored under
    if is_transformers_model(module):
        ignored = set(getattr(module, "_keys_to_ignore_on_save", None) or ())
        names = {stored: stored for stored in dict.fromkeys(keys.values()) if stored not in ignored}
    else:
        names = dict(keys)
    items = [(name, model_key("model", model_index, stored)) for name, stored in names.items()]
    sizes = [ck.tensor_bytes(key) for _, key in items]
    groups: list[list[tuple[str, str]]] = [[]]
    used = 0
    for item, size in zip(items, sizes):
        if groups[-1] and used + size > max_shard_size:
            groups.append([])
            used = 0
        groups[-1].append(item)
        used += size
    directory.mkdir(parents=True, exist_ok=True)
    if len(groups) == 1:
        paths = [directory / "model.safetensors"]
    else:
        paths = [directory / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for path, group in zip(paths, groups):
        write_safetensors_streamed(ck, group, path)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(sizes)},
            "weight_map": {name: path.name for path, group in zip(paths, groups) for name, _ in group},
        }
        write_json_durably(directory / INDEX, index)
    _write_config(module, directory)
    return paths


def model_files_writer(models: list[nn.Module], unwrap: Callable[[nn.Module], nn.Module]) -> Callable[[Path], None]:
    """What ``save_checkpoint(also_write=...)`` runs to put the one model's files beside its checkpoint."""
    if len(models) != 1:
        raise ValueError(
            f"engine.save_state(model_files=True) writes one model's files; {len(models)} models are prepared: save "
            "without model_files, and call engine.save_model(model, directory) for each"
        )
    module = unwrap(models[0])

    def write(directory: Path) -> None:
        with Checkpoint(directory) as ck:
            export_model_files(ck, module, directory)

    return write


def write_safetensors_streamed(ck: Checkpoint, items: list[tuple[str, str]], path: Path) -> None:
    """One safetensors file holding, under each ``name``, the checkpoint's tensor ``key`` (``items`` are (name,
    key) pairs), copied from the shard files piece by piece; written under a temporary name, fsynced, renamed. The
    header goes first: the checkpoint's manifest knows every dtype and shape."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, key in items:
        size = ck.tensor_bytes(key)
        info = ck.tensors[key]
        header[name] = {
            "dtype": SAFETENSORS_DTYPE[info["dtype"]],
            "shape": list(info["shape"]),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")  # a file that is there is whole
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, key in items:
            numel = math.prod(ck.tensors[key]["shape"])
            step = max(1, _CHUNK_BYTES // max(1, ck.dtype(key).itemsize))
            for a in range(0, numel, step):
                piece = ck.read(key, a, min(numel, a + step))
                f.write(memoryview(piece.view(torch.uint8).numpy()))  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
