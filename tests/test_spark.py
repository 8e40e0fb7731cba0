"""Apache Spark in local mode writes Parquet that `ShardedDataset` reads: the Spark writer
(`write_shards_spark`) gives the same rows as the in-memory source and as the pyarrow
writer (the same hold-out split, computed in Spark SQL) and refuses the same bad cells, and a
plain `df.write.parquet` of array<float> features is read with no manifest, its eval split
held out of its rows. One SparkSession (~5 s to start) serves the module."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from scaletrain.data.file_source import SourceError
from scaletrain.data.holdout import HeldOutSplit
from scaletrain.data.shard_writer import write_shards
from scaletrain.data.shards import ShardedDataset, load_dataset
from scaletrain.data.sources import TaskSpec, load_source
from scaletrain.data.spark import QUICK_JVM, spark_session, write_shards_spark
from scaletrain.models import build_model

from harness import load_weights, run_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark():
    session = spark_session(cores=2, driver_memory="1g", java_options=QUICK_JVM)
    yield session
    session.stop()


def _all(ds: ShardedDataset):
    return ds.get(torch.arange(len(ds)))


def test_spark_writer_equals_the_source(spark, tmp_path):
    manifest = write_shards_spark(
        "digits", tmp_path, rows_per_shard=500, row_group_rows=128, spark=spark
    )
    assert [s.rows for s in manifest.shards] == [500, 500, 438]  # ceil(1438 / 500) partitions
    assert all(
        s.file.startswith("part-") and s.file.endswith(".snappy.parquet") for s in manifest.shards
    )  # Spark's own part names are kept
    assert all(max(s.row_groups) == 128 for s in manifest.shards)  # row_group_rows honoured
    assert (tmp_path / "train" / "_SUCCESS").exists()
    for split in ("train", "eval"):
        ds, ref = ShardedDataset(tmp_path / split, verify=True), load_source("digits", split=split)
        assert ds.spec == ref.spec and ds.manifest.schema[0] == ("inputs", "list<element: float>")
        got = _all(ds)
        assert torch.equal(got.inputs, ref.inputs) and torch.equal(got.targets, ref.targets)


def test_spark_writer_packs_text_and_splits_files_like_the_pyarrow_writer(spark, tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "docs").mkdir()
    for part in range(2):  # a directory: files in name order, each in order
        with open(tmp_path / "docs" / f"{part}.jsonl", "w") as f:  # UTF-8 straddles windows
            f.writelines(
                json.dumps({"text": f"doc {part}.{i} é \u4e2d " + "xy" * int(rng.integers(0, 60))})
                + "\n"
                for i in range(60)
            )
    with open(tmp_path / "rows.csv", "w") as f:  # sorted by label: eval still gets every class
        f.write("p1,label,p0\n")
        f.writelines(f"{float(i) / 8!r},{i // 40},{-float(i)!r}\n" for i in range(200))
    # Small input splits: several partitions per file, so the distributed numbering and
    # running sums (not the one-partition shortcut) must put rows back in file order.
    spark.conf.set("spark.sql.files.maxPartitionBytes", "2048")
    spark.conf.set("spark.sql.files.openCostInBytes", "1024")
    try:
        _compare_writers(spark, tmp_path)
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
        spark.conf.unset("spark.sql.files.openCostInBytes")
    assert load_dataset(tmp_path / "spark-rows.csv", "eval").spec == TaskSpec(
        "classification", (2,), 5
    )
    ev = load_dataset(tmp_path / "spark-rows.csv", "eval")
    assert len(ev) == 10 and set(ev.get(torch.arange(10)).targets.tolist()) == set(range(5))


@pytest.mark.parametrize("cell, shown", [("abc", "'abc' is not a number"), ("", "empty")])
def test_spark_writer_refuses_a_bad_cell_like_the_pyarrow_writer(spark, tmp_path, cell, shown):
    lines = ["label,a,b"] + [f"{i % 3},{i * 0.5},{-i}" for i in range(120)]
    lines[75] = f"1,{cell},3"  # data row 75, line 76
    (tmp_path / "bad.csv").write_text("\n".join(lines) + "\n")
    messages = []
    for write in (write_shards, lambda *a, **k: write_shards_spark(*a, spark=spark, **k)):
        with pytest.raises(SourceError) as caught:
            write(tmp_path / "bad.csv", tmp_path / f"out{len(messages)}", rows_per_shard=50)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert f"bad.csv, row 75 (line 76), column `a`: {shown};" in messages[0]


def test_spark_writer_writes_regression_like_the_pyarrow_writer(spark, tmp_path):
    lines = ["a,target,b"] + [
        f"{i * 0.25!r},{i // 4 if i % 4 == 0 else i * 0.375 - 9!r},{i % 7}" for i in range(120)
    ]  # integer and decimal targets
    (tmp_path / "r.csv").write_text("\n".join(lines) + "\n")
    write_shards_spark(tmp_path / "r.csv", tmp_path / "spark", rows_per_shard=50, spark=spark)
    write_shards(tmp_path / "r.csv", tmp_path / "arrow", rows_per_shard=50)
    for split in ("train", "eval"):
        a, b = (ShardedDataset(tmp_path / w / split) for w in ("spark", "arrow"))
        assert a.spec == b.spec == TaskSpec("regression", (2,), 1)
        assert a.shard_rows == b.shard_rows and a.manifest.schema[1] == ("targets", "float")
        x, y = _all(a), _all(b)
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
        assert x.targets.dtype == torch.float32 and x.count == y.count == len(a)
        assert a.manifest.target_stats == pytest.approx(b.manifest.target_stats)
        assert (a.manifest.label_column, a.manifest.feature_columns) == ("target", ("a", "b"))
    lines[76] = "1.5,NaN,3"  # data row 76, line 77: Spark reads NaN as a double
    (tmp_path / "bad.csv").write_text("\n".join(lines) + "\n")
    messages = []
    for write in (write_shards, lambda *a, **k: write_shards_spark(*a, spark=spark, **k)):
        with pytest.raises(SourceError) as caught:
            write(tmp_path / "bad.csv", tmp_path / f"bad{len(messages)}", rows_per_shard=50)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert "bad.csv, row 76 (line 77), column `target`: 'NaN' is not finite;" in messages[0]
    # A plain Spark job's `target` column, no manifest: read as regression.
    spark.createDataFrame(
        [(i * 0.5, [float(i), 1.0]) for i in range(50)], "target double, features array<float>"
    ).write.parquet(str(tmp_path / "plain"))
    plain = ShardedDataset(tmp_path / "plain")
    assert plain.spec == TaskSpec("regression", (2,), 1)
    assert torch.equal(_all(plain).targets, torch.arange(50) * 0.5)


def _compare_writers(spark, tmp_path) -> None:
    for source, seq_len in (("docs", 24), ("rows.csv", 8)):
        assert spark.read.text(str(tmp_path / source)).rdd.getNumPartitions() > 1
        write_shards_spark(
            tmp_path / source,
            tmp_path / f"spark-{source}",
            rows_per_shard=20,
            seq_len=seq_len,
            spark=spark,
        )
        write_shards(
            tmp_path / source, tmp_path / f"arrow-{source}", rows_per_shard=20, seq_len=seq_len
        )
        for split in ("train", "eval"):
            a = load_dataset(tmp_path / f"spark-{source}", split)
            b = load_dataset(tmp_path / f"arrow-{source}", split)
            assert a.spec == b.spec and a.shard_rows == b.shard_rows
            x, y = _all(a), _all(b)
            assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)


def test_plain_spark_parquet_of_array_features_is_read_without_manifest(spark, tmp_path):
    digits = load_source("digits", split="train")
    x, y = digits.inputs.flatten(1), digits.targets
    rows = [
        (int(label), [float(v) for v in features])
        for label, features in zip(y.tolist(), x.tolist())
    ]
    df = spark.createDataFrame(rows, "label long, features array<float>")
    df.write.parquet(str(tmp_path / "plain"))
    ds = ShardedDataset(tmp_path / "plain")
    assert ds.spec == TaskSpec("classification", (1, 8, 8), 10)  # 64 = 8 x 8, max label + 1
    assert ds.manifest.schema == (("label", "int64"), ("features", "list<element: float>"))
    assert sum(ds.shard_rows) == len(digits) and len(ds.shard_rows) == 2  # local[2]
    got = _all(ds)  # parallelize slices the list in order: part files hold it in order
    assert torch.equal(got.inputs, digits.inputs) and torch.equal(got.targets, y)


def test_training_runs_directly_on_a_plain_spark_directory(spark, tmp_path):
    """`data.source = "shards"` on what Spark wrote (part files, _SUCCESS, .crc), 2 ranks."""
    digits = load_source("digits", split="train")
    rows = [
        (int(label), [float(v) for v in features])
        for label, features in zip(digits.targets.tolist(), digits.inputs.flatten(1).tolist())
    ]
    spark.createDataFrame(rows, "label long, features array<float>").write.parquet(
        str(tmp_path / "spark")
    )
    assert (tmp_path / "spark" / "_SUCCESS").exists()
    config = tmp_path / "cfg.toml"
    config.write_text(f"""
[model]
name = "mlp"
size = "small"
[data]
source = "shards"
path = "{tmp_path / "spark"}"
[optim]
lr = 3e-3
[train]
steps = 40
global_batch = 64
micro_batch = 32
eval_examples = 256
[log]
every = 10
quiet = true
""")
    run_dir = tmp_path / "run"
    run_workers(config, ["parallel.dp=2"], world_size=2, run_dir=run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert train[-1]["loss"] < 0.5 * train[0]["loss"]
    # The eval split is held out of the directory's rows: disjoint from what trained.
    with pytest.warns(UserWarning, match="no scaletrain manifest"):
        seen, held = (load_dataset(tmp_path / "spark", split) for split in ("train", "eval"))
    assert isinstance(held, HeldOutSplit) and (len(seen), len(held)) == (1366, 72)
    ids = {ds.split: set(ds.global_ids(torch.arange(len(ds))).tolist()) for ds in (seen, held)}
    assert not ids["train"] & ids["eval"] and len(ids["train"] | ids["eval"]) == len(digits)
    # The accuracy the run reports is the final model's on exactly those held-out rows.
    model = build_model("mlp", size="small", task=held.spec)
    model.load_state_dict(load_weights(run_dir))
    batch = held.get(torch.arange(len(held)))
    with torch.no_grad():
        accuracy = float((model.eval()(batch.inputs).argmax(-1) == batch.targets).float().mean())
    reported = json.loads((run_dir / "summary.json").read_text())["eval"]["accuracy"]
    assert reported == pytest.approx(accuracy, abs=1e-6) and reported > 0.8
