"""Precision and gradient accumulation on this machine, each pair side by side.

(a) `precision.mode = "auto"` vs `"fp32"`: step time of a matmul-heavy job (default: `mlp`
    `base` on MNIST, micro-batch = global batch = 1024, so nearly all time is in three
    GEMMs), 1 process x all cores. Prints the speed-up and what `auto` chose, as
    `scaletrain explain` reports it.
(b) accumulation k = 8 vs k = 1 at the same global batch (default: `cnn` `small` on MNIST,
    global batch 512 = 8 x 64 or 1 x 512), 1 process x all cores: peak memory
    (`peak_mem_bytes` of metrics.jsonl: the process's peak RSS on CPU), throughput
    (examples/s over the timed steps) and the final loss, which should agree: same examples,
    same gradient up to rounding.

Both run through the CLI (`scaletrain train cfg.toml --run-dir ...`, generated TOML),
interleaved over --reps, timing the records past the warm-up (start-up, data loading and
the final evaluation excluded). Runs disturbed by other processes on the machine are
retried (see `measured` in bench/peers.py).

    .venv/bin/python bench/precision_accum.py [--reps 3]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

from peers import BIN, NOISY_CORES, measured

CONFIG = """
name = "bench-{tag}"
[model]
name = "{model}"
size = "{size}"
[data]
source = "{source}"
[optim]
lr = 1e-3
schedule = "constant"
grad_clip = 1.0
[train]
steps = {steps}
global_batch = {global_batch}
micro_batch = {micro_batch}
eval_examples = 1
threads = 0
[parallel]
dp = 1
[precision]
mode = "{precision}"
[log]
every = {log_every}
quiet = true
"""


def write_config(tmp: Path, tag: str, **fields) -> Path:
    cfg = tmp / f"{tag}.toml"
    cfg.write_text(CONFIG.format(tag=tag, **fields))
    return cfg


def train(tmp: Path, tag: str, *, warmup: int, log_every: int, **fields) -> dict:
    """One CLI run; speed and memory from metrics.jsonl, final loss from summary.json."""
    cfg = write_config(tmp, tag, log_every=log_every, **fields)
    run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{tag}-")) / "run"  # fresh per retry
    proc = subprocess.run([str(BIN / "scaletrain"), "train", str(cfg), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"scaletrain failed on {cfg}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r.get("kind") == "train"]
    timed = [r for r in train_records if r["step"] > warmup]
    seconds = sum(r["step_time_s"] * log_every for r in timed)  # each record covers log_every steps
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"step_time_s": seconds / (len(timed) * log_every),
            "examples_per_s": sum(r["examples"] for r in timed) / seconds,
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in train_records),
            "final_loss": summary["final_loss"], "world_size": summary["world_size"]}


def explain(tmp: Path, cfg: Path) -> dict[str, str]:
    """The 'derived' table of `scaletrain explain` as {quantity: value}."""
    out = subprocess.run([str(BIN / "scaletrain"), "explain", str(cfg)], capture_output=True,
                         text=True, check=True, env={**os.environ, "COLUMNS": "250"}).stdout
    derived = out[out.rindex("derived"):]
    rows = (re.split(r"\s*│\s*", line.strip("│ ")) for line in derived.splitlines())
    return {row[0]: row[1] for row in rows if len(row) == 2}


def run_pair(tmp: Path, a, name: str, variants: dict[str, dict], common: dict) -> dict:
    """Interleave the variants over a.reps; returns {variant: [result per rep]}."""
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(a.reps):
        order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
        for variant in order:
            tag = f"{name}-{variant.replace('=', '')}-{rep}"  # run names: [A-Za-z0-9_.-]
            job = partial(train, tmp, tag, **common, **variants[variant])
            r, foreign, note = measured(job, retries=a.retries)
            assert r["world_size"] == 1
            r["noisy"] = foreign > NOISY_CORES
            results[variant].append(r)
            print(f"  rep {rep} {variant:>6}: {r['step_time_s'] * 1e3:8.1f} ms/step "
                  f"{r['examples_per_s']:8.0f} examples/s  peak {r['peak_mem_bytes'] / 2**20:6.0f} MiB"
                  f"  loss {r['final_loss']:.5f}  foreign load {foreign:.2f} cores"
                  f"{note}", flush=True)
    return results


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def per_rep(runs: list[dict], key: str, fmt: str) -> str:
    return " ".join(format(r[key], fmt) + ("~" if r["noisy"] else "") for r in runs)


def part_a(tmp: Path, a) -> None:
    common = dict(model=a.a_model, size=a.a_size, source=a.a_source, global_batch=a.a_batch,
                  micro_batch=a.a_batch, steps=a.a_warmup + a.a_steps, warmup=a.a_warmup,
                  log_every=a.a_warmup)
    derived = explain(tmp, write_config(tmp, "explain-auto", precision="auto", **{
        k: v for k, v in common.items() if k != "warmup"}))
    print(f"(a) precision auto vs fp32: {a.a_model}-{a.a_size} on {a.a_source}, micro-batch = "
          f"global batch = {a.a_batch}, 1 process x {derived['threads per process']} threads, "
          f"{a.a_steps} timed steps after {a.a_warmup}")
    print(f"    scaletrain explain: precision = {derived['precision']}")
    res = run_pair(tmp, a, "prec", {"fp32": {"precision": "fp32"},
                                   "auto": {"precision": "auto"}}, common)
    print(f"    {'mode':<6} {'ms/step':>8}  {'per rep':<24} {'final loss':>10}")
    for mode, runs in res.items():
        print(f"    {mode:<6} {median(runs, 'step_time_s') * 1e3:>8.1f}  "
              f"{per_rep([{**r, 'ms': r['step_time_s'] * 1e3} for r in runs], 'ms', '.1f'):<24} "
              f"{runs[0]['final_loss']:>10.5f}")
    speedup = median(res["fp32"], "step_time_s") / median(res["auto"], "step_time_s")
    print(f"    speed-up auto / fp32 (median step time): {speedup:.2f}x (target >= 3x)")


def part_b(tmp: Path, a) -> None:
    k = a.b_accum
    micro = a.b_batch // k
    common = dict(model=a.b_model, size=a.b_size, source=a.b_source, global_batch=a.b_batch,
                  steps=a.b_warmup + a.b_steps, warmup=a.b_warmup, log_every=a.b_warmup,
                  precision=a.b_precision)
    print(f"(b) accumulation k={k} vs k=1: {a.b_model}-{a.b_size} on {a.b_source}, global batch "
          f"{a.b_batch} ({k} x {micro} vs 1 x {a.b_batch}), {a.b_precision}, 1 process x all "
          f"cores, {a.b_steps} timed steps after {a.b_warmup}")
    res = run_pair(tmp, a, "accum", {"k=1": {"micro_batch": a.b_batch},
                                    f"k={k}": {"micro_batch": micro}}, common)
    print(f"    {'':<6} {'peak MiB':>8} {'examples/s':>10}  {'examples/s per rep':<24} {'final loss':>10}")
    for variant, runs in res.items():
        print(f"    {variant:<6} {median(runs, 'peak_mem_bytes') / 2**20:>8.0f} "
              f"{median(runs, 'examples_per_s'):>10.0f}  "
              f"{per_rep(runs, 'examples_per_s', '.0f'):<24} {runs[0]['final_loss']:>10.5f}")
    one, many = res["k=1"], res[f"k={k}"]
    print(f"    peak memory k={k} / k=1: "
          f"{median(many, 'peak_mem_bytes') / median(one, 'peak_mem_bytes'):.3f}; "
          f"throughput k={k} / k=1: "
          f"{median(many, 'examples_per_s') / median(one, 'examples_per_s'):.3f}; "
          f"final loss difference {abs(many[0]['final_loss'] - one[0]['final_loss']):.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--retries", type=int, default=2,
                   help="re-runs of a run disturbed by other processes")
    p.add_argument("--parts", default="a,b")
    p.add_argument("--a-model", default="mlp")
    p.add_argument("--a-size", default="base")
    p.add_argument("--a-source", default="mnist")
    p.add_argument("--a-batch", type=int, default=1024)
    p.add_argument("--a-steps", type=int, default=60)
    p.add_argument("--a-warmup", type=int, default=10)
    p.add_argument("--b-model", default="cnn")
    p.add_argument("--b-size", default="small")
    p.add_argument("--b-source", default="mnist")
    p.add_argument("--b-batch", type=int, default=512)
    p.add_argument("--b-accum", type=int, default=8)
    p.add_argument("--b-precision", default="fp32")
    p.add_argument("--b-steps", type=int, default=20)
    p.add_argument("--b-warmup", type=int, default=5)
    a = p.parse_args()
    if a.a_steps % a.a_warmup or a.b_steps % a.b_warmup:
        p.error("steps must be multiples of the warm-up (one metrics record per warm-up length)")
    with tempfile.TemporaryDirectory() as tmp:
        if "a" in a.parts:
            part_a(Path(tmp), a)
        if "b" in a.parts:
            part_b(Path(tmp), a)
    print("~ : the run still had > {:.2f} cores of foreign load after the retries".format(NOISY_CORES))


if __name__ == "__main__":
    main()
