"""What the loop reports as it goes: start-up progress, the metrics window, the loop's state.

The trainer's loop asks this module *what to say*, never keeps the arithmetic itself:

- `Startup` prints, on rank 0, one line per phase before the first step (data, model,
  parallel layout, first step), each with the seconds since the process began: a run whose
  imports, data loading and model build take ten seconds says so instead of staying silent.
- `Window` accumulates the steps between two metrics records; `log_window` adds a step to
  it and, every `log.every` steps, turns it into one record (`train_record`: one all-reduce
  of the summed loss over every rank; counts are global by construction).
- `RunProgress` is the loop's state between steps (the bad-step streak, the last logged
  loss, the open window, the comm counter's position). It is a DCP Stateful in the
  checkpoint (`TrainState.loop`), so a resumed run stops, logs and reports as the
  uninterrupted one would.
- `CommCounter` counts the bytes each rank hands to DDP's gradient all-reduce, or to
  DiLoCo's exchange between islands.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from scaletrain.data.sources import Batch
from scaletrain.precision import Precision
from scaletrain.records.memory import WindowPeak, held_bytes, lifetime_peak_bytes
from scaletrain.records.metrics import MetricsLogger
from scaletrain.runtime import all_reduce_sum, collective_guard
from scaletrain.training.step import StepResult


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): what the user has
    waited, interpreter start and imports included."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22
    except (OSError, ValueError, IndexError):
        return None


class Startup:
    """Rank 0's start-up lines, `scaletrain: <phase> (<t> s)`, t the seconds since this
    process started (imports included: they are part of the wait).

    Args:
        enabled: rank 0 and not log.quiet.
    """

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.started = time.perf_counter() - (process_age_s() or 0.0)

    def say(self, what: str) -> None:
        if self.enabled:
            print(
                f"scaletrain: {what} ({time.perf_counter() - self.started:.1f} s)",
                file=sys.stderr,
                flush=True,
            )


@dataclass
class Window:
    """Accumulates steps between two metrics records."""

    loss_sum: float = 0.0
    count: int = 0
    terms: dict[str, float] = field(default_factory=dict)  # a loss's parts, summed like it
    steps: int = 0
    start: float = field(default_factory=time.perf_counter)


class CommCounter:
    """Bytes each rank hands to DDP's gradient all-reduce per step.

    With a comm hook, the hook counts the tensors it sends; without one, DDP all-reduces
    every gradient once per step in its own dtype, which is the parameters' size. Under
    DiLoCo (`sent_by`) the exchange between islands counts what it hands to its
    collectives, averaged over the window's steps. Other layouts (FSDP's gathers and
    reduce-scatters, TP's all-reduces, PP's sends) are not counted here: 0.
    """

    def __init__(self, model: torch.nn.Module, hook_state, *, ddp: bool, sent_by=None) -> None:
        self.hook_state = hook_state
        self.sent_by = sent_by  # DiLoCo: anything with a running `bytes_sent`
        self.plain = (
            0
            if not ddp
            else sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        )
        self.seen = 0

    def per_step(self, steps: int) -> float:
        source = self.hook_state if self.hook_state is not None else self.sent_by
        if source is None:
            return float(self.plain)
        sent, self.seen = source.bytes_sent - self.seen, source.bytes_sent
        return sent / max(steps, 1)


@dataclass(frozen=True)
class ModelFlops:
    """MFU's two numbers: the model FLOPs of one example's forward and backward
    (models/flops.py, the counter the planner uses; recomputation not counted) and the peak
    FLOP/s of every rank together, from the hardware profile (runtime/hardware.py; None where no
    profile is known: mfu is then logged as null)."""

    per_example: int | None  # None: the model could not be traced on meta (see model_flops)
    peak: float | None

    def record(self, examples_per_s: float) -> dict:
        if self.per_example is None:
            return {"model_flops_per_s": None, "mfu": None}
        achieved = self.per_example * examples_per_s
        return {"model_flops_per_s": achieved, "mfu": achieved / self.peak if self.peak else None}


def model_flops(model, example, *, precision, world_size: int, device_type: str) -> ModelFlops:
    """ModelFlops for `model` (whole, before any technique splits it; meta or real) on one
    `example` Batch, with the peak of `world_size` devices of this machine's profile."""
    from scaletrain.models.flops import train_flops
    from scaletrain.runtime.hardware import default_profile

    try:
        per_example = train_flops(model, example.inputs, **example.extras)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        # A forward that reads a value (a Hugging Face encoder's attention mask) cannot run
        # on meta: the run goes on and logs model_flops_per_s and mfu as null.
        per_example = None
    profile = default_profile(device_type)
    name = precision.flops_dtype  # the rate its matmuls run at (fp32 on TF32 where enabled)
    ranks = min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    peak = profile.peak(name, ranks_per_node=ranks) if profile is not None else None
    return ModelFlops(per_example=per_example, peak=peak * world_size if peak else None)


@dataclass
class RunProgress:
    """What the loop tracks between steps of this process's run.

    A DCP Stateful: a checkpoint holds the streak, the last logged loss, the open window
    (its elapsed time, not its clock) and the comm counter's position, so a resumed run
    stops, logs and reports as the uninterrupted one would. The trainer's `build` makes it
    (it is `TrainState.loop`), a checkpoint loads into it, and the loop runs on it.
    """

    first_step: int
    bad_in_row: int = 0  # consecutive skipped steps
    first_bad: str | None = None  # the first parameter to overflow in the current streak
    last_loss: float = math.nan
    window: Window = field(default_factory=Window)
    started: float = field(default_factory=time.perf_counter)
    eval_s: float = 0.0  # this process's mid-run evaluations (summary.json's eval_time_s)
    memory: WindowPeak | None = None  # each window's peak above the post-set-up baseline
    comm: CommCounter | None = None  # its bytes at the last record belong to the window
    flops: ModelFlops | None = None  # model FLOPs per example and the peak (MFU)

    def state_dict(self) -> dict:
        w = self.window
        return {
            "bad_in_row": self.bad_in_row,
            "first_bad": self.first_bad or "",
            "last_loss": self.last_loss,
            "window.loss_sum": w.loss_sum,
            "window.terms": json.dumps(w.terms),
            "window.count": w.count,
            "window.steps": w.steps,
            "window.elapsed_s": time.perf_counter() - w.start,
            "comm_seen": self.comm.seen if self.comm is not None else 0,
        }

    def load_state_dict(self, state: dict) -> None:
        self.bad_in_row, self.first_bad = int(state["bad_in_row"]), state["first_bad"] or None
        self.last_loss = float(state["last_loss"])
        self.window = Window(
            loss_sum=float(state["window.loss_sum"]),
            terms=json.loads(state.get("window.terms", "{}")),
            count=int(state["window.count"]),
            steps=int(state["window.steps"]),
            start=time.perf_counter() - float(state["window.elapsed_s"]),
        )
        if self.comm is not None:
            self.comm.seen = int(state["comm_seen"])


def log_window(
    state,
    result: StepResult,
    micro: list[Batch],
    run: RunProgress,
    *,
    reports_loss: bool,
    logger: MetricsLogger,
    every: int,
    total_steps: int,
    compiled: bool,
    dp: int,
    terms: dict[str, float] | None = None,
    island_count: bool | None = None,
) -> None:
    """Add the step to the window; every `every` steps (and at the last) write one record
    and start a new window.

    Args:
        state: the TrainState (step already advanced past this step).
        result, micro: this step's outcome and micro-batches.
        run: the loop's RunProgress (its window, memory peak, comm counter).
        reports_loss: this rank's summed loss counts (one rank per data-parallel share).
        logger: rank 0's sinks (a no-op elsewhere).
        every, total_steps: log.every and train.steps.
        compiled: train.compile (the record then says how many graphs dynamo captured).
        dp: the data-parallel degree (examples per record are global).
        terms: this step's summed parts of the loss on this rank (under [distill]: the
            hard loss and each distillation term), reduced and normalised like the loss.
        island_count: under DiLoCo a step's count is its island's: True on the one rank
            per island that adds it to the record's sum, False on the others; None: the
            count is global already.
    """
    window = run.window
    # Tensor-parallel peers hold the same loss and a pipeline's other stages none: one rank
    # per data-parallel share adds it, so the all-reduced sum counts every example once.
    window.loss_sum += float(result.loss_sum) if reports_loss else 0.0
    for name, value in (terms or {}).items():
        window.terms[name] = window.terms.get(name, 0.0) + (value if reports_loss else 0.0)
    window.count += result.count
    window.steps += 1
    if state.step % every and state.step != total_steps:
        logger.advance()
        return
    with collective_guard("metrics all-reduce", step=state.step - 1):
        record = train_record(
            state.step - 1,
            result,
            window,
            micro,
            state.optimizer,
            state.precision,
            skipped=state.skipped_steps,
            dp=dp,
            island_count=island_count,
        )
    record["comm_bytes_per_step"] = run.comm.per_step(window.steps) if run.comm else 0.0
    if run.flops is not None:
        record.update(run.flops.record(record["examples_per_s"]))
    record["examples_seen"], record["tokens_seen"] = state.examples_seen, state.tokens_seen
    record.update(run.memory.record() if run.memory else {})
    # What this rank holds, from its local tensors (a shard's bytes, not the global shape).
    record.update(held_bytes(state.model, state.optimizer), grad_bytes=result.grad_bytes)
    if compiled:  # proof that dynamo captured graphs (0: the model ran eager)
        from torch._dynamo.utils import counters

        record["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
    run.last_loss = record["loss"]
    logger.log_step(record)
    run.window = Window()


def train_record(
    step: int,
    result: StepResult,
    window: Window,
    micro: list[Batch],
    optimizer,
    precision: Precision,
    *,
    skipped: int,
    dp: int,
    island_count: bool | None = None,
) -> dict:
    """One metrics record for the window that ends at `step` (0-based); `island_count` as
    in `log_window`."""
    # One all-reduce per record: the window's summed loss (and its terms, under [distill])
    # over every rank. Counts are global, but for DiLoCo's islands' (one rank of each adds
    # its island's to the same sum).
    names = sorted(window.terms)
    counted = [float(window.count) if island_count else 0.0] if island_count is not None else []
    sums = all_reduce_sum(
        torch.tensor(
            [window.loss_sum, *(window.terms[n] for n in names), *counted], dtype=torch.float64
        )
    )
    loss_sum = sums[0]
    count = max(float(sums[-1]) if counted else window.count, 1)
    elapsed = time.perf_counter() - window.start
    examples = sum(len(mb.targets) for mb in micro) * dp * window.steps
    tokens = sum(mb.tokens for mb in micro) * dp * window.steps
    record = {
        "step": step + 1,
        "loss": float(loss_sum.item()) / count,
        "lr": optimizer.param_groups[0]["lr"],
        "grad_norm": result.grad_norm,
        "examples": examples,
        "tokens": tokens,
        "examples_per_s": examples / elapsed,
        "tokens_per_s": tokens / elapsed,
        "step_time_s": elapsed / window.steps,
        "peak_mem_bytes": lifetime_peak_bytes(),
        "skipped_steps": skipped,
    }
    record.update({n: float(sums[1 + i]) / count for i, n in enumerate(names)})
    if precision.loss_scale is not None:
        record["loss_scale"] = precision.loss_scale
    return record
