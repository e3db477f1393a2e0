"""An Accelerate ``save_state`` folder: ``model.safetensors`` (``pytorch_model.bin`` without safe serialization),
``optimizer.bin``, ``scheduler.bin`` and ``random_states_R.pkl``; under FSDP, ``pytorch_model_fsdp_0/`` and
``optimizer_0/`` are torch DCP directories instead of the first two.

``optimizer.bin`` is a torch optimizer's ``state_dict()``, which numbers the parameters across its groups. The numbers
are matched to names by the group's ``param_names`` where torch recorded them (an optimizer built from
``model.named_parameters()``), else by the order of the parameters in this run's optimizer (the same model and
optimizer built the same way), else, with one group, by ``model.named_parameters()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.foreign.unpickle import load_torch_file
from phalanx.checkpoint.format import CheckpointError

__all__ = ["is_accelerate", "read_accelerate", "FSDP_MODEL", "FSDP_OPTIMIZER"]

FSDP_MODEL = "pytorch_model_fsdp_0"
FSDP_OPTIMIZER = "optimizer_0"
_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def is_accelerate(path: Path) -> bool:
    has_state = (path / "optimizer.bin").is_file() or any(path.glob("random_states_*.pkl"))
    return (path / FSDP_MODEL).is_dir() or (has_state and any((path / w).is_file() for w in _WEIGHTS))


def _weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))
    state = load_torch_file(path / "pytorch_model.bin")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / 'pytorch_model.bin'} holds a {type(state).__name__}, not a state dict")
    return state


def _optimizer_by_name(
    saved: dict[str, Any], order: list[list[str]] | None, params: list[str], where: Path
) -> dict[str, dict[str, Any]]:
    groups = saved.get("param_groups", [])
    by_index: dict[int, str] = {}
    if all("param_names" in g for g in groups):
        by_index = {i: n for g in groups for i, n in zip(g["params"], g["param_names"])}
    elif (
        order is not None
        and [len(g["params"]) for g in groups] == [len(o) for o in order]
        and all(n for o in order for n in o)
    ):
        by_index = {i: n for g, names in zip(groups, order) for i, n in zip(g["params"], names)}
    elif len(groups) == 1 and len(groups[0]["params"]) == len(params):
        by_index = dict(zip(groups[0]["params"], params))
    else:
        raise CheckpointError(
            f"{where} numbers its parameters in {len(groups)} group(s) of {[len(g['params']) for g in groups]} and "
            "records no names, and this run's optimizer does not list the same numbers of model parameters, so they "
            "cannot be matched by name: build the optimizer from model.named_parameters() (torch then saves the "
            "names), or with the same groups as the run that saved it"
        )
    return {by_index[i]: dict(s) for i, s in saved.get("state", {}).items() if i in by_index}


def read_accelerate(
    path: Path, order: list[list[str]] | None, params: list[str], rank: int, world: int
) -> dict[str, Any]:
    """Read the folder: the same fields as ``read_deepspeed``, plus ``rng`` (this rank's generators, when it saved on
    this world size). ``order`` is this run's optimizer's parameter names by group (None when not known); ``params``
    the model's trainable parameter names in order."""
    notes: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    param_groups = None
    dcp_dirs: list[Path] = []
    if (path / FSDP_MODEL).is_dir():
        dcp_dirs.append(path / FSDP_MODEL)
        if (path / FSDP_OPTIMIZER).is_dir():
            dcp_dirs.append(path / FSDP_OPTIMIZER)
        else:
            notes.append(f"{path} has no {FSDP_OPTIMIZER}/: the optimizer starts afresh from the checkpoint's weights")
    else:
        tensors.update({f"model/{k}": v for k, v in _weights(path).items()})
        if (path / "optimizer.bin").is_file():
            saved = load_torch_file(path / "optimizer.bin")
            state = _optimizer_by_name(saved, order, params, path / "optimizer.bin")
            for name, per_param in state.items():
                for k, v in per_param.items():
                    if isinstance(v, torch.Tensor):
                        tensors[f"optim/{name}/{k}"] = v
            param_groups = [
                {k: v for k, v in g.items() if k not in ("params", "param_names")} for g in saved["param_groups"]
            ]
        else:
            notes.append(f"{path} has no optimizer.bin: the optimizer starts afresh from the checkpoint's weights")
    if any(path.glob("optimizer_[1-9]*.bin")) or any(path.glob("model_[1-9]*.safetensors")):
        notes.append(f"{path} holds more than one model or optimizer; only the first of each is read")
    scheduler = None
    if (path / "scheduler.bin").is_file():
        try:
            scheduler = load_torch_file(path / "scheduler.bin")
        except CheckpointError as e:
            notes.append(f"the LR scheduler's state is not carried over ({e})")
    rng = None
    rng_file = path / f"random_states_{rank}.pkl"
    saved_world = len(list(path.glob("random_states_*.pkl")))
    if rng_file.is_file():
        states = load_torch_file(rng_file)  # its "step" counts accumulate() windows, not optimizer steps: unused
        if saved_world == world:
            rng = states
        else:
            notes.append(
                f"the random generator states were saved by {saved_world} process(es) and this run has {world}: "
                "they are not carried over, and dropout and other draws follow this run's seed"
            )
    else:
        notes.append("the folder has no random_states file: dropout and other draws follow this run's seed")
    for name, what in (("sampler.bin", "the sampler's state"), ("dl_state_dict.bin", "the DataLoader's position"),
                       ("scaler.pt", "the fp16 loss scale")):  # fmt: skip
        if (path / name).is_file():
            notes.append(f"{what} ({name}) is not carried over: phalanx's own starts afresh")
    custom = sorted(p.name for p in path.glob("custom_checkpoint_*.pkl"))
    if custom:
        notes.append(
            f"objects registered for checkpointing ({', '.join(custom)}) are not read: they are pickled objects"
        )
    return {
        "tensors": tensors,
        "dcp": dcp_dirs,
        "param_groups": param_groups,
        "global_step": None,  # the optimizer's own step count, read by the caller
        "scheduler": scheduler,
        "rng": rng,
        "notes": notes,
        "description": f"Accelerate save_state folder {path}" + (" (FSDP, torch DCP)" if dcp_dirs else ""),
    }
