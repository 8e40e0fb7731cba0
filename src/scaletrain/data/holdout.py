"""The held-out split: which rows of one collection of rows are eval, the same everywhere.

Two places have one collection of rows that must serve as both splits: a file source
(JSONL / CSV / Parquet) when `scaletrain shard` writes it (`shard_writer`, `spark`), and a
Parquet directory without a scaletrain manifest (plain Spark output) when it is read
(`HeldOutSplit`, from `shards.load_dataset`). Both use the rule below.

The rule. The rows, in storage order, are cut into blocks of `EVAL_EVERY` = 20 consecutive
rows (the last block may be shorter; fewer than 20 rows make one block). Each block gives
exactly one row to eval, at an offset in the block drawn by a fixed integer hash of the
block's index, seeded by `HOLDOUT_SEED` = 0 (not by the run's seed: the split is a property
of the data, not of a run). So eval is ceil(n / 20) rows, 5%: spread evenly through the
data, so a file sorted by label gets every class in proportion, and at hashed positions
inside the blocks, so a periodic column (label = row % 10) cannot line up with it.

Trade-offs. Unlike a seeded permutation, the rule needs no index array: the i-th train or
eval row's global row id is a few integer operations (`train_ids`, `eval_ids`), so a rank
opening a billion-row directory holds nothing, and split ids stay in storage order (the
sampler's shuffle window still reads nearby row groups). It depends only on the row index
and the row count, so every rank, every run and every world size agree; and the hash uses
only +, *, % on values below 2^62 plus shifts and xors, so Spark SQL computes the same bits
(`spark._holdout_columns`) without Python workers or overflow in ANSI mode.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch

from scaletrain.data.sources import Batch, TaskSpec

EVAL_EVERY = 20  # one eval row per block of 20 rows: 5%
HOLDOUT_SEED = 0  # the hash's seed; changing it changes every file source's split
_P = 2_147_483_647  # 2^31 - 1: hash state stays below 2^31, products below 2^62
_A1, _A2 = 1_597_334_677, 1_013_904_223  # odd multipliers below 2^31


def _xor_shift(x: Any, s: int) -> Any:
    return x ^ (x >> s)


def block_hash(block: Any, *, xor_shift: Callable[[Any, int], Any] = _xor_shift) -> Any:
    """A 31-bit hash of block indices; `block` is an int64 array or a Spark Column.

    Args:
        block: block indices (>= 0).
        xor_shift: x ^ (x >> s) for `block`'s type; Spark passes its own (Columns have no
            `>>`), so both engines run this one definition.
    """
    x = (block + HOLDOUT_SEED) % _P
    x = xor_shift((x * _A1) % _P, 15)
    x = xor_shift((x * _A2) % _P, 13)
    return x


def block_size(n: int) -> int:
    """Rows per block for a collection of n rows (n >= 2)."""
    if n < 2:
        raise ValueError(f"a split needs at least 2 rows (train and eval), got {n}")
    return min(EVAL_EVERY, n)


def eval_count(n: int) -> int:
    """Eval rows of n: one per block, ceil(n / 20) (5%), at least one."""
    k = block_size(n)
    return -(-n // k)


def _offsets(blocks: np.ndarray, n: int) -> np.ndarray:
    """(B,) offset of each block's eval row within the block."""
    k = block_size(n)
    sizes = np.where(blocks < n // k, k, n % k)  # only the last block may be shorter
    return block_hash(blocks.astype(np.int64)) % sizes


def eval_ids(local: np.ndarray, n: int) -> np.ndarray:
    """Global row ids of eval rows 0.. (eval row j is block j's)."""
    j = np.asarray(local, dtype=np.int64)
    return j * block_size(n) + _offsets(j, n)


def train_ids(local: np.ndarray, n: int) -> np.ndarray:
    """Global row ids of train rows 0..: each block's rows except its eval row, in order."""
    i = np.asarray(local, dtype=np.int64)
    k = block_size(n)
    b, o = np.divmod(i, k - 1)  # k - 1 train rows per block (fewer in the last)
    return b * k + o + (o >= _offsets(b, n))


def eval_mask(n: int) -> np.ndarray:
    """(n,) bool, True for eval rows: the writers' split of a file source."""
    mask = np.zeros(n, dtype=bool)
    mask[eval_ids(np.arange(eval_count(n)), n)] = True
    return mask


def rows_before(global_ids: np.ndarray, n: int, split: Literal["train", "eval"]) -> np.ndarray:
    """How many rows of `split` have a global id below each of `global_ids` (0..n)."""
    g = np.asarray(global_ids, dtype=np.int64)
    k = block_size(n)
    b, r = np.divmod(g, k)
    blocks = eval_count(n)
    inside = (b < blocks) & (r > _offsets(np.minimum(b, blocks - 1), n))  # its block's eval
    evals = np.minimum(b, blocks) + inside  # row lies below g
    return evals if split == "eval" else g - evals


def missing_classes(counts: dict[str, np.ndarray]) -> str | None:
    """Say which classes one split lacks that the other has, or None when both have all.

    Args:
        counts: {"train": rows per class, "eval": rows per class}, same length.
    """
    lines = []
    for split, other in (("eval", "train"), ("train", "eval")):
        absent = np.flatnonzero((counts[split] == 0) & (counts[other] > 0)).tolist()
        if absent:
            shown = ", ".join(map(str, absent[:10])) + (", ..." if len(absent) > 10 else "")
            lines.append(
                f"the {split} split has no rows of {len(absent)} class(es) present in "
                f"{other}: {shown}"
            )
    return "; ".join(lines) or None


class HeldOutSplit:
    """One split of a dataset that holds both: row i is `global_ids(i)` of `base`.

    Same interface as `ShardedDataset` (`spec`, `len`, `shard_rows`, `get`, `prefetch`,
    `size_cache_for`, `stats`, `close`); `shard_rows` counts this split's rows per shard, so
    the sampler shuffles shards and windows exactly as on a whole directory.
    """

    def __init__(self, base: Any, split: Literal["train", "eval"]) -> None:
        """Args: base: a `ShardedDataset` (any dataset with `shard_rows` and `get`); split."""
        self.base, self.split = base, split
        self.spec: TaskSpec = base.spec
        self.manifest, self.path = base.manifest, base.path
        self._n = len(base)
        self._ids = train_ids if split == "train" else eval_ids
        ends = np.cumsum(base.shard_rows, dtype=np.int64)  # (S,) global end of each shard
        before = rows_before(np.concatenate([[0], ends]), self._n, split)
        self._shard_rows = tuple(int(c) for c in np.diff(before))
        self._len = int(before[-1])

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"HeldOutSplit({self.base!r}, {self.split!r}, n={self._len})"

    @property
    def shard_rows(self) -> tuple[int, ...]:
        return self._shard_rows

    @property
    def stats(self) -> Any:
        return self.base.stats

    def global_ids(self, indices: torch.Tensor | np.ndarray) -> np.ndarray:
        """This split's row ids -> the base's global row ids, (B,) int64."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self._len):
            raise IndexError(f"row ids must be in [0, {self._len}), got {idx.min()}..{idx.max()}")
        return self._ids(idx, self._n)

    def get(self, indices: torch.Tensor) -> Batch:
        return self.base.get(torch.from_numpy(self.global_ids(indices)))

    def prefetch(self, indices: torch.Tensor) -> None:
        self.base.prefetch(torch.from_numpy(self.global_ids(indices)))

    def size_cache_for(self, shuffle_window: int) -> int:
        # A window of W split rows spans W / density base rows (eval: 1 in 20).
        density = self._len / max(1, self._n)
        return self.base.size_cache_for(round(shuffle_window / density) if shuffle_window else 0)

    def close(self) -> None:
        self.base.close()

    def __enter__(self) -> HeldOutSplit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_announced: set[str] = set()


def announce(path: str) -> None:
    """Warn once per process per directory that its rows are split here, and how."""
    if path in _announced:
        return
    _announced.add(path)
    warnings.warn(
        f"{path} has no scaletrain manifest (e.g. plain Spark output): holding out "
        f"1 row in {EVAL_EVERY} (5%, at hashed positions, seed {HOLDOUT_SEED}) as the "
        f"eval split and training on the rest, the same rows on every rank and run; "
        f"write the data with `scaletrain shard` to choose the splits yourself",
        stacklevel=3,
    )
