"""Gradient compression through DDP communication hooks, with the bytes each rank sends.

Hooks (`parallel.comm_hook`):
- none: DDP's own all-reduce of fp32 buckets.
- fp16 / bf16: torch's stock `fp16_compress_hook` / `bf16_compress_hook` (cast the
  bucket, divide by the world size, all-reduce, cast back in place), called from
  `compress_hook`, a thin wrapper that counts the bytes and passes the process group.
  Registering the wrapper, not the stock function, is also what lets bf16 run on gloo:
  DDP's `register_comm_hook` refuses a hook *named* `bf16_compress_hook` unless it has
  CUDA + NCCL >= 2.10, although gloo all-reduces bf16 fine.
- powersgd: torch's `powerSGD_hook` (per-tensor rank-r approximation with error feedback;
  vanilla all-reduce for the first `powersgd_start_iter` iterations). Works on gloo as is.
- batched-powersgd: ours. torch's `batched_powerSGD_hook` fails on every device: it hands
  2-D (side, rank) matrices to `_orthogonalize`, which asserts a 3-D batch. Ours views the
  whole bucket as one square matrix the same way, orthogonalises with a 2-D QR.

Every hook counts the bytes it hands to all-reduce in `HookState.bytes_sent`, from the
tensors actually sent (for stock PowerSGD, from its own compression statistics, which count
the P and Q elements it all-reduces). The trainer reports the per-step difference.

Resuming exactly. `HookState` is a DCP Stateful: iteration, error feedback, P/Q memory and
bytes sent (and, for stock PowerSGD, its numpy RNG, iteration and statistics) go into every
checkpoint, one entry per rank (error feedback is local). Both PowerSGD hooks key that
state by DDP bucket index and lay it out in bucket order, and DDP's buckets change once:
a fresh DDP holds every parameter in one bucket in forward order, and after the first
backward rebuilds them in gradient-ready order. A run resumed at step k would meet the
first layout again while its state was saved under the second. So before the first
resumed step, `rebuild_buckets` runs one forward and backward with the hook passing
gradients through (no communication, no state change, RNG forked), and DDP rebuilds the
same buckets a fresh run has from its second step on. The hooks record each bucket's
parameters (`layout`), and check restored state against it before using it.
"""

# No `from __future__ import annotations`: DDP checks the hooks' annotations as objects.

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as stock_default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as stock_powersgd

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd", "batched-powersgd")
BUCKET_KEYED_HOOKS = ("powersgd", "batched-powersgd")  # state laid out per DDP bucket


@dataclass
class HookState:
    """What a hook needs across calls, and what it has sent."""

    process_group: dist.ProcessGroup | None
    name: str = "none"  # which of COMM_HOOKS
    dtype: torch.dtype = torch.float32
    powersgd: stock_powersgd.PowerSGDState | None = None
    rank: int = 1
    start_iter: int = 10
    iteration: int = 0
    error: dict[int, torch.Tensor] = field(default_factory=dict)
    q_memory: dict[int, torch.Tensor] = field(default_factory=dict)
    p_memory: dict[int, torch.Tensor] = field(default_factory=dict)
    bytes_sent: int = 0
    # Which parameters (positions in model.parameters()) each bucket holds, in bucket order:
    # the layout the per-bucket state above is laid out in.
    positions: dict[int, int] = field(default_factory=dict)  # id(parameter) -> position
    layout: dict[int, tuple[int, ...]] = field(default_factory=dict)
    unchecked: set[int] = field(default_factory=set)  # restored buckets not yet checked
    passthrough: bool = False  # `rebuild_buckets`: hand gradients back untouched

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        """Stateful, flat: counters, per-bucket tensors as `<name>.<bucket>`, stock PowerSGD
        state as `powersgd.<name>`."""
        state: dict[str, torch.Tensor | int] = {
            "iteration": self.iteration,
            "bytes_sent": self.bytes_sent,
        }
        for name, tensors in (
            ("error", self.error),
            ("q_memory", self.q_memory),
            ("p_memory", self.p_memory),
        ):
            state.update({f"{name}.{index}": t for index, t in tensors.items()})
        state.update(
            {
                f"layout.{index}": torch.tensor(positions, dtype=torch.int64)
                for index, positions in self.layout.items()
            }
        )
        if self.powersgd is not None:
            state.update({f"powersgd.{k}": v for k, v in _powersgd_state(self.powersgd).items()})
        return state

    def load_state_dict(self, state: dict) -> None:
        self.iteration, self.bytes_sent = int(state["iteration"]), int(state["bytes_sent"])
        for name, tensors in (
            ("error", self.error),
            ("q_memory", self.q_memory),
            ("p_memory", self.p_memory),
        ):
            tensors.clear()
            tensors.update(_by_bucket(state, f"{name}."))
        self.layout = {
            index: tuple(t.tolist()) for index, t in _by_bucket(state, "layout.").items()
        }
        self.unchecked = set(self.layout)
        if self.powersgd is not None:
            _set_powersgd_state(
                self.powersgd,
                {
                    k.removeprefix("powersgd."): v
                    for k, v in state.items()
                    if k.startswith("powersgd.")
                },
            )


# Stock PowerSGDState slots that change as it runs (the others are its hyperparameters,
# which come from the config). Its __getstate__ would pickle the numpy RandomState, which
# a weights_only load refuses, so the RNG goes in as tensors.
_POWERSGD_BUCKETS = {
    "error": "error_dict",
    "p_memory": "p_memory_dict",
    "q_memory": "q_memory_dict",
}
_POWERSGD_COUNTERS = (
    "iter",
    "total_numel_before_compression",
    "total_numel_after_compression",
    "next_stats_report",
)


def _powersgd_state(ps: stock_powersgd.PowerSGDState) -> dict[str, torch.Tensor | int]:
    state: dict[str, torch.Tensor | int] = {k: int(getattr(ps, k)) for k in _POWERSGD_COUNTERS}
    for name, slot in _POWERSGD_BUCKETS.items():
        state.update({f"{name}.{index}": t for index, t in getattr(ps, slot).items()})
    _, key, pos, has_gauss, gauss = ps.rng.get_state()
    state.update(
        {
            "rng.key": torch.from_numpy(key.astype(np.int64)),
            "rng.pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
            "rng.gauss": torch.tensor([gauss], dtype=torch.float64),
        }
    )
    return state


def _set_powersgd_state(ps: stock_powersgd.PowerSGDState, state: dict) -> None:
    for k in _POWERSGD_COUNTERS:
        setattr(ps, k, int(state[k]))
    for name, slot in _POWERSGD_BUCKETS.items():
        setattr(ps, slot, _by_bucket(state, f"{name}."))
    pos, has_gauss = (int(x) for x in state["rng.pos"])
    ps.rng.set_state(
        (
            "MT19937",
            state["rng.key"].numpy().astype(np.uint32),
            pos,
            has_gauss,
            float(state["rng.gauss"][0]),
        )
    )


def _by_bucket(state: dict, prefix: str) -> dict[int, torch.Tensor]:
    return {
        int(k.removeprefix(prefix)): v
        for k, v in state.items()
        if k.startswith(prefix) and k.removeprefix(prefix).isdigit()
    }


def _record_layout(state: HookState, bucket: dist.GradBucket) -> None:
    """Note the bucket's parameters; drop restored state saved under another layout."""
    index = bucket.index()
    layout = tuple(state.positions.get(id(p), -1) for p in bucket.parameters())
    if index in state.unchecked:
        state.unchecked.discard(index)
        if state.layout.get(index) != layout:  # e.g. parallel.bucket_cap_mb changed
            warnings.warn(
                f"comm hook: bucket {index} holds other parameters than when the "
                "checkpoint was saved; its error feedback and P/Q memory start "
                "afresh (the run no longer matches an uninterrupted one)",
                stacklevel=2,
            )
            for tensors in (state.error, state.q_memory, state.p_memory):
                tensors.pop(index, None)
            if state.powersgd is not None:
                for slot in _POWERSGD_BUCKETS.values():
                    getattr(state.powersgd, slot).pop(index, None)
    state.layout[index] = layout


def _passed_through(bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _all_reduce(state: HookState, tensor: torch.Tensor) -> torch.futures.Future:
    state.bytes_sent += tensor.numel() * tensor.element_size()
    return dist.all_reduce(tensor, group=state.process_group, async_op=True).get_future()


# The stock casting hooks, by the dtype they send (HookState.dtype).
_STOCK_COMPRESS = {
    torch.float16: stock_default.fp16_compress_hook,
    torch.bfloat16: stock_default.bf16_compress_hook,
}


def compress_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's stock fp16/bf16 compress hook (by `state.dtype`), with the bytes it sends.

    The stock hook all-reduces the whole bucket cast to a 2-byte dtype: numel x 2 bytes.
    """
    state.bytes_sent += bucket.buffer().numel() * 2  # fp16 and bf16: 2 bytes an element
    return _STOCK_COMPRESS[state.dtype](state.process_group, bucket)


def powersgd_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's PowerSGD, with the bytes it sends counted from its compression statistics."""
    if state.passthrough:
        return _passed_through(bucket)
    _record_layout(state, bucket)
    ps = state.powersgd
    before = ps.total_numel_after_compression if ps.iter >= ps.start_powerSGD_iter else None
    fut = stock_powersgd.powerSGD_hook(ps, bucket)
    if before is None:  # vanilla all-reduce iterations
        state.bytes_sent += bucket.buffer().numel() * bucket.buffer().element_size()
    else:
        state.bytes_sent += (ps.total_numel_after_compression - before) * 4
    return fut


def batched_powersgd_hook(
    state: HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Rank-r PowerSGD of the whole bucket viewed as one square matrix, with error feedback.

    M (side, side) = bucket + error;  P = M Q -> all-reduce -> orthogonalise;
    Q = M^T P -> all-reduce;  M ~= P Q^T / world;  error = M - approximation.
    """
    if state.passthrough:
        return _passed_through(bucket)
    _record_layout(state, bucket)
    buffer = bucket.buffer()
    world = dist.get_world_size(state.process_group)
    if state.iteration < state.start_iter:
        state.iteration += bucket.is_last()

        def average(fut: torch.futures.Future) -> torch.Tensor:
            return fut.value()[0].div_(world)

        return _all_reduce(state, buffer).then(average)
    state.iteration += bucket.is_last()
    n = buffer.numel()
    side = math.ceil(math.sqrt(n))
    rank = min(state.rank, side)
    index = bucket.index()
    flat = torch.zeros(side * side, dtype=buffer.dtype, device=buffer.device)
    flat[:n] = buffer
    if index in state.error:  # error feedback: what earlier approximations left out
        flat += state.error[index]
    matrix = flat.view(side, side)  # (side, side)
    if index not in state.q_memory:  # the same random start on every rank
        g = torch.Generator().manual_seed(1_000 + index)
        state.q_memory[index] = torch.randn(side, rank, generator=g).to(buffer)
    q = torch.linalg.qr(state.q_memory[index]).Q  # (side, rank), orthonormal

    def compute_q(fut: torch.futures.Future) -> torch.Tensor:
        state.p_memory[index] = torch.linalg.qr(fut.value()[0]).Q  # basis of sum_i M_i Q
        return _all_reduce(state, matrix.t() @ state.p_memory[index]).wait()[0]  # sum_i M_i^T P

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        q_sum = fut.value()
        state.q_memory[index] = q_sum  # warm start for the next step
        approx = (state.p_memory[index] @ q_sum.t()).div_(world).flatten()  # the averaged M
        state.error[index] = flat - approx
        buffer.copy_(approx[:n])
        return buffer

    return _all_reduce(state, matrix @ q).then(compute_q).then(decompress)


def register_comm_hook(
    model: torch.nn.parallel.DistributedDataParallel,
    *,
    name: str,
    powersgd_rank: int,
    powersgd_start_iter: int,
) -> HookState | None:
    """Register the named hook on a DDP model; return its state (None for "none").

    Args:
        model: the DDP-wrapped model.
        name: one of COMM_HOOKS.
        powersgd_rank: rank r of the PowerSGD approximation.
        powersgd_start_iter: vanilla all-reduce iterations before compressing (warm-up).
    """
    if name == "none":
        return None
    state = HookState(
        process_group=None,
        name=name,
        rank=powersgd_rank,
        start_iter=powersgd_start_iter,
        positions={id(p): i for i, p in enumerate(model.parameters())},
    )
    match name:
        case "fp16" | "bf16":
            state.dtype = torch.float16 if name == "fp16" else torch.bfloat16
            model.register_comm_hook(state, compress_hook)
        case "powersgd":
            state.powersgd = stock_powersgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=powersgd_rank,
                start_powerSGD_iter=max(2, powersgd_start_iter),
                min_compression_rate=1,
            )
            model.register_comm_hook(state, powersgd_hook)
        case "batched-powersgd":
            model.register_comm_hook(state, batched_powersgd_hook)
        case _:
            raise ValueError(f"comm hook {name!r} is not one of {COMM_HOOKS}")
    return state


def rebuild_buckets(
    model: torch.nn.parallel.DistributedDataParallel,
    state: HookState,
    *,
    forward_backward: Callable[[], None],
    device: torch.device,
) -> None:
    """Make a fresh DDP take its rebuilt bucket layout now, before a resumed run's first step.

    DDP rebuilds its buckets in the order gradients became ready in the first backward, at
    the next forward. This runs that first backward with the hook passing gradients
    through: no collective, no hook state touched, the RNG forked (dropout draws nothing
    the run would see), buffers put back, gradients dropped. The run's next forward
    rebuilds exactly the buckets an uninterrupted run has had since its second step.

    Args:
        model: the DDP-wrapped model, with `state`'s hook registered.
        state: the hook's state (restored from a checkpoint).
        forward_backward: one forward and backward of a (small) batch through `model`.
        device: the model's device (its RNG is forked too on CUDA).
    """
    buffers = [b.detach().clone() for b in model.buffers()]
    state.passthrough = True
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            forward_backward()
    finally:
        state.passthrough = False
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    model.zero_grad(set_to_none=True)


def keyed_by_bucket(state: HookState | None) -> bool:
    """Whether the hook keeps state laid out by DDP bucket (both PowerSGD variants)."""
    return state is not None and state.name in BUCKET_KEYED_HOOKS
