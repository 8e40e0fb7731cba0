"""A damaged shard is refused by its path: before launch from its size and footer (cheap:
`scaletrain explain` and `scaletrain train` exit 2 with one paragraph, no worker starts),
and in the workers from its SHA-256 (a flip inside a data page leaves the footer intact).

Every single-byte flip in a footer is caught, including the ones Parquet still parses
(a string in the key-value metadata, a statistic): the manifest records the footer's
SHA-256, which costs one small read per shard at launch."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from scaletrain.data.manifest import MANIFEST, ShardError, open_shard, read_manifest
from scaletrain.data.preflight import DataCheckError, check_data
from scaletrain.data.shard_writer import write_shards
from scaletrain.data.shards import ShardedDataset

from harness import cli_main, file_tree, forbid_starting

TOML = """\
name = "integrity"
[model]
name = "mlp"
[data]
source = "shards"
path = "{path}"
[train]
steps = 2
global_batch = 8
micro_batch = 4
"""


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity") / "digits"
    write_shards("digits", root, rows_per_shard=500, row_group_rows=128)
    return root


@pytest.fixture
def shards(written, tmp_path) -> Path:
    """A fresh copy of the shards for a test to damage."""
    return Path(shutil.copytree(written, tmp_path / "digits"))


def _footer(data: bytes) -> tuple[int, int]:
    """(start, length) of the Parquet footer: the 4-byte length before the closing magic."""
    length = int.from_bytes(data[-8:-4], "little")
    return len(data) - 8 - length, length


def _flip(path: Path, position: int, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= mask
    path.write_bytes(bytes(data))


def _damage(shard: Path, kind: str) -> None:
    data = shard.read_bytes()
    start, length = _footer(data)
    if kind == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif kind == "magic":
        _flip(shard, len(data) - 1)
    elif kind == "footer-middle":
        _flip(shard, start + length // 2)
    elif kind == "footer-name":  # a column name that is no longer UTF-8
        _flip(shard, data.rindex(b"targets"))
    elif kind == "footer-text":  # still a valid footer: only its checksum tells
        _flip(shard, data.rindex(b"parquet-cpp-arrow"), 0x01)
    else:
        raise AssertionError(kind)


KINDS = ["truncated", "magic", "footer-middle", "footer-name", "footer-text"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_shard_is_refused_before_launch_by_its_path(shards, kind):
    shard = shards / "train" / "part-00001.parquet"
    _damage(shard, kind)
    with pytest.raises(DataCheckError) as caught:
        check_data(source="shards", path=str(shards), seq_len=128, model_name="mlp")
    message = str(caught.value)
    assert f"shard {shard}:" in message and "\n" not in message, message
    assert "write the shards again" in message, message


def test_every_single_byte_flip_in_a_footer_is_refused_as_a_shard_error(shards):
    split = shards / "train"
    info = read_manifest(split).shards[1]
    schema = read_manifest(split).schema
    shard = split / info.file
    clean = shard.read_bytes()
    start, _ = _footer(clean)
    for position in range(start, len(clean)):
        _flip(shard, position)
        with pytest.raises(ShardError, match=re.escape(f"shard {shard}: ")):
            open_shard(split, info, schema, verify=False)
        shard.write_bytes(clean)
    open_shard(split, info, schema, verify=False)  # and the clean file passes


def test_a_manifest_without_footer_checksums_is_still_checked_by_structure(shards):
    """Manifests written before the footer checksum existed load, and a truncated shard is
    still refused from its footer and size."""
    path = shards / "train" / MANIFEST
    manifest = json.loads(path.read_text())
    for s in manifest["shards"]:
        del s["footer_sha256"]
    path.write_text(json.dumps(manifest))
    assert check_data(source="shards", path=str(shards), seq_len=128, model_name="mlp") is None
    _damage(shards / "train" / "part-00001.parquet", "truncated")
    with pytest.raises(DataCheckError, match="part-00001.parquet: not a readable Parquet file"):
        check_data(source="shards", path=str(shards), seq_len=128, model_name="mlp")


def test_a_damaged_shard_of_a_directory_without_manifest_is_refused_by_its_path(shards):
    for split in ("train", "eval"):
        (shards / split / MANIFEST).unlink()
    shard = shards / "eval" / "part-00000.parquet"  # the eval split is checked too
    _damage(shard, "truncated")
    with pytest.raises(DataCheckError, match=re.escape(f"shard {shard}: not a readable Parquet")):
        check_data(source="shards", path=str(shards), seq_len=128, model_name="mlp")


@pytest.mark.parametrize("command", ["explain", "train"])
@pytest.mark.parametrize("kind", ["truncated", "footer-text"])
def test_the_cli_refuses_a_damaged_shard_before_any_worker_starts(
    shards, tmp_path, monkeypatch, capsys, command, kind
):
    forbid_starting(monkeypatch, tmp_path)
    cfg = tmp_path / "config.toml"
    cfg.write_text(TOML.format(path=shards))
    shard = shards / "train" / "part-00001.parquet"
    _damage(shard, kind)
    before = file_tree(tmp_path)

    code = cli_main([command, str(cfg), "--nproc", "2"])

    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("scaletrain: error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert f"shard {shard}:" in errors[0], err
    assert file_tree(tmp_path) == before  # no run directory, no log: nothing started


def test_a_flipped_byte_in_a_data_page_is_refused_in_the_worker_by_its_path(shards):
    """The footer, size and row counts are intact, so the launcher's cheap check passes it;
    the worker's SHA-256 over the file names it."""
    shard = shards / "train" / "part-00001.parquet"
    _flip(shard, shard.stat().st_size // 3)
    assert check_data(source="shards", path=str(shards), seq_len=128, model_name="mlp") is None
    with pytest.raises(ShardError) as caught:
        ShardedDataset(shards / "train")
    message = str(caught.value)
    assert f"shard {shard}: its bytes differ from those written" in message, message
    assert "write the shards again" in message and "\n" not in message, message
