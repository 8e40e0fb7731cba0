"""Optimizer and learning-rate schedule from the [optim] section's values."""

from __future__ import annotations

import math

import torch

from scaletrain.config import OptimConfig

OPTIMIZER_IMPLS = ("auto", "fused", "foreach")


def fused_supported(params: list[torch.Tensor]) -> tuple[bool, str]:
    """Whether torch's fused optimizer kernels take these parameters, and why (or why not).

    The decision is torch's own (the check its optimizers make when `fused=True` is asked
    for): every parameter floating point, of a supported type, on a device with fused kernels.
    """
    from torch.optim.optimizer import _default_to_fused_or_foreach

    fused, _ = _default_to_fused_or_foreach(params, differentiable=False, use_fused=True)
    devices = sorted({p.device.type for p in params})
    if fused:
        return True, f"torch has fused kernels for these parameters on {devices}"
    return False, f"torch's fused kernels do not take these parameters (devices {devices})"


def resolve_impl(impl: str, params: list[torch.Tensor]) -> str:
    """ "auto" -> "fused" where the device has fused kernels, else "foreach"."""
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer impl {impl!r} is not one of {OPTIMIZER_IMPLS}")
    if impl == "auto":
        return "fused" if fused_supported(params)[0] else "foreach"
    return impl


def build_optimizer(
    model: torch.nn.Module,
    *,
    name: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    momentum: float,
    impl: str = "auto",
) -> torch.optim.Optimizer:
    """AdamW or SGD over every trainable parameter.

    Args:
        model: the module whose trainable parameters are optimized.
        name: "adamw" or "sgd".
        lr, weight_decay, betas, momentum: the usual hyper-parameters.
        impl: "fused" (one kernel over all parameters: the MLP-base job's whole step is
            1.22x faster than foreach on CPU, BENCHMARKS.md), "foreach"
            (multi-tensor ops), or "auto" (fused where the device supports it). Both compute
            the same update; tests/test_optim.py checks them against each other in fp64.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    kernels = {"fused": True} if resolve_impl(impl, params) == "fused" else {"foreach": True}
    groups = _kernel_groups(params)
    match name:
        case "adamw":
            return torch.optim.AdamW(
                groups, lr=lr, betas=betas, weight_decay=weight_decay, **kernels
            )
        case "sgd":
            return torch.optim.SGD(
                groups, lr=lr, momentum=momentum, weight_decay=weight_decay, **kernels
            )
    raise ValueError(f"optimizer {name!r} is not one of ('adamw', 'sgd')")


def lr_multiplier(
    step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """LR / peak LR at optimizer step `step` (0-based): linear warmup, then cosine or constant."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def from_section(
    model: torch.nn.Module,
    optim: OptimConfig,
    *,
    total_steps: int,
    impl: str | None = None,
    per_step: int = 1,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer and schedule the [optim] section describes, over `model`'s trainable
    parameters: what the trainer, the parameter servers and `auto`'s probe all build.

    Args:
        model: the module (or a parameter server's shard) to optimize.
        optim: the frozen [optim] section.
        total_steps: optimizer steps the schedule spans (train.steps).
        impl: the kernels, where the caller must override optim.impl (None: optim.impl).
        per_step: scheduler steps per optimizer step (a parameter server steps once per
            gradient: several make a global step).
    """
    optimizer = build_optimizer(
        model,
        name=optim.name,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=optim.betas,
        momentum=optim.momentum,
        impl=impl or optim.impl,
    )
    scheduler = build_scheduler(
        optimizer,
        warmup_steps=optim.warmup_steps * per_step,
        total_steps=total_steps * per_step,
        schedule=optim.schedule,
        min_lr_ratio=optim.min_lr_ratio,
    )
    return optimizer, scheduler


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: str,
    min_lr_ratio: float,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `lr_multiplier`, advanced once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            schedule=schedule,
            min_lr_ratio=min_lr_ratio,
        ),
    )


def _kernel_groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """One parameter group, or two under tensor parallelism without FSDP: a fused or foreach
    kernel takes either plain tensors or DTensors, never both in one call, and TP leaves
    the embeddings, norms and head plain. Both groups have the same hyper-parameters."""
    from torch.distributed.tensor import DTensor

    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": g} for g in (plain, sharded) if g] or [{"params": params}]
