"""What the trainer asks of a dataset, and the one place a source name becomes one.

Four kinds satisfy `Dataset`: in-memory `ArrayDataset`s (built-in sources, one "shard"),
`ShardedDataset`s streaming Parquet shards written by `scaletrain shard`, `HeldOutSplit`s
of a Parquet directory Spark wrote without a manifest (train and eval disjoint, 1 row in
20 held out: `data/holdout.py`), and `MapSource`s wrapping a user's map-style dataset
(`data/user_source.py`). All index rows by a row id and expose `shard_rows`, which is all
the sampler needs to compute the (seed, epoch) order without reading data.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from scaletrain.data.sources import Batch, TaskSpec, load_source
from scaletrain.user_code import is_import_path


class Dataset(Protocol):
    spec: TaskSpec

    def __len__(self) -> int: ...

    @property
    def shard_rows(self) -> tuple[int, ...]: ...  # rows per shard, in storage order

    def get(self, indices: torch.Tensor) -> Batch: ...  # (B,) global row ids -> Batch

    def prefetch(self, indices: torch.Tensor) -> None: ...  # start reading rows needed soon


def load_dataset(
    source: str,
    *,
    split: str,
    path: str = "",
    seq_len: int = 128,
    synthetic_examples: int = 4096,
    seed: int = 0,
    shuffle_window: int | None = None,
    kwargs: dict[str, Any] | None = None,
    fn: Callable | None = None,
    tokenizer_dir: Path | None = None,
) -> Dataset:
    """A built-in source in memory, the Parquet shards under `path`, or the user's dataset.

    Args:
        source: a built-in source name, "shards", or an import path 'package.module:function'
            (the user's data function, called as function(split, **kwargs)).
        split: "train" or "eval".
        path: for "shards": a directory written by `scaletrain shard` (with train/ and
            eval/), or one split's directory, or a Parquet directory written by Spark
            (its eval split held out of its rows).
        seq_len, synthetic_examples, seed: for the built-in sources; seed also seeds the
            "sentences" source's augmentation (data.kwargs.augment).
        shuffle_window: the sampler's window (0 = whole split), so the row-group cache holds
            what one window touches; None for splits read in storage order (eval).
        kwargs: for a user's data function (`data.kwargs`).
        fn: the user's data function itself (Python API); `source` is then its label.
        tokenizer_dir: for "sentences": the tokenizer's directory (the caller resolves it).
    """
    if fn is not None or is_import_path(source):
        from scaletrain.data.user_source import load_user_dataset

        return load_user_dataset(source, split=split, kwargs=kwargs or {}, fn=fn)
    if source == "sentences":
        from scaletrain.data.sentences import load_sentences

        return load_sentences(
            split=split,
            seq_len=seq_len,
            kwargs=kwargs or {},
            tokenizer_dir=tokenizer_dir,
            seed=seed,  # data.kwargs.augment's variants follow train.seed
        )
    if source == "shards":
        from scaletrain.data.shards import load_dataset as load_shards

        return load_shards(Path(path), split, shuffle_window=shuffle_window)
    return load_source(
        source, split=split, seq_len=seq_len, synthetic_examples=synthetic_examples, seed=seed
    )
