"""Where a comm hook is exact, it is exact: PowerSGD's and batched PowerSGD's warm-up steps
(plain all-reduce, before powersgd_start_iter) give the parameters of the hook-less run in
float64 to 1e-9 on 2 gloo ranks; once compression starts, they leave that path (so the
comparison would see a hook that compressed from the first step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import load_weights, max_abs_diff, run_workers

pytestmark = pytest.mark.slow

CONFIG = """
[model]
name = "mlp"
size = "small"
[data]
source = "digits"
[optim]
lr = 3e-3
[train]
steps = 4
global_batch = 64
micro_batch = 32
eval_examples = 32
[parallel]
dp = 2
[precision]
mode = "fp64"
[log]
every = 1
quiet = true
"""


@pytest.mark.parametrize("hook", ["powersgd", "batched-powersgd"])
def test_powersgd_warm_up_is_exact_and_compression_is_not(tmp_path: Path, hook: str) -> None:
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG)

    def run(name: str, overrides: list[str]) -> dict:
        run_workers(config, overrides, world_size=2, run_dir=tmp_path / name)
        return load_weights(tmp_path / name)

    plain = run("none", [])
    warm_up = run("warm-up", [f"parallel.comm_hook={hook}", "parallel.powersgd_start_iter=10"])
    assert max_abs_diff(warm_up, plain) < 1e-9
    compressed = run("compressed", [f"parallel.comm_hook={hook}", "parallel.powersgd_start_iter=2"])
    assert max_abs_diff(compressed, plain) > 1e-6
