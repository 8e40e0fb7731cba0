"""The CPU heap policy: keep freed activation memory instead of returning it every step.

glibc serves allocations above its mmap threshold (128 KiB, raised dynamically up to 32 MiB)
with fresh mmap'd pages and unmaps them on free. A training step frees and re-allocates the
same large activation and gradient buffers every step, so each step page-faults them in
again: measured here at micro-batch 512, 2.6M page faults and a 1.6x slower step.

`retain` turns that off with `mallopt`: no mmap for heap blocks (M_MMAP_MAX = 0) and no
trimming of the heap top (M_TRIM_THRESHOLD = 1 GiB), so freed blocks are reused by the next
step. The cost: memory freed during the run is not handed back to the OS, so the process's
RSS stays at its peak (the peak itself does not grow: the same buffers are reused).
BENCHMARKS.md ("Allocator") has the measured speed and memory. glibc only: on another C
library, or when the call fails, nothing changes and the reason is returned.
"""

from __future__ import annotations

import ctypes
import ctypes.util

ALLOCATOR_MODES = ("auto", "system", "retain")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # from glibc's malloc.h


def resolve_allocator(mode: str, *, device_type: str) -> str:
    """The policy `mode` means on this device: "auto" is retain on CPU (where activations
    live on this heap) and system on CUDA (they live in torch's own caching allocator)."""
    if mode not in ALLOCATOR_MODES:
        raise ValueError(f"allocator {mode!r} is not one of {ALLOCATOR_MODES}")
    if mode == "auto":
        return "retain" if device_type == "cpu" else "system"
    return mode


def configure_allocator(mode: str, *, device_type: str) -> str:
    """Apply the heap policy to this process; returns what was done, for the run's log.

    Args:
        mode: "retain", "system" (leave glibc's defaults), or "auto" (`resolve_allocator`).
        device_type: "cpu" or "cuda".
    """
    if resolve_allocator(mode, device_type=device_type) == "system":
        return "system"
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return f"system (no mallopt in {libc_name or 'the C library'})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the trim threshold is an int, so 2^30 (1 GiB) per arena.
    if mallopt(_M_MMAP_MAX, 0) != 1 or mallopt(_M_TRIM_THRESHOLD, 1 << 30) != 1:
        return "system (mallopt refused the settings)"
    return "retain"
