"""Parquet shards, the reading side: the manifest, the checks on open, and `ShardedDataset`.

Writing a dataset as shards lives in `data/shard_writer.py` (in memory, pyarrow) and
`data/spark.py` (Apache Spark); both end with `write_manifest` from here, so the format is
defined in this one module and the writers only produce rows in it.

Layout on disk
--------------
    OUT_DIR/train/part-00000.parquet ... manifest.json
    OUT_DIR/eval/ part-00000.parquet ... manifest.json

Each split is a directory of Parquet files (the shards) and a `manifest.json` that lists
them in order with their row counts, sizes, SHA-256 and row groups, plus the task
(`TaskSpec`) and the Arrow schema. The manifest is written last, atomically (temp file +
rename), so a directory with a manifest is a complete one. A global row id is the offset of
its shard in manifest order plus its row in the shard; the sampler's `epoch_order` works on
these ids from the row counts alone, so a rank knows which row groups it needs before
reading any.

Schema: classification -> `inputs: list<float32>` (the example flattened; the manifest
holds its shape) and `targets: int64`; language modelling -> `tokens: list<int32>` of
seq_len + 1 bytes per row (inputs = the first seq_len, targets = the last seq_len; how text
becomes windows is in `shard_writer`). Plain lists (not fixed-size lists) because that is
what Apache Spark writes for `array<float>`; Arrow reads either writer's lists back as
`list<element: float>`, and the manifest stores the schema as read back from the files.

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

Integrity is checked on open, never assumed: every listed shard must exist, open as
Parquet, have the manifest's schema, row count, row groups and size, and (verify=True) its
SHA-256. Any failure raises `ShardError` naming the file and the problem; nothing is
skipped. A directory written by Spark without a manifest (`part-*.parquet`, `_SUCCESS`,
`.crc` files) is read directly: parts in name order, task inferred from the schema, no
checksums, but footers and schemas are still checked.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import warnings
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from scaletrain.data.sources import IGNORE_INDEX, Batch, TaskSpec

FORMAT, VERSION = "scaletrain-shards", 1
MANIFEST = "manifest.json"
INPUT_COLUMNS, TARGET_COLUMNS = ("inputs", "features"), ("targets", "label")


class ShardError(ValueError):
    """A shard (or manifest) is missing, damaged or inconsistent; the message names it."""


# ---------------------------------------------------------------------------------------
# The manifest


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest lists it."""

    file: str  # name inside the split directory
    rows: int
    bytes: int
    sha256: str | None  # None only for directories read without a manifest
    row_groups: tuple[int, ...]  # rows per row group


@dataclass(frozen=True)
class Manifest:
    """A split's table of contents: the task, the Arrow schema and the shards in order."""

    task: TaskSpec
    schema: tuple[tuple[str, str], ...]  # (column, Arrow type as str()) as in the files
    shards: tuple[ShardInfo, ...]
    split: str | None = None
    source: str | None = None
    writer: str = ""

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "split": self.split, "source": self.source,
                "writer": self.writer, "rows": self.rows, "task": asdict(self.task),
                "schema": [list(pair) for pair in self.schema],
                "shards": [asdict(s) for s in self.shards]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}, "
                             f"expected {FORMAT!r} version {VERSION}")
        t = data["task"]
        task = TaskSpec(t["kind"], tuple(t["input_shape"]), int(t["num_classes"]),
                        bool(t.get("ragged", False)))
        shards = tuple(ShardInfo(s["file"], int(s["rows"]), int(s["bytes"]), s["sha256"],
                                 tuple(s["row_groups"])) for s in data["shards"])
        return cls(task, tuple((n, ty) for n, ty in data["schema"]), shards,
                   split=data.get("split"), source=data.get("source"),
                   writer=data.get("writer", ""))

    def save(self, split_dir: Path) -> None:
        """Write `split_dir/manifest.json` atomically: readers see the old file or the new."""
        tmp = split_dir / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, split_dir / MANIFEST)


def read_manifest(split_dir: Path) -> Manifest:
    """Parse `split_dir/manifest.json`; any problem is a ShardError naming the file."""
    path = Path(split_dir) / MANIFEST
    try:
        return Manifest.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ShardError(f"{path}: unreadable manifest: {e}") from e


def schema_pairs(schema: pa.Schema) -> tuple[tuple[str, str], ...]:
    """The schema as the manifest stores it: (name, str(type)) per column."""
    return tuple((f.name, str(f.type)) for f in schema)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def describe_shard(path: Path) -> ShardInfo:
    """Measure one written shard: rows and row groups from its footer, size, SHA-256."""
    md = pq.read_metadata(path)
    return ShardInfo(path.name, md.num_rows, path.stat().st_size, sha256_file(path),
                     tuple(md.row_group(i).num_rows for i in range(md.num_row_groups)))


def part_files(split_dir: Path) -> list[Path]:
    """`part-*.parquet` in name order (Spark's `.crc`, `_SUCCESS` and temp files excluded)."""
    return sorted(p for p in Path(split_dir).glob("part-*.parquet") if p.is_file())


def write_manifest(split_dir: Path, *, task: TaskSpec, split: str | None, source: str | None,
                   writer: str) -> Manifest:
    """Scan the part files of a finished split directory and write its manifest, last.

    Args:
        split_dir: a directory of `part-*.parquet` (written by `write_shards` or by Spark).
        task: the task the rows pose.
        split, source, writer: recorded for people; the reader only checks `split`.
    """
    files = part_files(split_dir)
    if not files:
        raise ShardError(f"{split_dir}: no part-*.parquet files to list")
    schema = schema_pairs(pq.read_schema(files[0]))
    for f in files[1:]:
        if schema_pairs(pq.read_schema(f)) != schema:
            raise ShardError(f"shard {f.name}: schema differs from {files[0].name}'s")
    manifest = Manifest(task, schema, tuple(describe_shard(f) for f in files), split=split,
                        source=source, writer=writer)
    manifest.save(Path(split_dir))
    return manifest


# ---------------------------------------------------------------------------------------
# Columns <-> arrays (also used by the writers)


def image_shape(width: int) -> tuple[int, ...]:
    """(1, s, s) when a flat example of `width` values is a perfect square s*s, else (width,)."""
    side = math.isqrt(width)
    return (1, side, side) if side > 1 and side * side == width else (width,)


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

    def __init__(self, path: Path, *, verify: bool = True, prefetch: int = 2,
                 cache_row_groups: int = 8) -> None:
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
            raise ValueError(f"cache_row_groups must be >= 1 and prefetch >= 0, got "
                             f"{cache_row_groups}, {prefetch}")
        if (self.path / MANIFEST).exists():
            self.manifest = read_manifest(self.path)
            self._metadata = [open_shard(self.path, s, self.manifest.schema, verify=verify)
                              for s in self.manifest.shards]
            self._check_unlisted()
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

    def _check_unlisted(self) -> None:
        listed = {s.file for s in self.manifest.shards}
        for p in part_files(self.path):
            if p.name not in listed:
                raise ShardError(f"shard {p.name}: in {self.path} but not in its manifest")

    def _index_row_groups(self) -> None:
        """Global row group g covers rows [starts[g], starts[g] + rows): flat lookup tables."""
        shard, index, sizes, nbytes = [], [], [], []
        for s, md in enumerate(self._metadata):
            for r in range(md.num_row_groups):
                rg = md.row_group(r)
                shard.append(s)
                index.append(r)
                sizes.append(rg.num_rows)
                nbytes.append(sum(rg.column(c).total_compressed_size
                                  for c in range(rg.num_columns)))
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
        return (f"ShardedDataset({str(self.path)!r}, n={len(self)}, "
                f"shards={len(self.manifest.shards)}, spec={self.spec})")

    def _locate(self, indices: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Global row ids -> (global row group, row within it), both (B,)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"row ids must be in [0, {len(self)}), got "
                             f"{idx.min()}..{idx.max()}")
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
            inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            count = int((targets != IGNORE_INDEX).sum())
            return Batch(inputs=inputs, targets=targets, count=count, tokens=inputs.numel())
        inputs, targets = rows
        return Batch(inputs=inputs, targets=targets, count=len(local), tokens=0)

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
            warnings.warn(f"{self.path}: {reads} row groups decoded for {self._served} rows: "
                          f"the access order jumps between more row groups than the cache "
                          f"holds ({self._cache_size}); use a shuffle window of at most "
                          f"cache_row_groups x row group rows, or raise cache_row_groups",
                          stacklevel=3)

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
        info = self.manifest.shards[s]
        try:
            pf = pq.ParquetFile(self.path / info.file, metadata=self._metadata[s])
            table = pf.read_row_group(r, columns=list(self._columns), use_threads=False)
        except (OSError, pa.ArrowException) as e:
            raise ShardError(f"shard {info.file} row group {r}: unreadable: {e}") from e
        tensors = decode(table, self._columns, self.spec, where=f"shard {info.file} row group {r}")
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


def decode(table: pa.Table, columns: tuple[str, ...], spec: TaskSpec, *,
           where: str) -> tuple[torch.Tensor, ...]:
    """A row group's columns -> (tokens (n, T + 1),) or (inputs (n, *shape), targets (n,))."""
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
        raise ShardError(f"{where}: null labels")
    targets = torch.from_numpy(labels.to_numpy().astype(np.int64))  # (n,)
    _check_range(targets, spec.num_classes, what=f"{where}: label")
    return inputs.view(len(targets), *spec.input_shape), targets


def _check_range(values: torch.Tensor, limit: int, *, what: str) -> None:
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= limit):
        raise ShardError(f"{what} values span {int(values.min())}..{int(values.max())}, "
                         f"outside [0, {limit})")


def task_columns(schema: tuple[tuple[str, str], ...], spec: TaskSpec, *,
                 where: Path) -> tuple[str, ...]:
    """The columns a task reads: (tokens,) or (inputs|features, targets|label)."""
    names = [n for n, _ in schema]
    if spec.kind == "lm":
        if "tokens" not in names:
            raise ShardError(f"{where}: a language-modelling split needs a `tokens` column, "
                             f"has {names}")
        return ("tokens",)
    inputs = next((c for c in INPUT_COLUMNS if c in names), None)
    targets = next((c for c in TARGET_COLUMNS if c in names), None)
    if inputs is None or targets is None:
        raise ShardError(f"{where}: a classification split needs `inputs` (or `features`) and "
                         f"`targets` (or `label`) columns, has {names}")
    return inputs, targets


def open_shard(split_dir: Path, info: ShardInfo, schema: tuple[tuple[str, str], ...], *,
               verify: bool) -> pq.FileMetaData:
    """Check one listed shard against the manifest; return its footer. Raises ShardError."""
    path = split_dir / info.file
    where = f"shard {info.file}"
    if not path.is_file():
        raise ShardError(f"{where}: missing (listed in {split_dir / MANIFEST})")
    size = path.stat().st_size
    try:
        md = pq.read_metadata(path)
    except (OSError, pa.ArrowException) as e:
        raise ShardError(f"{where}: not a readable Parquet file, truncated or corrupt ({size} "
                         f"bytes, manifest says {info.bytes}): {e}") from e
    if (got := schema_pairs(md.schema.to_arrow_schema())) != schema:
        raise ShardError(f"{where}: schema {_fmt(got)} differs from the manifest's {_fmt(schema)}")
    if md.num_rows != info.rows:
        raise ShardError(f"{where}: {md.num_rows} rows in the file, manifest says {info.rows}")
    groups = tuple(md.row_group(i).num_rows for i in range(md.num_row_groups))
    if groups != info.row_groups:
        raise ShardError(f"{where}: row groups of {list(groups)} rows, manifest says "
                         f"{list(info.row_groups)}")
    if size != info.bytes:
        raise ShardError(f"{where}: {size} bytes, manifest says {info.bytes}")
    if verify and (digest := sha256_file(path)) != info.sha256:
        raise ShardError(f"{where}: sha256 mismatch (manifest {info.sha256}, file {digest})")
    return md


def _fmt(schema: tuple[tuple[str, str], ...]) -> str:
    return "(" + ", ".join(f"{n}: {t}" for n, t in schema) + ")"


def infer_manifest(split_dir: Path) -> tuple[Manifest, list[pq.FileMetaData]]:
    """Describe a directory of part files with no manifest (e.g. Spark's output).

    Parts in name order are the shards; rows come from the footers. `tokens` -> language
    modelling with seq_len = list length - 1 (bytes: vocabulary 256); `inputs`/`features`
    + `targets`/`label` -> classification, input shape from the list length (`image_shape`),
    num_classes = max label + 1 (reads the label column only). No checksums to compare.
    """
    files = part_files(split_dir)
    if not files:
        raise ShardError(f"{split_dir}: no {MANIFEST} and no part-*.parquet files")
    metadata, schema = [], None
    for f in files:
        try:
            md = pq.read_metadata(f)
        except (OSError, pa.ArrowException) as e:
            raise ShardError(f"shard {f.name}: not a readable Parquet file: {e}") from e
        pairs = schema_pairs(md.schema.to_arrow_schema())
        if schema is not None and pairs != schema:
            raise ShardError(f"shard {f.name}: schema {_fmt(pairs)} differs from "
                             f"{files[0].name}'s {_fmt(schema)}")
        schema = pairs
        metadata.append(md)
    names = [n for n, _ in schema]
    kind = "lm" if "tokens" in names else "classification"
    columns = task_columns(schema, TaskSpec(kind, (0,), 0), where=split_dir)
    width = _first_row_width(files, metadata, columns[0])
    if kind == "lm":
        if width < 2:
            raise ShardError(f"{split_dir}: `tokens` rows of {width} tokens; need >= 2")
        task = TaskSpec("lm", (width - 1,), 256)
    else:
        top = max((pc.max(pq.read_table(f, columns=[columns[1]]).column(0)).as_py()
                   for f, md in zip(files, metadata) if md.num_rows), default=None)
        if top is None:
            raise ShardError(f"{split_dir}: no labels found")
        task = TaskSpec("classification", image_shape(width), int(top) + 1)
    shards = tuple(ShardInfo(f.name, md.num_rows, f.stat().st_size, None,
                             tuple(md.row_group(i).num_rows for i in range(md.num_row_groups)))
                   for f, md in zip(files, metadata))
    return Manifest(task, schema, shards, split=None, source=str(split_dir), writer=""), metadata


def _first_row_width(files: list[Path], metadata: list[pq.FileMetaData], column: str) -> int:
    for f, md in zip(files, metadata):
        if md.num_rows:
            first = pq.ParquetFile(f).read_row_group(0, columns=[column]).column(0)
            return len(first[0].as_py() or [])
    raise ShardError(f"{files[0].parent}: every part file is empty")


def load_dataset(path: Path | str, split: Literal["train", "eval"], *, verify: bool = True,
                 prefetch: int = 2, cache_row_groups: int = 8,
                 shuffle_window: int | None = None) -> ShardedDataset:
    """Open `<path>/<split>`, or `path` itself when it is a split or Spark directory.

    A split directory's manifest records its split, and asking it for the other split is
    refused. A Spark directory has no such record and serves whichever split is asked for
    (the same rows): give train and eval their own directories.

    Args:
        path: the `out_dir` of `write_shards`, a split directory, or a Spark output.
        split: "train" or "eval".
        verify, prefetch, cache_row_groups: as in `ShardedDataset`.
        shuffle_window: the sampler's window, if known: the cache grows to hold it
            (`ShardedDataset.size_cache_for`).
    """
    path = Path(path)
    kwargs = dict(verify=verify, prefetch=prefetch, cache_row_groups=cache_row_groups)
    for candidate in (path / split, path):
        if (candidate / MANIFEST).exists() or part_files(candidate):
            ds = ShardedDataset(candidate, **kwargs)
            if ds.manifest.split not in (None, split):
                raise ValueError(f"{candidate} holds the {ds.manifest.split!r} split, not "
                                 f"{split!r}")
            if shuffle_window is not None:
                ds.size_cache_for(shuffle_window)
            return ds
    raise FileNotFoundError(f"no shards for split {split!r}: neither {path / split} nor {path} "
                            f"has {MANIFEST} or part-*.parquet files")
