"""Parameter servers stop and resume: a run stopped at a server checkpoint continues with
`--resume` and finishes; under sync (float64) the resumed run is bit-identical to an
uninterrupted one, with one server or two; async resumes and finishes; the checkpoint holds
the servers' own state, so the summary counts every update of the whole run."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from scaletrain.checkpoint.files import list_checkpoints

from harness import config_toml, load_weights, max_abs_diff, records, run_cli, run_workers

pytestmark = pytest.mark.slow

WORKERS, STEPS, STOP = 2, 30, 12

CONFIG = config_toml(
    "ps-resume",
    train={"steps": STEPS, "global_batch": 64, "micro_batch": 32, "eval_examples": 128},
    optim={"lr": 3e-3, "warmup_steps": 2},
    parallel={"strategy": "ps", "dp": WORKERS, "timeout_s": 60},
    ps={"worker_timeout_s": 10},
    checkpoint={"every": 6},
    log={"every": 1, "quiet": True},
)


def _config(tmp_path: Path) -> Path:
    config = tmp_path / "cfg.toml"
    if not config.exists():
        config.write_text(CONFIG)
    return config


def _run(config: Path, run_dir: Path, *overrides: str, servers: int = 1) -> None:
    run_workers(
        config,
        [f"ps.servers={servers}", *overrides],
        world_size=servers + WORKERS,
        run_dir=run_dir,
        timeout=150,
    )


def _stopped(config: Path, run_dir: Path, *overrides: str, servers: int = 1) -> None:
    """A run stopped by train.stop_after: its checkpoint is there, its summary is not."""
    _run(config, run_dir, f"train.stop_after={STOP}", *overrides, servers=servers)
    assert list_checkpoints(run_dir / "checkpoints")[-1].name == f"step-{STOP:08d}"
    assert not (run_dir / "summary.json").exists()
    assert max(r["step"] for r in records(run_dir)) == STOP


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir)}  # the last record of each step


def test_a_stopped_run_resumes_with_the_launcher_and_finishes(tmp_path: Path) -> None:
    config = _config(tmp_path)
    run_dir = tmp_path / "run"
    _stopped(config, run_dir, "ps.mode=ssp", "ps.staleness=1")

    r = run_cli(
        [
            "train",
            str(config),
            "--nproc",
            str(1 + WORKERS),
            "--run-dir",
            str(run_dir),
            "ps.mode=ssp",
            "ps.staleness=1",
            "--resume",
        ],
        timeout=150,
    )

    assert r.returncode == 0, r.stderr[-3000:]
    summary = _summary(run_dir)
    assert summary["steps"] == STEPS and math.isfinite(summary["final_loss"])
    # Continued from the checkpoint at STOP: every step logged once, none run twice.
    assert [rec["step"] for rec in records(run_dir)] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path, servers: int) -> None:
    config = _config(tmp_path)
    exact = ["ps.mode=sync", "precision.mode=fp64"]
    reference, run_dir = tmp_path / "reference", tmp_path / "resumed"
    _run(config, reference, *exact, servers=servers)
    _stopped(config, run_dir, *exact, servers=servers)

    _run(config, run_dir, *exact, servers=servers)

    # Resumed from the checkpoint, not retrained from step 0 (which would match as well).
    assert [r["step"] for r in records(run_dir)] == list(range(1, STEPS + 1))
    assert max_abs_diff(load_weights(reference), load_weights(run_dir)) == 0.0
    ref, got = _losses(reference), _losses(run_dir)
    assert [got[s] for s in range(STOP + 1, STEPS + 1)] == [
        ref[s] for s in range(STOP + 1, STEPS + 1)
    ]
    # Not vacuous: training moved the loss well past rounding over the resumed steps.
    assert abs(ref[STOP + 1] - ref[STEPS]) > 1e-2
    assert _summary(run_dir)["ps"]["updates"] == _summary(reference)["ps"]["updates"] == STEPS


@pytest.fixture(scope="module")
def async_resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Counter]:
    """An async run stopped at STOP and resumed to the end; the staleness logged before."""
    tmp = tmp_path_factory.mktemp("async")
    config = _config(tmp)
    run_dir = tmp / "run"
    _stopped(config, run_dir, "ps.mode=async")
    before = Counter(s for r in records(run_dir) for s in r["staleness"])
    _run(config, run_dir, "ps.mode=async")
    return run_dir, before


def test_async_resumes_and_finishes(async_resumed: tuple[Path, Counter]) -> None:
    run_dir, before = async_resumed
    summary = _summary(run_dir)
    assert summary["steps"] == STEPS
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] < losses[1]
    assert summary["eval"]["accuracy"] > 0.5, summary["eval"]
    assert sum(summary["ps"]["staleness_histogram"].values()) > sum(before.values())


def test_the_checkpoint_holds_the_servers_state(async_resumed: tuple[Path, Counter]) -> None:
    run_dir, before = async_resumed
    ps = _summary(run_dir)["ps"]
    whole_run = WORKERS * STEPS  # async: one update per worker gradient
    assert sum(before.values()) == WORKERS * STOP
    histogram = Counter({int(k): n for k, n in ps["staleness_histogram"].items()})
    assert sum(histogram.values()) == whole_run, histogram
    assert sum(ps["delay_histogram"].values()) == whole_run
    assert ps["updates"] == whole_run  # the server's version counts on from the checkpoint
    assert all(histogram[k] >= n for k, n in before.items())  # the pre-stop updates are in it


def test_every_update_is_logged_across_a_resume(async_resumed: tuple[Path, Counter]) -> None:
    # The log and the summary agree on what was applied, resume or not: every record is a
    # whole window of log.every global steps, and the records' staleness lists are the
    # histogram.
    run_dir, _ = async_resumed
    for r in records(run_dir):
        assert r["examples"] == 64 and len(r["staleness"]) == WORKERS, r
    histogram = {int(k): n for k, n in _summary(run_dir)["ps"]["staleness_histogram"].items()}
    assert histogram == Counter(s for r in records(run_dir) for s in r["staleness"])
