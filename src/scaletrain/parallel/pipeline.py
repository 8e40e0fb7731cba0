"""Pipeline parallelism: the model's blocks split into stages, run by torch's schedules.

Design (torchtitan's recipe). A stage is a deep copy of the whole model with the other
stages' blocks deleted and its ends set to None: the first stage keeps the spec's `first`
modules (embeddings), the last keeps `last` (final norm, head), and the model's forward
skips an end that is None (models/gpt.py). Parameter names, and so checkpoint keys, are the
whole model's on every stage ("blocks.5.attn.q.weight" on whichever stage holds block 5).
The copy is made after initialisation, so the stages hold exactly the values one process's
model would; the dropped pieces are never copied (`split_model`).

Everything that moves between ranks is torch.distributed.pipelining's: a `PipelineStage`
per part and one of its schedules (`build_pipeline`):

    gpipe             ScheduleGPipe                  all forwards, then all backwards
    1f1b              Schedule1F1B                   one forward, one backward in steady state
    interleaved-1f1b  ScheduleInterleaved1F1B        v >= 2 stages per rank, loop placement
    zero-bubble       ScheduleInterleavedZeroBubble  the same placement, v >= 1; backward split
                      into input and weight gradients, the weight half filling the bubble

zero-bubble is the loop-placed ScheduleInterleavedZeroBubble (ZB1P; ZB-H1 with v = 1), not
the V-shaped ScheduleZBVZeroBubble: it shares interleaved-1f1b's placement (one `stage_ids`
rule, stage 0 and the loss on different ranks as everywhere else) and takes any v where
ZBV takes exactly 2.

Normalisation. The train step divides summed losses by the global count, computed before
the micro-batches run. So the schedules are built with `scale_grads=False` (torch would
divide every gradient by the number of chunks) and the schedule's loss is the project
loss's *sum* times `Pipeline.loss_weight` (1 / global count, set by the step per call).

Shapes. A PipelineStage infers what it sends from the first chunk it sees and allocates
fixed receive buffers; it infers again only when the schedule switches between train and
eval (one more chunk's forward, and backward, at each switch). Unequal chunks or a second
shape meet the old buffers (seen: a shape error on one rank, a hang on the other). So
`run_pipeline` refuses a batch whose rows differ from the first one's, and `eval_pipeline`
pads a smaller eval batch to a fixed row count with copies of its first row, splits a
larger one, and slices the padding off the output.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.data.sources import Batch
from scaletrain.errors import UserError
from scaletrain.models.protocol import ModelSpec, PipelineSplit

if TYPE_CHECKING:  # importing pipelining costs ~1 s (it pulls in dynamo): only to build
    from torch.distributed.pipelining import PipelineStage

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank


class PipelineConfigError(UserError):
    """A pipeline layout torch's schedules cannot run."""


def check_schedule(
    schedule: str, *, pp: int, microbatches: int, stages_per_rank: int, n_blocks: int | None
) -> None:
    """Refuse a layout the schedule cannot run, before any process group exists.

    torch's rules (schedules.py, torch 2.13; each also run): gpipe takes any number of
    chunks; 1f1b needs chunks >= pp; interleaved-1f1b and zero-bubble run max(1, chunks //
    pp) rounds and need chunks to be a multiple of that (so any chunks < 2pp; beyond, e.g.
    2pp, 3pp, but not 2pp + 1). torch runs interleaved-1f1b with one stage per rank, as
    plain 1F1B: refused here as a misnomer. zero-bubble with one stage per rank is ZB-H1,
    the paper's own schedule, and is allowed.

    Args:
        schedule: one of SCHEDULES.
        pp: pipeline ranks.
        microbatches: chunks each micro-batch is split into.
        stages_per_rank: stages each rank holds.
        n_blocks: the model's blocks, when known (each stage needs one).
    """
    layout = (
        f"parallel.pp = {pp}, parallel.pp_schedule = {schedule!r}, parallel."
        f"pp_microbatches = {microbatches}, parallel.pp_stages_per_rank = {stages_per_rank}"
    )

    def refuse(why: str) -> None:
        raise PipelineConfigError(f"{layout}: {why}")

    if schedule not in SCHEDULES:
        refuse(f"parallel.pp_schedule must be one of {', '.join(SCHEDULES)}")
    if min(pp, microbatches, stages_per_rank) < 1:
        refuse("parallel.pp, parallel.pp_microbatches and parallel.pp_stages_per_rank must be >= 1")
    if schedule in SINGLE_STAGE and stages_per_rank != 1:
        refuse(
            f"{schedule} holds one stage per rank; set parallel.pp_stages_per_rank = 1, or "
            "use interleaved-1f1b or zero-bubble for several"
        )
    if schedule == "interleaved-1f1b" and stages_per_rank < 2:
        refuse(
            "interleaved-1f1b interleaves several stages per rank; set parallel."
            "pp_stages_per_rank >= 2, or use 1f1b for one (what torch would run)"
        )
    stages = pp * stages_per_rank
    if n_blocks is not None and stages > n_blocks:
        refuse(
            f"{stages} stages (parallel.pp x parallel.pp_stages_per_rank) but the model has "
            f"{n_blocks} blocks, and every stage needs at least one"
        )
    if schedule == "1f1b" and microbatches < pp:
        refuse(
            f"1f1b needs parallel.pp_microbatches >= parallel.pp = {pp} (torch: chunks >= stages)"
        )
    rounds = max(1, microbatches // pp)
    if schedule not in SINGLE_STAGE and microbatches % rounds:
        ok = [m for m in range(1, 4 * pp + 1) if m % max(1, m // pp) == 0]
        refuse(
            f"{schedule} runs max(1, pp_microbatches // pp) = {rounds} rounds and needs "
            f"parallel.pp_microbatches to be a multiple of that; allowed up to {4 * pp}: "
            f"{', '.join(map(str, ok))}"
        )


def stage_ids(*, pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The stages this pp rank holds: r, r + pp, r + 2pp, ... (loop placement, as every
    schedule here expects; single-stage schedules hold just r).

    Args:
        pp_rank: this rank's index in the pp group.
        pp: pipeline ranks.
        stages_per_rank: stages each rank holds.
        schedule: one of SCHEDULES.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def split_blocks(model: nn.Module, spec: ModelSpec, *, num_stages: int) -> list[list[str]]:
    """The block names of each stage: contiguous, each stage >= 1 block, balanced so that
    the largest stage's parameter count (stage 0 counting the `first` modules, the last
    stage the `last` ones) is as small as it can be. Deterministic.

    Args:
        model: the whole model.
        spec: its spec (with a pipeline split).
        num_stages: stages in the whole pipeline (pp x stages per rank).
    """
    split = _split_of(spec)
    names = [name for name, _ in model.get_submodule(split.blocks).named_children()]
    if not 1 <= num_stages <= len(names):
        raise PipelineConfigError(
            f"{num_stages} pipeline stages for the {len(names)} blocks of "
            f"{split.blocks!r}: every stage needs at least one block"
        )
    weights = [_numel(model.get_submodule(f"{split.blocks}.{n}")) for n in names]
    first = sum(_numel(model.get_submodule(p)) for p in split.first)
    last = sum(_numel(model.get_submodule(p)) for p in split.last)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(stage: int, lo: int, hi: int) -> int:  # blocks [lo, hi) on `stage`
        return (
            prefix[hi]
            - prefix[lo]
            + (first if stage == 0 else 0)
            + (last if stage == num_stages - 1 else 0)
        )

    # best[s][i]: the smallest largest-stage cost putting blocks [0, i) on stages [0, s).
    n, inf = len(names), float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):  # strict < keeps the earliest cut on a tie
                c = max(best[s - 1][j], cost(s - 1, j, i))
                if c < best[s][i]:
                    best[s][i], cut[s][i] = c, j
    bounds, i = [], n
    for s in range(num_stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return [names[lo:hi] for lo, hi in reversed(bounds)]


def split_model(
    model: nn.Module, spec: ModelSpec, *, stage_ids: list[int], num_stages: int
) -> list[nn.Module]:
    """One copy of `model` per stage in `stage_ids`, holding only that stage's pieces.

    The other stages' blocks are deleted from the blocks container by name (so a kept block
    keeps its name: "blocks.5" stays "blocks.5"; a ModuleList or Sequential must then be
    iterated by the forward, not indexed), and `first` / `last` are set to None off the
    first / last stage. The original model is not modified, and dropped pieces are never
    copied: deepcopy's memo maps them to None.

    Args:
        model: the whole, initialised model.
        spec: its spec (with a pipeline split).
        stage_ids: the stages this rank holds (`stage_ids`).
        num_stages: stages in the whole pipeline.
    """
    split = _split_of(spec)
    per_stage = split_blocks(model, spec, num_stages=num_stages)
    container = model.get_submodule(split.blocks)
    parts = []
    for sid in stage_ids:
        keep = set(per_stage[sid])
        dropped_blocks = [n for n, _ in container.named_children() if n not in keep]
        dropped_ends = ([] if sid == 0 else list(split.first)) + (
            [] if sid == num_stages - 1 else list(split.last)
        )
        memo: dict[int, Any] = {id(container.get_submodule(n)): None for n in dropped_blocks}
        memo.update({id(model.get_submodule(p)): None for p in dropped_ends})
        part = copy.deepcopy(model, memo)
        blocks = part.get_submodule(split.blocks)
        for name in dropped_blocks:
            # _modules directly: ModuleList's `del` would renumber the kept blocks.
            del blocks._modules[name]
        for path in dropped_ends:
            parent, _, leaf = path.rpartition(".")
            setattr(part.get_submodule(parent), leaf, None)
        parts.append(part)
    return parts


@dataclass
class Pipeline:
    """This rank's share of a pipeline and the schedule that runs it."""

    schedule: Any  # the torch schedule (ScheduleGPipe, Schedule1F1B, ...)
    stages: list[PipelineStage]
    parts: list[nn.Module]  # this rank's stage modules: what the optimizer and checkpoints see
    has_first: bool  # this rank holds stage 0 (feeds the inputs)
    has_last: bool  # this rank holds the last stage (computes the loss)
    microbatches: int  # chunks each call's batch is split into
    loss_weight: float = 1.0  # set by the step before each run: 1 / the global count
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None  # fp16 loss scaling
    count_fn: Callable[[torch.Tensor], int] | None = None  # Batch.count of a target chunk
    train_rows: int | None = None  # rows of every train batch (fixed by the first)
    eval_rows: int | None = None  # rows of every eval piece: train_rows, or the first eval's
    chunk_losses: list[torch.Tensor] = field(default_factory=list)  # detached sums, per chunk


def build_pipeline(
    parts: list[nn.Module],
    *,
    stage_ids: list[int],
    num_stages: int,
    group,
    device: torch.device,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[Any, Batch], tuple[torch.Tensor, Any]],
) -> Pipeline:
    """Wrap this rank's parts in PipelineStages and build the schedule over them.

    The parts may already be tensor-parallel, checkpointed and FSDP-wrapped (the order is
    split -> TP -> activation checkpointing -> FSDP -> build_pipeline).

    Args:
        parts: `split_model`'s modules, on `device`, in the order of `stage_ids`.
        stage_ids: the stage index of each part.
        num_stages: stages in the whole pipeline.
        group: the pp process group (e.g. mesh["pp"].get_group()).
        device: this rank's device.
        schedule: one of SCHEDULES.
        microbatches: chunks each batch is split into.
        loss_fn: the project's loss, (output, batch) -> (summed loss, count).
    """
    if len(parts) != len(stage_ids):
        raise ValueError(f"{len(parts)} parts for stage ids {stage_ids}")
    check_schedule(
        schedule,
        pp=dist.get_world_size(group),
        microbatches=microbatches,
        stages_per_rank=len(stage_ids),
        n_blocks=None,
    )
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    stages = [
        PipelineStage(part, sid, num_stages, device, group=group)
        for part, sid in zip(parts, stage_ids)
    ]
    pipeline = Pipeline(
        schedule=None,
        stages=stages,
        parts=parts,
        has_first=0 in stage_ids,
        has_last=num_stages - 1 in stage_ids,
        microbatches=microbatches,
    )
    # scale_grads=False: the loss is already a sum times 1 / global count (module docstring).
    cls = {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved-1f1b": ScheduleInterleaved1F1B,
        "zero-bubble": ScheduleInterleavedZeroBubble,
    }[schedule]
    held = {"stage": stages[0]} if schedule in SINGLE_STAGE else {"stages": stages}
    pipeline.schedule = cls(
        **held,
        n_microbatches=microbatches,
        scale_grads=False,
        loss_fn=partial(_chunk_loss, pipeline, loss_fn),
    )
    return pipeline


def _chunk_loss(pipeline: Pipeline, loss_fn, output: Any, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss on one chunk: the project loss's sum, recorded, then weighted."""
    # The last stage sees no inputs (they entered on stage 0): a loss that reads
    # batch.inputs or batch.extras cannot run under pp. count is the chunk's own count
    # (count_fn) or 0: the step normalises by the global count through loss_weight.
    count = pipeline.count_fn(target) if pipeline.count_fn is not None else 0
    total, _ = loss_fn(
        output, Batch(inputs=target.new_empty(0), targets=target, count=count, tokens=0)
    )
    pipeline.chunk_losses.append(total.detach())
    weighted = total * pipeline.loss_weight
    return pipeline.scale(weighted) if pipeline.scale is not None else weighted


def run_pipeline(
    pipeline: Pipeline,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    loss_weight: float,
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    count_fn: Callable[[torch.Tensor], int] | None = None,
) -> torch.Tensor:
    """Forward and backward of one train micro-batch, split into `pipeline.microbatches` chunks.

    Gradients accumulate into the parts' .grad. Precision is the caller's: run this inside
    its forward context.

    Args:
        pipeline: `build_pipeline`'s result.
        inputs: (B, ...) the micro-batch's inputs; read on the first-stage rank only.
        targets: (B, ...) its targets; read on the last-stage rank only.
        loss_weight: each chunk's summed loss is multiplied by this before backward
            (1 / the global count of the step, so grads are those of sum / count).
        scale: applied to the weighted loss before backward (fp16's loss scaler); identity
            when None.
        count_fn: Batch.count of a target chunk, for a loss that reads it; 0 when None.

    Returns:
        The micro-batch's summed, unweighted loss (float64, detached) on the last-stage
        rank; 0.0 on the others.
    """
    _check_rows(pipeline, inputs.shape[0])
    pipeline.loss_weight, pipeline.scale, pipeline.count_fn = loss_weight, scale, count_fn
    pipeline.chunk_losses.clear()
    args = (inputs,) if pipeline.has_first else ()
    pipeline.schedule.step(
        *args, target=targets if pipeline.has_last else None, return_outputs=False
    )
    if not pipeline.has_last:
        return torch.zeros((), dtype=torch.float64)
    # Shape inference (first call, and after each eval) runs the loss once more, first:
    # the real chunks' losses are the last `microbatches` recorded.
    chunks = pipeline.chunk_losses[-pipeline.microbatches :]
    return torch.stack([c.double() for c in chunks]).sum()


def eval_pipeline(
    pipeline: Pipeline, inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor | None:
    """Forward only (no backward, works under torch.no_grad()) of an eval batch of any size.

    The stages' buffers keep one shape per mode, so the batch runs in pieces of
    `pipeline.eval_rows` rows (the train batch's, or the first eval batch's rounded up to
    whole chunks), the last piece padded with copies of the batch's first row (a real
    example, so any model and loss take it) and the padding sliced off the output.

    Args:
        pipeline: `build_pipeline`'s result.
        inputs: (B, ...) on the first-stage rank (ignored elsewhere); every rank passes the
            same B.
        targets: (B, ...) on the last-stage rank: torch's schedules compute the loss in eval
            too (its value is dropped here).

    Returns:
        The model's output (B, ...) on the last-stage rank, None elsewhere.
    """
    n = inputs.shape[0]
    if pipeline.eval_rows is None:
        m = pipeline.microbatches
        pipeline.eval_rows = pipeline.train_rows or -(-n // m) * m  # n rounded up to whole chunks
    rows, outputs = pipeline.eval_rows, []
    for lo in range(0, n, rows):
        x, y = (_pad_rows(t[lo : lo + rows], rows) for t in (inputs, targets))
        args = (x,) if pipeline.has_first else ()
        out = pipeline.schedule.eval(*args, target=y if pipeline.has_last else None)
        outputs.append(out[: min(rows, n - lo)] if pipeline.has_last else None)
    pipeline.chunk_losses.clear()
    return torch.cat(outputs) if pipeline.has_last else None


def _check_rows(pipeline: Pipeline, rows: int) -> None:
    # Unequal chunks, or a second shape, would meet receive buffers of the first chunk's
    # shape: seen as a shape error on one rank and a hang on the other.
    if rows % pipeline.microbatches:
        raise ValueError(
            f"a batch of {rows} rows does not split into parallel.pp_microbatches = "
            f"{pipeline.microbatches} equal chunks"
        )
    if pipeline.train_rows is None:
        pipeline.train_rows = rows
    elif rows != pipeline.train_rows:
        raise ValueError(
            f"a train batch of {rows} rows, but the pipeline's buffers were shaped "
            f"for {pipeline.train_rows}: every micro-batch must have the same size"
        )


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    pad = rows - t.shape[0]
    return torch.cat([t, t[:1].expand(pad, *t.shape[1:])]) if pad else t


def idle_fraction_theory(
    schedule: str, *, pp: int, microbatches: int, stages_per_rank: int
) -> float:
    """The idle fraction of each rank's wall time in one step, with stages equally fast and
    communication free; p ranks, m chunks, v stages per rank, (p - 1) slots of bubble:

    gpipe, 1f1b       (p-1) / (m + p-1)
    interleaved-1f1b  (p-1) / (v*m + p-1)    slots v times shorter (Megatron-LM's (p-1)/(v*m)
                                             of the ideal time, here a fraction of wall time)
    zero-bubble       (p-1) / (3*v*m + p-1)  ZB-H1: a third of 1F1B's bubble when forward,
                                             input- and weight-gradient take equal time

    Args:
        schedule: one of SCHEDULES.
        pp: pipeline ranks.
        microbatches: chunks per step.
        stages_per_rank: stages each rank holds.
    """
    p, m, v = pp, microbatches, stages_per_rank
    work = {"gpipe": m, "1f1b": m, "interleaved-1f1b": v * m, "zero-bubble": 3 * v * m}
    if schedule not in work:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")
    return (p - 1) / (work[schedule] + p - 1)


def measure_idle(
    pipeline: Pipeline,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    loss_weight: float,
    warmup: bool = True,
) -> float:
    """The pipeline's idle fraction in one `run_pipeline`, the same on every pp rank:
    1 - (compute time summed over ranks) / (pp x the step's wall time, barrier to last end).

    Compute is timed around the stages' forward_one_chunk, backward_one_chunk and
    backward_weight_one_chunk, the schedules' only compute actions (module or autograd hooks
    would miss zero-bubble's deferred weight gradients). Waiting on communication, and the
    loss, count as idle. Gradients accumulate: zero them after.

    Args:
        pipeline: `build_pipeline`'s result.
        inputs, targets: one train micro-batch, as for `run_pipeline`.
        loss_weight: as for `run_pipeline`.
        warmup: run once untimed first: shape inference runs compute outside those actions.
    """
    if warmup:
        run_pipeline(pipeline, inputs, targets, loss_weight=loss_weight)
    busy = [0.0]
    names = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            busy[0] += time.perf_counter() - start
            return out

        return wrapper

    # Instance attributes shadow the methods for this one call and are deleted after: the
    # stages' own code is untouched.
    group = pipeline.stages[0].group
    for stage in pipeline.stages:
        for name in names:
            setattr(stage, name, timed(getattr(stage, name)))
    try:
        dist.barrier(group=group)
        start = time.perf_counter()
        run_pipeline(pipeline, inputs, targets, loss_weight=loss_weight)
        wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    finally:
        for stage in pipeline.stages:
            for name in names:
                delattr(stage, name)
    total_busy = torch.tensor([busy[0]], dtype=torch.float64)
    dist.all_reduce(total_busy, group=group)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=group)
    pp = dist.get_world_size(group)
    return max(0.0, 1.0 - float(total_busy) / (pp * float(wall)))


def _split_of(spec: ModelSpec) -> PipelineSplit:
    if spec.pipeline is None:
        raise PipelineConfigError(
            "the model declares no pipeline split (ModelSpec.pipeline); see models/protocol.py"
        )
    return spec.pipeline


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
