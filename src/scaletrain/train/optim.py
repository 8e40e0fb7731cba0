"""Optimizer and learning-rate schedule from the [optim] section's values."""

from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, *, name: str, lr: float, weight_decay: float,
                    betas: tuple[float, float], momentum: float) -> torch.optim.Optimizer:
    """AdamW or SGD over every trainable parameter, with the multi-tensor (foreach) kernels."""
    params = [p for p in model.parameters() if p.requires_grad]
    match name:
        case "adamw":
            return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                                     foreach=True)
        case "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                                   foreach=True)
    raise ValueError(f"optimizer {name!r} is not one of ('adamw', 'sgd')")


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, schedule: str,
                  min_lr_ratio: float) -> float:
    """LR / peak LR at optimizer step `step` (0-based): linear warmup, then cosine or constant."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                    schedule: str, min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `lr_multiplier`, advanced once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(step, warmup_steps=warmup_steps, total_steps=total_steps,
                                   schedule=schedule, min_lr_ratio=min_lr_ratio),
    )
