"""Parquet shards, the writing side: a source -> one Arrow table per split -> shard files.

The format (layout, schema, manifest) is in `data/manifest.py` and the reader in
`data/shards.py`; this module only makes rows in that schema and writes them. It holds a
whole source in memory, which suits every built-in source and files up to a few GB;
`data/spark.py` writes the same shards with Spark for larger ones, reusing the helpers
defined here.

Sources: a built-in name (`load_source`; both splits exactly as in memory) or a JSONL /
CSV / Parquet file or directory of them, read and checked cell by cell by
`data/file_source.py` (what makes a text, classification or regression set is described
there). A file holds one dataset, so the writer splits it: 1 row in 20 (5%, at least one)
goes to `eval` and the rest to `train`, each in file order, by the fixed, seeded rule of
`data/holdout.py` (seed `HOLDOUT_SEED` = 0; blocks of 20 rows, one hashed position each),
so a file sorted by label (or by target) still gets every class (every range of targets)
into both splits. A split that lacks a class the other has (a rare class, fewer than 20
rows of it) is reported in a warning. Regression targets are written as float32, the dtype
the model's outputs and the loss use.

Text is packed at shard time: the documents of a split (whole documents go to one split)
as UTF-8 bytes joined by a blank line (b"\\n\\n"), cut into consecutive windows of
seq_len + 1; the trailing partial window is dropped.

Writing is crash-safe by ordering: shards go to hidden temp names, are renamed to
`part-NNNNN.parquet` only when all are written, and the manifest (`write_manifest`) comes
last, so a reader never takes a half-written split for a complete one.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from scaletrain.data.file_source import TASK_COLUMNS, feature_columns, read_files, task_kind
from scaletrain.data.holdout import EVAL_EVERY, eval_mask, missing_classes
from scaletrain.data.manifest import (
    MANIFEST,
    Manifest,
    describe_targets,
    example_shape,
    part_files,
    write_manifest,
)
from scaletrain.data.shards import list_rows
from scaletrain.data.sources import SOURCE_NAMES, SPLITS, ArrayDataset, TaskSpec, load_source

TEXT_SEPARATOR = b"\n\n"  # between documents when text is packed


# ---------------------------------------------------------------------------------------
# Sources -> Arrow tables (one per split)


def fixed_lists(values: np.ndarray) -> pa.ListArray:
    """(N, D) array -> list array of N rows of D values, without copying the values."""
    n, d = values.shape
    offsets = pa.array(np.arange(0, n * d + 1, d, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(values).reshape(-1)))


def classification_table(inputs: np.ndarray, targets: np.ndarray) -> pa.Table:
    """(N, D) float32 examples and (N,) labels -> the classification shard schema."""
    return pa.table(
        {
            "inputs": fixed_lists(inputs.astype(np.float32, copy=False)),
            "targets": pa.array(targets.astype(np.int64, copy=False)),
        }
    )


def regression_table(inputs: np.ndarray, targets: np.ndarray) -> pa.Table:
    """(N, D) float32 examples and (N,) numeric targets -> the regression shard schema."""
    return pa.table(
        {
            "inputs": fixed_lists(inputs.astype(np.float32, copy=False)),
            "targets": pa.array(targets.astype(np.float32, copy=False)),
        }
    )


def lm_table(windows: np.ndarray) -> pa.Table:
    """(N, seq_len + 1) token windows -> the language-modelling shard schema."""
    return pa.table({"tokens": fixed_lists(windows.astype(np.int32, copy=False))})


def builtin_table(
    name: str, *, split: str, seq_len: int, synthetic_examples: int = 4096, seed: int = 0
) -> tuple[pa.Table, TaskSpec]:
    """A built-in source's split as a shard table; rows exactly as `load_source` holds them."""
    ds = load_source(
        name, split=split, seq_len=seq_len, synthetic_examples=synthetic_examples, seed=seed
    )
    if ds.spec.ragged:
        raise ValueError(
            f"source {name!r} is padded (ragged); shards hold packed sequences only: use 'wikitext'"
        )
    return dataset_table(ds), ds.spec


def dataset_table(ds: ArrayDataset) -> pa.Table:
    if ds.spec.kind == "lm":
        # A packed window w gives inputs = w[:-1], targets = w[1:]: w = inputs + last target.
        windows = torch.cat([ds.inputs, ds.targets[:, -1:]], dim=1)  # (N, T + 1)
        return lm_table(windows.numpy())
    return classification_table(ds.inputs.flatten(1).numpy(), ds.targets.numpy())


def pack_bytes(data: bytes, *, seq_len: int) -> np.ndarray:
    """Cut bytes into consecutive windows of seq_len + 1: (N, seq_len + 1) uint8."""
    w = seq_len + 1
    n = len(data) // w
    if n == 0:
        raise ValueError(f"{len(data)} bytes of text are too few for one window of {w}")
    return np.frombuffer(data, dtype=np.uint8, count=n * w).reshape(n, w)


def file_tables(
    path: Path, *, seq_len: int
) -> tuple[dict[str, tuple[pa.Table, TaskSpec]], str | None, tuple[str, ...]]:
    """A file source as ({split: (shard table, task)}, label or target column, feature columns).

    The rules are in `data/file_source.py` (columns, checks) and `data/holdout.py` (split).
    """
    table, fmt = read_files(path)
    is_eval = eval_mask(table.num_rows)  # (N,) bool: 1 row in 20, at hashed positions
    kind = task_kind(table.schema.names, where=path)  # each file's was checked: the same
    if kind == "lm":
        texts = np.array(
            [t if t is not None else "" for t in table.column("text").to_pylist()], dtype=object
        )
        spec = TaskSpec("lm", (seq_len,), 256)
        return (
            {
                split: (
                    lm_table(
                        pack_bytes(TEXT_SEPARATOR.join(t.encode() for t in part), seq_len=seq_len)
                    ),
                    spec,
                )
                for split, part in (("train", texts[~is_eval]), ("eval", texts[is_eval]))
            },
            None,
            ("text",),
        )
    columns = feature_columns(table.schema.names, fmt)
    if columns == ["features"]:
        inputs = list_rows(table.column("features").combine_chunks(), what=f"{path}: features")
    else:
        inputs = np.column_stack([table.column(c).to_numpy().astype(np.float32) for c in columns])
    shape = example_shape(inputs.shape[1], kind=kind, from_list=columns == ["features"])
    column = TASK_COLUMNS[kind]
    if kind == "classification":
        targets = table.column(column).to_numpy().astype(np.int64)  # checked: integers >= 0
        spec, make = TaskSpec(kind, shape, int(targets.max()) + 1), classification_table
    else:  # checked: finite numbers; float32 for the model, one target per row
        targets = table.column(column).to_numpy().astype(np.float32)  # (N,)
        spec, make = TaskSpec(kind, shape, 1), regression_table
    return (
        {
            "train": (make(inputs[~is_eval], targets[~is_eval]), spec),
            "eval": (make(inputs[is_eval], targets[is_eval]), spec),
        },
        column,
        tuple(columns),
    )


def warn_if_classes_missing(manifests: dict[str, Manifest], *, source: str) -> None:
    """Warn when one split lacks a class the other has: its accuracy says nothing of it."""
    train, ev = manifests["train"].label_counts, manifests["eval"].label_counts
    if train is None or ev is None:
        return
    width = max(len(train), len(ev))
    counts = {
        name: np.pad(np.array(c, dtype=np.int64), (0, width - len(c)))
        for name, c in (("train", train), ("eval", ev))
    }
    if message := missing_classes(counts):
        warnings.warn(
            f"{source}: {message}; with 1 row in {EVAL_EVERY} held out, a class "
            f"with few rows can miss a split, and that split's accuracy says nothing "
            f"of it: add rows of these classes, or write train and eval yourself",
            stacklevel=3,
        )


# ---------------------------------------------------------------------------------------
# Tables -> shard files and manifests


def write_shards(
    source: str | Path,
    out_dir: Path,
    *,
    rows_per_shard: int,
    seq_len: int = 128,
    row_group_rows: int = 1024,
    synthetic_examples: int = 4096,
    seed: int = 0,
    compression: str = "zstd",
    overwrite: bool = False,
) -> Manifest:
    """Write a source's train and eval splits as Parquet shards with manifests.

    Args:
        source: a built-in name (SOURCE_NAMES except the padded `wikitext-paragraphs`) or a
            JSONL / CSV / Parquet file or directory (1 row in 20 -> eval, `data/holdout.py`)
            with a `text`, `label` or `target` column (`data/file_source.py`).
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
        raise ValueError(
            f"rows_per_shard and row_group_rows must be >= 1, got "
            f"{rows_per_shard}, {row_group_rows}"
        )
    name = str(source)
    if name in SOURCE_NAMES:
        tables = {
            split: builtin_table(
                name, split=split, seq_len=seq_len, synthetic_examples=synthetic_examples, seed=seed
            )
            for split in SPLITS
        }
        label_column, features = None, ()
    else:
        tables, label_column, features = file_tables(Path(source), seq_len=seq_len)
    from scaletrain.version import __version__

    manifests = {}
    for split, (table, task) in tables.items():
        split_dir = prepare_split_dir(Path(out_dir) / split, overwrite=overwrite)
        written = []  # hidden temp names until all are done: a crash leaves no part-*.parquet
        for k, start in enumerate(range(0, table.num_rows, rows_per_shard)):
            tmp = split_dir / f".part-{k:05d}.parquet.tmp"
            # Dictionary encoding for class labels only: MNIST pixels decoded ~1.8x slower with
            # it, and regression targets are mostly distinct values.
            pq.write_table(
                table.slice(start, rows_per_shard),
                tmp,
                row_group_size=row_group_rows,
                compression=compression,
                use_dictionary=["targets"] if task.kind == "classification" else False,
            )
            written.append(tmp)
        for tmp in written:
            os.replace(tmp, split_dir / tmp.name[1:-4])
        counts = (
            tuple(
                np.bincount(table.column("targets").to_numpy(), minlength=task.num_classes).tolist()
            )
            if task.kind == "classification"
            else None
        )
        stats = describe_targets([table.column("targets")]) if task.kind == "regression" else None
        manifests[split] = write_manifest(
            split_dir,
            task=task,
            split=split,
            source=name,
            writer=f"scaletrain {__version__} (pyarrow {pa.__version__})",
            label_column=label_column,
            feature_columns=features,
            label_counts=counts,
            target_stats=stats,
        )
    warn_if_classes_missing(manifests, source=name)
    return manifests["train"]


def prepare_split_dir(split_dir: Path, *, overwrite: bool) -> Path:
    """Create a split directory; refuse (or, with overwrite, clear) one that holds shards."""
    split_dir.mkdir(parents=True, exist_ok=True)
    existing = [p for p in [split_dir / MANIFEST] if p.exists()] + part_files(split_dir)
    if existing and not overwrite:
        raise FileExistsError(
            f"{split_dir} already holds shards ({existing[0].name}, ...); "
            "pass overwrite=True to replace them"
        )
    for p in existing + list(split_dir.glob(".part-*.parquet.tmp")):  # manifest goes first
        p.unlink()
    return split_dir
