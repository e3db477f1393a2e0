"""Checkpoints: a directory of safetensors files and a JSON manifest; sharded, atomic, loadable on any world size.

    engine.save_state("ckpt/step-1000", keep_last=3)   # every rank calls it
    engine.load_state("ckpt/step-1000")                # under any strategy, on any world size
    phalanx checkpoint info ckpt/step-1000
    phalanx checkpoint consolidate ckpt/step-1000 model.safetensors

A checkpoint directory holds:

- ``shard-RRRRR-of-NNNNN.safetensors``: rank R's slices of the training state, written by the ranks in parallel.
  Each entry is a 1-D run ``[start, stop)`` of a flattened tensor (a parameter, an optimizer state tensor, or a
  tensor found inside a scheduler's or a registered object's state).
- ``manifest.json``: the format and its version; the world size, mesh and strategy at save time; every tensor's
  whole shape and dtype and, for each file, which runs of which tensors it holds with a crc32 of each run; and
  the state that is not a tensor (step counter, loader positions, schedulers, loss scaler, each rank's RNG,
  optimizer hyper-parameters, registered objects) as JSON.

Saving writes into ``.NAME.partial`` beside the target and renames it into place only when every rank has written
its file and rank 0 the manifest; a crash at any point leaves the previous checkpoint untouched. Ranks exchange
what they wrote as JSON bytes over the process group, never pickled.

Loading never unpickles and never runs code: the manifest is JSON, and tensor files are read by the offsets in their
own safetensors headers (a file that starts like a pickle or a ``torch.save`` zip is refused by its first bytes). Every
check (format version, each file present with its size, every checksum, names and shapes against the model, the
number of optimizers, schedulers, loaders and registered objects) passes on every rank before the first tensor is
copied: a checkpoint loads whole or not at all. Each rank reads only the runs that overlap its own shard.

The file format itself (writing, reading, the JSON encoding of state) is in ``format.py`` and ``read.py``.
"""

from __future__ import annotations

import base64
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx._version import __version__
from phalanx.checkpoint.async_save import (
    WRITER,
    AsyncSave,
    Hold,
    await_outcome,
    collect_reports,
    holds_steps,
    new_save_id,
    report_name,
    write_report,
)
from phalanx.checkpoint.format import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    from_json,
    is_checkpoint,
    recover_interrupted_swap,
    rotate,
    save_model_file,
    swap_into_place,
    to_json,
    write_json_durably,
    write_shard,
)
from phalanx.checkpoint.read import Checkpoint, latest_checkpoint
from phalanx.checkpoint.shards import ShardEntry
from phalanx.runtime.collective_log import watched
from phalanx.runtime.comm import all_gather_bytes
from phalanx.runtime.topology import Topology

if TYPE_CHECKING:
    from phalanx.strategies.base import Strategy

__all__ = [
    "CheckpointError",
    "Checkpoint",
    "TrainingParts",
    "save_checkpoint",
    "save_checkpoint_async",
    "wait_for_async_save",
    "AsyncSave",
    "load_checkpoint",
    "save_model_file",
    "agree",
    "latest_checkpoint",
    "FORMAT",
    "VERSION",
]


@dataclass
class TrainingParts:
    """Everything a checkpoint holds, as the Engine hands it over (optimizers unwrapped)."""

    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any] = field(default_factory=list)
    loaders: list[Any] = field(default_factory=list)
    objects: list[Any] = field(default_factory=list)
    precision: Any = None
    counters: dict[str, int] = field(default_factory=dict)
    seed: int = 0
    rng_trackers: list[Any] = field(default_factory=list)
    """Each rank's own RNG streams besides torch's (tensor parallelism's ``TPRngTracker``, one per model), with
    ``state_dict()`` (ints and uint8 tensors) and ``load_state_dict()``: saved with the rank's RNG."""


# ------------------------------------------------------------------------------------------------ save
def save_checkpoint(
    path: str | os.PathLike[str],
    parts: TrainingParts,
    strategy: Strategy,
    topology: Topology,
    device: torch.device,
    keep_last: int | None = None,
    also_write: Callable[[Path], None] | None = None,
) -> Path:
    """Write a checkpoint of ``parts`` to ``path``. A collective: every rank calls it, and every rank returns once
    the checkpoint is complete at ``path`` (or raises the same error). ``also_write(directory)`` runs on rank 0 once
    the checkpoint is whole in its staging directory, before it moves into place, to add files beside it (the
    Trainer's ``model.safetensors``): they appear with the checkpoint or not at all."""
    target, staging, entries, state, _ = _begin_save(path, parts, strategy, topology, device, keep_last, True)
    rank, world = topology.rank, topology.world_size
    written: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None
    error = None
    try:
        written = write_shard(staging, rank, world, entries) if entries else None
        rng = _rng_state(device, parts.rng_trackers)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others would wait forever
        error = f"{type(e).__name__}: {e}"
    reports = [
        json.loads(b)
        for b in all_gather_bytes(json.dumps({"error": error, "file": written, "rng": rng}).encode(), device)
    ]
    failed = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if rep["error"]]
    if failed:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"saving the checkpoint {target} failed (nothing was replaced): " + "; ".join(failed))

    error = None
    if rank == 0:
        try:
            assert state is not None
            _finish(staging, target, _manifest(state, reports, strategy, topology), also_write, keep_last)
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
    agree(error, device, f"saving the checkpoint {target}")
    return target


def save_checkpoint_async(
    path: str | os.PathLike[str],
    parts: TrainingParts,
    strategy: Strategy,
    topology: Topology,
    device: torch.device,
    keep_last: int | None = None,
    also_write: Callable[[Path], None] | None = None,
    timeout_s: float = 1800.0,
) -> AsyncSave:
    """``save_checkpoint``, returning once the state that anything but an optimizer step can change is taken: a
    thread copies the parameters and optimizer state to host memory (the next step of each optimizer in ``parts``
    waits for that copy) and writes the shards, and on rank 0 the manifest, renames the checkpoint into place and
    rotates (see ``async_save.py``). Every rank
    calls it; the first collective (shared with a synchronous save) raises on every rank when the previous save
    failed. ``timeout_s`` bounds how long the thread waits for the other ranks' parts or for rank 0's outcome."""
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds; got {timeout_s!r}")
    target, staging, entries, state, save_id = _begin_save(path, parts, strategy, topology, device, keep_last, False)
    rank, world = topology.rank, topology.world_size
    # What only an optimizer step changes (parameters, optimizer state) is copied by the thread, and the next step
    # waits for that copy; the rest (buffers, which a forward changes; the JSON state, the RNG) is taken now.
    later = _changed_only_by_steps(entries, parts.optimizers)
    staged, copies = WRITER.stage(entries, later)
    rng = _rng_state(device, parts.rng_trackers)
    handle = AsyncSave(target, rank)
    if copies.pending:
        WRITER.hold = Hold(copies, parts.optimizers)

    def write() -> None:
        written, error = None, None
        try:
            try:
                copies.run()
            finally:
                copies.wait_on_host()  # what was queued has landed before the buffers are read or reused
            _refuse_nonfinite(staged, target)
            written = write_shard(staging, rank, world, staged) if staged else None
        except Exception as e:  # noqa: BLE001 - rank 0 must learn of it, and gives the save up
            error = f"{type(e).__name__}: {e}"
        mine = {"save_id": save_id, "error": error, "file": written, "rng": rng}
        if rank != 0:
            write_report(staging, rank, mine)
            if error:
                raise CheckpointError(f"rank {rank}: {error}")
            await_outcome(staging, target, save_id, timeout_s)
            return
        try:
            others = collect_reports(staging, world, save_id, timeout_s)
        except TimeoutError as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(f"saving the checkpoint {target} failed (nothing was replaced): {e}") from None
        reports = [mine] + [others[r] for r in range(1, world)]
        failed = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if rep["error"]]
        if failed:
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(f"saving the checkpoint {target} failed (nothing was replaced): " + "; ".join(failed))
        for r in range(1, world):
            (staging / report_name(r)).unlink()
        assert state is not None
        manifest = {**_manifest(state, reports, strategy, topology), "save_id": save_id}
        try:
            _finish(staging, target, manifest, also_write, keep_last)
        except Exception:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    WRITER.start(handle, write)
    return handle


def _changed_only_by_steps(entries: list[ShardEntry], optimizers: list[torch.optim.Optimizer]) -> list[bool]:
    """For each entry, whether it lies in a parameter or an optimizer state tensor of ``optimizers`` (same
    storage), which only their ``step()`` changes, so that a step pre-hook can hold the change until it is copied.
    None is, when an optimizer cannot be held (not a ``torch.optim.Optimizer`` with torch's step hooks): the call
    then copies everything itself."""
    if not optimizers or not all(holds_steps(o) for o in optimizers):
        return [False] * len(entries)
    stepped: set[int] = set()
    for opt in optimizers:
        tensors = [p for g in opt.param_groups for p in g["params"]]
        tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        stepped.update(t.untyped_storage().data_ptr() for t in tensors)
    stepped.discard(0)
    return [e.data.untyped_storage().data_ptr() in stepped for e in entries]


def wait_for_async_save(device: torch.device) -> Path | None:
    """``engine.wait_for_checkpoint()``: a collective. Wait for this process's asynchronous save; every rank raises
    the same error if it failed on any (and was not raised yet). Returns its path, None if there was none."""
    if not isinstance(device, torch.device):
        raise TypeError(f"wait_for_async_save takes the engine's device; got {device!r}")
    last = WRITER.last
    failure = WRITER.settle()
    agree(failure, device, f"the asynchronous save of {last.path if last else None}")
    return last.path if last is not None else None


def _begin_save(
    path: str | os.PathLike[str],
    parts: TrainingParts,
    strategy: Strategy,
    topology: Topology,
    device: torch.device,
    keep_last: int | None,
    check_finite: bool,
) -> tuple[Path, Path, list[ShardEntry], dict[str, Any] | None, str]:
    """The first part of every save, a collective: this rank's shards (views of live state), rank 0's JSON state,
    its fresh staging directory and the save's id (rank 0's, on every rank). It first waits for this process's
    asynchronous save in flight, and every rank raises the same error if that one failed (it is reported once) or
    if anything here failed on any rank."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the number of checkpoints to keep); got {keep_last}")
    target = Path(os.path.abspath(os.path.expanduser(path)))
    staging = target.parent / f".{target.name}.partial"
    previous = WRITER.last
    earlier = WRITER.settle()
    # The tensors, each rank its share, and (rank 0's copy is the one saved) everything else as JSON. An error on
    # one rank must reach the others, which would otherwise wait for it in the next collective.
    entries: list[ShardEntry] = []
    state: dict[str, Any] | None = None
    error = None
    if earlier is not None:
        assert previous is not None
        error = f"the earlier asynchronous save of {previous.path} failed, so this one was not started: {earlier}"
    try:
        if error is None:
            for i, model in enumerate(parts.models):
                entries += [_rekey(e, i) for e in strategy.sharded_state(model, parts.optimizers)]
            if check_finite:  # an asynchronous save checks its host copies on its thread instead: no host sync here
                _refuse_nonfinite(entries, target)
        if error is None and topology.rank == 0:
            extra: dict[str, torch.Tensor] = {}
            state = _global_state(parts, strategy, extra)
            entries += [ShardEntry(k, tuple(t.shape), 0, t.numel(), t.reshape(-1)) for k, t in extra.items()]
            recover_interrupted_swap(target)
            if target.exists() and not is_checkpoint(target) and not _empty_dir(target):
                raise CheckpointError(
                    f"{target} exists and is not a phalanx checkpoint; save_state replaces only a checkpoint (choose "
                    "another directory, or remove this one yourself)"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # a save that crashed earlier
            staging.mkdir()
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    save_id = agree(error, device, f"saving the checkpoint {target}", new_save_id() if topology.rank == 0 else "")
    return target, staging, entries, state, save_id


def _finish(
    staging: Path,
    target: Path,
    manifest: dict[str, Any],
    also_write: Callable[[Path], None] | None,
    keep_last: int | None,
) -> None:
    """Rank 0, every shard file written: the manifest, the extra files, the rename into place, the rotation."""
    write_json_durably(staging / MANIFEST, manifest)
    if also_write is not None:
        also_write(staging)
    swap_into_place(staging, target)
    if keep_last is not None:
        rotate(target, keep_last)


def _refuse_nonfinite(entries: list[ShardEntry], target: Path) -> None:
    """A checkpoint is never written from weights or optimizer state holding a NaN or inf."""
    bad = [
        e.key
        for e in entries
        if e.data.is_floating_point() and e.data.numel() and not bool(torch.isfinite(e.data).all())
    ]
    if bad:
        raise CheckpointError(
            f"non-finite values (NaN or inf) in {', '.join(bad[:5])}{' and more' if len(bad) > 5 else ''}: "
            f"a checkpoint is never written from non-finite state, so {target} was left as it was. Training stepped "
            "into a NaN (on_nonfinite='raise', the default, stops it at that step instead; was it set to 'ignore'?)"
        )


def _rekey(e: ShardEntry, model_index: int) -> ShardEntry:
    """``model/x`` and ``optim/x/k`` of the first model keep their names; the i-th model's are ``modelI/...``."""
    if model_index == 0:
        return e
    kind, _, rest = e.key.partition("/")
    return e._replace(key=f"{kind}{model_index}/{rest}")


def _global_state(parts: TrainingParts, strategy: Strategy, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Everything that is not a model or optimizer tensor, as JSON (tensors inside go to ``tensors``)."""
    return {
        "counters": dict(parts.counters),
        "seed": parts.seed,
        "models": [
            {"class": type(strategy.unwrap_model(m)).__name__, "state_dict_keys": strategy.state_dict_keys(m)}
            for m in parts.models
        ],
        "optimizers": [
            {
                "class": type(opt).__name__,
                "param_groups": [
                    to_json({k: v for k, v in g.items() if k != "params"}, f"optimizer{j}/group{gi}", tensors)
                    for gi, g in enumerate(opt.param_groups)
                ],
            }
            for j, opt in enumerate(parts.optimizers)
        ],
        "schedulers": [to_json(s.state_dict(), f"scheduler{i}", tensors) for i, s in enumerate(parts.schedulers)],
        "loaders": [to_json(dl.state_dict(), f"loader{i}", tensors) for i, dl in enumerate(parts.loaders)],
        "objects": [
            {"class": type(o).__name__, "state": to_json(o.state_dict(), f"object{i}", tensors)}
            for i, o in enumerate(parts.objects)
        ],
        "precision": to_json(parts.precision.state_dict(), "precision", tensors) if parts.precision else None,
    }


def _manifest(
    state: dict[str, Any], reports: list[dict[str, Any]], strategy: Strategy, topology: Topology
) -> dict[str, Any]:
    files: list[dict[str, Any]] = []
    tensors: dict[str, dict[str, Any]] = {}
    for rank, rep in enumerate(reports):
        f = rep["file"]
        if f is None:
            continue
        index = len(files)
        files.append({"name": f["name"], "rank": rank, "bytes": f["bytes"]})
        for t in f["tensors"]:
            info = tensors.setdefault(t["key"], {"shape": t["shape"], "dtype": t["dtype"], "slices": []})
            assert info["shape"] == t["shape"] and info["dtype"] == t["dtype"], (t, info)
            run = {"file": index, "name": t["name"], "start": t["start"], "stop": t["stop"], "crc32": t["crc32"]}
            if "chunk" in t:
                run["chunk"] = t["chunk"]
            info["slices"].append(run)
    for key, info in tensors.items():
        _check_tiling(key, info)
    chunked = any("chunk" in run for info in tensors.values() for run in info["slices"])
    return {
        "format": FORMAT,
        "version": VERSION if chunked else 1,  # version 1 readers read every checkpoint without chunks
        "saved_at": time.time(),
        "phalanx_version": __version__,
        "torch_version": torch.__version__,
        "world_size": topology.world_size,
        "pp_size": topology.pp_size,
        "dp_size": topology.dp_size,
        "tp_size": topology.tp_size,
        "strategy": strategy.name,
        **state,
        "rng": [rep["rng"] for rep in reports],
        "files": files,
        "tensors": dict(sorted(tensors.items())),
    }


def _check_tiling(key: str, info: dict[str, Any]) -> None:
    """Our own invariant: the ranks' runs tile every tensor exactly, or (tensor parallelism) every chunk of one cut
    of it."""
    cuts = {tuple(run["chunk"][:3]) if "chunk" in run else None for run in info["slices"]}
    assert len(cuts) == 1, f"{key}: runs of different layouts ({sorted(map(str, cuts))})"
    cut = cuts.pop()
    parts = 1 if cut is None else cut[1]
    info["slices"].sort(key=lambda s: (s["chunk"][3] if "chunk" in s else 0, s["start"]))
    for index in range(parts):
        covered = 0
        for s in info["slices"]:
            if "chunk" in s and s["chunk"][3] != index:
                continue
            assert s["start"] == covered, f"{key}: runs do not tile chunk {index} ({info['slices']})"
            covered = s["stop"]
        assert covered == math.prod(info["shape"]) // parts, f"{key}: runs cover {covered} of {info['shape']}/{parts}"


def agree(error: str | None, device: torch.device, what: str, share: str = "") -> str:
    """Raise the same CheckpointError on every rank if any rank had ``error``, naming the ranks. Returns rank 0's
    ``share`` (a save's id), handed over in the same collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error:
            raise CheckpointError(f"{what} failed: {error}")
        return share
    replies = [json.loads(b) for b in all_gather_bytes(json.dumps([error or "", share]).encode(), device)]
    failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(replies) if e]
    if failed:
        raise CheckpointError(f"{what} failed: " + "; ".join(failed))
    return str(replies[0][1])


# ---------------------------------------------------------------------------------------- RNG state
def _rng_state(device: torch.device, trackers: list[Any] | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {
        "trackers": [_tracker_json(t.state_dict()) for t in trackers or []],
        "torch": _b64(torch.get_rng_state()),
        "python": to_json(random.getstate(), "rng", None),
        "cuda": _b64(torch.cuda.get_rng_state(device)) if device.type == "cuda" else None,
        "numpy": None,
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
        state["numpy"] = [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return state


def _tracker_json(state: dict[str, Any]) -> dict[str, Any]:
    """A ``TPRngTracker.state_dict()`` (ints, and a uint8 generator state per device) as JSON."""
    return {
        "seed": int(state["seed"]),
        "tp_rank": int(state["tp_rank"]),
        "states": {device: _b64(t) for device, t in state["states"].items()},
    }


def _set_trackers(saved: list[dict[str, Any]] | None, trackers: list[Any]) -> bool:
    """Give each tracker its saved state; False (nothing changed) when the checkpoint holds a different number."""
    if saved is None or len(saved) != len(trackers):
        return False
    for tracker, state in zip(trackers, saved):
        tracker.load_state_dict({**state, "states": {d: _unb64(s) for d, s in state["states"].items()}})
    return True


def _reseed_trackers(trackers: list[Any], seed: int, step: int, rank: int) -> None:
    """Trackers on another mesh: fresh streams from (seed, step, the rank's place outside its tp group)."""
    value = ((seed * 1_000_003 + step) * 65_537 + rank) % 2**62
    for tracker in trackers:
        state = tracker.state_dict()
        tracker.load_state_dict({**state, "seed": value, "states": {}})


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    random.setstate(from_json(state["python"], None))
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)
    if state.get("numpy") is not None:
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass


def _reseed(seed: int, step: int, rank: int, device: torch.device) -> None:
    """RNG for a run resumed on another mesh: a function of the seed, the global step and the rank."""
    value = ((seed * 1_000_003 + step) * 65_537 + rank) % 2**63  # torch takes seeds below 2**63
    random.seed(value)
    torch.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)
    try:
        import numpy as np

        np.random.seed(value % 2**32)
    except ImportError:
        pass


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


# ------------------------------------------------------------------------------------------------ load
def load_checkpoint(
    path: str | os.PathLike[str],
    parts: TrainingParts,
    strategy: Strategy,
    topology: Topology,
    device: torch.device,
    verify: bool = True,
) -> dict[str, int]:
    """Load ``path`` into ``parts``: all checks first, on every rank, then the tensors. Returns the counters."""
    WRITER.release_hold()  # an asynchronous save in flight has copied the state this load replaces
    error, ck = None, None
    try:
        # First, before anything that can fail on one rank only: under tensor and pipeline parallelism together the
        # shapes of the other stages' tensors are a collective (strategies/tensor_parallel/checkpoint.py).
        shapes = [strategy.state_shapes(model) for model in parts.models]
        ck = Checkpoint(path)
        problems = _compatibility(ck, parts, strategy, shapes)
        if verify and not problems:
            mine = range(topology.rank, len(ck.files), topology.world_size)  # the ranks verify the files between them
            problems = ck.verify(mine)
        if problems:
            error = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it before anything is loaded
        error = f"{type(e).__name__}: {e}"
    agree(error, device, f"loading the checkpoint {path}")
    assert ck is not None
    m = ck.manifest

    try:
        for i, model in enumerate(parts.models):
            strategy.load_sharded_state(model, parts.optimizers, ck.reader(i))
        _load_json_state(ck, parts)
    finally:
        ck.close()
    counters = {k: int(v) for k, v in m["counters"].items()}
    saved_mesh = (m["world_size"], m["pp_size"], m.get("tp_size", 1))
    step = counters.get("global_step", 0)
    # The ranks of a tp group draw alike from torch's generator (replicated activations): reseeded by their place
    # outside it (tp is the mesh's innermost axis).
    outer_rank = topology.rank // topology.tp_size
    if saved_mesh == (topology.world_size, topology.pp_size, topology.tp_size):
        _set_rng_state(m["rng"][topology.rank], device)
        if not _set_trackers(m["rng"][topology.rank].get("trackers"), parts.rng_trackers):
            _reseed_trackers(parts.rng_trackers, m["seed"], step, outer_rank)
    else:
        _reseed(m["seed"], step, outer_rank, device)
        _reseed_trackers(parts.rng_trackers, m["seed"], step, outer_rank)
    if dist.is_initialized():
        watched(dist.barrier)
    return counters


def _load_json_state(ck: Checkpoint, parts: TrainingParts) -> None:
    m, read_tensor = ck.manifest, ck.read_whole
    for opt, saved in zip(parts.optimizers, m["optimizers"]):
        for group, hyper in zip(opt.param_groups, saved["param_groups"]):
            group.update(from_json(hyper, read_tensor))
    for sched, saved in zip(parts.schedulers, m["schedulers"]):
        sched.load_state_dict(from_json(saved, read_tensor))
    for loader, saved in zip(parts.loaders, m["loaders"]):
        loader.load_state_dict(from_json(saved, read_tensor))
    for obj, saved in zip(parts.objects, m["objects"]):
        obj.load_state_dict(from_json(saved["state"], read_tensor))
    if parts.precision is not None and m["precision"] is not None:
        parts.precision.load_state_dict(from_json(m["precision"], read_tensor))


def _compatibility(
    ck: Checkpoint, parts: TrainingParts, strategy: Strategy, shapes: list[dict[str, tuple[int, ...]]]
) -> list[str]:
    """Every difference between the checkpoint and what is being loaded into, before anything is loaded."""
    m, where, problems = ck.manifest, ck.path / MANIFEST, []
    for kind, n_saved, n_now in (
        ("model", len(m["models"]), len(parts.models)),
        ("optimizer", len(m["optimizers"]), len(parts.optimizers)),
        ("LR scheduler", len(m["schedulers"]), len(parts.schedulers)),
        ("DataLoader", len(m["loaders"]), len(parts.loaders)),
        ("registered object", len(m["objects"]), len(parts.objects)),
    ):
        if n_saved != n_now:
            problems.append(
                f"{where} holds {n_saved} {kind}(s), and {n_now} are prepared (or registered) now; prepare the same "
                f"objects in the same order as when it was saved"
            )
    if problems:
        return problems
    for i, (model, now) in enumerate(zip(parts.models, shapes)):
        saved = ck.model_shapes(i)
        diffs = [f"{k}: missing from the checkpoint" for k in now if k not in saved]
        diffs += [f"{k}: in the checkpoint, not in the model" for k in saved if k not in now]
        diffs += [
            f"{k}: shape {list(saved[k])} in the checkpoint, {list(now[k])} in the model"
            for k in now
            if k in saved and tuple(saved[k]) != tuple(now[k])
        ]
        if diffs:
            problems.append(
                f"model {i} ({type(strategy.unwrap_model(model)).__name__}) does not match {where} "
                f"({len(diffs)} difference(s)): " + "; ".join(diffs[:5])
            )
    for i, (loader, saved_loader) in enumerate(zip(parts.loaders, m["loaders"])):
        problem = loader.resume_problem(from_json(saved_loader, None))
        if problem:
            problems.append(f"DataLoader {i}: {problem}")
    for j, (opt, saved_opt) in enumerate(zip(parts.optimizers, m["optimizers"])):
        if type(opt).__name__ != saved_opt["class"]:
            problems.append(f"optimizer {j} is {type(opt).__name__}; {where} holds the state of a {saved_opt['class']}")
        elif len(opt.param_groups) != len(saved_opt["param_groups"]):
            problems.append(
                f"optimizer {j} has {len(opt.param_groups)} param group(s); "
                f"{where} holds {len(saved_opt['param_groups'])}"
            )
    return problems


def _empty_dir(path: Path) -> bool:
    """An empty directory (a fresh tempfile.TemporaryDirectory, say): replacing it loses nothing."""
    return path.is_dir() and not any(path.iterdir())
