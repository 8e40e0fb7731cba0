"""Losses: each a function (model output, batch) -> (summed loss, count).

The contract that keeps every layout exact: a loss returns the *sum* of its per-item
losses over the batch and how many items it summed (examples, target tokens, target
values). The train step divides every micro-batch's sum by the global count of the whole
step (all micro-batches, all ranks), known from the data before the first forward
(`Batch.count`), so the gradient is that of one batch of k x n whatever k and n are. A
loss that returned a mean would be divided once more and weighted per micro-batch instead
of per item: silently wrong under accumulation and with ragged counts.

So a user's loss (`train.loss = 'package.module:function'`) is checked once, before the
first step, by `check_summed` on the first micro-batch:
- its count must equal the batch's count (what the step normalises by);
- it must be additive: loss(first half) + loss(second half) = loss(whole batch), which a
  sum is and a mean is not (a mean of two halves gives about twice the whole's value).
The check runs the model in eval mode without gradients (dropout off) and compares in
float64 where the model runs in float64, else with a tolerance that covers fp32 and
bf16 rounding. Built-in losses are written to the contract and skip it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from scaletrain.data.sources import IGNORE_INDEX, Batch, target_count
from scaletrain.errors import UserError
from scaletrain.models.protocol import output_logits

LossFn = Callable[[Any, Batch], tuple[torch.Tensor, Any]]


class LossError(UserError):
    """A loss that does not fit the data's task, or a user's loss that does not return
    (summed loss, count): the user's mistake, shown as one paragraph."""


def cross_entropy(output: Any, batch: Batch) -> tuple[torch.Tensor, int]:
    """Cross-entropy summed over examples (B, C) or target tokens (B, T, V); -100 is ignored.

    Half-precision logits are upcast to fp32; fp64 logits (precision fp64) stay fp64.
    """
    logits = output_logits(output)
    if logits.dtype != torch.float64:
        logits = logits.float()
    loss = F.cross_entropy(
        logits.flatten(0, -2), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, batch.count


def mse(output: Any, batch: Batch) -> tuple[torch.Tensor, int]:
    """Squared error summed over every target value; the model gives one value per target."""
    pred = output_logits(output)
    if pred.dtype != torch.float64:
        pred = pred.float()
    targets = batch.targets
    if pred.numel() != targets.numel():
        raise LossError(
            f"the model output {tuple(pred.shape)} has {pred.numel()} values but the "
            f"targets {tuple(targets.shape)} have {targets.numel()}: a regression "
            "model needs one output per target value"
        )
    diff = pred.reshape(targets.shape) - targets.to(pred.dtype)
    return (diff * diff).sum(), batch.count


BUILTIN_LOSSES: dict[str, LossFn] = {"cross-entropy": cross_entropy, "mse": mse}


def builtin_loss(name: str, *, task_kind: str) -> LossFn:
    """The loss a built-in name means for a task: auto = mse for regression, else cross-entropy."""
    if name == "auto":
        name = "mse" if task_kind == "regression" else "cross-entropy"
    if name == "cross-entropy" and task_kind == "regression":
        raise LossError(
            "train.loss = 'cross-entropy' needs class or token targets, but the "
            "data are regression (float targets); use train.loss = 'mse' or 'auto'"
        )
    if name == "mse" and task_kind != "regression":
        raise LossError(
            f"train.loss = 'mse' needs float targets, but the data's task is "
            f"{task_kind!r}; use 'cross-entropy' or 'auto'"
        )
    return BUILTIN_LOSSES[name]


def as_int(count: Any) -> int:
    """A loss's count as an int (it may return a tensor)."""
    return int(count.item()) if isinstance(count, torch.Tensor) else int(count)


@torch.no_grad()
def check_summed(
    loss_fn: LossFn,
    model: torch.nn.Module,
    batch: Batch,
    *,
    task_kind: str,
    forward: Callable[[torch.nn.Module, Batch], Any],
    label: str,
) -> None:
    """Refuse a loss that does not return (sum over items, their count), before step 1.

    Args:
        loss_fn: the user's loss.
        model: the bare model (its mode is restored afterwards).
        batch: one micro-batch of at least 2 examples (a smaller one is checked for count only).
        task_kind: the data's TaskSpec.kind (what the count counts).
        forward: runs the model on a batch (the step's own forward, precision included).
        label: how the user named the loss, e.g. "train.loss = 'mylosses:focal'".

    Raises:
        LossError: the count differs from the batch's, the result is not a scalar, or the
            loss is not additive over a split of the batch (a mean).
    """
    was_training = model.training
    model.eval()
    try:
        whole = _evaluate(loss_fn, model, batch, forward=forward, label=label)
        if whole[1] != batch.count:
            raise LossError(
                f"{label} returned count {whole[1]} for a micro-batch whose loss normaliser is "
                f"{batch.count} ({COUNTS[task_kind]}); scaletrain divides every step's "
                "summed loss by that count over all micro-batches and ranks, so the loss must "
                "sum over exactly those items (give ignored tokens the target -100)"
            )
        n = batch.targets.shape[0]
        if n < 2:
            return
        halves = [
            _slice(batch, slice(0, n // 2), task_kind),
            _slice(batch, slice(n // 2, n), task_kind),
        ]
        parts = [_evaluate(loss_fn, model, h, forward=forward, label=label) for h in halves]
    finally:
        model.train(was_training)
    total = parts[0][0] + parts[1][0]
    tol = 1e-9 if whole[2] == torch.float64 else 2e-2
    if abs(total - whole[0]) > tol * max(abs(whole[0]), 1e-12):
        mean_like = abs((parts[0][0] + parts[1][0]) / 2 - whole[0]) < abs(total - whole[0])
        why = (
            "it looks like a mean (the halves' average matches the whole)"
            if mean_like
            else "it is not additive over examples"
        )
        raise LossError(
            f"{label} must return the loss summed over the batch, but {why}: the two halves of "
            f"a micro-batch gave {parts[0][0]:.6g} + {parts[1][0]:.6g} = {total:.6g}, the whole "
            f"{whole[0]:.6g}. Use reduction='sum' and return (sum, count); scaletrain divides "
            "by the global count itself (docs/own-model.md)"
        )


def _evaluate(
    loss_fn: LossFn, model, batch: Batch, *, forward, label: str
) -> tuple[float, int, torch.dtype]:
    result = loss_fn(forward(model, batch), batch)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise LossError(
            f"{label} returned {type(result).__name__}; a loss returns a tuple "
            "(summed loss tensor, count)"
        )
    loss, count = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise LossError(
            f"{label} returned a loss of shape {shape}; it must be a scalar tensor "
            "(the sum over the batch)"
        )
    return float(loss.double()), as_int(count), loss.dtype


def _slice(batch: Batch, rows: slice, kind: str) -> Batch:
    targets, inputs = batch.targets[rows], batch.inputs[rows]
    return Batch(
        inputs=inputs,
        targets=targets,
        count=target_count(kind, targets),
        tokens=inputs.numel() if kind == "lm" else 0,
        extras={k: v[rows] for k, v in batch.extras.items()},
    )


COUNTS = {
    "classification": "examples",
    "lm": "target tokens that are not -100",
    "regression": "target values",
    "encode": "examples",
}
