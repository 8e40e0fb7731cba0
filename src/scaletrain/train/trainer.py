"""The trainer: build every piece from the config, run the loop, write the run directory.

This is the only place below the CLI that reads the config; every technique underneath
receives explicit arguments. Flow per run:

    resolve config -> threads, process group, seeds -> data (train/eval) -> model ->
    precision cast -> parallelize (DDP) -> optimizer, schedule -> loop:
        sampler gives this rank's micro-batches -> train_step -> bad-step check ->
        metrics every log.every (one all-reduce) -> eval every train.eval_every
    -> final eval -> model.safetensors, summary.json (rank 0)
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from scaletrain.checkpoint import Checkpointer, TrainState, latest_valid
from scaletrain.checkpoint import load as load_checkpoint
from scaletrain.config import Config, Derived, config_to_toml, resolve
from scaletrain.data.sampler import GlobalBatchSampler, eval_indices
from scaletrain.data.loader import Dataset, load_dataset
from scaletrain.data.sources import Batch
from scaletrain.metrics import MetricsLogger
from scaletrain.models import build_model
from scaletrain.parallel.compose import parallelize, unwrap
from scaletrain.precision import Precision, make_precision
from scaletrain.rundir import default_run_dir, write_config
from scaletrain.runtime import (ProcessEnv, all_reduce_sum, broadcast_object, collective_guard,
                                init_distributed, read_env, seed_everything, set_threads)
from scaletrain.train.optim import build_optimizer, build_scheduler
from scaletrain.train.step import StepResult, summed_loss, train_step


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


@dataclass
class Window:
    """Accumulates steps between two metrics records."""

    loss_sum: float = 0.0
    count: int = 0
    steps: int = 0
    start: float = field(default_factory=time.perf_counter)


@dataclass
class Parts:
    """Everything `train` builds from the config, handed to the loop."""

    state: TrainState  # model, optimizer, scheduler, precision, step: what a checkpoint holds
    sampler: GlobalBatchSampler
    train_ds: Dataset
    eval_ds: Dataset
    device: torch.device
    comm: "CommCounter"
    checkpointer: Checkpointer


def train(config: Config, *, run_dir: Path | None) -> dict | None:
    """Train as this process's rank; return the summary on rank 0 (None elsewhere).

    Resumes from the newest valid checkpoint in RUN_DIR/checkpoints when there is one (an
    elastic restart, or `--resume`), on any world size.

    Args:
        config: the validated config.
        run_dir: the run directory; None picks runs/<name>-<time> on rank 0 (plain torchrun).
    """
    penv = read_env()
    derived = resolve(config, world_size=penv.world_size, nproc_per_node=penv.local_world_size)
    set_threads(derived.threads)
    device = init_distributed(penv, backend=derived.backend, timeout_s=config.parallel.timeout_s)
    run_dir = Path(broadcast_object(str(run_dir or default_run_dir(config.name))))
    if penv.is_main:
        write_config(run_dir, config)
    seed_everything(config.train.seed)
    parts = build(config, derived, penv, device=device, run_dir=run_dir)
    resume_from = broadcast_object(_latest_checkpoint(run_dir, penv) if penv.is_main else None)
    if resume_from is not None:
        load_checkpoint(Path(resume_from), parts.state)
    logger = MetricsLogger(run_dir, total_steps=config.train.steps, enabled=penv.is_main,
                           quiet=config.log.quiet, tensorboard=config.log.tensorboard,
                           start_step=parts.state.step)
    if resume_from is not None:
        logger.message(f"scaletrain: resumed from {resume_from} at step {parts.state.step}")
    for warning in derived.warnings:
        logger.message(f"scaletrain: warning: {warning}")
    try:
        return _loop(config, derived, penv, parts, logger=logger, run_dir=run_dir)
    finally:
        parts.checkpointer.close()
        logger.close()


def build(config: Config, derived: Derived, penv: ProcessEnv, *, device: torch.device,
          run_dir: Path) -> Parts:
    """Data, model, precision, parallelism, optimizer, schedule, sampler: in that order."""
    d = config.data
    train_ds, eval_ds = (load_dataset(d.source, split=split, path=d.path, seq_len=d.seq_len,
                                      synthetic_examples=d.synthetic_examples,
                                      seed=config.train.seed,
                                      shuffle_window=d.shuffle_window if split == "train" else None)
                         for split in ("train", "eval"))
    precision = make_precision(config.precision.mode, device_type=device.type,
                               init_scale=config.precision.init_scale,
                               growth_interval=config.precision.growth_interval)
    model = build_model(config.model.name, size=config.model.size, task=train_ds.spec,
                        dropout=config.model.dropout)
    model = precision.convert_module(model)
    pc = config.parallel
    model, hook_state = parallelize(model, layout=derived.layout, device=device,
                                    bucket_cap_mb=pc.bucket_cap_mb,
                                    gradient_as_bucket_view=pc.gradient_as_bucket_view,
                                    comm_hook=pc.comm_hook, powersgd_rank=pc.powersgd_rank,
                                    powersgd_start_iter=pc.powersgd_start_iter)
    o = config.optim
    optimizer = build_optimizer(model, name=o.name, lr=o.lr, weight_decay=o.weight_decay,
                                betas=o.betas, momentum=o.momentum)
    scheduler = build_scheduler(optimizer, warmup_steps=o.warmup_steps,
                                total_steps=config.train.steps, schedule=o.schedule,
                                min_lr_ratio=o.min_lr_ratio)
    sampler = GlobalBatchSampler(len(train_ds), global_batch=config.train.global_batch,
                                 micro_batch=config.train.micro_batch, dp_rank=penv.rank,
                                 dp_size=derived.layout.dp, seed=config.train.seed,
                                 shard_rows=train_ds.shard_rows, shuffle_window=d.shuffle_window)
    c = config.checkpoint
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=c.keep, async_save=c.async_save,
                                config_toml=config_to_toml(config))
    return Parts(state=TrainState(model, optimizer, scheduler, precision), sampler=sampler,
                 train_ds=train_ds, eval_ds=eval_ds, device=device,
                 comm=CommCounter(model, hook_state, dp=derived.layout.dp),
                 checkpointer=checkpointer)


def _latest_checkpoint(run_dir: Path, penv: ProcessEnv) -> str | None:
    found = latest_valid(run_dir / "checkpoints", report=lambda m: print(m, file=sys.stderr))
    return str(found) if found else None


def _loop(config: Config, derived: Derived, penv: ProcessEnv, parts: Parts, *,
          logger: MetricsLogger, run_dir: Path) -> dict | None:
    t, state = config.train, parts.state
    bad_in_row, window, first_bad = 0, Window(), None
    last_loss, eval_record = math.nan, {}
    started, first_step = time.perf_counter(), state.step
    # Fixed-size examples (images, packed text) have the same count on every rank; padded
    # text does not, and then the step all-reduces the count before its first forward.
    ragged = parts.train_ds.spec.ragged
    micro, indices = [], parts.sampler.micro_batches(state.step)
    for step in range(state.step, t.steps):
        micro = [parts.train_ds.get(idx).to(parts.device, non_blocking=True) for idx in indices]
        if step + 1 < t.steps:  # read the next step's rows in the background
            indices = parts.sampler.micro_batches(step + 1)
            parts.train_ds.prefetch(torch.cat(indices))
        with collective_guard("gradient all-reduce (DDP backward)", step=step):
            result = train_step(state.model, micro, optimizer=state.optimizer,
                                scheduler=state.scheduler, precision=state.precision,
                                grad_clip=config.optim.grad_clip, dp_size=derived.layout.dp,
                                ragged_counts=ragged)
        state.step = step + 1
        bad_in_row = 0 if result.stepped else bad_in_row + 1
        state.skipped_steps += not result.stepped
        # fp16 overflows are the loss scaler's business; only persistent trouble stops the run.
        first_bad = result.first_nonfinite if bad_in_row == 1 else first_bad
        if bad_in_row >= t.max_bad_steps:
            raise TrainingDiverged(_diverged_message(step, bad_in_row, last_loss, config,
                                                     first_bad, state.precision))
        window.loss_sum += float(result.loss_sum)
        window.count += result.count
        window.steps += 1
        if state.step % config.log.every == 0 or state.step == t.steps:
            with collective_guard("metrics all-reduce", step=step):
                record = _train_record(step, result, window, micro, state.optimizer,
                                       state.precision, skipped=state.skipped_steps,
                                       dp=derived.layout.dp)
            record["comm_bytes_per_step"] = parts.comm.per_step(window.steps)
            last_loss = record["loss"]
            logger.log_step(record)
            window = Window()
        else:
            logger.advance()
        stop_now = state.step == t.stop_after
        if (config.checkpoint.every and state.step % config.checkpoint.every == 0) or stop_now:
            with collective_guard("checkpoint save", step=step):
                parts.checkpointer.save(state)
        if stop_now:  # a planned stop (e.g. a job time limit): resume with --resume
            parts.checkpointer.wait()
            logger.message(f"scaletrain: stopped after step {state.step} (train.stop_after); "
                           f"continue with: scaletrain train ... --run-dir {run_dir} --resume")
            return None
        if t.eval_every and state.step % t.eval_every == 0 and state.step < t.steps:
            eval_started = time.perf_counter()
            with collective_guard("evaluation all-reduce", step=step):
                logger.log_eval({"step": state.step, **evaluate(
                    state.model, parts.eval_ds, config, penv, derived,
                    precision=state.precision, device=parts.device)})
            window.start += time.perf_counter() - eval_started  # throughput is training only
    wall = time.perf_counter() - started
    with collective_guard("evaluation all-reduce", step=t.steps):
        eval_record = evaluate(state.model, parts.eval_ds, config, penv, derived,
                               precision=state.precision, device=parts.device)
    logger.log_eval({"step": t.steps, **eval_record})
    if not penv.is_main:
        return None
    return _finish(run_dir, model=state.model, config=config, derived=derived, wall=wall,
                   last_loss=last_loss, eval_record=eval_record, skipped=state.skipped_steps,
                   steps_run=t.steps - first_step, precision_mode=state.precision.mode,
                   tokens_per_example=parts.train_ds.spec.input_shape[0]
                   if parts.train_ds.spec.kind == "lm" else 0)


def _train_record(step: int, result: StepResult, window: Window, micro: list[Batch], optimizer,
                  precision: Precision, *, skipped: int, dp: int) -> dict:
    # One all-reduce per record: the window's summed loss over every rank. Counts are global.
    loss_sum = all_reduce_sum(torch.tensor([window.loss_sum], dtype=torch.float64))
    elapsed = time.perf_counter() - window.start
    examples = sum(len(mb.targets) for mb in micro) * dp * window.steps
    tokens = sum(mb.tokens for mb in micro) * dp * window.steps
    record = {
        "step": step + 1,
        "loss": float(loss_sum.item()) / max(window.count, 1),
        "lr": optimizer.param_groups[0]["lr"],
        "grad_norm": result.grad_norm,
        "examples": examples,
        "tokens": tokens,
        "examples_per_s": examples / elapsed,
        "tokens_per_s": tokens / elapsed,
        "step_time_s": elapsed / window.steps,
        "peak_mem_bytes": peak_memory_bytes(),
        "skipped_steps": skipped,
    }
    if precision.loss_scale is not None:
        record["loss_scale"] = precision.loss_scale
    return record


def peak_memory_bytes() -> int:
    """Peak memory of this process: CUDA allocator peak on GPU, else peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@torch.no_grad()
def evaluate(model: torch.nn.Module, eval_ds: Dataset, config: Config, penv: ProcessEnv,
             derived: Derived, *, precision: Precision, device: torch.device) -> dict:
    """Held-out loss (and accuracy, or perplexity for text), each rank a strided share."""
    net = unwrap(model)
    net.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for idx in eval_indices(len(eval_ds), limit=config.train.eval_examples, dp_rank=penv.rank,
                            dp_size=derived.layout.dp, batch=config.train.micro_batch):
        batch = eval_ds.get(idx).to(device, non_blocking=True)
        with precision.forward_context():
            logits = net(precision.convert_input(batch.inputs))
        totals[0] += float(summed_loss(logits, batch.targets))
        totals[1] += float((logits.argmax(-1) == batch.targets).sum())
        totals[2] += batch.count
    net.train()
    all_reduce_sum(totals)
    loss = float(totals[0] / totals[2])
    if eval_ds.spec.kind == "lm":
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
    return {"loss": loss, "accuracy": float(totals[1] / totals[2])}


def _diverged_message(step: int, bad: int, last_loss: float, config: Config,
                      first_bad: str | None, precision: Precision) -> str:
    where = f"; the first gradient to overflow was {first_bad!r}" if first_bad else ""
    scale = (f" (loss scale now {precision.loss_scale:g})" if precision.loss_scale is not None
             else "")
    return (
        f"training stopped at step {step + 1}: the loss or gradients were non-finite for {bad} "
        f"consecutive steps (train.max_bad_steps = {config.train.max_bad_steps}){where}{scale}; "
        f"last logged loss {last_loss:.4g}. Try a lower optim.lr (now {config.optim.lr}), "
        f"gradient clipping (optim.grad_clip), or precision.mode='fp32'/'bf16-mixed'."
    )


class CommCounter:
    """Bytes each rank hands to the gradient all-reduce per step.

    With a comm hook, the hook counts the tensors it sends; without one, DDP all-reduces
    every gradient once per step in its own dtype, which is the parameters' size.
    """

    def __init__(self, model: torch.nn.Module, hook_state, *, dp: int) -> None:
        self.hook_state = hook_state
        self.plain = 0 if dp == 1 else sum(p.numel() * p.element_size()
                                           for p in model.parameters() if p.requires_grad)
        self.seen = 0

    def per_step(self, steps: int) -> float:
        if self.hook_state is None:
            return float(self.plain)
        sent, self.seen = self.hook_state.bytes_sent - self.seen, self.hook_state.bytes_sent
        return sent / max(steps, 1)


def _finish(run_dir: Path, *, model, config: Config, derived: Derived, wall: float,
            last_loss: float, eval_record: dict, skipped: int, steps_run: int,
            tokens_per_example: int, precision_mode: str) -> dict:
    """Rank 0 writes the final weights (plain names, no DDP prefix) and the summary."""
    state = {k: v.detach().to("cpu", torch.float32).contiguous()
             for k, v in unwrap(model).state_dict().items()}
    save_file(state, str(run_dir / "model.safetensors"),
              metadata={"model": config.model.name, "size": config.model.size})
    examples = steps_run * config.train.global_batch  # this process's share of the run
    summary = {
        "final_loss": last_loss,  # mean training loss of the last log.every-step window
        "eval": eval_record,
        "wall_time_s": wall,
        "steps": config.train.steps,
        "skipped_steps": skipped,
        "world_size": derived.world_size,
        "examples_per_s": examples / wall,
        "tokens_per_s": examples * tokens_per_example / wall,
        "precision": precision_mode,  # what ran ("auto" resolved)
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
