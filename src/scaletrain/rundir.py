"""The run directory: where every run leaves its config, metrics, weights and summary.

    RUN_DIR/config.toml        the resolved config (what actually ran)
    RUN_DIR/metrics.jsonl      one JSON object per logged step or evaluation
    RUN_DIR/model.safetensors  final weights, plain parameter names
    RUN_DIR/summary.json       final loss, eval metric, wall time, throughput
    RUN_DIR/report.png         loss and throughput curves (`scaletrain report`)
    RUN_DIR/checkpoints/step-N sharded checkpoints (torch.distributed.checkpoint), see checkpoint.py
"""

from __future__ import annotations

import time
from pathlib import Path

from scaletrain.config import Config, ConfigError, config_to_toml


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_run_dir(run_dir: Path) -> None:
    """Refuse a directory that already holds a finished or running run: nothing is overwritten."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {str(run_dir)!r} exists and is not a directory")
    taken = [f for f in ("metrics.jsonl", "summary.json", "model.safetensors") if (run_dir / f).exists()]
    if taken:
        raise ConfigError(
            f"--run-dir {str(run_dir)!r} already holds a run ({', '.join(taken)}); "
            "choose another --run-dir so nothing is overwritten")


def write_config(run_dir: Path, config: Config) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.toml"
    path.write_text(config_to_toml(config))
    return path


def check_resumable(run_dir: Path | None) -> None:
    """`--resume` needs a run directory that holds at least one checkpoint."""
    if run_dir is None:
        raise ConfigError("--resume needs --run-dir, the run to continue")
    checkpoints = run_dir / "checkpoints"
    if not checkpoints.is_dir() or not any(p.name.startswith("step-") for p in checkpoints.iterdir()):
        raise ConfigError(f"--resume: {str(run_dir)!r} holds no checkpoint to resume from "
                          "(set checkpoint.every or train.stop_after when starting a run)")
