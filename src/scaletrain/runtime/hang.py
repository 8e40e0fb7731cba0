"""Hang reports, a rank's side: where this rank was when a collective failed or hung.

- At start (`install`, from prepare_worker_process): SIGUSR1 makes the rank dump every
  thread's Python stack into its log. faulthandler writes it from the signal handler
  itself, so a rank blocked in C++ (a collective, a lock) dumps too; then, once the main
  thread runs Python again (a rank sleeping or computing in Python), the rank writes its
  Flight Recorder record as well.
- Flight Recorder: torch keeps the last TORCH_FR_BUFFER_SIZE collectives of every process
  group of this rank (name such as "gloo:all_reduce", sequence number, whether it
  completed); the size must be in the environment before the group starts
  (`enable_flight_recorder`, from init_distributed). `dump_flight_record` writes it as JSON
  (torch's `_dump_fr_trace_json`) to RUN_DIR/logs/flight-rank-N.json; torch's pickle form is
  never written or read.
- A collective that fails in this rank (`on_collective_failure`, from
  runtime.collective_guard): the rank writes the stack it failed at and its flight record;
  under scaletrain's launcher it then asks the launcher to make the other live ranks of this
  node dump theirs (launch/hang.py) and waits until they have, at most REQUEST_WAIT_S,
  before its failure ends it and the launcher stops the others.

The request and the answer are files in the launcher's logs directory (named by
HANG_WATCH_ENV): the rank creates `.hang-rank-N.request`, the launcher renames it to
`.hang-rank-N.done` once the others have dumped. No socket is opened.

The stack blocks use faulthandler's format ("File "PATH", line N in NAME", most recent call
first), so launch/hang.py reads the ones written here and faulthandler's alike.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

FR_BUFFER_ENV, FR_BUFFER_DEFAULT = "TORCH_FR_BUFFER_SIZE", "2000"
# Set by the launcher for its workers: its logs directory, where a rank's request goes.
HANG_WATCH_ENV = "SCALETRAIN_HANG_WATCH"
REQUEST_WAIT_S = 10.0  # at most this long for the launcher's answer (it waits 3 s for the ranks)
STACK_HEADER = "Stack (most recent call first):"  # faulthandler's, for one thread
NOTE = "# scaletrain hang report:"  # lines for the log only (the console filter drops them)


def flight_record_path(log_dir: Path, rank: int) -> Path:
    """RUN_DIR/logs/flight-rank-N.json."""
    return Path(log_dir) / f"flight-rank-{rank}.json"


def request_path(watch_dir: Path, rank: int, *, done: bool = False) -> Path:
    """The file a rank creates to ask for its peers' stacks (`done`: the launcher's answer)."""
    return Path(watch_dir) / f".hang-rank-{rank}.{'done' if done else 'request'}"


def progress_path(log_dir: Path, rank: int) -> Path:
    """The file a rank touches after each step: the launcher's sign of progress."""
    return Path(log_dir) / f".progress-rank-{rank}"


def beat() -> None:
    """Mark that this rank finished a step (the launcher dumps the stacks of a run in which
    no rank has for parallel.timeout_s). A file's mtime: no collective, no message."""
    if _Armed.log_dir is not None:
        with contextlib.suppress(OSError):
            progress_path(_Armed.log_dir, _Armed.rank).touch()


class _Armed:
    log_dir: Path | None = None  # where the flight record goes; None until the run dir is known
    rank: int = 0
    reporting: bool = False  # this rank's own report is being written: SIGUSR1 is ignored


def enable_flight_recorder() -> None:
    """Turn on torch's Flight Recorder for the process groups this process creates next (a
    value the user set is kept)."""
    os.environ.setdefault(FR_BUFFER_ENV, FR_BUFFER_DEFAULT)


def install() -> None:
    """SIGUSR1 dumps this rank's stacks into its log (stderr), then its flight record.

    Python's handler is installed first and faulthandler's on top with chain=True: the C
    handler writes the stacks at once and then hands the signal to Python's, which runs
    when the main thread next executes Python. A no-op off the main thread or without
    SIGUSR1 (Windows).
    """
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return
    _Armed.rank, _Armed.reporting = int(os.environ.get("RANK", "0")), False
    signal.signal(signal.SIGUSR1, _on_sigusr1)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=True)


def arm(log_dir: Path, *, rank: int) -> None:
    """Where this rank's flight record goes (the run's logs directory), once it is known."""
    _Armed.log_dir, _Armed.rank, _Armed.reporting = Path(log_dir), rank, False


def dump_flight_record() -> Path | None:
    """Write this rank's Flight Recorder record as JSON; its path, or None when there is no
    place for it yet or torch has none."""
    if _Armed.log_dir is None:
        return None
    import torch

    try:
        raw = torch._C._distributed_c10d._dump_fr_trace_json(True, False)  # all, as JSON
    except (AttributeError, RuntimeError) as e:  # a build without it, or no group yet
        print(f"{NOTE} no flight record ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return None
    path = flight_record_path(_Armed.log_dir, _Armed.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_bytes(raw)
    os.replace(tmp, path)  # the launcher never reads half a record
    return path


def _on_sigusr1(signum, frame) -> None:
    if _Armed.reporting:
        return
    path = dump_flight_record()
    where = f"; flight record in {path}" if path else ""
    print(f"{NOTE} stacks dumped above on request (SIGUSR1){where}", file=sys.stderr, flush=True)


def on_collective_failure(error: BaseException, *, operation: str, step: int) -> None:
    """This rank's part of a hang report, when a collective failed here: its stack at the
    failure and its flight record into the logs, then (under scaletrain's launcher) the
    other live ranks' stacks, before this rank goes on to fail.

    Args:
        error: what the collective raised (its traceback says where this rank was).
        operation: the collective_guard's name for it.
        step: the step it belongs to (0-based, as the loop counts).
    """
    # From here on a SIGUSR1 (another failing rank's request) must not dump this rank again:
    # its last stack in the log is to stay the one it failed at.
    _Armed.reporting = True
    if hasattr(signal, "SIGUSR1"):
        faulthandler.unregister(signal.SIGUSR1)  # back to Python's handler alone
    out = sys.stderr
    print(f"{NOTE} collective '{operation}' at step {step} failed; this rank's stack:", file=out)
    print(STACK_HEADER, file=out)
    for frame in reversed(_stack_at(error)):
        print(f'  File "{frame.filename}", line {frame.lineno} in {frame.name}', file=out)
    out.flush()
    path = dump_flight_record()
    if path is not None:
        print(f"{NOTE} flight record in {path}", file=out, flush=True)
    watch = os.environ.get(HANG_WATCH_ENV)
    if watch:
        _ask_for_peer_stacks(Path(watch))


def _stack_at(error: BaseException) -> list[traceback.FrameSummary]:
    """The whole stack where `error` was raised, outermost first: the frames above the one
    that caught it, then its traceback (less this module's package, the guard's own frames)."""
    here = str(Path(__file__).parent)
    entries = list(traceback.walk_tb(error.__traceback__))
    while entries and entries[0][0].f_code.co_filename.startswith(here):
        entries.pop(0)  # collective_guard's frame: the error passed through it, not from it
    if not entries:
        return []
    outer = traceback.extract_stack(entries[0][0].f_back)
    return [*outer, *traceback.StackSummary.extract(entries)]


def _ask_for_peer_stacks(watch_dir: Path) -> None:
    """Ask scaletrain's launcher to make the other live ranks dump, and wait for its answer
    (bounded: a launcher that cannot answer costs REQUEST_WAIT_S, not the run)."""
    rank = _Armed.rank
    request, done = request_path(watch_dir, rank), request_path(watch_dir, rank, done=True)
    with contextlib.suppress(OSError):
        done.unlink(missing_ok=True)
        request.touch()
        deadline = time.monotonic() + REQUEST_WAIT_S
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        done.unlink(missing_ok=True)
        request.unlink(missing_ok=True)
