"""The per-rank supervisor of the parameter-server strategy.

torchrun's agent tears the whole group down when any rank exits non-zero, so a worker
killed by the OOM killer would end the run. Under parallel.strategy = "ps" each rank the
agent starts is this supervisor: it runs the rank's role (ps/run.py, `run_role`) in a child
process and decides what the child's end means for the agent. The child is forked, not a
new interpreter: it inherits torch and the role's modules, already imported, so a rank
starts one Python instead of two (forking after torch's import is what DataLoader workers
do; the supervisor has started no thread of its own and no process group). A worker's
child dying is exit 0 (the servers declare it dead after ps.worker_timeout_s and go on
without it); a server's is non-zero, with a message naming it (the run ends; the last
checkpoint survives). A background thread that failed in either role (ps/threads.py, a bug
of ours) ends the run too: the child has named the thread, the supervisor adds nothing. It
forwards SIGTERM/SIGINT/SIGHUP to the child, and once server 0 has written
RUN_DIR/logs/ps-finished it kills a worker child that did not leave: a SIGSTOPped worker
would otherwise hold the agent forever.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.launch.resolve import resolve

FINISHED_MARKER = "ps-finished"  # RUN_DIR/logs/ps-finished: the servers are done
EXIT_SERVER_LOST, EXIT_REFUSED = 3, 4  # a worker's child: a server is gone; declared dead
EXIT_THREAD_FAILED = 5  # either role's child: one of its background threads raised
_KILL_GRACE_S = 5.0  # after the run ends, a child still running this long is killed


def supervise(
    config: Config, run_dir: Path | None, *, role_main: Callable[[Config, Path], int]
) -> int:
    """Run this rank's role (`role_main`, ps/run.py's `run_role`) in a forked child; decide
    what the child's end means for torchrun."""
    from scaletrain.runtime import read_env

    penv = read_env()
    derived = resolve(config, world_size=penv.world_size, nproc_per_node=penv.local_world_size)
    role, index = derived.ps.role(penv.rank)
    if run_dir is None:
        print(
            "scaletrain: error: parallel.strategy = 'ps' under torchrun needs --run-dir "
            "(every rank writes into one run directory)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    started = time.time()
    child = multiprocessing.get_context("fork").Process(
        target=_child, args=(config, Path(run_dir), role_main, os.getpid()), daemon=False
    )
    child.start()
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        os.kill(child.pid, signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    marker, killed = Path(run_dir) / "logs" / FINISHED_MARKER, False
    while child.exitcode is None:
        child.join(timeout=0.2)
        if role == "worker" and _finished_since(marker, started):
            if time.time() - marker.stat().st_mtime > _KILL_GRACE_S and not killed:
                print(
                    f"scaletrain: worker {index} (rank {penv.rank}) did not leave after the run "
                    "ended (stopped or hung); killed it",
                    file=sys.stderr,
                    flush=True,
                )
                child.kill()
                killed = True
    code = child.exitcode
    if code == 0 or killed:
        return 0
    if forwarded:  # interrupted: the launcher reports it
        return 128 + forwarded[0] if code < 0 else code
    if code == EXIT_THREAD_FAILED:  # the child's last error line names the thread
        return code
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
    if role == "server":
        print(
            f"scaletrain: error: parameter server {index} (rank {penv.rank}, pid {child.pid}) "
            f"{how}; the run ends. Its checkpoints survive: continue with scaletrain train ... "
            f"--run-dir {run_dir} --resume",
            file=sys.stderr,
            flush=True,
        )
        return code if code > 0 else 1
    if code == 2:  # the user's mistake, seen by a worker: every worker would make it
        return 2
    if code not in (EXIT_SERVER_LOST, EXIT_REFUSED):
        print(
            f"scaletrain: worker {index} (rank {penv.rank}, pid {child.pid}) {how}; the "
            f"servers go on without it once ps.worker_timeout_s = "
            f"{config.ps.worker_timeout_s:g} s has passed",
            file=sys.stderr,
            flush=True,
        )
    return 0


def _child(
    config: Config, run_dir: Path, role_main: Callable[[Config, Path], int], supervisor: int
) -> None:
    """The forked child: die with the supervisor, run the role, leave with its status."""
    from scaletrain.runtime import LAUNCHER_PID_ENV, exit_worker, prepare_worker_process

    os.environ[LAUNCHER_PID_ENV] = str(supervisor)  # PR_SET_PDEATHSIG is not inherited
    prepare_worker_process()
    try:
        code = role_main(config, run_dir)
    except UserError as e:  # as cli.main shows it: one line, status 2
        print(f"scaletrain: error: {e}", file=sys.stderr, flush=True)
        code = 2
    exit_worker(code)  # a bug's exception leaves through multiprocessing: traceback, 1


def _finished_since(marker: Path, since: float) -> bool:
    try:
        return marker.stat().st_mtime >= since
    except FileNotFoundError:
        return False
