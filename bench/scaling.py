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
name = "mlp"
size = "base"
[data]
source = "synthetic-images"
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


def examples_per_s(tmp: Path, dp: int, steps: int, tag: str) -> float:
    cfg = tmp / f"cfg{dp}.toml"
    cfg.write_text(CONFIG.format(steps=steps, micro=256 // dp, dp=dp))
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
    effs = []
    print("mlp-base (784-1024-1024-10, 1.9M params) on synthetic images, global batch 256")
    print(f"{'rep':>3} {'1 proc ex/s':>12} {'2 procs ex/s':>13} {'speed-up':>9} {'efficiency':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            one = examples_per_s(Path(tmp), 1, a.steps, f"one{rep}")
            two = examples_per_s(Path(tmp), 2, a.steps, f"two{rep}")
            effs.append(two / (2 * one))
            print(f"{rep:>3} {one:>12.0f} {two:>13.0f} {two / one:>9.2f} {effs[-1]:>11.2f}")
    print(f"median scaling efficiency, 2 processes vs 1: {statistics.median(effs):.2f}")


if __name__ == "__main__":
    main()
