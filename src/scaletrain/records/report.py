"""One PNG that compares runs: training loss, throughput and (when evaluated) an eval metric.

* Only what a run leaves on disk is read: ``metrics.jsonl`` (required), and when present
  ``config.toml`` and ``summary.json`` (its numeric fields become a footnote). Nothing from
  the trainer is imported, so crashed or copied runs report too. Each run keeps one colour
  in every panel.
* What sets the runs apart is shown, not left to the reader: the config's ``name`` (top
  level or under ``[run]``) joins the run's label, and over several runs every dotted key
  whose value differs between their ``config.toml`` files (``differing_keys``; a key one
  run lacks counts as differing) is shown: the first few in each legend label
  (``legend_labels``), all of them in a small table under the panels.
* A resumed run re-logs the steps after its checkpoint; the later line wins. ``null`` (a
  non-finite value) is a gap in the line, and the loss panel marks those steps with an x.
* Throughput is tokens/s for a run that counts tokens, else examples/s; the eval panel shows
  accuracy if the records have it, else loss, else perplexity, as a line through a marker
  per evaluation. When runs mix units, the second unit is dashed on a right-hand axis
  instead of flattening the other curves.
* It draws on a bare ``matplotlib.figure.Figure`` (saved with Agg), not pyplot: no GUI
  backend is needed and the caller's pyplot backend and global state are left alone.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from scaletrain.config import flatten_config  # nested TOML tables -> {"section.key": value}
from scaletrain.records.metrics import METRICS_FILE, read_metrics

EVAL_METRICS = ("accuracy", "loss", "perplexity")  # the first one the eval records hold is shown
NAME_KEYS = ("name", "run.name")  # already in the label: not repeated as a difference
LABEL_KEYS = 3  # differing keys written into each legend label; the table holds them all


class _Run(NamedTuple):
    label: str
    color: str  # the same in every panel
    train: list[dict]
    evals: list[dict]
    summary: dict
    config: dict[str, Any]  # the dotted keys of config.toml ({} without one)


def write_report(run_dirs: list[Path], *, out: Path) -> Path:
    """Draw the curves of one or more runs into one PNG and return its path.

    Args:
        run_dirs: run directories, each holding a ``metrics.jsonl``; a missing one raises
            ``FileNotFoundError`` naming the directory.
        out: the PNG to write; its parent directory is created if missing.
    """
    fig = build_figure(run_dirs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def build_figure(run_dirs: list[Path]) -> Figure:
    """The report's figure (panels, legends, config table, footnote), not yet saved.

    Args:
        run_dirs: as for `write_report`.
    """
    runs = [_load(Path(d), color=f"C{i % 10}") for i, d in enumerate(run_dirs)]
    titles, configs = [r.label for r in runs], [r.config for r in runs]
    keys = differing_keys(configs)
    runs = [r._replace(label=label) for r, label in zip(runs, legend_labels(titles, configs, keys))]
    ncols = 3 if any(r.evals for r in runs) else 2
    fig = Figure(figsize=(5.5 * ncols, 4.6), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    _plot_loss(axes[0], runs)
    _plot_units(axes[1], runs, _throughput, title="throughput", from_zero=True, linewidth=0.9)
    if ncols == 3:  # a line through the evaluations, a marker on each
        _plot_units(
            axes[2], runs, _eval_metric, title="evaluation", marker="o", markersize=4, linewidth=1.2
        )
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    fig.suptitle("scaletrain report: " + ", ".join(titles), fontsize=11)
    table = config_table(titles, configs, keys)
    footnote = "\n".join(
        [*table, *(_summary_line(title, r) for title, r in zip(titles, runs) if r.summary)]
    )
    if footnote:
        fig.supxlabel(footnote, fontsize=8, family="monospace", ha="left", x=0.01)
    return fig


def differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    """Dotted keys whose value is not the same in every config, in first-seen order.

    A key that some configs lack differs too. Runs without a config.toml ({}) are left out
    of the comparison (nothing is known about them); fewer than two configs: none differ.

    Args:
        configs: each run's flattened config (`flatten_config`).
    """
    known = [c for c in configs if c]
    if len(known) < 2:
        return []
    keys = dict.fromkeys(k for c in known for k in c)
    missing = object()
    return [
        k for k in keys if k not in NAME_KEYS and len({repr(c.get(k, missing)) for c in known}) > 1
    ]


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()  # as TOML writes it
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def legend_labels(titles: list[str], configs: list[dict[str, Any]], keys: list[str]) -> list[str]:
    """Each run's title, then its values of the first LABEL_KEYS differing keys.

    Args:
        titles: one per run (directory and config name).
        configs: each run's flattened config.
        keys: the differing keys (`differing_keys`).
    """
    shown = keys[:LABEL_KEYS]
    more = f" (+{len(keys) - LABEL_KEYS} in the table)" if len(keys) > LABEL_KEYS else ""
    labels = []
    for title, config in zip(titles, configs):
        if not shown or not config:
            labels.append(title)
            continue
        values = ", ".join(f"{k}={format_value(config.get(k, '-'))}" for k in shown)
        labels.append(f"{title}\n{values}{more}")
    return labels


def config_table(titles: list[str], configs: list[dict[str, Any]], keys: list[str]) -> list[str]:
    """A fixed-width table, a row per run and a column per differing key ([] if none)."""
    if not keys:
        return []
    cells = [["run", *keys]] + [
        [t, *(format_value(c.get(k, "-")) if c else "?" for k in keys)]
        for t, c in zip(titles, configs)
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    rows = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return ["config keys that differ between the runs:", *rows]


def _load(run_dir: Path, *, color: str) -> _Run:
    if not (run_dir / METRICS_FILE).is_file():
        raise FileNotFoundError(f"run directory {run_dir} has no {METRICS_FILE}")
    records = read_metrics(run_dir)
    config_path = run_dir / "config.toml"
    config = flatten_config(tomllib.loads(config_path.read_text())) if config_path.is_file() else {}
    name = next((config[k] for k in NAME_KEYS if config.get(k)), None)
    label = f"{run_dir.name} ({name})" if name and name != run_dir.name else run_dir.name
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return _Run(
        label, color, _by_step(records, "train"), _by_step(records, "eval"), summary, config
    )


def _by_step(records: list[dict], kind: str) -> list[dict]:
    """One record per step (the last one logged wins), sorted by step."""
    latest = {r["step"]: r for r in records if r.get("kind", "train") == kind and "step" in r}
    return [latest[s] for s in sorted(latest)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    rows = [(r["step"], r[key]) for r in records if key in r]
    return [s for s, _ in rows], [math.nan if v is None else float(v) for _, v in rows]


def _plot_loss(ax: Axes, runs: list[_Run]) -> None:
    finite = []
    for run in runs:
        steps, loss = _series(run.train, "loss")
        ax.plot(steps, loss, label=run.label, color=run.color, linewidth=1.2)
        finite += [v for v in loss if math.isfinite(v)]
        bad = [s for s, v in zip(steps, loss) if not math.isfinite(v)]
        # x-axis transform: x in steps, y in axes fraction, so the marks sit on the bottom edge.
        ax.plot(bad, [0.02] * len(bad), "x", color=run.color, transform=ax.get_xaxis_transform())
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        ax.set_yscale("log")  # losses spanning decades read better on a log axis
    ax.set(title="training loss", ylabel="loss")
    ax.legend(fontsize=8)


def _throughput(run: _Run) -> tuple[str, list[int], list[float]]:
    uses_tokens = any((r.get("tokens_per_s") or 0) > 0 for r in run.train)
    unit, key = ("tokens/s", "tokens_per_s") if uses_tokens else ("examples/s", "examples_per_s")
    return (unit, *_series(run.train, key))


def _eval_metric(run: _Run) -> tuple[str, list[int], list[float]]:
    key = next((k for k in EVAL_METRICS if any(k in r for r in run.evals)), "loss")
    return (key, *_series(run.evals, key))


def _plot_units(
    ax: Axes, runs: list[_Run], series: Callable, *, title: str, from_zero: bool = False, **style
) -> None:
    """One line per run; the first unit on the left axis, any other dashed on a right-hand one."""
    lines = [(run, *series(run)) for run in runs]
    units = list(dict.fromkeys(unit for _, unit, steps, _ in lines if steps))
    right = ax.twinx() if len(units) > 1 else None
    for run, unit, steps, values in lines:
        if steps:
            target, dash = (ax, "-") if unit == units[0] else (right, "--")
            label = f"{run.label} [{unit}]" if right else run.label
            target.plot(steps, values, dash, label=label, color=run.color, **style)
    ax.set(title=title, ylabel=units[0] if units else "")
    ax.set_ylim(bottom=0 if from_zero else None)  # rates from 0: noise is not a collapse
    if right is not None:
        right.set_ylabel(" / ".join(units[1:]) + " (dashed)")
        right.set_ylim(bottom=0 if from_zero else None)
    if units:  # one legend for both axes
        ax.legend(handles=ax.lines + (right.lines if right else []), fontsize=8)


def _summary_line(title: str, run: _Run) -> str:
    numbers = {k: v for k, v in run.summary.items() if type(v) in (int, float)}  # not bool
    line = f"{title}: " + ", ".join(f"{k}={v:.4g}" for k, v in list(numbers.items())[:8])
    last = run.train[-1] if run.train else {}
    if last.get("mfu") is not None:  # the last window's, as the bar showed it
        line += f", MFU={last['mfu']:.1%}"
    if last.get("model_flops_per_s"):
        line += f", model FLOP/s={last['model_flops_per_s']:.3g}"
    return line
