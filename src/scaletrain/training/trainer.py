"""The trainer: build every piece from the config, run the loop, write the run directory.

This is the only place below the CLI that reads the config; every technique underneath
receives explicit arguments. Flow per run:

    resolve config -> threads, process group, seeds -> data (train/eval), sampler (by the
    data-parallel rank), model, loss (built-in or the user's: training/assemble.py) ->
    precision cast -> [user code: checked on the bare model] -> the layout checked against
    the model -> parallelize (pipeline split, TP, activation checkpointing, FSDP or DDP:
    parallel/compose.py) -> optimizer, schedule -> loop:
        sampler gives this rank's micro-batches -> train_step -> bad-step check ->
        metrics every log.every (one all-reduce) -> eval every train.eval_every
    -> final eval -> model.safetensors, summary.json (rank 0)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from scaletrain.allocator import configure_allocator
from scaletrain.checkpoint import Checkpointer, TrainState
from scaletrain.checkpoint import load as load_checkpoint
from scaletrain.checkpoint_files import latest_valid
from scaletrain.config import Config, config_to_toml
from scaletrain.data.loader import Dataset
from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.data.sources import Batch
from scaletrain.distill.build import cached_splits
from scaletrain.distill.objective import take_terms
from scaletrain.distill.teacher import describe_teacher, place_teacher
from scaletrain.errors import UserError
from scaletrain.launch import under_elastic_agent
from scaletrain.loss import LossFn
from scaletrain.memory import WindowPeak
from scaletrain.metrics import MetricsLogger
from scaletrain.models.init import is_meta
from scaletrain.models.protocol import model_spec
from scaletrain.parallel.comm_hooks import keyed_by_bucket, rebuild_buckets
from scaletrain.parallel.compose import check_model_fits, parallelize
from scaletrain.parallel.layout import ParallelLayout
from scaletrain.parallel.pipeline import Pipeline
from scaletrain.plan import Derived, resolve
from scaletrain.precision import Precision, make_precision
from scaletrain.rundir import default_run_dir, describe_finished, finished_run, write_config
from scaletrain.runtime import (
    ProcessEnv,
    all_reduce_sum,
    broadcast_object,
    collective_guard,
    init_distributed,
    read_env,
    seed_everything,
    set_threads,
)
from scaletrain.training import signals
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
from scaletrain.training.evaluate import evaluate
from scaletrain.training.finish import WRITTEN, save_split_weights
from scaletrain.training.finish import finish_run as _finish
from scaletrain.training.hooks import step_hooks
from scaletrain.training.optim import build_optimizer, build_scheduler
from scaletrain.training.progress import (
    CommCounter,
    RunProgress,
    Startup,
    Window,
    log_window,
    model_flops,
)
from scaletrain.training.step import StepResult, forward, train_step
from scaletrain.user_code import UserCodeError


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


@dataclass
class Parts:
    """Everything `train` builds from the config, handed to the loop."""

    state: TrainState  # what a checkpoint holds (checkpoint.py lists it)
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
    teacher: object | None = None  # under [distill] with an online teacher: distill.teacher.Teacher
    # Called after each step's train_step with (step, its seconds): what a benchmark or a
    # user hooks in (training/hooks.py); the loop itself sleeps for nobody.
    after_step: tuple[Callable[[int, float], None], ...] = ()
    heap: str = "system"  # the CPU heap policy applied (allocator.py)

    @property
    def reports_loss(self) -> bool:
        """This rank's summed loss counts in the logged loss (one per data-parallel share)."""
        return self.layout.reports_loss(self.rank)


def train(config: Config, *, run_dir: Path | None, code: UserCode = NO_CODE) -> dict | None:
    """Train as this process's rank; return the summary on rank 0 (None elsewhere).

    Resumes from the newest valid checkpoint in RUN_DIR/checkpoints when there is one (an
    elastic restart, or `--resume`), on any world size.

    Args:
        config: the validated config.
        run_dir: the run directory; None picks runs/<name>-<time> on rank 0 (plain torchrun).
        code: the model factory, data function or loss given as callables (Python API).
    """
    penv = read_env()
    derived = resolve(config, world_size=penv.world_size, nproc_per_node=penv.local_world_size)
    set_threads(derived.threads)
    device = init_distributed(penv, backend=derived.backend, timeout_s=config.parallel.timeout_s)
    startup = Startup(enabled=penv.is_main and not config.log.quiet)
    startup.say(f"{penv.world_size} process(es) up, {derived.threads} thread(s) each")
    run_dir = Path(broadcast_object(str(run_dir or default_run_dir(config.name))))
    # A finished run (plain torchrun pointed at its directory again): say so, touch nothing.
    done = broadcast_object(finished_run(run_dir, config) if penv.is_main else None)
    if done is not None:
        if penv.is_main:
            print(describe_finished(run_dir, done), file=sys.stderr)
        return {**done, "run_dir": str(run_dir)} if penv.is_main else None
    resume_from = broadcast_object(_latest_checkpoint(run_dir, penv) if penv.is_main else None)
    if penv.is_main and resume_from is None:
        write_config(run_dir, config)
    seed_everything(config.train.seed)
    parts = build(config, derived, penv, device=device, run_dir=run_dir, code=code, startup=startup)
    if resume_from is not None:
        load_checkpoint(Path(resume_from), parts.state)
        if keyed_by_bucket(parts.comm.hook_state):
            _rebuild_buckets(parts)
        if penv.is_main:  # only now: a resume that fails leaves the run's config.toml as it was
            write_config(run_dir, config)
    logger = MetricsLogger(
        run_dir,
        total_steps=config.train.steps,
        enabled=penv.is_main,
        quiet=config.log.quiet,
        tensorboard=config.log.tensorboard,
        start_step=parts.state.step,
    )
    if resume_from is not None:
        logger.message(f"scaletrain: resumed from {resume_from} at step {parts.state.step}")
    for warning in derived.warnings:
        logger.message(f"scaletrain: warning: {warning}")
    if parts.teacher is not None:
        logger.message(f"scaletrain: {describe_teacher(parts.teacher)}")
    if parts.heap != "system":
        logger.message(f"scaletrain: CPU heap policy: {parts.heap} (train.allocator)")
    startup.say(
        f"ready: step {parts.state.step + 1} of {config.train.steps} starting (the "
        "first is slower: warm-up)"
    )
    try:
        summary = _loop(config, derived, penv, parts, logger=logger, run_dir=run_dir)
        return None if summary is None else {**summary, "run_dir": str(run_dir)}
    finally:
        parts.checkpointer.close()
        logger.close()


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
    # The attention kernel measured fastest for this model and precision (attention.py):
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
    o = config.optim
    # A fused kernel takes the fp16 scaler's found-inf flag as a plain tensor, which it
    # cannot mix with DTensor parameters, and fused SGD has no DTensor sharding rule at all
    # (torch 2.13): sharded fp16, and sharded SGD, run the foreach kernels.
    sharded_unfusable = precision.scaler is not None or o.name == "sgd"
    impl = "foreach" if sharded_unfusable and layout.splits_gradients else o.impl
    optimizer = build_optimizer(
        model,
        name=o.name,
        lr=o.lr,
        weight_decay=o.weight_decay,
        betas=o.betas,
        momentum=o.momentum,
        impl=impl,
    )
    scheduler = build_scheduler(
        optimizer,
        warmup_steps=o.warmup_steps,
        total_steps=config.train.steps,
        schedule=o.schedule,
        min_lr_ratio=o.min_lr_ratio,
    )
    c = config.checkpoint
    checkpointer = Checkpointer(
        run_dir / "checkpoints",
        keep=c.keep,
        async_save=c.async_save,
        config_toml=config_to_toml(config),
        every=c.every,
    )
    comm = CommCounter(model, hook_state, ddp=isinstance(model, DistributedDataParallel))
    # The loop's streak and window: a checkpoint loads into this RunProgress, the loop runs on it.
    state = TrainState(
        model,
        optimizer,
        scheduler,
        precision,
        hook=hook_state,
        loop=RunProgress(first_step=0, comm=comm, flops=flops),
        tokens_per_example=train_ds.spec.input_shape[0] if train_ds.spec.kind == "lm" else 0,
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
        dp_group=layout.dp_group(par.mesh),
        teacher=kd.teacher if kd is not None else None,
        after_step=step_hooks(config, dp_rank=layout.dp_rank(penv.rank)),
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
        f"`{INIT_ATTR}(name, module)` on the model to build it on the meta device (README, "
        "'Models bigger than one device')"
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


def _rebuild_buckets(parts: Parts) -> None:
    """A resumed PowerSGD run needs DDP's rebuilt buckets before its first step: the hook
    state it restored is keyed by them (parallel/comm_hooks.py, `rebuild_buckets`)."""
    state = parts.state
    # One example is enough: the bucket order follows the graph, not the values.
    batch = parts.train_ds.get(parts.sampler.micro_batches(state.step)[0][:1]).to(parts.device)

    def forward_backward() -> None:
        with state.precision.forward_context():
            loss, _ = parts.loss_fn(forward(state.model, batch, state.precision), batch)
        loss.backward()

    rebuild_buckets(
        state.model, parts.comm.hook_state, forward_backward=forward_backward, device=parts.device
    )


def _latest_checkpoint(run_dir: Path, penv: ProcessEnv) -> str | None:
    # Rank 0 moves a damaged checkpoint aside, so the run's next save of that step succeeds.
    found = latest_valid(
        run_dir / "checkpoints", report=lambda m: print(m, file=sys.stderr), quarantine=True
    )
    return str(found) if found else None


def _loop(
    config: Config,
    derived: Derived,
    penv: ProcessEnv,
    parts: Parts,
    *,
    logger: MetricsLogger,
    run_dir: Path,
) -> dict | None:
    """Run steps state.step .. train.steps, then the final evaluation; None on a planned stop."""
    t, state = config.train, parts.state
    run = state.loop  # fresh from build, or the streak and open window a checkpoint restored
    run.first_step, run.started, run.memory = state.step, time.perf_counter(), WindowPeak.start()
    run.eval_s = 0.0
    if not run.window.steps:  # no window restored: start its clock now, not at build time
        run.window = Window()
    indices = parts.sampler.micro_batches(state.step)
    take_terms(parts.loss_fn)  # the set-up checks' calls are no step's
    for step in range(state.step, t.steps):
        micro, indices = _fetch(parts, indices, step=step, total_steps=t.steps)
        step_started = time.perf_counter()
        with collective_guard("gradient all-reduce (DDP backward)", step=step):
            result = train_step(
                state.model,
                micro,
                optimizer=state.optimizer,
                scheduler=state.scheduler,
                precision=state.precision,
                grad_clip=config.optim.grad_clip,
                dp_size=derived.layout.dp,
                ragged_counts=parts.train_ds.spec.ragged,
                loss_fn=parts.loss_fn,
                pipeline=parts.pipeline,
                pp_group=parts.pp_group,
                dp_group=parts.dp_group,
            )
        if step == run.first_step and config.train.compile:  # what compiling cost
            logger.message(
                f"scaletrain: torch.compile: the first step took "
                f"{time.perf_counter() - step_started:.1f} s (compiling; later steps reuse it)"
            )
        for hook in parts.after_step:  # e.g. the benchmark's straggler (training/hooks.py)
            hook(step, time.perf_counter() - step_started)
        state.step = step + 1
        _count_bad_steps(state, result, run, config=config)
        log_window(
            state,
            result,
            micro,
            run,
            reports_loss=parts.reports_loss,
            logger=logger,
            terms=take_terms(parts.loss_fn),  # [distill]: each term of the loss
            every=config.log.every,
            total_steps=t.steps,
            compiled=config.train.compile,
            dp=derived.layout.dp,
        )
        if _checkpoint_or_stop(state, parts, logger=logger, config=config, run_dir=run_dir):
            return None
        if t.eval_every and state.step % t.eval_every == 0 and state.step < t.steps:
            eval_started = time.perf_counter()
            with collective_guard("evaluation all-reduce", step=step):
                record = {
                    "step": state.step,
                    **evaluate(
                        state.model,
                        parts.eval_ds,
                        config,
                        penv,
                        derived,
                        precision=state.precision,
                        device=parts.device,
                        loss_fn=parts.loss_fn,
                        pipeline=parts.pipeline,
                    ),
                }
            logger.log_eval(record)
            logger.message(
                f"scaletrain: eval at step {state.step}: "
                + ", ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "step")
            )
            evaluating = time.perf_counter() - eval_started
            run.window.start += evaluating  # throughput is training only
            run.eval_s += evaluating
    train_s = time.perf_counter() - run.started - run.eval_s
    eval_started = time.perf_counter()
    with collective_guard("evaluation all-reduce", step=t.steps):
        eval_record = evaluate(
            state.model,
            parts.eval_ds,
            config,
            penv,
            derived,
            precision=state.precision,
            device=parts.device,
            loss_fn=parts.loss_fn,
            pipeline=parts.pipeline,
        )
    run.eval_s += time.perf_counter() - eval_started
    # Every rank takes part. A split model (under [distill] the student): each rank writes
    # its shards, rank 0 joins them (no rank holds the whole model).
    if parts.layout.splits_gradients:
        save_split_weights(state.model, run_dir=run_dir)
        weights = WRITTEN
    else:  # DDP or one process: rank 0's module is the whole model, saved as it is
        weights = None
    logger.log_eval({"step": t.steps, **eval_record})
    if not penv.is_main:
        return None
    # summary.json is JSON: a non-finite loss or metric is written as null (finish.py).
    return _finish(
        run_dir,
        model=state.model,
        weights=weights,
        config=config,
        derived=derived,
        train_s=train_s,
        eval_s=run.eval_s,
        last_loss=run.last_loss,
        eval_record=eval_record,
        skipped=state.skipped_steps,
        steps_run=t.steps - run.first_step,
        precision_mode=state.precision.mode,
        tokens_per_example=state.tokens_per_example,
    )


def _fetch(
    parts: Parts, indices: list[torch.Tensor], *, step: int, total_steps: int
) -> tuple[list[Batch], list[torch.Tensor]]:
    """This step's micro-batches; starts reading the next step's rows in the background."""
    micro = [parts.train_ds.get(idx).to(parts.device, non_blocking=True) for idx in indices]
    if step + 1 < total_steps:
        indices = parts.sampler.micro_batches(step + 1)
        parts.train_ds.prefetch(torch.cat(indices))
    return micro, indices


def _count_bad_steps(
    state: TrainState, result: StepResult, run: RunProgress, *, config: Config
) -> None:
    """Per-step counters: skipped steps and the streak of them (fp16 overflows are the loss
    scaler's business; only a streak stops the run), examples and tokens seen."""
    run.bad_in_row = 0 if result.stepped else run.bad_in_row + 1
    state.skipped_steps += not result.stepped
    state.examples_seen += config.train.global_batch
    state.tokens_seen += config.train.global_batch * state.tokens_per_example
    run.first_bad = result.first_nonfinite if run.bad_in_row == 1 else run.first_bad
    if run.bad_in_row >= config.train.max_bad_steps:
        raise TrainingDiverged(
            _diverged_message(
                state.step - 1,
                run.bad_in_row,
                run.last_loss,
                config,
                run.first_bad,
                state.precision,
            )
        )


def _checkpoint_or_stop(
    state: TrainState, parts: Parts, *, logger: MetricsLogger, config: Config, run_dir: Path
) -> bool:
    """Save on the checkpoint schedule; on a planned stop or a SIGTERM save, wait, return True.

    SIGTERM (a scheduler's preemption, forwarded by torchrun's agent) only sets a flag; the
    ranks agree on it a step later (training/signals.py), so every rank saves the same step.
    """
    planned = state.step == config.train.stop_after
    # stop_requested() runs on every step and rank: it is a collective (one step behind).
    with collective_guard("SIGTERM flag all-reduce", step=state.step - 1):
        preempted = signals.stop_requested() and state.step < config.train.steps
    if parts.checkpointer.due(state.step, stop=planned or preempted):
        with collective_guard("checkpoint save", step=state.step - 1):
            parts.checkpointer.save(state)
    if not (planned or preempted):
        return False
    parts.checkpointer.wait()  # a stop (job time limit, preemption): resume with --resume
    if preempted:
        signals.mark_stopped()
    # On SIGTERM the launcher of a single process, or ours for its workers, prints the line.
    if planned or under_elastic_agent():
        why = "train.stop_after" if planned else "SIGTERM"
        logger.message(
            f"scaletrain: stopped after step {state.step} ({why}); "
            f"continue with: scaletrain train ... --run-dir {run_dir} --resume"
        )
    return True


def _diverged_message(
    step: int,
    bad: int,
    last_loss: float,
    config: Config,
    first_bad: str | None,
    precision: Precision,
) -> str:
    where = f"; the first gradient to overflow was {first_bad!r}" if first_bad else ""
    scale = (
        f" (loss scale now {precision.loss_scale:g})" if precision.loss_scale is not None else ""
    )
    return (
        f"training stopped at step {step + 1}: the loss or gradients were non-finite for {bad} "
        f"consecutive steps (train.max_bad_steps = {config.train.max_bad_steps}){where}{scale}; "
        f"last logged loss {last_loss:.4g}. Try a lower optim.lr (now {config.optim.lr}), "
        f"gradient clipping (optim.grad_clip), or precision.mode='fp32'/'bf16-mixed'."
    )
