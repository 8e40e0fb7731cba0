"""Write shards with Apache Spark: the job of `shard_writer.write_shards` as a Spark program.

Same sources, same checks (`data/file_source.py`: the column that names the task, `text`,
`label` or `target`, and every cell of a file source, refused by file, row and column),
same split rule (`data/holdout.py`: 1 row in 20 held out at hashed positions, the hash
computed in Spark SQL from the same definition), same rows and the same `manifest.json` as
the pyarrow writer, so `ShardedDataset` reads either; part files keep Spark's names
(`part-00000-<uuid>-c000.snappy.parquet`) and Spark's schema (`list<element: float>`).
Runs in local mode here (`spark_session`); the same code runs on a cluster session.

How the job keeps the order. Rows are numbered in source order (files in name order, then
position in the file) with a distributed exclusive running sum (`_running_sum`): range
partition, per-partition totals to the driver, a window within each partition; no step
moves all rows to one partition. Rows then go to shard `row_id // rows_per_shard` with a
range repartition into ceil(rows / rows_per_shard) partitions, sorted within each, so the
part files in name order hold the rows in order (sizes are exact unless Spark samples the
range bounds of a very large split, then approximate; the manifest records what was
written). Row groups hold `row_group_rows` rows through parquet-java's
`parquet.block.row.count.limit` (`parquet.block.size` alone counts compressed bytes).

Text is packed in Spark without Python workers: documents are numbered with one running
sum, assigned to a split by the hold-out rule, and each document's UTF-8 bytes (plus the
separator, except after the split's last document) get their start offset in its split's
packed stream from a second running sum; each document is cut into the pieces that fall into
windows of seq_len + 1 bytes; pieces are grouped by window, ordered by offset and joined;
the trailing partial window is dropped. Built-in sources are decoded by `load_source`,
written once to a temporary Parquet file and read from there (no per-row Python).

pyspark is an optional dependency (`pip install scaletrain[spark]`), imported on use.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from scaletrain.data.file_source import (
    LABEL,
    TARGET,
    TASK_COLUMNS,
    SourceError,
    cell_error,
    feature_columns,
    source_files,
    task_kind,
)
from scaletrain.data.holdout import block_hash, block_size, eval_count
from scaletrain.data.manifest import Manifest, example_shape, write_manifest
from scaletrain.data.shard_writer import TEXT_SEPARATOR, builtin_table, warn_if_classes_missing
from scaletrain.data.sources import SOURCE_NAMES, SPLITS, TaskSpec

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

_READERS = {"json": "json", "csv": "csv", "parquet": "parquet"}

# JVM options for short jobs on small data (a few MB, a minute): the client compiler only
# (no C2 JIT, which spends more CPU compiling than such a job runs) and the serial
# collector (no parallel GC threads for a 1 GB heap). Half the JVM's CPU time in the tests
# (tests/test_spark.py: 56 s -> 28 s of CPU for three digits jobs); a job over a large
# dataset runs faster without them.
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def spark_session(
    *,
    cores: int = 2,
    driver_memory: str = "1g",
    app_name: str = "scaletrain-shards",
    java_options: str = "",
) -> SparkSession:
    """A local-mode SparkSession (no UI, loopback only), or the one already running.

    Args:
        cores: local[cores] executor threads.
        driver_memory: JVM heap of the driver, which is also the executor in local mode.
        app_name: shown in Spark's logs.
        java_options: extra options of the driver JVM (spark.driver.extraJavaOptions),
            e.g. QUICK_JVM for short jobs on small data. Only a session this call starts
            gets them: the JVM's options are fixed when it starts.
    """
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # else Spark may bind another interface
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers run this interpreter
    try:
        from pyspark.sql import SparkSession
    except ImportError as e:
        raise ImportError(
            "write_shards_spark needs pyspark: pip install 'scaletrain[spark]'"
        ) from e
    spark = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", driver_memory)
        .config("spark.sql.shuffle.partitions", str(2 * cores))
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", java_options)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def write_shards_spark(
    source: str | Path,
    out_dir: Path,
    *,
    rows_per_shard: int,
    seq_len: int = 128,
    row_group_rows: int = 1024,
    synthetic_examples: int = 4096,
    seed: int = 0,
    spark: SparkSession | None = None,
    overwrite: bool = False,
) -> Manifest:
    """Write a source's train and eval splits as Parquet with Spark, then their manifests.

    Args:
        source: a built-in name or a JSONL / CSV / Parquet file or directory, as in
            `write_shards` (same checks and split rule: 1 row in 20 is eval).
        out_dir: gets `train/` and `eval/` (Spark part files + `manifest.json`).
        rows_per_shard: rows per part file (Spark partitions: ceil(rows / rows_per_shard)).
        seq_len: tokens per example for text (rows hold seq_len + 1).
        row_group_rows: rows per Parquet row group (the last of a file may hold fewer).
        synthetic_examples, seed: as in `load_source`, for the synthetic sources.
        spark: a session to use; None starts a local one and stops it at the end.
        overwrite: replace existing split directories instead of refusing.

    Returns the train split's manifest.
    """
    if rows_per_shard < 1 or row_group_rows < 1:
        raise ValueError(
            f"rows_per_shard and row_group_rows must be >= 1, got "
            f"{rows_per_shard}, {row_group_rows}"
        )
    for split in SPLITS:  # refuse before any Spark job runs, as the pyarrow writer does
        if (Path(out_dir) / split).exists() and not overwrite:
            raise FileExistsError(
                f"{Path(out_dir) / split} exists; pass overwrite=True to replace it"
            )
    own = spark is None
    spark = spark_session() if own else spark
    name = str(source)
    from scaletrain.version import __version__

    writer = f"scaletrain {__version__} (pyspark {spark.version})"
    manifests = {}
    try:
        with tempfile.TemporaryDirectory(prefix="scaletrain-spark-") as tmp:
            if name in SOURCE_NAMES:
                splits = _builtin_frames(
                    spark,
                    name,
                    Path(tmp),
                    seq_len=seq_len,
                    synthetic_examples=synthetic_examples,
                    seed=seed,
                )
                columns = (None, ())
            else:
                splits, columns = _file_frames(spark, Path(source), seq_len=seq_len)
            for split, (df, rows, task) in splits.items():
                split_dir = Path(out_dir) / split
                _write_parquet(
                    df,
                    split_dir,
                    rows=rows,
                    rows_per_shard=rows_per_shard,
                    row_group_rows=row_group_rows,
                    overwrite=overwrite,
                )
                manifests[split] = write_manifest(
                    split_dir,
                    task=task,
                    split=split,
                    source=name,
                    writer=writer,
                    label_column=columns[0],
                    feature_columns=columns[1],
                )
    finally:
        if own:
            spark.stop()
    warn_if_classes_missing(manifests, source=name)
    return manifests["train"]


def _builtin_frames(
    spark: SparkSession, name: str, tmp: Path, *, seq_len: int, synthetic_examples: int, seed: int
) -> dict:
    """{split: (DataFrame with row_id, rows, task)} of a built-in source."""
    frames = {}
    for split in SPLITS:
        table, task = builtin_table(
            name, split=split, seq_len=seq_len, synthetic_examples=synthetic_examples, seed=seed
        )
        table = table.append_column("row_id", pa.array(np.arange(table.num_rows, dtype=np.int64)))
        path = tmp / f"{split}.parquet"  # Spark reads this columnar file: no per-row Python
        pq.write_table(table, path, row_group_size=8192, compression="none")
        frames[split] = (spark.read.parquet(str(path)), table.num_rows, task)
    return frames


def _file_frames(
    spark: SparkSession, path: Path, *, seq_len: int
) -> tuple[dict, tuple[str | None, tuple[str, ...]]]:
    """({split: (DataFrame with row_id from 0, rows, task)}, (label or target column, feature
    columns))."""
    from pyspark.sql import functions as F

    files, fmt = source_files(path)
    reader = spark.read.format(_READERS[fmt])
    if fmt == "csv":
        reader = reader.option("header", True).option("inferSchema", True)
    df = reader.load([str(f) for f in files])
    kind = task_kind(df.columns, where=path)  # before any job runs on the rows
    df = df.withColumn("_file", F.input_file_name()).withColumn(
        "_mono", F.monotonically_increasing_id()
    )  # file order first, then position in it
    if kind == "lm":
        return _text_frames(df, seq_len=seq_len), (None, ("text",))
    df, totals = _running_sum(df, ["_file", "_mono"], {"row_id": F.lit(1)})
    n = totals["row_id"]
    task, inputs, targets, features = _examples(df, kind=kind, fmt=fmt, where=path)
    is_eval, local = _holdout_columns(n)
    df = df.withColumn("_eval", is_eval).withColumn("row_id", local)
    frames = {
        split: (
            df.where(F.col("_eval") == (split == "eval")).select(
                "row_id", inputs.alias("inputs"), targets.alias("targets")
            ),
            rows,
            task,
        )
        for split, rows in (("train", n - eval_count(n)), ("eval", eval_count(n)))
    }
    return frames, (TASK_COLUMNS[kind], features)


def _holdout_columns(n: int) -> tuple[Column, Column]:
    """(is this row eval?, its row id within its split) from `row_id`: `holdout`'s rule."""
    from pyspark.sql import functions as F

    k, full = block_size(n), n // block_size(n)
    row, block = F.col("row_id"), F.expr(f"row_id div {k}")
    size = F.when(block < full, F.lit(k)).otherwise(F.lit(n % k))  # the last block may be short
    offset = block_hash(block, xor_shift=lambda x, s: x.bitwiseXOR(F.shiftright(x, s))) % size
    pos = row - block * k
    is_eval = pos == offset
    local = F.when(is_eval, block).otherwise(row - block - F.when(pos > offset, 1).otherwise(0))
    return is_eval, local


def _examples(
    df: DataFrame, *, kind: str, fmt: str, where: Path
) -> tuple[TaskSpec, Column, Column, tuple[str, ...]]:
    """Check every cell in one Spark job; return the task, the inputs and targets columns,
    and the source columns of the inputs. `kind` is "classification" or "regression"."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    fields = {f.name: f.dataType for f in df.schema.fields}
    column = TASK_COLUMNS[kind]
    bad = {column: _bad_targets(kind, fields[column])}
    try:  # the pyarrow writer's rule, on the source's columns
        names = tuple(
            feature_columns([c for c in fields if c not in ("_file", "_mono", "row_id")], fmt)
        )
    except SourceError as e:
        raise SourceError(f"{where}: {e}") from None
    if names == ("features",):
        item = getattr(fields["features"], "elementType", None)
        bad["features"] = (
            F.col("features").isNull() | F.exists("features", lambda x: x.isNull())
            if isinstance(item, T.NumericType)
            else F.lit(True)
        )
        inputs, width_of = F.col("features").cast("array<float>"), F.size("features")
    else:
        for c in names:  # a cell Spark could not type as a number made the column text
            bad[c] = (
                F.col(f"`{c}`").isNull()
                if isinstance(fields[c], T.NumericType)
                else F.expr(f"try_cast(`{c}` as double)").isNull()
            )
        inputs = F.array(*[F.col(f"`{c}`").cast("float") for c in names])
        width_of = F.lit(len(names))
    # try_cast and the raw width: with ANSI SQL a cast of a bad cell would fail this job
    # before the bad cell could be named.
    high = F.expr(f"max(try_cast(`{LABEL}` as bigint))") if kind == "classification" else F.lit(0)
    s = df.agg(
        high, F.min(width_of), F.max(width_of), *[F.count_if(cond) for cond in bad.values()]
    ).first()
    high, width, widest, *bad_counts = s
    for (name, cond), count in zip(bad.items(), bad_counts):
        if count:
            raise _first_bad_cell(df, cond, column=name, fmt=fmt, task_column=column)
    if width != widest:
        raise SourceError(
            f"{where}: `features` rows must all hold the same number of values "
            f"(widths {width}..{widest})"
        )
    shape = example_shape(width, kind=kind, from_list=names == ("features",))
    if kind == "classification":
        return TaskSpec(kind, shape, int(high) + 1), inputs, F.col(LABEL).cast("long"), names
    return TaskSpec(kind, shape, 1), inputs, F.col(TARGET).cast("float"), names


def _bad_targets(kind: str, dtype: object) -> Column:
    """The condition under which a row's `label` (an integer >= 0) or `target` (a finite
    number) cell is bad, for the column's Spark type."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if kind == "classification":
        if isinstance(dtype, T.IntegralType):
            return F.col(LABEL).isNull() | (F.col(LABEL) < 0)
        if not isinstance(dtype, T.StringType):  # decimals never pass
            return F.lit(True)
        # text (a CSV column with a bad cell) may still hold digits
        return F.col(LABEL).isNull() | ~F.col(LABEL).rlike(r"^\s*[0-9]+\s*$")
    if isinstance(dtype, T.NumericType):
        value = F.col(TARGET).cast("double")
    elif isinstance(dtype, T.StringType):  # a CSV column with a bad cell: the others may parse
        value = F.expr(f"try_cast(`{TARGET}` as double)")
    else:  # booleans, arrays, ...
        return F.lit(True)
    return value.isNull() | F.isnan(value) | (F.abs(value) == F.lit(float("inf")))


def _first_bad_cell(
    df: DataFrame, cond: Column, *, column: str, fmt: str, task_column: str
) -> SourceError:
    """The error naming the first row (in source order) where `cond` holds: file, row, column."""
    from urllib.parse import unquote, urlparse

    from pyspark.sql import functions as F

    row = (
        df.where(cond)
        .orderBy("row_id")
        .select("_file", "row_id", F.col(f"`{column}`").cast("string"))
        .first()
    )
    start = df.where(F.col("_file") == row[0]).agg(F.min("row_id")).first()[0]
    return cell_error(
        Path(unquote(urlparse(row[0]).path)),
        fmt,
        row[1] - start,
        column,
        row[2],
        task_column=task_column,
    )


def _running_sum(
    df: DataFrame, order: list[str], values: dict[str, Column]
) -> tuple[DataFrame, dict[str, int]]:
    """Add, for each name, the sum of its value over the rows before each row in `order`.

    Returns the frame and each value's total. Range-partitions by `order`, sends one total
    per partition to the driver, and sums within each partition with a window, so no step
    gathers all rows in one partition. The partitioned frame is checkpointed: its partition
    ids must not change between the job that totals them and the one that uses them.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    parts = df.rdd.getNumPartitions()
    temp = {name: f"_value_{name}" for name in values}
    df = df.select("*", *[v.cast("long").alias(temp[name]) for name, v in values.items()])
    if parts <= 1:  # already one partition: a plain window moves nothing
        before = Window.orderBy(*order).rowsBetween(Window.unboundedPreceding, -1)
        sums = df.agg(*[F.sum(t) for t in temp.values()]).first()
        out = df.select(
            "*",
            *[F.coalesce(F.sum(temp[name]).over(before), F.lit(0)).alias(name) for name in values],
        )
        return out.drop(*temp.values()), {n: sums[i] or 0 for i, n in enumerate(values)}
    ranged = (
        df.repartitionByRange(parts, *order)
        .withColumn("_pid", F.spark_partition_id())
        .localCheckpoint(eager=True)
    )
    per_part = {
        row[0]: row[1:]
        for row in ranged.groupBy("_pid").agg(*[F.sum(t) for t in temp.values()]).collect()
    }
    offsets = np.zeros((parts + 1, len(values)), dtype=np.int64)  # (P + 1, V) exclusive sums
    for pid in range(parts):
        offsets[pid + 1] = offsets[pid] + [v or 0 for v in per_part.get(pid, [0] * len(values))]
    before = Window.partitionBy("_pid").orderBy(*order).rowsBetween(Window.unboundedPreceding, -1)
    columns = []
    for i, name in enumerate(values):
        base = F.element_at(F.array(*[F.lit(int(o)) for o in offsets[:-1, i]]), F.col("_pid") + 1)
        columns.append((base + F.coalesce(F.sum(temp[name]).over(before), F.lit(0))).alias(name))
    out = ranged.select("*", *columns).drop("_pid", *temp.values())
    return out, {name: int(offsets[-1, i]) for i, name in enumerate(values)}


def _text_frames(df: DataFrame, *, seq_len: int) -> dict:
    """{split: (packed windows with row_id, rows, task)} of a file source with `text`.

    One running sum numbers the documents (source order), which the hold-out rule assigns
    to a split; a second places their bytes in their split's stream: each document is
    followed by the separator, so a document starts at the sum of (length + separator) of
    the split's documents before it. That is the joined stream plus one trailing separator,
    which only the dropped partial window can contain.
    """
    from pyspark.sql import functions as F

    text = F.encode(F.coalesce(F.col("text"), F.lit("")), "UTF-8")  # (bytes of one document)
    docs = df.select("_file", "_mono", F.concat(text, F.lit(bytearray(TEXT_SEPARATOR))).alias("b"))
    docs, totals = _running_sum(
        docs.withColumn("len", F.octet_length("b")), ["_file", "_mono"], {"row_id": F.lit(1)}
    )
    is_eval, _ = _holdout_columns(totals["row_id"])
    docs = docs.withColumn("_eval", is_eval)
    docs, totals = _running_sum(
        docs,
        ["_file", "_mono"],
        {
            "start_train": F.when(F.col("_eval"), 0).otherwise(F.col("len")),
            "start_eval": F.when(F.col("_eval"), F.col("len")).otherwise(0),
        },
    )
    task, frames = TaskSpec("lm", (seq_len,), 256), {}
    for split in ("train", "eval"):
        part = docs.where(F.col("_eval") == (split == "eval")).withColumn(
            "start", F.col(f"start_{split}")
        )
        windows, rows = _pack_text(
            part, seq_len=seq_len, split=split, total=totals[f"start_{split}"] - len(TEXT_SEPARATOR)
        )
        frames[split] = (windows, rows, task)
    return frames


def _pack_text(docs: DataFrame, *, seq_len: int, split: str, total: int) -> tuple[DataFrame, int]:
    """Placed documents (b, len, start) -> packed windows (row_id, tokens: array<int>), count.

    `total` is the length of the split's joined stream (without a trailing separator).
    """
    from pyspark.sql import functions as F

    w = seq_len + 1
    windows = total // w
    if windows == 0:
        raise ValueError(f"{split}: {total} bytes of text are too few for one window of {w}")
    # Document bytes [start, start + len) meet windows start div w .. (start + len - 1) div w.
    pieces = (
        docs.where("len > 0")
        .withColumn("w", F.explode(F.expr(f"sequence(start div {w}, (start + len - 1) div {w})")))
        .where(F.col("w") < windows)  # the trailing partial window is dropped
        .withColumn("lo", F.greatest("start", F.col("w") * w))
        .withColumn("hi", F.least(F.col("start") + F.col("len"), (F.col("w") + 1) * w))
        .select(
            "w",
            (F.col("lo") - F.col("w") * w).alias("off"),
            F.expr("substring(b, cast(lo - start + 1 as int), cast(hi - lo as int))").alias(
                "piece"
            ),
        )
    )
    to_ints = (
        "transform(sequence(1, octet_length(piece)), "  # byte i of the piece as an int
        "i -> cast(conv(hex(substring(piece, i, 1)), 16, 10) as int))"
    )
    packed = (
        pieces.select("w", "off", F.expr(to_ints).alias("t"))
        .groupBy("w")
        .agg(
            F.expr("flatten(transform(array_sort(collect_list(struct(off, t))), x -> x.t))").alias(
                "tokens"
            )
        )
    )
    return packed.select(F.col("w").alias("row_id"), "tokens"), windows


def _write_parquet(
    df: DataFrame,
    split_dir: Path,
    *,
    rows: int,
    rows_per_shard: int,
    row_group_rows: int,
    overwrite: bool,
) -> None:
    """Shard i = rows [i * rows_per_shard, (i + 1) * rows_per_shard): one partition, one file."""
    from pyspark.sql import functions as F

    shards = max(1, math.ceil(rows / rows_per_shard))
    out = (
        df.withColumn("_shard", F.floor(F.col("row_id") / rows_per_shard))
        .repartitionByRange(shards, "_shard")
        .sortWithinPartitions("row_id")
        .drop("_shard", "row_id")
    )
    (
        out.write.mode("overwrite" if overwrite else "errorifexists")
        .option("compression", "snappy")
        .option("parquet.block.row.count.limit", str(row_group_rows))
        .parquet(str(split_dir))
    )
