"""Host memory: glibc's heap, and peak resident memory.

glibc serves a block below its mmap threshold from the heap, and raises that threshold (up to 32 MiB) each time a
larger mapped block is freed. A freed block in the middle of the heap stays resident, and the next large request
fits in it only if nothing smaller took part of it first. The zero strategies used to allocate and free same-sized
flat buffers many times a step (zero3 gathers each unit twice and frees it twice), and the resident memory grew step
after step: 1.4-1.9 x what the process held, on 24 x Linear(1024) under zero3. They now take those buffers from a
pool they own (``strategies/zero/pool.py``), and the growth is gone: what the process holds (``host_bytes_allocated``)
is within 4% of ``memory_report``'s ``expected_peak`` on 2 and 4 ranks.

What remains above it is the free room glibc keeps around torch's own temporaries, which the pool cannot own:
autograd's gradient of each weight (made by the matmul in backward), autocast's casts and Adam's temporaries.
Measured (2 cores, gloo, the model above; benchmarks/results/zero-pool.md): 1.21-1.38 x the prediction in resident
memory in fp32, 1.24 x in bf16-mixed on 2 ranks and 1.76 x on 4, varying from run to run; 14-24% less than before the
pool.
``host_mmap_threshold_mb`` maps those temporaries instead and returns them when freed, and brings resident memory to
1.07 x, for a page fault on every page of them: 40% more CPU time per step on that small-batch model (70% before the
pool), so it is off by default; 1 when host memory is what binds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

import torch

__all__ = [
    "set_mmap_threshold",
    "release_free_heap",
    "host_bytes_allocated",
    "peak_memory_bytes",
    "peak_memory_mib",
    "gather_peak_memory",
]

_M_MMAP_THRESHOLD = -3


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


@functools.cache
def _glibc() -> Any:
    """glibc, or None where there is none (macOS, musl, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim, libc.mallinfo2  # noqa: B018 -- glibc has all three (2.33 and later)
    except (OSError, AttributeError):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    return libc


def set_mmap_threshold(mb: float) -> bool:
    """Fix glibc's mmap threshold at ``mb`` MiB; False where there is no glibc (macOS, musl) or it refuses."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mb * 2**20)))


def release_free_heap() -> bool:
    """Give the free pages inside glibc's heap back to the system (``malloc_trim``): once, after a phase that made
    and freed many large temporaries (a zero3 prepare lays units out one by one). False where there is no glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def host_bytes_allocated() -> int | None:
    """Bytes that this process's main thread holds from malloc now, in its heap and in mapped blocks (glibc's
    ``mallinfo2``: ``uordblks + hblkhd``): what the process holds, without the free room the allocator keeps
    resident. None where there is no glibc."""
    libc = _glibc()
    if libc is None:
        return None
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def peak_memory_bytes(device: torch.device | None = None) -> dict[str, int]:
    """This process's peak resident memory (Linux: ``VmHWM``, which ``/proc/self/clear_refs`` can reset; elsewhere
    ``ru_maxrss``) and, on CUDA, the peak bytes allocated on ``device``, measured from the process."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            out["rss"] = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        out["rss"] = int(peak_memory_mib()["rss_mib"] * 2**20)
    if device is not None and device.type == "cuda":
        out["cuda_allocated"] = int(torch.cuda.max_memory_allocated(device))
    return out


def peak_memory_mib(device: torch.device | None = None) -> dict[str, float]:
    """This process's peak resident memory (``ru_maxrss``) and, on CUDA, peak allocated device memory, in MiB."""
    out: dict[str, float] = {}
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux reports KiB, macOS bytes.
        out["rss_mib"] = rss / 2**20 if sys.platform == "darwin" else rss / 2**10
    except ImportError:  # Windows
        out["rss_mib"] = float("nan")
    if device is not None and device.type == "cuda":
        out["cuda_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def gather_peak_memory(device: torch.device) -> list[dict[str, float]]:
    """Every rank's :func:`peak_memory_mib`, in rank order. A collective: every rank must call it."""
    import torch.distributed as dist

    from phalanx.runtime.collective_log import watched

    mine = peak_memory_mib(device)
    keys = sorted(mine)
    t = torch.tensor([[mine[k] for k in keys]], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        watched(dist.all_gather, parts, t)
        t = torch.cat(parts)
    return [dict(zip(keys, row)) for row in t.cpu().tolist()]
