"""The manifest module (data/manifest.py): the names other modules import from
`scaletrain.data.shards` still resolve there, manifests written before the provenance fields
existed still load, and the summary `scaletrain shard` prints reads from manifests."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scaletrain.data import manifest, shards
from scaletrain.data.shard_writer import write_shards
from scaletrain.data.sources import load_source


@pytest.mark.parametrize("name", ["ShardError", "MANIFEST", "Manifest", "ShardInfo",
                                  "read_manifest", "write_manifest", "describe_shard",
                                  "part_files", "sha256_file", "schema_pairs", "open_shard",
                                  "task_columns", "infer_manifest", "image_shape", "FORMAT"])
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
    lines = manifest.summary_lines(train, manifest.read_manifest(tmp_path / "eval"),
                                   out_dir=tmp_path)
    assert lines == ["source digits: its own labels, 10 classes, 64 features (shape (1, 8, 8))",
                     "rows: 1438 train, 359 eval (the source's own eval split)",
                     f"wrote 3 train + 1 eval shards to {tmp_path}"]
