"""The CPU heap policy: keep freed activation memory instead of returning it every step.

glibc serves allocations above its mmap threshold (128 KiB, raised dynamically up to 32 MiB)
with fresh mmap'd pages and unmaps them on free. A training step frees and re-allocates the
same large activation and gradient buffers every step, so each step page-faults them in
again (BENCHMARKS.md, "Allocator", has the page faults and the step times).

`retain` turns that off with `mallopt`: no mmap for heap blocks (M_MMAP_MAX = 0) and no
trimming of the heap top (M_TRIM_THRESHOLD = 1 GiB), so freed blocks are reused by the next
step. The cost: memory freed during the run is not handed back to the OS, so the process's
RSS stays at its peak (the peak itself does not grow: the same buffers are reused).
BENCHMARKS.md ("Allocator") has the measured speed and memory. glibc only: on another C
library, or when the call fails, nothing changes and the reason is returned.

`release` is the other way, for a model whose shards, gradients and gathered blocks are
large: fixed thresholds (mmap from 1 MiB, trim the heap top beyond 4 MiB) stop glibc from
raising its mmap threshold as it frees blocks, so every block of a MiB or more is its own
mapping, handed back when freed. With glibc's defaults, FSDP's gathered parameters and
gradients of 16-32 MiB come from the heap after the first frees, and the freed holes
between them stay resident: an HF Llama of 0.8B parameters under dp_shard=4 crept from 1.3
to 3.4 GiB a rank (above the whole model's 3.07 GiB) before its first step ended; with
`release` it stays at 2.4 (bench/big_model.py, BENCHMARKS.md). The cost is a page fault
per page of every large block each step, small next to the arithmetic of such a model.

`auto` picks by the model: `retain` on CPU for a model under AUTO_RELEASE_BYTES of
parameters (its steps are short and page faults a large share of them), `release` from
there on; `system` on CUDA, where tensors live in torch's caching allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util

ALLOCATOR_MODES = ("auto", "system", "retain", "release")
AUTO_RELEASE_BYTES = 256 * 2**20  # a model's parameters from which auto releases on CPU
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # from glibc's malloc.h
_MMAP_MAX_DEFAULT = 65536  # glibc's default M_MMAP_MAX (retain sets it to 0)
_SETTINGS = {  # mode -> the mallopt calls that make it
    "retain": ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 1 << 30)),  # 1 GiB per arena: an int
    "release": (
        (_M_MMAP_MAX, _MMAP_MAX_DEFAULT),
        (_M_MMAP_THRESHOLD, 1 << 20),
        (_M_TRIM_THRESHOLD, 4 << 20),
    ),
}


def resolve_allocator(mode: str, *, device_type: str, model_bytes: int | None = None) -> str:
    """The policy `mode` means on this device: "auto" is system on CUDA (tensors live in
    torch's own caching allocator); on CPU, retain for a model under AUTO_RELEASE_BYTES
    of parameters (or of unknown size) and release from there on.

    Args:
        mode: one of ALLOCATOR_MODES.
        device_type: "cpu" or "cuda".
        model_bytes: the whole model's parameter bytes (a meta-built model's count), if known.
    """
    if mode not in ALLOCATOR_MODES:
        raise ValueError(f"allocator {mode!r} is not one of {ALLOCATOR_MODES}")
    if mode != "auto":
        return mode
    if device_type != "cpu":
        return "system"
    return "release" if (model_bytes or 0) >= AUTO_RELEASE_BYTES else "retain"


def configure_allocator(mode: str, *, device_type: str, model_bytes: int | None = None) -> str:
    """Apply the heap policy to this process; returns what was done, for the run's log.
    It may be called again (auto, once the model's size is known): each policy sets every
    value it depends on.

    Args:
        mode: "retain", "release", "system" (leave glibc's defaults), or "auto"
            (`resolve_allocator`).
        device_type: "cpu" or "cuda".
        model_bytes: as for `resolve_allocator`.
    """
    chosen = resolve_allocator(mode, device_type=device_type, model_bytes=model_bytes)
    if chosen == "system":
        return "system"
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return f"system (no mallopt in {libc_name or 'the C library'})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success.
    if not all(mallopt(param, value) == 1 for param, value in _SETTINGS[chosen]):
        return "system (mallopt refused the settings)"
    return chosen
