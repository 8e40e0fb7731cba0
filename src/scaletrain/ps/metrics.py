"""What server 0 records under the parameter-server strategy: metrics.jsonl windows,
evaluations on a background thread, the staleness and delay histograms of summary.json.

`ServerMetrics.update` runs under the server's lock (ps/server.py calls it for every
gradient applied) and only adds numbers; records go through a queue to a writer thread,
which also asks the other servers for their versions (their updates/s) and runs the
mid-run evaluations, off the lock and off the RPC threads, so no worker waits for either.
Evaluations are also said on the console, as a collective run says them. A record that
raises (an evaluation's error, in the model's or the user's code) does not end the writer:
it says so at once, writes every later record, and `close` raises the first error, so that
the run still fails with its traceback.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from scaletrain.config import Config
from scaletrain.launch.resolve import Derived
from scaletrain.ps.server import ParameterServer, Update


@dataclass
class _Window:
    examples: int = 0
    loss_sum: float = 0.0
    count: int = 0
    staleness: list[int] = field(default_factory=list)
    delay: list[int] = field(default_factory=list)
    skipped: int = 0
    started: float = field(default_factory=time.perf_counter)


class ServerMetrics:
    """What server 0 logs: windows of log.every global steps, evaluations, histograms.

    `update` runs under the server's lock and only adds numbers; records go through a
    queue to a writer thread, which also asks the other servers for their version (their
    updates/s) and runs evaluations, off the lock and off the RPC threads.

    A DCP Stateful (the checkpoint's loop entry of server 0): the histograms, counters and
    the last loss survive a resume.
    """

    def __init__(
        self, config: Config, derived: Derived, *, logger, start_step: int, evaluate, versions
    ) -> None:
        self.global_batch, self.every = config.train.global_batch, config.log.every
        self.eval_every, self.steps = config.train.eval_every, config.train.steps
        self.logger, self.evaluate, self.versions = logger, evaluate, versions
        self.workers = derived.ps.workers
        self.examples = start_step * self.global_batch  # applied, over the whole run
        self.start_examples = self.examples
        self._logged_step = start_step
        self.window = _Window()
        self.staleness_hist: Counter = Counter()
        self.delay_hist: Counter = Counter()
        self.skipped = 0
        self.last_loss = float("nan")
        self.worker_rate: dict[int, float] = {}
        self.alive = self.workers
        self.started = time.perf_counter()
        self._queue: queue.Queue = queue.Queue()
        self.failure: BaseException | None = None  # the first record that raised
        self._thread = threading.Thread(target=self._write, daemon=True, name="ps-metrics")
        self._thread.start()

    def update(self, u: Update, *, alive: int, lr: float, version: int) -> None:
        w = self.window
        step_before = self.examples // self.global_batch
        self.examples += u.push.examples
        w.examples += u.push.examples
        w.loss_sum += u.push.loss_sum
        w.count += u.push.count
        w.staleness.append(u.staleness)
        w.delay.append(u.delay)
        w.skipped += not u.applied
        self.skipped += not u.applied
        self.staleness_hist[u.staleness] += 1
        self.delay_hist[u.delay] += 1
        self.worker_rate[u.push.worker] = u.push.examples_per_s
        self.alive = alive
        step = self.examples // self.global_batch
        if step == step_before:
            return
        if step % self.every == 0 or step >= self.steps:
            self.last_loss = w.loss_sum / max(w.count, 1)
            # Timed here, where the window closes, not when the writer gets to it (it may
            # be busy evaluating).
            self._queue.put(
                ("train", step, w, lr, version, dict(self.worker_rate), alive, time.perf_counter())
            )
            self.window = _Window()
        if self.eval_every and step % self.eval_every == 0 and step < self.steps:
            self._queue.put(("eval", step, time.perf_counter()))

    def _write(self) -> None:
        last_versions: dict[int, tuple[int, float]] = {}
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._write_one(item, last_versions)
            except Exception as e:  # noqa: BLE001  raised again by close()
                if self.failure is None:
                    self.failure = e
                print(
                    f"scaletrain: error: server 0's {item[0]} record at step {item[1]} "
                    f"raised {type(e).__name__}: {e}; training goes on, the run ends with "
                    "this error",
                    file=sys.stderr,
                    flush=True,
                )

    def _write_one(self, item: tuple, last_versions: dict[int, tuple[int, float]]) -> None:
        """Write one queued record: an evaluation, or a window of train steps."""
        if item[0] == "eval":  # of the weights as they are now (at or after the step)
            said = self.evaluate()
            self.logger.log_eval({"step": item[1], **said, "time_s": item[2] - self.started})
            self.logger.message(  # as a collective run says it (training/trainer.py)
                f"scaletrain: eval at step {item[1]}: "
                + ", ".join(f"{k} {v:.4g}" for k, v in said.items())
            )
            return
        _, step, w, lr, version, rates, alive, ended = item
        elapsed = ended - w.started
        now, versions = ended, self.versions(version)
        ups = {}
        for k, v in versions.items():
            v0, t0 = last_versions.get(k, (v, self.started))
            ups[str(k)] = (
                (v - v0) / max(now - t0, 1e-9)
                if k in last_versions
                else v / max(now - self.started, 1e-9)
            )
            last_versions[k] = (v, now)
        steps_in = max(w.examples / self.global_batch, 1e-9)  # global steps in the window
        self.logger.log_step(
            {
                "step": step,
                "loss": w.loss_sum / max(w.count, 1),
                "lr": lr,
                "examples": w.examples,
                "examples_per_s": w.examples / max(elapsed, 1e-9),
                "step_time_s": elapsed / steps_in,
                "skipped_steps": self.skipped,
                "staleness": w.staleness,
                "staleness_max": max(w.staleness, default=0),
                "delay": w.delay,
                "updates_per_s": ups,
                "worker_examples_per_s": {str(k): r for k, r in sorted(rates.items())},
                "workers_alive": alive,
                "time_s": now - self.started,
            }
        )
        self.logger.advance(max(step - self._logged_step - 1, 0))  # the bar: global steps
        self._logged_step = step

    def close(self) -> None:
        """Write what is queued, end the writer; raise the first record's error, if any."""
        self._queue.put(None)
        self._thread.join()
        if self.failure is not None:
            raise self.failure

    def state_dict(self) -> dict:
        w = self.window  # open: gradients in flight at the cut were applied before the save
        window = {
            "examples": w.examples,
            "loss_sum": w.loss_sum,
            "count": w.count,
            "staleness": w.staleness,
            "delay": w.delay,
            "skipped": w.skipped,
            "elapsed_s": time.perf_counter() - w.started,
        }
        return {
            "staleness_hist": json.dumps(sorted(self.staleness_hist.items())),
            "delay_hist": json.dumps(sorted(self.delay_hist.items())),
            "skipped": self.skipped,
            "last_loss": self.last_loss,
            "window": json.dumps(window),
        }

    def load_state_dict(self, state: dict) -> None:
        self.staleness_hist = Counter(dict(json.loads(state["staleness_hist"])))
        self.delay_hist = Counter(dict(json.loads(state["delay_hist"])))
        self.skipped, self.last_loss = int(state["skipped"]), float(state["last_loss"])
        w = json.loads(state["window"])
        self.window = _Window(
            examples=w["examples"],
            loss_sum=w["loss_sum"],
            count=w["count"],
            staleness=w["staleness"],
            delay=w["delay"],
            skipped=w["skipped"],
            started=time.perf_counter() - w["elapsed_s"],
        )


class ServerProgress:
    """The checkpoint's per-server loop entry: the server's counters (+ server 0's metrics)."""

    def __init__(self) -> None:
        self.server: ParameterServer | None = None
        self.metrics: ServerMetrics | None = None
        self.loaded: dict = {}

    def state_dict(self) -> dict:
        out = {f"server.{k}": v for k, v in self.server.state_dict().items()}
        if self.metrics is not None:
            out.update({f"metrics.{k}": v for k, v in self.metrics.state_dict().items()})
        return out

    def load_state_dict(self, state: dict) -> None:
        self.loaded = dict(state)
