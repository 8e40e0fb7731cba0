"""File sources: JSONL / CSV / Parquet files read into one checked Arrow table.

A file source is a file or a directory of files of one format, read in name order. A
`text` column makes a language-modelling set. Otherwise it is classification: a `label`
column of integer class ids >= 0 and either a `features` list column of numbers (then no
other column is read) or every other column as one feature each, in file order (for JSON,
whose objects have no column order, by name).

Every cell is checked before any row is written, per file, so an error names the file, the
row and the column: a CSV cell that is not a number would otherwise make Arrow type the
whole column as text, and a column that silently stopped being a feature would train a
model on 19 features of 20 without a word. Rows are counted from 1 (the first data row),
with the line for CSV (the header is line 1) and JSONL. A CSV whose bad cell lies past the
block Arrow infers types from fails in the reader; it is read again as text to find the
cell. `data/spark.py` applies the same rules in Spark.
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

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv",
                ".parquet": "parquet"}
LABEL = "label"


class SourceError(ValueError):
    """A file source's cell or column is not what the task needs; names file, row, column."""


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
            raise SourceError(f"{f}: columns {table.schema.names} differ from {files[0]}'s "
                              f"{tables[0].schema.names}; every file of a source needs the "
                              f"same columns")
        tables.append(table)
    width = {_list_width(t) for t in tables} - {None}
    if len(width) > 1:
        raise SourceError(f"{path}: `features` lists hold {sorted(width)} values in different "
                          f"files; every row needs the same number")
    return pa.concat_tables(tables, promote_options="permissive"), fmt


def _read_checked(file: Path, fmt: str) -> pa.Table:
    """Read one file and check its cells; a failure is found again by row and column."""
    import pyarrow.csv
    import pyarrow.json

    try:
        if fmt == "csv":
            table = pyarrow.csv.read_csv(str(file))
        else:
            table = pyarrow.json.read_json(str(file)) if fmt == "json" else pq.read_table(file)
        if "text" not in table.schema.names:
            check_classification(table, file=file, fmt=fmt)
        return table
    except (pa.ArrowInvalid, SourceError) as e:
        # Arrow could not convert a cell (for CSV: one past the block the types were inferred
        # from), or a CSV cell became null ("", "n/a", "NA"). Look at the cells as written.
        if fmt == "csv" and "text" not in (header := _csv_header(file)):
            options = pyarrow.csv.ConvertOptions(
                column_types={n: pa.string() for n in header}, null_values=[],
                strings_can_be_null=False)  # every cell as the text it is
            check_classification(pyarrow.csv.read_csv(str(file), convert_options=options),
                                 file=file, fmt=fmt)
        elif fmt == "json" and isinstance(e, pa.ArrowInvalid):
            _check_json_rows(file)
        if isinstance(e, SourceError):
            raise
        raise SourceError(f"{file}: not readable as {fmt}: {e}") from None


def _csv_header(file: Path) -> list[str]:
    import csv

    with open(file, newline="") as f:
        return next(csv.reader(f), [])


def _check_json_rows(file: Path) -> None:
    """Check a JSONL file row by row in Python (the error path: Arrow refused it)."""
    rows = []
    with open(file) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SourceError(f"{file}, line {line_no}: not valid JSON: {e}") from None
    names = list(dict.fromkeys(k for row in rows for k in row))
    if "text" in names or LABEL not in names:
        return
    columns = {n: [row.get(n) for row in rows] for n in names}
    _check_label_values(columns[LABEL], file=file, fmt="json")
    for name in feature_columns(names, "json"):
        _check_values(columns[name], name=name, file=file, fmt="json")


def feature_columns(names: list[str], fmt: str) -> list[str]:
    """The input columns of a classification file (of its column `names`): `features`, else
    every other column (the one rule both writers pick columns by)."""
    if "features" in names:
        return ["features"]
    columns = [name for name in names if name != LABEL]
    if not columns:
        raise SourceError(f"no `features` list column and no columns besides `{LABEL}`")
    return sorted(columns) if fmt == "json" else columns  # JSON objects have no column order


def check_classification(table: pa.Table, *, file: Path, fmt: str) -> None:
    """Refuse the first cell that is not a label or a number, naming file, row and column.

    Arrow's column types are the fast path: an integer label column without nulls or
    negatives, numeric feature columns without nulls, pass without looking at a cell.
    """
    if LABEL not in table.schema.names:
        raise no_task_error(file, table.schema.names)
    labels = table.column(LABEL)
    if not (pa.types.is_integer(labels.type) and not labels.null_count
            and (not len(labels) or pc.min(labels).as_py() >= 0)):
        _check_label_values(labels.to_pylist(), file=file, fmt=fmt)
    for name in feature_columns(table.schema.names, fmt):
        column = table.column(name)
        t = column.type.value_type if _is_list(column.type) else column.type
        numeric = pa.types.is_integer(t) or pa.types.is_floating(t)
        nulls = column.null_count or (_is_list(column.type)
                                      and column.combine_chunks().flatten().null_count)
        if not numeric or nulls:
            _check_values(column.to_pylist(), name=name, file=file, fmt=fmt)
            if fmt != "csv":  # CSV cells read as text may all be numbers; others may not
                raise SourceError(f"{file}, column `{name}`: typed {column.type}; "
                                  f"{_ALLOWED[name == 'features']}")
        if _is_list(column.type):
            _check_widths(column.combine_chunks(), file=file, fmt=fmt)


def no_task_error(where: object, columns: list[str]) -> SourceError:
    """The error for a source with neither a `text` nor a `label` column."""
    return SourceError(f"{where}: needs a `text` column (language modelling) or a `{LABEL}` "
                       f"column (classification); columns are {columns}")


def cell_error(file: Path, fmt: str, row: int, column: str, value: object) -> SourceError:
    """The error for a bad cell: where it is, what it holds and what the column allows."""
    if column == LABEL:
        shown, allowed = "is not an integer class id", (f"`{LABEL}` must hold an integer "
                                                        f"class id >= 0 in every row")
    else:
        shown, allowed = "is not a number", _ALLOWED[column == "features"]
    shown = "empty" if value in (None, "") else f"{value!r} {shown}"
    return SourceError(f"{place(file, fmt, row)}, column `{column}`: {shown}; {allowed}")


_ALLOWED = {False: f"every column besides `{LABEL}` is a feature and must hold a number "
                   f"(integer or decimal) in every row: fix the cell, or remove the column",
            True: "`features` must hold a list of numbers in every row, the same count in each"}


def _check_label_values(values: list, *, file: Path, fmt: str) -> None:
    for row, value in enumerate(values):
        if not _is_label(value, text=fmt == "csv"):
            raise cell_error(file, fmt, row, LABEL, value)


def _check_values(values: list, *, name: str, file: Path, fmt: str) -> None:
    """The first cell of a feature column (or a `features` list) that is not a number."""
    for row, value in enumerate(values):
        if name == "features" and isinstance(value, list):
            value = next((v for v in value if not _is_number(v, text=False)), 0)
        if not _is_number(value, text=fmt == "csv" and name != "features"):
            raise cell_error(file, fmt, row, name, value)


def _check_widths(column: pa.Array, *, file: Path, fmt: str) -> None:
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths != lengths[0]).any():
        row = int(np.flatnonzero(lengths != lengths[0])[0])
        raise SourceError(f"{place(file, fmt, row)}, column `features`: {lengths[row]} values, "
                          f"row 1 has {lengths[0]}; {_ALLOWED[True]}")


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


def _is_label(value: object, *, text: bool) -> bool:
    if text and isinstance(value, str):
        return value.strip().isdigit()
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _list_width(table: pa.Table) -> int | None:
    if ("features" not in table.schema.names or not table.num_rows
            or not _is_list(table.schema.field("features").type)):
        return None
    return int(pc.list_value_length(table.column("features").combine_chunks())[0].as_py())
