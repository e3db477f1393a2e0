"""``hvd.elastic``: Horovod's elastic training API on phalanx's restarts.

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

Run it with ``phalanx launch -n 4 --max-restarts 3 train.py`` (torchrun's ``--max-restarts`` works too). Horovod
keeps the surviving processes alive when one fails, rolls them back to the last commit in memory and brings in new
workers; under torchrun's agent, which phalanx launches on, a failure restarts every worker process instead. So a
commit is kept in memory (``restore`` rolls back to it, as in Horovod) and, when the launch can restart (torchrun's
``TORCHELASTIC_MAX_RESTARTS`` > 0), written by every rank to its own file under ``<resume_from>/hvd-elastic/``
(``--resume-from``), or else a temporary folder named after the launch. After a restart, ``@hvd.elastic.run`` finds
the newest commit any rank holds, restores it, calls the reset callbacks (the world may have a new size), and
synchronises the state from a rank that holds that commit before calling the function again. A collective that
fails (a peer died) raises ``HorovodInternalError``; under a restartable launch it ends the process so that the
agent restarts the group, and otherwise ``run`` restores the last commit in memory, re-initialises and goes on, as
Horovod does. Membership changes also come as restarts here, so ``check_host_updates`` never raises
``HostsUpdatedInterrupt``.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from phalanx.checkpoint.format import CheckpointError, from_json, to_json
from phalanx.checkpoint.resume import ENV_LAUNCH_ID
from phalanx.compat.horovod.coordinator import HorovodInternalError
from phalanx.compat.horovod.more_ops import HostsUpdatedInterrupt
from phalanx.compat.horovod.ops import allreduce
from phalanx.compat.horovod.state import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from phalanx.compat.horovod.world import Max, init, rank, shutdown, size
from phalanx.config.settings import resolve_config
from phalanx.logging import get_logger

__all__ = ["State", "ObjectState", "TorchState", "ElasticSampler", "run"]

_META = "phalanx.hvd.elastic"  # the safetensors metadata key that holds a commit's JSON


def _restartable() -> bool:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def _restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _commit_dir() -> Path | None:
    """Where commits outlive a process: None when nothing restarts the processes."""
    if not _restartable():
        return None
    resume_from = resolve_config().engine.resume_from
    if resume_from:
        return Path(resume_from) / "hvd-elastic"
    launch = os.environ.get(ENV_LAUNCH_ID) or os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return Path(tempfile.gettempdir()) / f"phalanx-hvd-elastic-{launch}"


class State:
    """What an elastic run keeps in step across ranks: ``commit`` saves it, ``restore`` rolls back to the last
    commit, ``sync`` copies one rank's to the others, and reset callbacks run after a restart."""

    def __init__(self, bcast_object: Callable[..., Any] = broadcast_object, get_rank: Callable[[], int] = rank) -> None:
        self._bcast_object, self._rank = bcast_object, get_rank
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._commits = 0
        self._sync_root = 0

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Functions to call after a restart (a worker lost or added), before the state is synchronised; for
        example to scale the learning rate to the new number of ranks."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (in memory, and on disk when the launch can restart), then check for host changes."""
        self.save()
        self._commits += 1
        self._persist()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises ``HostsUpdatedInterrupt`` here when hosts come or go; under torchrun a change of members
        restarts the processes instead, so there is nothing to check."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a restart, before the callbacks and the synchronisation."""

    # -- what outlives a restart -----------------------------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_snapshot(self, snapshot: dict[str, Any]) -> None:
        raise NotImplementedError

    def _file(self) -> Path | None:
        folder = _commit_dir()
        return None if folder is None else folder / f"rank{rank()}.safetensors"

    def _persist(self) -> None:
        """This rank's commit on disk, as phalanx checkpoints are: tensors in safetensors, the rest as JSON in its
        metadata; nothing is pickled, so loading it runs no code (a state that holds other objects is refused)."""
        path = self._file()
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        saved = {"commit": self._commits, "world_size": size(), "state": self._snapshot()}
        try:
            doc = to_json(saved, "commit", tensors)
        except CheckpointError as e:
            raise CheckpointError(
                f"hvd.elastic: the state cannot be committed to disk for a restart: {e}. Keep numbers, strings, "
                "lists, dicts and tensors in ObjectState/TorchState"
            ) from None
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={_META: json.dumps(doc)})
        os.replace(tmp, path)  # a rank killed while writing leaves its previous commit whole

    def _resume(self) -> bool:
        """After a restart: load the newest commit any rank holds, and sync from a rank that holds it."""
        path = self._file()
        saved = _read_commit(path) if path is not None and path.exists() else None
        mine = saved["commit"] if saved is not None else -1
        newest = int(allreduce(torch.tensor([mine]), op=Max, name="hvd.elastic.commit").item())
        if newest < 0:
            return False
        holders = allgather_object(mine == newest, name="hvd.elastic.holders")
        self._sync_root = holders.index(True)
        if saved is not None and mine == newest:
            self._load_snapshot(saved["state"])
        self._commits = newest
        get_logger().info(
            f"hvd.elastic: restart {_restart_count()} resumes from commit {newest} (rank {self._sync_root}'s copy, "
            f"saved on {saved['world_size'] if saved else '?'} ranks, now {size()})"
        )
        return True


def _read_commit(path: Path) -> dict[str, Any]:
    with safe_open(str(path), framework="pt") as f:
        doc = json.loads((f.metadata() or {})[_META])
        return dict(from_json(doc, f.get_tensor))


class ObjectState(State):
    """State made of plain Python objects, given as keyword arguments and kept as attributes."""

    def __init__(
        self, bcast_object: Callable[..., Any] = broadcast_object, get_rank: Callable[[], int] = rank, **kwargs: Any
    ) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = broadcast_object(self._saved_state, self._sync_root, name="hvd.elastic.objects")
            self._set_attrs()
        self._sync_root = 0  # a resumed run synchronised from the rank holding the newest commit; then rank 0

    def _set_attrs(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, copy.deepcopy(v))

    def _snapshot(self) -> dict[str, Any]:
        return {"objects": self._saved_state}

    def _load_snapshot(self, snapshot: dict[str, Any]) -> None:
        self._saved_state = snapshot["objects"]
        self._set_attrs()


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's sampler for elastic runs: it shards the samples not yet processed in this epoch over the current
    ranks (padding the last round as DistributedSampler does), and remembers the processed ones
    (``record_batch``/``record_indices``) across a restart when it is part of a ``TorchState``."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.processed_indices = epoch, set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        start = batch_idx * batch_size
        self.record_indices(self.indices[start : start + batch_size])

    def record_indices(self, indices: Any) -> None:
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch, self.processed_indices = state_dict["epoch"], set(state_dict["processed_indices"])
        self.reset()

    def reset(self) -> None:
        self.num_replicas, self.rank = size(), rank()
        self.remaining_indices = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Any:
        order = list(self.remaining_indices)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        if order:
            order += (order * math.ceil(self.total_size / len(order)))[: self.total_size - len(order)]
        self.indices = order[self.rank : self.total_size : self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


class _Handler:
    """How ``TorchState`` saves, restores and synchronises one of its models, optimizers or samplers."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self, root: int) -> None:
        if isinstance(self.value, torch.nn.Module):
            broadcast_parameters(self.value.state_dict(), root_rank=root)
        elif isinstance(self.value, torch.optim.Optimizer):
            broadcast_optimizer_state(self.value, root_rank=root)
        else:  # a sampler: every rank's processed samples count
            state = self.value.state_dict()
            everyone = allgather_object(state["processed_indices"], name="hvd.elastic.sampler")
            state["processed_indices"] = set().union(*everyone)
            self.value.load_state_dict(broadcast_object(state, root, name="hvd.elastic.sampler.state"))


_HANDLED = (torch.nn.Module, torch.optim.Optimizer, ElasticSampler)


class TorchState(ObjectState):
    """``TorchState(model, optimizer, **objects)``: models, optimizers and ``ElasticSampler`` among the arguments
    are saved with their ``state_dict``s and synchronised with ``broadcast_parameters`` and
    ``broadcast_optimizer_state``; the other arguments are plain objects."""

    _handlers: dict[str, _Handler]

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handled = {k: v for k, v in kwargs.items() if isinstance(v, _HANDLED)}
        object.__setattr__(self, "_handlers", {k: _Handler(v) for k, v in handled.items()})
        for k, v in handled.items():
            object.__setattr__(self, k, v)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in handled})

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name] = _Handler(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self) -> None:
        for h in self._handlers.values():
            h.sync(self._sync_root)
        super().sync()

    def _snapshot(self) -> dict[str, Any]:
        return {"handlers": {k: h.saved for k, h in self._handlers.items()}, **super()._snapshot()}

    def _load_snapshot(self, snapshot: dict[str, Any]) -> None:
        for k, saved in snapshot["handlers"].items():
            if k in self._handlers:
                self._handlers[k].saved = saved
                self._handlers[k].restore()
        super()._load_snapshot(snapshot)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function ``func(state, ...)``: the state is synchronised before it runs (from the
    newest commit after a restart), and a failed collective rolls back to the last commit (see the module)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(
                f"@hvd.elastic.run: the first argument must be a hvd.elastic.State (TorchState, ObjectState); got "
                f"{type(state).__name__}"
            )
        if state._resume() and _restart_count() > 0:
            state.on_reset()
        while True:
            try:
                state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                if _restartable():
                    raise  # the agent restarts every rank; they resume from the last commit on disk
                state.restore()
            except HostsUpdatedInterrupt:
                pass
            shutdown()
            init()
            state.on_reset()

    return wrapper
