"""The Horovod dialect's start-of-training broadcasts: parameters, optimizer state and Python objects, and ``join``.
Each takes ``process_set=`` as Horovod's do.

``broadcast_optimizer_state`` differs from Horovod's on purpose. Horovod, finding an optimizer with no state yet,
takes one optimizer step on zero gradients to create the state: that step applies weight decay (and, for Adam,
counts a step), so the parameters move before training starts. Here the root's state is copied as it is: tensors
that exist on the root are created where missing and broadcast, and a fresh optimizer (no state anywhere) has only
its param-group hyperparameters broadcast. Parameters are never touched.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from phalanx.compat.horovod.coordinator import Coordinator, HorovodMismatchError, Op, digest_of
from phalanx.compat.horovod.ops import allreduce, broadcast_op, run
from phalanx.compat.horovod.process_sets import coordinator_of
from phalanx.compat.horovod.world import HvdWorld, ReduceOp, check_root, current
from phalanx.runtime.collective_log import watched

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object", "join"]


def _broadcast_tensors(tensors: list[torch.Tensor], root_rank: int, world: HvdWorld, process_set: Any = None) -> None:
    """Broadcast many tensors in place with one collective per dtype and device (a flat buffer each), all started
    in one coordinator round."""
    if not tensors:
        return
    coord = coordinator_of(process_set, "hvd.broadcast_parameters")
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.dtype, t.device)].append(t)
    with torch.no_grad():
        flats = [(members, torch.cat([t.detach().reshape(-1) for t in members])) for members in groups.values()]
        ops = [coord.submit(broadcast_op(coord, flat, root_rank, world)) for _, flat in flats]
        for op, (members, flat) in zip(ops, flats):
            coord.wait(op)  # ranks whose models differ stop here, all of them
            if world.info.rank == root_rank:
                continue
            offset = 0
            for t in members:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _agree(ok: bool, world: HvdWorld, process_set: Any = None) -> bool:
    """True on every rank when ``ok`` is true on every rank: a rank that would refuse makes all of them refuse,
    so that none is left waiting in a collective the others never start."""
    if not world.distributed:
        return ok
    return bool(allreduce(torch.tensor([1 if ok else 0]), op=ReduceOp.Min, process_set=process_set).item())


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


def broadcast_parameters(params: Any, root_rank: int, process_set: Any = None) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place. ``params``: ``model.state_dict()``,
    ``model.named_parameters()``, ``model.parameters()``, or a list of tensors or (name, tensor) pairs."""
    where = "hvd.broadcast_parameters"
    world = current(where)
    check_root(root_rank, where)
    coord = coordinator_of(process_set, where)
    named = _as_named(params, where)
    if coord.size == 1:
        return
    layout = zlib.crc32(repr([(tuple(t.shape), str(t.dtype)) for _, t in named]).encode())
    digest, text = digest_of(where, [], root=root_rank, extra=f"{len(named)} tensors, layout digest {layout}")
    try:
        run(coord, Op(where, coord.auto_name(where), digest, text, lambda sizes: ([], lambda: None)))
    except HorovodMismatchError as e:
        raise HorovodMismatchError(
            f"{e}\n(build the same model on every rank and pass the same collection: the tensors differ between ranks "
            "in number, shape or dtype)"
        ) from None
    _broadcast_tensors([t for _, t in named], root_rank, world, process_set)


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


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, process_set: Any = None) -> None:
    """Make every rank's optimizer state and hyperparameters equal to ``root_rank``'s, without stepping."""
    where = "hvd.broadcast_optimizer_state"
    world = current(where)
    check_root(root_rank, where)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not optimizer.state:
        _zero_grads(optimizer)
    if coordinator_of(process_set, where).size == 1:
        return
    mine_described = _describe_state(optimizer) if world.info.rank == root_rank else None
    recipe = broadcast_object(mine_described, root_rank, process_set=process_set)
    mine = [len(g["params"]) for g in optimizer.param_groups]
    shapes = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]]
    if not _agree(mine == recipe["group_sizes"] and shapes == recipe["shapes"], world, process_set):
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
    _broadcast_tensors(tensors, root_rank, world, process_set)


def _zero_grads(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's broadcast of a fresh optimizer's state leaves every trainable parameter without a gradient with a
    zero one (its zero-gradient step needs them; sparse under SparseAdam), and scripts read them: so do we, without
    the step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zeros = torch.zeros_like(p)
                p.grad = zeros.to_sparse() if isinstance(optimizer, torch.optim.SparseAdam) else zeros


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


def _object_op(coord: Coordinator, kind: str, name: Any, collective: Callable[[], Any]) -> Op:
    digest, text = digest_of(kind, [])
    return Op(
        kind, name or coord.auto_name(kind), digest, text, lambda sizes: ([], (lambda out: lambda: out)(collective()))
    )


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """``root_rank``'s ``obj`` on every rank (pickled on the wire: send only what the ranks of this job may read)."""
    world = current("hvd.broadcast_object")
    check_root(root_rank, "hvd.broadcast_object")
    coord = coordinator_of(process_set, "hvd.broadcast_object")
    if coord.size == 1:
        return obj
    if root_rank not in coord.ranks:
        raise ValueError(f"hvd.broadcast_object: root_rank={root_rank} is not in the process set (ranks {coord.ranks})")
    box = [obj if world.info.rank == root_rank else None]

    def collective() -> Any:
        watched(dist.broadcast_object_list, box, src=root_rank, group=coord.group, device=world.comm_device)
        return obj if world.info.rank == root_rank else box[0]

    return run(coord, _object_op(coord, "hvd.broadcast_object", name, collective))


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    current("hvd.allgather_object")
    coord = coordinator_of(process_set, "hvd.allgather_object")
    if coord.size == 1:
        return [obj]
    out: list[Any] = [None] * coord.size

    def collective() -> Any:
        watched(dist.all_gather_object, out, obj, group=coord.group)
        return out

    return run(coord, _object_op(coord, "hvd.allgather_object", name, collective))


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, it stands in for itself in the others' all-reduces
    (and DistributedOptimizer steps) with zeros, as Horovod's join does; an average still divides by the number of
    ranks. Other operations raise on the ranks that call them meanwhile. Returns the rank that joined last, the
    same on every rank."""
    current("hvd.join()")
    return coordinator_of(None, "hvd.join()").join()
