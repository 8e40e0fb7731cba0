"""`--resume` compares the new config with the checkpoint's own config.toml in the launcher,
before any process starts: a change that breaks exact resume (model, data, optimizer,
schedule, precision, seed, the comm hook...) is refused with each key's old and new value,
unless `--allow-config-change` is given, which prints what will differ. Logging, evaluation,
checkpoint cadence and the process layout may change freely. The run directory's
config.toml is never overwritten by a refused resume, nor by one whose checkpoint does not
fit the new model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import scaletrain.cli
import scaletrain.commands.train
from scaletrain.checkpoint import Checkpointer, TrainState
from scaletrain.checkpoint.files import list_checkpoints
from scaletrain.config import ConfigError, config_to_toml, load_config
from scaletrain.data.sources import TaskSpec
from scaletrain.launch.rundir import check_resumable
from scaletrain.models import build_model
from scaletrain.precision import make_precision
from scaletrain.training.optim import build_optimizer, build_scheduler

from harness import cli_main, config_toml, forbid_starting

TOML = config_toml(
    optim={"lr": 0.003},
    train={"steps": 4, "global_batch": 16, "micro_batch": 8, "eval_examples": 16},
    checkpoint={"every": 2},
    log={"quiet": True},
)


def _run_dir_with_checkpoint(tmp_path: Path, overrides: list[str] = ()) -> tuple[Path, Path]:
    """A config file, and a run directory holding a checkpoint saved with that config."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(TOML)
    run_dir = tmp_path / "run"
    saved = config_to_toml(load_config(cfg, list(overrides)))
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.toml").write_text(saved)
    model = build_model("mlp", size="tiny", task=TaskSpec("classification", (1, 8, 8), 10))
    opt = build_optimizer(
        model, name="adamw", lr=3e-3, weight_decay=0.0, betas=(0.9, 0.999), momentum=0.0
    )
    sched = build_scheduler(opt, warmup_steps=0, total_steps=4, schedule="cosine", min_lr_ratio=0.1)
    state = TrainState(model, opt, sched, make_precision("fp32", device_type="cpu"), step=2)
    Checkpointer(run_dir / "checkpoints", keep=2, async_save=False, config_toml=saved).save(state)
    return cfg, run_dir


@pytest.mark.parametrize(
    "overrides, keys",
    [
        (["model.size=small"], ["model.size ('tiny' -> 'small')"]),
        (["optim.lr=0.001", "train.seed=3"], ["optim.lr (0.003 -> 0.001)", "train.seed (0 -> 3)"]),
        (
            ["data.source=synthetic-images", "train.steps=8"],
            ["data.source ('digits' -> 'synthetic-images')", "train.steps (4 -> 8)"],
        ),
        (["precision.mode=bf16-mixed"], ["precision.mode ('fp32' -> 'bf16-mixed')"]),
        (["parallel.comm_hook=powersgd"], ["parallel.comm_hook ('none' -> 'powersgd')"]),
        (
            ["optim.warmup_steps=1", "train.global_batch=32"],
            ["optim.warmup_steps (0 -> 1)", "train.global_batch (16 -> 32)"],
        ),
    ],
)
def test_a_change_that_breaks_exact_resume_is_refused_naming_the_keys(
    tmp_path: Path, overrides: list[str], keys: list[str]
) -> None:
    cfg, run_dir = _run_dir_with_checkpoint(tmp_path)
    with pytest.raises(ConfigError) as e:
        check_resumable(run_dir, load_config(cfg, overrides))
    message = str(e.value)
    assert all(key in message for key in keys), message
    assert "step-00000002" in message and "--allow-config-change" in message
    warnings = check_resumable(run_dir, load_config(cfg, overrides), allow_config_change=True)
    assert len(warnings) == 1 and all(key in warnings[0] for key in keys)
    assert "will not match an uninterrupted one" in warnings[0]


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["log.every=1", "log.tensorboard=true"],
        ["checkpoint.keep=5", "checkpoint.every=1"],
        ["train.eval_every=2", "train.eval_examples=8"],
        ["parallel.dp=2", "train.micro_batch=4"],
        ["parallel.bucket_cap_mb=1.0", "train.threads=1", "name=again"],
    ],
)
def test_changes_that_keep_the_trajectory_pass(tmp_path: Path, overrides: list[str]) -> None:
    cfg, run_dir = _run_dir_with_checkpoint(tmp_path)
    assert check_resumable(run_dir, load_config(cfg, overrides)) == []


def test_bucket_size_matters_only_with_a_powersgd_hook(tmp_path: Path) -> None:
    cfg, run_dir = _run_dir_with_checkpoint(tmp_path, ["parallel.comm_hook=powersgd"])
    with pytest.raises(ConfigError, match=r"parallel.bucket_cap_mb \(25.0 -> 1.0\)"):
        check_resumable(
            run_dir, load_config(cfg, ["parallel.comm_hook=powersgd", "parallel.bucket_cap_mb=1.0"])
        )


def test_no_valid_checkpoint_is_refused_with_the_damage(tmp_path: Path) -> None:
    cfg, run_dir = _run_dir_with_checkpoint(tmp_path)
    data = next(list_checkpoints(run_dir / "checkpoints")[-1].glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(ConfigError, match="no valid checkpoint.*truncated"):
        check_resumable(run_dir, load_config(cfg))


# ---------------------------------------------------------------------------- the CLI


@pytest.fixture()
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record launcher calls instead of starting workers."""
    calls: list = []

    def launch(*args, **kwargs) -> int:
        calls.append(args)
        return 0

    def refuse(*args, **kwargs):
        pytest.fail("no worker runs in the launcher's process here")

    monkeypatch.setattr(scaletrain.commands.train, "launch", launch)
    monkeypatch.setattr(scaletrain.commands.train, "run_worker", refuse)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    return calls


def test_cli_refuses_before_anything_starts_and_keeps_config_toml(
    tmp_path: Path, launches: list, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, run_dir = _run_dir_with_checkpoint(tmp_path)
    before = (run_dir / "config.toml").read_bytes()
    argv = [
        "train",
        str(cfg),
        "--nproc",
        "2",
        "--run-dir",
        str(run_dir),
        "--resume",
        "model.size=small",
    ]
    assert scaletrain.cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("scaletrain: error: --resume:")
    assert "model.size ('tiny' -> 'small')" in err[0]
    assert not launches and (run_dir / "config.toml").read_bytes() == before

    assert scaletrain.cli.main([*argv, "--allow-config-change"]) == 0
    err = capsys.readouterr().err
    assert (
        "scaletrain: warning: --allow-config-change: resuming step-00000002 with "
        "model.size ('tiny' -> 'small')" in err
    )
    assert len(launches) == 1


def test_a_checkpoint_that_does_not_fit_fails_cleanly_and_keeps_config_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The checkpoint is saved in this process (what a run stopped at step 2 leaves); the
    # refused resume goes through the CLI and the trainer, in this process as well: one
    # process runs the trainer in the launcher's own process (cli.cmd_train: in_process).
    # No launcher may start; torch's thread count and OMP_NUM_THREADS (the trainer sets
    # both) are put back after.
    cfg, run_dir = _run_dir_with_checkpoint(tmp_path)
    before = (run_dir / "config.toml").read_bytes()
    run_worker = scaletrain.commands.train.run_worker
    forbid_starting(monkeypatch, tmp_path)
    monkeypatch.setattr(
        scaletrain.commands.train, "run_worker", run_worker
    )  # the in-process trainer
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    try:
        code = cli_main(
            [
                "train",
                str(cfg),
                "--run-dir",
                str(run_dir),
                "--resume",
                "--allow-config-change",
                "model.size=small",
                "optim.name=sgd",
            ]
        )
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    err = capsys.readouterr().err
    assert code == 1, err[-2000:]
    assert "scaletrain: warning: --allow-config-change" in err
    error = [line for line in err.splitlines() if line.startswith("scaletrain: error:")]
    assert error and "does not fit this run's model and optimizer" in error[-1], err[-2000:]
    assert "Traceback" not in err and "KeyError" not in err
    assert (run_dir / "config.toml").read_bytes() == before
