"""The placement ledger: every tensor ``engine.prepare`` puts on the compute device, counted in one place.

A strategy that moves a tensor onto the device during prepare calls ``LEDGER.to_device``; one that allocates a
tensor straight on the device (a zero shard, a gradient slice) hands it to ``LEDGER.record``. The ledger counts the
bytes of each tensor's *storage* (``untyped_storage().nbytes()``, what the allocator gave, a view's whole base
included, each storage once), and forgets them when the storage is freed (a finalizer on the storage) or resized
(``LEDGER.resized``: zero3 empties a unit's working buffer in place, and fills it again for a forward). So
``live_bytes`` is what prepare's placements hold on the device now, and ``peak_bytes`` the most they held at once:
the claims "zero3 moves only this rank's shards plus one unit" and "offload keeps the shards on the host" can be
checked from them, and on CUDA ``live_bytes`` follows ``torch.cuda.memory_allocated`` (the collectives' transient
buffers of prepare, freed before it returns, are not counted).

What counts is what is routed here, whatever the device: a strategy routes its placements onto its compute device,
never its offload tier (host or disk). On a CPU-only machine the compute device is the CPU and those "moves" are
no-ops, but they still count as placements, so that a CPU test sees what a GPU would hold. A tensor already on the
device when prepare places it counts too (it is held there because of prepare as much as a moved one).

The counts are per process (each rank its own). ``LEDGER.reset()`` forgets everything counted so far.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

__all__ = ["LEDGER", "PlacementLedger", "place_module", "place_buffers"]


class PlacementLedger:
    """Bytes placed on the compute device by ``engine.prepare``: live now, at peak, and each placement's name."""

    def __init__(self) -> None:
        # storage key -> (bytes counted now, the finalizer that forgets it when the storage is freed)
        self._entries: dict[int, tuple[int, weakref.finalize]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.moves: list[tuple[str, int]] = []

    def reset(self) -> None:
        """Forget every placement counted so far: live and peak back to 0, no moves."""
        for _, fin in self._entries.values():
            fin.detach()
        self._entries.clear()
        self.live_bytes = self.peak_bytes = 0
        self.moves = []

    def to_device(
        self, t: torch.Tensor, device: torch.device | str, non_blocking: bool = False, what: str = "tensor"
    ) -> torch.Tensor:
        """``t.to(device)``, counted: the result's storage bytes are placed on ``device`` (also when ``t`` was there
        already and nothing moved)."""
        return self.record(t.to(device, non_blocking=non_blocking), what)

    def record(self, t: torch.Tensor, what: str = "tensor") -> torch.Tensor:
        """Count ``t``, made on the compute device by prepare without a move (allocated there); returns ``t``. A
        storage already counted is not counted again; a meta tensor holds no memory, and a tensor with no storage of
        its own (sparse, a wrapper subclass) cannot be followed: neither is counted."""
        if t.is_meta or t.layout != torch.strided:
            return t
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        key = storage._cdata
        if key in self._entries:
            return t
        nbytes = storage.nbytes()
        forget = weakref.finalize(storage, self._freed, key)
        forget.atexit = False  # nothing to count at exit
        self._entries[key] = (nbytes, forget)
        self.moves.append((what, nbytes))
        self._add(nbytes)
        return t

    def resized(self, t: torch.Tensor) -> None:
        """``t``'s storage was resized in place (zero3 frees and regathers a unit so): count its present size. A
        storage the ledger does not count is ignored."""
        storage = t.untyped_storage()
        entry = self._entries.get(storage._cdata)
        if entry is not None:
            nbytes = storage.nbytes()
            self._entries[storage._cdata] = (nbytes, entry[1])
            self._add(nbytes - entry[0])

    def _freed(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[0]

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


LEDGER = PlacementLedger()


def _names(module: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), name)
    return names


def place_module(module: nn.Module, device: torch.device | str, what: str = "", empty: bool = False) -> nn.Module:
    """``module.to(device)`` through the ledger: each parameter, gradient and buffer is moved (and counted) one by
    one, by ``nn.Module._apply`` as ``.to`` does, so that modules which override ``_apply`` keep working.
    ``empty=True`` is ``module.to_empty(device=device)`` instead: tensors allocated on the device, uninitialised
    (for a block built on the meta device). ``what`` prefixes each placement's name."""
    names = _names(module)
    prefix = f"{what} " if what else ""

    def move(t: torch.Tensor) -> torch.Tensor:
        label = prefix + names.get(id(t), "gradient")
        if empty:
            return LEDGER.record(torch.empty_like(t, device=device), label)
        return LEDGER.to_device(t, device, what=label)

    return module._apply(move)


def place_buffers(module: nn.Module, device: torch.device | str, what: str = "") -> None:
    """Move ``module``'s real buffers (not meta ones) to ``device`` through the ledger; parameters stay where they are
    (zero3 places them a unit at a time, sharded)."""
    prefix = f"{what} " if what else ""
    for mname, m in module.named_modules():
        for name, b in m._buffers.items():
            if b is not None and not b.is_meta:
                label = f"{prefix}buffer {mname}.{name}" if mname else f"{prefix}buffer {name}"
                m._buffers[name] = LEDGER.to_device(b, device, what=label)
