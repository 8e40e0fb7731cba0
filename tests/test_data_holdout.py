"""The hold-out rule (data/holdout.py): 1 row in 20 is eval, one per block at a hashed
position, the same on every call; file sources sorted by label still get every class into
eval; a split missing a class is reported; `HeldOutSplit` maps split ids to row ids."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from scaletrain.data.holdout import (
    EVAL_EVERY,
    HeldOutSplit,
    eval_count,
    eval_ids,
    eval_mask,
    missing_classes,
    rows_before,
    train_ids,
)
from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.data.shard_writer import write_shards
from scaletrain.data.shards import ShardedDataset


@pytest.mark.parametrize("n", [2, 3, 19, 20, 21, 39, 40, 41, 57, 200, 1213])
def test_one_eval_row_per_block_and_the_id_maps_agree_with_the_mask(n):
    mask = eval_mask(n)
    k = min(EVAL_EVERY, n)
    assert mask.sum() == eval_count(n) == -(-n // k)  # ceil(5%), at least one
    per_block = np.add.reduceat(mask, np.arange(0, n, k))
    assert (per_block == 1).all()  # exactly one per block, the short last block included
    evals, trains = np.flatnonzero(mask), np.flatnonzero(~mask)
    assert np.array_equal(eval_ids(np.arange(len(evals)), n), evals)
    assert np.array_equal(train_ids(np.arange(len(trains)), n), trains)
    edges = np.arange(n + 1)
    assert np.array_equal(rows_before(edges, n, "eval"), np.r_[0, np.cumsum(mask)])
    assert np.array_equal(rows_before(edges, n, "train"), np.r_[0, np.cumsum(~mask)])


def test_the_split_is_fixed_across_runs_and_versions():
    # A golden list: a change of the hash, its seed or the block size changes every file
    # source's eval rows, which this test makes a deliberate decision.
    assert np.flatnonzero(eval_mask(100)).tolist() == [0, 31, 40, 74, 83]
    with pytest.raises(ValueError, match="at least 2 rows"):
        eval_mask(1)


def test_a_periodic_label_does_not_line_up_with_the_blocks():
    labels = np.arange(4000) % EVAL_EVERY  # the period of the blocks themselves
    held = labels[eval_mask(4000)]
    assert len(set(held.tolist())) == EVAL_EVERY  # every class, not one offset


def _csv(path, labels: np.ndarray, width: int = 3) -> None:
    rng = np.random.default_rng(0)
    rows = ["label," + ",".join(f"f{i}" for i in range(width))]
    rows += [",".join([str(y)] + [repr(float(v)) for v in rng.normal(size=width)]) for y in labels]
    path.write_text("\n".join(rows) + "\n")


def test_a_file_sorted_by_label_gets_every_class_into_eval(tmp_path):
    labels = np.repeat(np.arange(5), 40)  # sorted: the old tail split gave eval class 4 only
    _csv(tmp_path / "sorted.csv", labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no split misses a class
        write_shards(tmp_path / "sorted.csv", tmp_path / "out", rows_per_shard=64)
        write_shards(tmp_path / "sorted.csv", tmp_path / "again", rows_per_shard=64)
    ev = ShardedDataset(tmp_path / "out" / "eval")
    targets = ev.get(torch.arange(len(ev))).targets
    assert len(ev) == 10 and set(targets.tolist()) == set(range(5))
    assert torch.equal(targets, torch.from_numpy(labels[eval_mask(200)]))
    again = ShardedDataset(tmp_path / "again" / "eval")  # seeded: the same rows every time
    assert torch.equal(again.get(torch.arange(10)).inputs, ev.get(torch.arange(10)).inputs)


def test_a_split_missing_a_class_is_reported(tmp_path):
    labels = np.r_[np.zeros(100, dtype=int), [7]]  # class 7 has one row: train or eval lacks it
    _csv(tmp_path / "rare.csv", labels)
    side = "eval" if not eval_mask(101)[100] else "train"
    with pytest.warns(
        UserWarning,
        match=rf"rare.csv: the {side} split has no rows of 1 class"
        rf"\(es\) present in \w+: 7;",
    ):
        write_shards(tmp_path / "rare.csv", tmp_path / "out", rows_per_shard=64)
    counts = {"train": np.array([5, 0, 2]), "eval": np.array([1, 1, 0])}
    assert missing_classes(counts) == (
        "the eval split has no rows of 1 class(es) present in "
        "train: 2; the train split has no rows of 1 class(es) "
        "present in eval: 1"
    )
    assert missing_classes({"train": np.ones(3), "eval": np.ones(3)}) is None


def test_held_out_splits_partition_a_directory_for_the_sampler(tmp_path):
    (tmp_path / "d").mkdir()
    ids = np.arange(2000)
    for k, part in enumerate(np.array_split(ids, 3)):  # shards of 667, 667, 666 rows
        pq.write_table(
            pa.table({"features": [[float(i)] for i in part], "label": part % 3}),
            tmp_path / "d" / f"part-{k:05d}.parquet",
            row_group_size=100,
        )
    base = ShardedDataset(tmp_path / "d", prefetch=0)
    train, ev = HeldOutSplit(base, "train"), HeldOutSplit(base, "eval")
    assert (len(train), len(ev)) == (1900, 100)
    assert [a + b for a, b in zip(train.shard_rows, ev.shard_rows)] == list(base.shard_rows)
    sampler = GlobalBatchSampler(
        len(train),
        global_batch=100,
        micro_batch=50,
        dp_rank=0,
        dp_size=1,
        seed=3,
        shard_rows=train.shard_rows,
        shuffle_window=200,
    )
    seen = torch.cat(
        [
            train.get(idx).inputs[:, 0].long()
            for step in range(19)
            for idx in sampler.micro_batches(step)
        ]
    )
    held = ev.get(torch.arange(100)).inputs[:, 0].long()
    assert torch.equal(seen.sort().values, torch.from_numpy(np.flatnonzero(~eval_mask(2000))))
    assert not set(seen.tolist()) & set(held.tolist())

    # A window of 10 eval rows spans 200 rows of the directory: the cache holds those.
    def fresh() -> ShardedDataset:
        return ShardedDataset(tmp_path / "d", prefetch=0, cache_row_groups=1)

    assert HeldOutSplit(fresh(), "eval").size_cache_for(10) == fresh().size_cache_for(200)
    assert fresh().size_cache_for(200) > fresh().size_cache_for(10)
    with pytest.raises(IndexError, match=r"\[0, 100\)"):
        ev.get(torch.tensor([100]))
