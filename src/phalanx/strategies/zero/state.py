"""The zero strategies' state hooks: each rank gives and takes exactly its own slices, keyed by parameter name,
so that a checkpoint saved under any strategy and world size loads here and the other way round.

A tensor-wise optimizer's state (``tensorwise.py``) is whole on each parameter's owner: the owner gives and takes it
whole, as ddp does (Adafactor's factored statistics keep their own shapes), so it too loads on any world size, and
under ddp."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx.checkpoint.shards import (
    ShardEntry,
    StateReader,
    keys_by_param,
    load_whole_tensors,
    named_tensors,
    read_into,
    read_optimizer_state,
    whole_entry,
)
from phalanx.strategies.expert_parallel.params import is_expert

if TYPE_CHECKING:
    from phalanx.strategies.zero.base import ZeroStrategy

__all__ = ["sharded_state", "load_sharded_state", "nonfinite_grad_names"]


def sharded_state(zs: ZeroStrategy, model: nn.Module, optimizers: Any = None) -> list[ShardEntry]:
    """Each rank gives its own slice of every parameter and optimizer state tensor; rank 0 the replicated rest."""
    zs.finish_gradient_sync()
    if zs.rep_rank > 0:
        return []  # hybrid sharding: the first replica's shards cover every tensor once
    segments = zs._models[id(model)].segments
    entries = []
    for s in segments:
        at_rest = zs._at_rest(s)
        for i, pa, pb, xa, xb in s.param_runs(0, s.shard_numel):
            name, shape = zs._names[s.params[i]], tuple(s.shapes[i])
            entries.append(ShardEntry(f"model/{name}", shape, pa, pb, at_rest[xa:xb].detach()))
            if s.master is not None and s.master.dtype != s.dtype and s.trainable[i]:
                entries.append(ShardEntry(f"optim/{name}/master", shape, pa, pb, s.master[xa:xb].detach()))
    ours = {p for s in segments for p in s.params}
    # The rest (buffers, frozen parameters of zero1/2) is whole on every rank: the first shard rank writes it, and
    # each ep rank's frozen experts the first rank that holds them (the ep view places them in the whole tensor).
    for k, v in named_tensors(model):
        if v not in ours and (zs.expert_rank if is_expert(v) else zs.rank) == 0:
            entries.append(whole_entry(f"model/{k}", v))
    for opt, _group, piece, (seg, a, b) in zs._pieces_of(model, optimizers):
        state = opt.state.get(piece, {})
        for i, pa, pb, xa, xb in seg.param_runs(a, b):
            name, shape = zs._names[seg.params[i]], tuple(seg.shapes[i])
            for k, v in state.items():
                if not isinstance(v, torch.Tensor):
                    continue
                if v.shape == piece.shape:
                    entries.append(ShardEntry(f"optim/{name}/{k}", shape, pa, pb, v[xa - a : xb - a].detach()))
                elif v.dim() == 0 and pa == 0:  # per-tensor scalars (step): from the rank holding element 0
                    entries.append(whole_entry(f"optim/{name}/{k}", v))
    names = {p: zs._names[p] for s in segments for p in s.params}
    for plan in zs._plans(optimizers):
        entries += plan.state_entries(names)
    return entries


def load_sharded_state(zs: ZeroStrategy, model: nn.Module, optimizers: Any, reader: StateReader) -> None:
    """Read exactly this rank's slices: no rank ever holds more than its shard plus one slice in transit."""
    zs.finish_gradient_sync()
    segments = zs._models[id(model)].segments
    available = set(reader.keys())
    problems = []
    for s in segments:
        for i, shape in enumerate(s.shapes):
            key = f"model/{zs._names[s.params[i]]}"
            if key not in available:
                problems.append(f"{key[6:]}: not in the checkpoint")
            elif tuple(reader.shape(key)) != tuple(shape):
                problems.append(
                    f"{key[6:]}: shape {tuple(reader.shape(key))} in the checkpoint, {tuple(shape)} in the model"
                )
    if problems:
        raise ValueError("the checkpoint does not match the model: " + "; ".join(problems[:5]))
    with torch.no_grad():
        for s in segments:
            at_rest = zs._at_rest(s)
            for i, pa, pb, xa, xb in s.param_runs(0, s.shard_numel):
                name = zs._names[s.params[i]]
                read_into(reader, f"model/{name}", pa, pb, at_rest[xa:xb])
                if s.master is not None and s.master.data_ptr() != at_rest.data_ptr():
                    master_key = f"optim/{name}/master"
                    if master_key in available:
                        read_into(reader, master_key, pa, pb, s.master[xa:xb])
                    else:
                        s.master[xa:xb].copy_(at_rest[xa:xb])
        ours = {p for s in segments for p in s.params}
        load_whole_tensors(model, reader, skip=ours)
    if zs.params_whole:
        for w in [zs.comm.gather(s, async_op=True) for s in segments]:
            w.wait()
    else:  # zero3: the at-rest slices are the loaded values; a unit gathered before the load is dropped
        zs._publish_params(segments)
    keys = keys_by_param(reader)
    for opt, group, piece, (seg, a, b) in zs._pieces_of(model, optimizers):
        runs = [(zs._names[seg.params[i]], pa, pb, xa, xb) for i, pa, pb, xa, xb in seg.param_runs(a, b)]
        # A piece may span parameters whose state differs (one never got a gradient): the union of the kinds,
        # zeros where a parameter has none.
        kinds = list(dict.fromkeys(k for name, *_ in runs for k in keys.get(name, []) if k != "master"))
        state: dict[str, Any] = {}
        for k in kinds:
            holders = [r for r in runs if k in keys.get(r[0], [])]
            if reader.shape(f"optim/{holders[0][0]}/{k}") == ():  # a per-tensor scalar (step)
                state[k] = read_optimizer_state(reader, f"optim/{holders[0][0]}/{k}", piece, group)
                continue
            # On disk with offload=disk. Padding past the last parameter is in no run: it must be zero.
            covered = len(holders) == len(runs) and sum(xb - xa for *_, xa, xb in runs) == b - a
            buf = (zs.store.empty if covered else zs.store.zeros)(piece.numel(), piece.dtype)
            for name, pa, pb, xa, xb in holders:
                read_into(reader, f"optim/{name}/{k}", pa, pb, buf[xa - a : xb - a])
            state[k] = buf
        if state:
            opt.state[piece] = state
    names = {p: zs._names[p] for s in segments for p in s.params}
    for plan in zs._plans(optimizers):
        plan.refresh()  # the masters were just loaded
        plan.load_state(names, reader)
    zs.store.release()


def nonfinite_grad_names(zs: ZeroStrategy, model: nn.Module, limit: int) -> list[str]:
    """From this rank's slices of the reduced gradients: the parameters they hold a NaN or inf of."""
    zs.finish_gradient_sync()
    out: list[str] = []
    for s in zs._models[id(model)].segments:
        if s.master_grad is None:
            continue
        for i, _, _, xa, xb in s.param_runs(0, s.shard_numel):
            name = zs._names[s.params[i]]
            if xb > xa and name not in out and not bool(torch.isfinite(s.master_grad[xa:xb]).all()):
                out.append(name)
                if len(out) >= limit:
                    return out
    return out
