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

import sys
from pathlib import Path

import torch
from torch import nn

from phalanx.checkpoint.format import save_model_file
from phalanx.checkpoint.state import agree

__all__ = ["write_model_dir", "is_transformers_model"]


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
    """``config.json`` from a config object that can write one (a transformers ``PretrainedConfig``, say)."""
    config = getattr(module, "config", None)
    if callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(directory)  # type: ignore[union-attr]
    elif callable(getattr(config, "to_json_file", None)):
        directory.mkdir(parents=True, exist_ok=True)
        config.to_json_file(directory / "config.json")  # type: ignore[union-attr]
