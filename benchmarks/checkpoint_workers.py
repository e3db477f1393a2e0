"""Worker functions for bench_checkpoint.py: save and load the same training state with one checkpointing method,
in a process started by phalanx.spawn (2 ranks, gloo, 1 thread each).

Every configuration builds the same model (``n_layers`` x ``Linear(d, d)`` with ReLU between; 50.4M parameters by
default) from the same seed, takes one AdamW step on the same batch (so that the optimizer holds exp_avg and
exp_avg_sq for every parameter: 3 x 50.4M floats in all), saves, then loads into a freshly built model and
optimizer (other initial weights; built untimed). Times are barrier to barrier, so they are the slowest rank's.
Before saving, ``os.sync()`` writes back earlier dirty pages; before loading, every file of the checkpoint is
fsynced and dropped from the page cache (``posix_fadvise(DONTNEED)``), so loads read from the disk.

A checksum (float64 sum of every parameter and every non-scalar optimizer state element, each counted once over
the ranks) is taken before the save and after the load; a run whose two checksums differ fails.

With ``spec["async"]`` each repeat saves twice, in the same process and from the same state: synchronously
(``sync_save_s``, barrier to barrier), then asynchronously (phalanx ``save_state(..., async_save=True)``, DCP
``async_save``), and training goes on at once with one step (forward, backward, ``optimizer.step()``).
``call_s`` is the time from the call to its return; ``held_s`` how long that step's ``optimizer.step()`` waited
before it could change the state (phalanx holds it until its thread has copied the parameters and optimizer
state; measured between a step pre-hook registered before the save and one registered after it, so it is 0 where
nothing holds the step); ``blocked_s`` = ``call_s`` + ``held_s``, what training waits for. ``save_s`` runs from
the call until the wait for the checkpoint returns (the step included). The load then reads the asynchronous
checkpoint and must give the checksum of the state at the call, not after the step.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from harness import init_gloo, memory_now, world
from torch import nn


def build_model(spec: dict[str, Any], seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(spec["n_layers"]):
        layers += [nn.Linear(spec["d"], spec["d"])] + ([nn.ReLU()] if i < spec["n_layers"] - 1 else [])
    return nn.Sequential(*layers)


def _batch(spec: dict[str, Any]) -> torch.Tensor:
    return torch.randn(spec["batch"], spec["d"], generator=torch.Generator().manual_seed(spec["seed"]))


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, spec: dict[str, Any]) -> None:
    model(_batch(spec)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _local_sum(tensors: list[torch.Tensor]) -> float:
    total = 0.0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this rank's shard
        if t.dim() > 0:
            total += float(t.detach().double().sum())
    return total


def _replicated_checksum(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return _local_sum(list(model.parameters()) + state)


def _sharded_checksum(local: float) -> float:
    t = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def _evict(path: str) -> int:
    """fsync and drop from the page cache every file under ``path`` (rank 0; untimed); returns the bytes there."""
    total = 0
    if os.path.isfile(path):
        files = [path]
    else:
        files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
    for f in files:
        total += os.path.getsize(f)
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return total


Loader = Callable[[], Callable[[], float]]
"""Builds a fresh model and optimizer (untimed) and returns the load itself, which returns the checksum after."""


def _measure(
    spec: dict[str, Any],
    rank: int,
    save: Callable[[], Any],
    loader: Loader,
    before: float,
    extra_loads: dict[str, Loader] | None = None,
    save_async: Callable[[], Callable[[], Any]] | None = None,
    train_step: Callable[[], None] | None = None,
    optimizer: Any = None,
    checksum_now: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """``spec["repeats"]`` times: sync, time ``save``, evict the files, build the fresh state, time the load (and
    each extra load), delete the checkpoint. Returns every repeat's times; the driver takes their median."""
    path = spec["path"]
    times: dict[str, list[float]] = {}
    nbytes = 0
    for _ in range(spec["repeats"]):
        if rank == 0:
            os.sync()  # no save waits on dirty pages of an earlier one
        if save_async is not None:
            assert train_step is not None and optimizer is not None and checksum_now is not None
            before = checksum_now()  # the state both saves take; the step after the asynchronous call changes it
            sync_s, _ = _timed(save)
            times.setdefault("sync_save_s", []).append(sync_s)
            if rank == 0:
                _evict(path)
                shutil.rmtree(path, ignore_errors=True)
                os.sync()
            marks: list[float] = []
            mark = marks.append
            arrive = optimizer.register_step_pre_hook(lambda *_, mark=mark: mark(time.perf_counter()))
            dist.barrier()
            t0 = time.perf_counter()
            finish = save_async()
            call_s = time.perf_counter() - t0
            leave = optimizer.register_step_pre_hook(lambda *_, mark=mark: mark(time.perf_counter()))
            train_step()
            arrive.remove()
            leave.remove()
            held_s = marks[1] - marks[0]
            times.setdefault("call_s", []).append(call_s)
            times.setdefault("held_s", []).append(held_s)
            times.setdefault("blocked_s", []).append(call_s + held_s)
            finish()
            save_s = time.perf_counter() - t0
            dist.barrier()
        else:
            save_s, _ = _timed(save)
        nbytes = _evict(path) if rank == 0 else 0
        times.setdefault("save_s", []).append(save_s)
        for name, make in {"load": loader, **(extra_loads or {})}.items():
            if rank == 0:
                _evict(path)
            load = make()
            dist.barrier()
            seconds, after = _timed(load)
            del load
            gc.collect()  # the fresh model and optimizer go now, not at some later collection (peak RSS)
            times.setdefault(f"{name}_s", []).append(seconds)
            # Equal but for the last bits of the float64 sums: ddp's balanced byte split between the ranks follows
            # the optimizer state's key order, which a load changes (step last), so the sums group differently.
            if not math.isclose(after, before, rel_tol=1e-12, abs_tol=0.0):
                raise RuntimeError(f"rank {rank}: checksum {after!r} after {name}, {before!r} before saving")
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        dist.barrier()
    return {"rank": rank, **times, "bytes": nbytes, "checksum_before": before, "memory": memory_now()}


# ----------------------------------------------------------------------------------------- configurations
def run_torch_save(spec: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 writes one torch.save file of the full model and optimizer state dicts; every rank torch.loads it."""
    rank, _ = init_gloo()
    model = build_model(spec, spec["seed"])
    opt = _optimizer(model.parameters())
    _plain_step(model, opt, spec)
    before = _replicated_checksum(model, opt)
    path = spec["path"]

    def save() -> None:
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)

    def loader() -> Callable[[], float]:
        model2 = build_model(spec, spec["seed"] + 1)
        opt2 = _optimizer(model2.parameters())

        def load() -> float:
            sd = torch.load(path, map_location="cpu", weights_only=True)
            model2.load_state_dict(sd["model"])
            opt2.load_state_dict(sd["optimizer"])
            return _replicated_checksum(model2, opt2)

        return load

    out = _measure(spec, rank, save, loader, before)
    dist.destroy_process_group()
    return out


def run_dcp(spec: dict[str, Any]) -> dict[str, Any]:
    """torch.distributed.checkpoint save/load of get_state_dict(model, opt): replicated (plain model, the state that
    DDP holds) or, with spec["fsdp2"], an FSDP2 model sharded per Linear."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, size = init_gloo()
    sharded = spec.get("fsdp2", False)

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = build_model(spec, seed)
        if sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (size,))
            for m in model:
                if isinstance(m, nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model, _optimizer(model.parameters())

    def checksum(model: nn.Module, opt: torch.optim.Optimizer) -> float:
        local = _replicated_checksum(model, opt)
        return _sharded_checksum(local) if sharded else local

    model, opt = build(spec["seed"])
    if sharded:
        model(_batch(spec)[rank::size]).pow(2).mean().backward()  # each rank half the batch
        opt.step()
        opt.zero_grad()
    else:
        _plain_step(model, opt, spec)
    before = checksum(model, opt)

    # DCP's advice for async_save: its background collectives on a gloo group of their own.
    group = dist.new_group(backend="gloo") if spec.get("async") else None

    def save() -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=spec["path"])

    def save_async() -> Callable[[], Any]:
        msd, osd = get_state_dict(model, opt)
        return dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=spec["path"], process_group=group).result

    def loader() -> Callable[[], float]:
        model2, opt2 = build(spec["seed"] + 1)

        def load() -> float:
            msd, osd = get_state_dict(model2, opt2)  # initialises the optimizer state that dcp.load fills in
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=spec["path"])
            set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
            return checksum(model2, opt2)

        return load

    def train_step() -> None:
        if sharded:
            model(_batch(spec)[rank::size]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        else:
            _plain_step(model, opt, spec)

    if spec.get("async"):
        out = _measure(
            spec,
            rank,
            save,
            loader,
            before,
            save_async=save_async,
            train_step=train_step,
            optimizer=opt,
            checksum_now=lambda: checksum(model, opt),
        )
    else:
        out = _measure(spec, rank, save, loader, before)
    dist.destroy_process_group()
    return out


def run_phalanx(spec: dict[str, Any]) -> dict[str, Any]:
    """phalanx Engine(strategy=...).save_state(path) / a second Engine's load_state(path) (and load_state without
    checksum verification)."""
    import phalanx

    rank, size = world()

    def build(seed: int) -> tuple[phalanx.Engine, nn.Module, Any]:
        engine = phalanx.Engine(strategy=spec["strategy"], seed=spec["seed"])
        model = build_model(spec, seed)
        model, opt = engine.prepare(model, _optimizer(model.parameters()))
        return engine, model, opt

    def checksum(engine: phalanx.Engine, model: nn.Module, opt: Any) -> float:
        entries = engine.strategy.sharded_state(model, [opt])  # every element exactly once over the ranks
        return _sharded_checksum(sum(float(e.data.double().sum()) for e in entries if e.shape != ()))

    engine, model, opt = build(spec["seed"])
    engine.backward(model(_batch(spec)[rank::size]).pow(2).mean())  # each rank half the batch
    opt.step()
    opt.zero_grad()
    before = checksum(engine, model, opt)

    def loader(verify: bool) -> Loader:
        def make() -> Callable[[], float]:
            engine2, model2, opt2 = build(spec["seed"] + 1)

            def load() -> float:
                engine2.load_state(spec["path"], verify=verify)
                return checksum(engine2, model2, opt2)

            return load

        return make

    def train_step() -> None:
        engine.backward(model(_batch(spec)[rank::size]).pow(2).mean())
        opt.step()
        opt.zero_grad()

    if spec.get("async"):
        return _measure(
            spec,
            rank,
            lambda: engine.save_state(spec["path"]),
            loader(True),
            before,
            save_async=lambda: engine.save_state(spec["path"], async_save=True).result,
            train_step=train_step,
            optimizer=opt,
            checksum_now=lambda: checksum(engine, model, opt),
        )
    return _measure(
        spec,
        rank,
        lambda: engine.save_state(spec["path"]),
        loader(True),
        before,
        extra_loads={"load_noverify": loader(False)},
    )


RUNNERS = {"torch_save": run_torch_save, "dcp": run_dcp, "phalanx": run_phalanx}


def run(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The one entry point phalanx.spawn calls."""
    return RUNNERS[kind](spec)
