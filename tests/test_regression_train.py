"""Regression trains end to end: a CSV with a numeric `target` column is sharded, the
built-in MLP trains on it with the summed squared error (train.loss = "auto" -> "mse"), the
eval records report `mse`, and dp=2 with accumulation reproduces one process in float64."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness import Case, load_weights, losses, max_abs_diff, records, run_cli

CONFIG = """
[model]
name = "mlp"
size = "tiny"
[data]
source = "shards"
[optim]
lr = 1e-2
[train]
steps = {steps}
global_batch = 32
eval_examples = 400
seed = 1
[precision]
mode = "fp64"
[log]
every = 10
quiet = true
"""


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("regression")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 3))
    y = 2.0 * x[:, 0] - x[:, 1] + 0.5 * x[:, 2] ** 2 + 0.1 * rng.normal(size=2000)
    lines = ["x1,x2,x3,target"] + [f"{a:.6f},{b:.6f},{c:.6f},{t:.6f}" for (a, b, c), t in zip(x, y)]
    (root / "data.csv").write_text("\n".join(lines) + "\n")
    out = root / "shards"
    result = run_cli(["shard", str(root / "data.csv"), str(out), "--rows-per-shard", "500"])
    assert result.returncode == 0, result.stderr
    assert "target" in result.stdout
    return out


def _case(shards: Path, *, steps: int, dp: int = 1, micro_batch: int = 32) -> Case:
    return Case.of(
        CONFIG.format(steps=steps),
        f"data.path={shards}",
        f"parallel.dp={dp}",
        f"train.micro_batch={micro_batch}",
    )


@pytest.fixture(scope="module")
def runs(trained, shards: Path) -> dict[str, Path]:
    """The trainings, one job per world size (the `shard` command above is the CLI's)."""
    one = trained({"long": _case(shards, steps=300), "dp1": _case(shards, steps=4)}, world_size=1)
    two = trained({"dp2": _case(shards, steps=4, dp=2, micro_batch=8)}, world_size=2)
    return {name: r.run_dir for name, r in (one | two).items()}


@pytest.mark.slow
def test_regression_csv_trains_and_reports_mse(runs: dict) -> None:
    run = runs["long"]
    final = records(run, "eval")[-1]
    assert set(final) >= {"loss", "mse"} and "accuracy" not in final
    assert final["mse"] == pytest.approx(final["loss"], rel=1e-12)  # loss "auto" is the MSE
    # The targets' variance is ~5.5: predicting their mean scores that; the model learns.
    assert final["mse"] < 0.5
    assert losses(run)[-1] < losses(run)[0] / 5


@pytest.mark.slow
def test_regression_dp2_with_accumulation_matches_one_process(runs: dict) -> None:
    reference, dp2 = runs["dp1"], runs["dp2"]
    assert max_abs_diff(load_weights(reference), load_weights(dp2)) < 1e-9
    assert losses(dp2) == pytest.approx(losses(reference), abs=1e-9)
