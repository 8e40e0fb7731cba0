"""The one order in which parallel techniques are applied, and what the step needs of them.

Order (written down once, here, in `parallelize`):

    precision cast (done by the caller) -> pipeline split -> tensor parallel ->
    activation checkpointing -> FSDP -> materialise (a meta-built model) -> torch.compile ->
    DDP (only without sharding) -> DDP comm hook -> pipeline schedule

Under parallel.strategy = "diloco" the dp_replicate dimension holds islands that train
apart: FSDP shards over dp_shard alone and no DDP wraps the model; the islands' exchange
(parallel/diloco.py) is built by the caller on what this returns.

- The pipeline split comes first: every later technique applies to a stage, the part of
  the model this rank holds, not to the whole model.
- Tensor parallelism before FSDP: FSDP then shards the DTensors TP made along the data-
  parallel dimension (a 2-D layout); the other way round FSDP's flat shards could not be
  split by heads.
- Activation checkpointing wraps whole blocks before FSDP makes each (wrapped) block a unit,
  so the recomputation all-gathers the block's parameters like its forward did.
- A model built on the meta device (models/init.py) goes through the split, TP and FSDP as
  shapes only; then each rank allocates its own shards (`to_empty`) and fills them by the
  module rule, so the values are one process's whatever the layout, and no rank ever holds
  more of the model than its shards plus one module's full tensors.
- DDP goes last and only when nothing is sharded: it replicates whole parameters and
  all-reduces gradients; its comm hook (gradient compression) is registered on the wrapper.
  The module is compiled in place (`nn.Module.compile`) before DDP wraps it, so parameter
  names stay plain (no `_orig_mod.` prefix in checkpoints).
- The pipeline schedule is built from the finished stages (torch's PipelineStage must see
  the FSDP-wrapped module to drive its unshard and gradient reduction).

What comes back (`Parallelized`): `model`, the one module whose parameters this rank
trains and checkpoints (the whole model, a DDP wrapper, or under pipeline parallelism this
rank's share of the blocks, with the model's own parameter names), and the pipeline when
there is one. With one process nothing is wrapped and nothing communicates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scaletrain.models.init import WEIGHTS_ATTR, init_plan, is_meta, materialize
from scaletrain.models.protocol import (
    ModelSpec,
    block_modules,
    require,
    sequence_targets,
    tp_targets,
)
from scaletrain.parallel.checkpointing import apply_activation_checkpointing
from scaletrain.parallel.checks import PipelineShape
from scaletrain.parallel.comm_hooks import HookState, register_comm_hook
from scaletrain.parallel.ddp import apply_ddp
from scaletrain.parallel.fsdp import allow_tensor_parallel_output_view, apply_fsdp
from scaletrain.parallel.layout import ParallelLayout
from scaletrain.parallel.tensor import apply_tp, check_tp_fit


class ParallelKeys(Protocol):
    """The [parallel] keys the techniques read. The caller passes the frozen section itself
    (config.ParallelConfig, which this room does not import); nothing copies it field by
    field. The pipeline's keys come resolved, with their defaults, as a `PipelineShape`."""

    strategy: str  # "diloco": dp_replicate is islands that sync apart from the step
    bucket_cap_mb: float
    gradient_as_bucket_view: bool
    comm_hook: str
    powersgd_rank: int
    powersgd_start_iter: int
    reshard_after_forward: bool
    activation_checkpointing: str
    sequence_parallel: bool
    fsdp_offload: bool


# What the model must declare (models/protocol.require) for each technique, and when the
# layout and keys turn that technique on: the one table check_model_fits and the launcher's
# check (prelaunch.check_layout_fits) read.
NEEDS_DECLARATION: dict[str, Callable[[ParallelLayout, ParallelKeys], bool]] = {
    "tp": lambda layout, parallel: layout.tp > 1,
    "pp": lambda layout, parallel: layout.pp > 1,
    "activation-checkpointing": lambda layout, parallel: (
        parallel.activation_checkpointing != "none"
    ),
}


def techniques_needing_the_model(layout: ParallelLayout, parallel: ParallelKeys) -> list[str]:
    """The techniques on in this run that need something declared by the model."""
    return [name for name, on in NEEDS_DECLARATION.items() if on(layout, parallel)]


@dataclass
class Parallelized:
    model: nn.Module  # what the optimizer and the checkpoints see (see the module docstring)
    mesh: object | None  # the run's DeviceMesh (None in one process)
    pipeline: object | None = None  # parallel.pipeline.Pipeline under pp > 1
    hook_state: HookState | None = None  # the DDP comm hook's state (bytes sent, PowerSGD)
    weights_read: int = 0  # bytes of pretrained weights this rank read (its slices)


def check_model_fits(
    model: nn.Module,
    spec: ModelSpec,
    *,
    layout: ParallelLayout,
    parallel: ParallelKeys,
    pipeline: PipelineShape | None,
    model_label: str,
) -> None:
    """Refuse a layout this model cannot take (no TP plan, heads that do not split, fewer
    blocks than stages), naming the model and the key. Runs on the bare model, before any
    technique: in the launcher, and on every rank before `parallelize`."""
    from scaletrain.parallel.pipeline import PipelineConfigError, check_schedule

    for technique in techniques_needing_the_model(layout, parallel):
        require(spec, technique, model_label=model_label)
    if layout.tp > 1:
        heads = {
            p: "colwise"
            for p, role in sequence_targets(model, spec).items()
            if role == "head" and parallel.sequence_parallel
        }
        check_tp_fit(
            model, {**tp_targets(model, spec), **heads}, tp=layout.tp, model_label=model_label
        )
    if layout.pp > 1:
        if spec.source == "hugging-face":
            raise PipelineConfigError(
                f"parallel.pp = {layout.pp}: pipeline stages of a Hugging Face model "
                f"({model_label}) are not supported yet (its base model computes the rotary "
                "embeddings once for every layer); use dp_shard and tp with it, or the "
                "built-in gpt for pp"
            )
        n_blocks = len(list(model.get_submodule(spec.pipeline.blocks).children()))
        check_schedule(
            pipeline.schedule,
            pp=layout.pp,
            microbatches=pipeline.microbatches,
            stages_per_rank=pipeline.stages_per_rank,
            n_blocks=n_blocks,
        )


def parallelize(
    model: nn.Module,
    *,
    spec: ModelSpec,
    layout: ParallelLayout,
    rank: int,
    device: torch.device,
    parallel: ParallelKeys,
    pipeline: PipelineShape | None,
    precision,
    loss_fn=None,
    compile: bool = False,
    init_seed: int = 0,
    shapes_only: bool = False,
) -> Parallelized:
    """Apply the layout's techniques to `model` in the documented order.

    Args:
        model: the bare model, already in its master dtype, identical on every rank: real,
            or on the meta device (materialised here, after the split, by models/init.py).
        spec: its ModelSpec (blocks, TP plan, pipeline split).
        layout: the resolved degrees; rank: this process's global rank.
        device: this rank's device.
        parallel: the frozen [parallel] section (`ParallelKeys` are what is read).
        pipeline: under pp > 1 the resolved schedule, chunks and stages per rank.
        precision: the Precision object (FSDP's mixed-precision policy, fp16 loss scaling
            inside the pipeline).
        loss_fn: (output, batch) -> (sum, count); the pipeline's last stage computes it.
        compile: torch.compile the module in place (DDP path only; refused with sharding).
        init_seed: train.seed, from which a meta-built model's modules are initialised.
        shapes_only: the planner's pass (planner/trace.py, under a fake process group): a
            meta model goes through steps 1-4 and stays on meta, each rank's shards as
            shapes; no DDP wrapper and no schedule, which hold no parameters.
    """
    plan = init_plan(model) if is_meta(model) else None  # read off the bare, unsplit model
    islands = parallel.strategy == "diloco"  # no gradient sync over dp_replicate
    if plan is None and not shapes_only:
        model = model.to(device)
    mesh = layout.build_mesh(device.type)
    coords = layout.coords(rank)
    parts, owner, stages = [model], model, None
    if layout.pp > 1:  # 1. pipeline split: this rank's stages of the model
        from scaletrain.parallel.pipeline import split_model, stage_ids

        stages = stage_ids(
            pp_rank=coords["pp"],
            pp=layout.pp,
            stages_per_rank=pipeline.stages_per_rank,
            schedule=pipeline.schedule,
        )
        parts = split_model(
            model, spec, stage_ids=stages, num_stages=layout.pp * pipeline.stages_per_rank
        )
        owner = parts[0] if len(parts) == 1 else _share_parts(model, spec, parts)
    targets = tp_targets(model, spec) if layout.tp > 1 else {}
    sequence = sequence_targets(model, spec) if layout.tp > 1 and parallel.sequence_parallel else {}
    for part in parts:
        if layout.tp > 1:  # 2. tensor parallel (and sequence parallel where declared)
            apply_tp(part, mesh["tp"], targets=targets, sequence=sequence)
        if parallel.activation_checkpointing != "none":  # 3. activation checkpointing
            apply_activation_checkpointing(
                part, blocks_path=spec.blocks, mode=parallel.activation_checkpointing
            )
        if layout.dp_shard > 1:  # 4. FSDP, per stage (HSDP over dp_replicate, but not
            # across DiLoCo's islands: they exchange apart from the step, parallel/diloco.py)
            hsdp = layout.dp_replicate > 1 and not islands
            dims = ("dp_replicate", "dp_shard") if hsdp else ("dp_shard",)
            apply_fsdp(
                part,
                mesh[dims],
                blocks=block_modules(part, spec) if spec.blocks else [],
                mp_policy=precision.fsdp_policy(),
                reshard_after_forward=parallel.reshard_after_forward,
                offload=parallel.fsdp_offload,
            )
            if layout.tp > 1:  # its output is TP's to_local() view: see the function
                allow_tensor_parallel_output_view(part)
    weights_read = 0
    if shapes_only:
        return Parallelized(model=owner, mesh=mesh)
    if plan is not None:  # 5. this rank's shards, each value as one process has it
        weights_read = materialize(
            parts,
            plan=plan,
            seed=init_seed,
            device=device,
            weights=getattr(model, WEIGHTS_ATTR, None),  # pretrained: read in slices
        )
    if compile:
        owner.compile()  # in place: the same module and parameter names, a compiled forward
    out = Parallelized(model=owner, mesh=mesh, weights_read=weights_read)
    if layout.dp_replicate > 1 and layout.dp_shard == 1 and not islands:  # 6. DDP (nothing else)
        out.model = apply_ddp(
            owner,
            device=device,
            bucket_cap_mb=parallel.bucket_cap_mb,
            gradient_as_bucket_view=parallel.gradient_as_bucket_view,
        )
        out.hook_state = register_comm_hook(
            out.model,
            name=parallel.comm_hook,  # 7.
            powersgd_rank=parallel.powersgd_rank,
            powersgd_start_iter=parallel.powersgd_start_iter,
        )
    if layout.pp > 1:  # 8. the schedule over the finished stages
        from scaletrain.parallel.pipeline import build_pipeline

        out.pipeline = build_pipeline(
            parts,
            stage_ids=stages,
            num_stages=layout.pp * pipeline.stages_per_rank,
            group=_pipeline_group(mesh, layout),
            device=device,
            schedule=pipeline.schedule,
            microbatches=pipeline.microbatches,
            loss_fn=loss_fn,
        )
    return out


def _pipeline_group(mesh, layout: ParallelLayout):
    """The stages' process group. When the pipeline spans the whole world, the mesh's "pp"
    group is the default group, which also carries the trainer's own collectives (the
    SIGTERM flag's all-reduce is in flight during the next step): a group of their own
    keeps the schedule's sends and receives apart from them."""
    import torch.distributed as dist

    if layout.pp == layout.world_size:
        return dist.new_group(ranks=list(range(layout.world_size)))
    return mesh["pp"].get_group()


def _share_parts(model: nn.Module, spec: ModelSpec, parts: list[nn.Module]) -> nn.Module:
    """One module holding every stage this rank runs (interleaved schedules run two or more):
    the model's skeleton whose blocks and ends are the very modules of the stage parts. The
    optimizer and the checkpoints see it, with the model's own parameter names; the
    schedule runs the parts."""
    import copy

    pipe = spec.pipeline
    blocks = model.get_submodule(pipe.blocks)
    saved = dict(blocks.named_children())
    for name in saved:  # copy the skeleton only, not every block's weights
        delattr(blocks, name)
    try:
        owner = copy.deepcopy(model)
    finally:
        for name, block in saved.items():
            blocks.register_module(name, block)
    held = owner.get_submodule(pipe.blocks)
    for part in parts:
        for name, block in part.get_submodule(pipe.blocks).named_children():
            held.register_module(name, block)
    for path in (*pipe.first, *pipe.last):
        parent, _, leaf = path.rpartition(".")
        found = [getattr(p.get_submodule(parent), leaf) for p in parts]
        setattr(owner.get_submodule(parent), leaf, next((m for m in found if m is not None), None))
    return owner


def gradient_sync(model: nn.Module, *, enabled: bool) -> ContextManager:
    """Context for one micro-batch's backward: sync gradients across ranks or not.

    DDP: skipping the all-reduce on all but the last micro-batch lets gradients accumulate
    locally and be all-reduced once per optimizer step, at no memory cost. FSDP is left to
    reduce-scatter every micro-batch (as torchtitan does): skipping it would keep every
    block's whole, unsharded gradient until the last micro-batch, the very memory sharding
    saves; the accumulated shards sum to the same gradient.
    """
    if isinstance(model, DistributedDataParallel) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module, without the DDP wrapper (plain parameter names)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
