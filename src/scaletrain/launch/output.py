"""What a launched run shows on the console, and what it keeps in RUN_DIR/logs.

launch/agent.py starts the workers through torchrun's agent; this module decides where their
output goes. The rule: the files keep everything, the console shows what a user acts on.

- Files. Each rank's whole output (stdout and stderr in one file) goes to
  RUN_DIR/logs/rank-N.log, N the global rank: torchrun's own --log-dir / --redirects do
  the writing and `run_dir_logs`, a torchrun LogsSpecs, names the files. A file is never
  overwritten (a restart or a later --resume launch gets a new name), so every attempt's
  output survives. The agent's own log records ("Sending process ... closing signal")
  go to RUN_DIR/logs/launcher.log (`agent_log`).
- Console. Local rank 0's output (progress bar, messages) is copied from its log file as
  it grows (`ConsoleEcho`) through `OutputFilter`, which drops C++ stack frames, c10d's
  and torch's log records and Python tracebacks. When one rank fails, every rank tends to
  print a traceback and c10d dozens of frames and warnings, which would bury the one line
  that says what happened; they stay in the logs. torchrun's --tee copies a stream
  unchanged, which is why the console is fed by reading the file back instead.
- The end. A failed run ends with one paragraph (`describe_child_failure`): each failed
  rank, how it ended, its own error line (`last_error_line`) and the path of its log; after
  a failed collective, where each rank was (launch/hang.py). A run stopped by a signal
  ends with one line (`describe_interrupt`): the step, the last checkpoint and how to
  continue.
- `--debug` turns all of this off: every rank's output and the agent's log records reach
  the console unfiltered (torchrun's --tee), and the files are still written.

The trade-off: the filter is a list of patterns (`_NOISE`). New noise from a later torch
reaches the console until a pattern is added; a line that merely looks like noise is
hidden from the console, never from the log.

Importing this module does not import torch; `run_dir_logs` imports it when called.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

# --------------------------------------------------------------------------- the agent's log


@contextlib.contextmanager
def agent_log(path: Path | None) -> Iterator[None]:
    """Send torch.distributed's log records in this process (the agent's "Sending process
    ... closing signal", "failed (exitcode: -9)") to `path` instead of the console."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        swapped = []
        for name, logger in list(logging.Logger.manager.loggerDict.items()):
            if name != "torch" and not name.startswith("torch.distributed"):
                continue
            for handler in getattr(logger, "handlers", ()):
                if type(handler) is logging.StreamHandler and handler.stream is sys.stderr:
                    swapped.append((handler, handler.setStream(f)))
        try:
            yield
        finally:
            for handler, stream in swapped:
                handler.setStream(stream)


# --------------------------------------------------------------------------- worker logs


def run_dir_logs(log_dir: Path, *, tee=0, on_attempt: Callable[[Path], None] | None = None):
    """torchrun's LogsSpecs for RUN_DIR/logs/rank-N.log, N the global rank.

    The agent redirects each worker's stderr into its file (torchrun's --redirects 2);
    the worker points its stdout there too (runtime.prepare_worker_process), because the
    agent opens the two streams' files separately and one file cannot take both. A file
    is never overwritten: restart attempt K writes rank-N.restart-K.log, and a later
    launch into the same run directory (--resume) adds .2, .3, ... to the name.

    Args:
        log_dir: the directory for the files.
        tee: torchrun's Std value: also copy these streams to the console (--debug).
        on_attempt: called with local rank 0's file each time the workers are (re)started.

    Returns:
        A LogsSpecs whose `paths` maps each global rank to its current log file.
    """
    # Imported here so that importing this module does not import torch.
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std, to_map

    class RunDirLogs(LogsSpecs):
        def __init__(self) -> None:
            super().__init__(str(log_dir), Std.ERR, tee if isinstance(tee, dict) else Std(tee))
            self.paths: dict[int, Path] = {}

        @property
        def root_log_dir(self) -> str:
            return str(log_dir)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            log_dir.mkdir(parents=True, exist_ok=True)
            ranks = {lr: int(env.get("RANK", lr)) for lr, env in envs.items()}
            restart = next(iter(envs.values()), {}).get("TORCHELASTIC_RESTART_COUNT", "0")
            base = "" if restart == "0" else f".restart-{restart}"
            suffix, n = base, 1
            while any((log_dir / f"rank-{r}{suffix}.log").exists() for r in ranks.values()):
                n += 1
                suffix = f"{base}.{n}"
            tees = to_map(self._tee, len(envs))
            stdouts, stderrs, tee_err, errors = {}, {}, {}, {}
            self.paths = {}
            for lr, rank in ranks.items():
                path = log_dir / f"rank-{rank}{suffix}.log"
                self.paths[rank] = path
                stdouts[lr], stderrs[lr] = "", str(path)  # "": the agent's stdout (see above)
                if tees[lr] & Std.ERR:
                    tee_err[lr] = str(path)
                errors[lr] = str(log_dir / f"rank-{rank}{suffix}.error.json")
                envs[lr]["TORCHELASTIC_ERROR_FILE"] = errors[lr]
            if on_attempt is not None and 0 in ranks:
                on_attempt(self.paths[ranks[0]])
            return LogsDest(
                stdouts,
                stderrs,
                {},
                tee_err,
                errors,
                str(log_dir / "filtered_stdout.log"),
                str(log_dir / "filtered_stderr.log"),
            )

    return RunDirLogs()


# --------------------------------------------------------------------------- the console

_RANK_PREFIX = r"(?:\[(?:default)?rank\d+\]:)?"  # c10d prefixes its C++ log lines with this
_NOISE = re.compile(
    _RANK_PREFIX
    + r"""(?:
      \[?[WEIF]\d{4}\ \d\d:\d\d:\d\d   # a glog-style header: c10d's C++ log, torch's Python log
    | \s*frame\ \#\d+:                  # a C++ stack frame
    | \s*<omitting\ python\ frames>
    | Exception\ raised\ from[ ]  # the space is part of the pattern
    | \#\ scaletrain\ (?:worker|hang\ report):  # a rank log's first line; hang-report notes
    | (?:Current\ thread|Thread)\ .*\(most\ recent\ call\ first\):  # faulthandler's stacks
    | Stack\ \(most\ recent\ call\ first\):
    | \ \ File\ ".*",\ line\ \d+\ in\     # a frame of one (a traceback's says "line N, in")
    | \ \ <no\ Python\ frame>
    | scaletrain:\ error:               # quoted by the launcher's failure paragraph instead
    )""",
    re.X,
)
_GLUED_NOISE = re.compile(_RANK_PREFIX + r"\[[WEIF]\d{4} \d\d:\d\d:\d\d")  # C++ log on a bar's line
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)


class OutputFilter:
    """What of a worker's output reaches the console: all of it but C++ stack frames, c10d's
    and torch's log records, Python tracebacks and error lines (quoted at the end instead).

    The text is cut into segments ending in "\\n" or "\\r"; tqdm redraws its bar after a
    "\\r", so a bar update passes as soon as the next one begins.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._mode = "text"  # "text", "traceback" (inside one), "after" (blank lines dropped)

    def feed(self, text: str) -> str:
        """Add output; return the part of it that may be shown."""
        self._pending += text
        shown = []
        while (end := _segment_end(self._pending)) is not None:
            segment, self._pending = self._pending[:end], self._pending[end:]
            shown.append(self._segment(segment))
        return "".join(shown)

    def flush(self) -> str:
        """The last, unterminated segment, if it may be shown."""
        segment, self._pending = self._pending, ""
        return self._segment(segment) if segment else ""

    def _segment(self, segment: str) -> str:
        body = segment.rstrip("\r\n")
        if self._mode == "traceback":
            if not body or body[0] in " \t":
                return ""
            self._mode = "after"  # the exception's own line ends the traceback
            return ""
        if body.startswith(_TRACEBACK):
            self._mode = "traceback"
            return ""
        if self._mode == "after" and (not body.strip() or body in _CHAINED):
            return ""
        self._mode = "text"
        if _NOISE.match(body):
            self._mode = "after"
            return ""
        glued = _GLUED_NOISE.search(body)
        if glued:
            self._mode = "after"
            return body[: glued.start()] + "\n"
        return segment


def _segment_end(text: str) -> int | None:
    ends = [i for i in (text.find("\n"), text.find("\r")) if i >= 0]
    return min(ends) + 1 if ends else None


class ConsoleEcho:
    """Copies one worker's log file to the console as it grows, through `OutputFilter`.

    Any signal this process receives mutes it at once: the agent is then stopping the
    workers, and the CLI will print one line. It notices through `signal.set_wakeup_fd`,
    which every Python-level handler (the agent's included) writes to.

    Args:
        dst: the console stream.
    """

    def __init__(self, dst) -> None:
        self._dst = dst
        self._lock = threading.Lock()
        self._next: Path | None = None
        self._done = threading.Event()
        self._muted = False
        self._last = ""  # the last character shown
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._old_wakeup = None
        if threading.current_thread() is threading.main_thread():
            self._old_wakeup = signal.set_wakeup_fd(self._wake_w.fileno())
        self._thread = threading.Thread(target=self._run, name="scaletrain-console", daemon=True)
        self._thread.start()

    def follow(self, path: Path) -> None:
        """Copy `path` from now on (after the rest of the current file)."""
        with self._lock:
            self._next = Path(path)

    def stop(self) -> None:
        """Copy what is left, then stop. Safe to call twice."""
        if self._done.is_set():
            return
        self._done.set()
        self._thread.join(timeout=10)
        if self._old_wakeup is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            self._old_wakeup = None
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        current, stream, filt = None, None, OutputFilter()
        while True:
            readable, _, _ = select.select([self._wake_r], [], [], 0.1)
            if readable:
                with contextlib.suppress(BlockingIOError):
                    if self._wake_r.recv(64):
                        self._muted = True
            finishing = self._done.is_set()
            with self._lock:
                following, self._next = self._next, None
            if following is not None:
                if stream is not None:
                    self._show(filt.feed(_read_new(stream)) + filt.flush())
                    stream.close()
                current, stream, filt = following, None, OutputFilter()
            if stream is None and current is not None and current.exists():
                stream = current.open(encoding="utf-8", errors="replace", newline="")
            if stream is not None:
                self._show(filt.feed(_read_new(stream)))
            if finishing:
                if stream is not None:
                    self._show(filt.flush())
                    stream.close()
                if self._last not in ("", "\n") and not self._muted:
                    self._show("\n")  # what the CLI prints next starts on a line of its own
                return

    def _show(self, text: str) -> None:
        if text and not self._muted:
            self._dst.write(text)
            self._dst.flush()
            self._last = text[-1]


def _read_new(stream) -> str:
    # read(n), not read(): read() decodes as if at the end of the file, and would turn a
    # multi-byte character cut by the writer's flush into a replacement character.
    chunks = []
    while chunk := stream.read(1 << 16):
        chunks.append(chunk)
    return "".join(chunks)


# --------------------------------------------------------------------------- what went wrong


def describe_child_failure(error, *, logs: dict[int, Path] | None = None, hang: str = "") -> str:
    """One paragraph: every failed rank, how it ended, its own error line, its log file.

    Ranks the agent stopped (SIGTERM) because another rank failed first are said to be so.

    Args:
        error: torch's ChildFailedError.
        logs: global rank -> that rank's log file.
        hang: a sentence on where each rank was (launch/hang.describe_hang), appended.
    """
    logs = logs or {}
    failures = list(error.failures.items())  # in the order the agent saw them fail
    stopped = {-signal.SIGTERM, 128 + signal.SIGTERM}
    causes = [r for r, f in failures if f.exitcode not in stopped] or [failures[0][0]]
    parts = []
    for rank, failure in sorted(failures, key=lambda rf: (rf[0] not in causes, rf[0])):
        if rank not in causes and failure.exitcode in stopped:
            what = f"was stopped by the launcher after rank {causes[0]} failed"
        elif failure.exitcode < 0:
            what = f"was killed by {_signal_name(-failure.exitcode)}"
            if failure.exitcode == -signal.SIGKILL:
                what += " (from outside, or by the kernel's out-of-memory killer)"
        else:
            what = f"exited with code {failure.exitcode}"
            said = last_error_line(logs[rank]) if rank in logs else None
            if said:
                what += f": {said}"
        where = f"; its output is in {logs[rank]}" if rank in logs else ""
        parts.append(
            f"rank {rank} (pid {failure.pid}, local rank {failure.local_rank}) {what}{where}"
        )
    return (
        "scaletrain: error: the run failed: "
        + "; ".join(parts)
        + "."
        + (f" {hang}" if hang else "")
    )


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def last_error_line(log: Path, *, limit: int = 400) -> str | None:
    """A rank's last `scaletrain: error:` message, else the last exception line of its last
    Python traceback; None when the log holds neither."""
    lines = _tail_lines(log, 256 * 1024)
    if lines is None:
        return None
    said = [ln for ln in lines if ln.startswith("scaletrain: error: ")]
    if said:
        return said[-1].removeprefix("scaletrain: error: ")[:limit]
    found, inside = None, False
    for line in lines:
        if line.startswith(_TRACEBACK):
            inside = True
        elif inside and line and line[0] not in " \t":
            found, inside = line, False
    return found[:limit] if found else None


def describe_interrupt(run_dir: Path, *, signum: int) -> str:
    """The one line printed when a signal stopped the run: where, last checkpoint, how to go on."""
    from scaletrain.checkpoint.files import list_checkpoints

    checkpoints = list_checkpoints(Path(run_dir) / "checkpoints")
    last = checkpoints[-1] if checkpoints else None
    step = max(_last_logged_step(Path(run_dir)), _checkpoint_step(last) if last else 0)
    where = f"at step {step}" if step else "before the first logged step"
    if last is not None:
        then = (
            f"last checkpoint {last.name}; continue with: scaletrain train ... "
            f"--run-dir {run_dir} --resume"
        )
    else:
        then = (
            "no checkpoint to continue from (checkpoint.every = 0, or none was reached); "
            "set checkpoint.every to make a run resumable"
        )
    return f"scaletrain: interrupted ({_signal_name(signum)}) {where}; {then}"


def _checkpoint_step(path: Path) -> int:
    tail = path.name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _last_logged_step(run_dir: Path) -> int:
    """The step of the last train record in metrics.jsonl (0 when there is none)."""
    for line in reversed(_tail_lines(run_dir / "metrics.jsonl", 64 * 1024) or []):
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by the seek, or by the kill
            continue
        if record.get("kind") == "train":
            return int(record.get("step", 0))
    return 0


def _tail_lines(path: Path, nbytes: int) -> list[str] | None:
    """The lines in the last `nbytes` bytes of `path` (the first may be cut); None when the
    file cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - nbytes))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
