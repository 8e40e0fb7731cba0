"""The trainer: the loop over what training/build.py builds, and the run directory's files.

Flow per run:

    resolve config -> threads, process group, seeds -> data (train/eval), sampler (by the
    data-parallel rank), model, loss (built-in or the user's: training/assemble.py) ->
    precision cast -> [user code: checked on the bare model] -> the layout checked against
    the model -> parallelize (pipeline split, TP, activation checkpointing, FSDP or DDP:
    parallel/compose.py) -> optimizer, schedule -> loop:
        sampler gives this rank's micro-batches -> train_step -> [DiLoCo: the islands'
        exchange and outer step every diloco.sync_every steps] -> bad-step check ->
        metrics every log.every (one all-reduce) -> eval every train.eval_every
    -> final eval -> model.safetensors, summary.json (rank 0)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from scaletrain.checkpoint import TrainState
from scaletrain.checkpoint import load as load_checkpoint
from scaletrain.checkpoint.files import latest_valid
from scaletrain.config import Config, flatten_config
from scaletrain.data.sources import Batch
from scaletrain.distill.objective import take_terms
from scaletrain.distill.teacher import describe_teacher
from scaletrain.launch.agent import under_elastic_agent
from scaletrain.launch.resolve import Derived, resolve
from scaletrain.launch.rundir import default_run_dir, describe_finished, finished_run, write_config
from scaletrain.parallel.comm_hooks import keyed_by_bucket, rebuild_buckets
from scaletrain.precision import Precision
from scaletrain.records.memory import WindowPeak
from scaletrain.records.metrics import MetricsLogger
from scaletrain.records.profiling import OomSnapshot, StepProfiler, step_profiler
from scaletrain.runtime import (
    ProcessEnv,
    broadcast_object,
    collective_guard,
    hang,
    init_distributed,
    read_env,
    seed_everything,
    set_threads,
)
from scaletrain.runtime.attention import attention_context
from scaletrain.training import signals
from scaletrain.training.assemble import (
    NO_CODE,
    UserCode,
)
from scaletrain.training.build import Parts, build
from scaletrain.training.evaluate import evaluate
from scaletrain.training.finish import WRITTEN, save_split_weights
from scaletrain.training.finish import finish_run as _finish
from scaletrain.training.progress import (
    RunProgress,
    Startup,
    Window,
    log_window,
)
from scaletrain.training.step import StepResult, forward, train_step


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


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
    hang.arm(run_dir / "logs", rank=penv.rank)  # where a hang report's flight record goes
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
    oom = OomSnapshot.arm(config.log.oom_snapshot, device=device, run_dir=run_dir, rank=penv.rank)
    with oom:
        parts = build(
            config, derived, penv, device=device, run_dir=run_dir, code=code, startup=startup
        )
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
        trackers=config.log.trackers,
        params=flatten_config(config.model_dump(mode="json")),
        eval_every=config.train.eval_every,
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
    profiler = step_profiler(
        config.log.profile_steps,
        run_dir=run_dir,
        rank=penv.rank,
        device=device,
        total_steps=config.train.steps,
        report=logger.message,
    )
    try:
        with oom:
            summary = _loop(
                config, derived, penv, parts, logger=logger, run_dir=run_dir, profiler=profiler
            )
        return None if summary is None else {**summary, "run_dir": str(run_dir)}
    finally:
        profiler.close()  # the run stopped inside log.profile_steps: keep what it recorded
        parts.checkpointer.close()
        logger.close()


def _rebuild_buckets(parts: Parts) -> None:
    """A resumed PowerSGD run needs DDP's rebuilt buckets before its first step: the hook
    state it restored is keyed by them (parallel/comm_hooks.py, `rebuild_buckets`)."""
    state = parts.state
    # One example is enough: the bucket order follows the graph, not the values.
    batch = parts.train_ds.get(parts.sampler.micro_batches(state.step)[0][:1]).to(parts.device)

    def forward_backward() -> None:
        with state.precision.forward_context():
            loss, _ = parts.loss_fn(forward(state.model, batch, state.precision), batch)
        with attention_context(state.precision.attention):  # checkpointing recomputes in it
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
    profiler: StepProfiler,
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
        # log.profile_steps: steps count from 1 (a no-op context outside the range)
        with (
            collective_guard("gradient all-reduce (DDP backward)", step=step),
            profiler.step(step + 1),
        ):
            result = train_step(
                state.model,
                micro,
                optimizer=state.optimizer,
                scheduler=state.scheduler,
                precision=state.precision,
                grad_clip=config.optim.grad_clip,
                dp_size=parts.dp_size,
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
        if parts.diloco is not None:  # DiLoCo: every sync_every steps the islands meet
            with collective_guard("DiLoCo exchange between islands", step=step):
                parts.diloco.step(result.count, last=step + 1 == t.steps)
        state.step = step + 1
        hang.beat()  # the launcher's sign of progress (launch/hang.py: no step for timeout_s)
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
            island_count=parts.island_count,
        )
        if _checkpoint_or_stop(state, parts, logger=logger, config=config, run_dir=run_dir):
            return None
        if t.eval_every and state.step % t.eval_every == 0 and state.step < t.steps:
            before = run.eval_s
            record = _evaluate(parts, config, penv, derived, logger=logger)
            logger.message(
                f"scaletrain: eval at step {state.step}: "
                + ", ".join(f"{k} {v:.4g}" for k, v in record.items())
            )
            run.window.start += run.eval_s - before  # throughput is training only
    train_s = time.perf_counter() - run.started - run.eval_s
    eval_record = _evaluate(parts, config, penv, derived, logger=logger)
    # Every rank takes part. A split model (under [distill] the student): each rank writes
    # its shards, rank 0 joins them (no rank holds the whole model).
    if parts.layout.splits_gradients:
        save_split_weights(state.model, run_dir=run_dir)
        weights = WRITTEN
    else:  # DDP or one process: rank 0's module is the whole model, saved as it is
        weights = None
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
        logger=logger,
    )


def _evaluate(
    parts: Parts, config: Config, penv: ProcessEnv, derived: Derived, *, logger: MetricsLogger
) -> dict:
    """Evaluate at the current step (every rank), log the record, add its seconds to the
    run's evaluation time (RunProgress.eval_s); return the metrics."""
    state, started = parts.state, time.perf_counter()
    with collective_guard("evaluation all-reduce", step=state.step):
        record = evaluate(
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
    seconds = time.perf_counter() - started
    logger.log_eval({"step": state.step, **record}, seconds=seconds)  # the bar's time left
    state.loop.eval_s += seconds
    return record


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
