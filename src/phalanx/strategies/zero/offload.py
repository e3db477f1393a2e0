"""Where the zero strategies keep optimizer state (and zero3's parameter shards): device, host, or disk.

``offload="cpu"`` puts them in host memory, pinned when the compute device is CUDA, so that the copies
to and from the device can run asynchronously. ``offload="disk"`` puts them in memory-mapped files under
a directory the user gives. The files are unlinked as soon as they are mapped, so nothing is left behind
even after a crash. After each use the pages are handed back with ``madvise(MADV_DONTNEED)``: the data
stays in the file (the page cache), and the process's resident memory falls by their size.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import torch

from phalanx.runtime.placement import LEDGER

__all__ = ["OFFLOAD_MODES", "StateStore", "check_offload_dir"]

OFFLOAD_MODES = ("none", "cpu", "disk")


def check_offload_dir(directory: str | None) -> Path:
    """The directory for disk offload, created if needed; a clear error when it cannot be written."""
    if not directory:
        raise ValueError(
            "offload='disk' needs a directory for the memory-mapped files: set offload_dir=/path/with/space"
        )
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(
            f"offload_dir {str(path)!r} is not a writable directory ({e.strerror or e}); "
            "give a directory this user can write to, on a disk with room for the optimizer state"
        ) from None
    return path


class StateStore:
    """Allocates the tensors that may be offloaded, and releases disk-backed pages after each use."""

    def __init__(self, mode: str, device: torch.device, directory: str | None = None, rank: int = 0) -> None:
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"unknown offload {mode!r}; valid values: {', '.join(OFFLOAD_MODES)}")
        self.mode = mode
        self.compute_device = device
        self.device = device if mode == "none" else torch.device("cpu")
        self.directory = check_offload_dir(directory) if mode == "disk" else None
        self.rank = rank
        self._maps: list[mmap.mmap] = []
        self._pointers: set[int] = set()
        self._count = 0
        self.disk_bytes = 0

    @property
    def pinned(self) -> bool:
        return self.mode == "cpu" and self.compute_device.type == "cuda"

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor in this store's tier whose contents will all be written (zeros on disk)."""
        if self.mode != "disk" or numel == 0:
            return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pinned)
        return self.zeros(numel, dtype)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled flat tensor in this store's tier."""
        if self.mode != "disk" or numel == 0:
            return torch.zeros(numel, dtype=dtype, device=self.device, pin_memory=self.pinned)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        assert self.directory is not None
        path = self.directory / f"phalanx-offload-{os.getpid()}-r{self.rank}-{self._count}.bin"
        self._count += 1
        with open(path, "w+b") as f:
            f.truncate(nbytes)  # a sparse file: reads as zeros, takes disk space only as it is written
            mapped = mmap.mmap(f.fileno(), nbytes)
        path.unlink()  # the mapping keeps the data; no file outlives the process
        self._maps.append(mapped)
        self.disk_bytes += nbytes
        t = torch.frombuffer(mapped, dtype=dtype)
        self._pointers.add(t.untyped_storage().data_ptr())
        return t

    def host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled flat tensor in host memory (not on disk) that copies to or from the compute device read or
        write: pinned when that device is CUDA, so that those copies are DMA transfers that can run asynchronously
        (from pageable memory the driver stages them through a bounce buffer, synchronously)."""
        return torch.zeros(numel, dtype=dtype, pin_memory=self.compute_device.type == "cuda")

    def placed(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """``tensor``, which prepare allocated in this store's tier, counted in the placement ledger when that tier is
        the compute device (no offload); an offloaded one is on the host, and not the ledger's."""
        return LEDGER.record(tensor, what) if self.mode == "none" else tensor

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` (same shape and dtype) in this store's tier."""
        out = self.zeros(tensor.numel(), tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out

    def owns(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lives in one of this store's memory-mapped files."""
        if self.mode != "disk" or tensor.numel() == 0:
            return False
        return tensor.untyped_storage().data_ptr() in self._pointers

    def release(self) -> None:
        """Drop the disk-backed pages from this process's resident memory (their data stays in the files)."""
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED)
