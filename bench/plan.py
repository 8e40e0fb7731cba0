"""Today's planner and the one in this tree against real runs of models calibrate never ran.

Each planner (the baseline revision, `--baseline`, checked out in a git worktree; and this
working tree) first calibrates at its defaults (`scaletrain calibrate --world 2,4`: the
built-in GPT tiny), one after the other; both wall times are printed. Then each predicts
(`planner.predict_configured`, in a subprocess with PYTHONPATH set to its own `src`: both
are called the same way, through this file's --predict mode) every row of a grid that
calibrate never saw: an HF Llama built from kwargs (another model family), the MNIST CNN (no
transformer at all) and GPT "small" (the family calibrate ran, at another size), on 2 and 4
ranks, over the layouts the launcher accepts for each (the Llama and the CNN have no
pipeline split, the CNN no TP plan). Each row is then trained for real (`scaletrain train`,
this tree) while the foreign load on the CPUs is metered (bench/common.py's `measured`:
it waits for a quiet machine first and reruns a disturbed row up to --retries times).

Measured: the median `step_time_s` of the logged windows after the first, and the largest
`window_peak_above_baseline_bytes` (the RSS high-water mark above what the rank held after
set-up); "late rise" is how much that peak still rose over the last SETTLED_STEPS steps
(under FSDP2 it climbs for ~120 steps on GPT small before it settles). The baseline already
holds the parameters, and under DDP the gradients in its buckets, so the predicted peak is
compared less those (`held_at_setup`). Ratios are predicted / measured.

The summary holds each planner to issue 48's bars: step time within 15% for the median row
and 30% for the worst, peak within 25% for the median row, and per (model, world) the pick
(the fastest predicted row) within 10% of the fastest measured and in the measured top 3.

    .venv/bin/python bench/plan.py [--keep DIR] [--models llama,cnn,gpt] [--worlds 2,4]
        [--baseline REV] [--steps-scale 1.0] [--retries 1] [--profile NAME]
    .venv/bin/python bench/plan.py --from DIR   # predict again for DIR's runs, train nothing

--keep DIR keeps the configs, both profiles (and calibrate's logs), the run directories,
rows.json and the baseline worktree (DIR/baseline, reused); without it all goes at the end.
--profile NAME skips calibrate: both planners predict on that built-in (a smoke test).
On 2 quiet cores: two calibrates (minutes each), 25 rows of ~25-60 s of training (~20 min;
about twice that while another core's worth of work runs); --from takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASELINE = "a150e52"  # the planner before issue 48's rewrite
SETTLED_STEPS = 40  # a peak that did not rise over this many last steps has settled
EVERY = 10  # steps per logged window
PLANNERS = ("old", "new")
MARK = {True: "ok", False: "MISSED"}  # against issue 48's bars

LLAMA = {  # CPU-sized: ~3M parameters
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
TEXT = {"source": "wikitext", "seq_len": 128}
# name -> (its config's sections but [train], global batch, steps: each row's run ~30-70 s;
# GPT small's peak under FSDP2 settles after ~120 steps, the others' sooner)
MODELS = {
    "llama": (
        {"model": {"name": "hf", "hf_config": "LlamaConfig"}, "model.kwargs": LLAMA, "data": TEXT},
        16,
        80,
    ),
    "cnn": ({"model": {"name": "cnn", "size": "small"}, "data": {"source": "mnist"}}, 128, 100),
    "gpt": ({"model": {"name": "gpt", "size": "small"}, "data": TEXT}, 16, 120),
}
# name -> (world, overrides); the micro-batch is set to one per data-parallel rank
LAYOUTS = {
    "ddp": (2, ["parallel.dp_replicate=2"]),
    "zero3": (2, ["parallel.dp_shard=2"]),
    "zero2": (2, ["parallel.dp_shard=2", "parallel.reshard_after_forward=false"]),
    "zero3-ac-full": (2, ["parallel.dp_shard=2", "parallel.activation_checkpointing=full"]),
    "tp2": (2, ["parallel.tp=2"]),
    "pp2-1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "ddp4": (4, ["parallel.dp_replicate=4"]),
    "zero3x4": (4, ["parallel.dp_shard=4"]),
    "hsdp": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "zero3xtp2": (4, ["parallel.dp_shard=2", "parallel.tp=2"]),
    "pp2xzero3": (4, ["parallel.pp=2", "parallel.dp_shard=2"]),
    "pp2xtp2": (4, ["parallel.pp=2", "parallel.tp=2"]),
}
# model -> its rows: only layouts the launcher accepts for it (`scaletrain plan --all`)
GRID = {
    "llama": ["ddp", "zero3", "zero3-ac-full", "tp2", "ddp4", "zero3x4", "hsdp", "zero3xtp2"],
    "cnn": ["ddp", "zero3", "zero2", "ddp4", "zero3x4", "hsdp"],
    "gpt": [
        *("ddp", "zero3", "zero2", "tp2", "pp2-1f1b"),
        *("ddp4", "zero3x4", "hsdp", "zero3xtp2", "pp2xzero3", "pp2xtp2"),
    ],
}


def layout_overrides(layout: str, *, global_batch: int) -> list[str]:
    """The layout's overrides and a micro-batch of one per data-parallel rank."""
    world, keys = LAYOUTS[layout]
    degree = {k.split("=")[0].removeprefix("parallel."): k.split("=")[1] for k in keys}
    dp = world // (int(degree.get("tp", 1)) * int(degree.get("pp", 1)))
    return [*keys, f"train.micro_batch={global_batch // dp}"]


def grid(models: list[str], worlds: list[int]) -> list[dict]:
    """The rows: each model's layouts on the given world sizes."""
    rows = []
    for model in models:
        for layout in (name for name in GRID[model] if LAYOUTS[name][0] in worlds):
            world, batch = LAYOUTS[layout][0], MODELS[model][1]
            over = layout_overrides(layout, global_batch=batch)
            rows.append({"model": model, "world": world, "layout": layout, "overrides": over})
    return rows


def write_configs(out: Path, models: list[str], *, steps_scale: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model in models:
        sections, batch, steps = MODELS[model]
        steps = max(2 * EVERY, round(steps * steps_scale / EVERY) * EVERY)
        train = {"steps": steps, "seed": 0, "global_batch": batch, "micro_batch": batch // 2}
        sections = {**sections, "train": {**train, "eval_examples": batch}}
        sections["log"] = {"every": EVERY, "quiet": True}
        (out / f"{model}.toml").write_text(
            "".join(
                f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
                for name, keys in sections.items()
            )
        )


# --------------------------------------------------------------- the two planners' sources


def baseline_tree(rev: str, where: Path | None) -> tuple[Path, bool]:
    """A worktree of `rev` at `where` (reused when it already holds rev), else in /tmp;
    and whether the caller removes it at the end."""
    want = _git("rev-parse", f"{rev}^{{commit}}")
    if where is not None and where.is_dir():
        if _git("-C", str(where), "rev-parse", "HEAD") == want:
            return where, False
        _git("worktree", "remove", "--force", str(where))
    path = where or Path(tempfile.mkdtemp(prefix="plan-baseline-"))
    _git("worktree", "add", "--detach", str(path), want)
    return path, where is None


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def calibrate(src: Path, out: Path, *, worlds: str) -> float:
    """`scaletrain calibrate` at its defaults from `src`; its wall time (log beside `out`)."""
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        cmd = [sys.executable, "-m", "scaletrain", "calibrate", "--world", worlds, "--out"]
        proc = subprocess.run(
            [*cmd, str(out)], env={**os.environ, "PYTHONPATH": str(src)}, stdout=log, stderr=log
        )
    if proc.returncode:
        sys.exit(f"calibrate from {src} failed: {out.with_suffix('.log')}")
    return time.perf_counter() - start


def predict(src: Path, profile: str, rows: list[dict], configs: Path) -> list[dict]:
    """Each row predicted by the planner in `src` (this file's --predict, in a subprocess)."""
    jobs = [
        {"config": str(configs / f"{r['model']}.toml"), **{k: r[k] for k in ("overrides", "world")}}
        for r in rows
    ]
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"profile": profile, "jobs": jobs}))
        cmd = [sys.executable, __file__, "--predict", str(spec), str(out)]
        proc = subprocess.run(
            cmd, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True
        )
        if proc.returncode:
            sys.exit(f"predicting from {src} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def predict_main(spec: Path, out: Path) -> None:
    """The driver, run with PYTHONPATH at one planner's src: the same calls for both."""
    from scaletrain.config import load_config
    from scaletrain.planner import predict_configured
    from scaletrain.runtime.hardware import load_profile

    task = json.loads(spec.read_text())
    profile = load_profile(task["profile"])
    preds = []
    for job in task["jobs"]:
        try:
            config = load_config(Path(job["config"]), job["overrides"])
            pred = predict_configured(config, world_size=job["world"], profile=profile)
        except Exception as e:  # refused by this revision: the row is scored without it
            preds.append({"error": f"{type(e).__name__}: {e}"})
            continue
        m = pred.memory_bytes
        held = held_at_setup(config.parallel, m, world=job["world"])
        preds.append({"step_time_s": pred.step_time_s, "memory": m, "above": m["peak"] - held})
    out.write_text(json.dumps(preds))


def held_at_setup(par, memory: dict, *, world: int) -> int:
    """What the planner predicts a rank holds before its first step, which the measured
    baseline already contains: the parameters, and under plain DDP with
    gradient_as_bucket_view (the default) the gradients too, which are views into the
    buckets DDP allocates when it wraps the model."""
    replicate = (
        par.dp_replicate if par.dp_replicate > 0 else world // (par.dp_shard * par.tp * par.pp)
    )
    ddp = replicate > 1 and par.dp_shard == 1 and getattr(par, "gradient_as_bucket_view", True)
    return memory["params"] + (memory["grads"] if ddp else 0)


def train(cfg: Path, row: dict, run_dir: Path) -> dict:
    start = time.perf_counter()
    shutil.rmtree(run_dir, ignore_errors=True)  # a retry starts afresh, never resumes
    cmd = [sys.executable, "-m", "scaletrain", "train", str(cfg), *row["overrides"]]
    cmd += ["--nproc", str(row["world"]), "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return {**read_run(run_dir), "wall_s": time.perf_counter() - start}


def read_run(run_dir: Path) -> dict:
    """A finished run's median step time and largest peak above baseline (module doc)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    windows = [r for r in map(json.loads, lines) if r.get("kind") == "train"][1:]  # warm-up
    peaks = [r["window_peak_above_baseline_bytes"] for r in windows]
    early = [p for r, p in zip(windows, peaks) if r["step"] <= windows[-1]["step"] - SETTLED_STEPS]
    return {
        "step_time_s": statistics.median(r["step_time_s"] for r in windows),
        "above": max(peaks),
        # a run no longer than SETTLED_STEPS: the rise over all its windows after the first
        "late_rise": max(peaks) - max(early, default=peaks[0]),
    }


def scores(rows: list[dict], planner: str) -> dict:
    """The issue's figures for one planner over the rows it predicted: |predicted /
    measured - 1| of step and peak, and per (model, world) its pick (the fastest predicted):
    (layout, measured rank, rows, measured gap to the fastest, the fastest's layout)."""
    done = [r for r in rows if "error" not in r["pred"][planner]]
    step = [abs(_ratio(r, planner, "step_time_s") - 1) for r in done] or [float("nan")]
    peak = [abs(_ratio(r, planner, "above") - 1) for r in done] or [float("nan")]
    picks = {}
    for key in dict.fromkeys((r["model"], r["world"]) for r in done):
        group = sorted(
            (r for r in done if (r["model"], r["world"]) == key),
            key=lambda r: r["meas"]["step_time_s"],
        )
        pick = min(group, key=lambda r: r["pred"][planner]["step_time_s"])
        gap = pick["meas"]["step_time_s"] / group[0]["meas"]["step_time_s"] - 1
        picks[key] = (pick["layout"], group.index(pick) + 1, len(group), gap, group[0]["layout"])
    return {
        "rows": len(done),
        "refused": len(rows) - len(done),
        "step_median": statistics.median(step),
        "step_worst": max(step),
        "peak_median": statistics.median(peak),
        "picks": picks,
    }


def _ratio(row: dict, planner: str, key: str) -> float:
    return row["pred"][planner][key] / max(row["meas"][key], 1e-12)


HEADER = (
    f"{'model':<6}{'w':>2} {'layout':<14}{'step ms':>8}{'old':>8}{'x':>6}{'new':>8}{'x':>6} |"
    f"{'peak MiB':>9}{'old':>8}{'x':>6}{'new':>8}{'x':>6}{'late':>6} |{'foreign':>8}"
)


def format_row(r: dict) -> str:
    """One row: measured, each planner's prediction and ratio, late rise, foreign cores."""
    cells = [f"{r['model']:<6}{r['world']:>2} {r['layout']:<14}"]
    for key, unit, width in (("step_time_s", 1e3, 8), ("above", 2**-20, 9)):
        cells.append(f"{r['meas'][key] * unit:>{width}.1f}")
        for p in (r["pred"][planner] for planner in PLANNERS):
            cells.append(
                f"{'refused':>14}"
                if "error" in p
                else f"{p[key] * unit:>8.1f}{p[key] / max(r['meas'][key], 1e-12):>6.2f}"
            )
        cells.append(f"{r['meas']['late_rise'] / 2**20:>6.1f} |" if width == 9 else " |")
    noisy = " noisy" if r.get("noisy") else ""
    return "".join(cells) + f"{r.get('foreign', float('nan')):>8.2f}{noisy}"


def print_summary(rows: list[dict], calibrate_s: dict) -> None:
    noisy = sum(bool(r.get("noisy")) for r in rows)
    wall = sum(r["meas"].get("wall_s", 0) for r in rows) / 60
    print(
        f"\n{len(rows)} rows ({wall:.0f} min of training), {noisy} noisy (foreign load > 0.1 core)"
    )
    for planner in PLANNERS:
        s, wall = scores(rows, planner), calibrate_s.get(planner)
        print(
            f"{planner} planner (calibrate {'-' if wall is None else f'{wall:.0f} s'}; "
            f"{s['rows']} rows predicted, {s['refused']} refused):\n"
            f"  step |error| median {s['step_median']:.0%} (<= 15%: "
            f"{MARK[s['step_median'] <= 0.15]}), worst {s['step_worst']:.0%} (<= 30%: "
            f"{MARK[s['step_worst'] <= 0.30]}); peak |error| median {s['peak_median']:.0%} "
            f"(<= 25%: {MARK[s['peak_median'] <= 0.25]})"
        )
        for (model, world), (pick, rank, n, gap, best) in s["picks"].items():
            print(
                f"  {model} w{world}: pick {pick} measured #{rank} of {n}, {gap:.0%} slower "
                f"than the fastest ({best}): {MARK[gap <= 0.10 and rank <= 3]}"
            )


# --------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--predict", nargs=2, type=Path, help=argparse.SUPPRESS)  # the driver
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--baseline", default=BASELINE, help="the old planner's git revision")
    p.add_argument("--steps-scale", type=float, default=1.0, help="times each model's steps")
    p.add_argument("--retries", type=int, default=1, help="reruns of a disturbed row")
    p.add_argument("--profile", help="skip calibrate: both planners use this built-in")
    p.add_argument("--keep", type=Path, help="keep configs, profiles, runs, rows.json here")
    p.add_argument("--from", dest="source", type=Path, help="re-predict a --keep DIR's runs")
    a = p.parse_args()
    if a.predict:
        return predict_main(*a.predict)
    models, worlds = a.models.split(","), [int(w) for w in a.worlds.split(",")]
    kept = a.source or a.keep  # a kept dir holds its baseline worktree too, for --from
    work = kept or Path(tempfile.mkdtemp(prefix="plan-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    tree, remove = baseline_tree(a.baseline, kept and kept / "baseline")
    srcs = {"old": tree / "src", "new": REPO / "src"}
    try:
        run(a, work, srcs, models, worlds)
    finally:
        if remove:
            _git("worktree", "remove", "--force", str(tree))
        if not kept:
            shutil.rmtree(work, ignore_errors=True)


def run(a, work: Path, srcs: dict, models: list[str], worlds: list[int]) -> None:
    kept = json.loads((work / "rows.json").read_text()) if a.source else {}
    calibrate_s = kept.get("calibrate_s", {})
    profile = kept.get("profile") if a.source else a.profile  # a built-in: no calibrate
    profiles = {pl: profile or str(work / f"profile-{pl}.toml") for pl in PLANNERS}
    if a.source:
        rows = [r for r in kept["rows"] if r["model"] in models and r["world"] in worlds]
    else:
        rows = grid(models, worlds)
        write_configs(work / "configs", models, steps_scale=a.steps_scale)
        for planner in () if a.profile else PLANNERS:  # one after the other: 2 cores
            out = Path(profiles[planner])
            calibrate_s[planner] = calibrate(srcs[planner], out, worlds=a.worlds)
            print(
                f"calibrate ({planner}, {srcs[planner]}): {calibrate_s[planner]:.0f} s", flush=True
            )
    for planner in PLANNERS:  # before training: a refused config shows at once
        preds = predict(srcs[planner], profiles[planner], rows, work / "configs")
        for r, pred in zip(rows, preds, strict=True):
            r.setdefault("pred", {})[planner] = pred
        for error in dict.fromkeys(p["error"] for p in preds if "error" in p):
            n = sum(p.get("error") == error for p in preds)
            print(f"{planner} planner refuses {n} of {len(rows)} rows: {error}", flush=True)
    print(HEADER, flush=True)
    for r in rows:
        run_dir = work / "runs" / f"{r['model']}-w{r['world']}-{r['layout']}"
        if a.source:
            r["meas"] = {**r["meas"], **read_run(run_dir)}  # the wall time kept
        else:
            from common import NOISY_CORES, measured

            cfg = work / "configs" / f"{r['model']}.toml"
            go = partial(train, cfg, r, run_dir)
            r["meas"], r["foreign"], _ = measured(go, retries=a.retries)
            r["noisy"] = r["foreign"] > NOISY_CORES
            done = {"calibrate_s": calibrate_s, "profile": a.profile}
            done["rows"] = [x for x in rows if "meas" in x]
            (work / "rows.json").write_text(json.dumps(done, indent=1))
        print(format_row(r), flush=True)
    print_summary(rows, calibrate_s)


if __name__ == "__main__":
    main()
