"""The planner against real runs: predicted and measured step time and peak memory, side by
side, for a grid of layouts of the built-in GPT at two sizes and world sizes 2 and 4.

Each layout is trained for real (`scaletrain train`, its own run directory, the same steps,
log.every windows) and predicted by the planner for the same config and world
(`planner.predict_configured`), with the profile `scaletrain calibrate
CONFIG` writes for that size first (the model's own steps, in as many processes side by
side as the busiest world keeps cores busy, fit what a step costs beyond its matmuls; the
collectives are measured per world size: planner/reference.py).

Measured: the median `step_time_s` of the logged windows after the first (warm-up), and the
largest `window_peak_above_baseline_bytes` (the CPU has no allocator peak counter: the RSS
high-water mark of each window above what the rank held after set-up). Each layout runs 160
steps by default: under FSDP2 the resident peak climbs for ~120 steps before it settles
(glibc's heap fragments around the per-unit gather buffers; BENCHMARKS.md), and "late rise"
prints how much it still rose over the last SETTLED_STEPS steps. The baseline
already holds the parameters, and under DDP the gradients in its buckets, so the prediction
compared is the peak less those (`held_at_setup`).

This VM's speed moves by a quarter from minute to minute, and the planner predicts at its
speed when calibrate ran. So the bench times calibrate's reference again (a round of its
micro-batches) before and after each run (`reference.pace`), and prints beside each row
how much slower the machine ran than at calibrate (the mean of the two) and the step
ratio at that pace (the predicted step times the pace over the measured one): what the
planner's model missed, with the machine's drift taken out. The raw ratio is the one the
summary counts first.

Printed: every row, each ratio, the summary errors, and for each (size, world) whether
the planner's pick is within 10% of the fastest measured layout and in the measured top 3.
--keep DIR keeps the configs, the profiles, every run directory and its pace; --from DIR
predicts again for them (after a change to the planner) and trains nothing.

    .venv/bin/python bench/plan.py [--sizes small,base] [--worlds 2,4] [--steps 160] [--every 10]
        [--keep DIR]
    .venv/bin/python bench/plan.py --from DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTLED_STEPS = 40  # a peak that did not rise over this many last steps has settled
SCALETRAIN = [sys.executable, "-m", "scaletrain"]

CONFIG = """
[model]
name = "gpt"
size = "{size}"
[data]
source = "wikitext"
seq_len = 128
[train]
steps = {steps}
seed = 0
global_batch = 16
micro_batch = 8
eval_examples = 16
[log]
every = {every}
quiet = true
"""

# world -> layouts (overrides); each must be one the launcher accepts for both sizes
GRID = {
    2: {
        "ddp": ["parallel.dp_replicate=2"],
        "zero3": ["parallel.dp_shard=2"],
        "zero2": ["parallel.dp_shard=2", "parallel.reshard_after_forward=false"],
        "zero3-mb4": ["parallel.dp_shard=2", "train.micro_batch=4"],
        "zero3-ac-full": ["parallel.dp_shard=2", "parallel.activation_checkpointing=full"],
        "tp2": ["parallel.tp=2", "train.micro_batch=16"],
        "pp2-1f1b": ["parallel.pp=2", "train.micro_batch=16"],
    },
    4: {
        "zero3x4": ["parallel.dp_shard=4", "train.micro_batch=4"],
        "hsdp": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "train.micro_batch=4"],
        "zero3xtp2": ["parallel.dp_shard=2", "parallel.tp=2"],
        "pp2xzero3": ["parallel.pp=2", "parallel.dp_shard=2"],
        "pp2xtp2": ["parallel.pp=2", "parallel.tp=2", "train.micro_batch=16"],
        "ddp4": ["parallel.dp_replicate=4", "train.micro_batch=4"],
    },
}


def measure(cfg: Path, overrides: list[str], world: int, run_dir: Path) -> dict:
    cmd = [
        *SCALETRAIN,
        "train",
        str(cfg),
        *overrides,
        "--nproc",
        str(world),
        "--run-dir",
        str(run_dir),
    ]
    subprocess.run(
        cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900
    )
    return measured(run_dir)


def measured(run_dir: Path) -> dict:
    """A finished run's median step time and largest peak above baseline (module doc)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"][1:]  # the first window warms up
    peaks = [r["window_peak_above_baseline_bytes"] for r in train]
    last = [r for r in train if r["step"] > train[-1]["step"] - SETTLED_STEPS]
    return {
        "step_time_s": statistics.median(r["step_time_s"] for r in train),
        "above_baseline": max(peaks),
        # how much the peak still rose over the last SETTLED_STEPS steps (0: it had settled);
        # a run no longer than that: over all its windows after the first
        "late_rise": max(peaks)
        - max((p for r, p in zip(train, peaks, strict=True) if r not in last), default=peaks[0]),
        "config": run_dir / "config.toml",
    }


def pace_now(cfg: Path, profile, busy: int) -> float:
    """How much slower the machine runs now than when calibrate timed its reference (timed
    again as calibrate timed it, `busy` ranks side by side: reference.pace)."""
    from scaletrain.config import load_config
    from scaletrain.planner.calibrate import _launch
    from scaletrain.planner.reference import pace

    data = load_config(cfg).model_dump(mode="json")
    return pace(data, launch=_launch, concurrent=busy, profile=profile)


def predict(config_path: Path, world: int, profile) -> dict:
    from scaletrain.config import load_config
    from scaletrain.planner import predict_configured

    config = load_config(config_path)
    pred = predict_configured(config, world_size=world, profile=profile)
    m = pred.memory_bytes
    return {
        "step_time_s": pred.step_time_s,
        "above_baseline": m["peak"] - held_at_setup(config, m),
        "memory": m,
    }


def held_at_setup(config, memory: dict) -> int:
    """What the planner predicts a rank holds before its first step, which the measured
    baseline already contains: the parameters, and under plain DDP with
    gradient_as_bucket_view (the default) the gradients too, which are views into the
    buckets DDP allocates when it wraps the model."""
    par = config.parallel
    ddp_buckets = par.dp_replicate > 1 and par.dp_shard == 1 and par.gradient_as_bucket_view
    return memory["params"] + (memory["grads"] if ddp_buckets else 0)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="small,base")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--every", type=int, default=10, help="steps per logged window")
    p.add_argument(
        "--keep",
        type=Path,
        help="keep the configs, profiles and run directories here (default: a temporary one)",
    )
    p.add_argument(
        "--from",
        dest="source",
        type=Path,
        help="predict again for the runs and profiles a --keep DIR holds; train nothing",
    )
    a = p.parse_args()
    from scaletrain.runtime.hardware import load_profile

    rows = []
    if a.source:
        # the sizes and rows the kept directory holds (a bench of one size keeps only its own)
        for size in (s for s in a.sizes.split(",") if (a.source / f"{s}-profile.toml").is_file()):
            profile = load_profile(str(a.source / f"{size}-profile.toml"))
            for world in (int(w) for w in a.worlds.split(",")):
                for name in GRID[world]:
                    run_dir = a.source / f"{size}-{world}-{name}"
                    if not (run_dir / "metrics.jsonl").is_file():
                        continue
                    got = measured(run_dir)
                    pred = predict(got["config"], world, profile)
                    paced = run_dir / "pace.json"
                    got["pace"] = json.loads(paced.read_text())["pace"] if paced.is_file() else 1.0
                    rows.append(
                        {"size": size, "world": world, "layout": name, "meas": got, "pred": pred}
                    )
                    _print_row(rows[-1])
        _summary(rows)
        return
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(str(a.keep)) if a.keep else tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes.split(","):
            cfg = Path(tmp) / f"{size}.toml"
            cfg.write_text(CONFIG.format(size=size, steps=a.steps, every=a.every))
            out = Path(tmp) / f"{size}-profile.toml"
            subprocess.run(
                [*SCALETRAIN, "calibrate", str(cfg), "--world", a.worlds, "--out", str(out)],
                check=True,
            )
            profile = load_profile(str(out))
            worlds = [int(w) for w in a.worlds.split(",")]
            busy = min(profile.cores, max(worlds))  # as calibrate ran its reference
            before = pace_now(cfg, profile, busy)
            for world in worlds:
                for name, overrides in GRID[world].items():
                    run_dir = Path(tmp) / f"{size}-{world}-{name}"
                    got = measure(cfg, overrides, world, run_dir)
                    after = pace_now(cfg, profile, busy)
                    got["pace"] = (before + after) / 2
                    before = after
                    (run_dir / "pace.json").write_text(json.dumps({"pace": got["pace"]}))
                    pred = predict(got["config"], world, profile)
                    rows.append(
                        {"size": size, "world": world, "layout": name, "meas": got, "pred": pred}
                    )
                    _print_row(rows[-1])
    _summary(rows)


def _print_row(r: dict) -> None:
    m, p = r["meas"], r["pred"]
    print(
        f"{r['size']:>5} w{r['world']} {r['layout']:<14} step pred {p['step_time_s']:.3f} s "
        f"meas {m['step_time_s']:.3f} s ratio {p['step_time_s'] / m['step_time_s']:.2f} | "
        f"peak above baseline pred {p['above_baseline'] / 2**20:.1f} MiB meas "
        f"{m['above_baseline'] / 2**20:.1f} MiB ratio {p['above_baseline'] / max(m['above_baseline'], 1):.2f} "
        f"(late rise {m['late_rise'] / 2**20:.1f} MiB) | machine {m['pace']:.2f}x as slow as at "
        f"calibrate, step ratio at that pace {p['step_time_s'] * m['pace'] / m['step_time_s']:.2f}",
        flush=True,
    )
    m = p["memory"]
    print(
        "      predicted MiB: "
        + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in m.items() if k != "peak"),
        flush=True,
    )


def _summary(rows: list[dict]) -> None:
    def err(key):
        return [abs(r["pred"][key] / max(r["meas"][key], 1e-12) - 1) for r in rows]

    paced = [
        abs(r["pred"]["step_time_s"] * r["meas"]["pace"] / r["meas"]["step_time_s"] - 1)
        for r in rows
    ]
    for label, e in (
        ("step time", err("step_time_s")),
        ("step time at the machine's pace", paced),
        ("peak above baseline", err("above_baseline")),
    ):
        print(
            f"{label}: median |error| {statistics.median(e):.0%}, max {max(e):.0%}, "
            f"within 20%: {sum(x <= 0.2 for x in e)} of {len(e)}"
        )
    groups = {}
    for r in rows:
        groups.setdefault((r["size"], r["world"]), []).append(r)
    for (size, world), group in groups.items():
        measured = sorted(group, key=lambda r: r["meas"]["step_time_s"])
        pick = min(group, key=lambda r: r["pred"]["step_time_s"])
        rank = measured.index(pick) + 1
        slower = pick["meas"]["step_time_s"] / measured[0]["meas"]["step_time_s"] - 1
        print(
            f"{size} w{world}: pick {pick['layout']} is measured #{rank} of {len(group)}, "
            f"{slower:.0%} slower than the fastest ({measured[0]['layout']})"
        )


if __name__ == "__main__":
    main()
