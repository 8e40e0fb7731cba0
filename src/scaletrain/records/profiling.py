"""Why a step is slow, why memory grew: a profiler trace of chosen steps, and a GPU memory
snapshot when a rank runs out of GPU memory.

- `StepProfiler` (log.profile_steps = [a, b], train steps counted from 1 as train.steps and
  train.stop_after count them): torch.profiler records train steps a..b on every rank (CPU
  activity, CUDA's too where there is a GPU; shapes, memory, Python stacks). Each step runs
  inside `record_function("train_step N")`, so the trace names the step its events belong
  to. The trace goes to RUN_DIR/profile/rank-N/ as Chrome/Perfetto JSON through
  `tensorboard_trace_handler`, the layout TensorBoard's profiler plugin reads
  (`tensorboard --logdir RUN_DIR/profile`); on CUDA the memory timeline
  (`export_memory_timeline`) goes beside it. Off, the loop's hook is a shared no-op context:
  no profiler object, no `record_function`.
- `OomSnapshot` (log.oom_snapshot, CUDA only): the caching allocator records its history
  from before the model is built (`torch.cuda.memory._record_memory_history`, bounded by
  OOM_HISTORY_ENTRIES); a `torch.OutOfMemoryError` leaving a guarded block writes the
  snapshot (`_dump_snapshot`) to RUN_DIR/memory/rank-N-oom.pickle, for
  https://pytorch.org/memory_viz, and the error goes on. On CPU it does nothing. The
  snapshot is torch's pickle: written here, never read by scaletrain.

The profiler starts at the beginning of step a, so the first profiled step carries the
profiler's own start-up; profile from the second step or later to see steady state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

PROFILE_DIR = "profile"  # RUN_DIR/profile/rank-N/
MEMORY_DIR = "memory"  # RUN_DIR/memory/rank-N-oom.pickle
OOM_HISTORY_ENTRIES = 100_000  # allocator events kept (a ring): the last ones before an OOM

_NOTHING = contextlib.nullcontext()


class StepProfiler:
    """A torch.profiler trace of train steps first..last (1-based) on this rank.

    Args:
        steps: [first, last], the train steps to record (log.profile_steps); [] = none.
        out_dir: this rank's directory for the trace (RUN_DIR/profile/rank-N).
        rank: this process's global rank (names the trace file).
        device: the device the step runs on (CUDA adds GPU activity and the memory timeline).
        report: called with one line once the trace is written (rank 0's message).
    """

    def __init__(
        self,
        steps: Sequence[int],
        *,
        out_dir: Path,
        rank: int,
        device: torch.device,
        report: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.out_dir, self.rank, self.device, self.report = Path(out_dir), rank, device, report
        self._prof: torch.profiler.profile | None = None

    def step(self, number: int) -> contextlib.AbstractContextManager[Any]:
        """The context train step `number` (1-based) runs in: recorded, or a no-op."""
        if self._prof is None and not self.first <= number <= self.last:
            return _NOTHING
        return self._recorded(number)

    @contextlib.contextmanager
    def _recorded(self, number: int) -> Iterator[None]:
        if self._prof is None:  # step `first`, or the first step after a resume inside the range
            self._prof = self._start()
        try:
            with torch.profiler.record_function(f"train_step {number}"):
                yield
        except BaseException:
            with contextlib.suppress(Exception):  # the step's error is the one to report
                self.close()  # a step that failed is kept too: its trace may say why
            raise
        if number >= self.last:
            self.close()

    def _start(self) -> torch.profiler.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=activities,
            record_shapes=True,
            profile_memory=True,
            with_stack=True,  # the memory timeline needs it; TensorBoard shows the call stacks
        )
        prof.start()
        return prof

    def close(self) -> None:
        """Stop and write the trace if one is being recorded (the run ended inside the
        range: train.stop_after, a SIGTERM, a failure). Safe to call twice."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.profiler.tensorboard_trace_handler(
            str(self.out_dir), worker_name=f"rank-{self.rank}"
        )(prof)
        if self.device.type == "cuda":
            timeline = self.out_dir / f"rank-{self.rank}.memory-timeline.html"
            try:
                prof.export_memory_timeline(str(timeline), device=str(self.device))
            except Exception as e:  # the trace is written; a plot must not end the run
                print(
                    f"scaletrain: warning: rank {self.rank}: the memory timeline could not be "
                    f"written ({type(e).__name__}: {e})",
                    flush=True,
                )
        self.report(
            f"scaletrain: profile of train steps {self.first}-{self.last} written to "
            f"{self.out_dir.parent} (tensorboard --logdir {self.out_dir.parent}, or open a "
            "*.pt.trace.json in https://ui.perfetto.dev)"
        )


def step_profiler(
    steps: Sequence[int],
    *,
    run_dir: Path,
    rank: int,
    device: torch.device,
    total_steps: int,
    report: Callable[[str], None] = lambda line: None,
) -> StepProfiler:
    """The profiler for log.profile_steps (a no-op one for []); says when the range starts
    after the run's last step, where nothing would be recorded.

    Args:
        steps: log.profile_steps.
        run_dir: the run directory (the trace goes to RUN_DIR/profile/rank-N).
        rank: this process's global rank.
        device: the device the steps run on.
        total_steps: train.steps.
        report: prints one line (rank 0's logger).
    """
    if steps and steps[0] > total_steps:
        report(
            f"scaletrain: warning: log.profile_steps = {list(steps)} starts after the last "
            f"step (train.steps = {total_steps}): nothing is profiled"
        )
    return StepProfiler(
        steps,
        out_dir=Path(run_dir) / PROFILE_DIR / f"rank-{rank}",
        rank=rank,
        device=device,
        report=report,
    )


class OomSnapshot:
    """Guards blocks of a run: a CUDA out-of-memory error leaving one writes the allocator's
    snapshot (history recorded since `arm`) to `path` before it goes on. Reusable; inert when
    `path` is None (off, or not on CUDA)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    @classmethod
    def arm(cls, enabled: bool, *, device: torch.device, run_dir: Path, rank: int) -> OomSnapshot:
        """Start recording the allocator's history where it applies (enabled, on CUDA).

        Args:
            enabled: log.oom_snapshot.
            device: this rank's device; anything but CUDA gives an inert guard.
            run_dir: the run directory (the snapshot goes to RUN_DIR/memory/rank-N-oom.pickle).
            rank: this process's global rank.
        """
        if not enabled or device.type != "cuda":
            return cls(None)
        # Python stacks only: C++ unwinding on every allocation is what makes it costly.
        torch.cuda.memory._record_memory_history(max_entries=OOM_HISTORY_ENTRIES, stacks="python")
        return cls(Path(run_dir) / MEMORY_DIR / f"rank-{rank}-oom.pickle")

    def __enter__(self) -> OomSnapshot:
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if self.path is not None and isinstance(error, torch.OutOfMemoryError):
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                torch.cuda.memory._dump_snapshot(str(self.path))
                print(
                    f"scaletrain: out of GPU memory: the allocator's snapshot is in "
                    f"{self.path} (drag it into https://pytorch.org/memory_viz)",
                    flush=True,
                )
            except Exception as e:  # the OOM is the error to report, not this
                print(f"scaletrain: warning: no memory snapshot written: {e}", flush=True)
        return False  # the error goes on
