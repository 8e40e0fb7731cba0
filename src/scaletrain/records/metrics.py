"""The run's feedback on rank 0: a progress bar, a JSON-lines file and the experiment trackers.

Design:

* One object, ``MetricsLogger``, owns the sinks so the trainer makes one call per logged
  step. Ranks other than 0 build it with ``enabled=False``: every method is then a no-op and
  no file is opened, so the training loop needs no ``if rank == 0`` around it.
* ``metrics.jsonl`` is the record of truth; the PNG report (``records/report.py``) and any external
  tool read it back with ``read_metrics``. Each line is one JSON object with a ``"kind"``
  field (``"train"`` or ``"eval"``) and at least a ``"step"``. Every line is flushed as it is
  written, so a crashed or killed run keeps everything logged up to the crash.
* Strict JSON has no NaN or infinity. A non-finite number (a diverged loss, an fp16 grad
  norm of inf) is written as ``null``; the line stays valid for any JSON parser, and a reader
  treats ``null`` as "no finite value". The trackers receive the raw value, NaN included.
* The trackers (TensorBoard, MLflow, W&B, CSV: records/trackers.py) get every record
  metrics.jsonl gets, at the same step, and the run's files at the end (`complete`).
* On resume (``start_step > 0``) the file is appended to, so steps re-run after the last
  checkpoint appear twice; readers that need one value per step keep the later line (the
  report does).
* The progress bar moves one step per train step: ``log_step`` for a logged step, and
  ``advance`` for the steps in between. It starts at ``start_step``. Its time left is
  `RunEta`'s, which counts the evaluations still to come: tqdm's own estimate divides the
  steps left by a rate that an evaluation slows, then speeds up again.
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from scaletrain.records.trackers import Tracker, open_trackers, tracker_names

METRICS_FILE = "metrics.jsonl"
# tqdm's own layout with our time left (`RunEta`) where its {remaining} was.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{run_eta}, {rate_fmt}{postfix}]"


class MetricsLogger:
    """Writes step and eval records to ``run_dir/metrics.jsonl``, a tqdm bar and the trackers.

    Args:
        run_dir: the run's directory; created if missing.
        total_steps: the number of train steps the run will take (the bar's total).
        enabled: False on ranks other than 0: every method does nothing.
        quiet: no progress bar and no messages (the JSONL file is still written).
        tensorboard: also write scalars to ``run_dir/"tensorboard"`` (log.tensorboard).
        start_step: the step the run resumes from; the bar starts there.
        trackers: log.trackers (records/trackers.py).
        params: the resolved config as dotted keys, for the trackers.
        eval_every: train.eval_every (0: only the final evaluation), for the time left.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        enabled: bool,
        quiet: bool,
        tensorboard: bool,
        start_step: int = 0,
        trackers: Sequence[str] = (),
        params: dict[str, Any] | None = None,
        eval_every: int = 0,
    ) -> None:
        self.enabled = enabled
        self.quiet = quiet
        self._file = None
        self._trackers: list[Tracker] = []
        self._bar = None
        self._completed = False
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / METRICS_FILE
        partial = _ends_mid_line(path)
        self._file = path.open("a", encoding="utf-8")
        if partial:  # a run killed mid-write left a partial line; start ours on a fresh one
            self._file.write("\n")
        try:
            self._trackers = open_trackers(
                tracker_names(trackers, tensorboard=tensorboard),
                run_dir,
                params=params or {},
                start_step=start_step,
            )
        except BaseException:  # the caller's `finally` has no logger to close yet
            self._file.close()
            raise
        if self._trackers and not quiet:  # where the trackers write, once
            print(
                "scaletrain: trackers: " + ", ".join(t.label for t in self._trackers),
                file=sys.stderr,
                flush=True,
            )
        self.eta = RunEta(total_steps=total_steps, step=start_step, eval_every=eval_every)
        self._bar = _Bar(
            self.eta,
            total=total_steps,
            initial=start_step,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5,
            disable=quiet,
            bar_format=BAR_FORMAT,
        )

    def log_step(self, record: dict[str, float | int]) -> None:
        """Record one train step and move the progress bar by one step.

        Args:
            record: the step's numbers; must hold ``"step"``. Typical fields: loss, lr,
                grad_norm, examples, tokens, examples_per_s, tokens_per_s, step_time_s,
                peak_mem_bytes, skipped_steps.
        """
        if not self.enabled:
            return
        self._write(record, kind="train")
        self._bar.set_postfix_str(_postfix(record), refresh=False)
        self.advance(1)

    def log_eval(self, record: dict[str, float | int], *, seconds: float | None = None) -> None:
        """Record one evaluation (``"kind": "eval"``); the progress bar does not move.

        Args:
            record: the evaluation's numbers; must hold ``"step"`` (the train step it follows).
            seconds: how long the evaluation held up training (for the time left); None
                when it did not (an evaluation beside training, as the servers' is).
        """
        if not self.enabled:
            return
        self._write(record, kind="eval")
        if seconds is not None:
            self.eta.evaluated(seconds)

    def advance(self, steps: int = 1) -> None:
        """Move the progress bar over train steps that were not logged.

        Args:
            steps: how many steps to move.
        """
        if self.enabled:
            self.eta.stepped(steps)
            self._bar.update(steps)

    def message(self, text: str) -> None:
        """Print a line above the progress bar, unless quiet.

        Args:
            text: the line to print.
        """
        if self.enabled and not self.quiet:
            tqdm.write(text)

    @property
    def takes_artifacts(self) -> bool:
        """Whether a tracker keeps files (MLflow, W&B): the report is then drawn for it."""
        return any(tracker.keeps_files for tracker in self._trackers)

    def complete(self, artifacts: Sequence[Path]) -> None:
        """The run has completed: hand its files (the report PNG, summary.json) to the
        trackers that keep files; `close` then ends the trackers' runs as finished.

        Args:
            artifacts: files that exist; a missing one is skipped.
        """
        if not self.enabled:
            return
        for path in map(Path, artifacts):
            if path.is_file():
                for tracker in self._trackers:
                    tracker.log_artifact(path)
        self._completed = True

    def close(self) -> None:
        """Close the bar, the file and the trackers. Safe to call twice."""
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        for tracker in self._trackers:
            tracker.close(completed=self._completed)
        self._bar = self._file = None
        self._trackers = []
        self.enabled = False

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, record: dict[str, Any], *, kind: str) -> None:
        if "step" not in record:
            raise ValueError(f"a {kind} metrics record needs a 'step' field; got {sorted(record)}")
        values = {k: _plain(v) for k, v in record.items() if k != "kind"}
        line = {"kind": kind, **{k: _json_safe(v) for k, v in values.items()}}
        self._file.write(json.dumps(line, allow_nan=False) + "\n")
        self._file.flush()
        for tracker in self._trackers:
            tracker.log(kind, values)


def eta_s(
    *, steps_left: int, step_time_s: float | None, evals_left: int, eval_time_s: float | None
) -> float | None:
    """The run's time left: steps left x the step time + evaluations left x the evaluation
    time. None while no step time is known; no evaluation time (none timed yet) counts 0."""
    if step_time_s is None:
        return None
    return steps_left * step_time_s + evals_left * (eval_time_s or 0.0)


def evals_left(step: int, *, total_steps: int, eval_every: int) -> int:
    """Evaluations still to come when the bar stands at `step`: one at each multiple of
    `eval_every` from `step` on (the trainer evaluates after the bar has moved to that step)
    before the last step, and the final one."""
    if eval_every <= 0:
        return 1
    mid = (total_steps - 1) // eval_every - (max(step, 1) - 1) // eval_every
    return max(mid, 0) + 1


class RunEta:
    """The progress bar's time left, from this process's own steps and evaluations.

    The step time is the mean wall time between bar updates, the evaluations' time taken
    out, over the steps since the first: the first step is warm-up (compilation, the
    allocator's first blocks) and its time is left out. Checkpoint saves recur, so they
    stay in. The evaluation time is the mean of the evaluations timed so far.

    Args:
        total_steps: train.steps.
        step: the step this process starts at.
        eval_every: train.eval_every (0: only the final evaluation).
        clock: seconds (time.perf_counter; a test passes its own).
    """

    def __init__(
        self,
        *,
        total_steps: int,
        step: int,
        eval_every: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total_steps, self.step, self.eval_every = total_steps, step, eval_every
        self._clock, self._last = clock, clock()
        self._first = True  # the next update holds the warm-up step
        self._train_s, self._steps = 0.0, 0
        self._eval_s, self._evals, self._eval_pending = 0.0, 0, 0.0

    def stepped(self, steps: int = 1) -> None:
        now = self._clock()
        elapsed = now - self._last - self._eval_pending
        self._last, self._eval_pending = now, 0.0
        self.step += steps
        if self._first:
            self._first = False
            return
        self._train_s += max(elapsed, 0.0)
        self._steps += steps

    def evaluated(self, seconds: float) -> None:
        self._eval_s += seconds
        self._evals += 1
        self._eval_pending += seconds

    def seconds_left(self) -> float | None:
        return eta_s(
            steps_left=max(self.total_steps - self.step, 0),
            step_time_s=self._train_s / self._steps if self._steps else None,
            evals_left=evals_left(
                self.step, total_steps=self.total_steps, eval_every=self.eval_every
            ),
            eval_time_s=self._eval_s / self._evals if self._evals else None,
        )


class _Bar(tqdm):
    """tqdm with `RunEta`'s time left as the bar format's {run_eta}."""

    def __init__(self, eta: RunEta, **kwargs: Any) -> None:
        self._eta = eta
        super().__init__(**kwargs)

    @property
    def format_dict(self) -> dict:
        left = self._eta.seconds_left()
        return {
            **super().format_dict,
            "run_eta": "?" if left is None else self.format_interval(left),
        }


def read_metrics(run_dir: Path) -> list[dict]:
    """Read ``run_dir/metrics.jsonl`` back, one dict per line, in file order.

    A line that is not valid JSON (a run killed mid-write) is skipped with a warning.
    Non-finite values come back as ``None``.

    Args:
        run_dir: the run's directory.
    """
    path = Path(run_dir) / METRICS_FILE
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                warnings.warn(
                    f"{path}:{lineno}: skipping a line that is not valid JSON", stacklevel=2
                )
    return records


def _ends_mid_line(path: Path) -> bool:
    if not path.exists() or path.stat().st_size == 0:
        return False
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def _plain(value: Any) -> Any:
    """A 0-d tensor or numpy scalar becomes a Python number; anything else is left alone."""
    return value.item() if hasattr(value, "item") and callable(value.item) else value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_safe(value: Any) -> Any:
    """NaN and +-inf become None (JSON null), so every line is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _postfix(record: dict[str, Any]) -> str:
    parts = []
    loss = _plain(record.get("loss"))
    if _is_number(loss):
        parts.append(f"loss={loss:.4g}")
    for key, label in (("examples_per_s", "ex/s"), ("tokens_per_s", "tok/s")):
        rate = _plain(record.get(key))
        if _is_number(rate) and rate > 0:
            parts.append(f"{label}={_si(rate)}")
    mfu, flops = _plain(record.get("mfu")), _plain(record.get("model_flops_per_s"))
    if _is_number(mfu):
        parts.append(f"MFU={mfu:.1%}")
    elif _is_number(flops) and flops > 0:  # no hardware profile: the achieved rate alone
        parts.append(f"FLOP/s={_si(flops)}")
    return " ".join(parts)


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"
