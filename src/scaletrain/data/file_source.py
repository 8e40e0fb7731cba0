"""File sources: JSONL / CSV / Parquet files read into one checked Arrow table.

A file source is a file or a directory of files of one format, read in name order. One
column names the task (`task_kind`): `text` makes a language-modelling set (no other column
is read); otherwise a `label` column of integer class ids >= 0 makes a classification set,
and a `target` column of numbers (integers or decimals, every one finite) a regression set
with one target per row; a source with both is refused. The inputs of both are a `features`
list column of numbers (then no other column is read) or else every other column as one
feature each, in file order (for JSON, whose objects have no column order, by name).

Every cell is checked before any row is written, per file, so an error names the file, the
row and the column: a CSV cell that is not a number would otherwise make Arrow type the
whole column as text, a column that silently stopped being a feature would train a model
on 19 features of 20 without a word, and one NaN target makes every later loss NaN. Rows
are counted from 1 (the first data row), with the line for CSV (the header is line 1) and
JSONL. A CSV whose bad cell lies past the block Arrow infers types from fails in the
reader; it is read again as text to find the cell. Arrow's own messages name neither file
nor line, so whatever it refuses is looked at again as written: a CSV row with more or
fewer values than the header, or a JSONL line that is not an object, is named by its line,
and bytes that are not UTF-8 (a binary file, a Latin-1 export) by line and byte offset.
`data/spark.py` applies the same rules in Spark, with the helpers defined here
(`task_kind`, `feature_columns`, `cell_error`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from scaletrain.data.sources import SOURCE_NAMES
from scaletrain.errors import UserError

FILE_FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}
LABEL, TARGET, TEXT = "label", "target", "text"  # the columns that name the task
TASK_COLUMNS = {"classification": LABEL, "regression": TARGET}  # kind -> the column of targets


class SourceError(UserError):
    """A file source's cell or column is not what the task needs; names file, row, column."""


def source_files(path: Path) -> tuple[list[Path], str]:
    """The data files of a file source in name order, and their one format (json/csv/parquet)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(
            p
            for p in path.iterdir()
            if p.is_file() and p.suffix in FILE_FORMATS and not p.name.startswith(("_", "."))
        )
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(
            f"data source {str(path)!r} is neither a built-in name "
            f"({', '.join(SOURCE_NAMES)}) nor an existing file or directory"
        )
    formats = {FILE_FORMATS.get(p.suffix) for p in files}
    if not files or None in formats:
        raise ValueError(f"{path}: expected .jsonl/.json, .csv or .parquet files")
    if len(formats) > 1:
        raise ValueError(f"{path}: mixes formats {sorted(formats)}; use one format per source")
    return files, formats.pop()


def place(file: Path, fmt: str, row: int) -> str:
    """Where 0-based data row `row` of `file` is, for people: row from 1, and the line."""
    line = {"csv": row + 2, "json": row + 1}.get(fmt)  # CSV: the header is line 1
    return f"{file}, row {row + 1}" + (f" (line {line})" if line else "")


def read_files(path: Path) -> tuple[pa.Table, str]:
    """Read and check a file source: one Arrow table (files concatenated in name order)."""
    files, fmt = source_files(path)
    tables = []
    for f in files:
        table = _read_checked(f, fmt)
        if tables and set(table.schema.names) != set(tables[0].schema.names):
            raise SourceError(
                f"{f}: columns {table.schema.names} differ from {files[0]}'s "
                f"{tables[0].schema.names}; every file of a source needs the "
                f"same columns"
            )
        tables.append(table)
    width = {_list_width(t) for t in tables} - {None}
    if len(width) > 1:
        raise SourceError(
            f"{path}: `features` lists hold {sorted(width)} values in different "
            f"files; every row needs the same number"
        )
    return pa.concat_tables(tables, promote_options="permissive"), fmt


def _read_checked(file: Path, fmt: str) -> pa.Table:
    """Read one file and check its cells; a failure is found again by line, row and column."""
    import pyarrow.csv
    import pyarrow.json

    try:
        if fmt == "csv":  # a text cell of digits is text all the same
            text = pyarrow.csv.ConvertOptions(column_types={TEXT: pa.string()})
            table = pyarrow.csv.read_csv(str(file), convert_options=text)
        else:
            table = pyarrow.json.read_json(str(file)) if fmt == "json" else pq.read_table(file)
    except (pa.ArrowInvalid, UnicodeDecodeError) as e:
        # Arrow could not split a line into values or convert a cell (for CSV: one past the
        # block the types were inferred from), or a column name is not UTF-8. Its message
        # says neither file nor line: look at the bytes and cells as written, which raises
        # naming them.
        if fmt == "csv":
            _check_csv_as_text(file)
        elif fmt == "json":
            _check_json_rows(file)
        raise SourceError(f"{file}: not readable as {fmt}: {e}") from None
    except (OSError, pa.ArrowException) as e:
        raise SourceError(f"{file}: not readable as {fmt}: {e}") from None
    try:  # Arrow's JSON reader keeps a string that is not UTF-8 as it found it
        table.validate(full=True)
    except pa.ArrowInvalid as e:
        if fmt != "parquet":
            check_utf8(file, fmt)
        raise SourceError(f"{file}: not readable as {fmt}: {e}") from None
    kind = task_kind(table.schema.names, where=file)
    if kind == "lm":
        _check_text_column(table, file=file)
    else:
        try:
            check_examples(table, kind=kind, file=file, fmt=fmt)
        except SourceError:
            if fmt == "csv":  # a cell may have become null ("", "n/a", "NaN"): show it as written
                _check_csv_as_text(file)
            raise
    return table


def _check_csv_as_text(file: Path) -> None:
    """Check a CSV file's bytes, rows and cells as the text they are (the error path: Arrow
    refused one)."""
    import pyarrow.csv

    check_utf8(file, "csv")
    header = _check_csv_rows(file)
    if (kind := task_kind(header, where=file)) == "lm":
        return
    options = pyarrow.csv.ConvertOptions(
        column_types={n: pa.string() for n in header}, null_values=[], strings_can_be_null=False
    )
    check_examples(
        pyarrow.csv.read_csv(str(file), convert_options=options), kind=kind, file=file, fmt="csv"
    )


def _check_json_rows(file: Path) -> None:
    """Check a JSONL file row by row in Python (the error path: Arrow refused it)."""
    check_utf8(file, "json")
    rows = []
    with open(file, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SourceError(f"{file}, line {line_no}: not valid JSON: {e}") from None
                if not isinstance(rows[-1], dict):
                    raise SourceError(
                        f"{file}, line {line_no}: a JSON {type(rows[-1]).__name__}; each line "
                        f"of a JSONL source is one object of named values"
                    )
    names = list(dict.fromkeys(k for row in rows for k in row))
    if TEXT in names or not {LABEL, TARGET} & set(names):
        return  # no cell of a task column to name: Arrow's own error says what it could not read
    column = TASK_COLUMNS[task_kind(names, where=file)]
    columns = {n: [row.get(n) for row in rows] for n in names}
    _check_task_values(columns[column], column=column, file=file, fmt="json")
    for name in feature_columns(names, "json"):
        _check_values(columns[name], name=name, file=file, fmt="json", task_column=column)


def check_utf8(file: Path, fmt: str) -> None:
    """Refuse a file that is not UTF-8 text, naming the line and byte offset of the first
    byte that is not. Read in blocks: a binary file may have no line ends at all."""
    start, line, carry = 0, 1, b""  # file offset and line of `data[0]`; a cut character
    with open(file, "rb") as f:
        while block := f.read(1 << 20):
            data = carry + block
            try:
                data.decode("utf-8")
                carry = b""
            except UnicodeDecodeError as e:
                if e.reason != "unexpected end of data" or e.end != len(data):
                    raise _not_utf8(file, fmt, data, e.start, start=start, line=line) from None
                data, carry = data[: e.start], data[e.start :]  # a character cut by the block
            line += data.count(b"\n")
            start += len(data)
    if carry:  # the file ends inside a character
        raise _not_utf8(file, fmt, carry, 0, start=start, line=line)


def _not_utf8(file: Path, fmt: str, data: bytes, at: int, *, start: int, line: int) -> SourceError:
    """The error for the byte `data[at]`, where `data` begins at byte `start`, line `line`."""
    line += data.count(b"\n", 0, at)
    return SourceError(
        f"{file}, line {line} (byte {start + at}): byte "
        f"0x{data[at]:02x} is not UTF-8 text; a {fmt.upper()} source must be UTF-8: save "
        f"the file as UTF-8, or check it is the data file meant (not a binary file)"
    )


def _check_csv_rows(file: Path) -> list[str]:
    """The first CSV row whose number of values differs from the header's, by row and line
    (empty lines are skipped, as Arrow skips them); returns the header."""
    import csv

    with open(file, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header, row = next(reader, []), 0
        while True:
            line = reader.line_num + 1  # a quoted value may span lines: the row's first
            try:
                values = next(reader, None)
            except csv.Error as e:
                raise SourceError(f"{file}, line {line}: not readable as CSV: {e}") from None
            if values is None:
                return header
            if values and len(values) != len(header):
                raise SourceError(
                    f"{file}, row {row + 1} (line {line}): {len(values)} values, but the "
                    f"header (line 1) names {len(header)} columns; every row needs one "
                    f"value per column"
                )
            row += bool(values)


def _check_text_column(table: pa.Table, *, file: Path) -> None:
    """A `text` column must hold strings (JSON numbers or Parquet bytes are not text)."""
    t = table.schema.field(TEXT).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)):
        raise SourceError(
            f"{file}, column `{TEXT}`: typed {t}; `{TEXT}` must hold text in every row"
        )


def task_kind(names: list[str], *, where: object) -> str:
    """The task a source's column `names` pose: "lm", "classification" or "regression".

    `text` -> language modelling (its other columns are not read); else `label` ->
    classification and `target` -> regression. Both of these, or none of the three, is a
    SourceError naming `where`.
    """
    if TEXT in names:
        return "lm"
    if LABEL in names and TARGET in names:
        raise SourceError(
            f"{where}: has both a `{LABEL}` column (classification) and a "
            f"`{TARGET}` column (regression); keep the one to train on and drop "
            f"or rename the other (a renamed column becomes a feature)"
        )
    if LABEL in names:
        return "classification"
    if TARGET in names:
        return "regression"
    raise no_task_error(where, list(names))


def feature_columns(names: list[str], fmt: str) -> list[str]:
    """The input columns of a classification or regression file (of its column `names`):
    `features`, else every other column (the one rule both writers pick columns by)."""
    if "features" in names:
        return ["features"]
    columns = [name for name in names if name not in (LABEL, TARGET)]
    if not columns:
        task = " or ".join(f"`{c}`" for c in (LABEL, TARGET) if c in names)
        raise SourceError(f"no `features` list column and no columns besides {task}")
    return sorted(columns) if fmt == "json" else columns  # JSON objects have no column order


def check_examples(table: pa.Table, *, kind: str, file: Path, fmt: str) -> None:
    """Refuse the first cell that is not a label, a target or a number, naming file, row
    and column.

    Arrow's column types are the fast path: an integer label column without nulls or
    negatives, a numeric target column without nulls or NaN / infinity, numeric feature
    columns without nulls, pass without looking at a cell.

    Args:
        table: one file's rows, typed by Arrow (or, on the error path, every cell as text).
        kind: "classification" or "regression" (`task_kind`).
        file, fmt: where the rows came from, for the messages.
    """
    column = TASK_COLUMNS[kind]
    targets = table.column(column)
    if kind == "classification":
        fast = (
            pa.types.is_integer(targets.type)
            and not targets.null_count
            and (not len(targets) or pc.min(targets).as_py() >= 0)
        )
    else:
        fast = (
            _is_numeric(targets.type)
            and not targets.null_count
            and (
                not pa.types.is_floating(targets.type)
                or not len(targets)
                or pc.all(pc.is_finite(targets)).as_py()
            )
        )
    if not fast:
        _check_task_values(targets.to_pylist(), column=column, file=file, fmt=fmt)
        if kind == "regression" and not _is_numeric(targets.type) and fmt != "csv":
            raise SourceError(
                f"{file}, column `{TARGET}`: typed {targets.type}; {_ALLOWED[TARGET]}"
            )
    for name in feature_columns(table.schema.names, fmt):
        values = table.column(name)
        t = values.type.value_type if _is_list(values.type) else values.type
        nulls = values.null_count or (
            _is_list(values.type) and values.combine_chunks().flatten().null_count
        )
        if not _is_numeric(t) or nulls:
            _check_values(values.to_pylist(), name=name, file=file, fmt=fmt, task_column=column)
            if fmt != "csv":  # CSV cells read as text may all be numbers; others may not
                raise SourceError(
                    f"{file}, column `{name}`: typed {values.type}; {_feature_rule(name, column)}"
                )
        if _is_list(values.type):
            _check_widths(values.combine_chunks(), file=file, fmt=fmt)


def no_task_error(where: object, columns: list[str]) -> SourceError:
    """The error for a source with no column that names a task (`label`, `target`, `text`)."""
    return SourceError(
        f"{where}: needs a column that names the task: `{LABEL}` "
        f"(classification: integer class ids), `{TARGET}` (regression: numbers) "
        f"or `{TEXT}` (language modelling); columns are {columns}"
    )


def cell_error(
    file: Path, fmt: str, row: int, column: str, value: object, *, task_column: str = LABEL
) -> SourceError:
    """The error for a bad cell: where it is, what it holds and what the column allows.

    Args:
        file, fmt, row: where the cell is (`row` from 0, as `place` takes it).
        column, value: its column and what it holds (None or "" for an empty cell).
        task_column: the source's `label` or `target` column, which the rule for a feature
            column names.
    """
    if column == LABEL:
        shown = "is not an integer class id"
    elif column == TARGET:
        shown = "is not finite" if _is_non_finite(value) else "is not a number"
    else:
        shown = "is not a number"
    shown = "empty" if value in (None, "") else f"{value!r} {shown}"
    allowed = _ALLOWED.get(column) or _feature_rule(column, task_column)
    return SourceError(f"{place(file, fmt, row)}, column `{column}`: {shown}; {allowed}")


_ALLOWED = {
    LABEL: f"`{LABEL}` must hold an integer class id >= 0 in every row",
    TARGET: f"`{TARGET}` must hold a finite number (integer or decimal) in every row",
    "features": "`features` must hold a list of numbers in every row, the same count in each",
}


def _feature_rule(column: str, task_column: str) -> str:
    if column == "features":
        return _ALLOWED["features"]
    return (
        f"every column besides `{task_column}` is a feature and must hold a number "
        f"(integer or decimal) in every row: fix the cell, or remove the column"
    )


def _check_task_values(values: list, *, column: str, file: Path, fmt: str) -> None:
    """The first cell of the `label` or `target` column that is not a class id or a number."""
    ok = _is_label if column == LABEL else _is_target
    for row, value in enumerate(values):
        if not ok(value, text=fmt == "csv"):
            raise cell_error(file, fmt, row, column, value, task_column=column)


def _check_values(values: list, *, name: str, file: Path, fmt: str, task_column: str) -> None:
    """The first cell of a feature column (or a `features` list) that is not a number."""
    for row, value in enumerate(values):
        if name == "features" and isinstance(value, list):
            value = next((v for v in value if not _is_number(v, text=False)), 0)
        if not _is_number(value, text=fmt == "csv" and name != "features"):
            raise cell_error(file, fmt, row, name, value, task_column=task_column)


def _check_widths(column: pa.Array, *, file: Path, fmt: str) -> None:
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths != lengths[0]).any():
        row = int(np.flatnonzero(lengths != lengths[0])[0])
        raise SourceError(
            f"{place(file, fmt, row)}, column `features`: {lengths[row]} values, "
            f"row 1 has {lengths[0]}; {_ALLOWED['features']}"
        )


def _is_number(value: object, *, text: bool) -> bool:
    """An int or float; with text=True (CSV cells) also a string that parses as one."""
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, (int, float)):
        return True
    if not (text and isinstance(value, str)) or "_" in value:  # Python reads 1_000; Arrow not
        return False
    try:
        return math.isfinite(float(value))  # "nan", "inf": not a feature value
    except ValueError:
        return False


def _is_target(value: object, *, text: bool) -> bool:
    """A finite int or float; with text=True (CSV cells) also a string that parses as one."""
    return _is_number(value, text=text) and not _is_non_finite(value)


def _is_non_finite(value: object) -> bool:
    """NaN or infinite, as a float or as text that parses as one ("NaN", "inf")."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return False
    try:
        return not math.isfinite(float(value))
    except (ValueError, OverflowError):
        return False


def _is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _is_label(value: object, *, text: bool) -> bool:
    if text and isinstance(value, str):
        return value.strip().isdigit()
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _list_width(table: pa.Table) -> int | None:
    if (
        "features" not in table.schema.names
        or not table.num_rows
        or not _is_list(table.schema.field("features").type)
    ):
        return None
    return int(pc.list_value_length(table.column("features").combine_chunks())[0].as_py())
