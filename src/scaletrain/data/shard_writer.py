"""Parquet shards, the writing side: a source -> one Arrow table per split -> shard files.

The format (layout, schema, manifest) and the reader are in `data/shards.py`; this module
only makes rows in that schema and writes them. It holds a whole source in memory, which
suits every built-in source and files up to a few GB; `data/spark.py` writes the same
shards with Spark for larger ones, reusing the split rule and helpers defined here.

Sources: a built-in name (`load_source`; both splits exactly as in memory) or a JSONL /
CSV / Parquet file or directory of them (one format; files in name order). A `text`
column makes a language-modelling set; otherwise a `label` integer column and either a
`features` list column (a perfect square s*s becomes a (1, s, s) image) or every other
numeric column (in file order; for JSON, whose objects have no column order, by name). Files hold
one dataset, so the split is positional: the last 5% of rows (at least one) are `eval`,
the rest `train`, in file order: shuffle a file that is sorted by label first.

Text is packed at shard time: UTF-8 bytes of the documents joined by a blank line
(b"\\n\\n"), cut into consecutive windows of seq_len + 1; the trailing partial window is
dropped.

Writing is crash-safe by ordering: shards go to hidden temp names, are renamed to
`part-NNNNN.parquet` only when all are written, and the manifest (`write_manifest`) comes
last, so a reader never takes a half-written split for a complete one.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from scaletrain.data.shards import (MANIFEST, Manifest, image_shape, list_rows, part_files,
                                    write_manifest)
from scaletrain.data.sources import SOURCE_NAMES, SPLITS, ArrayDataset, TaskSpec, load_source

EVAL_FRACTION = 0.05  # file sources: the last 5% of rows (at least one) are the eval split
TEXT_SEPARATOR = b"\n\n"  # between documents when text is packed
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv",
                ".parquet": "parquet"}


# ---------------------------------------------------------------------------------------
# Sources -> Arrow tables (one per split)


def fixed_lists(values: np.ndarray) -> pa.ListArray:
    """(N, D) array -> list array of N rows of D values, without copying the values."""
    n, d = values.shape
    offsets = pa.array(np.arange(0, n * d + 1, d, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(values).reshape(-1)))


def classification_table(inputs: np.ndarray, targets: np.ndarray) -> pa.Table:
    """(N, D) float32 examples and (N,) labels -> the classification shard schema."""
    return pa.table({"inputs": fixed_lists(inputs.astype(np.float32, copy=False)),
                     "targets": pa.array(targets.astype(np.int64, copy=False))})


def lm_table(windows: np.ndarray) -> pa.Table:
    """(N, seq_len + 1) token windows -> the language-modelling shard schema."""
    return pa.table({"tokens": fixed_lists(windows.astype(np.int32, copy=False))})


def builtin_table(name: str, *, split: str, seq_len: int, synthetic_examples: int = 4096,
                  seed: int = 0) -> tuple[pa.Table, TaskSpec]:
    """A built-in source's split as a shard table; rows exactly as `load_source` holds them."""
    ds = load_source(name, split=split, seq_len=seq_len, synthetic_examples=synthetic_examples,
                     seed=seed)
    if ds.spec.ragged:
        raise ValueError(f"source {name!r} is padded (ragged); shards hold packed sequences "
                         "only: use 'wikitext'")
    return dataset_table(ds), ds.spec


def dataset_table(ds: ArrayDataset) -> pa.Table:
    if ds.spec.kind == "lm":
        # A packed window w gives inputs = w[:-1], targets = w[1:]: w = inputs + last target.
        windows = torch.cat([ds.inputs, ds.targets[:, -1:]], dim=1)  # (N, T + 1)
        return lm_table(windows.numpy())
    return classification_table(ds.inputs.flatten(1).numpy(), ds.targets.numpy())


def source_files(path: Path) -> tuple[list[Path], str]:
    """The data files of a file source in name order, and their one format (json/csv/parquet)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in FILE_FORMATS
                       and not p.name.startswith(("_", ".")))
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"data source {str(path)!r} is neither a built-in name "
                         f"({', '.join(SOURCE_NAMES)}) nor an existing file or directory")
    formats = {FILE_FORMATS.get(p.suffix) for p in files}
    if not files or None in formats:
        raise ValueError(f"{path}: expected .jsonl/.json, .csv or .parquet files")
    if len(formats) > 1:
        raise ValueError(f"{path}: mixes formats {sorted(formats)}; use one format per source")
    return files, formats.pop()


def read_files(path: Path) -> tuple[pa.Table, str]:
    """Read a file source into one Arrow table (files concatenated in name order)."""
    import pyarrow.csv
    import pyarrow.json

    files, fmt = source_files(path)
    readers = {"json": pyarrow.json.read_json, "csv": pyarrow.csv.read_csv,
               "parquet": pq.read_table}
    tables = [readers[fmt](str(f)) for f in files]
    return pa.concat_tables(tables, promote_options="permissive"), fmt


def eval_rows(n: int) -> int:
    """Rows of a file source that go to eval: the last 5%, rounded up, at least one."""
    if n < 2:
        raise ValueError(f"a file source needs at least 2 rows (train and eval), got {n}")
    return max(1, math.ceil(EVAL_FRACTION * n))


def feature_columns(schema: pa.Schema, fmt: str) -> list[str]:
    """The input columns of a classification file: `features`, else every other number."""
    if "features" in schema.names:
        return ["features"]
    numeric = [f.name for f in schema if f.name != "label"
               and (pa.types.is_integer(f.type) or pa.types.is_floating(f.type))]
    if not numeric:
        raise ValueError("no `features` list column and no numeric columns besides `label`")
    return sorted(numeric) if fmt == "json" else numeric  # JSON objects have no column order


def pack_bytes(data: bytes, *, seq_len: int) -> np.ndarray:
    """Cut bytes into consecutive windows of seq_len + 1: (N, seq_len + 1) uint8."""
    w = seq_len + 1
    n = len(data) // w
    if n == 0:
        raise ValueError(f"{len(data)} bytes of text are too few for one window of {w}")
    return np.frombuffer(data, dtype=np.uint8, count=n * w).reshape(n, w)


def file_tables(path: Path, *, seq_len: int) -> dict[str, tuple[pa.Table, TaskSpec]]:
    """A file source as {split: (shard table, task)}; see the module docstring for the rules."""
    table, fmt = read_files(path)
    n_train = table.num_rows - eval_rows(table.num_rows)
    if "text" in table.schema.names:
        texts = [t if t is not None else "" for t in table.column("text").to_pylist()]
        spec = TaskSpec("lm", (seq_len,), 256)
        return {split: (lm_table(pack_bytes(TEXT_SEPARATOR.join(t.encode() for t in part),
                                            seq_len=seq_len)), spec)
                for split, part in (("train", texts[:n_train]), ("eval", texts[n_train:]))}
    if "label" not in table.schema.names:
        raise ValueError(f"{path}: needs a `text` column (language modelling) or a `label` "
                         f"column (classification); columns are {table.schema.names}")
    labels = table.column("label")
    if not pa.types.is_integer(labels.type) or labels.null_count:
        raise ValueError(f"{path}: `label` must be integers without nulls, got {labels.type}")
    targets = labels.to_numpy().astype(np.int64)
    if targets.min() < 0:
        raise ValueError(f"{path}: labels must be >= 0, found {targets.min()}")
    columns = feature_columns(table.schema, fmt)
    if nulls := [c for c in columns if table.column(c).null_count]:
        raise ValueError(f"{path}: null values in column(s) {nulls}")
    if columns == ["features"]:
        inputs = list_rows(table.column("features").combine_chunks(), what=f"{path}: features")
        shape = image_shape(inputs.shape[1])
    else:
        inputs = np.column_stack([table.column(c).to_numpy().astype(np.float32) for c in columns])
        shape = (len(columns),)
    spec = TaskSpec("classification", shape, int(targets.max()) + 1)
    return {"train": (classification_table(inputs[:n_train], targets[:n_train]), spec),
            "eval": (classification_table(inputs[n_train:], targets[n_train:]), spec)}


# ---------------------------------------------------------------------------------------
# Tables -> shard files and manifests


def write_shards(source: str | Path, out_dir: Path, *, rows_per_shard: int, seq_len: int = 128,
                 row_group_rows: int = 1024, synthetic_examples: int = 4096, seed: int = 0,
                 compression: str = "zstd", overwrite: bool = False) -> Manifest:
    """Write a source's train and eval splits as Parquet shards with manifests.

    Args:
        source: a built-in name (SOURCE_NAMES except the padded `wikitext-paragraphs`) or a
            JSONL / CSV / Parquet file or directory (last 5% of rows -> eval).
        out_dir: gets `train/` and `eval/`, each `part-NNNNN.parquet` + `manifest.json`.
        rows_per_shard: rows per file (the last file of a split may hold fewer).
        seq_len: tokens per example for text (rows hold seq_len + 1).
        row_group_rows: rows per Parquet row group, the unit a reader decodes.
        synthetic_examples, seed: as in `load_source`, for the synthetic sources.
        compression: Parquet codec ("zstd" reads fastest here, "snappy", "none").
        overwrite: replace existing shards (only part-*.parquet and the manifest) instead of
            refusing.

    Returns the train split's manifest; `read_manifest(out_dir / "eval")` gives the other.
    """
    if rows_per_shard < 1 or row_group_rows < 1:
        raise ValueError(f"rows_per_shard and row_group_rows must be >= 1, got "
                         f"{rows_per_shard}, {row_group_rows}")
    name = str(source)
    if name in SOURCE_NAMES:
        tables = {split: builtin_table(name, split=split, seq_len=seq_len,
                                       synthetic_examples=synthetic_examples, seed=seed)
                  for split in SPLITS}
    else:
        tables = file_tables(Path(source), seq_len=seq_len)
    from scaletrain import __version__

    manifests = {}
    for split, (table, task) in tables.items():
        split_dir = prepare_split_dir(Path(out_dir) / split, overwrite=overwrite)
        written = []  # hidden temp names until all are done: a crash leaves no part-*.parquet
        for k, start in enumerate(range(0, table.num_rows, rows_per_shard)):
            tmp = split_dir / f".part-{k:05d}.parquet.tmp"
            # Dictionary encoding for labels only: MNIST pixels decoded ~1.8x slower with it.
            pq.write_table(table.slice(start, rows_per_shard), tmp, row_group_size=row_group_rows,
                           compression=compression, use_dictionary=["targets"])
            written.append(tmp)
        for tmp in written:
            os.replace(tmp, split_dir / tmp.name[1:-4])
        manifests[split] = write_manifest(split_dir, task=task, split=split, source=name,
                                          writer=f"scaletrain {__version__} (pyarrow "
                                                 f"{pa.__version__})")
    return manifests["train"]


def prepare_split_dir(split_dir: Path, *, overwrite: bool) -> Path:
    """Create a split directory; refuse (or, with overwrite, clear) one that holds shards."""
    split_dir.mkdir(parents=True, exist_ok=True)
    existing = [p for p in [split_dir / MANIFEST] if p.exists()] + part_files(split_dir)
    if existing and not overwrite:
        raise FileExistsError(f"{split_dir} already holds shards ({existing[0].name}, ...); "
                              "pass overwrite=True to replace them")
    for p in existing + list(split_dir.glob(".part-*.parquet.tmp")):  # manifest goes first
        p.unlink()
    return split_dir
