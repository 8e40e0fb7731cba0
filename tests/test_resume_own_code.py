"""Exact resume with the user's own code: a run of a user package (factory, map-style
dataset, user loss) and one of a Hugging Face Llama, each stopped after step 2 and resumed
on 2 ranks, end BIT-identical to the uninterrupted run (weights and every logged loss).
Neither adds state of its own: the data position is the step (the sampler is a function of
it) and the HF model's weights and optimizer state go through DCP like any module's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import load_weights, losses, run_workers
from test_hf_train import CONFIG as HF_CONFIG
from test_user_model_parity import CONFIG as USER_CONFIG, PACKAGE, write_package

CHECKPOINTS = "\n[checkpoint]\nevery = 1\n"


def _assert_resume_is_exact(tmp_path: Path, body: str, overrides: list[str]) -> None:
    config = tmp_path / "cfg.toml"
    config.write_text(body + CHECKPOINTS)
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run_workers(config, overrides, world_size=2, run_dir=reference, cwd=tmp_path)
    run_workers(config, [*overrides, "train.stop_after=2"], world_size=2, run_dir=resumed,
                cwd=tmp_path)
    assert not (resumed / "model.safetensors").exists()
    run_workers(config, overrides, world_size=2, run_dir=resumed, cwd=tmp_path)
    a, b = load_weights(reference), load_weights(resumed)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert len(losses(reference)) == 4
    assert losses(resumed) == losses(reference)  # steps 1-2 before the stop, 3-4 after


@pytest.mark.slow
def test_user_package_resume_is_exact(tmp_path: Path) -> None:
    write_package(tmp_path, PACKAGE)
    _assert_resume_is_exact(tmp_path, USER_CONFIG.replace("steps = 4", "steps = 4\nloss = "
                                                          '"shapes.losses:summed_ce"'),
                            ["parallel.dp=2", "train.micro_batch=8"])


@pytest.mark.slow
def test_hugging_face_resume_is_exact(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    _assert_resume_is_exact(tmp_path, HF_CONFIG.replace("steps = 3", "steps = 4"),
                            ["parallel.dp=2", "train.micro_batch=2"])
