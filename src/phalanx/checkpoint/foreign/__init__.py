"""Continuing another tool's run: ``engine.load_state`` and the Trainer's ``resume_from_checkpoint`` read

- a torch DCP checkpoint (``.metadata`` and ``__R_I.distcp``), as FSDP2 and torchtitan save it;
- an Accelerate ``save_state`` folder (``model.safetensors``, ``optimizer.bin`` ...; under FSDP, DCP directories);
- a DeepSpeed ZeRO 1/2/3 checkpoint (``latest``, ``global_stepN/``);
- through the Trainer, a transformers ``checkpoint-N/`` holding one of these (trainer/transformers_checkpoint.py).

Weights and optimizer moments are matched by parameter name and handed to the strategy as a StateReader
(``model/<name>``, ``optim/<name>/<state>``), so they load at any phalanx layout and world size. Every rank checks
the names and shapes against its model before anything is loaded, and an error names the parameter. What a
checkpoint holds that phalanx does not carry over (RNG states of another tool, a pickled sampler, DeepSpeed's loss
scale ...) is said once, with what happens instead.

Pickles are read only through unpickle.py: ``torch.load(weights_only=True)``, or an unpickler that allows exactly
DCP's metadata classes. See docs/foreign-checkpoints.md.

- ``unpickle.py``   the restricted readers of other tools' pickles
- ``dcp.py``        torch DCP directories: metadata, chunks, whole tensors
- ``deepspeed.py``  DeepSpeed ZeRO 1/2/3: flat fp32 partitions back into parameters and moments
- ``accelerate.py`` Accelerate ``save_state`` folders
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx.checkpoint.foreign.accelerate import is_accelerate, read_accelerate
from phalanx.checkpoint.foreign.dcp import METADATA, DcpCheckpoint
from phalanx.checkpoint.foreign.deepspeed import is_deepspeed, read_deepspeed
from phalanx.checkpoint.format import MANIFEST, CheckpointError
from phalanx.logging import get_logger

if TYPE_CHECKING:
    from phalanx.checkpoint.state import TrainingParts
    from phalanx.runtime.topology import Topology

__all__ = ["detect", "load_foreign", "ForeignState"]

_WRAPPERS = re.compile(r"(?:^|(?<=\.))(?:_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")
_HYPER_SKIP = {"params", "param_names", "foreach", "fused", "capturable", "differentiable"}


def detect(path: str | os.PathLike[str]) -> str | None:
    """Which other tool wrote the checkpoint at ``path``: ``"dcp"``, ``"deepspeed"``, ``"accelerate"``, or None (a
    phalanx checkpoint, or nothing phalanx recognises)."""
    p = Path(path).expanduser()
    if not p.is_dir() or (p / MANIFEST).is_file():
        return None
    if (p / METADATA).is_file():
        return "dcp"
    if is_deepspeed(p):
        return "deepspeed"
    if is_accelerate(p):
        return "accelerate"
    return None


class ForeignState:
    """A StateReader over another tool's checkpoint, in phalanx's names: ``model/<name>`` and
    ``optim/<name>/<state>`` map to whole tensors held in memory or to a DCP checkpoint's keys."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}
        self.mapped: dict[str, tuple[DcpCheckpoint, str]] = {}
        self.param_groups: list[dict[str, Any]] | None = None
        self.global_step: int | None = None
        self.scheduler: dict[str, Any] | None = None
        self.rng: dict[str, Any] | None = None
        self.notes: list[str] = []
        self.description = ""

    def keys(self) -> Iterable[str]:
        return [*self.held, *self.mapped]

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self.held:
            return tuple(self.held[key].shape)
        ck, k = self.mapped[key]
        return ck.shape(k)

    def dtype(self, key: str) -> torch.dtype:
        if key in self.held:
            return self.held[key].dtype
        ck, k = self.mapped[key]
        return ck.dtype(k)

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        if key in self.held:
            return self.held[key].reshape(-1)[start:stop]
        ck, k = self.mapped[key]
        return ck.read(k, start, stop)

    def read_into(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        out.copy_(self.read(key, start, stop))

    def add_dcp(self, ck: DcpCheckpoint, wanted: Iterable[str], params: set[str]) -> None:
        """Map the DCP checkpoint's keys to ours: the model's by the prefix under which the most of ``wanted`` lie
        (``model.``, none, ...), the optimizer's as ``...state.<name>.<state>``, its groups' hyperparameters as
        ``...param_groups.<i>.<key>``."""
        plain = {_WRAPPERS.sub("", k): k for k in ck.keys()}
        wanted = list(wanted)
        prefixes: dict[str, int] = {}
        for n in wanted:
            for k in plain:
                if k.endswith(n) and (len(k) == len(n) or k[-len(n) - 1] == ".") and "state." not in k[: -len(n)]:
                    prefixes[k[: -len(n)]] = prefixes.get(k[: -len(n)], 0) + 1
        used: set[str] = set()
        if prefixes:
            prefix = max(prefixes, key=lambda q: (prefixes[q], -len(q)))
            for n in wanted:
                if prefix + n in plain:
                    self.mapped[f"model/{n}"] = (ck, plain[prefix + n])
                    used.add(prefix + n)
        for k in plain:
            head, _, state = k.rpartition(".")
            for m in re.finditer(r"(?:^|(?<=\.))state\.", head):
                name = head[m.end() :]
                if name in params:
                    self.mapped[f"optim/{name}/{state}"] = (ck, plain[k])
                    used.add(k)
                    break
            if k.endswith("train_state.step") or k == "step":
                self.global_step = int(ck.whole(plain[k]).reshape(-1)[0])
                used.add(k)
        groups: dict[int, dict[str, Any]] = {}
        scheduler: dict[str, Any] = {}
        for key in ck.bytes_items:
            plain_key = _WRAPPERS.sub("", key)
            found = re.search(r"(?:^|\.)param_groups\.(\d+)\.([A-Za-z_]\w*)$", plain_key)
            if found is not None:
                if found.group(2) not in _HYPER_SKIP:
                    groups.setdefault(int(found.group(1)), {})[found.group(2)] = ck.item(key)
                used.add(plain_key)
            elif plain_key.endswith("param_groups"):  # the whole list as one item (an unflattened state dict)
                saved = ck.item(key)
                if isinstance(saved, list) and all(isinstance(g, dict) for g in saved):
                    for i, g in enumerate(saved):
                        groups[i] = {k: v for k, v in g.items() if k not in _HYPER_SKIP}
                used.add(plain_key)
            elif plain_key.startswith("lr_scheduler."):
                scheduler[plain_key.removeprefix("lr_scheduler.")] = ck.item(key)
                used.add(plain_key)
        if groups:
            self.param_groups = [groups[i] for i in sorted(groups)]
        if scheduler:
            self.scheduler = scheduler
        left = sorted({k.split(".")[0] for k in [*plain, *map(lambda b: _WRAPPERS.sub("", b), ck.bytes_items)]
                       if k not in used and not k.startswith(tuple(f"{p}." for p in ("lr_scheduler",)))})  # fmt: skip
        left = [x for x in left if not any(u.split(".")[0] == x for u in used)]
        if left:
            self.notes.append(
                f"{ck.path} also holds {', '.join(left)}, which phalanx does not read (a data loader's position or "
                "other state of the tool that wrote it): what it restored starts afresh here"
            )


def _open(
    path: Path, kind: str, parts: TrainingParts, model: Any, strategy: Any, rank: int, world: int
) -> ForeignState:
    wanted = list(strategy.state_shapes(model))
    module = strategy.unwrap_model(model)
    params = [n for n, p in module.named_parameters()]
    state = ForeignState()
    if kind == "dcp":
        ck = DcpCheckpoint(path)
        state.add_dcp(ck, wanted, set(params))
        state.description = f"torch DCP checkpoint {path}"
        state.notes.append("a torch DCP checkpoint holds no random generator state here: draws follow this run's seed")
        return state
    if kind == "deepspeed":
        read = read_deepspeed(path)
    else:
        read = read_accelerate(path, _optimizer_order(parts, module), params, rank, world)
        for d in read["dcp"]:
            state.add_dcp(DcpCheckpoint(d), wanted, set(params))
        state.rng = read["rng"]
    state.held = read["tensors"]
    state.param_groups = read["param_groups"] or state.param_groups
    state.global_step = read["global_step"] if read["global_step"] is not None else state.global_step
    state.scheduler = read["scheduler"] if read["scheduler"] is not None else state.scheduler
    state.notes += read["notes"]
    state.description = read["description"]
    return state


def _optimizer_order(parts: TrainingParts, module: Any) -> list[list[str]] | None:
    """This run's optimizer's parameter names by group, where its groups still hold the model's parameters (ddp);
    None where a strategy has put flat shards there."""
    if len(parts.optimizers) != 1:
        return None
    names = {id(p): n for n, p in module.named_parameters()}
    order = [[names.get(id(p), "") for p in g["params"]] for g in parts.optimizers[0].param_groups]
    return order if all(n for o in order for n in o) else None


def _problems(state: ForeignState, wanted: dict[str, tuple[int, ...]], params: list[str], parts: Any) -> list[str]:
    """Every way the checkpoint does not fit the model, each naming the parameter."""
    held = set(state.keys())
    problems = [f"{n}: not in the checkpoint" for n in wanted if f"model/{n}" not in held]
    problems += [
        f"{n}: shape {list(state.shape(f'model/{n}'))} in the checkpoint, {list(s)} in the model"
        for n, s in wanted.items()
        if f"model/{n}" in held and tuple(state.shape(f"model/{n}")) != tuple(s)
    ]
    extra = sorted(k.removeprefix("model/") for k in held if k.startswith("model/") and k[6:] not in wanted)
    problems += [f"{n}: in the checkpoint, not in the model" for n in extra]
    if parts.optimizers:
        moments = {k.split("/")[1] for k in held if k.startswith("optim/")}
        if not moments:
            state.notes.append("the checkpoint holds no optimizer state: the optimizer starts afresh from its weights")
        for n in params:
            if moments and n not in moments:
                problems.append(f"{n}: no optimizer state in the checkpoint, though other parameters have some")
            for k in [k for k in held if k.startswith(f"optim/{n}/")]:
                shape = tuple(state.shape(k))
                if shape not in ((), tuple(wanted.get(n, shape))):
                    problems.append(f"{k[6:]}: shape {list(shape)} in the checkpoint, {list(wanted[n])} in the model")
    return problems


def load_foreign(
    path: str | os.PathLike[str],
    kind: str,
    parts: TrainingParts,
    strategy: Any,
    topology: Topology,
    device: torch.device,
    weights_and_optimizer_only: bool = False,
) -> int | None:
    """Load another tool's checkpoint at ``path`` into ``parts`` on every rank (a collective): checks first, then
    the weights and moments through ``strategy``, then the optimizer's hyperparameters and, unless
    ``weights_and_optimizer_only`` (the Trainer reads the rest of a ``checkpoint-N/`` itself), the LR scheduler's
    counters and RNG. Returns the step the checkpoint was saved at, where it records one."""
    from phalanx.checkpoint.state import _reseed, agree
    from phalanx.runtime.collective_log import watched

    p = Path(path).expanduser()
    error, state = None, None
    try:
        if len(parts.models) != 1:
            raise CheckpointError(
                f"{p} is a {kind} checkpoint, which holds one model, and {len(parts.models)} models are prepared: "
                "prepare the one model it was saved from"
            )
        model = parts.models[0]
        wanted = strategy.state_shapes(model)
        params = [n for n, _ in strategy.unwrap_model(model).named_parameters()]
        state = _open(p, kind, parts, model, strategy, topology.rank, topology.world_size)
        problems = _problems(state, wanted, params, parts)
        if problems:
            raise CheckpointError(
                f"{state.description} does not match {type(strategy.unwrap_model(model)).__name__} "
                f"({len(problems)} difference(s)): "
                + "; ".join(problems[:6])
                + ("; ..." if len(problems) > 6 else "")
                + " (resume with the model that was saved, built the same way)"
            )
        if len(parts.optimizers) > 1:
            raise CheckpointError(f"{p} holds one optimizer's state, and {len(parts.optimizers)} are prepared")
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it before anything is loaded
        error = f"{type(e).__name__}: {e}"
    agree(error, device, f"loading the {kind} checkpoint {p}")
    assert state is not None
    strategy.load_sharded_state(parts.models[0], list(parts.optimizers), state)
    # Under the Trainer, a checkpoint-N/ has its own rng_state_R.pth, read there: no word about generators here.
    notes = [n for n in state.notes if not (weights_and_optimizer_only and "random generator" in n)]
    for opt in parts.optimizers:
        saved = state.param_groups
        if saved is None:
            continue
        if len(saved) != len(opt.param_groups):
            notes.append(
                f"the checkpoint's optimizer has {len(saved)} param group(s) and this one {len(opt.param_groups)}: "
                "the hyperparameters (lr, betas, weight decay) stay this run's"
            )
            continue
        for group, hyper in zip(opt.param_groups, saved):
            group.update({k: v for k, v in hyper.items() if k in group and k not in _HYPER_SKIP})
    step = state.global_step
    if step is None:
        steps = [state.read(k, 0, 1) for k in state.keys() if k.endswith("/step")]
        step = int(steps[0].reshape(-1)[0]) if steps else None
    if not weights_and_optimizer_only:
        _schedulers(parts, state, notes)
        if state.rng is not None:
            _set_accelerate_rng(state.rng, device)
        else:
            _reseed(parts.seed, int(step or 0), topology.rank, device)
    if topology.rank == 0:
        said = "; ".join(dict.fromkeys(notes))
        get_logger().warning(
            f"resumed from the {state.description}"
            + (f" at step {step}" if step is not None else "")
            + (f". Not carried over: {said}" if said else "")  # fmt: skip
        )
    if dist.is_initialized():
        watched(dist.barrier)
    return step


def _schedulers(parts: TrainingParts, state: ForeignState, notes: list[str]) -> None:
    if not parts.schedulers:
        return
    if state.scheduler is None or len(parts.schedulers) != 1:
        notes.append(
            "the checkpoint holds no LR scheduler state phalanx can read, so the schedule starts from its first "
            "step: build the scheduler with last_epoch set to the resumed step, or step it that many times"
        )
        return
    sched = parts.schedulers[0]
    inner = getattr(sched, "scheduler", sched)
    ours = inner.state_dict()
    inner.load_state_dict({**ours, **{k: v for k, v in state.scheduler.items() if k in ours and k != "lr_lambdas"}})


def _set_accelerate_rng(states: dict[str, Any], device: torch.device) -> None:
    """Accelerate's ``random_states_R.pkl``: Python's, numpy's, torch's (and CUDA's) generators."""
    if "random_state" in states:
        random.setstate(states["random_state"])
    if "numpy_random_seed" in states:
        try:
            import numpy as np

            np.random.set_state(states["numpy_random_seed"])
        except ImportError:
            pass
    if isinstance(states.get("torch_manual_seed"), torch.Tensor):
        torch.set_rng_state(states["torch_manual_seed"])
    cuda = states.get("torch_cuda_manual_seed")
    if device.type == "cuda" and cuda:
        torch.cuda.set_rng_state(cuda[device.index or 0] if isinstance(cuda, list) else cuda, device)
