"""Loader throughput: scaletrain's ShardedDataset vs a PyTorch DataLoader over pyarrow,
the same MNIST shards, at the same number of threads, and vs what the trainer consumes.

    .venv/bin/python bench/loader.py [--steps 1000] [--window 16384] [--reps 3]

Both sides deliver the same thing: (128, 1, 28, 28) float32 batches + int64 labels, rows
shuffled within a window of W rows after the shards are shuffled, 1 torch thread in the
main process. Two comparisons, each with equal background help on both sides:

(a) no background work: ShardedDataset(prefetch=0) (`get` reads and decodes what a batch
    needs, synchronously) vs DataLoader(num_workers=0).
(b) background readers: ShardedDataset at its default prefetch (P threads reading the next
    step's row groups while this one is served) vs DataLoader(num_workers=P) (P worker
    processes, each reading its share of the shards, DataLoader's default prefetch_factor).

The baseline is written as a user would write it: an IterableDataset that reads each shard
as record batches (`ParquetFile.iter_batches`), turns whole columns into numpy arrays at
once (`list_flatten`, reshape), shuffles a buffer of W rows with one permutation and yields
ready batches by fancy indexing (`DataLoader(batch_size=None)`): no per-example Python.
ShardedDataset is driven as the trainer drives it: GlobalBatchSampler (1 rank, global
batch 128, shuffle window W), `get` this step, `prefetch` the next. Each side serves
--warmup batches untimed first (DataLoader's workers start, caches fill), then --steps
timed; the reps alternate the sides.

(c) The trainer's consumption: examples/s of the default CNN job on 2 processes (a short
    `scaletrain train` on the same shards), the rate a loader must keep ahead of.
"""

import argparse
import inspect
import itertools
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from common import BIN, ROOT, run
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from scaletrain.records.metrics import read_metrics

BATCH = 128


class ParquetBatches(IterableDataset):
    """What one writes by hand: shards in a shuffled order, record batches to numpy in
    whole columns, a shuffle buffer of `window` rows, whole batches out."""

    def __init__(self, files: list[Path], *, window: int, batch: int = BATCH, seed: int = 0):
        self.files, self.window, self.batch, self.seed = files, window, batch, seed

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        rows = np.random.default_rng((self.seed, worker))
        for epoch in itertools.count():
            order = np.random.default_rng((self.seed, epoch)).permutation(len(self.files))
            xs, ys = [], []
            for f in order[worker::workers]:  # each worker its share of the shards
                for rb in pq.ParquetFile(self.files[f]).iter_batches(batch_size=1024):
                    xs.append(pc.list_flatten(rb.column("inputs")).to_numpy().reshape(-1, 784))
                    ys.append(rb.column("targets").to_numpy())
                    if sum(map(len, ys)) >= self.window:
                        xs, ys = yield from self._drain(xs, ys, rows)
            yield from self._drain(xs, ys, rows)  # the epoch's rest; a partial batch is dropped

    def _drain(self, xs, ys, rng):
        """Yield the buffer's whole batches in a shuffled order; return what is left."""
        if not ys:
            return [], []
        x, y = np.concatenate(xs), np.concatenate(ys)
        perm = rng.permutation(len(y))
        whole = len(y) // self.batch * self.batch
        for i in range(0, whole, self.batch):
            idx = perm[i : i + self.batch]
            yield torch.from_numpy(x[idx]).view(-1, 1, 28, 28), torch.from_numpy(y[idx])
        rest = perm[whole:]
        return [x[rest]], [y[rest]]


def sharded_rate(split: Path, *, prefetch: int, steps: int, warmup: int, window: int) -> float:
    from scaletrain.data.sampler import GlobalBatchSampler
    from scaletrain.data.shards import load_dataset

    with load_dataset(split.parent, split.name, prefetch=prefetch, shuffle_window=window) as ds:
        sampler = GlobalBatchSampler(
            len(ds),
            global_batch=BATCH,
            micro_batch=BATCH,
            dp_rank=0,
            dp_size=1,
            seed=0,
            shard_rows=ds.shard_rows,
            shuffle_window=window,
        )
        for step in range(warmup):
            ds.get(sampler.micro_batches(step)[0])
            ds.prefetch(sampler.micro_batches(step + 1)[0])
        start = time.perf_counter()
        for step in range(warmup, warmup + steps):
            batch = ds.get(sampler.micro_batches(step)[0])
            ds.prefetch(sampler.micro_batches(step + 1)[0])  # a no-op with prefetch=0
        seconds = time.perf_counter() - start
    assert batch.inputs.shape == (BATCH, 1, 28, 28) and batch.inputs.dtype == torch.float32
    return steps * BATCH / seconds


def plain_rate(split: Path, *, workers: int, steps: int, warmup: int, window: int) -> float:
    loader = DataLoader(
        ParquetBatches(sorted(split.glob("part-*.parquet")), window=window),
        batch_size=None,
        num_workers=workers,
    )
    batches = iter(loader)
    for _ in range(warmup):
        next(batches)
    start = time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
    seconds = time.perf_counter() - start
    del batches  # stops the workers
    assert x.shape == (BATCH, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    return steps * BATCH / seconds


def trainer_rate(shards: Path, tmp: Path, *, steps: int) -> float:
    run_dir = tmp / "run"
    run(
        [
            str(BIN / "scaletrain"),
            "train",
            str(ROOT / "configs" / "default.toml"),
            "data.source=shards",
            f"data.path={shards}",
            "data.shuffle_window=16384",
            f"train.steps={steps}",
            "train.eval_every=0",
            "train.eval_examples=128",
            "log.quiet=true",
            "--run-dir",
            str(run_dir),
        ]
    )
    rows = read_metrics(run_dir)
    timed = [r["examples_per_s"] for r in rows if r["kind"] == "train" and r["step"] > 10]
    return sum(timed) / len(timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="timed batches per side (468 an epoch)")
    p.add_argument("--warmup", type=int, default=20, help="untimed batches first")
    p.add_argument("--window", type=int, default=16384, help="shuffle window (rows)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--consume-steps", type=int, default=100, help="trainer steps for (c)")
    a = p.parse_args()
    torch.set_num_threads(1)
    from scaletrain.data.shards import load_dataset

    threads = inspect.signature(load_dataset).parameters["prefetch"].default  # scaletrain's
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = tmp / "mnist"
        run(
            [
                sys.executable,
                "-m",
                "scaletrain",
                "shard",
                "mnist",
                str(shards),
                "--rows-per-shard",
                "8192",
            ]
        )
        kw = dict(steps=a.steps, warmup=a.warmup, window=a.window)
        sides = {  # (comparison, side): rate function
            ("a", "scaletrain"): partial(sharded_rate, shards / "train", prefetch=0, **kw),
            ("a", "DataLoader"): partial(plain_rate, shards / "train", workers=0, **kw),
            ("b", "scaletrain"): partial(sharded_rate, shards / "train", prefetch=threads, **kw),
            ("b", "DataLoader"): partial(plain_rate, shards / "train", workers=threads, **kw),
        }
        rates: dict[tuple[str, str], list[float]] = {side: [] for side in sides}
        for rep in range(a.reps):
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            for side in order:
                rates[side].append(sides[side]())
        consume = trainer_rate(shards, tmp, steps=a.consume_steps) if a.consume_steps else None
    print(
        f"MNIST shards (8 x 8192 rows, row groups of 1024), batch {BATCH}, window {a.window}, "
        f"{a.steps} timed batches after {a.warmup}, {a.reps} reps; examples/s (median)"
    )
    labels = {
        "a": "(a) no background work: prefetch=0 vs num_workers=0",
        "b": f"(b) {threads} background readers: prefetch={threads} (threads) vs "
        f"num_workers={threads} (processes)",
    }
    for comparison, label in labels.items():
        ours = statistics.median(rates[(comparison, "scaletrain")])
        plain = statistics.median(rates[(comparison, "DataLoader")])
        print(label)
        for side in ("scaletrain", "DataLoader"):
            runs = rates[(comparison, side)]
            print(
                f"    {side:<11} {statistics.median(runs):10.0f}   per rep "
                + " ".join(f"{r:.0f}" for r in runs)
            )
        print(f"    ratio scaletrain / DataLoader: {ours / plain:.2f}")
    if consume:
        best = max(statistics.median(r) for r in rates.values())
        print(
            f"(c) trainer consumption (CNN, 2 procs): {consume:10.0f} examples/s; fastest "
            f"loader above: {best / consume:.1f}x that"
        )


if __name__ == "__main__":
    main()
