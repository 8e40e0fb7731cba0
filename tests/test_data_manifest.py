"""The manifest module (data/manifest.py): the names other modules import from
`scaletrain.data.shards` still resolve there, manifests written before the provenance fields
existed still load, and the summary `scaletrain shard` prints reads from manifests (class
counts for classification, the target's min / mean / max for regression)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scaletrain.data import manifest, shards
from scaletrain.data.holdout import eval_mask
from scaletrain.data.shard_writer import write_shards
from scaletrain.data.sources import load_source


@pytest.mark.parametrize(
    "name",
    [
        "ShardError",
        "MANIFEST",
        "Manifest",
        "ShardInfo",
        "read_manifest",
        "write_manifest",
        "describe_shard",
        "part_files",
        "sha256_file",
        "schema_pairs",
        "open_shard",
        "task_columns",
        "infer_manifest",
        "image_shape",
        "FORMAT",
    ],
)
def test_the_format_lives_in_manifest_and_stays_importable_from_shards(name):
    assert getattr(shards, name) is getattr(manifest, name)
    assert name in shards.__all__


def test_a_manifest_without_the_provenance_fields_still_loads(tmp_path):
    write_shards("digits", tmp_path, rows_per_shard=1000)
    path = tmp_path / "train" / manifest.MANIFEST
    data = json.loads(path.read_text())
    digits = load_source("digits", split="train")
    assert data["label_counts"] == np.bincount(digits.targets.numpy()).tolist()
    for key in ("label_column", "feature_columns", "label_counts"):
        del data[key]
    path.write_text(json.dumps(data))
    old = manifest.read_manifest(tmp_path / "train")
    assert (old.label_counts, old.feature_columns, old.rows) == (None, (), 1438)
    assert len(shards.ShardedDataset(tmp_path / "train")) == 1438


def test_summary_lines_say_what_was_written(tmp_path):
    train = write_shards("digits", tmp_path, rows_per_shard=500)
    lines = manifest.summary_lines(
        train, manifest.read_manifest(tmp_path / "eval"), out_dir=tmp_path
    )
    assert lines == [
        "source digits: its own labels, 10 classes, 64 features (shape (1, 8, 8))",
        "rows: 1438 train, 359 eval (the source's own eval split)",
        f"wrote 3 train + 1 eval shards to {tmp_path}",
    ]


def test_a_regression_manifest_records_the_target_and_loads_without_it(tmp_path):
    y = np.arange(100) * 0.5 - 3  # -3 .. 46.5
    (tmp_path / "r.csv").write_text("x,target\n" + "".join(f"{i},{v}\n" for i, v in enumerate(y)))
    train = write_shards(tmp_path / "r.csv", tmp_path / "out", rows_per_shard=64)
    ev = manifest.read_manifest(tmp_path / "out" / "eval")
    path = tmp_path / "out" / "train" / manifest.MANIFEST
    data = json.loads(path.read_text())
    assert data["label_counts"] is None and data["label_column"] == "target"
    seen = y[~eval_mask(100)]
    assert data["target_stats"] == pytest.approx(
        {"min": seen.min(), "mean": seen.mean(), "max": seen.max()}
    )
    assert train.target_stats == tuple(data["target_stats"][k] for k in ("min", "mean", "max"))
    assert manifest.summary_lines(train, ev, out_dir=tmp_path)[0] == (
        f"source {tmp_path / 'r.csv'}: target column `target` (min -3, mean {y.mean():.4g}, "
        f"max 46.5), 1 features (x)"
    )  # over both splits' rows
    del data["target_stats"]  # a manifest from before the field: loads, summary without it
    path.write_text(json.dumps(data))
    old = manifest.read_manifest(tmp_path / "out" / "train")
    assert old.target_stats is None and old.task.kind == "regression"
    assert manifest.summary_lines(old, ev, out_dir=tmp_path)[0].endswith(
        "target column `target`, 1 features (x)"
    )
