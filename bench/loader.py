"""Loader throughput: scaletrain's ShardedDataset vs a plain PyTorch DataLoader over pyarrow
reading the same MNIST shards, side by side, and vs what the trainer consumes.

    .venv/bin/python bench/loader.py [--steps 400] [--window 16384]

(a) ShardedDataset + GlobalBatchSampler (1 rank, global batch 128, shuffle window W): the
    sampler's order, row-group reads, LRU cache, prefetch of the next step.
(b) The plain baseline: an IterableDataset that reads each shard with pyarrow (whole file),
    shuffles rows inside the same window size, and a DataLoader(batch_size=128).
(c) The trainer's consumption: examples/s of the default CNN job on 2 processes (from a
    short `scaletrain train` run on the same shards).
All single-threaded (torch threads = 1) so the ratio compares the code, not the cores.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset


class PlainParquet(IterableDataset):
    """What one writes by hand: read every shard with pyarrow, shuffle within a window."""

    def __init__(self, files: list[Path], window: int, seed: int = 0) -> None:
        self.files, self.window, self.seed = files, window, seed

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        for f in rng.permutation(len(self.files)):
            table = pq.read_table(self.files[f])
            x = np.stack(table.column("inputs").to_numpy(zero_copy_only=False)).astype(np.float32)
            y = table.column("targets").to_numpy()
            for start in range(0, len(y), self.window):
                for i in rng.permutation(min(self.window, len(y) - start)) + start:
                    yield torch.from_numpy(x[i]).view(1, 28, 28), int(y[i])


def sharded_rate(split: Path, *, steps: int, window: int) -> float:
    from scaletrain.data.sampler import GlobalBatchSampler
    from scaletrain.data.shards import load_dataset

    ds = load_dataset(split.parent, split.name, shuffle_window=window)
    sampler = GlobalBatchSampler(len(ds), global_batch=128, micro_batch=128, dp_rank=0,
                                 dp_size=1, seed=0, shard_rows=ds.shard_rows,
                                 shuffle_window=window)
    start = time.perf_counter()
    for step in range(steps):
        batch = ds.get(sampler.micro_batches(step)[0])
        ds.prefetch(sampler.micro_batches(step + 1)[0])
    assert batch.inputs.shape == (128, 1, 28, 28)
    return steps * 128 / (time.perf_counter() - start)


def plain_rate(split: Path, *, steps: int, window: int) -> float:
    loader = DataLoader(PlainParquet(sorted(split.glob("part-*.parquet")), window),
                        batch_size=128, num_workers=0)
    start = time.perf_counter()
    for step, (x, _) in enumerate(loader):
        if step + 1 == steps:
            break
    assert x.shape == (128, 1, 28, 28)
    return steps * 128 / (time.perf_counter() - start)


def trainer_rate(shards: Path, tmp: Path) -> float:
    run_dir = tmp / "run"
    subprocess.run([sys.executable, "-m", "scaletrain", "train", "configs/default.toml",
                    "data.source=shards", f"data.path={shards}", "data.shuffle_window=16384",
                    "train.steps=100", "train.eval_every=0", "train.eval_examples=128",
                    "log.quiet=true", "--run-dir", str(run_dir)], check=True,
                   capture_output=True, timeout=900)
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r["examples_per_s"] for r in rows if r["kind"] == "train" and r["step"] > 10]
    return sum(timed) / len(timed)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--window", type=int, default=16384)
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = tmp / "mnist"
        subprocess.run([sys.executable, "-m", "scaletrain", "shard", "mnist", str(shards),
                        "--rows-per-shard", "8192"], check=True, capture_output=True)
        ours = sharded_rate(shards / "train", steps=a.steps, window=a.window)
        plain = plain_rate(shards / "train", steps=a.steps, window=a.window)
        consume = trainer_rate(shards, tmp)
    print(f"MNIST shards (8 x 8192 rows, row groups of 1024), global batch 128, window {a.window}")
    print(f"scaletrain ShardedDataset:           {ours:10.0f} examples/s")
    print(f"plain DataLoader over pyarrow:       {plain:10.0f} examples/s")
    print(f"ratio scaletrain / plain:            {ours / plain:10.2f}")
    print(f"trainer consumption (CNN, 2 procs):  {consume:10.0f} examples/s")
    print(f"loader headroom over consumption:    {ours / consume:10.1f}x")


if __name__ == "__main__":
    main()
