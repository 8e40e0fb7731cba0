"""Signals to the launcher, through the real elastic agent: Ctrl-C prints one line and exits
130; a scheduler's SIGTERM makes the workers checkpoint the current step, exits 143, and the
run resumes from that checkpoint; `kill -9` of the launcher takes its workers with it.

No test races the run: every run is STEPS long, which no machine finishes within the test's
time limits, a signal is sent only once a step has been logged, and only to a launcher that
is checked to be still running (a run that ended first fails the test, it does not pass
it). The resumed run stops by itself with `train.stop_after`, a few steps after the one
SIGTERM saved.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import (
    cli_env,
    config_toml,
    listening_addresses,
    records,
    run_cli,
    start_cli,
    wait_until,
    worker_pids,
)

pytestmark = pytest.mark.slow

STEPS = 100_000_000  # "forever": at ~1 ms per step, longer than a day
CONFIG = config_toml(
    "signals",
    train={"steps": STEPS, "global_batch": 32, "micro_batch": 16, "eval_examples": 64},
    log={"every": 1, "quiet": True},
)


def _as_from_a_terminal() -> None:
    """In the launcher's process before exec: SIGINT and SIGQUIT as a terminal's foreground
    command has them. A shell without job control starts a background command (`make test
    &` in a script, a CI runner) with both ignored; the ignore is inherited by pytest and
    its children, Python installs no KeyboardInterrupt handler over an inherited ignore, and
    the one-process launcher trained on after SIGINT (seen in clean-clone runs: /proc's
    SigIgn held SIGINT). The agent's launcher installs its own handlers, so only that case
    showed it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG)
    run_dir = tmp_path / "run"
    launcher = start_cli(
        ["train", str(config), "--run-dir", str(run_dir), "parallel.timeout_s=20", *extra],
        env=cli_env(PYTHONFAULTHANDLER="1"),  # a hang in _stop shows every thread's stack
        preexec_fn=_as_from_a_terminal,
    )
    wait_until(  # start-up: imports, the agent, the first step
        lambda: (run_dir / "metrics.jsonl").exists() and records(run_dir),
        launcher=launcher,
        what="the first record",
        timeout=180,
    )
    return launcher, run_dir


def _stop(launcher: subprocess.Popen, signum: int) -> tuple[str, list[str]]:
    """Send `signum` to the launcher, still running; return its stdout and its stderr lines."""
    try:
        if launcher.poll() is not None:
            raise AssertionError(
                f"the run ended (status {launcher.returncode}) before the "
                f"signal:\n{launcher.communicate()[1][-3000:]}"
            )
        launcher.send_signal(signum)
        try:
            out, err = launcher.communicate(timeout=90)
        except subprocess.TimeoutExpired:  # hung: the kernel's view, every thread's stack
            state = _signal_state(launcher.pid)
            launcher.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER dumps the stacks
            _, err = launcher.communicate(timeout=30)
            raise AssertionError(
                f"the launcher did not exit after {signum!r} ({state}):\n{err[-8000:]}"
            ) from None
    finally:
        launcher.kill()
    return out, [line for line in err.splitlines() if line.strip()]


def _signal_state(pid: int) -> str:
    """The process's pending, blocked, ignored and caught signal masks, and each thread's
    blocked mask, from /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        threads = [
            next(x for x in (t / "status").read_text().splitlines() if x.startswith("SigBlk"))
            for t in Path(f"/proc/{pid}/task").iterdir()
        ]
    except (OSError, StopIteration) as e:
        return f"/proc unreadable: {e}"
    own = [x for x in status if x.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))]
    return f"{'; '.join(own)}; threads' SigBlk: {sorted(set(threads))}"


def _the_one_line(lines: list[str]) -> str:
    assert not any("Traceback" in line or "frame #" in line for line in lines), lines
    others = [line for line in lines if not line.startswith("scaletrain: warning:")]
    assert len(others) == 1, "\n".join(lines[-40:])
    return others[0]


@pytest.mark.parametrize("nproc", [2, 1])
def test_ctrl_c_prints_one_line_and_exits_130(tmp_path: Path, nproc: int) -> None:
    launcher, run_dir = _start(tmp_path, "--nproc", str(nproc))
    pids = worker_pids(launcher.pid)

    _, lines = _stop(launcher, signal.SIGINT)

    assert launcher.returncode == 130, lines
    line = _the_one_line(lines)
    assert line.startswith("scaletrain: interrupted (SIGINT) at step "), line
    assert "no checkpoint to continue from" in line
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids.values())
    if nproc == 2:
        assert (run_dir / "logs/rank-0.log").read_text().startswith("# scaletrain worker: rank 0")


# Loaded by Python's `site` from PYTHONPATH: the process stops at its first `import torch`,
# says so in a file, and waits there for the signal (a condition, not a race with the import).
HOLD_AT_TORCH = """
import os, sys, time

class _Hold:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            open(os.environ["HOLD_MARK"], "w").close()
            while True:
                time.sleep(0.05)  # SIGINT raises KeyboardInterrupt here, inside the import
        return None

sys.meta_path.insert(0, _Hold())
"""


@pytest.mark.parametrize("entry", ["console script", "python -m"])
def test_ctrl_c_while_torch_imports_prints_one_line(tmp_path: Path, entry: str) -> None:
    (tmp_path / "sitecustomize.py").write_text(HOLD_AT_TORCH)
    mark = tmp_path / "holding"
    command = (
        [str(Path(sys.executable).with_name("scaletrain"))]
        if entry == "console script"
        else [sys.executable, "-m", "scaletrain"]
    )
    env = cli_env(PYTHONPATH=str(tmp_path), HOLD_MARK=str(mark))
    launcher = subprocess.Popen(
        [*command, "explain", "configs/default.toml"],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_from_a_terminal,
    )
    deadline = time.monotonic() + 60
    while not mark.exists():
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            raise AssertionError(f"never reached import torch:\n{launcher.communicate()[1]}")
        time.sleep(0.05)

    _, lines = _stop(launcher, signal.SIGINT)

    assert launcher.returncode == 130, lines
    assert _the_one_line(lines) == "scaletrain: interrupted (SIGINT)"


def test_a_single_node_run_listens_on_loopback_only(tmp_path: Path) -> None:
    """No socket of the launcher or of a worker listens beyond 127.0.0.0/8 or ::1 (the
    rendezvous, the process group's store, gloo's pairs)."""
    import ipaddress

    launcher, _ = _start(tmp_path, "--nproc", "2")
    try:
        pids = [launcher.pid, *worker_pids(launcher.pid).values()]
        assert len(pids) == 3
        listening = listening_addresses(pids)
    finally:
        _stop(launcher, signal.SIGINT)
    assert {pid for pid, _, _ in listening} >= set(pids[1:]), listening  # gloo's, at least
    beyond = [s for s in listening if not ipaddress.ip_address(s[1]).is_loopback]
    assert not beyond, f"listening beyond loopback (pid, address, port): {beyond}"


def test_sigterm_saves_the_current_step_and_the_run_resumes(tmp_path: Path) -> None:
    # checkpoint.every is past train.steps: the only checkpoint is the one SIGTERM asks for.
    every = f"checkpoint.every={10 * STEPS}"
    launcher, run_dir = _start(tmp_path, "--nproc", "2", every)

    _, lines = _stop(launcher, signal.SIGTERM)

    assert launcher.returncode == 143, lines
    line = _the_one_line(lines)
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0].startswith("step-"), saved
    step = int(saved[0].removeprefix("step-"))
    assert step > 0
    assert line == (
        f"scaletrain: interrupted (SIGTERM) at step {step}; last checkpoint "
        f"{saved[0]}; continue with: scaletrain train ... --run-dir {run_dir} --resume"
    )

    # The resume runs two steps past the saved one and stops there (train.stop_after may
    # change on resume), saving step + 2.
    r = run_cli(
        [
            "train",
            str(tmp_path / "cfg.toml"),
            "--run-dir",
            str(run_dir),
            "--nproc",
            "2",
            "parallel.timeout_s=20",
            every,
            f"train.stop_after={step + 2}",
            "--resume",
        ]
    )

    assert r.returncode == 0, r.stderr[-3000:]
    resumed = [rec["step"] for rec in records(run_dir)]
    assert resumed[-2:] == [step + 1, step + 2], resumed[-5:]
    assert f"step-{step + 2:08d}" in os.listdir(run_dir / "checkpoints")
    assert "rank-0.2.log" in os.listdir(run_dir / "logs")  # the first launch's logs are kept


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"  # exited, waiting for whoever adopted it to reap it


def test_kill_9_of_the_launcher_takes_the_workers_with_it(tmp_path: Path) -> None:
    launcher, _ = _start(tmp_path, "--nproc", "2")
    pids = worker_pids(launcher.pid)
    assert sorted(pids) == [0, 1], pids
    try:
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 5
        while not all(_gone(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in pids.values() if not _gone(p)]
    finally:
        for pid in pids.values():
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their launcher"
