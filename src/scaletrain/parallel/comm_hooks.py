"""Gradient compression through DDP communication hooks, with the bytes each rank sends.

Hooks (`parallel.comm_hook`):
- none: DDP's own all-reduce of fp32 buckets.
- fp16 / bf16: cast the bucket, divide by the world size, all-reduce, cast back. Ours,
  because torch's stock `bf16_compress_hook` is refused on gloo: DDP's
  `register_comm_hook` checks the hook's *name* (`bf16_compress_hook`) and demands CUDA +
  NCCL >= 2.10, although gloo all-reduces bf16 fine. The logic is the stock one.
- powersgd: torch's `powerSGD_hook` (per-tensor rank-r approximation with error feedback;
  vanilla all-reduce for the first `powersgd_start_iter` iterations). Works on gloo as is.
- batched-powersgd: ours. torch's `batched_powerSGD_hook` fails on every device: it hands
  2-D (side, rank) matrices to `_orthogonalize`, which asserts a 3-D batch. Ours views the
  whole bucket as one square matrix the same way, orthogonalises with a 2-D QR.

Every hook counts the bytes it hands to all-reduce in `HookState.bytes_sent`, from the
tensors actually sent (for stock PowerSGD, from its own compression statistics, which count
the P and Q elements it all-reduces). The trainer reports the per-step difference.
"""

# No `from __future__ import annotations`: DDP checks the hooks' annotations as objects.

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as stock_powersgd

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd", "batched-powersgd")


@dataclass
class HookState:
    """What a hook needs across calls, and what it has sent."""

    process_group: dist.ProcessGroup | None
    dtype: torch.dtype = torch.float32
    powersgd: stock_powersgd.PowerSGDState | None = None
    rank: int = 1
    start_iter: int = 10
    iteration: int = 0
    error: dict[int, torch.Tensor] = field(default_factory=dict)
    q_memory: dict[int, torch.Tensor] = field(default_factory=dict)
    p_memory: dict[int, torch.Tensor] = field(default_factory=dict)
    bytes_sent: int = 0


def _all_reduce(state: HookState, tensor: torch.Tensor) -> torch.futures.Future:
    state.bytes_sent += tensor.numel() * tensor.element_size()
    return dist.all_reduce(tensor, group=state.process_group, async_op=True).get_future()


def compress_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in `state.dtype` (fp16/bf16), averaged, then cast back in place."""
    buffer = bucket.buffer()
    world = dist.get_world_size(state.process_group)
    compressed = buffer.to(state.dtype).div_(world)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return _all_reduce(state, compressed).then(decompress)


def powersgd_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's PowerSGD, with the bytes it sends counted from its compression statistics."""
    ps = state.powersgd
    before = ps.total_numel_after_compression if ps.iter >= ps.start_powerSGD_iter else None
    fut = stock_powersgd.powerSGD_hook(ps, bucket)
    if before is None:  # vanilla all-reduce iterations
        state.bytes_sent += bucket.buffer().numel() * bucket.buffer().element_size()
    else:
        state.bytes_sent += (ps.total_numel_after_compression - before) * 4
    return fut


def batched_powersgd_hook(state: HookState,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Rank-r PowerSGD of the whole bucket viewed as one square matrix, with error feedback.

    M (side, side) = bucket + error;  P = M Q -> all-reduce -> orthogonalise;
    Q = M^T P -> all-reduce;  M ~= P Q^T / world;  error = M - approximation.
    """
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


def register_comm_hook(model: torch.nn.parallel.DistributedDataParallel, *, name: str,
                       powersgd_rank: int, powersgd_start_iter: int) -> HookState | None:
    """Register the named hook on a DDP model; return its state (None for "none").

    Args:
        model: the DDP-wrapped model.
        name: one of COMM_HOOKS.
        powersgd_rank: rank r of the PowerSGD approximation.
        powersgd_start_iter: vanilla all-reduce iterations before compressing (warm-up).
    """
    if name == "none":
        return None
    state = HookState(process_group=None, rank=powersgd_rank, start_iter=powersgd_start_iter)
    match name:
        case "fp16" | "bf16":
            state.dtype = torch.float16 if name == "fp16" else torch.bfloat16
            model.register_comm_hook(state, compress_hook)
        case "powersgd":
            state.powersgd = stock_powersgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=powersgd_rank,
                start_powerSGD_iter=max(2, powersgd_start_iter), min_compression_rate=1)
            model.register_comm_hook(state, powersgd_hook)
        case "batched-powersgd":
            model.register_comm_hook(state, batched_powersgd_hook)
        case _:
            raise ValueError(f"comm hook {name!r} is not one of {COMM_HOOKS}")
    return state
