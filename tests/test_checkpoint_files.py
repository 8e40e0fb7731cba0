"""Checkpoint directories on disk: a damaged newest checkpoint is moved aside on resume
(`step-N.corrupt-<time>`, kept, reported, never listed or pruned), so the next save of
step N succeeds; an old checkpoint that cannot be pruned is reported with its path and
the error, not ignored."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import scaletrain.checkpoint_files as checkpoint_files
from scaletrain.checkpoint import Checkpointer, TrainState, load
from scaletrain.checkpoint_files import latest_valid, list_checkpoints
from scaletrain.data.sources import TaskSpec
from scaletrain.models import build_model
from scaletrain.precision import make_precision
from scaletrain.training.optim import build_optimizer, build_scheduler


def _state() -> TrainState:
    torch.manual_seed(0)
    model = build_model("mlp", size="tiny", task=TaskSpec("classification", (1, 8, 8), 10))
    opt = build_optimizer(
        model, name="adamw", lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), momentum=0.0
    )
    sched = build_scheduler(
        opt, warmup_steps=0, total_steps=10, schedule="constant", min_lr_ratio=1.0
    )
    return TrainState(model, opt, sched, make_precision("fp32", device_type="cpu"))


def _save(saver: Checkpointer, state: TrainState, step: int) -> None:
    state.step = step
    saver.save(state)


def test_a_damaged_checkpoint_is_moved_aside_and_its_step_saved_again(tmp_path: Path) -> None:
    state, messages = _state(), []
    saver = Checkpointer(tmp_path, keep=2, async_save=False, config_toml="", report=messages.append)
    _save(saver, state, 2)
    _save(saver, state, 4)
    data = next((tmp_path / "step-00000004").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-100])

    reports = []
    found = latest_valid(tmp_path, report=reports.append, quarantine=True)
    assert found.name == "step-00000002"
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("step-00000004.corrupt-")]
    assert len(aside) == 1 and (aside[0] / data.name).is_file()  # kept, as it was
    assert len(reports) == 1 and "step-00000004" in reports[0] and aside[0].name in reports[0]
    assert "truncated" in reports[0]
    load(found, _state())

    _save(saver, state, 4)  # the name is free again: no "Directory not empty"
    _save(saver, state, 6)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000006"]
    assert aside[0].is_dir()  # pruning leaves it alone
    assert messages == []


def test_skipping_without_quarantine_moves_nothing(tmp_path: Path) -> None:
    state = _state()
    saver = Checkpointer(tmp_path, keep=2, async_save=False, config_toml="")
    _save(saver, state, 1)
    (tmp_path / "step-00000001" / "manifest.json").unlink()
    assert latest_valid(tmp_path, report=lambda m: None) is None
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_checkpoint_that_cannot_be_pruned_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    real_rmtree = shutil.rmtree

    def refuse(path, *args, **kwargs):  # e.g. a file another user owns
        if Path(path).name != "step-00000001":
            return real_rmtree(path, *args, **kwargs)
        raise PermissionError(13, "Permission denied", str(path))

    state, messages = _state(), []
    saver = Checkpointer(
        tmp_path, keep=1, async_save=async_save, config_toml="", report=messages.append
    )
    _save(saver, state, 1)
    monkeypatch.setattr(checkpoint_files.shutil, "rmtree", refuse)
    _save(saver, state, 2)
    saver.close()
    assert len(messages) == 1, messages
    assert "could not remove old checkpoint" in messages[0]
    assert str(tmp_path / "step-00000001") in messages[0] and "Permission denied" in messages[0]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001", "step-00000002"]


def test_export_writes_the_model_under_its_own_names_or_a_rename_from_above(tmp_path: Path) -> None:
    """export_weights knows no distillation: a distilled run's caller hands it the student's
    `strip_wrapper` (cli export, distill/teacher.py), a plain export keeps every name."""
    from safetensors.torch import load_file

    from scaletrain.distill.student import strip_wrapper

    state = _state()
    saver = Checkpointer(tmp_path / "ckpt", keep=1, async_save=False, config_toml="", report=print)
    _save(saver, state, 1)
    step = tmp_path / "ckpt" / "step-00000001"
    plain = load_file(checkpoint_files.export_weights(step, tmp_path / "plain.safetensors"))
    expected = state.model.state_dict()
    assert plain.keys() == expected.keys()
    assert all(torch.equal(plain[k], expected[k]) for k in expected)
    renamed = load_file(
        checkpoint_files.export_weights(
            step,
            tmp_path / "renamed.safetensors",
            rename=lambda w: {f"student.{k}": v for k, v in w.items()},
        )
    )
    assert renamed.keys() == {f"student.{k}" for k in expected}
    assert strip_wrapper(renamed).keys() == expected.keys()  # what a distilled run exports
