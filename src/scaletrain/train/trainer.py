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
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from scaletrain.config import Config, Derived, resolve
from scaletrain.data.sampler import GlobalBatchSampler, eval_indices
from scaletrain.data.sources import ArrayDataset, Batch, load_source
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


def train(config: Config, *, run_dir: Path | None) -> dict | None:
    """Train as this process's rank; return the summary on rank 0 (None elsewhere).

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

    train_ds, eval_ds = (load_source(config.data.source, split=split, seq_len=config.data.seq_len,
                                     synthetic_examples=config.data.synthetic_examples,
                                     seed=config.train.seed) for split in ("train", "eval"))
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
                                 dp_size=derived.layout.dp, seed=config.train.seed)
    logger = MetricsLogger(run_dir, total_steps=config.train.steps, enabled=penv.is_main,
                           quiet=config.log.quiet, tensorboard=config.log.tensorboard)
    for warning in derived.warnings:
        logger.message(f"scaletrain: warning: {warning}")
    comm = CommCounter(model, hook_state, dp=derived.layout.dp)
    try:
        return _loop(config, derived, penv, model=model, optimizer=optimizer, scheduler=scheduler,
                     precision=precision, sampler=sampler, train_ds=train_ds, eval_ds=eval_ds,
                     device=device, logger=logger, run_dir=run_dir, comm=comm)
    finally:
        logger.close()


def _loop(config: Config, derived: Derived, penv: ProcessEnv, *, model, optimizer, scheduler,
          precision: Precision, sampler: GlobalBatchSampler, train_ds: ArrayDataset,
          eval_ds: ArrayDataset, device: torch.device, logger: MetricsLogger,
          run_dir: Path, comm: "CommCounter") -> dict | None:
    t = config.train
    bad_in_row, skipped, window, first_bad = 0, 0, Window(), None
    last_loss, eval_record = math.nan, {}
    started = time.perf_counter()
    # Fixed-size examples (images, packed text) have the same count on every rank; padded
    # text does not, and then the step all-reduces the count before its first forward.
    ragged = train_ds.spec.ragged
    for step in range(t.steps):
        micro = [_to(train_ds.get(idx), device) for idx in sampler.micro_batches(step)]
        with collective_guard("gradient all-reduce (DDP backward)", step=step):
            result = train_step(model, micro, optimizer=optimizer, scheduler=scheduler,
                                precision=precision, grad_clip=config.optim.grad_clip,
                                dp_size=derived.layout.dp, ragged_counts=ragged)
        bad_in_row = 0 if result.stepped else bad_in_row + 1
        skipped += not result.stepped
        # fp16 overflows are the loss scaler's business; only persistent trouble stops the run.
        first_bad = result.first_nonfinite if bad_in_row == 1 else first_bad
        if bad_in_row >= t.max_bad_steps:
            raise TrainingDiverged(_diverged_message(step, bad_in_row, last_loss, config,
                                                     first_bad, precision))
        window.loss_sum += float(result.loss_sum)
        window.count += result.count
        window.steps += 1
        if (step + 1) % config.log.every == 0 or step + 1 == t.steps:
            with collective_guard("metrics all-reduce", step=step):
                record = _train_record(step, result, window, micro, optimizer, precision,
                                       skipped=skipped, dp=derived.layout.dp)
            record["comm_bytes_per_step"] = comm.per_step(window.steps)
            last_loss = record["loss"]
            logger.log_step(record)
            window = Window()
        else:
            logger.advance()
        if t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps:
            with collective_guard("evaluation all-reduce", step=step):
                logger.log_eval({"step": step + 1, **evaluate(model, eval_ds, config, penv, derived,
                                                               precision=precision, device=device)})
    wall = time.perf_counter() - started
    with collective_guard("evaluation all-reduce", step=t.steps):
        eval_record = evaluate(model, eval_ds, config, penv, derived, precision=precision,
                               device=device)
    logger.log_eval({"step": t.steps, **eval_record})
    if not penv.is_main:
        return None
    return _finish(run_dir, model=model, config=config, derived=derived, wall=wall,
                   last_loss=last_loss, eval_record=eval_record, skipped=skipped,
                   tokens_per_example=micro[0].tokens // max(1, len(micro[0].targets)))


def _to(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch
    return Batch(inputs=batch.inputs.to(device, non_blocking=True),
                 targets=batch.targets.to(device, non_blocking=True),
                 count=batch.count, tokens=batch.tokens)


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
def evaluate(model: torch.nn.Module, eval_ds: ArrayDataset, config: Config, penv: ProcessEnv,
             derived: Derived, *, precision: Precision, device: torch.device) -> dict:
    """Held-out loss (and accuracy, or perplexity for text), each rank a strided share."""
    net = unwrap(model)
    net.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for idx in eval_indices(len(eval_ds), limit=config.train.eval_examples, dp_rank=penv.rank,
                            dp_size=derived.layout.dp, batch=config.train.micro_batch):
        batch = _to(eval_ds.get(idx), device)
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
            last_loss: float, eval_record: dict, skipped: int, tokens_per_example: int) -> dict:
    """Rank 0 writes the final weights (plain names, no DDP prefix) and the summary."""
    state = {k: v.detach().to("cpu", torch.float32).contiguous()
             for k, v in unwrap(model).state_dict().items()}
    save_file(state, str(run_dir / "model.safetensors"),
              metadata={"model": config.model.name, "size": config.model.size})
    examples = config.train.steps * config.train.global_batch
    summary = {
        "final_loss": last_loss,
        "eval": eval_record,
        "wall_time_s": wall,
        "steps": config.train.steps,
        "skipped_steps": skipped,
        "world_size": derived.world_size,
        "examples_per_s": examples / wall,
        "tokens_per_s": examples * tokens_per_example / wall,
        "precision": config.precision.mode,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
