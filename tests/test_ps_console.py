"""What a parameter-server run shows on the console, through the real launcher: what a
collective run shows (start-up lines with their seconds, the evaluations as they happen,
the outcome), and no internal line; the rank's log keeps the line that names each role's
process (tests and operators find the pid to signal there).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness import run_cli

pytestmark = pytest.mark.slow

CONFIG = """
name = "ps-console"
[model]
name = "mlp"
size = "tiny"
[data]
source = "digits"
[train]
steps = 20
global_batch = 64
micro_batch = 32
eval_every = 10
eval_examples = 128
[parallel]
strategy = "ps"
dp = 1
[ps]
mode = "async"
[log]
every = 5
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp("ps-console")
    (root / "cfg.toml").write_text(CONFIG)
    r = run_cli(
        ["train", str(root / "cfg.toml"), "--nproc", "2", "--run-dir", str(root / "run")],
        timeout=180,
        cwd=root,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr, root / "run"


def test_the_console_has_the_start_up_lines_of_a_collective_run(run) -> None:
    console, _ = run
    phases = re.findall(r"^scaletrain: (\S+).* \(\d+\.\d s\)$", console, re.M)
    assert phases[:2] == ["1", "data:"], console  # "1 parameter server(s) and 1 worker(s) up"
    assert "model:" in phases and phases[-1] == "ready:", console
    assert re.search(r"^scaletrain: 1 parameter server\(s\) and 1 worker\(s\) up", console, re.M)
    assert re.search(r"^scaletrain: model: .*1 parameter server.*ps\.mode = 'async'", console, re.M)


def test_the_console_shows_the_evaluations(run) -> None:
    console, _ = run
    assert re.search(r"^scaletrain: eval at step 10: loss \S+, accuracy \S+$", console, re.M), (
        console
    )


def test_the_console_has_no_internal_line_and_the_log_names_the_process(run) -> None:
    console, run_dir = run
    assert "# scaletrain" not in console, console
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert re.search(r"^# scaletrain worker: rank 0 is ps server 0, pid \d+$", log, re.M)
    worker_log = (run_dir / "logs" / "rank-1.log").read_text()
    assert re.search(r"^# scaletrain worker: rank 1 is ps worker 0, pid \d+$", worker_log, re.M)
