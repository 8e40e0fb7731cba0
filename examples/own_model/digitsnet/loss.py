"""A loss scaletrain calls as `smoothed_cross_entropy(output, batch)`.

It returns the loss SUMMED over the batch and how many examples it summed: scaletrain
divides by the global count over every micro-batch and rank itself, so accumulation and
data parallelism give the gradient of the whole global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import scaletrain


def smoothed_cross_entropy(output: torch.Tensor, batch: scaletrain.Batch):
    """Cross-entropy with 10% label smoothing, summed (reduction="sum", never "mean")."""
    logits = output if output.dtype == torch.float64 else output.float()
    loss = F.cross_entropy(logits, batch.targets, label_smoothing=0.1, reduction="sum")
    return loss, batch.targets.shape[0]
