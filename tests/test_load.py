"""Foreign load (runtime/load.py): whose CPU time a Meter counts as someone else's.

Other processes may load the machine while these run, so no test asserts an absolute load.
Each pairs two meters over nested windows: a witness in a child process, whose tree holds
only itself, and one in the test's own process. What the witness sees beyond the test's
meter is then the test's own burn, whatever else ran. Every burn is a fixed amount of CPU
time (not of wall time) and every hand-over waits for a line the other side printed, so
neither the machine's speed nor its load decides the outcome.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import scaletrain.runtime.load as load_module
from scaletrain.runtime.load import Load, Meter, cpu_ticks, wait_quiet

TIMEOUT_S = 60
# load.py is stdlib only: loaded from its file, a witness starts without the torch that
# scaletrain.runtime's __init__ imports
WITNESS = f"""
import dataclasses, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("load", {str(Path(load_module.__file__))!r})
load = sys.modules["load"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(load)
with load.Meter() as m:
    print("started", flush=True)
    sys.stdin.readline()
print(json.dumps(dataclasses.asdict(m.load)), flush=True)
"""
# a child that burns `seconds` of its own CPU time, says so, and waits (alive) to be told to go
BURNER = """
import sys, time
while time.process_time() < {seconds}:
    pass
print("burnt", flush=True)
sys.stdin.readline()
"""


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _expect(proc: subprocess.Popen, line: str) -> None:
    assert proc.stdout.readline().strip() == line


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate("go\n", timeout=TIMEOUT_S)
    return out


def _burn(cpu_s: float) -> None:
    end = time.process_time() + cpu_s
    while time.process_time() < end:
        pass


def test_a_meter_counts_its_parents_work_as_foreign() -> None:
    """The test process burns 1 s of CPU inside a child's meter: the child counts it,
    the test's own meter does not (its process is its own)."""
    witness = _start(WITNESS)
    try:
        _expect(witness, "started")
        with Meter() as mine:
            _burn(1.0)
        seen = Load(**json.loads(_finish(witness)))
    finally:
        witness.kill()
    assert _beyond(seen, mine.load) > 0.8, (seen, mine.load)


def _beyond(seen: Load, mine: Load) -> float:
    """CPU seconds the witness counted as foreign beyond what the test's own meter did."""
    return seen.foreign_cores * seen.wall_s - mine.foreign_cores * mine.wall_s


def test_a_meter_counts_its_live_childrens_work_as_its_own() -> None:
    """A child of the test's process burns 1 s of CPU and is still alive when the test's
    meter ends: the meter counts it as its own, a sibling witness as foreign."""
    witness = _start(WITNESS)
    try:
        _expect(witness, "started")
        with Meter() as mine:
            burner = _start(BURNER.format(seconds=1.0))
            _expect(burner, "burnt")
        _finish(burner)  # reaped, but inside the witness's window
        seen = Load(**json.loads(_finish(witness)))
    finally:
        witness.kill()
    # the witness saw the burn and whatever else ran in the test's window (its own is
    # longer); the test's meter saw only the rest
    assert _beyond(seen, mine.load) > 0.8, (seen, mine.load)


def test_only_the_cpus_this_process_may_use_are_read() -> None:
    stat = (
        "cpu  900 90 900 9000 90 90 90 90 0 0\n"
        "cpu0 100 10 100 1000 10 10 10 10 0 0\n"
        "cpu1 200 20 200 2000 20 20 20 20 0 0\n"
        "cpu2 400 40 400 4000 40 40 40 40 0 0\n"
        "intr 33821205 0 0\n"
        "ctxt 77766670\n"
    )
    # user + nice + system (irq and softirq left out), steal apart
    assert cpu_ticks(stat, {0, 2}) == (100 + 10 + 100 + 400 + 40 + 400, 10 + 40)
    assert cpu_ticks(stat, set()) == (0, 0)


def test_waiting_for_quiet_ends_at_its_limit() -> None:
    load = wait_quiet(limit_s=0, threshold=-1.0, step_s=0.05)
    assert load.wall_s >= 0.05 and load.noisy == (load.foreign_cores > 0.10)
    assert "cores busy outside this run" in load.describe()
