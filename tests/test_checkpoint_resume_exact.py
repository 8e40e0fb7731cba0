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

from scaletrain.checkpoint.files import list_checkpoints

from harness import Case, CaseResult, config_toml, load_weights, records

pytestmark = pytest.mark.slow

# float64: the run is exact on any CPU; the comparison is exact too (torch.equal, ==).
CONFIG = config_toml(
    model={"dropout": 0.1},
    optim={"lr": 3e-3, "warmup_steps": 2},
    train={"steps": 8, "global_batch": 32, "micro_batch": 8, "eval_examples": 32},
    precision={"mode": "fp64"},
    log={"every": 3, "quiet": True},
)

# Every number a step record holds that a resume must reproduce (not times or memory).
SAME_IN_RECORDS = (
    "loss",
    "lr",
    "grad_norm",
    "examples",
    "tokens",
    "examples_seen",
    "tokens_seen",
    "skipped_steps",
    "loss_scale",
    "comm_bytes_per_step",
)

HOOKS = ("fp16", "bf16", "powersgd", "batched-powersgd")
# name -> (world size, overrides, stop after, leg run between the stop and the resume)
SCENARIOS = {
    # Compression from step 3 on, so the stop (after 4) falls inside it; a window of 3
    # steps around it checks comm_bytes_per_step too.
    **{
        f"hook-{hook}": (
            2,
            ("parallel.dp=2", f"parallel.comm_hook={hook}", "parallel.powersgd_start_iter=2"),
            4,
            None,
        )
        for hook in HOOKS
    },
    # 2**22 overflows: steps 1-4 are skipped as the scale halves, then it grows every 2
    # clean steps. The stop after 3 falls inside the overflow streak.
    "fp16-scale": (
        1,
        (
            "precision.mode=fp16-mixed",
            "precision.init_scale=4194304.0",
            "precision.growth_interval=2",
            "train.max_bad_steps=8",
            "log.every=1",
        ),
        3,
        None,
    ),
    "async": (1, ("checkpoint.async_save=true", "checkpoint.every=2"), 4, None),
    "shards": (
        2,
        ("data.source=shards", "data.path={shards}", "data.shuffle_window=256", "parallel.dp=2"),
        4,
        None,
    ),
    "truncated": (
        1,
        ("checkpoint.every=2", "checkpoint.keep=3"),
        6,
        "test_checkpoint_resume_exact:truncate_newest",
    ),
}
# The scale never gets low enough: every step overflows, max_bad_steps = 5 ends the run.
STREAK = (
    "precision.mode=fp16-mixed",
    "precision.init_scale=1e30",
    "train.max_bad_steps=5",
    "log.every=1",
)


def no_final_weights(run_dir: Path) -> None:
    """Between the legs: the stopped run wrote no final weights."""
    assert not (run_dir / "model.safetensors").exists()


def truncate_newest(run_dir: Path) -> None:
    no_final_weights(run_dir)
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    assert newest.name == "step-00000006"
    data = next(newest.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-100])


@pytest.fixture(scope="module")
def runs(trained, tmp_path_factory) -> dict[tuple[str, str], CaseResult]:
    """{(scenario, "reference" | "resumed"): result}: uninterrupted vs stopped-and-resumed
    on one run directory, each world size in one job (harness.run_job). Workers resume
    from the newest valid checkpoint by themselves (as an elastic restart)."""
    from scaletrain.data.shard_writer import write_shards

    shards = tmp_path_factory.mktemp("exact-shards")
    write_shards("digits", shards, rows_per_shard=500, row_group_rows=128)
    cases: dict[int, dict[str, Case]] = {1: {}, 2: {}}
    for name, (world, overrides, stop, between) in SCENARIOS.items():
        overrides = tuple(o.format(shards=shards) for o in overrides)
        cases[world][f"{name}-reference"] = Case.of(CONFIG, *overrides)
        cases[world][f"{name}-resumed"] = Case(
            CONFIG,
            (
                (*overrides, f"train.stop_after={stop}"),
                between or "test_checkpoint_resume_exact:no_final_weights",
                overrides,
            ),
        )
    cases[1]["streak-reference"] = Case.of(CONFIG, *STREAK, expect_ok=False)
    cases[1]["streak-resumed"] = Case(
        CONFIG, ((*STREAK, "train.stop_after=3"), STREAK), expect_ok=False
    )
    out = {}
    for world, asked in cases.items():
        for name, result in trained(asked, world_size=world).items():
            out[tuple(name.rsplit("-", 1))] = result
    return out


def _by_step(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in records(run_dir)}  # a re-run step: its last record


def assert_resume_is_exact(runs: dict, name: str) -> Path:
    """The scenario's resumed run equals its uninterrupted one; returns the former's dir."""
    stop = SCENARIOS[name][2]
    reference, resumed = runs[(name, "reference")].run_dir, runs[(name, "resumed")]
    assert "resumed from" not in resumed.stdout[-1]  # log.quiet; the record says it instead
    a, b = load_weights(reference), load_weights(resumed.run_dir)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed run differs in {different}"
    ref, got = _by_step(reference), _by_step(resumed.run_dir)
    assert sorted(ref) == sorted(got)
    for step in (s for s in ref if s > stop):
        for key in SAME_IN_RECORDS:
            assert got[step].get(key) == ref[step].get(key), (step, key)
    summary = [json.loads((d / "summary.json").read_text()) for d in (reference, resumed.run_dir)]
    assert summary[0]["skipped_steps"] == summary[1]["skipped_steps"]
    return resumed.run_dir


@pytest.mark.parametrize("hook", HOOKS)
def test_resume_with_a_comm_hook_is_exact(runs: dict, hook: str) -> None:
    # run_job exports OMP_NUM_THREADS to the workers as the launcher (and torchrun) does
    # (1 on 2 ranks of 2 cores); without it PowerSGD's matmuls in gloo's callback threads
    # run on MKL's default threads and are not even reproducible run to run.
    assert_resume_is_exact(runs, f"hook-{hook}")


def test_resume_with_a_moving_fp16_loss_scale_is_exact(runs: dict) -> None:
    resumed = assert_resume_is_exact(runs, "fp16-scale")
    scales = [r["loss_scale"] for r in records(resumed)]
    assert scales[0] < 4194304.0 and max(scales[4:]) > min(scales)  # it moved down and up
    assert json.loads((resumed / "summary.json").read_text())["skipped_steps"] >= 3


def test_resume_after_async_saves_is_exact(runs: dict) -> None:
    assert_resume_is_exact(runs, "async")


def test_resume_from_shards_is_exact(runs: dict) -> None:
    assert_resume_is_exact(runs, "shards")


def test_a_truncated_newest_checkpoint_is_moved_aside_and_the_run_finishes(runs: dict) -> None:
    resumed = assert_resume_is_exact(runs, "truncated")
    # Resumed from step 4, saved step 6 again (its name was free), and kept the damaged one.
    names = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    assert [n for n in names if n.startswith("step-00000006.corrupt-")], names
    assert "step-00000006" in names and "step-00000008" in names


def test_an_overflow_streak_across_the_stop_ends_the_run_at_the_same_step(runs: dict) -> None:
    reference, resumed = runs[("streak", "reference")], runs[("streak", "resumed")]
    assert resumed.codes[0] == 0, resumed.stderr[0][-2000:]  # stopped after 3, as asked

    def diverged(code: int, stderr: str) -> str:
        assert code == 1, stderr[-2000:]
        return next(
            line
            for line in stderr.splitlines()
            if line.startswith("scaletrain: error: training stopped")
        )

    message = diverged(reference.codes[0], reference.stderr[0])
    assert "at step 5" in message and "5 consecutive steps" in message
    assert diverged(resumed.codes[-1], resumed.stderr[-1]) == message  # same step, streak, ...
