"""The per-rank supervisor of the parameter-server strategy.

torchrun's agent tears the whole group down when any rank exits non-zero, so a worker
killed by the OOM killer would end the run. Under parallel.strategy = "ps" each rank the
agent starts is this supervisor: it runs the rank's role (ps/run.py, `run_role`) as a child
process and decides what the child's end means for the agent. A worker's child dying is
exit 0 (the servers declare it dead after ps.worker_timeout_s and go on without it); a
server's is non-zero, with a message naming it (the run ends; the last checkpoint
survives). It forwards SIGTERM/SIGINT/SIGHUP to the child, and once server 0 has written
RUN_DIR/logs/ps-finished it kills a worker child that did not leave: a SIGSTOPped worker
would otherwise hold the agent forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from scaletrain.config import Config
from scaletrain.plan import resolve

CHILD_ENV = "SCALETRAIN_PS_CHILD"  # set in the supervisor's child: run the role
FINISHED_MARKER = "ps-finished"  # RUN_DIR/logs/ps-finished: the servers are done
EXIT_SERVER_LOST, EXIT_REFUSED = 3, 4  # a worker's child: a server is gone; declared dead
_KILL_GRACE_S = 5.0  # after the run ends, a child still running this long is killed


def supervise(config: Config, run_dir: Path | None, argv: list[str]) -> int:
    """Run this rank's role in a child process; decide what its end means for torchrun."""
    from scaletrain.runtime import LAUNCHER_PID_ENV, read_env

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
    env = {**os.environ, CHILD_ENV: "1", LAUNCHER_PID_ENV: str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-m", "scaletrain", *argv], env=env)
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        child.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    marker, killed = Path(run_dir) / "logs" / FINISHED_MARKER, False
    while child.poll() is None:
        time.sleep(0.2)
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
    code = child.returncode
    if code == 0 or killed:
        return 0
    if forwarded:  # interrupted: the launcher reports it
        return 128 + forwarded[0] if code < 0 else code
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


def _finished_since(marker: Path, since: float) -> bool:
    try:
        return marker.stat().st_mtime >= since
    except FileNotFoundError:
        return False
