"""Hang reports: a rank held in `time.sleep` before the gradient all-reduce ends the run within
parallel.timeout_s + 30 s, and the one failure paragraph names that rank, the all-reduce and
the line of the sleep; the stacks and the Flight Recorder's records stay in the logs.

Also, without a process group: the paragraph's sentence read from a rank's log (faulthandler's
format) and flight record, and the failing rank's own stack written in that format.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

import scaletrain.runtime as runtime
from scaletrain.launch.hang import describe_hang, last_collective, stack_location
from scaletrain.launch.output import OutputFilter
from scaletrain.runtime import hang

from harness import config_toml, start_cli, wait_until

TIMEOUT_S = 5


def user_model(forward_body: str) -> str:
    """A user's model module (model.name = "<module>:build"): a Linear classifier whose
    training forward first runs `forward_body` (indented 12 spaces, inside
    `if torch.is_grad_enabled():`, with self.forwards counting those forwards)."""
    return f"""
import os
import time
from pathlib import Path

import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, features, classes):
        super().__init__()
        self.fc = nn.Linear(features, classes)
        self.forwards = 0

    def forward(self, x):
        if torch.is_grad_enabled():
            self.forwards += 1
{forward_body}
        return self.fc(x.flatten(1))


def build(task):
    features = 1
    for size in task.input_shape:
        features *= size
    return Model(features, task.num_classes)
"""


# model.name = "sleepy:build": rank 1 sleeps in its second training forward, so rank 0
# waits in DDP's gradient all-reduce of that step.
SLEEPY = user_model(
    """            if self.forwards == 2 and os.environ.get("RANK") == "1":
                Path("held").touch()  # the test's clock starts here
                time.sleep(600)  # HELD"""
)
SLEEP_LINE = next(i for i, line in enumerate(SLEEPY.splitlines(), 1) if "# HELD" in line)


@pytest.mark.slow
def test_rank_held_in_sleep_is_named_with_the_all_reduce_and_the_line(tmp_path: Path) -> None:
    (tmp_path / "sleepy.py").write_text(SLEEPY)
    config = tmp_path / "cfg.toml"
    config.write_text(
        config_toml(
            "hang",
            model={"name": "sleepy:build"},
            train={"steps": 50, "global_batch": 16, "micro_batch": 8},
            log={"every": 1, "quiet": True},
        )
    )
    run_dir = tmp_path / "run"
    launcher = start_cli(
        [
            "train",
            str(config),
            "--nproc",
            "2",
            "--run-dir",
            str(run_dir),
            f"parallel.timeout_s={TIMEOUT_S}",
        ],
        cwd=tmp_path,
    )
    try:
        wait_until((tmp_path / "held").exists, launcher=launcher, what="rank 1 held", timeout=120)
        held = time.monotonic()
        _, err = launcher.communicate(timeout=TIMEOUT_S + 60)
        took = time.monotonic() - held
    finally:
        launcher.kill()
    assert launcher.returncode == 1, err[-3000:]
    assert took < TIMEOUT_S + 30, (took, err[-3000:])
    paragraph = [line for line in err.splitlines() if line.startswith("scaletrain: error:")]
    assert len(paragraph) == 1, err[-3000:]
    text = paragraph[0]
    assert "rank(s) 1 did not arrive" in text, text
    assert "Where each rank was: rank 0:" in text and "; rank 1:" in text, text
    where = text[text.index("Where each rank was:") :]
    rank0, rank1 = where.split("; rank 1:")
    rank1 = "rank 1:" + rank1
    # rank 0 waits in the all-reduce; rank 1 finished an earlier collective and sleeps
    waited = re.match(
        r"Where each rank was: rank 0: last collective gloo:all_reduce #(\d+),", rank0
    )
    assert waited, where
    assert re.match(rf"rank 1: last collective \S+ #\d+, behind the others' #{waited[1]}", rank1), (
        where
    )
    assert f"Python at {tmp_path / 'sleepy.py'}:{SLEEP_LINE} in forward" in rank1, where
    for noise in ("most recent call first", 'File "', "Traceback", "# scaletrain"):
        assert noise not in err, err[-3000:]
    logs = run_dir / "logs"
    assert "time.sleep" not in text  # the stacks themselves stay in the logs
    assert f'sleepy.py", line {SLEEP_LINE} in forward' in (logs / "rank-1.log").read_text()
    for rank in (0, 1):
        record = json.loads((logs / f"flight-rank-{rank}.json").read_text())
        assert any(e["profiling_name"] == "gloo:all_reduce" for e in record["entries"])
    assert not list(logs.glob(".hang-*")), list(logs.iterdir())


# model.name = "stalled:build": both ranks wait in their second training forward until the
# test says "go": no rank is in a collective, so none times out; only the launcher's
# progress watch sees it.
STALLED = user_model(
    """            while self.forwards == 2 and not Path("go").exists():
                time.sleep(0.05)  # WAITING"""
)
WAIT_LINE = next(i for i, line in enumerate(STALLED.splitlines(), 1) if "# WAITING" in line)


@pytest.mark.slow
def test_no_step_for_the_timeout_dumps_every_rank_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "stalled.py").write_text(STALLED)
    config = tmp_path / "cfg.toml"
    config.write_text(
        config_toml(
            "stall",
            model={"name": "stalled:build"},
            train={"steps": 4, "global_batch": 16, "micro_batch": 8},
            log={"every": 1, "quiet": True},
        )
    )
    run_dir = tmp_path / "run"
    argv = ["train", str(config), "--nproc", "2", "--run-dir", str(run_dir)]
    launcher = start_cli([*argv, f"parallel.timeout_s={TIMEOUT_S}"], cwd=tmp_path)
    logs = [run_dir / "logs" / f"rank-{rank}.log" for rank in (0, 1)]

    def both_dumped() -> bool:  # each rank's log has the stack the launcher asked for
        return all(log.exists() and "on request (SIGUSR1)" in log.read_text() for log in logs)

    try:
        wait_until(both_dumped, launcher=launcher, what="both ranks' stacks", timeout=120)
        (tmp_path / "go").touch()
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    warning = [line for line in err.splitlines() if "no rank has finished a step" in line]
    assert len(warning) == 1, err[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}:" in warning[0], warning[0]
    assert warning[0].count(f"stalled.py:{WAIT_LINE} in forward") == 2, warning[0]
    assert "most recent call first" not in err, err[-3000:]


# ----------------------------------------------------------------------------- no group

FAULTHANDLER_DUMP = """\
# scaletrain worker: rank 1 of 2 (local rank 1), pid 7, host h, torch 2.13.0
Thread 0x00007f0000000001 (most recent call first):
  File "{stdlib}/threading.py", line 324 in wait
  File "{stdlib}/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "{torch}/nn/modules/module.py", line 1750 in _call_impl
  File "/home/me/own/model.py", line 12 in forward
  File "{torch}/nn/modules/module.py", line 1750 in _call_impl
  File "/home/me/own/train.py", line 40 in <module>
# scaletrain hang report: stacks dumped above on request (SIGUSR1)
"""


def _roots() -> dict[str, str]:
    import sysconfig

    import torch

    return {"stdlib": sysconfig.get_paths()["stdlib"], "torch": str(Path(torch.__file__).parent)}


def test_stack_location_is_the_main_threads_innermost_frame_outside_torch(tmp_path) -> None:
    log = tmp_path / "rank-1.log"
    log.write_text(
        "an older dump, replaced by the last one:\n" + FAULTHANDLER_DUMP.format(**_roots())
    )
    assert stack_location(log) == "/home/me/own/model.py:12 in forward"
    log.write_text("no dump here\n")
    assert stack_location(log) is None


def test_the_failing_ranks_stack_is_where_the_collective_raised(tmp_path, capsys) -> None:
    """collective_guard writes the stack the error came from (faulthandler's format), which
    the launcher reads back: the innermost frame outside torch is the caller's line."""

    def all_reduce_here() -> None:
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting")

    line = all_reduce_here.__code__.co_firstlineno + 1  # the raise: the innermost frame
    with pytest.raises(runtime.CollectiveFailure):
        with runtime.collective_guard("metrics all-reduce", step=4):
            all_reduce_here()
    log = tmp_path / "rank-0.log"
    log.write_text(capsys.readouterr().err)
    assert stack_location(log) == f"{__file__}:{line} in all_reduce_here", log.read_text()


def test_console_shows_none_of_a_dump(tmp_path) -> None:
    """Local rank 0's log is echoed to the console: its stack dumps and hang-report notes
    stay in the log (launch/output.OutputFilter)."""
    dump = FAULTHANDLER_DUMP.format(**_roots())
    own = "# scaletrain hang report: collective 'x' at step 1 failed; this rank's stack:\n"
    own += 'Stack (most recent call first):\n  File "/a/b.py", line 3 in f\n'
    shown = OutputFilter().feed(f"step 1 done\n{dump}{own}step 2 done\n")
    assert shown == "step 1 done\nstep 2 done\n", shown


def test_last_collective_reads_the_flight_record_of_this_launch(tmp_path) -> None:
    record = tmp_path / "flight-rank-0.json"
    entry = {"profiling_name": "gloo:all_reduce", "process_group": ["0", "default_pg"]}
    record.write_text(
        json.dumps(
            {
                "entries": [
                    {**entry, "collective_seq_id": 4, "time_created_ns": 1, "retired": True},
                    {**entry, "collective_seq_id": 5, "time_created_ns": 2, "retired": False},
                ]
            }
        )
    )
    assert str(last_collective(record, since=0)) == "gloo:all_reduce #5"
    assert last_collective(record, since=time.time() + 60) is None  # an earlier launch's
    logs = {0: tmp_path / "rank-0.log", 1: tmp_path / "rank-1.log"}
    logs[1].write_text(FAULTHANDLER_DUMP.format(**_roots()))
    said = describe_hang(tmp_path, logs, since=0)
    assert said.startswith(
        "Where each rank was: rank 0: last collective gloo:all_reduce #5; "
        "rank 1: no flight record, Python at /home/me/own/model.py:12 in forward."
    ), said
    assert describe_hang(tmp_path / "none", {0: tmp_path / "missing.log"}, since=0) == ""


def test_sigusr1_dumps_the_stack_and_the_flight_record(tmp_path, capfd) -> None:
    """What a worker installs at start: SIGUSR1 dumps every thread's stack (faulthandler)
    and then, in Python, the flight record into the armed logs directory."""
    old = signal.getsignal(signal.SIGUSR1)
    try:
        hang.install()
        hang.arm(tmp_path, rank=3)
        signal.raise_signal(signal.SIGUSR1)
    finally:
        import faulthandler

        faulthandler.unregister(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, old)
        hang._Armed.log_dir = None
    err = capfd.readouterr().err
    assert "Current thread" in err and "most recent call first" in err, err
    assert "test_sigusr1_dumps_the_stack_and_the_flight_record" in err
    assert "pg_status" in json.loads((tmp_path / "flight-rank-3.json").read_text())  # no group


def test_flight_recorder_is_on_before_the_group_starts(monkeypatch) -> None:
    monkeypatch.delenv(hang.FR_BUFFER_ENV, raising=False)
    hang.enable_flight_recorder()
    import os

    assert int(os.environ[hang.FR_BUFFER_ENV]) > 0
    monkeypatch.setenv(hang.FR_BUFFER_ENV, "50")
    hang.enable_flight_recorder()
    assert os.environ[hang.FR_BUFFER_ENV] == "50"  # the user's own is kept
