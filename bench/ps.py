"""Parameter servers vs DDP with a straggler: throughput and time to an accuracy, side by side.

Five contenders train the same job through the real CLI (`scaletrain train ... --nproc N`),
one after the other in this invocation, each after the machine is quiet
(`common.measured`): DDP (parallel.strategy = "collective", 3 ranks), and parameter
servers with 1 server + 3 workers under sync, ssp (staleness 2 and 8) and async. Every
process runs 1 torch thread, and data-parallel rank 0 / worker 0 is slowed --slow-factor
times (bench/straggler.py: the model's forward and backward on that rank take that many
times as long, so the other DDP ranks wait for it in the all-reduce). Config: identical for
all but the strategy keys and which rank is slowed (printed, with every key that differs in
the resolved configs).

What is measured, the same way for every contender:

- examples/s: the examples applied (summary.json's `examples`) over the training wall time:
  DDP from the loop's start to its last step, its mid-run evaluation pauses included
  (`train_time_s` plus those pauses, each `eval_time_s` over the evaluations, the final
  one included); PS server 0 from serving until every worker left (`train_time_s`), its
  concurrent evaluations included.
- time to the target accuracy: the training clock at the end of the first global step s
  whose evaluation (kind "eval" in metrics.jsonl, train.eval_examples held-out examples)
  reaches --target. DDP's records have no clock, so its clock at s is the sum of its train
  windows up to s (examples / examples_per_s of each record: training steps only) plus the
  evaluation pauses before s (each eval_time_s over its evaluations). PS records carry server 0's clock (`time_s` of the train record at s).
- first-half examples/s: the same clock at the record nearest train.steps / 2: the rate
  while every worker still has steps to do (a diagnosis of the run's tail, not a goal).
- final accuracy: this script evaluates each run's model.safetensors on the whole held-out
  split (MNIST: the 10k test set) with scaletrain's own evaluation code, after all runs.
- staleness: summary.json's histogram (PS only): max and mean over every update.

    .venv/bin/python bench/ps.py               # 400 steps, slow factor 3: ~11 min on 2 cores
    .venv/bin/python bench/ps.py --quick       # a smoke version on digits, < 2 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import BIN, NOISY_CORES, ROOT, measured

CONFIG = """
name = "bench-ps"
[model]
name = "straggler:build"  # bench/straggler.py: the built-in model, one rank slowed
kwargs = {{ model = "{model}", size = "{size}", factor = {slow_factor} }}
[data]
source = "{source}"
[optim]
name = "adamw"
lr = {lr}
warmup_steps = {warmup}
schedule = "cosine"
grad_clip = {grad_clip}
[train]
steps = {steps}
global_batch = {global_batch}
micro_batch = {micro_batch}
eval_every = {eval_every}
eval_examples = {eval_examples}
threads = 1
seed = 0
[log]
every = {log_every}
quiet = true
"""
WORKERS = 3
# The workers import the model factory (straggler:build) from bench/.
BENCH_ON_PATH = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]),
}
CONTENDERS = {  # name: (--nproc, the strategy's overrides)
    "ddp": (WORKERS, ["parallel.strategy=collective", f"parallel.dp={WORKERS}"]),
    "ps-sync": (
        WORKERS + 1,
        ["parallel.strategy=ps", f"parallel.dp={WORKERS}", "ps.servers=1", "ps.mode=sync"],
    ),
    "ps-ssp2": (
        WORKERS + 1,
        [
            "parallel.strategy=ps",
            f"parallel.dp={WORKERS}",
            "ps.servers=1",
            "ps.mode=ssp",
            "ps.staleness=2",
        ],
    ),
    "ps-ssp8": (
        WORKERS + 1,
        [
            "parallel.strategy=ps",
            f"parallel.dp={WORKERS}",
            "ps.servers=1",
            "ps.mode=ssp",
            "ps.staleness=8",
        ],
    ),
    "ps-async": (
        WORKERS + 1,
        ["parallel.strategy=ps", f"parallel.dp={WORKERS}", "ps.servers=1", "ps.mode=async"],
    ),
}
GOAL_SPEED, GOAL_POINTS = 1.5, 0.5  # async >= 1.5x DDP's examples/s, accuracy within 0.5 pt
# How the contenders differ beyond their config keys (read off the code; see BENCHMARKS.md).
DIFFERENCES = [
    "processes: DDP 3 ranks (gloo); PS 4 (server 0 + 3 workers), each a supervisor and its "
    "child, TensorPipe RPC over TCP (uv) on lo; on 2 cores both oversubscribe",
    "updates per global step: DDP and sync 1 (the mean gradient of global_batch examples); "
    "ssp and async 3, one per worker gradient of global_batch / 3 examples",
    "LR schedule: in optimizer updates; under ssp/async warmup and cosine length are x3 "
    "updates, so the LR at a global step is the same for all",
    "gradient clipping (optim.grad_clip): DDP clips the all-reduced gradient; every PS worker "
    "clips its own before pushing (sync averages the clipped gradients)",
    "end of the run: all at train.steps x global_batch examples applied; under ssp/async the "
    "fast workers take more than train.steps steps of their own and the straggler fewer, so "
    "the examples applied are not the first train.steps global batches of the order",
    "straggler sleep: DDP rank 0 sleeps (factor - 1) x its train_step (forward, backward, "
    "all-reduce, clip, AdamW; not the fetch); PS worker 0 sleeps (factor - 1) x its fetch + "
    "forward/backward/clip (not the RPC); DDP's fast ranks compute their next step during "
    "that sleep, so its straggler then computes alone, while under sync/ssp the workers wait "
    "for the update and the straggler computes beside them: on 2 cores its compute, and so "
    "its sleep, is longer",
    "mid-run evaluation: DDP pauses, each rank evaluates a third; PS server 0 evaluates all "
    "of them on a background thread while the workers train (on the weights it has when the "
    "thread gets to it, at or after the step)",
]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--steps", type=int, default=400, help="train.steps (global steps)")
    p.add_argument(
        "--slow-factor", type=float, default=3.0, help="how many times slower worker 0 runs"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke version: MLP tiny on digits, 40 steps, target 0.8 (< 2 min)",
    )
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=", ".join(CONTENDERS))
    p.add_argument("--target", type=float, default=0.97, help="accuracy for the time-to column")
    p.add_argument("--model", default="cnn")
    p.add_argument("--size", default="small")
    p.add_argument("--source", default="mnist")
    p.add_argument("--global-batch", type=int, default=192, help="a multiple of 3 x micro-batch")
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak LR (configs/default.toml)")
    p.add_argument("--warmup", type=int, default=50, help="optim.warmup_steps (global steps)")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument(
        "--eval-examples",
        type=int,
        default=1000,
        help="held-out examples per mid-run evaluation (the final one: all)",
    )
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument(
        "--retries",
        type=int,
        default=0,
        help="re-runs of a run disturbed by other processes (each ~2-3 min)",
    )
    p.add_argument("--keep", type=Path, help="keep the run directories here")
    a = p.parse_args()
    if a.quick:
        a.model, a.size, a.source, a.steps, a.target = "mlp", "tiny", "digits", 40, 0.8
        a.global_batch, a.micro_batch, a.lr, a.warmup = 48, 16, 1e-2, 5
        a.eval_every, a.eval_examples, a.log_every = 10, 200, 5
    if a.global_batch % (WORKERS * a.micro_batch):
        p.error(f"--global-batch must be a multiple of {WORKERS} x --micro-batch")
    if a.eval_every % a.log_every:
        p.error("--eval-every must be a multiple of --log-every (the clock is read at records)")
    return a


def train(name: str, a: argparse.Namespace, config: Path, root: Path) -> dict:
    """One contender through the CLI; its run directory's numbers."""
    nproc, overrides = CONTENDERS[name]
    run_dir = root / name
    cmd = [
        str(BIN / "scaletrain"),
        "train",
        str(config),
        "--nproc",
        str(nproc),
        *overrides,
        # the slowed rank: DDP's rank 0; under PS the servers come first, worker 0 after them
        f"model.kwargs.slow_rank={nproc - WORKERS}",
        "--run-dir",
        str(run_dir),
    ]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=BENCH_ON_PATH)
    if done.returncode != 0:
        raise SystemExit(
            f"{name}: {' '.join(cmd)} failed ({done.returncode}):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    r = read_run(run_dir, a)
    r.update(name=name, run_dir=run_dir, cmd=cmd, total_s=time.perf_counter() - started)
    return r


def read_run(run_dir: Path, a: argparse.Namespace) -> dict:
    """Throughput, the clock at every record, time to the target, staleness."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trains = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    evals = sorted((r for r in records if r["kind"] == "eval"), key=lambda r: r["step"])
    mid = [e for e in evals if e["step"] < a.steps]
    if "ps" in summary:  # server 0's clock, stamped on every record
        wall = summary["train_time_s"]
        clock = {r["step"]: r["time_s"] for r in trains}
        clock[a.steps] = wall  # the run's end, on the same clock as examples/s
        eval_s = []  # concurrent with training: its duration is not recorded
    else:  # windows of training steps, plus the evaluation pauses before each step
        windows = [r["examples"] / r["examples_per_s"] for r in trains]
        # eval_time_s holds the mid-run evaluations and the final one, all of one size
        pause = summary["eval_time_s"] / (len(mid) + 1)
        wall = summary["train_time_s"] + pause * len(mid)
        clock, elapsed = {}, 0.0
        for r, w in zip(trains, windows):
            elapsed += w
            clock[r["step"]] = elapsed + pause * sum(e["step"] < r["step"] for e in mid)
        eval_s = [pause] * len(mid)
    reached = next((e for e in evals if e.get("accuracy", 0.0) >= a.target), None)
    half = max((s for s in clock if s <= a.steps // 2), default=None)
    applied = summary["examples"]
    out = {
        "examples_per_s": applied / wall,
        "wall_s": wall,
        "examples_expected": a.steps * a.global_batch,
        "examples_applied": applied,
        "half_examples_per_s": half * a.global_batch / clock[half] if half else float("nan"),
        "target_step": reached["step"] if reached else None,
        "target_s": clock[reached["step"]] if reached else None,
        "eval_s": sum(eval_s) / len(eval_s) if eval_s else 0.0,
        "evals": len(mid),
        "last_eval_accuracy": evals[-1].get("accuracy") if evals else None,
    }
    if "ps" in summary:
        hist = {int(k): n for k, n in summary["ps"]["staleness_histogram"].items()}
        delay = {int(k): n for k, n in summary["ps"]["delay_histogram"].items()}
        out.update(
            staleness_max=max(hist),
            staleness_mean=_mean(hist),
            delay_mean=_mean(delay),
            updates=summary["ps"]["updates"],
            dead=summary["ps"]["dead_workers"],
        )
    return out


def _mean(hist: dict[int, int]) -> float:
    return sum(k * n for k, n in hist.items()) / max(sum(hist.values()), 1)


def final_accuracy(run_dir: Path) -> tuple[float, int]:
    """(accuracy, examples) of the run's model.safetensors on the whole held-out split."""
    import torch
    from safetensors.torch import load_file

    from scaletrain.config import load_config
    from scaletrain.precision import make_precision
    from scaletrain.training.assemble import build_data, build_loss, build_net
    from scaletrain.training.evaluate import eval_record, eval_totals

    config = load_config(run_dir / "config.toml")
    eval_ds = build_data(config, split="eval")
    net = build_net(config, eval_ds)
    net.load_state_dict(load_file(str(run_dir / "model.safetensors")), strict=True)
    totals = eval_totals(
        net,
        eval_ds,
        limit=len(eval_ds),
        batch=500,
        dp_rank=0,
        dp_size=1,
        counts=True,
        precision=make_precision("fp32", device_type="cpu"),
        device=torch.device("cpu"),
        loss_fn=build_loss(config, eval_ds),
    )
    return eval_record(totals, kind=eval_ds.spec.kind, loss_name=config.train.loss)[
        "accuracy"
    ], int(totals[2])


def config_differences(results: dict[str, dict]) -> dict[str, dict[str, str]]:
    """Every key whose resolved value differs between the contenders' stored configs."""
    import tomllib

    from scaletrain.config import flatten_config

    flat = {
        n: flatten_config(tomllib.loads((r["run_dir"] / "config.toml").read_text()))
        for n, r in results.items()
    }
    keys = sorted({k for f in flat.values() for k in f})
    return {
        k: {n: str(f.get(k, "-")) for n, f in flat.items()}
        for k in keys
        if len({str(f.get(k, "-")) for f in flat.values()}) > 1
    }


def report(results: dict[str, dict], a: argparse.Namespace) -> None:
    ref = results.get("ddp")
    pct = lambda x: f"{100 * x:.2f}"  # noqa: E731
    print(
        f"\n{'contender':<9} {'ex/s':>7} {'/DDP':>5} {'ex/s 1st half':>13} {'/DDP':>5} "
        f"{'final acc %':>11} {'-DDP pt':>7} {f'step@{a.target:g}':>9} {'time s':>7} "
        f"{'/DDP':>5} {'stale max':>9} {'mean':>5} {'delay mean':>10} {'foreign':>7}"
    )
    for name, r in results.items():
        ratio = r["examples_per_s"] / ref["examples_per_s"] if ref else float("nan")
        half = r["half_examples_per_s"] / ref["half_examples_per_s"] if ref else float("nan")
        diff = (r["accuracy"] - ref["accuracy"]) * 100 if ref else float("nan")
        t, tr = "-", "-"
        if r["target_s"] is not None:
            t = f"{r['target_s']:.1f}"
            if ref and ref["target_s"]:
                tr = f"{r['target_s'] / ref['target_s']:.2f}"
        stale = (
            f"{r['staleness_max']:>9} {r['staleness_mean']:>5.1f} {r['delay_mean']:>10.2f}"
            if "staleness_max" in r
            else f"{'-':>9} {'-':>5} {'-':>10}"
        )
        print(
            f"{name:<9} {r['examples_per_s']:>7.0f} {ratio:>5.2f} {r['half_examples_per_s']:>13.0f}"
            f" {half:>5.2f} {pct(r['accuracy']):>11} {diff:>+7.2f} {r['target_step'] or '-':>9}"
            f" {t:>7} {tr:>5} {stale} {r['foreign']:>7.2f}"
            + ("~" if r["foreign"] > NOISY_CORES else "")
        )
    print(f"~ : > {NOISY_CORES} cores of foreign load during the run")
    for name, r in results.items():
        where = (
            f"{r['eval_s']:.2f} s pause each" if name == "ddp" else "on server 0 beside training"
        )
        print(
            f"  {name}: {r['evals']} mid-run evals ({where}); "
            f"wall {r['wall_s']:.1f} s, {r['examples_applied']} of {r['examples_expected']} "
            f"examples; whole command {r['total_s']:.0f} s"
            + (f"; dead workers {r['dead']}" if r.get("dead") else "")
        )
    if ref and "ps-async" in results:
        r = results["ps-async"]
        speed = r["examples_per_s"] / ref["examples_per_s"]
        points = abs(r["accuracy"] - ref["accuracy"]) * 100
        ok = speed >= GOAL_SPEED and points <= GOAL_POINTS
        print(
            f"\ngoal async >= {GOAL_SPEED}x DDP examples/s at accuracy within {GOAL_POINTS} pt: "
            f"{speed:.2f}x, {points:.2f} pt -> {'MET' if ok else 'NOT MET'}"
        )
    print(
        "\ndifferences between the contenders' resolved configs (config.toml; ps.mode and "
        "ps.staleness are not read under collective):"
    )
    for key, values in config_differences(results).items():
        print(f"  {key}: " + ", ".join(f"{n}={v}" for n, v in values.items()))
    print("differences in what they do (read off the code):")
    for line in DIFFERENCES:
        print(f"  - {line}")


def main() -> None:
    a = parse()
    names = a.contenders.split(",")
    unknown = set(names) - set(CONTENDERS)
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}; allowed: {', '.join(CONTENDERS)}")
    print(
        f"{a.model} {a.size} on {a.source}, {a.steps} global steps of {a.global_batch} "
        f"({WORKERS} x {a.global_batch // WORKERS}, micro-batch {a.micro_batch}), AdamW lr "
        f"{a.lr:g} cosine, warmup {a.warmup}, clip {a.grad_clip:g}; worker/rank 0 slowed "
        f"{a.slow_factor:g}x; 1 thread per process; evals every {a.eval_every} steps on "
        f"{a.eval_examples} examples",
        flush=True,
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = a.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        config = root / "bench-ps.toml"
        config.write_text(CONFIG.format(**vars(a)))
        results = {}
        for name in names:
            r, foreign, note = measured(
                lambda name=name: train(name, a, config, root), retries=a.retries
            )
            r["foreign"] = foreign
            results[name] = r
            print(
                f"  ran {name}: {r['examples_per_s']:.0f} examples/s, wall {r['wall_s']:.1f} s"
                f"{note}, foreign load {foreign:.2f} cores",
                flush=True,
            )
        for r in results.values():  # after every run: no contender's timing pays for it
            r["accuracy"], r["accuracy_examples"] = final_accuracy(r["run_dir"])
        print(
            f"final accuracy on {next(iter(results.values()))['accuracy_examples']} held-out "
            f"examples (model.safetensors of each run, scaletrain's eval code)"
        )
        report(results, a)
    print(
        f"\nbenchmark wall time: {time.perf_counter() - started:.0f} s; command: "
        f"{' '.join([Path(sys.executable).name, *sys.argv])}"
    )


if __name__ == "__main__":
    main()
