"""Regression data (a numeric `target` column): CSV, JSONL and Parquet sources become
regression shards whose rows read back exactly (float32 inputs and targets, count = values),
split by the hold-out rule like the other kinds; a bad target cell is refused by file, row,
line and column; a Parquet directory without a manifest with a `target` column is read as
regression; a damaged regression shard is refused by name. Elsewhere: `label` with `target`
or no task column (tests/test_data_file_source.py), Spark (tests/test_spark.py), the
pre-launch model check (tests/test_data_preflight.py)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from scaletrain.cli import EXIT_USAGE, main
from scaletrain.data.file_source import SourceError
from scaletrain.data.holdout import HeldOutSplit, eval_mask
from scaletrain.data.manifest import MANIFEST, read_manifest, summary_lines
from scaletrain.data.shard_writer import write_shards
from scaletrain.data.shards import ShardedDataset, ShardError, load_dataset
from scaletrain.data.sources import TaskSpec

N = 200  # 190 train + 10 eval rows


def _all(ds):
    return ds.get(torch.arange(len(ds)))


def _xy(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    """Features and targets that float32 holds exactly (multiples of 1/8), ints among them."""
    i = np.arange(n)
    x = np.stack([i / 8.0, -(i % 7) * 0.5], axis=1)  # (N, 2)
    y = np.where(i % 3 == 0, i // 3, i * 0.125 - 5.0)  # integers in every third row
    return x, y


def _csv(path, x: np.ndarray, y: np.ndarray, *, header: str = "x1,x2,target") -> None:
    def cell(v: float) -> str:  # "3" for an integer-valued cell, as a person writes it
        return str(int(v)) if float(v).is_integer() else repr(float(v))

    cols = header.split(",")
    rows = [
        [cell(x[r, 0]) if c == "x1" else cell(x[r, 1]) if c == "x2" else cell(y[r]) for c in cols]
        for r in range(len(y))
    ]
    path.write_text("\n".join(",".join(r) for r in [cols, *rows]) + "\n")


def test_a_csv_with_a_target_column_becomes_regression_shards_read_back_exactly(tmp_path):
    x, y = _xy()
    _csv(tmp_path / "t.csv", x, y)
    manifest = write_shards(
        tmp_path / "t.csv", tmp_path / "out", rows_per_shard=64, row_group_rows=16
    )
    spec = TaskSpec("regression", (2,), 1)
    assert manifest.task == spec and manifest.shards[0].rows == 64
    data = json.loads((tmp_path / "out" / "train" / MANIFEST).read_text())
    assert data["task"] == {
        "kind": "regression",
        "input_shape": [2],
        "num_classes": 1,
        "ragged": False,
    }
    assert data["schema"] == [["inputs", "list<element: float>"], ["targets", "float"]]
    assert (data["label_column"], data["feature_columns"], data["label_counts"]) == (
        "target",
        ["x1", "x2"],
        None,
    )
    held = eval_mask(N)
    for split, rows in (("train", ~held), ("eval", held)):
        ds = ShardedDataset(tmp_path / "out" / split)
        assert ds.spec == spec and len(ds) == rows.sum() == {"train": 190, "eval": 10}[split]
        got = _all(ds)
        assert got.inputs.dtype == got.targets.dtype == torch.float32
        assert got.inputs.shape == (len(ds), 2) and got.targets.shape == (len(ds),)
        assert torch.equal(got.inputs, torch.from_numpy(x[rows].astype(np.float32)))
        assert torch.equal(got.targets, torch.from_numpy(y[rows].astype(np.float32)))
        assert (got.count, got.tokens) == (len(ds), 0)  # MSE over every target value
        idx = torch.tensor([len(ds) - 1, 0, len(ds) // 2, 0])  # any order, repeats, shards
        some = ds.get(idx)
        assert torch.equal(some.targets, got.targets[idx]) and some.count == 4
        stats = read_manifest(tmp_path / "out" / split).target_stats
        assert stats == pytest.approx((y[rows].min(), y[rows].mean(), y[rows].max()))


def test_the_target_may_be_any_column_and_the_features_keep_file_order(tmp_path):
    x, y = _xy(40)
    _csv(tmp_path / "t.csv", x, y, header="x2,target,x1")
    write_shards(tmp_path / "t.csv", tmp_path / "out", rows_per_shard=64)
    train = ShardedDataset(tmp_path / "out" / "train")
    assert train.manifest.feature_columns == ("x2", "x1")
    assert torch.equal(
        _all(train).inputs, torch.from_numpy(x[~eval_mask(40)][:, ::-1].copy().astype(np.float32))
    )


def test_jsonl_and_parquet_regression_sources(tmp_path):
    x, y = _xy(60)
    held = eval_mask(60)
    with open(tmp_path / "t.jsonl", "w") as f:  # keys in any order: features by name (a, b)
        f.writelines(
            json.dumps(
                {
                    "target": int(y[i]) if float(y[i]).is_integer() else y[i],
                    "b": x[i, 1],
                    "a": x[i, 0],
                }
            )
            + "\n"
            for i in range(60)
        )
    write_shards(tmp_path / "t.jsonl", tmp_path / "j", rows_per_shard=100)
    train = ShardedDataset(tmp_path / "j" / "train")
    assert train.spec == TaskSpec("regression", (2,), 1)
    assert train.manifest.feature_columns == ("a", "b")
    assert torch.equal(_all(train).inputs, torch.from_numpy(x[~held].astype(np.float32)))
    assert torch.equal(_all(train).targets, torch.from_numpy(y[~held].astype(np.float32)))
    # Parquet with a `features` list of 4 (a perfect square): regression stays flat, (4,).
    features = np.repeat(x[:, :1], 4, axis=1) + np.arange(4)  # (60, 4)
    pq.write_table(
        pa.table({"features": features.tolist(), "target": pa.array(np.arange(60), pa.int32())}),
        tmp_path / "t.parquet",
    )
    write_shards(tmp_path / "t.parquet", tmp_path / "p", rows_per_shard=100)
    ev = ShardedDataset(tmp_path / "p" / "eval")
    assert ev.spec == TaskSpec("regression", (4,), 1)
    assert torch.equal(_all(ev).inputs, torch.from_numpy(features[held].astype(np.float32)))
    assert torch.equal(_all(ev).targets, torch.from_numpy(np.flatnonzero(held).astype(np.float32)))


@pytest.mark.parametrize(
    "cell, shown",
    [
        ("abc", "'abc' is not a number"),
        ("", "empty"),
        ("NaN", "'NaN' is not finite"),
        ("inf", "'inf' is not finite"),
    ],
)
def test_a_bad_target_cell_in_a_csv_is_refused_naming_file_row_line_and_column(
    tmp_path, cell, shown
):
    x, y = _xy()
    _csv(tmp_path / "t.csv", x, y)
    lines = (tmp_path / "t.csv").read_text().splitlines()
    lines[57] = f"1.5,2,{cell}"  # line 58 = data row 57 (the header is line 1)
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(
        SourceError,
        match=rf"t\.csv, row 57 \(line 58\), column `target`: "
        rf"{shown}; `target` must hold a finite number "
        rf"\(integer or decimal\) in every row",
    ):
        write_shards(tmp_path / "t.csv", tmp_path / "out", rows_per_shard=64)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_bad_target_past_arrows_type_inference_block_is_found(tmp_path):
    n = 60_000  # ~1.4 MB: Arrow types the columns from the first 1 MB block
    lines = ["x1,x2,target"] + [f"{i % 97 * 0.25},{i % 13},{i * 0.5}" for i in range(n)]
    lines[59_001] = "1,2,n/a"  # data row 59001
    (tmp_path / "big.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(
        SourceError,
        match=r"big\.csv, row 59001 \(line 59002\), column "
        r"`target`: 'n/a' is not a number",
    ):
        write_shards(tmp_path / "big.csv", tmp_path / "out", rows_per_shard=100_000)


def test_a_bad_target_in_jsonl_or_parquet_is_refused_by_row(tmp_path):
    objs = [{"a": float(i), "target": i * 0.5} for i in range(40)]
    for k, (bad, shown) in enumerate(
        [
            (float("nan"), "nan is not finite"),
            ("abc", "'abc' is not a number"),
            (None, "empty"),
            (True, "True is not a number"),
        ]
    ):
        rows = [dict(o) for o in objs]
        rows[12]["target"] = bad  # json.dumps writes NaN, which Arrow reads as a float
        (tmp_path / f"{k}.jsonl").write_text("".join(json.dumps(o) + "\n" for o in rows))
        with pytest.raises(
            SourceError,
            match=rf"{k}\.jsonl, row 13 \(line 13\), column "
            rf"`target`: {shown};",
        ):
            write_shards(tmp_path / f"{k}.jsonl", tmp_path / f"j{k}", rows_per_shard=64)
    target = np.arange(40, dtype=np.float64)
    target[30] = -np.inf
    pq.write_table(pa.table({"a": np.ones(40), "target": target}), tmp_path / "t.parquet")
    with pytest.raises(
        SourceError,
        match=r"t\.parquet, row 31, column `target`: -inf is not "
        r"finite",
    ):
        write_shards(tmp_path / "t.parquet", tmp_path / "p", rows_per_shard=64)


def test_a_bad_feature_cell_names_target_as_the_task_column(tmp_path):
    x, y = _xy(50)
    _csv(tmp_path / "t.csv", x, y)
    lines = (tmp_path / "t.csv").read_text().splitlines()
    lines[5] = "oops,1,2"
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(
        SourceError,
        match=r"row 5 \(line 6\), column `x1`: 'oops' is not a "
        r"number; every column besides `target` is a feature",
    ):
        write_shards(tmp_path / "t.csv", tmp_path / "out", rows_per_shard=64)


def test_shard_prints_the_target_and_refuses_a_bad_cell_as_a_message(tmp_path, capsys):
    x, y = _xy()
    _csv(tmp_path / "t.csv", x, y)
    assert (
        main(["shard", str(tmp_path / "t.csv"), str(tmp_path / "out"), "--rows-per-shard", "100"])
        == 0
    )
    out = capsys.readouterr().out
    assert (
        f"source {tmp_path / 't.csv'}: target column `target` (min {y.min():.4g}, mean "
        f"{y.mean():.4g}, max {y.max():.4g}), 2 features (x1, x2)"
    ) in out
    assert "rows: 190 train, 10 eval (eval: 1 row in 20" in out
    lines = (tmp_path / "t.csv").read_text().splitlines()
    lines[3] = "1,2,NaN"
    (tmp_path / "bad.csv").write_text("\n".join(lines) + "\n")
    assert main(["shard", str(tmp_path / "bad.csv"), str(tmp_path / "bad")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("scaletrain: error: ") and "row 3 (line 4), column `target`" in err


def _part_dir(
    path, columns: dict[str, pa.Array], parts: int = 2, row_group_rows: int = 1024
) -> None:
    """A directory shaped like a plain Spark write: part files and _SUCCESS, no manifest."""
    path.mkdir()
    (path / "_SUCCESS").write_bytes(b"")
    table = pa.table(columns)
    for k, rows in enumerate(np.array_split(np.arange(table.num_rows), parts)):
        pq.write_table(
            table.take(rows),
            path / f"part-{k:05d}-0a1b-c000.snappy.parquet",
            row_group_size=row_group_rows,
        )


def test_a_parquet_directory_without_manifest_with_a_target_is_regression(tmp_path):
    ids = np.arange(400)
    features = pa.array(
        np.stack([ids, -ids], 1).astype(np.float32).tolist(),
        pa.list_(pa.field("element", pa.float32())),
    )
    _part_dir(tmp_path / "d", {"features": features, "target": pa.array(ids * 0.25)})
    ds = ShardedDataset(tmp_path / "d")
    assert ds.spec == TaskSpec("regression", (2,), 1)  # 2 values: not an image either way
    got = _all(ds)
    assert torch.equal(got.targets, torch.from_numpy((ids * 0.25).astype(np.float32)))
    assert got.targets.dtype == torch.float32 and got.count == 400
    with pytest.warns(UserWarning, match="no scaletrain manifest"):
        ev = load_dataset(tmp_path / "d", "eval")
    assert isinstance(ev, HeldOutSplit) and len(ev) == 20
    assert torch.equal(
        _all(ev).inputs[:, 0], torch.from_numpy(np.flatnonzero(eval_mask(400)).astype(np.float32))
    )
    # The writers' own column name: float `targets` is regression, integer classification.
    _part_dir(tmp_path / "f", {"inputs": features, "targets": pa.array(ids * 0.5, pa.float32())})
    assert ShardedDataset(tmp_path / "f").spec == TaskSpec("regression", (2,), 1)
    _part_dir(tmp_path / "i", {"inputs": features, "targets": pa.array(ids % 3)})
    assert ShardedDataset(tmp_path / "i").spec == TaskSpec("classification", (2,), 3)
    _part_dir(
        tmp_path / "both",
        {"features": features, "label": pa.array(ids % 3), "target": pa.array(ids * 1.0)},
    )
    with pytest.raises(ShardError, match="has both a `label` column .* and a `target` column"):
        ShardedDataset(tmp_path / "both")
    lists = pa.array([[1.0, 2.0]] * 400)
    _part_dir(tmp_path / "l", {"features": features, "target": lists})
    with pytest.raises(
        ShardError,
        match=r"regression split's `target` column must hold one "
        r"number per row; it is typed list<element: double>",
    ):
        ShardedDataset(tmp_path / "l")


def test_a_non_finite_target_in_a_shard_is_refused_by_name(tmp_path):
    target = np.arange(100, dtype=np.float32)
    target[70] = np.nan  # a hand-made directory: no writer would let this through
    _part_dir(
        tmp_path / "d",
        {"features": pa.array([[1.0]] * 100), "target": target},
        parts=1,
        row_group_rows=50,
    )
    ds = ShardedDataset(tmp_path / "d")
    assert len(ds.get(torch.arange(10)).targets) == 10  # row groups are read when asked for
    with pytest.raises(
        ShardError,
        match=r"part-00000-0a1b-c000\.snappy\.parquet row group 1: "
        r"target nan \(row 20 of the row group\) is not finite",
    ):
        ds.get(torch.tensor([70]))


def test_a_regression_manifest_must_say_one_target_per_row(tmp_path):
    x, y = _xy(40)
    _csv(tmp_path / "t.csv", x, y)
    write_shards(tmp_path / "t.csv", tmp_path / "out", rows_per_shard=64)
    path = tmp_path / "out" / "train" / MANIFEST
    data = json.loads(path.read_text())
    data["task"]["num_classes"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(
        ShardError,
        match=r"holds one target per row \(num_classes 1\); its "
        r"task says num_classes 3",
    ):
        ShardedDataset(tmp_path / "out" / "train")


def test_summary_lines_of_a_regression_set(tmp_path):
    x, y = _xy()
    _csv(tmp_path / "t.csv", x, y)
    train = write_shards(tmp_path / "t.csv", tmp_path / "out", rows_per_shard=500)
    ev = read_manifest(tmp_path / "out" / "eval")
    lines = summary_lines(train, ev, out_dir=tmp_path / "out")
    assert lines[0] == (
        f"source {tmp_path / 't.csv'}: target column `target` (min -4.875, "
        f"mean {y.mean():.4g}, max {y.max():.4g}), 2 features (x1, x2)"
    )
    assert "classes" not in lines[0]
