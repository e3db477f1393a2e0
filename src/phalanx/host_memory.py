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

__all__ = ["set_mmap_threshold"]

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
