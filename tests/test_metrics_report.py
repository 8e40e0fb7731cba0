"""Rank-0 feedback: the JSONL record, TensorBoard events, and the PNG report built from them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from scaletrain.records.metrics import MetricsLogger, read_metrics
from scaletrain.records.report import (
    build_figure,
    config_table,
    differing_keys,
    flatten_config,
    legend_labels,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _logger(run_dir: Path, **kw) -> MetricsLogger:
    args = dict(total_steps=10, enabled=True, quiet=True, tensorboard=False) | kw
    return MetricsLogger(run_dir, **args)


def _fake_run(run_dir: Path, *, steps: int, tokens: bool, eval_key: str) -> None:
    with _logger(run_dir, total_steps=steps) as m:
        for s in range(1, steps + 1):
            rec = {"step": s, "loss": 2.0 / s, "lr": 1e-3, "examples_per_s": 100.0 + s}
            if tokens:
                rec["tokens_per_s"] = 4000.0 + s
            m.log_step(rec)
            if s % 5 == 0:
                m.log_eval({"step": s, eval_key: 0.5 + s / 100})


def test_jsonl_lines_are_strict_json_with_non_finite_as_null(tmp_path: Path) -> None:
    with _logger(tmp_path) as m:
        m.log_step({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1})
        m.log_step({"step": 2, "loss": 0.5, "grad_norm": -math.inf, "examples": 32})
        m.log_eval({"step": 2, "accuracy": 0.75})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3

    def strict(token: str) -> None:  # json.loads accepts NaN/Infinity unless told not to
        raise ValueError(f"non-standard JSON constant {token}")

    records = [json.loads(line, parse_constant=strict) for line in lines]
    assert records[0] == {"kind": "train", "step": 1, "loss": None, "grad_norm": None, "lr": 0.1}
    assert records[1]["grad_norm"] is None and records[1]["examples"] == 32
    assert records[2] == {"kind": "eval", "step": 2, "accuracy": 0.75}


def test_each_line_is_flushed_before_close(tmp_path: Path) -> None:
    m = _logger(tmp_path)
    m.log_step({"step": 1, "loss": 1.0})
    assert read_metrics(tmp_path) == [{"kind": "train", "step": 1, "loss": 1.0}]
    m.close()
    m.close()  # idempotent


def test_read_metrics_round_trips(tmp_path: Path) -> None:
    sent = [
        {"step": s, "loss": 1.0 / s, "tokens": 128 * s, "peak_mem_bytes": 2**33} for s in (1, 2, 3)
    ]
    with _logger(tmp_path) as m:
        for rec in sent:
            m.log_step(rec)
        m.log_eval({"step": 3, "loss": 0.4, "perplexity": math.exp(0.4)})
    got = read_metrics(tmp_path)
    assert got[:3] == [{"kind": "train", **rec} for rec in sent]
    assert got[3] == {"kind": "eval", "step": 3, "loss": 0.4, "perplexity": math.exp(0.4)}


def test_resume_appends_and_survives_a_partial_last_line(tmp_path: Path) -> None:
    with _logger(tmp_path) as m:
        m.log_step({"step": 1, "loss": 1.0})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 2, "lo')  # killed mid-write
    with _logger(tmp_path, start_step=1) as m:
        m.log_step({"step": 2, "loss": 0.9})
    with pytest.warns(UserWarning, match=r"metrics.jsonl:2"):
        got = read_metrics(tmp_path)
    assert [r["step"] for r in got] == [1, 2] and got[1]["loss"] == 0.9


def test_step_is_required(tmp_path: Path) -> None:
    with _logger(tmp_path) as m, pytest.raises(ValueError, match="'step'"):
        m.log_step({"loss": 1.0})


def test_disabled_logger_is_a_no_op_and_creates_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "rank1"
    m = MetricsLogger(run_dir, total_steps=5, enabled=False, quiet=False, tensorboard=True)
    m.log_step({"step": 1, "loss": 1.0})
    m.log_eval({"step": 1, "loss": 1.0})
    m.advance(3)
    m.message("hello")
    m.close()
    assert not run_dir.exists()


def test_progress_bar_counts_logged_and_advanced_steps(tmp_path: Path, capsys) -> None:
    m = _logger(tmp_path, quiet=False, total_steps=10, start_step=2)
    m.log_step({"step": 3, "loss": 0.25, "examples_per_s": 1500.0, "tokens_per_s": 0.0})
    m.advance(4)
    assert m._bar.n == 7
    assert "loss=0.25" in m._bar.postfix and "ex/s=1.5k" in m._bar.postfix
    assert "tok/s" not in m._bar.postfix  # shown only when tokens are counted
    m.message("checkpoint saved")
    m.close()
    assert "checkpoint saved" in capsys.readouterr().out


def test_quiet_logger_prints_nothing(tmp_path: Path, capsys) -> None:
    with _logger(tmp_path, quiet=True) as m:
        m.log_step({"step": 1, "loss": 1.0})
        m.message("not shown")
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_tensorboard_writes_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with _logger(tmp_path, tensorboard=True) as m:
        for s in (1, 2):
            m.log_step({"step": s, "loss": 1.0 / s, "lr": 0.1})
        m.log_eval({"step": 2, "accuracy": 0.9})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"train/loss", "train/lr", "eval/accuracy"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 0.5)]


def test_report_draws_a_png_for_two_runs(tmp_path: Path) -> None:
    import matplotlib.image

    _fake_run(tmp_path / "mlp", steps=20, tokens=False, eval_key="accuracy")
    _fake_run(tmp_path / "gpt", steps=30, tokens=True, eval_key="loss")
    (tmp_path / "gpt" / "config.toml").write_text('[run]\nname = "gpt-small"\n')
    (tmp_path / "gpt" / "summary.json").write_text(json.dumps({"final_loss": 0.07, "steps": 30}))
    out = write_report([tmp_path / "mlp", tmp_path / "gpt"], out=tmp_path / "out" / "report.png")
    assert out == tmp_path / "out" / "report.png"
    assert out.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = matplotlib.image.imread(out).shape
    assert 300 <= height <= 1200 and 1500 <= width <= 3000  # three panels (about 1815 px)


def test_report_without_eval_has_two_panels(tmp_path: Path) -> None:
    import matplotlib.image

    with _logger(tmp_path / "run") as m:
        for s in range(1, 6):
            m.log_step({"step": s, "loss": float("nan") if s == 3 else 1.0 / s})
    out = write_report([tmp_path / "run"], out=tmp_path / "r.png")
    height, width, _ = matplotlib.image.imread(out).shape
    assert 1000 <= width < 1500  # two panels (about 1210 px), not three (about 1815 px)


def test_report_refuses_a_run_without_metrics(tmp_path: Path) -> None:
    _fake_run(tmp_path / "good", steps=5, tokens=False, eval_key="accuracy")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"run directory .*empty has no metrics\.jsonl"):
        write_report([tmp_path / "good", tmp_path / "empty"], out=tmp_path / "r.png")
    assert not (tmp_path / "r.png").exists()


def _config(run_dir: Path, text: str) -> None:
    (run_dir / "config.toml").write_text(text)


def test_differing_keys_lists_changed_and_missing_keys_only() -> None:
    a = flatten_config(
        {
            "name": "a",
            "optim": {"lr": 1e-3, "betas": [0.9, 0.99]},
            "train": {"steps": 100, "micro_batch": 32},
        }
    )
    b = flatten_config(
        {
            "name": "b",
            "optim": {"lr": 3e-3, "betas": [0.9, 0.99]},
            "train": {"steps": 100, "micro_batch": 32, "compile": True},
        }
    )
    c = flatten_config(
        {
            "name": "c",
            "optim": {"lr": 1e-3, "betas": [0.9, 0.95]},
            "train": {"steps": 100, "micro_batch": 32},
        }
    )
    assert a["optim.lr"] == 1e-3 and "optim" not in a  # dotted keys, no tables
    assert differing_keys([a, b]) == ["optim.lr", "train.compile"]  # the name is in the label
    assert differing_keys([a, b, c]) == ["optim.lr", "optim.betas", "train.compile"]
    assert differing_keys([a, a]) == [] and differing_keys([a]) == []
    assert differing_keys([a, {}, b]) == ["optim.lr", "train.compile"]  # no config: not compared


def test_legend_labels_and_table_name_each_differing_value() -> None:
    configs = [{"optim.lr": 0.001, "train.compile": True}, {"optim.lr": 0.003}]
    keys = ["optim.lr", "train.compile"]
    labels = legend_labels(["r1", "r2"], configs, keys)
    assert labels == [
        "r1\noptim.lr=0.001, train.compile=true",
        "r2\noptim.lr=0.003, train.compile=-",
    ]
    assert legend_labels(["r1", "r2"], configs, []) == ["r1", "r2"]
    many = [f"k.{i}" for i in range(5)]
    label = legend_labels(["r"], [{k: 1 for k in many}], many)[0]
    assert "k.0=1, k.1=1, k.2=1 (+2 in the table)" in label and "k.3" not in label
    table = config_table(["r1", "r2"], configs, keys)
    assert table[1].split() == ["run", "optim.lr", "train.compile"]
    assert table[2].split() == ["r1", "0.001", "true"] and table[3].split() == ["r2", "0.003", "-"]


def test_report_shows_what_differs_between_the_runs_configs(tmp_path: Path) -> None:
    for name, lr, micro in (("fast", 3e-3, 64), ("slow", 1e-3, 32)):
        _fake_run(tmp_path / name, steps=10, tokens=False, eval_key="accuracy")
        _config(
            tmp_path / name,
            f'name = "mnist"\n[model]\nname = "cnn"\n'
            f"[optim]\nlr = {lr}\n[train]\nmicro_batch = {micro}\n",
        )
    fig = build_figure([tmp_path / "fast", tmp_path / "slow"])
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == [
        "fast (mnist)\noptim.lr=0.003, train.micro_batch=64",
        "slow (mnist)\noptim.lr=0.001, train.micro_batch=32",
    ]
    footnote = fig.get_supxlabel()
    assert "optim.lr" in footnote and "train.micro_batch" in footnote
    assert "model.name" not in footnote and "model.name" not in "".join(legend)  # the same in both


def test_eval_is_drawn_as_a_line_through_a_marker_per_evaluation(tmp_path: Path) -> None:
    _fake_run(tmp_path / "run", steps=20, tokens=False, eval_key="accuracy")  # evals at 5..20
    fig = build_figure([tmp_path / "run"])
    (line,) = fig.axes[2].lines
    assert list(line.get_xdata()) == [5, 10, 15, 20]
    assert list(line.get_ydata()) == pytest.approx([0.55, 0.6, 0.65, 0.7])
    assert line.get_linestyle() == "-" and line.get_linewidth() > 0  # a line, not lone dots
    assert line.get_marker() == "o"


def test_time_left_counts_the_evaluations_to_come() -> None:
    """The bar's time left is steps left x the step time + evaluations left x the
    evaluation time; before a step time is known it is unknown, before the first
    evaluation is timed the evaluations count nothing."""
    from scaletrain.records.metrics import eta_s, evals_left

    # train.steps = 100, an evaluation after steps 25, 50 and 75, and the final one.
    assert [evals_left(s, total_steps=100, eval_every=25) for s in (0, 1, 25, 26, 75, 76)] == [
        4,
        4,
        4,  # the bar stands at 25 before the evaluation at 25 runs
        3,
        2,
        1,
    ]
    assert evals_left(100, total_steps=100, eval_every=25) == 1  # the final one
    assert evals_left(3, total_steps=100, eval_every=0) == 1
    assert eta_s(steps_left=10, step_time_s=0.5, evals_left=2, eval_time_s=3.0) == 11.0
    assert eta_s(steps_left=10, step_time_s=0.5, evals_left=2, eval_time_s=None) == 5.0
    assert eta_s(steps_left=10, step_time_s=None, evals_left=2, eval_time_s=3.0) is None


def test_run_eta_leaves_the_evaluations_and_the_first_step_out_of_the_step_time() -> None:
    """A clock the test moves: a 5 s warm-up step, then 1 s steps and a 4 s evaluation
    after step 5 of 10. The step time stays 1 s across the evaluation (tqdm's rate would
    count it as a 5 s step), and the time left is 4 x 1 s + the final evaluation's 4 s."""
    import io

    from scaletrain.records.metrics import BAR_FORMAT, RunEta, _Bar

    now = [0.0]
    eta = RunEta(total_steps=10, step=0, eval_every=5, clock=lambda: now[0])

    def step(seconds: float) -> None:
        now[0] += seconds
        eta.stepped(1)

    step(5.0)  # warm-up
    assert eta.seconds_left() is None
    for _ in range(4):
        step(1.0)
    assert eta.seconds_left() == 5 * 1.0  # no evaluation timed yet
    now[0] += 4.0
    eta.evaluated(4.0)
    step(1.0)
    assert eta.step == 6 and eta.seconds_left() == 4 * 1.0 + 1 * 4.0
    bar = _Bar(eta, total=10, initial=6, file=io.StringIO(), bar_format=BAR_FORMAT)
    assert "<00:08," in str(bar)
    bar.close()


def test_the_progress_bar_shows_the_run_eta(tmp_path: Path) -> None:
    from scaletrain.records.metrics import RunEta

    """The logger's bar reads RunEta's time left, not tqdm's own (still "?" here: the
    bar has not moved)."""
    m = _logger(tmp_path, quiet=False, total_steps=10)
    now = [0.0]
    m.eta = m._bar._eta = RunEta(total_steps=10, step=0, eval_every=0, clock=lambda: now[0])
    for seconds in (5.0, 1.0):  # the warm-up step, then a 1 s step
        now[0] += seconds
        m.eta.stepped(1)
    assert "<00:08," in str(m._bar)  # 8 steps x 1 s
    m.close()
