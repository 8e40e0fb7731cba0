"""Overhead: steps/s of `scaletrain train` vs a minimal hand-written DDP loop, side by side.

Same model, data, global batch, optimizer and process count (2 x 1 thread, gloo). Runs are
interleaved (scaletrain, baseline, scaletrain, ...) so drift hits both; each side times the
same steps (after a warm-up) and excludes start-up and evaluation. Prints each pair and the
median ratio (target >= 0.98).

    .venv/bin/python bench/overhead.py [--reps 3] [--steps 200]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = """
name = "bench-overhead"
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
global_batch = {batch}
micro_batch = {micro}
eval_examples = 1
threads = 1
[parallel]
dp = 2
[log]
every = {warmup}
quiet = true
"""


def scaletrain_steps_per_s(tmp: Path, a, rep: int) -> float:
    cfg = tmp / "cfg.toml"
    cfg.write_text(CONFIG.format(model=a.model, size=a.size, source=a.source, batch=a.batch,
                                 micro=a.batch // 2, steps=a.steps + a.warmup, warmup=a.warmup))
    run_dir = tmp / f"st{rep}"
    subprocess.run([sys.executable, "-m", "scaletrain", "train", str(cfg), "--run-dir",
                    str(run_dir)], check=True, capture_output=True, timeout=1800)
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r.get("kind") == "train" and r["step"] > a.warmup]
    seconds = sum(r["step_time_s"] * a.warmup for r in timed)  # each record covers `warmup` steps
    return len(timed) * a.warmup / seconds


def baseline_steps_per_s(tmp: Path, a, rep: int) -> float:
    out = tmp / f"base{rep}.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", str(ROOT / "bench" / "baseline_ddp.py"),
                    "--model", a.model, "--size", a.size, "--source", a.source,
                    "--global-batch", str(a.batch), "--steps", str(a.steps),
                    "--warmup", str(a.warmup), "--out", str(out)],
                   check=True, capture_output=True, timeout=1800, env=_env())
    result = json.loads(out.read_text())
    return result["steps"] / result["seconds"]


def _env() -> dict:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--model", default="cnn")
    p.add_argument("--size", default="small")
    p.add_argument("--source", default="mnist")
    p.add_argument("--batch", type=int, default=128)
    a = p.parse_args()
    ratios = []
    print(f"{a.model}-{a.size} on {a.source}, global batch {a.batch}, 2 processes x 1 thread, "
          f"{a.steps} timed steps")
    print(f"{'rep':>3} {'scaletrain steps/s':>19} {'hand-written DDP steps/s':>25} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            ours = scaletrain_steps_per_s(Path(tmp), a, rep)
            base = baseline_steps_per_s(Path(tmp), a, rep)
            ratios.append(ours / base)
            print(f"{rep:>3} {ours:>19.2f} {base:>25.2f} {ours / base:>6.3f}")
    print(f"median ratio scaletrain / hand-written: {statistics.median(ratios):.3f} (target >= 0.98)")


if __name__ == "__main__":
    main()
