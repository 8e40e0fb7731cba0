"""The run's feedback on rank 0: a progress bar, a JSON-lines file and, optionally, TensorBoard.

Design:

* One object, ``MetricsLogger``, owns the three sinks so the trainer makes one call per
  logged step. Ranks other than 0 build it with ``enabled=False``: every method is then a
  no-op and no file is opened, so the training loop needs no ``if rank == 0`` around it.
* ``metrics.jsonl`` is the record of truth; the PNG report (``records/report.py``) and any external
  tool read it back with ``read_metrics``. Each line is one JSON object with a ``"kind"``
  field (``"train"`` or ``"eval"``) and at least a ``"step"``. Every line is flushed as it is
  written, so a crashed or killed run keeps everything logged up to the crash.
* Strict JSON has no NaN or infinity. A non-finite number (a diverged loss, an fp16 grad
  norm of inf) is written as ``null``; the line stays valid for any JSON parser, and a reader
  treats ``null`` as "no finite value". TensorBoard receives the raw value, NaN included.
* On resume (``start_step > 0``) the file is appended to, so steps re-run after the last
  checkpoint appear twice; readers that need one value per step keep the later line (the
  report does). TensorBoard gets ``purge_step=start_step`` so it hides the stale events.
* The progress bar moves one step per train step: ``log_step`` for a logged step, and
  ``advance`` for the steps in between. It starts at ``start_step``. TensorBoard is imported
  only when asked for, since it is an optional dependency and slow to import.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Writes step and eval records to ``run_dir/metrics.jsonl``, a tqdm bar and TensorBoard.

    Args:
        run_dir: the run's directory; created if missing.
        total_steps: the number of train steps the run will take (the bar's total).
        enabled: False on ranks other than 0: every method does nothing.
        quiet: no progress bar and no messages (the JSONL file is still written).
        tensorboard: also write scalars to ``run_dir/"tensorboard"``.
        start_step: the step the run resumes from; the bar starts there.
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
    ) -> None:
        self.enabled = enabled
        self.quiet = quiet
        self._file = None
        self._writer = None
        self._bar = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / METRICS_FILE
        partial = _ends_mid_line(path)
        self._file = path.open("a", encoding="utf-8")
        if partial:  # a run killed mid-write left a partial line; start ours on a fresh one
            self._file.write("\n")
        if tensorboard:
            self._writer = _summary_writer(run_dir / "tensorboard", start_step=start_step)
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5,
            disable=quiet,
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
        self._bar.update(1)

    def log_eval(self, record: dict[str, float | int]) -> None:
        """Record one evaluation (``"kind": "eval"``); the progress bar does not move.

        Args:
            record: the evaluation's numbers; must hold ``"step"`` (the train step it follows).
        """
        if not self.enabled:
            return
        self._write(record, kind="eval")

    def advance(self, steps: int = 1) -> None:
        """Move the progress bar over train steps that were not logged.

        Args:
            steps: how many steps to move.
        """
        if self.enabled:
            self._bar.update(steps)

    def message(self, text: str) -> None:
        """Print a line above the progress bar, unless quiet.

        Args:
            text: the line to print.
        """
        if self.enabled and not self.quiet:
            tqdm.write(text)

    def close(self) -> None:
        """Close the bar, the file and the TensorBoard writer. Safe to call twice."""
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
        self._bar = self._file = self._writer = None
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
        if self._writer is not None:
            step = int(values["step"])
            for key, value in values.items():
                if key != "step" and _is_number(value):
                    self._writer.add_scalar(f"{kind}/{key}", value, global_step=step)


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


def _summary_writer(log_dir: Path, *, start_step: int) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # tensorboard is an optional extra
        raise ImportError(
            "TensorBoard logging was asked for but the 'tensorboard' package is missing: "
            "install scaletrain[tensorboard] or turn TensorBoard off in the config"
        ) from e
    return SummaryWriter(log_dir=str(log_dir), purge_step=start_step or None)


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
