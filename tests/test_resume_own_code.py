"""Exact resume with the user's own code: a run of a user package (factory, map-style
dataset, user loss) and one of a Hugging Face Llama, each stopped after step 2 and resumed
on 2 ranks, end BIT-identical to the uninterrupted run (weights and every logged loss).
Neither adds state of its own: the data position is the step (the sampler is a function of
it) and the HF model's weights and optimizer state go through DCP like any module's.
Both scenarios train in one 2-rank job (harness.run_job)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_hf_train import CONFIG as HF_CONFIG
from test_user_model_parity import CONFIG as USER_CONFIG
from test_user_model_parity import PACKAGE, write_package

from harness import Case, load_weights, losses

CHECKPOINTS = "\n[checkpoint]\nevery = 1\n"
USER_BODY = USER_CONFIG.replace("steps = 4", 'steps = 4\nloss = "shapes.losses:summed_ce"')
# name -> (config, overrides)
SCENARIOS = {
    "user-package": (USER_BODY, ("parallel.dp=2", "train.micro_batch=8")),
    "hugging-face": (
        HF_CONFIG.replace("steps = 3", "steps = 4"),
        ("parallel.dp=2", "train.micro_batch=2"),
    ),
}


def no_final_weights(run_dir: Path) -> None:
    """Between the legs: the stopped run wrote no final weights."""
    assert not (run_dir / "model.safetensors").exists()


@pytest.fixture(scope="module")
def runs(trained, tmp_path_factory) -> dict:
    """{(scenario, "reference" | "resumed"): run}: both scenarios in one 2-rank job, run
    where the user's package is (their working directory)."""
    root = tmp_path_factory.mktemp("own-code")
    write_package(root, PACKAGE)
    cases = {}
    for name, (body, overrides) in SCENARIOS.items():
        config = body + CHECKPOINTS
        cases[f"{name}-reference"] = Case.of(config, *overrides)
        cases[f"{name}-resumed"] = Case(
            config,
            (
                (*overrides, "train.stop_after=2"),
                "test_resume_own_code:no_final_weights",
                overrides,
            ),
        )
    return {
        tuple(k.rsplit("-", 1)): r.run_dir
        for k, r in trained(cases, world_size=2, cwd=root).items()
    }


def _assert_resume_is_exact(runs: dict, name: str) -> None:
    reference, resumed = runs[(name, "reference")], runs[(name, "resumed")]
    a, b = load_weights(reference), load_weights(resumed)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert len(losses(reference)) == 4
    assert losses(resumed) == losses(reference)  # steps 1-2 before the stop, 3-4 after


@pytest.mark.slow
def test_user_package_resume_is_exact(runs: dict) -> None:
    _assert_resume_is_exact(runs, "user-package")


@pytest.mark.slow
def test_hugging_face_resume_is_exact(runs: dict) -> None:
    _assert_resume_is_exact(runs, "hugging-face")
