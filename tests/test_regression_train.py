"""Regression trains end to end: a CSV with a numeric `target` column is sharded, the
built-in MLP trains on it with the summed squared error (train.loss = "auto" -> "mse"), the
eval records report `mse`, and dp=2 with accumulation reproduces one process in float64."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness import load_weights, losses, max_abs_diff, records, run_cli

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


def _train(tmp_path: Path, shards: Path, name: str, *, steps: int, nproc: int = 1,
           micro_batch: int = 32) -> Path:
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG.format(steps=steps))
    run_dir = tmp_path / name
    result = run_cli(["train", str(config), "--nproc", str(nproc), "--run-dir", str(run_dir),
                      f"data.path={shards}", f"parallel.dp={nproc}",
                      f"train.micro_batch={micro_batch}"])
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_regression_csv_trains_and_reports_mse(tmp_path: Path, shards: Path) -> None:
    run = _train(tmp_path, shards, "long", steps=300)
    final = records(run, "eval")[-1]
    assert set(final) >= {"loss", "mse"} and "accuracy" not in final
    assert final["mse"] == pytest.approx(final["loss"], rel=1e-12)  # loss "auto" is the MSE
    # The targets' variance is ~5.5: predicting their mean scores that; the model learns.
    assert final["mse"] < 0.5
    assert losses(run)[-1] < losses(run)[0] / 5


@pytest.mark.slow
def test_regression_dp2_with_accumulation_matches_one_process(tmp_path: Path,
                                                              shards: Path) -> None:
    reference = _train(tmp_path, shards, "dp1", steps=4)
    dp2 = _train(tmp_path, shards, "dp2", steps=4, nproc=2, micro_batch=8)
    assert max_abs_diff(load_weights(reference), load_weights(dp2)) < 1e-9
    assert losses(dp2) == pytest.approx(losses(reference), abs=1e-9)
