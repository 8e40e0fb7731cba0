"""Own data: what reading a user's map-style dataset costs, against a torch DataLoader.

A user who brings data (`data.source = 'package.module:function'`) hands scaletrain a
map-style dataset; `MapSource.get(indices)` makes each global batch from its items, in the
training process, one `__getitem__` per example or one `__getitems__` per batch. This
script times that against what a torch user writes for the same batches, in one process,
one thread:

- map-getitem: `MapSource.get` over a torch `Dataset` whose `__getitem__` returns
  {"inputs": (64,) float32, "targets": int64 scalar} (digits-like: 4096 examples, 10
  classes);
- map-getitems: the same dataset with torch's batched `__getitems__(indices)` (one tensor
  gather, then the list of items torch's contract asks for); MapSource calls it once a batch;
- dataloader: `DataLoader(dataset, batch_size=256, sampler=<the same indices>,
  num_workers=0)`, default collate, iterated: the reference;
- dataloader-getitems: the DataLoader over the `__getitems__` dataset (it calls it too),
  the like-for-like partner of map-getitems;
- array: the built-in in-memory path, `ArrayDataset.get` (one `index_select` per tensor)
  on the same tensors;
- mlp-step, for scale: one training step of scaletrain's MLP `small` (64-256-256-10) on
  such a batch, forward + backward + AdamW (fused, scaletrain's default kernels on CPU).

Every contender reads the same global batches of 256, in the order scaletrain's
`GlobalBatchSampler` draws them (seed 0, 1 rank); the DataLoader's sampler yields those
indices back to back, so its batches are the same (checked before timing). A contender's
time is 500 batches (1-2 s) after 5 untimed ones; the median of 5 reps, interleaved with
the order rotated, each after `common.wait_for_quiet` and retried when another process
loaded the machine (`common.measured`). 5 reps, not 3, and each ratio the median of the
reps' own ratios: on the shared 2-core VM the same block's time drifts by up to 2x between
minutes with no other process visible, and much less between neighbouring blocks.

    .venv/bin/python bench/own_data.py [--reps 5] [--batches 500]
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch
from common import NOISY_CORES, base_parser, interleave, median, per_rep
from torch.utils.data import DataLoader, Dataset

EXAMPLES, FEATURES, CLASSES, BATCH, WARMUP = 4096, 64, 10, 256, 5


class ItemDataset(Dataset):
    """A user's dataset as torch's docs write one: an item is a dict of tensors."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets  # (N, 64) float32, (N,) int64

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.inputs[i], "targets": self.targets[i]}  # (64,), ()


class BatchedDataset(ItemDataset):
    """The same, with torch's batched fetch: one gather per batch, then the list of items
    torch's contract asks for (a DataLoader hands that list to its collate_fn)."""

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        idx = torch.as_tensor(indices)
        inputs, targets = self.inputs[idx], self.targets[idx]  # (B, 64), (B,)
        return [{"inputs": x, "targets": t} for x, t in zip(inputs, targets)]


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits-like examples: 64 float features in [0, 1), a class id in 0..9."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.rand(EXAMPLES, FEATURES, generator=g),
        torch.randint(CLASSES, (EXAMPLES,), generator=g),
    )


def batch_order(batches: int) -> list[torch.Tensor]:
    """The first `batches` global batches of scaletrain's sampler: (256,) int64 each."""
    from scaletrain.data.sampler import GlobalBatchSampler

    sampler = GlobalBatchSampler(
        EXAMPLES,
        global_batch=BATCH,
        micro_batch=BATCH,
        dp_rank=0,
        dp_size=1,
        seed=0,
        shard_rows=(EXAMPLES,),
    )
    return [sampler.micro_batches(step)[0] for step in range(batches)]


def readers(inputs: torch.Tensor, targets: torch.Tensor, order: list[torch.Tensor]) -> dict:
    """{contender: a generator of (inputs (B, 64), targets (B,)) over the batches of `order`}."""
    from scaletrain.data.sources import ArrayDataset, TaskSpec
    from scaletrain.data.user_source import MapSource

    spec = TaskSpec("classification", (FEATURES,), CLASSES)
    plain, batched = ItemDataset(inputs, targets), BatchedDataset(inputs, targets)
    flat = torch.cat(order).tolist()  # the DataLoader's sampler: the batches back to back

    def source(ds):
        return lambda: ((b.inputs, b.targets) for b in map(ds.get, order))

    def loader(ds):
        return lambda: (
            (b["inputs"], b["targets"])
            for b in DataLoader(ds, batch_size=BATCH, sampler=flat, num_workers=0)
        )

    return {
        "map-getitem": source(MapSource(plain, spec, label="own_data (__getitem__)")),
        "map-getitems": source(MapSource(batched, spec, label="own_data (__getitems__)")),
        "dataloader": loader(plain),
        "dataloader-getitems": loader(batched),
        "array": source(ArrayDataset(inputs, targets, spec=spec)),
    }


def check_same(readers: dict, order: list[torch.Tensor], inputs, targets) -> None:
    """Every contender delivers exactly the sampler's batches, in its order."""
    for name, read in readers.items():
        for k, (x, y) in enumerate(read()):
            assert torch.equal(x, inputs[order[k]]) and torch.equal(y, targets[order[k]]), name
        assert k == len(order) - 1, f"{name} gave {k + 1} batches, not {len(order)}"


def time_reader(read, *, batches: int) -> dict:
    """ms per batch over `batches` batches, after WARMUP untimed ones."""
    for _ in zip(range(WARMUP), read()):
        pass
    it = read()
    start = time.perf_counter()
    for _ in it:
        pass
    return {"ms": (time.perf_counter() - start) / batches * 1e3}


def time_mlp_step(
    inputs: torch.Tensor, targets: torch.Tensor, order: list[torch.Tensor], *, batches: int
) -> dict:
    """ms per training step of MLP small on the batches (fetched outside the timing)."""
    import torch.nn.functional as F

    from scaletrain.data.sources import TaskSpec
    from scaletrain.models import build_model

    torch.manual_seed(0)
    model = build_model("mlp", size="small", task=TaskSpec("classification", (FEATURES,), CLASSES))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    data = [(inputs[idx], targets[idx]) for idx in order]

    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for x, y in data[:WARMUP]:
        step(x, y)
    start = time.perf_counter()
    for x, y in data:
        step(x, y)
    return {"ms": (time.perf_counter() - start) / batches * 1e3}


def rep_ratio(runs: list[dict], others: list[dict]) -> float:
    """Median over reps of others' time / runs' time, each rep's pair measured seconds apart:
    the machine's speed drifts between reps (BENCHMARKS.md), much less within one."""
    return statistics.median(o["ms"] / r["ms"] for r, o in zip(runs, others))


def print_table(results: dict[str, list[dict]], *, reference: str, step: str) -> None:
    reps = max(len(r) for r in results.values())
    width = max(16, 8 * reps)
    print(
        f"{'contender':<20} {'ms/batch':>9}  {'per rep':<{width}} {'examples/s':>11} "
        f"{reference + ' / it':>16} {'it / mlp step':>14}"
    )
    for name, runs in results.items():
        ms = median(runs, "ms")
        ratio = f"{rep_ratio(runs, results[reference]):16.2f}" if name != step else f"{'-':>16}"
        share = f"{1 / rep_ratio(runs, results[step]):14.2f}" if name != step else f"{'-':>14}"
        print(
            f"{name:<20} {ms:9.3f}  {per_rep(runs, 'ms', '.3f'):<{width}} "
            f"{BATCH / ms * 1e3:11.0f} {ratio} {share}"
        )
    print(
        f"~ : still had > {NOISY_CORES} cores of foreign load after the retries. Ratios are "
        f"medians of each rep's ratio. {reference} / it > 1: faster than the DataLoader; "
        "it / mlp step: the read's time as a fraction of one training step on the batch"
    )


def main() -> None:
    p = base_parser(__doc__, reps=5)
    p.add_argument("--batches", type=int, default=500, help="timed batches per contender")
    a = p.parse_args()
    torch.set_num_threads(1)
    inputs, targets = make_data()
    order = batch_order(a.batches)
    contenders = readers(inputs, targets, order)
    check_same(contenders, order, inputs, targets)
    jobs = {
        name: partial(time_reader, read, batches=a.batches) for name, read in contenders.items()
    }
    jobs["mlp-step"] = partial(time_mlp_step, inputs, targets, order, batches=a.batches)
    print(
        f"own data: {EXAMPLES} examples of ({FEATURES},) float32 + an int64 class, "
        f"{a.batches} global batches of {BATCH} in GlobalBatchSampler's order, 1 process x "
        f"{torch.get_num_threads()} thread, torch {torch.__version__}"
    )
    results = interleave(
        jobs,
        reps=a.reps,
        retries=a.retries,
        line=lambda rep, name, r: f"{name:<20} {r['ms']:8.3f} ms/batch",
    )
    print()
    print_table(results, reference="dataloader", step="mlp-step")


if __name__ == "__main__":
    main()
