"""Data parallelism: replicate the model, all-reduce (average) gradients in buckets during backward.

DDP broadcasts rank 0's parameters at wrap time, then overlaps the gradient all-reduce of
each bucket with the rest of the backward pass. Gradients arrive averaged over ranks; the
train step scales each rank's loss so that the average is the gradient of the global-batch
mean (see training/step.py).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(
    model: torch.nn.Module,
    *,
    device: torch.device,
    bucket_cap_mb: float,
    gradient_as_bucket_view: bool,
) -> DistributedDataParallel:
    """Wrap `model` for data parallelism over the default process group.

    Args:
        model: the module, already on `device`.
        device: this rank's device (CPU for gloo).
        bucket_cap_mb: gradient bucket size; smaller buckets start communicating earlier.
        gradient_as_bucket_view: gradients alias the buckets (one fewer copy in memory).
    """
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
