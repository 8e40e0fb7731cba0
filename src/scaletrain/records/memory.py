"""Memory per logging window: the peak above what the run holds after set-up.

The lifetime peak RSS is dominated by the data and model floor loaded before
the first step, so it hides what the step itself costs (activations, gradients, optimizer
state, communication buffers). Each logging window therefore also reports its own peak,
read from the kernel's high-water mark (VmHWM in /proc/self/status) after resetting it at
the window's start (writing "5" to /proc/self/clear_refs), and that peak minus the RSS
measured right after set-up. On CUDA the allocator's own peak counters play these roles.
Where /proc cannot be reset (another kernel, a sandbox), the window peak falls back to the
lifetime peak and `window_resettable` is False.

The lifetime peak is this process's own: VmHWM, kept across the windows' resets, not
`ru_maxrss`, which Linux carries over fork and exec from the parent (a worker started by
a launcher that had loaded the data and the model would report the launcher's peak).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

import torch

_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")
_PEAK_BEFORE_RESETS = [0]  # the highest VmHWM seen before a window's reset cleared it


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    return None


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def lifetime_peak_bytes() -> int:
    """Peak memory of this process so far: CUDA allocator peak on GPU, else peak RSS (its
    own VmHWM; `ru_maxrss` where /proc has none)."""
    if _cuda():
        return int(torch.cuda.max_memory_allocated())
    hwm = _status_bytes("VmHWM")
    if hwm is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return max(hwm, _PEAK_BEFORE_RESETS[0])


def current_bytes() -> int:
    """Memory held now: CUDA allocated bytes on GPU, else resident set size."""
    if _cuda():
        return int(torch.cuda.memory_allocated())
    return _status_bytes("VmRSS") or lifetime_peak_bytes()


@dataclass
class WindowPeak:
    """Tracks the peak of each logging window above the post-set-up baseline."""

    baseline: int  # bytes held after set-up, before the first step
    window_resettable: bool = True

    @classmethod
    def start(cls) -> WindowPeak:
        """Measure the baseline now (call after set-up) and open the first window."""
        tracker = cls(baseline=current_bytes())
        tracker.reset()
        return tracker

    def reset(self) -> None:
        """Open a new window: the next `peak()` covers only what happens from here."""
        if _cuda():
            torch.cuda.reset_peak_memory_stats()
            return
        _PEAK_BEFORE_RESETS[0] = lifetime_peak_bytes()
        try:
            _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            self.window_resettable = False

    def peak(self) -> int:
        """Peak bytes since the last reset (the lifetime peak where that cannot be reset)."""
        if _cuda():
            return int(torch.cuda.max_memory_allocated())
        hwm = _status_bytes("VmHWM") if self.window_resettable else None
        return hwm if hwm is not None else lifetime_peak_bytes()

    def record(self) -> dict[str, int]:
        """The window's numbers for a metrics record, then open the next window."""
        peak = self.peak()
        self.reset()
        return {
            "window_peak_mem_bytes": peak,
            "window_peak_above_baseline_bytes": max(0, peak - self.baseline),
        }


def global_bytes(tensors) -> int:
    """Bytes of the tensors at their global shapes: a DTensor counts whole (what gathering
    it costs), a meta tensor by its shape."""
    return sum(t.numel() * t.element_size() for t in tensors)


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo: what the machine can still give (None where there is
    none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    return None


def local_bytes(tensors) -> int:
    """Bytes of the tensors as this rank holds them: a DTensor counts its local shard only
    (FSDP's 1/N of a parameter, TP's slice), not its global shape."""
    from torch.distributed.tensor import DTensor

    total = 0
    with torch.no_grad():
        for t in tensors:
            if t is None:
                continue
            if isinstance(t, DTensor):
                t = t.to_local()
            total += t.numel() * t.element_size()
    return total


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's parameter and optimizer-state bytes, from the tensors it holds now."""
    states = (
        v
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return {
        "param_bytes": local_bytes(model.parameters()),
        "optim_state_bytes": local_bytes(states),
    }
