"""train.compile = true: the model compiled by inductor, under DDP on 2 gloo ranks, ends 3
float64 steps with the parameters of the eager single process (1e-9), and inductor really
compiled the forward (its kernels are in the worker's debug counters)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import config_toml, load_weights, max_abs_diff, records, run_workers

CONFIG = config_toml(
    optim={"lr": 1e-2},
    train={"steps": 3, "global_batch": 32, "eval_examples": 32},
    precision={"mode": "fp64"},
    log={"every": 1, "quiet": True},
)


@pytest.mark.slow
def test_compiled_ddp_matches_eager_single_process(tmp_path: Path) -> None:
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG)
    eager = tmp_path / "eager"
    run_workers(config, ["parallel.dp=1", "train.micro_batch=32"], world_size=1, run_dir=eager)
    compiled = tmp_path / "compiled"
    run_workers(
        config,
        ["parallel.dp=2", "train.micro_batch=16", "train.compile=true"],
        world_size=2,
        run_dir=compiled,
        timeout=300,
    )
    assert records(compiled)[-1]["compiled_graphs"] >= 1  # dynamo captured the forward
    assert "compiled_graphs" not in records(eager)[-1]
    diff = max_abs_diff(load_weights(compiled), load_weights(eager))
    assert diff < 1e-9, diff


def test_compile_mistakes_are_refused_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both would fail inside every worker: tiny DDP buckets (dynamo's 1 MiB first bucket
    assertion) and no C++ compiler for inductor."""
    import shutil

    from scaletrain.config import ConfigError, validate_config
    from scaletrain.launch.resolve import resolve

    config = validate_config(
        {
            "model": {"name": "mlp"},
            "data": {"source": "digits"},
            "train": {"compile": True, "global_batch": 32, "micro_batch": 16},
        }
    )
    resolve(config, world_size=2)  # the defaults are fine
    small = validate_config({**config.model_dump(), "parallel": {"bucket_cap_mb": 0.5}})
    with pytest.raises(ConfigError, match=r"parallel.bucket_cap_mb = 0.5 .* at least 1 MiB"):
        resolve(small, world_size=2)
    resolve(small, world_size=1)  # no DDP, no buckets
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        resolve(config, world_size=1)
