"""The attention kernel, chosen by measurement: which of torch's SDPA backends runs a
model's own attention calls fastest on this device, in this dtype.

`F.scaled_dot_product_attention` picks a backend by fixed rules. On a CPU those rules take
the fused flash kernel whenever it applies, and its bf16 backward can be several times
slower than the math backend's batched matmuls at the short sequences and narrow heads of
small models (bench/step_anatomy.py shows the share, BENCHMARKS.md the figures). Which one
wins depends on the CPU, the dtype, the sequence length and the head width, so it is
measured, not assumed:

1. `record_calls` runs the model's forward once (a batch of two examples, no gradient)
   and records each SDPA call's shapes, dtype and flags, letting the call run;
2. `fastest_backend` times each candidate backend on tensors of those shapes (the batch
   dimension widened to the micro-batch), forward and backward, and returns the fastest;
3. the train step runs its forward under `attention_context(name)` (the precision
   policy's forward context holds it), and the checkpoint keeps the name, so a resumed run
   uses the kernel the run started with.

On CUDA torch's own choice stands (its rules know the flash, memory-efficient and cuDNN
kernels and their limits); in float64, which proves numerics, too.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

CPU_BACKENDS = ("FLASH_ATTENTION", "MATH")  # what a CPU build of torch has


@dataclass(frozen=True)
class AttentionCall:
    """What one `scaled_dot_product_attention` call was given (shapes, not values)."""

    query: tuple[int, ...]  # (B, heads, T, head_dim)
    key: tuple[int, ...]
    value: tuple[int, ...]
    dtype: torch.dtype
    mask: tuple[int, ...] | None  # attn_mask's shape (a bool mask), or None
    causal: bool
    gqa: bool  # enable_gqa: fewer key/value heads than query heads

    def widened(self, batch: int, recorded: int) -> AttentionCall:
        """The same call at `batch` examples: every leading dimension of `recorded` (the
        batch the forward was run with) becomes `batch`."""

        def widen(shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
            if shape is None or not shape or shape[0] != recorded:
                return shape
            return (batch, *shape[1:])

        return replace(
            self,
            query=widen(self.query),
            key=widen(self.key),
            value=widen(self.value),
            mask=widen(self.mask),
        )


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[AttentionCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
            given = {**dict(zip(names, args)), **kwargs}
            mask, query = given.get("attn_mask"), given["query"]
            # autocast casts SDPA's inputs (CPU: to its dtype): the kernel runs in that one
            device = query.device.type
            cast = torch.is_autocast_enabled(device) and query.is_floating_point()
            self.calls.append(
                AttentionCall(
                    query=tuple(given["query"].shape),
                    key=tuple(given["key"].shape),
                    value=tuple(given["value"].shape),
                    dtype=torch.get_autocast_dtype(device) if cast else query.dtype,
                    mask=tuple(mask.shape) if mask is not None else None,
                    causal=bool(given.get("is_causal", False)),
                    gqa=bool(given.get("enable_gqa", False)),
                )
            )
        return func(*args, **kwargs)


def record_calls(run: Callable[[], object]) -> list[AttentionCall]:
    """`run()` with every SDPA call it makes recorded, in order (repeats included)."""
    recorder = _Recorder()
    with recorder, torch.no_grad():
        run()
    return recorder.calls


def time_call(call: AttentionCall, backend: str, *, reps: int = 3) -> float:
    """Seconds of one forward and backward of `call` under `backend` (the fastest of
    `reps` after one warm-up). Raises RuntimeError where the backend cannot run it."""

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, dtype=call.dtype, requires_grad=True)

    q, k, v = tensor(call.query), tensor(call.key), tensor(call.value)
    mask = torch.ones(call.mask, dtype=torch.bool).tril() if call.mask is not None else None
    best = float("inf")
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        for i in range(reps + 1):
            started = time.perf_counter()
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=call.causal, enable_gqa=call.gqa
            )
            out.sum().backward()
            if i:  # the first is the warm-up
                best = min(best, time.perf_counter() - started)
    return best


def fastest_backend(
    calls: list[AttentionCall],
    *,
    candidates: tuple[str, ...] = CPU_BACKENDS,
    timer: Callable[[AttentionCall, str], float] = time_call,
) -> tuple[str | None, dict[str, float]]:
    """The candidate whose kernels take the least time over all `calls` (each distinct call
    timed once, counted as often as it was made), and each candidate's seconds; None (and
    no times) when there is no call, or no candidate could run them all."""
    if not calls:  # a model without attention: nothing to choose
        return None, {}
    counts = collections.Counter(calls)
    totals: dict[str, float] = {}
    for backend in candidates:
        try:
            totals[backend] = sum(timer(call, backend) * n for call, n in counts.items())
        except RuntimeError:  # "No available kernel": this backend cannot run a call
            continue
    if not totals:
        return None, {}
    return min(totals, key=totals.__getitem__), totals


@contextlib.contextmanager
def attention_context(backend: str | None) -> Iterator[None]:
    """SDPA calls inside run on `backend` (a name of SDPBackend); None: torch's choice."""
    if backend is None:
        yield
        return
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        yield
