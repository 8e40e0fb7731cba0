"""Held-out evaluation: the loss and the task's metric, each data-parallel share a part.

`eval_totals` sums one share's loss, hits (or squared error), count and, for a loss with
terms (distillation: `hard_loss`, `distill/kl`, ...), each term, with no collective;
`eval_record` turns totals into the record; `evaluate` is the two with one all-reduce in
between, as every collective layout runs it. The parameter-server strategy evaluates on one
server with no collective (ps/finish.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from scaletrain.config import Config
from scaletrain.data.loader import Dataset
from scaletrain.data.sampler import eval_indices
from scaletrain.launch.resolve import Derived
from scaletrain.loss import LossFn, mse
from scaletrain.models.protocol import output_logits
from scaletrain.parallel.compose import unwrap
from scaletrain.parallel.pipeline import Pipeline, eval_pipeline
from scaletrain.precision import Precision
from scaletrain.records.memory import available_bytes, global_bytes
from scaletrain.runtime import ProcessEnv, all_reduce_sum
from scaletrain.training.step import forward


@torch.no_grad()
def eval_totals(
    net: torch.nn.Module,
    eval_ds: Dataset,
    *,
    limit: int,
    batch: int,
    dp_rank: int,
    dp_size: int,
    counts: bool,
    precision: Precision,
    device: torch.device,
    loss_fn: LossFn,
    pipeline: Pipeline | None = None,
) -> torch.Tensor:
    """(loss sum, correct or squared error, count, *terms) over this share, in float64.

    The terms are a loss's parts (`loss_fn.terms`: under [distill] the hard loss and each
    distillation term, unweighted), summed like the loss, in `term_names(loss_fn)` order.

    Args:
        net: the bare model (no DDP wrapper), or under pp > 1 this rank's stages.
        eval_ds: the held-out split.
        limit: at most this many held-out examples in all (train.eval_examples).
        batch: examples per forward.
        dp_rank, dp_size: this share of the examples (strided).
        counts: this rank's numbers count (one rank per data-parallel share); else zeros.
        precision, device, loss_fn: as in training.
        pipeline: under pp > 1, the schedule whose last stage has the output.
    """
    net.eval()
    kind = eval_ds.spec.kind
    terms = getattr(loss_fn, "terms", None)  # a loss's parts (distill/objective.LossTerms)
    names = term_names(loss_fn)
    # loss sum, correct (or squared error), count, then each term's sum
    totals = torch.zeros(3 + len(names), dtype=torch.float64)
    if terms is not None:
        terms.take()  # the sums start here: nothing a training call left counts
    for idx in eval_indices(
        len(eval_ds), limit=limit, dp_rank=dp_rank, dp_size=dp_size, batch=batch
    ):
        b = eval_ds.get(idx).to(device, non_blocking=True)
        with precision.forward_context():
            if pipeline is None:
                output = forward(net, b, precision)
            else:
                output = eval_pipeline(pipeline, precision.convert_input(b.inputs), b.targets)
        if not counts:
            continue
        totals[0] += float(loss_fn(output, b)[0])
        if kind == "regression":
            totals[1] += float(mse(output, b)[0])
        elif kind != "encode":  # sentences for an encoder have no labels: the loss alone
            totals[1] += float((output_logits(output).argmax(-1) == b.targets).sum())
        totals[2] += b.count
    if terms is not None:
        sums = terms.take()
        totals[3:] = torch.tensor([sums[n] for n in names], dtype=torch.float64)
    net.train()
    return totals


def term_names(loss_fn: LossFn) -> tuple[str, ...]:
    """The names of the terms a loss records (`loss_fn.terms`), () for a loss without."""
    terms = getattr(loss_fn, "terms", None)
    return tuple(terms.names) if terms is not None else ()


def eval_record(
    totals: torch.Tensor, *, kind: str, loss_name: str, terms: tuple[str, ...] = ()
) -> dict:
    """The evaluation's record from summed totals: loss and accuracy, mse or perplexity, then
    each of the loss's terms (`terms`, totals[3:]) over the same count as the loss."""
    record = _metrics(totals, kind=kind, loss_name=loss_name)
    count = max(float(totals[2]), 1.0)
    return {**record, **{name: float(totals[3 + i]) / count for i, name in enumerate(terms)}}


def _metrics(totals: torch.Tensor, *, kind: str, loss_name: str) -> dict:
    loss = float(totals[0] / totals[2])
    if kind == "regression":
        return {"loss": loss, "mse": float(totals[1] / totals[2])}
    if kind == "encode":
        return {"loss": loss}
    if kind == "lm":
        if loss_name not in ("auto", "cross-entropy"):
            return {"loss": loss}  # a perplexity of another loss would mean nothing
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
    return {"loss": loss, "accuracy": float(totals[1] / totals[2])}


def evaluate(
    model: torch.nn.Module,
    eval_ds: Dataset,
    config: Config,
    penv: ProcessEnv,
    derived: Derived,
    *,
    precision: Precision,
    device: torch.device,
    loss_fn: LossFn,
    pipeline: Pipeline | None = None,
) -> dict:
    """Held-out loss, and the task's metric (accuracy; mse for regression; perplexity for
    text under cross-entropy), each data-parallel share a strided part. Tensor-parallel
    peers evaluate the same examples (their forward is collective) and count them once;
    under pipeline parallelism the last stage has the output."""
    layout = derived.layout
    keep = keeps_gathered(
        config.train.eval_gather,
        unsharded_bytes=global_bytes(unwrap(model).parameters()),
        local_ranks=penv.local_world_size,
    )
    with gathered_for_eval(unwrap(model), keep=keep):  # one gather for every micro-batch
        totals = eval_totals(
            unwrap(model),
            eval_ds,
            limit=config.train.eval_examples,
            batch=config.train.micro_batch,
            dp_rank=layout.dp_rank(penv.rank),
            dp_size=layout.dp,
            counts=layout.reports_loss(penv.rank),
            precision=precision,
            device=device,
            loss_fn=loss_fn,
            pipeline=pipeline,
        )
    all_reduce_sum(totals)  # the terms with the loss: one sum over the data-parallel shares
    return eval_record(
        totals, kind=eval_ds.spec.kind, loss_name=config.train.loss, terms=term_names(loss_fn)
    )


# ---------------------------------------------------------------------------------------
# A sharded model's evaluation: gathered once, or per forward.


def keeps_gathered(mode: str, *, unsharded_bytes: int, local_ranks: int) -> bool:
    """Whether an evaluation keeps FSDP's gathered parameters across its micro-batches
    (train.eval_gather): "keep", "per-batch", or "auto" = keep when the unsharded model
    takes at most a quarter of this rank's share of the machine's available memory."""
    if mode != "auto":
        return mode == "keep"
    available = available_bytes()
    return available is not None and unsharded_bytes <= available // max(local_ranks, 1) // 4


@contextlib.contextmanager
def gathered_for_eval(model: torch.nn.Module, *, keep: bool) -> Iterator[None]:
    """With `keep`, every FSDP unit stays gathered after its first forward of the
    evaluation (FSDP2's `set_reshard_after_forward(False)`, as torch documents it for
    evals), so that the evaluation gathers the model once instead of once per
    micro-batch; afterwards every unit is resharded and gets its setting back.
    Without FSDP units, or without `keep`, nothing changes."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)] if keep else []
    before = [_reshards_after_forward(m) for m in units]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit, setting in zip(units, before):
            unit.reshard()
            unit.set_reshard_after_forward(setting, recurse=False)


def _reshards_after_forward(unit) -> bool:
    """A unit's current reshard-after-forward setting. torch has a setter and no getter:
    read from its parameter groups (post_forward_mesh_info is set when it reshards)."""
    groups = unit._get_fsdp_state()._fsdp_param_groups
    return any(g.post_forward_mesh_info is not None for g in groups)
