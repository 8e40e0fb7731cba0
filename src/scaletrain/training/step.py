"""One optimizer step, readable top to bottom.

    count -> for each micro-batch: forward (precision context) -> summed loss -> scaled
    backward (sync only on the last) -> unscale -> global-norm clip -> optimizer step (or
    skip) -> LR step -> zero grad

Normalisation (the subtle part): the gradient must be that of the mean loss over the whole
global batch, k micro-batches on each of n ranks, whatever k and n are. So every
micro-batch's *summed* loss (a loss returns (sum, count): loss.py) is divided by the
global count of examples, target tokens or target values in the step, known from the data
before the first forward; DDP then averages over the n ranks, which we undo by
multiplying by n. With ragged counts (masked tokens differ between micro-batches
and ranks) the global count is all-reduced once per step; with fixed counts it is just
local count x n and no collective runs.

The same step runs every layout. n is the data-parallel degree (dp_replicate x dp_shard):
FSDP averages like DDP, tensor-parallel and pipeline peers read the same examples and
average nothing, so a ragged count is summed over the data-parallel group alone (a sum over
the world would count every example tp x pp times). Under pipeline parallelism one call of
the schedule replaces a micro-batch's forward and backward (it splits the micro-batch into
chunks and backpropagates each chunk's sum x the same weight), and the gradient norm is the
whole model's, however it is split (training/grad_norm.py).

Its two halves are functions of their own: `accumulate_gradients` (the normalised forward
and backward) and `clip_gradients` (the global norm and clipping), so that a parameter-
server worker computes its gradient with exactly this code (ps/worker.py), and its servers
clip the averaged gradient with the same rule.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.data.sources import Batch
from scaletrain.loss import LossFn, cross_entropy
from scaletrain.parallel.compose import gradient_sync
from scaletrain.parallel.pipeline import Pipeline, run_pipeline
from scaletrain.precision import Precision
from scaletrain.records.memory import local_bytes
from scaletrain.runtime import all_reduce_sum
from scaletrain.training.grad_norm import clip_grads_, global_grad_norm
from scaletrain.user_code import UserCodeError


def forward(model: torch.nn.Module, batch: Batch, precision: Precision) -> Any:
    """The model on one batch: inputs in the compute dtype, a user dataset's extra tensors
    (e.g. attention_mask) as keyword arguments. Call it inside precision.forward_context()."""
    return model(precision.convert_input(batch.inputs), **batch.extras)


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed loss over its micro-batches (fp64, detached)
    count: int  # global examples or target tokens in the step (the normaliser)
    grad_norm: float  # global gradient norm before clipping (inf/nan if non-finite)
    stepped: bool  # False when the step was skipped for a non-finite gradient
    first_nonfinite: str | None = None  # when skipped: the parameter nearest the output
    # whose gradient is inf/NaN, i.e. the first to overflow in backward order
    grad_bytes: int = 0  # bytes of the gradients this rank held (its local shards)


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: list[Batch],
    *,
    precision: Precision,
    dp_size: int,
    ragged_counts: bool,
    loss_fn: LossFn = cross_entropy,
    pipeline: Pipeline | None = None,
    dp_group=None,
) -> tuple[torch.Tensor, int]:
    """Forward and backward over this rank's micro-batches, leaving in each parameter's
    .grad the gradient of (sum of the step's losses over every rank) / (their global count).

    The first half of `train_step`, and the whole of a parameter-server worker's gradient
    (ps/worker.py, with dp_size = 1: a worker is its own data-parallel group).

    Args:
        model, micro_batches, precision, loss_fn, pipeline: as in `train_step`.
        dp_size: data-parallel ranks whose gradients DDP or FSDP average (1: none).
        ragged_counts: counts may differ between ranks (masked tokens): all-reduce them.
        dp_group: the data-parallel process group (ParallelLayout.dp_group), which ragged
            counts are summed over; None means every rank is a data-parallel rank.

    Returns:
        (this rank's summed loss, fp64 and detached; the step's global count).
    """
    # The normaliser of the whole step, across micro-batches and ranks, before any forward.
    local_count = sum(mb.count for mb in micro_batches)
    if ragged_counts and dp_size > 1:
        # Over the data-parallel ranks only: tensor-parallel and pipeline peers hold the
        # same micro-batches, and a sum over the world would count them tp x pp times.
        if dist.get_world_size(dp_group) != dp_size:
            raise RuntimeError(
                f"the count's group has {dist.get_world_size(dp_group)} ranks, "
                f"the data-parallel degree is {dp_size}: pass its dp_group"
            )
        count = torch.tensor(
            [local_count], dtype=torch.float64, device=micro_batches[0].targets.device
        )
        global_count = int(all_reduce_sum(count, group=dp_group).item())
    else:
        global_count = local_count * dp_size
    # DDP and FSDP divide the summed gradient by dp_size; multiply it back so the result is
    # the gradient of (sum of all losses) / global_count. Tensor-parallel and pipeline peers
    # see the same examples and average nothing, so they need no correction.
    loss_weight = dp_size / max(global_count, 1)

    # float64 so that neither fp32 rounding nor the number of micro-batches changes the sum.
    loss_sum = torch.zeros((), dtype=torch.float64, device=micro_batches[0].targets.device)
    for i, mb in enumerate(micro_batches):
        is_last = i == len(micro_batches) - 1
        # All-reduce gradients only on the last micro-batch; earlier ones accumulate locally.
        with gradient_sync(model, enabled=is_last):
            if pipeline is None:
                with precision.forward_context():
                    loss, _ = loss_fn(forward(model, mb, precision), mb)  # a sum, not a mean
                precision.backward(loss * loss_weight)
                loss = loss.detach().double()
            else:
                if mb.extras:
                    raise UserCodeError(
                        f"the dataset's items carry {sorted(mb.extras)} for the model's forward, "
                        "which a pipeline's stages do not pass along; parallel.pp > 1 takes "
                        "(inputs, targets) items only"
                    )
                precision.init_scale_on(loss_sum.device)  # fp16: every stage unscales
                # The schedule splits the micro-batch into pp_microbatches chunks, runs their
                # forwards and backwards through the stages in its order, and backpropagates
                # each chunk's summed loss x loss_weight: the same normaliser as above.
                with precision.forward_context():
                    loss = run_pipeline(
                        pipeline,
                        precision.convert_input(mb.inputs),
                        mb.targets,
                        loss_weight=loss_weight,
                        scale=precision.scale,
                    )
        loss_sum += loss  # on a pipeline's other stages: 0 (the loss is on the last)
    return loss_sum, global_count


def clip_gradients(
    grads: list[torch.Tensor], *, grad_clip: float, pp_group=None
) -> tuple[torch.Tensor, bool]:
    """The global norm of (unscaled) gradients and, when it is finite, clipping to grad_clip.

    Args:
        grads: this rank's gradients (plain tensors and DTensors).
        grad_clip: max global norm; 0 disables clipping.
        pp_group: under pp > 1, the pipeline's process group (the stages' norms add).

    Returns:
        (the norm before clipping, float64; whether it is finite).
    """
    # The norm of the whole gradient, the same on every rank: DTensor shards and pipeline
    # stages summed (training/grad_norm.py).
    grad_norm = global_grad_norm(grads, pp_group=pp_group)
    # After DDP's all-reduce every rank holds the same gradients, and the sharded layouts
    # reduce the norm over every rank, so every rank takes the same decision here: a NaN on
    # one rank's loss reaches all ranks.
    grads_finite = bool(torch.isfinite(grad_norm))
    if grad_clip > 0 and grads_finite:
        clip_grads_(grads, max_norm=grad_clip, total_norm=grad_norm)
    return grad_norm, grads_finite


def train_step(
    model: torch.nn.Module,
    micro_batches: list[Batch],
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    precision: Precision,
    grad_clip: float,
    dp_size: int,
    ragged_counts: bool,
    loss_fn: LossFn = cross_entropy,
    pipeline: Pipeline | None = None,
    pp_group=None,
    dp_group=None,
) -> StepResult:
    """Run one optimizer step over this rank's micro-batches.

    Args:
        model: the (possibly DDP- or FSDP-wrapped, TP-split) model, or under pipeline
            parallelism this rank's share of it (what the optimizer holds).
        micro_batches: this rank's micro-batches for the step.
        optimizer: the optimizer over the model's parameters.
        scheduler: LR schedule, advanced once per step.
        precision: forward context, (scaled) backward, unscale, optimizer step.
        grad_clip: max global gradient norm; 0 disables clipping.
        dp_size: data-parallel ranks (dp_replicate x dp_shard) whose gradients DDP or FSDP
            average.
        ragged_counts: counts may differ between ranks (masked tokens): all-reduce them.
        loss_fn: (model output, batch) -> (summed loss, count); cross-entropy by default.
        pipeline: under pp > 1, the schedule that runs forward and backward of each
            micro-batch through the stages (parallel/pipeline.py).
        pp_group: under pp > 1, the pipeline's process group (the stages' grad norms add).
        dp_group: the data-parallel process group (ParallelLayout.dp_group), which ragged
            counts are summed over; None means every rank is a data-parallel rank.
    """
    loss_sum, global_count = accumulate_gradients(
        model,
        micro_batches,
        precision=precision,
        dp_size=dp_size,
        ragged_counts=ragged_counts,
        loss_fn=loss_fn,
        pipeline=pipeline,
        dp_group=dp_group,
    )

    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    precision.unscale_(optimizer)  # fp16: clip and check the true gradient, not the scaled one
    grad_norm, grads_finite = clip_gradients(grads, grad_clip=grad_clip, pp_group=pp_group)
    first_nonfinite = None if grads_finite else _first_nonfinite(model)
    stepped = precision.optimizer_step(optimizer, grads_finite=grads_finite)
    # The schedule follows the step counter, skipped steps included.
    if stepped:
        scheduler.step()
    else:  # before any optimizer step LambdaLR warns about the order. Only here: entering
        # catch_warnings resets Python's "shown once" record of every warning, which would
        # then print again on every step (FSDP2's view warning did).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
            scheduler.step()
    grad_bytes = local_bytes(grads)  # what this rank held, before the gradients are freed
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss_sum=loss_sum,
        count=global_count,
        grad_norm=float(grad_norm),
        stepped=stepped,
        first_nonfinite=first_nonfinite,
        grad_bytes=grad_bytes,
    )


def _first_nonfinite(model: torch.nn.Module) -> str | None:
    """Backward runs from the output to the input, so scan parameters in reverse order."""
    for name, p in reversed(list(model.named_parameters())):
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")
    return None
