"""Build every piece of a run from the config, in one documented order: data, sampler,
model and loss (training/assemble.py), precision, the measured attention kernel, the layout
checked against the model, parallelize (parallel/compose.py), optimizer and schedule,
checkpointer. `train` (training/trainer.py) runs the loop on what `build` returns (`Parts`).

This and the trainer are the only places below the commands that read the whole config;
every technique underneath receives its section or explicit arguments.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from scaletrain.checkpoint import Checkpointer, TrainState
from scaletrain.config import Config, config_to_toml
from scaletrain.data.loader import Dataset
from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.distill.build import cached_splits
from scaletrain.distill.teacher import place_teacher
from scaletrain.errors import UserError
from scaletrain.launch.resolve import Derived
from scaletrain.loss import LossFn
from scaletrain.models.init import is_meta
from scaletrain.models.protocol import model_spec
from scaletrain.parallel.compose import check_model_fits, parallelize
from scaletrain.parallel.diloco import DiLoCo, assign_fragments, island_groups, plain_name
from scaletrain.parallel.layout import ParallelLayout
from scaletrain.parallel.pipeline import Pipeline
from scaletrain.precision import Precision, make_precision
from scaletrain.runtime import (
    ProcessEnv,
    all_reduce_sum,
    broadcast_object,
)
from scaletrain.runtime.allocator import configure_allocator
from scaletrain.training.assemble import (
    NO_CODE,
    UserCode,
    brings_own_code,
    build_data,
    build_net,
    build_objective,
    check_fit,
    check_loss,
    is_user_loss,
    measure_attention,
    tensor_bytes,
)
from scaletrain.training.optim import (
    describe_optimizer,
    from_section,
    hidden_matrices,
    layout_impl,
)
from scaletrain.training.progress import (
    CommCounter,
    RunProgress,
    Startup,
    model_flops,
)
from scaletrain.user_code import UserCodeError


@dataclass
class Parts:
    """Everything `train` builds from the config, handed to the loop."""

    state: TrainState  # what a checkpoint holds (checkpoint/__init__.py lists it)
    sampler: GlobalBatchSampler
    train_ds: Dataset
    eval_ds: Dataset
    device: torch.device
    comm: CommCounter
    checkpointer: Checkpointer
    loss_fn: LossFn  # (model output, batch) -> (summed loss, count)
    layout: ParallelLayout
    rank: int
    pipeline: Pipeline | None = None  # under pp > 1: the schedule over this rank's stages
    pp_group: object | None = None  # under pp > 1: the pipeline's process group
    dp_group: object | None = None  # the data-parallel peers' group (ragged counts sum over it)
    dp_size: int = 1  # data-parallel ranks the step normalises over (under DiLoCo: an island's)
    diloco: DiLoCo | None = None  # parallel.strategy = 'diloco': the exchange between islands
    teacher: object | None = None  # under [distill] with an online teacher: distill.teacher.Teacher
    heap: str = "system"  # the CPU heap policy applied (runtime/allocator.py)

    @property
    def reports_loss(self) -> bool:
        """This rank's summed loss counts in the logged loss (one per data-parallel share)."""
        return self.layout.reports_loss(self.rank)

    @property
    def island_count(self) -> bool | None:
        """Under DiLoCo, whether this rank adds its island's count to a record's sum (one
        rank per island does); None without islands (counts are global)."""
        if self.diloco is None:
            return None
        return self.reports_loss and self.layout.coords(self.rank)["dp_shard"] == 0


def build(
    config: Config,
    derived: Derived,
    penv: ProcessEnv,
    *,
    device: torch.device,
    run_dir: Path,
    code: UserCode = NO_CODE,
    startup: Startup | None = None,
) -> Parts:
    """Data, model, loss, precision, parallelism, optimizer, schedule, sampler: in that order."""
    d, layout = config.data, derived.layout
    startup = startup or Startup(enabled=False)
    train_ds, eval_ds = (build_data(config, split=split, code=code) for split in ("train", "eval"))
    startup.say(
        f"data: {len(train_ds)} training and {len(eval_ds)} evaluation examples "
        f"(data.source = {d.source!r})"
    )
    # Tensor-parallel and pipeline peers read the same examples: the sampler takes the
    # data-parallel rank, not the global one.
    sampler = GlobalBatchSampler(
        len(train_ds),
        global_batch=config.train.global_batch,
        micro_batch=config.train.micro_batch,
        dp_rank=layout.dp_rank(penv.rank),
        dp_size=layout.dp,
        seed=config.train.seed,
        shard_rows=train_ds.shard_rows,
        shuffle_window=d.shuffle_window,
    )
    precision = make_precision(
        config.precision.mode,
        device_type=device.type,
        init_scale=config.precision.init_scale,
        growth_interval=config.precision.growth_interval,
        sharded=layout.splits_gradients,
        tf32=config.precision.tf32,
    )
    # On the meta device where the model allows it (models/init.py; model.meta_init):
    # parallelize materialises this rank's shards only. A distillation student too (its
    # projections with it), unless distill.init_layers copies teacher values into it now.
    meta = config.model.meta_init and not config.distill.init_layers
    student = build_net(config, train_ds, code=code, meta=meta)
    # The heap policy before any shard is allocated: auto picks it by the model's size.
    heap = configure_allocator(
        config.train.allocator, device_type=device.type, model_bytes=tensor_bytes(student)
    )
    # The loss, or under [distill] the student wrapped with its projections and the
    # distillation loss (the teacher lives in the loss; a cache rides with the batches).
    # A teacher sharded like the student is built on meta and each rank reads its slices
    # (place_teacher, below).
    model, loss_fn, kd = build_objective(
        config,
        student,
        train_ds,
        precision=precision,
        code=code,
        teacher_meta=layout.dp_shard > 1,
    )
    if config.distill.cache:
        cached = cached_splits(
            config, kd, precision=precision, splits={"train": train_ds, "eval": eval_ds}
        )
        train_ds, eval_ds = cached["train"], cached["eval"]
    model = precision.convert_module(model)
    on_meta = is_meta(model)
    check_code = brings_own_code(config, code)
    user_check = dict(
        train_ds=train_ds,
        config=config,
        code=code,
        precision=precision,
        loss_fn=loss_fn,
        first=sampler.micro_batches(0)[0],
        device=device,
    )
    # Checked on the bare model before any technique splits it; a meta-built model, or a
    # student whose teacher is on meta, on this rank's shards once both are placed (below).
    shards_checked = on_meta or (
        kd is not None and kd.teacher is not None and is_meta(kd.teacher.module)
    )
    if check_code and not shards_checked:
        _check_user_code(model.to(device), **user_check)
    if not on_meta and meta and layout.splits_gradients and penv.is_main:
        print(f"scaletrain: warning: {_built_whole(student, config)}", file=sys.stderr)
    spec = model_spec(model)
    # muon: its matrices chosen on the whole bare model, so that every pipeline stage agrees
    hidden = hidden_matrices(model) if config.optim.name == "muon" else None
    try:
        check_model_fits(
            model,
            spec,
            layout=layout,
            parallel=config.parallel,
            pipeline=derived.pipeline,
            model_label=f"model.name = {config.model.name!r}",
        )
    except UserError as e:  # ModelSpecError, TensorParallelError, PipelineConfigError
        raise UserCodeError(str(e)) from None
    # The attention kernel measured fastest for this model and precision (runtime/attention.py):
    # rank 0 measures on the bare model, every rank runs what it chose.
    chosen, seconds = broadcast_object(
        measure_attention(
            model,
            train_ds,
            user_check["first"],
            precision=precision,
            micro_batch=config.train.micro_batch,
        )
        if penv.is_main
        else None
    )
    precision.attention = chosen
    if chosen is not None:
        times = ", ".join(f"{name.lower()} {s * 1e3:.1f} ms" for name, s in seconds.items())
        startup.say(f"attention: the {chosen.lower()} kernel, measured fastest ({times})")
    # MFU's numerator: the whole model's FLOPs per example, counted before any split.
    flops = model_flops(
        model,
        train_ds.get(torch.zeros(1, dtype=torch.long)),
        precision=precision,
        world_size=layout.world_size,
        device_type=device.type,
    )
    islands = config.parallel.strategy == "diloco"
    if islands:  # Streaming DiLoCo's fragments, by the bare model's names and blocks
        fragment_of = assign_fragments(model, blocks=spec.blocks, fragments=config.diloco.fragments)
    par = parallelize(
        model,
        spec=spec,
        layout=layout,
        rank=penv.rank,
        device=device,
        parallel=config.parallel,
        pipeline=derived.pipeline,
        precision=precision,
        loss_fn=loss_fn,
        compile=config.train.compile,
        init_seed=config.train.seed,
    )
    model, hook_state = par.model, par.hook_state
    held = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())
    read = f", {par.weights_read / 2**20:,.2f} MiB of weights read" if par.weights_read else ""
    built = "built on meta" if on_meta else "built whole"  # meta: this rank's shards only
    startup.say(
        f"model: {held:,} parameters on this rank (model.name = "
        f"{config.model.name!r}, {built}){read}, layout {layout.describe()}"
    )
    if kd is not None and kd.teacher is not None:  # replicated, or sharded like the student
        place_teacher(
            kd.teacher, device=device, mesh=par.mesh["dp_shard"] if layout.dp_shard > 1 else None
        )
    # A meta-built model is checked on this rank's shards, every rank at once; not under pp
    # (a stage cannot run alone), where the launcher's check on two examples stands.
    if check_code and shards_checked and par.pipeline is None:
        _check_user_code(par.model, **user_check)
        _reshard(par.model)  # the check's no-grad forward leaves FSDP's last block gathered
    impl = layout_impl(
        config.optim,
        splits_gradients=layout.splits_gradients,
        loss_scaled=precision.scaler is not None,
    )
    optimizer, scheduler = from_section(
        model, config.optim, total_steps=config.train.steps, impl=impl, hidden=hidden
    )
    startup.say(describe_optimizer(optimizer))
    c = config.checkpoint
    checkpointer = Checkpointer(
        run_dir / "checkpoints",
        keep=c.keep,
        async_save=c.async_save,
        config_toml=config_to_toml(config),
        every=c.every,
    )
    # DiLoCo: the step normalises over the island's own data-parallel ranks; the islands
    # meet every diloco.sync_every steps (parallel/diloco.py).
    dp_group, diloco = layout.dp_group(par.mesh), None
    if islands:
        dp_group, across = island_groups(layout, par.mesh)
        trained = [(plain_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
        diloco = DiLoCo(
            trained,
            config.diloco,
            fragment_of=fragment_of,
            group=across,
            island=layout.coords(penv.rank)["dp_replicate"],
            islands=layout.dp_replicate,
            equal_counts=not train_ds.spec.ragged,
        )
    comm = CommCounter(
        model, hook_state, ddp=isinstance(model, DistributedDataParallel), sent_by=diloco
    )
    # The loop's streak and window: a checkpoint loads into this RunProgress, the loop runs on it.
    state = TrainState(
        model,
        optimizer,
        scheduler,
        precision,
        hook=hook_state,
        loop=RunProgress(first_step=0, comm=comm, flops=flops),
        tokens_per_example=train_ds.spec.input_shape[0] if train_ds.spec.kind == "lm" else 0,
        diloco=diloco,
    )
    return Parts(
        state=state,
        sampler=sampler,
        train_ds=train_ds,
        eval_ds=eval_ds,
        device=device,
        comm=comm,
        checkpointer=checkpointer,
        loss_fn=loss_fn,
        layout=layout,
        rank=penv.rank,
        pipeline=par.pipeline,
        pp_group=par.pipeline.stages[0].group if par.pipeline else None,
        dp_group=dp_group,
        dp_size=layout.dp_shard if islands else layout.dp,
        diloco=diloco,
        teacher=kd.teacher if kd is not None else None,
        heap=heap,
    )


def _reshard(model: torch.nn.Module) -> None:
    """Every FSDP unit back to its shards (FSDP2's `reshard`), as before any forward."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _built_whole(model: torch.nn.Module, config: Config) -> str:
    """Why every rank holds the whole model before the layout splits it, and what it costs."""
    from scaletrain.models.init import INIT_ATTR, undeclared

    size = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    missing = ", ".join(undeclared(model)[:3]) or "(the model failed on the meta device)"
    return (
        f"model.name = {config.model.name!r} is built whole on every rank ({size:,.1f} MiB) "
        f"before the layout splits it: module(s) {missing} have no initialiser; define "
        f"`{INIT_ATTR}(name, module)` on the model to build it on the meta device "
        "(docs/big-models.md)"
    )


def _check_user_code(
    net: torch.nn.Module,
    train_ds: Dataset,
    config: Config,
    *,
    code: UserCode,
    precision: Precision,
    loss_fn: LossFn,
    first: torch.Tensor,
    device: torch.device,
) -> None:
    """Before the first step, every rank runs the user's model and loss on its first
    micro-batch (`check_fit`), and checks a user's loss sums (loss.py,
    `check_summed`): the launcher checked two examples, this checks what each rank will
    train on, and in one process it is the only check. It runs on the bare model, on the
    device, before any technique splits it; a meta-built model, on this rank's shards once
    they exist (every rank at once). The ranks agree on the outcome, so none is left
    waiting in a collective while another reports the mistake."""
    batch = train_ds.get(first).to(device)
    problem = None
    try:
        check_fit(net, batch, loss_fn=loss_fn, precision=precision, config=config)
        if is_user_loss(config, code):
            check_loss(
                loss_fn,
                net,
                batch,
                config=config,
                precision=precision,
                task_kind=train_ds.spec.kind,
            )
    except UserCodeError as e:
        problem = e
    refused = all_reduce_sum(torch.tensor([float(problem is not None)], dtype=torch.float64))
    if problem is not None:
        raise problem
    if float(refused.item()) > 0:
        raise UserCodeError(
            f"the model, data or loss was refused on another rank (its log "
            f"says why: model.name = {config.model.name!r}, data.source = "
            f"{config.data.source!r}, train.loss = {config.train.loss!r})"
        )
