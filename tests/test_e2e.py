"""End to end through the real launcher (torchrun's elastic agent): the run directory, the
report, two "nodes" meeting through the c10d rendezvous, and failures that must not hang."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from harness import (
    cli_env,
    cli_main,
    config_toml,
    free_port,
    records,
    run_cli,
    spawn_ranks,
    start_cli,
    wait_until,
    worker_pids,
)

pytestmark = pytest.mark.slow

SMALL = config_toml(
    "e2e",
    optim={"lr": 1e-2},
    train={
        "steps": 40,
        "global_batch": 32,
        "micro_batch": 16,
        "eval_every": 20,
        "eval_examples": 200,
    },
    log={"every": 5, "quiet": True},
)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "cfg.toml"
    path.write_text(SMALL)
    return path


def test_two_nodes_meet_through_c10d_rendezvous_and_write_the_whole_run_directory(
    tmp_path: Path, config: Path
) -> None:
    """Two launcher processes, one worker each, on loopback: one world of 2 that trains and
    writes the whole run directory, as one launcher with --nproc 2 does (that path, one
    node of 2 workers, is what tests/test_launch_signals.py, test_killed_rank_ends_the_run
    below and tests/test_api.py launch)."""
    run_dir, port = tmp_path / "run", free_port()
    common = [
        "train",
        str(config),
        "--nnodes",
        "2",
        "--nproc",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "two-nodes",
        "--run-dir",
        str(run_dir),
    ]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "scaletrain", *common, "--node-rank", str(i)],
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [n.communicate(timeout=150) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    for n, (_, err) in zip(nodes, outs):
        assert n.returncode == 0, err[-3000:]
    assert f"run directory {run_dir}" in outs[0][0]
    for name in ("config.toml", "metrics.jsonl", "model.safetensors", "summary.json", "report.png"):
        assert (run_dir / name).is_file(), name
    assert "global_batch = 32" in (run_dir / "config.toml").read_text()
    train = records(run_dir)
    assert [r["step"] for r in train] == list(range(5, 41, 5))
    for field in (
        "step",
        "loss",
        "lr",
        "grad_norm",
        "examples",
        "tokens",
        "examples_per_s",
        "tokens_per_s",
        "step_time_s",
        "peak_mem_bytes",
    ):
        assert field in train[0], field
    assert train[0]["examples"] == 5 * 32
    assert train[-1]["loss"] < train[0]["loss"]
    evals = records(run_dir, "eval")
    assert [e["step"] for e in evals] == [20, 40] and evals[-1]["accuracy"] > 0.5
    weights = load_file(str(run_dir / "model.safetensors"))
    assert not any(k.startswith("module.") for k in weights)  # no DDP prefix
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 40
    assert summary["eval"]["accuracy"] == evals[-1]["accuracy"]

    out = tmp_path / "both.png"
    assert cli_main(["report", str(run_dir), str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def _wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.2)


@pytest.mark.parametrize("victim", [1, 0])
def test_killed_rank_ends_the_run_naming_it(tmp_path: Path, config: Path, victim: int) -> None:
    """One paragraph names the rank and where its output is; no C++ frames, no tracebacks.

    Killing rank 0 takes the rendezvous store with it: rank 1's store calls then print a
    page of C++ frames, which must stay in rank 1's log."""
    run_dir = tmp_path / "run"
    launcher = start_cli(
        [
            "train",
            str(config),
            "--nproc",
            "2",
            "--run-dir",
            str(run_dir),
            "train.steps=100000",
            "log.every=1",
            "parallel.timeout_s=20",
        ]
    )
    try:
        wait_until(
            (run_dir / "metrics.jsonl").exists, launcher=launcher, what="a record", timeout=90
        )
        pids = worker_pids(launcher.pid)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[victim], signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 1
    for noise in ("TCPStore", "sendBytes", "frame #", "Traceback", "closing signal"):
        assert noise not in err, err[-3000:]
    paragraph = [line for line in err.splitlines() if line.startswith("scaletrain: error:")]
    assert len(paragraph) == 1, err[-3000:]
    log = run_dir / "logs" / f"rank-{victim}.log"
    assert (
        f"rank {victim} (pid {pids[victim]}, local rank {victim}) was killed by SIGKILL"
        in paragraph[0]
        and f"its output is in {log}" in paragraph[0]
    ), paragraph[0]
    for rank in (0, 1):  # each rank's own output is kept, from its first line on
        text = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert text.startswith(f"# scaletrain worker: rank {rank} of 2"), text[:300]


def test_one_process_prints_evals_labels_throughput_and_writes_readable_weights(
    tmp_path: Path, config: Path
) -> None:
    run_dir = tmp_path / "run"
    r = run_cli(
        [
            "train",
            str(config),
            "--run-dir",
            str(run_dir),
            "train.steps=20",
            "train.eval_every=10",
            "log.quiet=false",
            "checkpoint.every=10",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"^scaletrain: eval at step 10: loss \d\S*, accuracy \d", r.stdout, re.M), (
        r.stdout
    )
    done = next(line for line in r.stdout.splitlines() if line.startswith("scaletrain: done"))
    assert re.search(
        r"^scaletrain: done in [\d.]+ s \([\d.]+ s training, [\d.]+ s evaluating\), .*; "
        r"\d+ examples/s while training$",
        done,
    ), done
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["examples"] == 20 * 32 and summary["eval_time_s"] > 0
    # the rate is the training's alone: the evaluations' seconds are not in it
    assert summary["examples_per_s"] == pytest.approx(
        summary["examples"] / summary["train_time_s"], rel=1e-12
    )
    umask = os.umask(0)
    os.umask(umask)
    assert (run_dir / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    out = tmp_path / "exported.safetensors"
    assert cli_main(["export", str(run_dir), str(out)]) == 0
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


def test_hung_rank_times_out_naming_the_collective_and_the_rank(
    tmp_path: Path, config: Path
) -> None:
    """Rank 1 is stopped (SIGSTOP): rank 0's gradient all-reduce times out and says who."""
    run_dir, port = tmp_path / "run", free_port()
    args = [
        "train",
        str(config),
        "--run-dir",
        str(run_dir),
        "train.steps=100000",
        "log.every=1",
        "parallel.timeout_s=4",
    ]
    # each rank forked from the session's zygote: no interpreter start
    zygote, ranks = spawn_ranks(
        args, world_size=2, port=port, cwd=tmp_path, outputs=tmp_path, TORCHELASTIC_RUN_ID="hang"
    )
    try:
        _wait_for(lambda: (run_dir / "metrics.jsonl").exists(), timeout=90)
        os.kill(ranks[1], signal.SIGSTOP)
        started = time.monotonic()
        code = zygote.wait(ranks[0], timeout=60)
        waited = time.monotonic() - started
    finally:
        for r in ranks:
            zygote.kill(r)  # SIGKILL ends a stopped process too
    err = (tmp_path / "rank-0.err").read_text()
    assert code == 1, err[-3000:]
    assert "collective '" in err and "rank(s) 1 did not arrive" in err, err[-3000:]
    assert waited < 30
