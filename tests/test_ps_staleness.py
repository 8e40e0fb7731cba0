"""Parameter servers' staleness, measured: under ssp no update is staler than ps.staleness
(with a straggler, so that staleness builds up to the bound), while the same straggler under
async goes past it; async logs the staleness and delay of every gradient it applied, and the
summary's histograms count exactly the run's updates."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from harness import config_toml, records, run_workers

pytestmark = pytest.mark.slow

WORKERS, GLOBAL_BATCH, STEPS = 2, 64, 40

CONFIG = config_toml(
    "ps-staleness",
    train={"steps": STEPS, "global_batch": GLOBAL_BATCH, "micro_batch": 32, "eval_examples": 64},
    optim={"lr": 0.01},
    parallel={"strategy": "ps", "dp": WORKERS, "timeout_s": 60},
    ps={"worker_timeout_s": 10},
    log={"every": 5, "quiet": True},
)

# Worker 0 (rank 1, after the server) takes 3x as long a step (bench/straggler.py, imported
# from the ranks' working directory): worker 1 runs ahead as far as it may.
BENCH = Path(__file__).resolve().parent.parent / "bench"
STRAGGLER = [
    "model.name=straggler:build",
    "model.kwargs.model=mlp",
    "model.kwargs.size=tiny",
    "model.kwargs.slow_rank=1",
    "model.kwargs.factor=3.0",
]


def _run(tmp_path: Path, *overrides: str) -> tuple[Path, dict]:
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG)
    run_dir = tmp_path / "run"
    run_workers(
        config, list(overrides), world_size=1 + WORKERS, run_dir=run_dir, timeout=120, cwd=BENCH
    )
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def _logged(run_dir: Path, key: str) -> list[int]:
    """Every update's `key` (staleness or delay), over all train records, in order."""
    return [s for r in records(run_dir) for s in r[key]]


@pytest.mark.parametrize("bound", [1, 2])
def test_ssp_never_exceeds_its_bound(tmp_path: Path, bound: int) -> None:
    run_dir, summary = _run(tmp_path, "ps.mode=ssp", f"ps.staleness={bound}", *STRAGGLER)

    logged = _logged(run_dir, "staleness")
    ps = summary["ps"]
    assert ps["staleness_bound"] == bound
    assert max(logged) <= bound, Counter(logged)
    assert max(logged) == bound, (
        f"the straggler never made staleness reach {bound}: {Counter(logged)}"
    )
    histogram = {int(k): n for k, n in ps["staleness_histogram"].items()}
    assert max(histogram) <= bound, histogram
    assert sum(histogram.values()) == ps["updates"] == WORKERS * STEPS == len(logged)
    assert histogram == Counter(logged)


def test_async_with_the_same_straggler_goes_past_the_bound(tmp_path: Path) -> None:
    # The negative case: what ssp's hold prevents does happen without it.
    run_dir, summary = _run(tmp_path, "ps.mode=async", *STRAGGLER)

    bound = 2
    logged = _logged(run_dir, "staleness")
    assert max(logged) > bound, Counter(logged)
    assert max(int(k) for k in summary["ps"]["staleness_histogram"]) > bound
    assert summary["ps"]["staleness_bound"] is None  # async promises no bound


def test_async_logs_the_staleness_and_delay_of_every_gradient(tmp_path: Path) -> None:
    run_dir, summary = _run(tmp_path, "ps.mode=async")

    per_gradient = GLOBAL_BATCH // WORKERS  # examples in one worker's gradient
    train = records(run_dir)
    assert train and train[-1]["step"] == STEPS
    for r in train:
        assert isinstance(r["staleness"], list) and isinstance(r["delay"], list), r
        gradients = r["examples"] // per_gradient
        assert gradients > 0 and r["examples"] == gradients * per_gradient, r
        assert len(r["staleness"]) == len(r["delay"]) == gradients, r
        assert r["staleness_max"] == max(r["staleness"]), r
        assert all(s >= 0 for s in r["staleness"]) and all(d >= 0 for d in r["delay"]), r
    ps = summary["ps"]
    assert ps["updates"] == WORKERS * STEPS
    staleness = {int(k): n for k, n in ps["staleness_histogram"].items()}
    delay = {int(k): n for k, n in ps["delay_histogram"].items()}
    assert sum(staleness.values()) == sum(delay.values()) == ps["updates"]
    assert staleness == Counter(_logged(run_dir, "staleness"))
    assert delay == Counter(_logged(run_dir, "delay"))
