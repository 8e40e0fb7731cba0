"""Parquet shards, the format: the manifest, the checks a shard must pass, and `ShardError`.

Both writers (`data/shard_writer.py`, pyarrow; `data/spark.py`, Spark) end with
`write_manifest` from here, and the reader (`data/shards.py`) and the pre-launch checks
(`data/preflight.py`) start with `open_split`, `read_manifest` or `infer_manifest`, so the
format is defined in this one module. Nothing here decodes rows: everything reads footers,
schemas and the manifest, and (verify=True) hashes bytes.

Layout on disk
--------------
    OUT_DIR/train/part-00000.parquet ... manifest.json
    OUT_DIR/eval/ part-00000.parquet ... manifest.json

Each split is a directory of Parquet files (the shards) and a `manifest.json` that lists
them in order with their row counts, sizes, SHA-256 (of the file and of its footer) and row
groups, plus the task (`TaskSpec`) and the Arrow schema. The manifest is written last,
atomically (temp file + rename), so a directory with a manifest is a complete one. It also
records, for people and for `scaletrain shard`'s summary, which source columns the rows came
from and how many rows each class has (classification) or the target's min, mean and max
(regression); the reader ignores those.

Schema: classification -> `inputs: list<float32>` (the example flattened; the manifest
holds its shape) and `targets: int64`; regression -> `inputs: list<float32>` and
`targets: float` (one finite float32 per row, num_classes 1); language modelling ->
`tokens: list<int32>` of seq_len + 1 bytes per row. Plain lists (not fixed-size lists)
because that is what Apache Spark writes for `array<float>`; Arrow reads either writer's
lists back as `list<element: float>`, and the manifest stores the schema as read back from
the files.

Integrity is checked on open, never assumed (`open_split`, `open_shard`): every listed
shard must exist, open as Parquet, have the manifest's schema, row count, row groups and
size, the SHA-256 of its footer, and (verify=True) the SHA-256 of all its bytes. Any failure
raises `ShardError` naming the file's path, the problem and the fix. All but the last read
the footer alone, so the launcher runs them on every shard before any worker starts
(`data/preflight.py`); a flip inside a data page leaves the footer intact, and only the
full hash, in the workers, sees it. A directory without a manifest (Spark's
`part-*.parquet`, `_SUCCESS`, `.crc`) is described by `infer_manifest`: parts in name
order, task inferred from the schema (`tokens`: text; `target`, or float `targets`:
regression; `label`, or integer `targets`: classification), no checksums, but footers and
schemas are still checked.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from scaletrain.data.holdout import EVAL_EVERY, HOLDOUT_SEED
from scaletrain.data.sources import TaskSpec
from scaletrain.errors import UserError

FORMAT, VERSION = "scaletrain-shards", 1
MANIFEST = "manifest.json"
INPUT_COLUMNS = ("inputs", "features")
# The column of targets per task kind: the writers' `targets`, or a plain Spark job's source
# column (`label`, `target`, as in a file source).
TARGET_COLUMNS = {"classification": ("targets", "label"), "regression": ("targets", "target")}
_SCALAR_NUMBERS = {
    "halffloat",
    "float",
    "double",
    *(f"{u}int{b}" for u in ("", "u") for b in (8, 16, 32, 64)),
}


class ShardError(UserError):
    """A shard (or manifest) is missing, damaged or inconsistent; the message names it."""


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest lists it."""

    file: str  # name inside the split directory
    rows: int
    bytes: int
    sha256: str | None  # None only for directories read without a manifest
    row_groups: tuple[int, ...]  # rows per row group
    # Of the footer alone (`footer_sha256`): cheap enough to check at every launch. None for
    # directories without a manifest and manifests written before it was recorded.
    footer_sha256: str | None = None


@dataclass(frozen=True)
class Manifest:
    """A split's table of contents: the task, the Arrow schema and the shards in order."""

    task: TaskSpec
    schema: tuple[tuple[str, str], ...]  # (column, Arrow type as str()) as in the files
    shards: tuple[ShardInfo, ...]
    split: str | None = None
    source: str | None = None
    writer: str = ""
    # Where the rows came from, for people: not read back by the reader.
    label_column: str | None = None  # the source column that became `targets` (label, target)
    feature_columns: tuple[str, ...] = ()  # the source columns that became `inputs`/`tokens`
    label_counts: tuple[int, ...] | None = None  # rows per class 0..num_classes-1
    target_stats: tuple[float, float, float] | None = None  # regression: (min, mean, max)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "split": self.split,
            "source": self.source,
            "writer": self.writer,
            "rows": self.rows,
            "task": asdict(self.task),
            "schema": [list(pair) for pair in self.schema],
            "label_column": self.label_column,
            "feature_columns": list(self.feature_columns),
            "label_counts": None if self.label_counts is None else list(self.label_counts),
            "target_stats": (
                None
                if self.target_stats is None
                else dict(zip(("min", "mean", "max"), self.target_stats))
            ),
            "shards": [asdict(s) for s in self.shards],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(
                f"format {data.get('format')!r} version {data.get('version')!r}, "
                f"expected {FORMAT!r} version {VERSION}"
            )
        t = data["task"]
        task = TaskSpec(
            t["kind"], tuple(t["input_shape"]), int(t["num_classes"]), bool(t.get("ragged", False))
        )
        shards = tuple(
            ShardInfo(
                s["file"],
                int(s["rows"]),
                int(s["bytes"]),
                s["sha256"],
                tuple(s["row_groups"]),
                s.get("footer_sha256"),  # absent from manifests written before it existed
            )
            for s in data["shards"]
        )
        counts = data.get("label_counts")  # absent from manifests written before it existed
        stats = data.get("target_stats")  # likewise
        return cls(
            task,
            tuple((n, ty) for n, ty in data["schema"]),
            shards,
            split=data.get("split"),
            source=data.get("source"),
            writer=data.get("writer", ""),
            label_column=data.get("label_column"),
            feature_columns=tuple(data.get("feature_columns") or ()),
            label_counts=None if counts is None else tuple(int(c) for c in counts),
            target_stats=None
            if stats is None
            else tuple(float(stats[k]) for k in ("min", "mean", "max")),
        )

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


def footer_sha256(path: Path) -> str:
    """SHA-256 of a Parquet file's footer: its metadata, their 4-byte length and the closing
    magic, i.e. the last length + 8 bytes (the whole file when that length is damaged)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - 8))
        length = int.from_bytes(f.read(4), "little")
        f.seek(max(0, size - 8 - length))
        return hashlib.sha256(f.read()).hexdigest()


def describe_shard(path: Path) -> ShardInfo:
    """Measure one written shard: rows and row groups from its footer, size, SHA-256s."""
    md = pq.read_metadata(path)
    return ShardInfo(
        path.name,
        md.num_rows,
        path.stat().st_size,
        sha256_file(path),
        row_groups(md),
        footer_sha256(path),
    )


def row_groups(md: pq.FileMetaData) -> tuple[int, ...]:
    """Rows per row group, from a footer."""
    return tuple(md.row_group(i).num_rows for i in range(md.num_row_groups))


def part_files(split_dir: Path) -> list[Path]:
    """`part-*.parquet` in name order (Spark's `.crc`, `_SUCCESS` and temp files excluded)."""
    return sorted(p for p in Path(split_dir).glob("part-*.parquet") if p.is_file())


def find_split_dir(path: Path, split: str) -> Path | None:
    """`path/split`, else `path` itself, whichever holds a manifest or part files; else None."""
    for candidate in (Path(path) / split, Path(path)):
        if (candidate / MANIFEST).exists() or part_files(candidate):
            return candidate
    return None


def write_manifest(
    split_dir: Path,
    *,
    task: TaskSpec,
    split: str | None,
    source: str | None,
    writer: str,
    label_column: str | None = None,
    feature_columns: tuple[str, ...] = (),
    label_counts: tuple[int, ...] | None = None,
    target_stats: tuple[float, float, float] | None = None,
) -> Manifest:
    """Scan the part files of a finished split directory and write its manifest, last.

    Args:
        split_dir: a directory of `part-*.parquet` (written by `write_shards` or by Spark).
        task: the task the rows pose.
        split, source, writer: recorded for people; the reader only checks `split`.
        label_column, feature_columns: the source columns the rows came from, for people.
        label_counts: rows per class; None counts them in the files (classification only:
            reads the label column of each shard).
        target_stats: (min, mean, max) of the targets; None computes them from the files
            (regression only: reads the target column of each shard).
    """
    files = part_files(split_dir)
    if not files:
        raise ShardError(f"{split_dir}: no part-*.parquet files to list")
    schema = schema_pairs(pq.read_schema(files[0]))
    for f in files[1:]:
        if schema_pairs(pq.read_schema(f)) != schema:
            raise ShardError(f"shard {f.name}: schema differs from {files[0].name}'s")
    column = task_columns(schema, task, where=split_dir)[-1]
    if label_counts is None and task.kind == "classification":
        label_counts = count_labels(files, column, num_classes=task.num_classes)
    if target_stats is None and task.kind == "regression":
        target_stats = describe_targets(pq.read_table(f, columns=[column]).column(0) for f in files)
    manifest = Manifest(
        task,
        schema,
        tuple(describe_shard(f) for f in files),
        split=split,
        source=source,
        writer=writer,
        label_column=label_column,
        feature_columns=tuple(feature_columns),
        label_counts=label_counts,
        target_stats=target_stats,
    )
    manifest.save(Path(split_dir))
    return manifest


def count_labels(files: list[Path], column: str, *, num_classes: int) -> tuple[int, ...]:
    """Rows per class 0..num_classes-1 over the files (reads one column)."""
    counts = np.zeros(num_classes, dtype=np.int64)
    for f in files:
        labels = pq.read_table(f, columns=[column]).column(0).to_numpy()
        found = np.bincount(labels.astype(np.int64), minlength=len(counts))  # never shorter
        counts = found + np.pad(counts, (0, len(found) - len(counts)))
    return tuple(int(c) for c in counts)


def describe_targets(
    columns: Iterable[pa.Array | pa.ChunkedArray],
) -> tuple[float, float, float] | None:
    """(min, mean, max) of regression targets given in pieces (one per shard); None if empty."""
    low, high, total, n = math.inf, -math.inf, 0.0, 0
    for column in columns:
        if len(column):
            extremes = pc.min_max(column)
            low, high = min(low, extremes["min"].as_py()), max(high, extremes["max"].as_py())
            total += pc.sum(column.cast(pa.float64())).as_py()  # float64: no float32 drift
            n += len(column)
    return (float(low), total / n, float(high)) if n else None


def summary_lines(train: Manifest, ev: Manifest, *, out_dir: Path) -> list[str]:
    """What a written dataset holds, for `scaletrain shard` to print: columns, rows, shards."""
    task, builtin = train.task, not train.feature_columns
    if task.kind == "lm":
        column = "the source's text" if builtin else f"text column `{train.feature_columns[0]}`"
        what = f"{column}, seq_len {task.input_shape[0]} (rows of {task.input_shape[0] + 1} tokens)"
    elif task.kind == "regression":
        what = f"{_target_words(train, ev)}, {_feature_words(train)}"
    else:
        labels = (
            "its own labels"
            if train.label_column is None
            else f"label column `{train.label_column}`"
        )
        counts = [a + b for a, b in zip(train.label_counts or (), ev.label_counts or ())]
        present = sum(1 for c in counts if c)
        classes = f"{task.num_classes} classes" + (
            f" ({present} with rows)" if counts and present < task.num_classes else ""
        )
        what = f"{labels}, {classes}, {_feature_words(train)}"
    held = (
        "the source's own eval split"
        if builtin
        else f"eval: 1 row in {EVAL_EVERY} of the source at hashed positions, seed {HOLDOUT_SEED}"
    )
    return [
        f"source {train.source}: {what}",
        f"rows: {train.rows} train, {ev.rows} eval ({held})",
        f"wrote {len(train.shards)} train + {len(ev.shards)} eval shards to {out_dir}",
    ]


def _feature_words(train: Manifest) -> str:
    """ "20 features (f0, f1, ...)": how many inputs an example has and where they came from."""
    shape = train.task.input_shape
    width = math.prod(shape)
    if train.feature_columns == ("features",):
        return f"{width} features (`features` lists, shape {shape})"
    if not train.feature_columns:  # a built-in source
        return f"{width} features (shape {shape})"
    names = ", ".join(train.feature_columns[:8]) + (", ..." if width > 8 else "")
    return f"{width} features ({names})"


def _target_words(train: Manifest, ev: Manifest) -> str:
    """ "target column `target` (min -1.5, mean 0.2, max 3)" over both splits' rows."""
    words = f"target column `{train.label_column or 'targets'}`"
    if train.target_stats is None or ev.target_stats is None:
        return words
    (lo_t, mean_t, hi_t), (lo_e, mean_e, hi_e) = train.target_stats, ev.target_stats
    mean = (mean_t * train.rows + mean_e * ev.rows) / max(1, train.rows + ev.rows)
    return f"{words} (min {min(lo_t, lo_e):.4g}, mean {mean:.4g}, max {max(hi_t, hi_e):.4g})"


def image_shape(width: int) -> tuple[int, ...]:
    """(1, s, s) when a flat example of `width` values is a perfect square s*s, else (width,)."""
    side = math.isqrt(width)
    return (1, side, side) if side > 1 and side * side == width else (width,)


def example_shape(width: int, *, kind: str, from_list: bool) -> tuple[int, ...]:
    """The input shape of examples of `width` values, the one rule of every writer and reader.

    Classification examples from a list column (`features`, `inputs`) of s*s values are
    (1, s, s) images, for the CNN. Everything else stays flat, (width,): feature columns,
    and regression, which only the MLP trains (it flattens its input anyway).
    """
    return image_shape(width) if kind == "classification" and from_list else (width,)


# ---------------------------------------------------------------------------------------
# Checks on open


def task_columns(
    schema: tuple[tuple[str, str], ...], spec: TaskSpec, *, where: Path
) -> tuple[str, ...]:
    """The columns a task reads: (tokens,) or (inputs|features, targets|label|target).

    A regression split must hold one number per row: num_classes 1 and a numeric column.
    """
    columns = _kind_columns(schema, spec.kind, where=where)
    if spec.kind == "regression":
        if spec.num_classes != 1:
            raise ShardError(
                f"{where}: a regression split holds one target per row "
                f"(num_classes 1); its task says num_classes {spec.num_classes}"
            )
        if (typed := dict(schema)[columns[1]]) not in _SCALAR_NUMBERS:
            raise ShardError(
                f"{where}: a regression split's `{columns[1]}` column must hold "
                f"one number per row; it is typed {typed}"
            )
    return columns


def _kind_columns(
    schema: tuple[tuple[str, str], ...], kind: str, *, where: Path
) -> tuple[str, ...]:
    names = [n for n, _ in schema]
    if kind == "lm":
        if "tokens" not in names:
            raise ShardError(
                f"{where}: a language-modelling split needs a `tokens` column, has {names}"
            )
        return ("tokens",)
    inputs = next((c for c in INPUT_COLUMNS if c in names), None)
    targets = next((c for c in TARGET_COLUMNS[kind] if c in names), None)
    if inputs is None or targets is None:
        raise ShardError(
            f"{where}: a {kind} split needs `inputs` (or `features`) and "
            f"`targets` (or `{TARGET_COLUMNS[kind][1]}`) columns, has {names}"
        )
    return inputs, targets


REWRITE = "write the shards again (`scaletrain shard`, or the Spark job) or restore the file"


def open_split(split_dir: Path, *, verify: bool) -> tuple[Manifest, list[pq.FileMetaData]]:
    """A split directory's manifest and the footers of its shards, each checked against it
    (`open_shard`); a part file the manifest does not list is refused too.

    Args:
        split_dir: a directory holding manifest.json.
        verify: also compare each shard's SHA-256 with the manifest's (reads every byte).
    """
    manifest = read_manifest(split_dir)
    metadata = [open_shard(split_dir, s, manifest.schema, verify=verify) for s in manifest.shards]
    listed = {s.file for s in manifest.shards}
    for p in part_files(split_dir):
        if p.name not in listed:
            raise ShardError(
                f"shard {p}: in {split_dir} but not in its manifest; remove it, or "
                f"write the shards again"
            )
    return manifest, metadata


def open_shard(
    split_dir: Path, info: ShardInfo, schema: tuple[tuple[str, str], ...], *, verify: bool
) -> pq.FileMetaData:
    """Check one listed shard against the manifest; return its footer.

    Without `verify` this reads the footer alone: it exists, parses, has the manifest's
    schema, rows, row groups and size, and (where recorded) the footer's SHA-256. A flip
    inside a data page passes that; `verify` hashes every byte to catch it.

    Raises:
        ShardError: naming the shard's path, the problem and the fix.
    """
    path = Path(split_dir) / info.file
    try:
        return _check_shard(path, info, schema, verify=verify)
    except ShardError as e:
        raise ShardError(f"shard {path}: {e}; {REWRITE}") from e.__cause__


def _check_shard(
    path: Path, info: ShardInfo, schema: tuple[tuple[str, str], ...], *, verify: bool
) -> pq.FileMetaData:
    if not path.is_file():
        raise ShardError(f"missing (listed in {path.parent / MANIFEST})")
    md, got = read_footer(path, expected_bytes=info.bytes)
    if got != schema:
        raise ShardError(f"schema {_fmt(got)} differs from the manifest's {_fmt(schema)}")
    if md.num_rows != info.rows:
        raise ShardError(f"{md.num_rows} rows in the file, manifest says {info.rows}")
    if (groups := row_groups(md)) != info.row_groups:
        raise ShardError(
            f"row groups of {list(groups)} rows, manifest says {list(info.row_groups)}"
        )
    if (size := path.stat().st_size) != info.bytes:
        raise ShardError(
            f"{size} bytes, manifest says {info.bytes}: truncated, extended or replaced "
            f"since it was written"
        )
    # A flipped byte in the footer may still parse (a name, a statistic, Arrow's schema):
    # its checksum is one small read more.
    if info.footer_sha256 and (digest := footer_sha256(path)) != info.footer_sha256:
        raise ShardError(
            f"its footer (Parquet's metadata) differs from the one written (sha256 "
            f"{digest[:16]}..., manifest says {info.footer_sha256[:16]}...): the file was "
            f"damaged after it was written"
        )
    if verify and (digest := sha256_file(path)) != info.sha256:
        raise ShardError(
            f"its bytes differ from those written (sha256 {digest[:16]}..., manifest says "
            f"{str(info.sha256)[:16]}...): the file was damaged after it was written"
        )
    return md


def read_footer(
    path: Path, *, expected_bytes: int | None = None
) -> tuple[pq.FileMetaData, tuple[tuple[str, str], ...]]:
    """A Parquet file's footer and its schema as the manifest stores it.

    Raises:
        ShardError: the footer does not parse (the message has no path: callers add it).
    """
    try:
        md = pq.read_metadata(path)
        return md, schema_pairs(md.schema.to_arrow_schema())
    # A damaged footer fails in the Thrift decoder, in Arrow's schema or in a column name's
    # UTF-8, each with its own exception.
    except (OSError, pa.ArrowException, UnicodeDecodeError) as e:
        said = "" if expected_bytes is None else f", manifest says {expected_bytes}"
        raise ShardError(
            f"not a readable Parquet file, truncated or corrupt "
            f"({path.stat().st_size} bytes{said}): {str(e).rstrip('.')}"
        ) from e


def _fmt(schema: tuple[tuple[str, str], ...]) -> str:
    return "(" + ", ".join(f"{n}: {t}" for n, t in schema) + ")"


# ---------------------------------------------------------------------------------------
# Directories without a manifest


def infer_manifest(split_dir: Path) -> tuple[Manifest, list[pq.FileMetaData]]:
    """Describe a directory of part files with no manifest (e.g. Spark's output).

    Parts in name order are the shards; rows come from the footers; the task kind and the
    example shape as in `infer_task`. num_classes: 256 for text (bytes), 1 for regression,
    max label + 1 for classification (reads the label column only). No checksums to compare.

    Args:
        split_dir: a directory of `part-*.parquet`.
    """
    files, metadata, schema = read_footers(split_dir)
    kind, shape, columns = _infer_layout(split_dir, files, metadata, schema)
    if kind == "lm":
        task = TaskSpec("lm", shape, 256)
    elif kind == "regression":
        task = TaskSpec("regression", shape, 1)
    else:
        task = TaskSpec(
            "classification", shape, _num_classes(split_dir, files, metadata, columns[1])
        )
    task_columns(schema, task, where=split_dir)  # a regression target must be one number
    shards = tuple(
        ShardInfo(f.name, md.num_rows, f.stat().st_size, None, row_groups(md))
        for f, md in zip(files, metadata)
    )
    return Manifest(task, schema, shards, split=None, source=str(split_dir), writer=""), metadata


def infer_task(split_dir: Path) -> tuple[str, tuple[int, ...]]:
    """The task kind and example shape of a directory without a manifest, from its footers
    and the first row of one file (no labels read): for checks that need no more.

    `tokens` -> "lm", seq_len = list length - 1; `label` -> "classification" and `target` ->
    "regression" (the file-source columns, as a Spark job would write them; both is
    refused); else `targets` (the writers' name) -> "regression" when it is floating point,
    "classification" when not. The shape follows `example_shape`.
    """
    files, metadata, schema = read_footers(split_dir)
    kind, shape, _ = _infer_layout(split_dir, files, metadata, schema)
    return kind, shape


def read_footers(
    split_dir: Path,
) -> tuple[list[Path], list[pq.FileMetaData], tuple[tuple[str, str], ...]]:
    """The part files of a directory without a manifest, their footers and their one schema
    (a mix is refused): all that can be checked of it without reading rows."""
    files = part_files(split_dir)
    if not files:
        raise ShardError(f"{split_dir}: no {MANIFEST} and no part-*.parquet files")
    metadata, schema = [], None
    for f in files:
        try:
            md, pairs = read_footer(f)
        except ShardError as e:
            raise ShardError(f"shard {f}: {e}; {REWRITE}") from e.__cause__
        if schema is not None and pairs != schema:
            raise ShardError(
                f"shard {f}: schema {_fmt(pairs)} differs from {files[0].name}'s {_fmt(schema)}"
            )
        schema = pairs
        metadata.append(md)
    return files, metadata, schema


def _infer_layout(
    split_dir: Path,
    files: list[Path],
    metadata: list[pq.FileMetaData],
    schema: tuple[tuple[str, str], ...],
) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
    """(task kind, example shape, the columns it reads) from the schema and the first row."""
    types = dict(schema)
    if "tokens" in types:
        kind = "lm"
    elif "label" in types and "target" in types:
        raise ShardError(
            f"{split_dir}: has both a `label` column (classification) and a "
            f"`target` column (regression); write the rows with one of them"
        )
    elif "target" in types or (
        "label" not in types and types.get("targets") in ("halffloat", "float", "double")
    ):
        kind = "regression"
    else:
        kind = "classification"
    columns = _kind_columns(schema, kind, where=split_dir)
    width = _first_row_width(files, metadata, columns[0])
    if kind == "lm":
        if width < 2:
            raise ShardError(f"{split_dir}: `tokens` rows of {width} tokens; need >= 2")
        return kind, (width - 1,), columns
    return kind, example_shape(width, kind=kind, from_list=True), columns


def _num_classes(
    split_dir: Path, files: list[Path], metadata: list[pq.FileMetaData], column: str
) -> int:
    """Max label + 1 over the files (reads the label column only)."""
    top = max(
        (
            pc.max(pq.read_table(f, columns=[column]).column(0)).as_py()
            for f, md in zip(files, metadata)
            if md.num_rows
        ),
        default=None,
    )
    if top is None:
        raise ShardError(f"{split_dir}: no labels found")
    return int(top) + 1


def _first_row_width(files: list[Path], metadata: list[pq.FileMetaData], column: str) -> int:
    """Values in the first row's list: one batch of one row, not the whole row group."""
    for f, md in zip(files, metadata):
        if md.num_rows:
            batch = next(pq.ParquetFile(f).iter_batches(batch_size=1, columns=[column]))
            return len(batch.column(0)[0].as_py() or [])
    raise ShardError(f"{files[0].parent}: every part file is empty")
