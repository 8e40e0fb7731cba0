"""Where a comm hook is exact, it is exact: PowerSGD's and batched PowerSGD's warm-up steps
(plain all-reduce, before powersgd_start_iter) give the parameters of the hook-less run in
float64 to 1e-9 on 2 gloo ranks; once compression starts, they leave that path (so the
comparison would see a hook that compressed from the first step). All five runs train in
one 2-rank job (harness.run_job)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import Case, config_toml, load_weights, max_abs_diff

pytestmark = pytest.mark.slow

CONFIG = config_toml(
    model={"size": "small"},
    optim={"lr": 3e-3},
    train={"steps": 4, "global_batch": 64, "micro_batch": 32, "eval_examples": 32},
    parallel={"dp": 2},
    precision={"mode": "fp64"},
    log={"every": 1, "quiet": True},
)


HOOKS = ("powersgd", "batched-powersgd")


@pytest.fixture(scope="module")
def runs(trained) -> dict[str, Path]:
    cases = {"none": Case.of(CONFIG)}
    for hook in HOOKS:
        cases[f"{hook}-warm-up"] = Case.of(
            CONFIG, f"parallel.comm_hook={hook}", "parallel.powersgd_start_iter=10"
        )
        cases[f"{hook}-compressed"] = Case.of(
            CONFIG, f"parallel.comm_hook={hook}", "parallel.powersgd_start_iter=2"
        )
    return {name: result.run_dir for name, result in trained(cases, world_size=2).items()}


@pytest.mark.parametrize("hook", HOOKS)
def test_powersgd_warm_up_is_exact_and_compression_is_not(runs: dict, hook: str) -> None:
    plain = load_weights(runs["none"])
    warm_up = load_weights(runs[f"{hook}-warm-up"])
    assert max_abs_diff(warm_up, plain) < 1e-9
    compressed = load_weights(runs[f"{hook}-compressed"])
    assert max_abs_diff(compressed, plain) > 1e-6
