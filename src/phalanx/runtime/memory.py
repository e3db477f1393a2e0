"""Host memory that follows what the process holds (glibc's ``M_MMAP_THRESHOLD``).

glibc serves a block below its mmap threshold from the heap, and raises that threshold (up to 32 MiB) each time a
larger mapped block is freed. The zero strategies free and allocate same-sized flat buffers many times a step
(zero3 gathers each unit twice and frees it twice), so after the first free those buffers come from the heap,
interleave with small allocations, and the freed room stays in the process. Measured on CPU (2 ranks, 24 x
Linear(1024), zero3, AdamW): the resident memory grew with every step, to 2.3 x what the process held after ten
steps; with the threshold fixed at 1 MiB it stayed within 13% of it. ``host_mmap_threshold_mb`` fixes it: blocks of
at least that size are mapped, and returned to the system when freed. It is off by default, because each such
allocation then faults its pages in afresh: measured side by side (bench_zero --malloc-rows, mlp, 2 ranks), zero2
took 1.54 x and zero3 1.71 x as long per step, for 62 and 108 MiB less peak RSS per rank.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

__all__ = ["set_mmap_threshold", "peak_memory_bytes", "peak_memory_mib", "gather_peak_memory"]

_M_MMAP_THRESHOLD = -3


def set_mmap_threshold(mb: float) -> bool:
    """Fix glibc's mmap threshold at ``mb`` MiB; False where there is no glibc (macOS, musl) or it refuses."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(mb * 2**20)))


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
