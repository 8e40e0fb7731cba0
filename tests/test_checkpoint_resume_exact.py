"""A run stopped after step k (`train.stop_after`) and resumed ends BIT-identical to the
uninterrupted run, and logs the same records after the resume (same metrics window, same
examples/tokens seen, comm bytes, loss scale, skipped steps): with each DDP comm hook on 2
ranks, fp16-mixed with a loss scale that overflows, halves and grows again around the
stop, asynchronous saves, Parquet shards, and a truncated newest checkpoint. Dropout is on,
so a missing RNG restore shows. An fp16 overflow streak that spans the stop ends the run at
the same step, with the same message, as without the stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import load_weights, records, run_workers
from scaletrain.checkpoint_files import list_checkpoints

pytestmark = pytest.mark.slow

# float64: the run is exact on any CPU; the comparison is exact too (torch.equal, ==).
CONFIG = """
[model]
name = "mlp"
size = "tiny"
dropout = 0.1
[data]
source = "digits"
[optim]
lr = 3e-3
warmup_steps = 2
[train]
steps = 8
global_batch = 32
micro_batch = 8
eval_examples = 32
[precision]
mode = "fp64"
[log]
every = 3
quiet = true
"""

# Every number a step record holds that a resume must reproduce (not times or memory).
SAME_IN_RECORDS = ("loss", "lr", "grad_norm", "examples", "tokens", "examples_seen",
                   "tokens_seen", "skipped_steps", "loss_scale", "comm_bytes_per_step")


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("exact") / "cfg.toml"
    path.write_text(CONFIG)
    return path


def _by_step(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in records(run_dir)}  # a re-run step: its last record


def assert_resume_is_exact(config: Path, tmp_path: Path, overrides: list[str], *,
                           world_size: int, stop_after: int = 4, damage=None) -> Path:
    """Uninterrupted vs stopped-and-resumed on the same run directory; returns the latter."""
    reference = tmp_path / "reference"
    run_workers(config, overrides, world_size=world_size, run_dir=reference)
    resumed = tmp_path / "resumed"
    run_workers(config, [*overrides, f"train.stop_after={stop_after}"], world_size=world_size,
                run_dir=resumed)
    assert not (resumed / "model.safetensors").exists()
    if damage is not None:
        damage(resumed)
    # Workers resume from the newest valid checkpoint by themselves (as an elastic restart).
    results = run_workers(config, overrides, world_size=world_size, run_dir=resumed)
    assert "resumed from" not in results[0].stdout  # log.quiet; the record says it instead
    a, b = load_weights(reference), load_weights(resumed)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed run differs in {different}"
    ref, got = _by_step(reference), _by_step(resumed)
    assert sorted(ref) == sorted(got)
    for step in (s for s in ref if s > stop_after):
        for key in SAME_IN_RECORDS:
            assert got[step].get(key) == ref[step].get(key), (step, key)
    summary = [json.loads((d / "summary.json").read_text()) for d in (reference, resumed)]
    assert summary[0]["skipped_steps"] == summary[1]["skipped_steps"]
    return resumed


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd", "batched-powersgd"])
def test_resume_with_a_comm_hook_is_exact(config: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, hook: str) -> None:
    # The launcher (and torchrun) export OMP_NUM_THREADS to workers; without it PowerSGD's
    # matmuls in gloo's callback threads run on MKL's default threads and are not even
    # reproducible run to run. The harness starts workers directly, so set it here.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Compression from step 3 on, so the stop (after 4) falls inside it; a window of 3
    # steps around it checks comm_bytes_per_step too.
    overrides = ["parallel.dp=2", f"parallel.comm_hook={hook}", "parallel.powersgd_start_iter=2"]
    assert_resume_is_exact(config, tmp_path, overrides, world_size=2)


def test_resume_with_a_moving_fp16_loss_scale_is_exact(config: Path, tmp_path: Path) -> None:
    # 2**22 overflows: steps 1-4 are skipped as the scale halves, then it grows every 2
    # clean steps. The stop after 3 falls inside the overflow streak.
    overrides = ["precision.mode=fp16-mixed", "precision.init_scale=4194304.0",
                 "precision.growth_interval=2", "train.max_bad_steps=8", "log.every=1"]
    resumed = assert_resume_is_exact(config, tmp_path, overrides, world_size=1, stop_after=3)
    scales = [r["loss_scale"] for r in records(resumed)]
    assert scales[0] < 4194304.0 and max(scales[4:]) > min(scales)  # it moved down and up
    assert json.loads((resumed / "summary.json").read_text())["skipped_steps"] >= 3


def test_resume_after_async_saves_is_exact(config: Path, tmp_path: Path) -> None:
    overrides = ["checkpoint.async_save=true", "checkpoint.every=2"]
    assert_resume_is_exact(config, tmp_path, overrides, world_size=1)


def test_resume_from_shards_is_exact(config: Path, tmp_path: Path) -> None:
    from scaletrain.data.shard_writer import write_shards

    shards = tmp_path / "shards"
    write_shards("digits", shards, rows_per_shard=500, row_group_rows=128)
    overrides = ["data.source=shards", f"data.path={shards}", "data.shuffle_window=256",
                 "parallel.dp=2"]
    assert_resume_is_exact(config, tmp_path, overrides, world_size=2)


def test_a_truncated_newest_checkpoint_is_moved_aside_and_the_run_finishes(
        config: Path, tmp_path: Path) -> None:
    def truncate_newest(run_dir: Path) -> None:
        newest = list_checkpoints(run_dir / "checkpoints")[-1]
        assert newest.name == "step-00000006"
        data = next(newest.glob("*.distcp"))
        data.write_bytes(data.read_bytes()[:-100])

    overrides = ["checkpoint.every=2", "checkpoint.keep=3"]
    resumed = assert_resume_is_exact(config, tmp_path, overrides, world_size=1, stop_after=6,
                                     damage=truncate_newest)
    # Resumed from step 4, saved step 6 again (its name was free), and kept the damaged one.
    names = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    assert [n for n in names if n.startswith("step-00000006.corrupt-")], names
    assert "step-00000006" in names and "step-00000008" in names


def test_an_overflow_streak_across_the_stop_ends_the_run_at_the_same_step(
        config: Path, tmp_path: Path) -> None:
    # The scale never gets low enough: every step overflows, max_bad_steps = 5 ends the run.
    overrides = ["precision.mode=fp16-mixed", "precision.init_scale=1e30",
                 "train.max_bad_steps=5", "log.every=1"]
    reference = run_workers(config, overrides, world_size=1, run_dir=tmp_path / "reference",
                            expect_ok=False)
    run_dir = tmp_path / "resumed"
    run_workers(config, [*overrides, "train.stop_after=3"], world_size=1, run_dir=run_dir)
    resumed = run_workers(config, overrides, world_size=1, run_dir=run_dir, expect_ok=False)

    def diverged(result) -> str:
        assert result.returncode == 1, result.stderr[-2000:]
        return next(line for line in result.stderr.splitlines()
                    if line.startswith("scaletrain: error: training stopped"))

    message = diverged(reference[0])
    assert "at step 5" in message and "5 consecutive steps" in message
    assert diverged(resumed[0]) == message  # same step, streak, first overflow, scale
