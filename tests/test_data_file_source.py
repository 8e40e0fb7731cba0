"""File sources (data/file_source.py) refuse a bad cell by file, row and column, in every
format and wherever the cell is, and a source whose columns name no task (or two: `label`
and `target`); `scaletrain shard` says what it understood (label column, classes, features
or seq_len, rows per split, shards) and shows bad cells as user errors. Regression sources
(a `target` column): tests/test_data_regression.py."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from scaletrain.cli import EXIT_USAGE, main
from scaletrain.data.file_source import SourceError
from scaletrain.data.shard_writer import write_shards

WIDTH = 20


def _rows(n: int) -> list[list[str]]:
    rng = np.random.default_rng(0)
    return [[str(i % 4)] + [f"{v:.4f}" for v in rng.normal(size=WIDTH)] for i in range(n)]


def _write_csv(path, rows: list[list[str]]) -> None:
    header = ["label"] + [f"f{i}" for i in range(WIDTH)]
    path.write_text("\n".join(",".join(r) for r in [header, *rows]) + "\n")


@pytest.mark.parametrize("cell, shown", [("abc", "'abc' is not a number"), ("", "empty")])
def test_a_csv_with_one_bad_cell_is_refused_naming_file_row_and_column(tmp_path, cell, shown):
    rows = _rows(200)
    rows[56][3] = cell  # data row 57, line 58 (the header is line 1), column f2
    _write_csv(tmp_path / "t.csv", rows)
    with pytest.raises(
        SourceError,
        match=rf"t\.csv, row 57 \(line 58\), column `f2`: {shown}; "
        r"every column besides `label` is a feature",
    ):
        write_shards(tmp_path / "t.csv", tmp_path / "out", rows_per_shard=64)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_bad_cell_past_arrows_type_inference_block_is_found(tmp_path):
    rows = _rows(30_000)  # ~3.8 MB: Arrow types the columns from the first 1 MB block
    rows[29_000][20] = "n/a"
    _write_csv(tmp_path / "big.csv", rows)
    with pytest.raises(
        SourceError,
        match=r"big\.csv, row 29001 \(line 29002\), column `f19`: "
        r"'n/a' is not a number",
    ):
        write_shards(tmp_path / "big.csv", tmp_path / "out", rows_per_shard=10_000)


def test_a_bad_label_is_refused_by_row(tmp_path):
    rows = _rows(50)
    rows[9][0] = "cat"
    _write_csv(tmp_path / "t.csv", rows)
    with pytest.raises(
        SourceError,
        match=r"row 10 \(line 11\), column `label`: 'cat' is not an "
        r"integer class id; `label` must hold an integer",
    ):
        write_shards(tmp_path / "t.csv", tmp_path / "out", rows_per_shard=64)


def test_jsonl_and_parquet_feature_columns_must_be_numbers(tmp_path):
    objs = [{"label": i % 2, "a": float(i), "b": 1.0} for i in range(40)]
    objs[12]["b"] = "high"
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(o) + "\n" for o in objs))
    with pytest.raises(
        SourceError,
        match=r"t\.jsonl, row 13 \(line 13\), column `b`: 'high' "
        r"is not a number",
    ):
        write_shards(tmp_path / "t.jsonl", tmp_path / "j", rows_per_shard=64)
    names = pa.array([f"n{i}" for i in range(40)])  # a text column is no feature either
    pq.write_table(
        pa.table({"label": np.arange(40) % 2, "x": np.ones(40), "name": names}),
        tmp_path / "t.parquet",
    )
    with pytest.raises(
        SourceError,
        match=r"t\.parquet, row 1, column `name`: 'n0' is not a "
        r"number",
    ):
        write_shards(tmp_path / "t.parquet", tmp_path / "p", rows_per_shard=64)
    lists = [{"label": 0, "features": [1.0, 2.0]} for _ in range(30)]
    lists[4]["features"] = [1.0, None]
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(o) + "\n" for o in lists))
    with pytest.raises(
        SourceError,
        match=r"l\.jsonl, row 5 \(line 5\), column `features`: "
        r"empty; `features` must hold a list of numbers",
    ):
        write_shards(tmp_path / "l.jsonl", tmp_path / "l", rows_per_shard=64)


def test_files_of_one_source_need_the_same_columns(tmp_path):
    (tmp_path / "src").mkdir()
    _write_csv(tmp_path / "src" / "a.csv", _rows(30))
    (tmp_path / "src" / "b.csv").write_text("label,f0\n1,0.5\n")
    with pytest.raises(SourceError, match=r"b\.csv: columns \['label', 'f0'\] differ"):
        write_shards(tmp_path / "src", tmp_path / "out", rows_per_shard=64)


def test_shard_prints_what_it_understood(tmp_path, capsys):
    _write_csv(tmp_path / "t.csv", _rows(200))
    assert (
        main(["shard", str(tmp_path / "t.csv"), str(tmp_path / "out"), "--rows-per-shard", "100"])
        == 0
    )
    out = capsys.readouterr().out
    assert "label column `label`, 4 classes, 20 features (f0, f1," in out
    assert "rows: 190 train, 10 eval (eval: 1 row in 20 of the source" in out
    assert "seed 0" in out and f"wrote 2 train + 1 eval shards to {tmp_path / 'out'}" in out
    docs = [{"text": f"document {i} " * 5} for i in range(60)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    assert main(["shard", str(tmp_path / "d.jsonl"), str(tmp_path / "lm"), "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "text column `text`, seq_len 16 (rows of 17 tokens)" in out
    assert "rows: " in out and " train, " in out and "1 train + 1 eval shards" in out


def test_shard_shows_a_bad_cell_and_a_missing_class_as_messages(tmp_path, capsys):
    rows = _rows(60)
    rows[3][5] = "x"
    _write_csv(tmp_path / "bad.csv", rows)
    assert main(["shard", str(tmp_path / "bad.csv"), str(tmp_path / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("scaletrain: error: ") and "row 4 (line 5), column `f4`" in err
    rows = _rows(60)
    rows[0][0] = "9"  # class 9 has one row (row 1, which the rule holds out): train lacks it
    _write_csv(tmp_path / "rare.csv", rows)
    assert main(["shard", str(tmp_path / "rare.csv"), str(tmp_path / "rare")]) == 0
    err = capsys.readouterr().err
    assert "scaletrain: warning: " in err and "no rows of 6 class(es)" not in err
    assert "present in eval: 9" in err


def test_label_and_target_together_or_no_task_column_are_refused(tmp_path):
    (tmp_path / "both.csv").write_text("label,target,x\n" + "1,0.5,2\n" * 30)
    with pytest.raises(
        SourceError,
        match=r"both\.csv: has both a `label` column "
        r"\(classification\) and a `target` column "
        r"\(regression\); keep the one to train on and drop "
        r"or rename the other",
    ):
        write_shards(tmp_path / "both.csv", tmp_path / "b", rows_per_shard=64)
    (tmp_path / "both.jsonl").write_text(json.dumps({"label": 1, "target": 0.5, "x": 1}) + "\n")
    with pytest.raises(SourceError, match=r"both\.jsonl: has both a `label`"):
        write_shards(tmp_path / "both.jsonl", tmp_path / "bj", rows_per_shard=64)
    (tmp_path / "none.csv").write_text("x1,x2,y\n" + "1,2,3\n" * 30)
    with pytest.raises(
        SourceError,
        match=r"none\.csv: needs a column that names the task: "
        r"`label` \(classification: integer class ids\), "
        r"`target` \(regression: numbers\) or `text` "
        r"\(language modelling\); columns are \['x1', 'x2', "
        r"'y'\]",
    ):
        write_shards(tmp_path / "none.csv", tmp_path / "n", rows_per_shard=64)
    (tmp_path / "only.csv").write_text("target\n" + "1.5\n" * 30)
    with pytest.raises(
        SourceError,
        match=r"no `features` list column and no columns besides "
        r"`target`",
    ):
        write_shards(tmp_path / "only.csv", tmp_path / "o", rows_per_shard=64)


# --- rows that do not parse and bytes that are not text: named by file and line ---------


@pytest.mark.parametrize(
    "row, count",
    [(["1", "0.5"], 2), (_rows(1)[0] + ["9"], WIDTH + 2)],  # too few values, one too many
)
def test_a_csv_row_with_the_wrong_number_of_values_is_refused_by_line(tmp_path, row, count):
    rows = _rows(40)
    rows[6] = row  # data row 7, line 8
    _write_csv(tmp_path / "t.csv", rows)
    with pytest.raises(SourceError) as caught:
        write_shards(tmp_path / "t.csv", tmp_path / "out", rows_per_shard=64)
    assert str(caught.value) == (
        f"{tmp_path / 't.csv'}, row 7 (line 8): {count} values, but the header (line 1) "
        f"names {WIDTH + 1} columns; every row needs one value per column"
    )


def test_a_short_csv_row_past_arrows_first_block_is_found(tmp_path):
    rows = _rows(20_000)  # ~2.5 MB: past the block Arrow reads first
    rows[18_000] = ["1", "0.5", "0.25"]
    _write_csv(tmp_path / "big.csv", rows)
    with pytest.raises(SourceError, match=r"big\.csv, row 18001 \(line 18002\): 3 values"):
        write_shards(tmp_path / "big.csv", tmp_path / "out", rows_per_shard=10_000)


@pytest.mark.parametrize(
    "name, content, line, offset",
    [
        # A UTF-8 CSV with one cell in Latin-1: line 3, its 4th byte.
        ("t.csv", b"label,a,b\n1,0.5,2\n0,caf\xe9,3\n1,1,1\n", 3, 23),
        ("bin.csv", b"\x80\x81\x82" + bytes(range(256)) * 4, 1, 0),  # not text at all
        ("t.jsonl", b'{"label": 1, "a": 2}\n{"label": 0, "a": "\xff"}\n', 2, 40),
        ("d.jsonl", b'{"text": "ok"}\n{"text": "ok"}\n{"text": "s\xc3("}\n', 3, 41),
        ("d.csv", b"text\nhello\nw\xf6rld\n", 3, 12),  # a text source's cell
    ],
)
def test_a_file_that_is_not_utf8_is_refused_by_line_and_byte(tmp_path, name, content, line, offset):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(SourceError) as caught:
        write_shards(tmp_path / name, tmp_path / "out", rows_per_shard=64)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / name}, line {line} (byte {offset}): "), message
    assert f"byte 0x{content[offset]:02x} is not UTF-8" in message, message
    assert "save the file as UTF-8" in message and "\n" not in message, message


def test_shard_shows_a_short_row_and_a_binary_file_as_one_paragraph(tmp_path, capsys):
    rows = _rows(30)
    rows[2] = ["1", "2"]
    _write_csv(tmp_path / "short.csv", rows)
    (tmp_path / "bin.csv").write_bytes(bytes(range(128, 256)) * 8)
    for name, where in (("short.csv", "row 3 (line 4): 2 values"), ("bin.csv", "line 1 (byte 0)")):
        code = main(["shard", str(tmp_path / name), str(tmp_path / f"out-{name}")])
        err = capsys.readouterr().err
        assert code == EXIT_USAGE and err.count("\n") == 1, err
        assert err.startswith(f"scaletrain: error: {tmp_path / name}, {where}"), err


def test_a_text_column_must_hold_text_and_a_jsonl_line_an_object(tmp_path):
    docs = "text\n" + "".join(f"{i}\n" for i in range(400))  # digits in a CSV are text
    (tmp_path / "n.csv").write_text(docs)
    write_shards(tmp_path / "n.csv", tmp_path / "n", rows_per_shard=64, seq_len=8)
    (tmp_path / "n.jsonl").write_text('{"text": 4}\n{"text": 5}\n')  # JSON says numbers
    with pytest.raises(SourceError, match=r"n\.jsonl, column `text`: typed int64; `text` must"):
        write_shards(tmp_path / "n.jsonl", tmp_path / "j", rows_per_shard=64)
    (tmp_path / "l.jsonl").write_text('{"label": 1, "a": 2}\n[0, 3]\n')
    with pytest.raises(SourceError, match=r"l\.jsonl, line 2: a JSON list; each line of a"):
        write_shards(tmp_path / "l.jsonl", tmp_path / "l", rows_per_shard=64)
