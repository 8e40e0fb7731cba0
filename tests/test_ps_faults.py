"""Parameter servers under faults, through the real launcher, with two servers (server 0
decides who is alive and tells server 1; both must refuse the same workers).

One sync run of 2 servers and 4 workers takes three faults at once, each held by a
condition, not a race: once the first train record is written, worker 1 is SIGKILLed and
workers 2 and 3 are SIGSTOPped (before that, what every role listens on is read from
/proc: loopback only, ps.interface's default). Sync cannot move without them, so the run waits until both
servers have logged every one of them declared dead (after ps.worker_timeout_s); then
worker 2 gets SIGCONT, is told it was declared dead (its late messages refused) and leaves
by itself, while worker 3 stays stopped and is killed by its supervisor once the run has
finished with worker 0 alone. A second run (two servers, one worker) kills server 0: the
run ends with an error naming it, and its checkpoints survive."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from scaletrain.checkpoint.files import latest_valid, list_checkpoints

from harness import config_toml, env_of, listening, records, start_cli, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LEASE_S = 2.0  # ps.worker_timeout_s
SERVERS, WORKERS = 2, 4
WAIT_S = 300.0  # for any one condition; a loaded CI machine starts 6 ranks slowly

CONFIG = config_toml(
    "ps-faults",
    train={"steps": 150, "global_batch": 64, "micro_batch": 16, "eval_examples": 256},
    optim={"lr": 0.01},
    parallel={"strategy": "ps", "dp": WORKERS, "timeout_s": 60},
    ps={"mode": "sync", "servers": SERVERS, "worker_timeout_s": LEASE_S},
    log={"every": 10, "quiet": True},
)


def _start(root: Path, *overrides: str, workers: int = WORKERS) -> tuple[subprocess.Popen, Path]:
    root.mkdir(parents=True, exist_ok=True)
    config = root / "cfg.toml"
    config.write_text(CONFIG)
    run_dir = root / "run"
    launcher = start_cli(
        [
            "train",
            str(config),
            "--nproc",
            str(SERVERS + workers),
            f"parallel.dp={workers}",
            "--run-dir",
            str(run_dir),
            *overrides,
        ]
    )
    return launcher, run_dir


def _wait(launcher: subprocess.Popen, what: str, ready, timeout: float = WAIT_S):
    return wait_until(ready, launcher=launcher, what=what, timeout=timeout)


def _log(run_dir: Path, rank: int) -> str:
    try:
        return (run_dir / "logs" / f"rank-{rank}.log").read_text()
    except FileNotFoundError:
        return ""


def _role_pid(launcher: subprocess.Popen, run_dir: Path, role: str, index: int, rank: int) -> int:
    """The pid of the role child, from the line it prints first to its rank's log."""
    line = re.compile(rf"^# scaletrain worker: rank {rank} is ps {role} {index}, pid (\d+)$", re.M)
    return int(
        _wait(
            launcher,
            f"{role} {index}'s pid line in rank-{rank}.log",
            lambda: line.search(_log(run_dir, rank)),
        ).group(1)
    )


def _trained(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() and bool(records(run_dir))


def _finish(launcher: subprocess.Popen, timeout: float = WAIT_S) -> tuple[str, str]:
    try:
        return launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher.kill()
        out, err = launcher.communicate()
        raise AssertionError(
            f"the launcher did not finish in {timeout} s:\n{err[-3000:]}"
        ) from None


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
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


def _declared_everywhere(run_dir: Path, worker: int) -> bool:
    """Both servers have logged the worker declared dead (server 0 decided, server 1 was
    told)."""
    return all(
        f"parameter server {k}: worker {worker} declared dead" in _log(run_dir, k)
        for k in range(SERVERS)
    )


class Faults:
    """What the faulted run left: its run directory, console, and facts seen on the way."""

    def __init__(
        self,
        run_dir: Path,
        out: str,
        err: str,
        code: int,
        *,
        finished_before_cont: bool,
        woken_left_by_itself: bool,
        stopped_gone: bool,
        listeners: dict[str, list[tuple[str, int]]],
    ) -> None:
        self.run_dir, self.out, self.err, self.code = run_dir, out, err, code
        self.listeners = listeners  # "server 0" -> the (address, port)s it LISTENs on
        self.finished_before_cont = finished_before_cont
        self.woken_left_by_itself = woken_left_by_itself
        self.stopped_gone = stopped_gone
        self.summary = json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Faults:
    launcher, run_dir = _start(tmp_path_factory.mktemp("faults"))
    pids: dict[int, int] = {}
    try:
        for w in range(WORKERS):
            pids[w] = _role_pid(launcher, run_dir, "worker", w, rank=SERVERS + w)
        servers = {k: _role_pid(launcher, run_dir, "server", k, rank=k) for k in range(SERVERS)}
        _wait(launcher, "a train record", lambda: _trained(run_dir))
        # Every role is up and gradients were applied: what each listens on (one look each
        # at /proc, milliseconds, before the faults; the environment names the port if not)
        listeners = {
            f"{role} {i}": [(*s, env_of(pid).get("MASTER_PORT")) for s in listening(pid)]
            for role, roles in (("server", servers), ("worker", pids))
            for i, pid in roles.items()
        }
        os.kill(pids[1], signal.SIGKILL)
        os.kill(pids[2], signal.SIGSTOP)
        os.kill(pids[3], signal.SIGSTOP)
        for w in (1, 2, 3):  # sync waits for them until then: the run cannot end first
            _wait(
                launcher,
                f"worker {w} declared dead by both servers",
                lambda w=w: _declared_everywhere(run_dir, w),
            )
        finished_before_cont = (run_dir / "logs" / "ps-finished").exists()
        os.kill(pids[2], signal.SIGCONT)
        _wait(launcher, "the woken worker 2 leaving", lambda: _gone(pids[2]))
        woken_left = "did not leave after the run ended" not in _log(run_dir, SERVERS + 2)
        out, err = _finish(launcher)
        stopped_gone = _gone(pids[3])
    finally:
        _cleanup(launcher, *pids.values())
    return Faults(
        run_dir,
        out,
        err,
        launcher.returncode,
        finished_before_cont=finished_before_cont,
        woken_left_by_itself=woken_left,
        stopped_gone=stopped_gone,
        listeners=listeners,
    )


def test_every_role_listens_on_loopback_only(faults: Faults) -> None:
    """With ps.interface = "lo" (the default) no server or worker accepts a connection from
    outside the machine: every socket they LISTEN on (TensorPipe's, the servers' gloo group,
    the store) is 127.0.0.1's. Seen on this run's 6 roles before the faults."""
    assert sorted(faults.listeners) == [f"server {k}" for k in range(SERVERS)] + [
        f"worker {w}" for w in range(WORKERS)
    ]
    for role, sockets in faults.listeners.items():
        assert sockets, f"{role} listens on nothing: wrong pid?"
        outside = [s for s in sockets if s[0] != "127.0.0.1"]
        assert not outside, (
            f"{role} listens beyond loopback (address, port, MASTER_PORT): {outside}"
        )


def test_the_run_finishes_with_the_survivor(faults: Faults) -> None:
    assert faults.code == 0, faults.err[-3000:]
    summary, ps = faults.summary, faults.summary["ps"]
    assert sorted(ps["dead_workers"]) == ["1", "2", "3"], ps
    assert all("not heard from" in why for why in ps["dead_workers"].values()), ps
    assert ps["workers_alive"] == 1, ps
    assert math.isfinite(summary["final_loss"]), summary
    assert 0.0 <= summary["eval"]["accuracy"] <= 1.0, summary
    # The run went on after the deaths: its last records count one worker alive.
    assert records(faults.run_dir)[0]["workers_alive"] == WORKERS
    assert records(faults.run_dir)[-1]["workers_alive"] == 1
    # Both servers applied the same steps: neither took a gradient the other refused.
    assert len(set(ps["updates_by_server"].values())) == 1, ps["updates_by_server"]
    assert "worker 1 declared dead" in faults.err, faults.err[-3000:]  # the console says so


def test_every_server_declares_the_same_workers_dead(faults: Faults) -> None:
    for k in range(SERVERS):
        log = _log(faults.run_dir, k)
        declared = sorted(
            set(re.findall(rf"parameter server {k}: worker (\d+) declared dead", log))
        )
        assert declared == ["1", "2", "3"], (k, log[-2000:])
    # Server 1 keeps no lease of its own: server 0 decided, and it gives server 0's reason,
    # word for word.
    reasons = [
        dict(
            re.findall(
                rf"parameter server {k}: worker (\d+) declared dead{by} "
                r"\(([^)]*)",
                _log(faults.run_dir, k),
            )
        )
        for k, by in ((0, ""), (1, " by server 0"))
    ]
    assert sorted(reasons[1]) == ["1", "2", "3"], _log(faults.run_dir, 1)[-2000:]
    assert reasons[0] == reasons[1]


def test_a_killed_worker_did_not_finish(faults: Faults) -> None:
    assert "scaletrain: worker 1: done" not in _log(faults.run_dir, SERVERS + 1)


def test_a_stopped_worker_woken_after_its_death_is_refused_and_leaves(faults: Faults) -> None:
    worker_log = _log(faults.run_dir, SERVERS + 2)
    assert "worker 2 was declared dead by the servers" in worker_log, worker_log[-2000:]
    assert "refused" in worker_log
    assert faults.woken_left_by_itself, worker_log[-2000:]  # nobody killed it
    assert not faults.finished_before_cont, "the run ended before the woken worker was refused"


def test_a_worker_stopped_to_the_end_is_killed_by_its_supervisor(faults: Faults) -> None:
    silent = float(
        re.search(
            r"not heard from for ([\d.]+) s", faults.summary["ps"]["dead_workers"]["3"]
        ).group(1)
    )
    assert silent >= LEASE_S, faults.summary["ps"]["dead_workers"]
    assert faults.stopped_gone, "the stopped worker 3 outlived the run"
    assert "did not leave after the run ended" in _log(faults.run_dir, SERVERS + 3)


def test_a_killed_server_ends_the_run_and_its_checkpoint_survives(tmp_path: Path) -> None:
    """Two servers and one worker; train.steps far past what any machine runs before the
    kill, which follows the first checkpoint: the run cannot end first."""
    launcher, run_dir = _start(
        tmp_path, "checkpoint.every=20", "ps.mode=async", "train.steps=10000000", workers=1
    )
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
