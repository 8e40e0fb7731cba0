"""Scaling: 2 processes x 1 thread vs 1 process x 1 thread on a compute-bound model.

Same global batch, so each of the 2 ranks does half the work per step; efficiency =
throughput(2) / (2 x throughput(1)). Runs alternate (1, 2, 1, 2, ...); prints the median.

    .venv/bin/python bench/scaling.py [--reps 3]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = """
name = "bench-scaling"
[model]
name = "{model}"
size = "{size}"
[data]
source = "{source}"
synthetic_examples = 16384
[optim]
schedule = "constant"
[train]
steps = {steps}
global_batch = 256
micro_batch = {micro}
eval_examples = 1
threads = 1
[parallel]
dp = {dp}
[log]
every = 10
quiet = true
"""


MODELS = {  # name: (model, size, source, what it shows)
    "cnn-small": ("cnn", "small", "mnist", "compute-bound: 85k params, conv-heavy"),
    "mlp-base": ("mlp", "base", "synthetic-images", "communication-heavy: 1.9M params"),
}


def examples_per_s(tmp: Path, dp: int, steps: int, tag: str, model: str) -> float:
    name, size, source, _ = MODELS[model]
    cfg = tmp / f"cfg{dp}.toml"
    cfg.write_text(CONFIG.format(steps=steps, micro=256 // dp, dp=dp, model=name, size=size,
                                 source=source))
    run_dir = tmp / tag
    subprocess.run([sys.executable, "-m", "scaletrain", "train", str(cfg), "--run-dir",
                    str(run_dir)], check=True, capture_output=True, timeout=1800)
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r.get("kind") == "train" and r["step"] > 10]
    return statistics.mean(r["examples_per_s"] for r in timed)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    a = p.parse_args()
    for model, (_, _, source, what) in MODELS.items():
        effs = []
        print(f"{model} on {source} ({what}), global batch 256, 1 thread per process")
        print(f"{'rep':>3} {'1 proc ex/s':>12} {'2 procs ex/s':>13} {'speed-up':>9} "
              f"{'efficiency':>11}")
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(a.reps):
                one = examples_per_s(Path(tmp), 1, a.steps, f"one{rep}", model)
                two = examples_per_s(Path(tmp), 2, a.steps, f"two{rep}", model)
                effs.append(two / (2 * one))
                print(f"{rep:>3} {one:>12.0f} {two:>13.0f} {two / one:>9.2f} {effs[-1]:>11.2f}")
        print(f"median scaling efficiency, 2 processes vs 1: {statistics.median(effs):.2f}\n")


if __name__ == "__main__":
    main()
