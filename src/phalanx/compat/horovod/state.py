"""The Horovod dialect's start-of-training broadcasts: parameters, optimizer state and Python objects, and ``join``.

``broadcast_optimizer_state`` differs from Horovod's on purpose. Horovod, finding an optimizer with no state yet,
takes one optimizer step on zero gradients to create the state: that step applies weight decay (and, for Adam,
counts a step), so the parameters move before training starts. Here the root's state is copied as it is: tensors
that exist on the root are created where missing and broadcast, and a fresh optimizer (no state anywhere) has only
its param-group hyperparameters broadcast. Parameters are never touched.
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from phalanx.compat.horovod.coordinator import agree
from phalanx.compat.horovod.ops import to_comm_device
from phalanx.compat.horovod.world import HvdWorld, check_root, current
from phalanx.runtime.collective_log import watched

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object", "join"]


def _broadcast_tensors(tensors: list[torch.Tensor], root_rank: int, world: HvdWorld) -> None:
    """Broadcast many tensors in place with one collective per dtype and device (a flat buffer each)."""
    if not world.distributed or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.dtype, t.device)].append(t)
    with torch.no_grad():
        for members in groups.values():
            flat = to_comm_device(torch.cat([t.detach().reshape(-1) for t in members]), world)
            agree("hvd.broadcast", flat, root=root_rank)  # ranks whose models differ stop here, all of them
            watched(dist.broadcast, flat, src=root_rank)
            if world.info.rank == root_rank:
                continue
            offset = 0
            for t in members:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _agree(ok: bool, world: HvdWorld) -> bool:
    """True on every rank when ``ok`` is true on every rank: a rank that would refuse makes all of them refuse,
    so that none is left waiting in a collective the others never start."""
    if not world.distributed:
        return ok
    flag = torch.tensor([1 if ok else 0], device=world.comm_device)
    watched(dist.all_reduce, flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _as_named(params: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))  # the same order on every rank
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        items = [p if isinstance(p, tuple) else (f"#{i}", p) for i, p in enumerate(params)]
    else:
        raise ValueError(
            f"{where}: params of type {type(params).__name__} is not a collection of tensors (pass model.state_dict(), "
            "model.named_parameters() or model.parameters())"
        )
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"{where}: entry {name!r} is a {type(t).__name__}, not a tensor (broadcast tensors here, and other "
                "values with hvd.broadcast_object)"
            )
    return [(str(n), t) for n, t in items]


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place. ``params``: ``model.state_dict()``,
    ``model.named_parameters()``, ``model.parameters()``, or a list of tensors or (name, tensor) pairs."""
    where = "hvd.broadcast_parameters"
    world = current(where)
    check_root(root_rank, where)
    named = _as_named(params, where)
    if not world.distributed:
        return
    layout = repr([(tuple(t.shape), str(t.dtype)) for _, t in named]).encode()
    signature = torch.tensor([len(named), zlib.crc32(layout)], dtype=torch.long, device=world.comm_device)
    both = torch.cat([signature, -signature])
    watched(dist.all_reduce, both, op=dist.ReduceOp.MAX)
    if not torch.equal(both[:2], -both[2:]):
        raise ValueError(
            f"{where}: the tensors differ between ranks in number, shape or dtype (this rank has {len(named)}); build "
            "the same model on every rank and pass the same collection"
        )
    _broadcast_tensors([t for _, t in named], root_rank, world)


def _describe_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The root's state as a recipe: per parameter index, each tensor's shape and dtype, each other value itself."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(params):
        entries = optimizer.state.get(p)
        if not entries:
            continue
        state[i] = {
            k: ("tensor", tuple(v.shape), v.dtype, v.device.type == "cpu")
            if isinstance(v, torch.Tensor)
            else ("value", v)
            for k, v in entries.items()
        }
    return {
        "group_sizes": [len(g["params"]) for g in optimizer.param_groups],
        "shapes": [tuple(p.shape) for p in params],
        "hyper": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "state": state,
    }


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Make every rank's optimizer state and hyperparameters equal to ``root_rank``'s, without stepping."""
    where = "hvd.broadcast_optimizer_state"
    world = current(where)
    check_root(root_rank, where)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not world.distributed:
        return
    recipe = broadcast_object(_describe_state(optimizer) if world.info.rank == root_rank else None, root_rank)
    mine = [len(g["params"]) for g in optimizer.param_groups]
    shapes = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]]
    if not _agree(mine == recipe["group_sizes"] and shapes == recipe["shapes"], world):
        raise ValueError(
            f"{where}: the optimizers differ between ranks: parameters per group {mine} on rank {world.info.rank}, "
            f"{recipe['group_sizes']} on root rank {root_rank}, or their shapes differ (build the same model and "
            "optimizer on every rank)"
        )
    if world.info.rank == root_rank:
        tensors = [v for i in sorted(recipe["state"]) for v in _state_tensors(optimizer, i)]
    else:
        tensors = _rebuild_state(optimizer, recipe["state"])
        for group, hyper in zip(optimizer.param_groups, recipe["hyper"]):
            group.update(hyper)
    _broadcast_tensors(tensors, root_rank, world)


def _state_tensors(optimizer: torch.optim.Optimizer, index: int) -> list[torch.Tensor]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [v for v in optimizer.state[params[index]].values() if isinstance(v, torch.Tensor)]


def _rebuild_state(optimizer: torch.optim.Optimizer, recipe: dict[int, dict[str, Any]]) -> list[torch.Tensor]:
    """Shape this rank's state after the root's recipe (reusing tensors that fit); returns the tensors to receive,
    in the root's order."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        if i not in recipe and p in optimizer.state:
            del optimizer.state[p]
    tensors: list[torch.Tensor] = []
    for i in sorted(recipe):
        p = params[i]
        old = optimizer.state.get(p, {})
        new: dict[str, Any] = {}
        for key, entry in recipe[i].items():
            if entry[0] == "value":
                new[key] = entry[1]
                continue
            _, shape, dtype, on_cpu = entry
            device = torch.device("cpu") if on_cpu else p.device
            t = old.get(key)
            if not (
                isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == dtype and t.device == device
            ):
                t = torch.empty(shape, dtype=dtype, device=device)
            new[key] = t
            tensors.append(t)
        optimizer.state[p] = new
    return tensors


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """``root_rank``'s ``obj`` on every rank (pickled on the wire: send only what the ranks of this job may read)."""
    world = current("hvd.broadcast_object")
    check_root(root_rank, "hvd.broadcast_object")
    if not world.distributed:
        return obj
    box = [obj if world.info.rank == root_rank else None]
    watched(dist.broadcast_object_list, box, src=root_rank, device=world.comm_device)
    return obj if world.info.rank == root_rank else box[0]


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    world = current("hvd.allgather_object")
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.info.world_size
    watched(dist.all_gather_object, out, obj)
    return out


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join()``; returns the rank that arrived last.

    Unlike Horovod, a rank that joined does not stand in for the others' later all-reduces: every rank must run
    the same number of optimizer steps before it joins (give each rank the same number of batches, e.g. with
    ``DistributedSampler(drop_last=True)``).
    """
    world = current("hvd.join()")
    if not world.distributed:
        return 0
    arrived = torch.tensor([time.time()], dtype=torch.float64, device=world.comm_device)
    times = [torch.empty_like(arrived) for _ in range(world.info.world_size)]
    watched(dist.all_gather, times, arrived)
    return int(torch.stack(times).argmax())
