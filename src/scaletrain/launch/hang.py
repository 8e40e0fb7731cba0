"""Hang reports, the launcher's side: every rank's stack before the workers are stopped, and
one sentence on where each rank was for the failure paragraph.

A collective that times out fails on the ranks waiting in it; the rank that never arrived
(asleep, stuck in a data loader, in C++) fails nowhere, and torchrun's agent stops it with
SIGTERM as soon as another worker exits. Its stack is what a user needs, so a failing rank
first asks (runtime/hang.py: a `.hang-rank-N.request` file in the logs directory) and
`HangWatch`, a thread of the launcher, answers: it sends SIGUSR1 to every other live worker
of this node that handles it (each dumps its Python stack into its log through faulthandler,
and its Flight Recorder record), waits until each has written its record, has exited, or
PEER_WAIT_S has passed (a rank blocked in C++ dumps its stack but runs no Python), then
renames the request to `.done`. Only then does the failing rank go on to exit, so the
agent's SIGTERM cannot race the dumps. Each worker is signalled once per launch.

Workers on other nodes are their own launcher's: each waiting rank times out in its own
collective and reports through its node's launcher; a rank stuck alone on another node is
stopped without a stack.

A run where no rank waits in a collective (every rank stuck in its own loop or lock) never
times out. With `stall_s` (parallel.timeout_s), `HangWatch` also watches progress: each rank
touches a file after every step (runtime/hang.beat); once some rank has, and then none has
for stall_s, it dumps every worker's stack and flight record the same way and prints one
warning saying where each rank was. It stops nothing (a long evaluation or checkpoint write
looks the same) and warns once per stall. `kill -USR1 PID` dumps any rank by hand.

`describe_hang` reads what the ranks left (RUN_DIR/logs/flight-rank-N.json and the last
stack dump in each rank's log) into one sentence: each rank's last collective and the
innermost frame of its main thread outside torch and the standard library.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import signal
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from scaletrain.runtime.hang import flight_record_path, progress_path, request_path

PEER_WAIT_S = 3.0  # per request: how long the signalled workers get to write their records


class HangWatch:
    """The launcher's thread that answers the workers' requests for their peers' stacks.

    Args:
        log_dir: the run's logs directory (the workers' HANG_WATCH_ENV).
        wait_s: how long signalled workers get to write their flight records.
        stall_s: warn, with every rank's stack, when no rank has finished a step for this
            long (None: not watched).
        logs: global rank -> its log, for the stall warning (the launcher's LogsSpecs).
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        wait_s: float = PEER_WAIT_S,
        stall_s: float | None = None,
        logs=None,
    ) -> None:
        self.log_dir, self.wait_s, self.stall_s, self.logs = Path(log_dir), wait_s, stall_s, logs
        self._signalled: set[int] = set()  # pids: each worker dumps once
        self._stalled_at: float | None = None  # the last progress a stall was reported at
        self._started = time.time()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scaletrain-hang", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; remove what a rank that died mid-request left. Safe to call twice."""
        self._done.set()
        self._thread.join(timeout=self.wait_s + 5)
        with contextlib.suppress(OSError):
            for stray in self.log_dir.glob(".hang-rank-*"):
                stray.unlink(missing_ok=True)

    def _run(self) -> None:
        while not self._done.wait(0.1):
            with contextlib.suppress(OSError):
                for request in sorted(self.log_dir.glob(".hang-rank-*.request")):
                    self._answer(request)
                if self.stall_s is not None:
                    self._watch_progress()

    def _watch_progress(self) -> None:
        """Warn once per stall: some rank finished a step, then none did for stall_s."""
        beats = [progress_path(self.log_dir, rank) for rank in worker_pids()]
        last = max((b.stat().st_mtime for b in beats if b.exists()), default=None)
        if last is None or last < self._started or last == self._stalled_at:
            return  # no step yet in this launch (a build, a first compile), or said already
        if time.time() - last < self.stall_s:
            return
        self._stalled_at = last
        self._signal(worker_pids(), once=False)
        where = describe_hang(self.log_dir, self.logs() if self.logs else {}, since=self._started)
        where = where or "Each rank's stack is in its log."
        print(
            f"scaletrain: warning: no rank has finished a step for {self.stall_s:.0f} s "
            f"(parallel.timeout_s); the run goes on. {where}",
            file=sys.stderr,
            flush=True,
        )

    def _answer(self, request: Path) -> None:
        asking = request.name.removeprefix(".hang-rank-").removesuffix(".request")
        if not asking.isdigit():
            request.unlink(missing_ok=True)  # not a rank's: no one waits for it
            return
        workers = worker_pids()
        if int(asking) in workers:
            self._signalled.add(workers[int(asking)])  # it has dumped its own
        self._signal(workers, once=True)
        with contextlib.suppress(OSError):
            os.replace(request, request_path(self.log_dir, int(asking), done=True))

    def _signal(self, workers: dict[int, int], *, once: bool) -> None:
        """SIGUSR1 to each worker that handles it (`once`: not one signalled before), then
        wait until each has written its flight record, exited, or wait_s has passed."""
        waiting = {}  # rank -> (pid, its flight record's stamp before the signal)
        for rank, pid in workers.items():
            if (once and pid in self._signalled) or not _handles(pid, signal.SIGUSR1):
                continue  # done already, or not yet at prepare_worker_process: SIGUSR1 kills
            waiting[rank] = (pid, _stamp(flight_record_path(self.log_dir, rank)))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            if once:
                self._signalled.add(pid)
        deadline = time.monotonic() + self.wait_s
        while waiting and time.monotonic() < deadline:
            time.sleep(0.05)
            waiting = {
                rank: (pid, stamp)
                for rank, (pid, stamp) in waiting.items()
                if _alive(pid) and _stamp(flight_record_path(self.log_dir, rank)) == stamp
            }


def worker_pids(parent: int | None = None) -> dict[int, int]:
    """RANK -> pid of `parent`'s (this process's) children that have RANK in their
    environment: the workers torchrun's agent started. Read from /proc; {} without it."""
    parent = os.getpid() if parent is None else parent
    found = {}
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid != parent:
                    continue
                env = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            rank = [e[5:] for e in env if e.startswith(b"RANK=")]
            if rank and rank[0].isdigit():
                found[int(rank[0])] = int(entry.name)
    return found


def _handles(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (SigCgt in /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie the agent has yet to reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


# --------------------------------------------------------------------------- the report


def describe_hang(log_dir: Path, logs: dict[int, Path], *, since: float) -> str:
    """One sentence: each rank's last collective (from its flight record; a rank whose last
    one is older than another rank's in the same group is said to be behind) and where its
    Python stack was (its log's last stack dump); "" when no rank left either.

    Args:
        log_dir: the run's logs directory (the flight records).
        logs: global rank -> that rank's log of this launch.
        since: when this launch started (time.time()): older flight records are ignored.
    """
    found = {
        rank: (last_collective(flight_record_path(log_dir, rank), since=since), stack_location(log))
        for rank, log in sorted(logs.items())
    }
    newest: dict[str, int] = {}  # process group -> the highest sequence number any rank reached
    for collective, _ in found.values():
        if collective is not None:
            newest[collective.group] = max(newest.get(collective.group, 0), collective.seq)
    parts = []
    for rank, (collective, frame) in found.items():
        if collective is None and frame is None:
            continue
        said = [f"last collective {collective}" if collective else "no flight record"]
        if collective is not None and collective.seq < newest[collective.group]:
            said[0] += f", behind the others' #{newest[collective.group]}"
        if frame:
            said.append(f"Python at {frame}")
        parts.append(f"rank {rank}: {', '.join(said)}")
    if not parts:
        return ""
    return (
        f"Where each rank was: {'; '.join(parts)}. Their full stacks are in their logs, "
        f"their recent collectives in {Path(log_dir) / 'flight-rank-N.json'}."
    )


@dataclass(frozen=True)
class Collective:
    """One collective of a flight record."""

    name: str  # torch's profiling name, e.g. "gloo:all_reduce"
    seq: int  # its sequence number in its process group
    group: str  # the process group's name ("default_pg": all ranks)

    def __str__(self) -> str:
        on = f" on group {self.group}" if self.group != "default_pg" else ""
        return f"{self.name} #{self.seq}{on}"


def last_collective(path: Path, *, since: float) -> Collective | None:
    """The newest collective of a flight record written at or after `since`; None when
    there is none. Whether it completed is not told: a collective that timed out is
    retired from the record like one that succeeded, sooner or later."""
    try:
        if path.stat().st_mtime < since:
            return None  # an earlier launch's
        record = json.loads(path.read_bytes())
        entries = [e for e in record.get("entries", []) if isinstance(e, dict)]
        if not entries:
            return None
        last = max(entries, key=lambda e: (e.get("time_created_ns", 0), e.get("record_id", 0)))
        p2p = bool(last.get("is_p2p"))
        return Collective(
            name=str(last.get("profiling_name", "?")),
            seq=int(last.get("p2p_seq_id" if p2p else "collective_seq_id", 0)),
            group=str((last.get("process_group") or ["default_pg"])[-1]),
        )
    except (OSError, ValueError, TypeError, AttributeError):  # unreadable: no record to show
        return None


_HEADER = re.compile(
    r"^(?:(?P<current>Current thread)|Thread) .*\(most recent call first\):$"
    r"|^(?P<one>Stack) \(most recent call first\):$"
)
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
_INSIDE = re.compile(r"^(?:|  \.\.\.|  <no Python frame>)$")  # a dump's blank and filler lines


def stack_location(log: Path) -> str | None:
    """'PATH:LINE in NAME': the innermost frame outside torch and the standard library of the
    main thread in the last stack dump of a rank's log (faulthandler's format); None when
    the log holds no dump."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - (1 << 20)))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    dumps: list[list[tuple[bool, list[tuple[str, int, str]]]]] = []
    block, inside = None, False
    for line in lines:
        header = _HEADER.match(line)
        if header:
            if not inside:
                dumps.append([])  # a new dump begins
            block = (bool(header["current"] or header["one"]), [])
            dumps[-1].append(block)
            inside = True
        elif inside and (frame := _FRAME.match(line)) and block is not None:
            block[1].append((frame[1], int(frame[2]), frame[3]))
        elif not _INSIDE.match(line):
            block, inside = None, False
    if not dumps:
        return None
    threads = dumps[-1]
    # The signal lands on the main thread on Linux ("Current thread"); a thread started by
    # `threading` is told by its outermost frame, should it be another.
    main = [f for current, f in threads if current and not _started_thread(f)]
    main = main or [f for _, f in threads if not _started_thread(f)]
    for path, line, name in main[0] if main else []:
        if not _library(path):
            return f"{path}:{line} in {name}"
    return None


def _started_thread(frames: list[tuple[str, int, str]]) -> bool:
    return bool(frames) and frames[-1][2] == "_bootstrap" and frames[-1][0].endswith("threading.py")


@functools.cache
def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(the standard library, installed packages, torch): directories, each ending in os.sep."""
    paths = sysconfig.get_paths()
    torch = importlib.util.find_spec("torch")  # found, not imported

    def dirs(*names: str) -> tuple[str, ...]:
        return tuple({name.rstrip(os.sep) + os.sep for name in names})

    return (
        dirs(paths["stdlib"], paths["platstdlib"]),
        dirs(paths["purelib"], paths["platlib"]),  # inside the stdlib's directory on some systems
        dirs(*(torch.submodule_search_locations or ())) if torch else (),
    )


def _library(path: str) -> bool:
    """torch's own code, the standard library, or Python's frozen modules."""
    stdlib, installed, torch = _library_roots()
    return (
        path.startswith("<")
        or path.startswith(torch)
        or (path.startswith(stdlib) and not path.startswith(installed))
    )
