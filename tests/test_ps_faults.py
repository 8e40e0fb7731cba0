"""Parameter servers under faults, through the real launcher: a worker killed with SIGKILL or
frozen with SIGSTOP is declared dead after ps.worker_timeout_s and the run finishes with the
rest (the summary names it; a stopped one is killed at the end so that torchrun can exit); a
frozen worker that wakes up after being declared dead has its late gradients refused and
leaves; a killed server ends the run with an error naming it, and its checkpoints survive."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import cli_env, records
from scaletrain.checkpoint_files import latest_valid, list_checkpoints

pytestmark = pytest.mark.slow

LEASE_S = 2.0  # ps.worker_timeout_s

# Steps enough for the run to go on for several leases after a worker is lost (about 50
# steps/s per worker on two cores): the deaths below happen mid-run.
CONFIG = f"""
name = "ps-faults"
[model]
name = "mlp"
size = "tiny"
[data]
source = "digits"
[train]
steps = 600
global_batch = 64
micro_batch = 32
eval_examples = 256
[optim]
lr = 0.01
[parallel]
strategy = "ps"
dp = 2
timeout_s = 30
[ps]
mode = "async"
worker_timeout_s = {LEASE_S}
[log]
every = 10
quiet = true
"""


def _start(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen, Path]:
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG)
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "train", str(config), "--nproc", "3",
         "--run-dir", str(run_dir), *overrides],
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return launcher, run_dir


def _wait(launcher: subprocess.Popen, what: str, ready, timeout: float = 90.0):
    """Poll `ready()` until it returns something truthy; fail if the launcher ends first."""
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            out, err = launcher.communicate()
            raise AssertionError(f"never saw {what} (launcher exit {launcher.returncode}):\n"
                                 f"{(out + err)[-3000:]}")
        time.sleep(0.1)
    return found


def _log(run_dir: Path, rank: int) -> str:
    try:
        return (run_dir / "logs" / f"rank-{rank}.log").read_text()
    except FileNotFoundError:
        return ""


def _role_pid(launcher: subprocess.Popen, run_dir: Path, role: str, index: int,
              rank: int) -> int:
    """The pid of the role child, from the line it prints first to its rank's log."""
    line = re.compile(rf"^# scaletrain ps {role} {index}: rank {rank}, pid (\d+)$", re.M)
    return int(_wait(launcher, f"{role} {index}'s pid line in rank-{rank}.log",
                     lambda: line.search(_log(run_dir, rank))).group(1))


def _trained(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() and bool(records(run_dir))


def _finish(launcher: subprocess.Popen, timeout: float = 120.0) -> tuple[str, str]:
    try:
        return launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher.kill()
        out, err = launcher.communicate()
        raise AssertionError(f"the launcher did not finish in {timeout} s:\n{err[-3000:]}") from None


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def _cleanup(launcher: subprocess.Popen, *pids: int) -> None:
    """Whatever a failed test left behind: the launcher, and the processes it signalled."""
    launcher.kill()
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def _assert_finished_without(run_dir: Path, worker: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    ps = summary["ps"]
    assert list(ps["dead_workers"]) == [str(worker)], ps
    assert "not heard from" in ps["dead_workers"][str(worker)], ps
    assert ps["workers_alive"] == 1, ps
    assert math.isfinite(summary["final_loss"]), summary
    assert 0.0 <= summary["eval"]["accuracy"] <= 1.0, summary
    # The run went on after the death: its last records count one worker alive.
    assert records(run_dir)[-1]["workers_alive"] == 1
    assert records(run_dir)[0]["workers_alive"] == 2
    return summary


def test_sigkill_of_a_worker_the_run_finishes_without_it(tmp_path: Path) -> None:
    launcher, run_dir = _start(tmp_path)
    pid = _role_pid(launcher, run_dir, "worker", 1, rank=2)
    try:
        _wait(launcher, "a train record", lambda: _trained(run_dir))
        os.kill(pid, signal.SIGKILL)
        out, err = _finish(launcher)
    finally:
        _cleanup(launcher)

    assert launcher.returncode == 0, err[-3000:]
    _assert_finished_without(run_dir, worker=1)
    assert "scaletrain: worker 1: done" not in _log(run_dir, 2)  # it did not finish its steps
    server_log = _log(run_dir, 0)
    assert "worker 1 declared dead" in server_log, server_log[-2000:]
    assert "worker 1 declared dead" in err, err[-3000:]  # the console says so too


def test_sigstop_of_a_worker_is_declared_dead_and_killed_at_the_end(tmp_path: Path) -> None:
    launcher, run_dir = _start(tmp_path)
    pid = _role_pid(launcher, run_dir, "worker", 1, rank=2)
    try:
        _wait(launcher, "a train record", lambda: _trained(run_dir))
        os.kill(pid, signal.SIGSTOP)
        _, err = _finish(launcher)
        gone = _gone(pid)
    finally:
        _cleanup(launcher, pid)

    assert launcher.returncode == 0, err[-3000:]
    summary = _assert_finished_without(run_dir, worker=1)
    silent = float(re.search(r"not heard from for ([\d.]+) s",
                             summary["ps"]["dead_workers"]["1"]).group(1))
    assert silent >= LEASE_S, summary["ps"]["dead_workers"]
    assert gone, f"the stopped worker {pid} outlived the run"
    assert "did not leave after the run ended" in _log(run_dir, 2)  # its supervisor killed it


def test_a_late_message_from_a_dead_worker_is_refused(tmp_path: Path) -> None:
    launcher, run_dir = _start(tmp_path)
    pid = _role_pid(launcher, run_dir, "worker", 1, rank=2)
    try:
        _wait(launcher, "a train record", lambda: _trained(run_dir))
        os.kill(pid, signal.SIGSTOP)
        _wait(launcher, "'declared dead' in rank-0.log",
              lambda: "worker 1 declared dead" in _log(run_dir, 0))
        os.kill(pid, signal.SIGCONT)
        _wait(launcher, "worker 1 leaving", lambda: _gone(pid), timeout=30)
        finished_then = (run_dir / "logs" / "ps-finished").exists()
        _, err = _finish(launcher)
    finally:
        _cleanup(launcher, pid)

    worker_log = _log(run_dir, 2)
    assert "worker 1 was declared dead by the servers" in worker_log, worker_log[-2000:]
    assert "refused" in worker_log
    assert "did not leave" not in worker_log  # it left by itself, nobody killed it
    assert not finished_then, "the run ended before the woken worker was refused"
    assert launcher.returncode == 0, err[-3000:]
    _assert_finished_without(run_dir, worker=1)


def test_a_killed_server_ends_the_run_and_its_checkpoint_survives(tmp_path: Path) -> None:
    launcher, run_dir = _start(tmp_path, "checkpoint.every=50")
    pid = _role_pid(launcher, run_dir, "server", 0, rank=0)
    try:
        _wait(launcher, "a checkpoint", lambda: list_checkpoints(run_dir / "checkpoints"))
        saved = list_checkpoints(run_dir / "checkpoints")[-1]
        os.kill(pid, signal.SIGKILL)
        out, err = _finish(launcher)
    finally:
        _cleanup(launcher)

    assert launcher.returncode != 0, err[-3000:]
    assert "parameter server 0" in err, err[-3000:]
    console = out + err
    assert "Traceback" not in console, console[-3000:]
    assert not (run_dir / "summary.json").exists()
    survivor = latest_valid(run_dir / "checkpoints")
    assert survivor is not None and survivor.name >= saved.name, survivor
