"""Pre-launch data checks (data/preflight.py): a wrong data.path, a model that does not fit
the shards' task, or a data.seq_len the text shards were not written at is refused with a
message naming the key and the fix, from metadata alone."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from scaletrain.data import manifest as manifest_module
from scaletrain.data.preflight import CNN_MIN_SIDE, MODEL_KINDS, DataCheckError, check_data
from scaletrain.data.shard_writer import write_shards
from scaletrain.errors import UserError


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    write_shards("digits", root / "digits", rows_per_shard=1000)
    write_shards(
        "synthetic-text", root / "text", rows_per_shard=100, seq_len=32, synthetic_examples=200
    )
    (root / "flat").mkdir()  # a Spark-like directory without a manifest: 20 flat features
    pq.write_table(
        pa.table({"features": [[0.5] * 20] * 50, "label": np.arange(50) % 3}),
        root / "flat" / "part-00000.parquet",
    )
    (root / "spark-text").mkdir()
    pq.write_table(pa.table({"tokens": [[1] * 65] * 10}), root / "spark-text" / "part-0.parquet")
    rows = "".join(f"{i},{i % 5},{i * 0.5},{i * 0.25 - 3}\n" for i in range(60))
    (root / "reg.csv").write_text("a,b,c,target\n" + rows)  # a numeric target: regression
    write_shards(root / "reg.csv", root / "reg", rows_per_shard=100)
    (root / "spark-reg").mkdir()  # the same without a manifest: a Spark job's `target`
    pq.write_table(
        pa.table({"features": [[0.5] * 3] * 40, "target": np.arange(40) * 0.5}),
        root / "spark-reg" / "part-00000.parquet",
    )
    return root


def _check(path, *, model: str = "mlp", seq_len: int = 128, source: str = "shards"):
    return check_data(source=source, path=str(path), seq_len=seq_len, model_name=model)


def test_fitting_data_pass_and_builtin_sources_are_not_checked(shards):
    assert DataCheckError.__mro__[1] is UserError and issubclass(DataCheckError, ValueError)
    assert _check(shards / "digits", model="cnn") is None
    assert _check(shards / "digits" / "train", model="mlp") is None  # one split directory
    assert _check(shards / "text", model="gpt", seq_len=32) is None
    assert _check(shards / "nowhere", source="digits") is None
    note = _check(shards / "flat", model="mlp")
    assert "no scaletrain manifest: eval is 1 row in 20 of its rows" in note


@pytest.mark.parametrize("data", ["reg", "spark-reg"])
def test_regression_shards_train_the_mlp_and_no_other_model(shards, data):
    note = _check(shards / data, model="mlp")
    assert (note is None) == (data == "reg")  # a note only for the directory without manifest
    for model, needs in (
        ("cnn", "classification data (task kind 'classification')"),
        ("gpt", "text (task kind 'lm')"),
        ("hf", "text (task kind 'lm')"),
    ):
        with pytest.raises(
            DataCheckError,
            match=rf"model.name = '{model}' needs "
            rf"{re.escape(needs)}, but the shards at "
            rf"data.path = '.*{data}' hold regression "
            rf"data \(task kind 'regression', examples of "
            rf"shape \(3,\)\); models for this data: "
            rf"'mlp'$",
        ):
            _check(shards / data, model=model, seq_len=32)


def test_a_missing_or_empty_path_is_refused(shards, tmp_path):
    with pytest.raises(
        DataCheckError,
        match=r"data.path = '.*nowhere' does not exist; it must "
        r"be the directory `scaletrain shard",
    ):
        _check(shards / "nowhere")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataCheckError, match=r"data.path = '.*afile' is a file; it must be"):
        _check(tmp_path / "afile")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("hi")
    with pytest.raises(
        DataCheckError,
        match=r"is not a shard directory: neither it nor "
        r".*train' holds manifest.json or part-\*.parquet",
    ):
        _check(tmp_path / "empty")
    shutil.copytree(shards / "digits" / "train", tmp_path / "half" / "train")
    with pytest.raises(DataCheckError, match="has a train split .* but no eval split"):
        _check(tmp_path / "half")


@pytest.mark.parametrize(
    "data, model, words",
    [
        (
            "digits",
            "gpt",
            r"model.name = 'gpt' needs text \(task kind 'lm'\), but the shards at "
            r"data.path = '.*digits' hold classification data \(task kind "
            r"'classification', examples of shape \(1, 8, 8\)\); models for this "
            r"data: 'mlp', 'cnn'$",
        ),
        (
            "text",
            "mlp",
            r"model.name = 'mlp' needs classification data or regression data \(task "
            r"kind 'classification' or 'regression'\), but .* hold text \(task kind "
            r"'lm', .*; models for this data: 'gpt', 'hf'$",
        ),
        ("spark-text", "cnn", r"'cnn' needs classification data"),  # read from the Parquet schema
        (
            "flat",
            "cnn",
            r"model.name = 'cnn' needs images \(C, H, W\) of at least 8x8, but .* "
            r"shape \(20,\)\); use model.name='mlp'",
        ),
    ],
)
def test_a_model_that_does_not_fit_the_data_is_refused(shards, data, model, words):
    with pytest.raises(DataCheckError, match=words):
        _check(shards / data, model=model, seq_len=32)


def test_a_seq_len_other_than_the_shards_is_refused_naming_both(shards):
    with pytest.raises(
        DataCheckError,
        match=r"data.seq_len = 128 differs from the seq_len the "
        r"text shards at data.path = .* were written at "
        r"\(32\); set data.seq_len=32",
    ):
        _check(shards / "text", model="gpt", seq_len=128)
    with pytest.raises(DataCheckError, match=r"data.seq_len = 32 .* \(64\); set data.seq_len=64"):
        _check(shards / "spark-text", model="gpt", seq_len=32)  # no manifest: from the rows


def test_the_checks_read_metadata_only(shards, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("read data, not metadata")

    monkeypatch.setattr(pq, "read_table", refuse)
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", refuse)
    monkeypatch.setattr(pq.ParquetFile, "read", refuse)
    monkeypatch.setattr(manifest_module, "sha256_file", refuse)
    assert _check(shards / "digits", model="cnn") is None
    assert _check(shards / "flat", model="mlp") is not None
    assert _check(shards / "spark-reg", model="mlp") is not None
    with pytest.raises(DataCheckError, match="seq_len"):
        _check(shards / "spark-text", model="gpt", seq_len=8)


def test_a_model_name_that_is_not_built_in_is_left_to_its_factory(shards):
    # An import path is the user's factory: it decides what it trains on.
    assert _check(shards / "digits", model="pkg.mod:make_model") is None
    with pytest.raises(DataCheckError, match=r"model.name = 'hf' needs text \(task kind 'lm'\)"):
        _check(shards / "digits", model="hf")


def test_the_model_table_stays_in_step_with_the_registry():
    from scaletrain.models import _REGISTRY
    from scaletrain.models.cnn import MIN_SIDE

    def kinds(entry) -> set[str]:  # the registry's first field: a kind or a tuple of kinds
        return {entry[0]} if isinstance(entry[0], str) else set(entry[0])

    assert {name: kinds(entry) for name, entry in _REGISTRY.items()} == {
        name: set(MODEL_KINDS[name]) for name in _REGISTRY
    }
    assert set(MODEL_KINDS["mlp"]) == {"classification", "regression"}
    assert set(MODEL_KINDS) == set(_REGISTRY) | {"hf"}  # hf: models/hf.py, not the registry
    assert CNN_MIN_SIDE == MIN_SIDE
