"""A DeepSpeed ZeRO 1/2/3 checkpoint: ``latest`` naming a ``global_stepN/`` directory that holds the model states
(``mp_rank_00_model_states.pt``; under ZeRO-3 one ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank) and each
rank's optimizer states (``zero_pp_rank_R_mp_rank_00_optim_states.pt``, ``bf16_`` in front under bf16).

The optimizer files hold each rank's partition of the flat fp32 master weights and of the moments, which have the same
layout. They are put back together as DeepSpeed's ``zero_to_fp32.py`` does:

- ZeRO-1/2: a group's partitions, laid end to end over the ranks, are its parameters in ``param_shapes`` order, each
  followed by its alignment padding where the file records one;
- ZeRO-3: each parameter is cut in ``ceil(numel / world)`` elements per rank, and a rank's groups, end to end, hold its
  piece of every parameter in order; a parameter is its ranks' pieces end to end, cut to its size.

Buffers come from the model states' ``module``; tied weights (``shared_params``) under both names.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.foreign.unpickle import Opaque, load_torch_file
from phalanx.checkpoint.format import CheckpointError

__all__ = ["read_deepspeed", "deepspeed_dir", "is_deepspeed"]

_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL3 = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_TAG = re.compile(r"global_step(\d+)")


def _is_tag_dir(p: Path) -> bool:
    return p.is_dir() and any(p.glob("*model_states.pt"))


def is_deepspeed(path: Path) -> bool:
    """``path`` is a DeepSpeed checkpoint (``latest`` and its tag, or ``global_stepN/`` directories) or one tag."""
    if _is_tag_dir(path):
        return True
    if (path / "latest").is_file():
        return True
    return any(_TAG.fullmatch(p.name) and _is_tag_dir(p) for p in path.glob("global_step*"))


def deepspeed_dir(path: Path) -> Path:
    """The tag directory to read: the one ``latest`` names, else the highest ``global_stepN``."""
    if _is_tag_dir(path):
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if not tag or "/" in tag or tag in (".", ".."):
            raise CheckpointError(f"{latest} names {tag!r}, which is no checkpoint tag (e.g. global_step500)")
        if not _is_tag_dir(path / tag):
            raise CheckpointError(f"{latest} names {tag!r}, and {path / tag} holds no *_model_states.pt; copy it too")
        return path / tag
    tags = sorted((int(m.group(1)), p) for p in path.glob("global_step*") if (m := _TAG.fullmatch(p.name)))
    tags = [(n, p) for n, p in tags if _is_tag_dir(p)]
    if not tags:
        raise CheckpointError(f"{path} holds no DeepSpeed checkpoint (no latest, no global_stepN/ with model states)")
    return tags[-1][1]


def _ranked(files: list[Path], pattern: re.Pattern[str], where: Path, what: str) -> list[Path]:
    ranked: dict[int, Path] = {}
    for f in files:
        m = pattern.fullmatch(f.name)
        if m is None:
            continue
        if int(m.group(2)) != 0:
            raise CheckpointError(
                f"{f}: DeepSpeed model parallelism (mp_rank {m.group(2)}) is not read; phalanx reads data-parallel "
                "ZeRO checkpoints (mp_rank_00 only). Convert it with DeepSpeed's zero_to_fp32.py and load the weights"
            )
        ranked[int(m.group(1))] = f
    n = len(ranked)
    if sorted(ranked) != list(range(n)):
        missing = sorted(set(range(max(ranked) + 1)) - set(ranked)) if ranked else [0]
        raise CheckpointError(f"{where} lacks the {what} of rank(s) {missing}: copy every rank's file")
    return [ranked[r] for r in range(n)]


def _group_states(osd: dict[str, Any], stage: int) -> list[dict[str, Any]]:
    """The base optimizer's state of each flat group (``exp_avg``, ``exp_avg_sq``, ``step`` ...)."""
    base = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    if isinstance(base, dict) and "state" in base:
        state = base["state"]
        return [dict(state[k]) for k in sorted(state)]
    if isinstance(base, list):  # older DeepSpeed: one state dict per group
        return [dict(s) for s in base]
    raise CheckpointError(f"a DeepSpeed ZeRO-{stage} optimizer file holds no base optimizer state it can read")


def _param_groups(osd: dict[str, Any], stage: int) -> list[dict[str, Any]] | None:
    base = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    if isinstance(base, dict) and isinstance(base.get("param_groups"), list):
        return [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
    return None


def read_deepspeed(path: Path) -> dict[str, Any]:
    """Read the DeepSpeed checkpoint at ``path``: ``tensors`` (``model/<name>``, ``optim/<name>/<state>``, whole),
    ``param_groups``, ``global_step``, ``scheduler``, ``notes`` (what is not carried over) and ``description``."""
    tag = deepspeed_dir(path)
    files = sorted(tag.iterdir())
    optim_files = _ranked(files, _OPTIM, tag, "optimizer states (zero_pp_rank_R_mp_rank_00_optim_states.pt)")
    single = tag / "mp_rank_00_model_states.pt"
    model_files = [single] if single.is_file() else _ranked(files, _MODEL3, tag, "model states")
    models = [load_torch_file(f) for f in model_files]
    optims = [load_torch_file(f)["optimizer_state_dict"] for f in optim_files]
    if not optims:
        raise CheckpointError(
            f"{tag} has model states but no zero_pp_rank_*_optim_states.pt: a checkpoint without ZeRO (stage 0) keeps "
            "a torch optimizer by index, which phalanx does not match by name. Save it with ZeRO 1, 2 or 3, or load "
            "the weights only with engine.load_model after DeepSpeed's zero_to_fp32.py"
        )
    stage = int(optims[0].get("zero_stage", 0))
    world = len(optims)
    saved_world = models[0].get("dp_world_size", world)
    if saved_world != world:
        raise CheckpointError(f"{tag} was saved on {saved_world} data-parallel ranks and holds {world} optimizer files")
    head = models[0]
    shapes: list[dict[str, Any]] = list(head.get("param_shapes") or [])
    if not shapes:
        raise CheckpointError(f"{model_files[0]} has no param_shapes, which names DeepSpeed's flat parameters")
    tensors: dict[str, torch.Tensor] = {}
    states = [_group_states(o, stage) for o in optims]
    group_steps: list[torch.Tensor | None] = [s.get("step") for s in states[0]]

    if stage in (1, 2):
        paddings = optims[0].get("param_alignment_paddings")
        for g, group_shapes in enumerate(shapes):
            parts = [o["single_partition_of_fp32_groups"][g] for o in optims]
            full = torch.cat([p.reshape(-1) for p in parts])
            moments = {
                k: torch.cat([s[g][k].reshape(-1) for s in states])
                for k, v in states[0][g].items()
                if isinstance(v, torch.Tensor) and v.numel() == parts[0].numel() and v.dim() > 0
            }
            offset = 0
            for i, (name, shape) in enumerate(group_shapes.items()):
                numel = math.prod(shape)
                if offset + numel > full.numel():
                    raise CheckpointError(
                        f"{tag}: group {g}'s partitions hold {full.numel()} elements, fewer than its parameters need "
                        f"(at {name}); is a rank's optimizer file from another run?"
                    )
                tensors[f"model/{name}"] = full[offset : offset + numel].view(tuple(shape))
                for k, m in moments.items():
                    tensors[f"optim/{name}/{k}"] = m[offset : offset + numel].view(tuple(shape))
                if group_steps[g] is not None:
                    tensors[f"optim/{name}/step"] = group_steps[g]  # type: ignore[assignment]
                offset += numel + (int(paddings[g][i]) if paddings else 0)
    elif stage == 3:
        vectors = [torch.cat([t.reshape(-1) for t in o["fp32_flat_groups"]]) for o in optims]
        bounds = [0]
        for t in optims[0]["fp32_flat_groups"]:
            bounds.append(bounds[-1] + t.numel())
        moment_names = [k for k, v in states[0][0].items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        by_rank = {k: [torch.cat([s[k].reshape(-1) for s in per_rank]) for per_rank in states] for k in moment_names}
        offset = 0
        for group_shapes in shapes:
            for name, shape in group_shapes.items():
                numel = math.prod(shape)
                piece = math.ceil(numel / world)
                if offset + piece > vectors[0].numel():
                    raise CheckpointError(
                        f"{tag}: the ZeRO-3 partitions end before {name}; a rank's file is from another run"
                    )
                tensors[f"model/{name}"] = torch.cat([v[offset : offset + piece] for v in vectors])[:numel].view(
                    tuple(shape)
                )
                for k, per_rank in by_rank.items():
                    tensors[f"optim/{name}/{k}"] = torch.cat([v[offset : offset + piece] for v in per_rank])[
                        :numel
                    ].view(tuple(shape))
                g = max(i for i, b in enumerate(bounds[:-1]) if b <= offset)
                if g < len(group_steps) and group_steps[g] is not None:
                    tensors[f"optim/{name}/step"] = group_steps[g]  # type: ignore[assignment]
                offset += piece
    else:
        raise CheckpointError(f"{optim_files[0]} records ZeRO stage {stage}; phalanx reads stages 1, 2 and 3")

    module = head.get("module") or {}
    for name in head.get("buffer_names") or []:
        if name in module:
            tensors[f"model/{name}"] = module[name]
    frozen = head.get("frozen_param_shapes") or {}
    for name, shape in frozen.items():
        numel = math.prod(shape)
        if stage == 3:
            pieces = [m.get("frozen_param_fragments", {}).get(name) for m in models]
            if any(p is None for p in pieces):
                raise CheckpointError(f"{tag}: the frozen parameter {name} is missing from a rank's model states")
            tensors[f"model/{name}"] = torch.cat([p.reshape(-1) for p in pieces])[:numel].view(tuple(shape))
        elif name in module and module[name].numel() == numel:
            tensors[f"model/{name}"] = module[name]
    for alias, owner in (head.get("shared_params") or {}).items():
        for key in [k for k in tensors if k == f"model/{owner}" or k.startswith(f"optim/{owner}/")]:
            tensors[key.replace(owner, alias, 1)] = tensors[key]

    notes = ["DeepSpeed saves no random generator state, so dropout and other draws follow this run's seed"]
    scaler = optims[0].get("loss_scaler")
    scale = scaler.state.get("cur_scale") if isinstance(scaler, Opaque) and isinstance(scaler.state, dict) else None
    if optims[0].get("dynamic_loss_scale") or (scale is not None and float(scale) != 1.0):
        notes.append(
            f"DeepSpeed's fp16 loss scale (cur_scale={scale}) is not carried over: phalanx's scaler starts from its "
            "initial scale and finds its level again in a few steps"
        )
    known = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
             "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
             "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
             "ds_version", "sparse_tensor_module_names", "zero_stage"}  # fmt: skip
    client = sorted(k for k in head if k not in known)
    if client:
        notes.append(f"DeepSpeed's client_state ({', '.join(client)}) is not read: restore it yourself if you need it")
    if head.get("data_sampler") is not None:
        notes.append("DeepSpeed's data sampler state is not carried over: the data order follows this run's loader")
    return {
        "tensors": tensors,
        "param_groups": _param_groups(optims[0], stage),
        "global_step": head.get("global_steps"),
        "scheduler": head.get("lr_scheduler"),
        "notes": notes,
        "description": f"DeepSpeed {head.get('ds_version', '?')} ZeRO-{stage} checkpoint {tag} ({world} rank(s))",
    }
