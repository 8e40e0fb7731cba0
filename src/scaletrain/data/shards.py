"""Parquet shards, the reading side: `ShardedDataset` and `load_dataset`.

The format (layout, schema, manifest) and the checks every shard passes on open live in
`data/manifest.py`; the writers are `data/shard_writer.py` (pyarrow) and `data/spark.py`
(Spark). The names other modules have always imported from here (`ShardError`, `MANIFEST`,
`Manifest`, `read_manifest`, ...) are re-exported, so `from scaletrain.data.shards import
ShardError` keeps working.

A global row id is the offset of its shard in manifest order plus its row in the shard; the
sampler's `epoch_order` works on these ids from the row counts alone, so a rank knows which
row groups it needs before reading any. Language-modelling rows hold seq_len + 1 tokens:
inputs = the first seq_len, targets = the last seq_len. Classification and regression rows
hold an example and its target: an int64 class id, or one float32 value (regression).

Reading (`ShardedDataset`) has the same interface as `ArrayDataset` (`spec`, `len`,
`get(indices) -> Batch`). `get` decodes only the row groups holding the requested rows
(`ParquetFile.read_row_group`) and keeps the last `cache_row_groups` decoded ones (LRU):
with the sampler's shuffle window, a rank walks through a few row groups at a time, and
`size_cache_for(shuffle_window)` makes the cache hold two windows' worth (a batch may
straddle two windows), so each row group is decoded once per epoch; a smaller cache
decodes them again and again (measured: ~100x slower on MNIST), and says so in a warning.
`prefetch(indices)` starts those reads on background threads (pyarrow decodes without the
GIL) so the next `get` finds them ready. Counters (`stats`) record every row group read,
for tests and benchmarks.

A directory without a manifest (plain Spark output) holds one collection of rows, not a
split: `load_dataset` serves train and eval from it as disjoint `HeldOutSplit`s (1 row in
20 held out, `data/holdout.py`) and says so once in a warning.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from scaletrain.data.holdout import HeldOutSplit, announce
from scaletrain.data.manifest import (  # only re-exported, for `from ...shards import`
    FORMAT,
    MANIFEST,
    Manifest,
    ShardError,
    ShardInfo,
    describe_shard,
    find_split_dir,
    image_shape,
    infer_manifest,
    open_shard,
    open_split,
    part_files,
    read_manifest,
    schema_pairs,
    sha256_file,
    task_columns,
    write_manifest,
)
from scaletrain.data.sources import Batch, TaskSpec, target_count

__all__ = [
    "FORMAT",
    "MANIFEST",
    "Manifest",
    "ReadStats",
    "ShardError",
    "ShardInfo",
    "ShardedDataset",
    "decode",
    "describe_shard",
    "image_shape",
    "infer_manifest",
    "list_rows",
    "load_dataset",
    "open_shard",
    "open_split",
    "part_files",
    "read_manifest",
    "schema_pairs",
    "sha256_file",
    "task_columns",
    "write_manifest",
]


def list_rows(column: pa.Array, *, what: str, width: int | None = None) -> np.ndarray:
    """A list column of equal-length rows -> (N, width) numpy array (a view when possible)."""
    if pa.types.is_fixed_size_list(column.type):
        offsets = np.arange(len(column) + 1) * column.type.list_size
    elif pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        offsets = column.offsets.to_numpy()
    else:
        raise ShardError(f"{what}: expected a list column, got {column.type}")
    values = column.flatten()
    lengths = np.diff(offsets)
    width = int(lengths[0]) if width is None and len(lengths) else width
    if column.null_count or values.null_count:
        raise ShardError(f"{what}: null values")
    if len(lengths) and (lengths != width).any():
        bad = int(np.flatnonzero(lengths != width)[0])
        raise ShardError(f"{what}: row {bad} has {lengths[bad]} values, expected {width}")
    return values.to_numpy(zero_copy_only=False).reshape(len(column), width or 0)


# ---------------------------------------------------------------------------------------
# Reading


@dataclass
class ReadStats:
    """What a ShardedDataset has read; `get` and `prefetch` both count."""

    row_groups_read: int = 0
    bytes_read: int = 0  # compressed column-chunk bytes of the row groups read
    hits: int = 0  # row groups `get` found decoded in the cache
    waits: int = 0  # row groups `get` found still being prefetched (and waited for)
    misses: int = 0  # row groups `get` had to read itself
    reads: Counter = field(default_factory=Counter)  # (shard, row group) -> times read


class ShardedDataset:
    """A split's shards as a map-style dataset: example i is global row id i.

    Same interface as `ArrayDataset` (`spec`, `len`, `get`), plus `shard_rows` for the
    sampler and `prefetch` for overlapping reads with compute.
    """

    def __init__(
        self, path: Path, *, verify: bool = True, prefetch: int = 2, cache_row_groups: int = 8
    ) -> None:
        """Open a split directory, checking every shard before any is read.

        Args:
            path: a split directory with manifest.json, or a Spark output directory
                (`part-*.parquet`) without one.
            verify: also check each shard's SHA-256 against the manifest (reads every byte).
            prefetch: background reader threads for `prefetch()`; 0 makes it a no-op.
            cache_row_groups: decoded row groups kept (least recently used goes first).
        """
        self.path = Path(path)
        if cache_row_groups < 1 or prefetch < 0:
            raise ValueError(
                f"cache_row_groups must be >= 1 and prefetch >= 0, got "
                f"{cache_row_groups}, {prefetch}"
            )
        if (self.path / MANIFEST).exists():
            self.manifest, self._metadata = open_split(self.path, verify=verify)
        else:
            self.manifest, self._metadata = infer_manifest(self.path)
        self.spec = self.manifest.task
        self._columns = task_columns(self.manifest.schema, self.spec, where=self.path)
        self._index_row_groups()
        self._cache_size, self._workers = cache_row_groups, prefetch
        self._cache: OrderedDict[int, tuple[torch.Tensor, ...]] = OrderedDict()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._warned, self._served = False, 0  # rows returned by get, for the warning
        self.stats = ReadStats()

    def _index_row_groups(self) -> None:
        """Global row group g covers rows [starts[g], starts[g] + rows): flat lookup tables."""
        shard, index, sizes, nbytes = [], [], [], []
        for s, md in enumerate(self._metadata):
            for r in range(md.num_row_groups):
                rg = md.row_group(r)
                shard.append(s)
                index.append(r)
                sizes.append(rg.num_rows)
                nbytes.append(
                    sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
                )
        self._rg_shard, self._rg_index, self._rg_bytes = shard, index, nbytes
        self._rg_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # (G + 1,)

    @property
    def shard_rows(self) -> tuple[int, ...]:
        """Rows per shard in manifest order (the sampler's `shard_rows`)."""
        return tuple(s.rows for s in self.manifest.shards)

    def size_cache_for(self, shuffle_window: int) -> int:
        """Hold enough decoded row groups for the sampler's shuffle window; return how many.

        A window of W rows spans about W / (rows per row group) + 2 row groups (its ends
        and shard boundaries cut row groups). Rows are permuted within it, so a global batch
        that straddles two windows touches row groups all over both: twice that. With a
        smaller cache batches decode row groups again and again (~100x slower). Window 0
        (one permutation of everything) means every row group: the split decoded in memory.

        Args:
            shuffle_window: the sampler's `shuffle_window` (0 = the whole dataset).
        """
        groups = len(self._rg_shard)
        rows_per_group = len(self) / groups if groups else 1  # the mean
        per_window = math.ceil(shuffle_window / rows_per_group) + 2
        need = groups if shuffle_window <= 0 else 2 * per_window
        self._cache_size = max(self._cache_size, min(need, max(groups, 1)))
        return self._cache_size

    def __len__(self) -> int:
        return int(self._rg_starts[-1])

    def __repr__(self) -> str:
        return (
            f"ShardedDataset({str(self.path)!r}, n={len(self)}, "
            f"shards={len(self.manifest.shards)}, spec={self.spec})"
        )

    def _locate(self, indices: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Global row ids -> (global row group, row within it), both (B,)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"row ids must be in [0, {len(self)}), got {idx.min()}..{idx.max()}")
        g = np.searchsorted(self._rg_starts, idx, side="right") - 1
        return g, idx - self._rg_starts[g]

    def get(self, indices: torch.Tensor) -> Batch:
        """Gather the rows with these global ids, in this order, into one `Batch`.

        Args:
            indices: (B,) int64 global row ids; repeats are allowed.
        """
        g, local = self._locate(indices)
        groups = np.unique(g)
        self._served += len(local)
        self._warn_if_thrashing()
        parts = [self._row_group(int(u)) for u in groups]  # each: (rows, ...) tensors
        if len(groups) == 0:
            rows = [t[:0] for t in self._row_group(0)]
        elif len(groups) == 1:  # the common case with a shuffle window: one gather, no copy-in
            rows = [t.index_select(0, torch.from_numpy(local)) for t in parts[0]]
        else:
            rows = [t.new_empty((len(local), *t.shape[1:])) for t in parts[0]]
            for u, tensors in zip(groups, parts):
                pos = torch.from_numpy(np.flatnonzero(g == u))
                sel = torch.from_numpy(local[pos.numpy()])
                for out, t in zip(rows, tensors):
                    out.index_copy_(0, pos, t.index_select(0, sel))
        if self.spec.kind == "lm":
            (tokens,) = rows  # (B, T + 1)
            inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T)
        else:
            inputs, targets = rows  # (B, *input_shape) float32; (B,) int64 or float32
        # The loss normaliser, as `ArrayDataset` counts it: examples, target tokens or values.
        return Batch(
            inputs=inputs,
            targets=targets,
            count=target_count(self.spec.kind, targets),
            tokens=inputs.numel() if self.spec.kind == "lm" else 0,
        )

    def _warn_if_thrashing(self) -> None:
        """Say once when row groups are decoded for a small fraction of their rows each.

        Reading a split once decodes every row group once for all its rows; an order that
        jumps between more row groups than the cache holds (no shuffle window, or a window
        larger than the cache) decodes each many times for a few rows: ~100x slower.
        """
        reads = self.stats.row_groups_read
        if self._warned or reads < 4 * self._cache_size:
            return
        rows_per_group = len(self) / max(1, len(self._rg_shard))
        if self._served < reads * rows_per_group / 4:
            self._warned = True
            warnings.warn(
                f"{self.path}: {reads} row groups decoded for {self._served} rows: "
                f"the access order jumps between more row groups than the cache "
                f"holds ({self._cache_size}); use a shuffle window of at most "
                f"cache_row_groups x row group rows, or raise cache_row_groups",
                stacklevel=3,
            )

    def prefetch(self, indices: torch.Tensor) -> None:
        """Start reading, in the background, the row groups `indices` need and lack."""
        if not self._workers:
            return
        g, _ = self._locate(indices)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="shard-read")
            for u in np.unique(g).tolist():
                if u not in self._cache and u not in self._pending:
                    self._pending[u] = self._pool.submit(self._load_pending, u)

    def _row_group(self, g: int) -> tuple[torch.Tensor, ...]:
        with self._lock:
            if g in self._cache:
                self._cache.move_to_end(g)
                self.stats.hits += 1
                return self._cache[g]
            pending = self._pending.get(g)
            if pending is not None:
                self.stats.waits += 1
            else:
                self.stats.misses += 1
        if pending is not None:
            return pending.result()  # a failed read raises here, in the caller
        return self._store(g, self._read(g))

    def _load_pending(self, g: int) -> tuple[torch.Tensor, ...]:
        try:
            return self._store(g, self._read(g))
        finally:
            with self._lock:
                self._pending.pop(g, None)

    def _store(self, g: int, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        with self._lock:
            self._cache[g] = tensors
            self._cache.move_to_end(g)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return tensors

    def _read(self, g: int) -> tuple[torch.Tensor, ...]:
        """Read and decode one row group (thread-safe: each call opens its own reader)."""
        s, r = self._rg_shard[g], self._rg_index[g]
        path = self.path / self.manifest.shards[s].file
        where = f"shard {path} row group {r}"
        try:
            pf = pq.ParquetFile(path, metadata=self._metadata[s])
            table = pf.read_row_group(r, columns=list(self._columns), use_threads=False)
        except (OSError, pa.ArrowException) as e:
            raise ShardError(f"{where}: unreadable: {e}") from e
        tensors = decode(table, self._columns, self.spec, where=where)
        with self._lock:
            self.stats.row_groups_read += 1
            self.stats.bytes_read += self._rg_bytes[g]
            self.stats.reads[(s, r)] += 1
        return tensors

    def close(self) -> None:
        """Stop the background readers (pending reads are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> ShardedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decode(
    table: pa.Table, columns: tuple[str, ...], spec: TaskSpec, *, where: str
) -> tuple[torch.Tensor, ...]:
    """A row group's columns -> (tokens (n, T + 1),) or (inputs (n, *shape), targets (n,)):
    int64 class ids in [0, num_classes), or finite float32 regression targets."""
    if spec.kind == "lm":
        width = spec.input_shape[0] + 1
        tokens = list_rows(table.column(columns[0]).combine_chunks(), what=where, width=width)
        out = torch.from_numpy(tokens.astype(np.int64))  # (n, T + 1), a copy we own
        _check_range(out, spec.num_classes, what=f"{where}: token")
        return (out,)
    width = math.prod(spec.input_shape)
    values = list_rows(table.column(columns[0]).combine_chunks(), what=where, width=width)
    inputs = torch.from_numpy(np.array(values, dtype=np.float32))  # copy: owned, writable
    labels = table.column(columns[1])
    if labels.null_count:
        raise ShardError(f"{where}: null {'targets' if spec.kind == 'regression' else 'labels'}")
    if spec.kind == "regression":
        targets = torch.from_numpy(labels.to_numpy().astype(np.float32))  # (n,), a copy we own
        if not torch.isfinite(targets).all():  # one NaN would make every later loss NaN
            bad = int((~torch.isfinite(targets)).nonzero()[0, 0])
            raise ShardError(
                f"{where}: target {float(targets[bad])} (row {bad} of the row group) is not finite"
            )
    else:
        targets = torch.from_numpy(labels.to_numpy().astype(np.int64))  # (n,)
        _check_range(targets, spec.num_classes, what=f"{where}: label")
    return inputs.view(len(targets), *spec.input_shape), targets


def _check_range(values: torch.Tensor, limit: int, *, what: str) -> None:
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= limit):
        raise ShardError(
            f"{what} values span {int(values.min())}..{int(values.max())}, outside [0, {limit})"
        )


def load_dataset(
    path: Path | str,
    split: Literal["train", "eval"],
    *,
    verify: bool = True,
    prefetch: int = 2,
    cache_row_groups: int = 8,
    shuffle_window: int | None = None,
) -> ShardedDataset | HeldOutSplit:
    """Open `<path>/<split>`, or `path` itself when it is a split or Spark directory.

    A split directory's manifest records its split, and asking it for the other split is
    refused. A directory without a manifest (Spark's output) holds both: train and eval are
    disjoint `HeldOutSplit`s of its rows (1 in 20 held out, the same on every rank and run;
    `data/holdout.py`), announced once per process in a warning.

    Args:
        path: the `out_dir` of `write_shards`, a split directory, or a Spark output.
        split: "train" or "eval".
        verify, prefetch, cache_row_groups: as in `ShardedDataset`.
        shuffle_window: the sampler's window, if known: the cache grows to hold it
            (`ShardedDataset.size_cache_for`).
    """
    path = Path(path)
    candidate = find_split_dir(path, split)
    if candidate is None:
        raise FileNotFoundError(
            f"no shards for split {split!r}: neither {path / split} nor "
            f"{path} has {MANIFEST} or part-*.parquet files"
        )
    ds = ShardedDataset(
        candidate, verify=verify, prefetch=prefetch, cache_row_groups=cache_row_groups
    )
    if ds.manifest.split not in (None, split):
        raise ValueError(f"{candidate} holds the {ds.manifest.split!r} split, not {split!r}")
    if not (candidate / MANIFEST).exists():
        announce(str(candidate))
        ds = HeldOutSplit(ds, split)
    if shuffle_window is not None:
        ds.size_cache_for(shuffle_window)
    return ds
