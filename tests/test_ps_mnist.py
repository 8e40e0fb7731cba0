"""Asynchronous parameter servers train MNIST as well as DDP does: with the same examples
(train.steps x train.global_batch), 2 async workers and 1 server reach DDP dp=2's accuracy on
the full test set, to within 0.5 points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import Case, run_workers

# About 2 epochs of MNIST: both reach their plateau (~97.5-98%), where the gap measures the
# strategy and not how far along each run is. About 20 s (DDP) + 30 s (PS) on two cores.
CONFIG = """
name = "ps-mnist"
[model]
name = "mlp"
size = "small"
[data]
source = "mnist"
[train]
steps = 1000
global_batch = 128
micro_batch = 64
eval_examples = 10000
[optim]
lr = 1e-3
warmup_steps = 20
[parallel]
timeout_s = 60
[log]
every = 50
quiet = true
"""


def _accuracy(run_dir: Path) -> float:
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["eval"]["accuracy"]


@pytest.mark.slow
def test_async_ps_reaches_ddp_accuracy_on_mnist(tmp_path: Path, trained) -> None:
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG)
    ps = tmp_path / "ps"
    ddp = trained({"ddp": Case.of(CONFIG, "parallel.dp=2")}, world_size=2, timeout=150)[
        "ddp"
    ].run_dir
    run_workers(
        config,
        ["parallel.strategy=ps", "parallel.dp=2", "ps.mode=async"],
        world_size=3,
        run_dir=ps,
        timeout=150,
    )

    ddp_acc, ps_acc = _accuracy(ddp), _accuracy(ps)
    print(f"MNIST accuracy on 10000 test images: DDP dp=2 {ddp_acc:.4f}, async PS {ps_acc:.4f}")
    assert ddp_acc > 0.97, ddp_acc  # the reference itself trained
    # One-sided: async applies each worker's half-batch as its own update (twice DDP's
    # updates), which is worth a little accuracy here; only falling behind DDP is a defect.
    assert ps_acc >= ddp_acc - 0.005, (ps_acc, ddp_acc)
