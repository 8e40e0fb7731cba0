"""bench/plan.py's pure parts: the grid it trains (every row a config this tree accepts,
one micro-batch per data-parallel rank), how a run's metrics are read, what the planner is
held to against them (errors, the pick's rank and gap) and what a DDP baseline holds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from scaletrain.config import load_config

PATH = Path(__file__).resolve().parent.parent / "bench" / "plan.py"
_spec = importlib.util.spec_from_file_location("bench_plan", PATH)
plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan)


def test_grid_covers_both_worlds_and_at_least_twelve_rows():
    rows = plan.grid(list(plan.MODELS), [2, 4])
    assert len(rows) >= 12
    assert {(r["model"], r["world"]) for r in rows} == {(m, w) for m in plan.MODELS for w in (2, 4)}
    assert [r["world"] for r in plan.grid(["gpt"], [4])] == [4] * 6


@pytest.mark.parametrize(
    ("layout", "micro_batch"),
    [("ddp", 8), ("tp2", 16), ("pp2-1f1b", 16), ("hsdp", 4), ("zero3xtp2", 8), ("pp2xtp2", 16)],
)
def test_one_micro_batch_per_data_parallel_rank(layout, micro_batch):
    assert plan.layout_overrides(layout, global_batch=16)[-1] == f"train.micro_batch={micro_batch}"


def test_every_row_is_a_config_this_tree_accepts(tmp_path):
    plan.write_configs(tmp_path, list(plan.MODELS), steps_scale=0.2)
    for row in plan.grid(list(plan.MODELS), [2, 4]):
        config = load_config(tmp_path / f"{row['model']}.toml", row["overrides"])
        par = config.parallel
        dp = row["world"] // (par.tp * par.pp)
        assert config.train.micro_batch * dp == config.train.global_batch
        assert config.train.steps == 20  # the smallest: two windows of EVERY steps


def test_read_run_medians_after_the_warm_up_window_and_the_late_rise(tmp_path):
    mib = 2**20
    windows = [(10, 9.0, 50), (20, 1.0, 60), (30, 2.0, 70), (40, 3.0, 72), (50, 4.0, 75)]
    lines = [{"kind": "eval", "step": 50}] + [
        {"kind": "train", "step": s, "step_time_s": t, "window_peak_above_baseline_bytes": p * mib}
        for s, t, p in windows
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)))
    got = plan.read_run(tmp_path)
    assert got["step_time_s"] == 2.5  # windows 20-50; the first (9 s) warms up
    assert got["above"] == 75 * mib
    assert got["late_rise"] == 15 * mib  # steps 20-50 vs the last early window (step 10 dropped)


def _row(model, world, layout, meas_s, old_s, new_s, meas_peak=100, pred_peak=100):
    pred = {"step_time_s": old_s, "above": pred_peak}
    return {
        "model": model,
        "world": world,
        "layout": layout,
        "meas": {"step_time_s": meas_s, "above": meas_peak, "late_rise": 0},
        "pred": {
            "old": pred,
            "new": {"error": "refused"} if new_s is None else {**pred, "step_time_s": new_s},
        },
    }


def test_scores_hold_the_pick_to_its_measured_rank_and_gap():
    rows = [
        _row("gpt", 2, "ddp", 1.0, 0.9, 1.0),
        _row("gpt", 2, "zero3", 1.2, 0.8, 1.3, pred_peak=150),
        _row("gpt", 2, "tp2", 2.0, 3.0, None),
    ]
    old = plan.scores(rows, "old")
    assert old["step_median"] == pytest.approx(1 / 3)  # |0.9-1|, |0.8/1.2-1|, |3/2-1|
    assert old["step_worst"] == pytest.approx(0.5)
    assert old["peak_median"] == 0
    assert old["picks"][("gpt", 2)] == ("zero3", 2, 3, pytest.approx(0.2), "ddp")
    new = plan.scores(rows, "new")
    assert (new["rows"], new["refused"]) == (2, 1)
    assert new["picks"][("gpt", 2)] == ("ddp", 1, 2, 0.0, "ddp")
    assert "refused" in plan.format_row({**rows[2], "foreign": 0.5, "noisy": True})


@pytest.mark.parametrize(
    ("degrees", "world", "held"),
    [
        ({"dp_replicate": 2, "dp_shard": 1, "tp": 1, "pp": 1}, 2, 30),  # DDP: grads in buckets
        ({"dp_replicate": -1, "dp_shard": 1, "tp": 1, "pp": 1}, 4, 30),  # inferred DDP
        ({"dp_replicate": -1, "dp_shard": 2, "tp": 1, "pp": 1}, 2, 10),  # FSDP
        ({"dp_replicate": 2, "dp_shard": 2, "tp": 1, "pp": 1}, 4, 10),  # HSDP
        ({"dp_replicate": -1, "dp_shard": 1, "tp": 2, "pp": 1}, 2, 10),  # TP alone
    ],
)
def test_held_at_setup(degrees, world, held):
    par = SimpleNamespace(gradient_as_bucket_view=True, **degrees)
    assert plan.held_at_setup(par, {"params": 10, "grads": 20}, world=world) == held
