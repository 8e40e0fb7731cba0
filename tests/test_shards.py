"""Parquet shards: round trips equal the in-memory sources, the manifest describes the files,
file sources split by the hold-out rule, ranks of any world size read the sampler's global
order and only the row groups they need, prefetch lands in the cache, and every kind of
damaged shard is refused by name. No Spark here (tests/test_spark.py); directories shaped
like Spark's are written with pyarrow. The rule itself: tests/test_data_holdout.py."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from scaletrain.data.holdout import HeldOutSplit, eval_mask
from scaletrain.data.sampler import GlobalBatchSampler, epoch_order
from scaletrain.data.shard_writer import write_shards
from scaletrain.data.shards import MANIFEST, ShardedDataset, ShardError, load_dataset, read_manifest
from scaletrain.data.sources import TaskSpec, load_source


def _read_all(ds: ShardedDataset):
    return ds.get(torch.arange(len(ds)))


def _assert_equal_to_source(out: Path, name: str, **source_kwargs) -> None:
    for split in ("train", "eval"):
        ref = load_source(name, split=split, **source_kwargs)
        ds = ShardedDataset(out / split)
        assert ds.spec == ref.spec and len(ds) == len(ref)
        got = _read_all(ds)
        assert torch.equal(got.inputs, ref.inputs) and got.inputs.dtype == ref.inputs.dtype
        assert torch.equal(got.targets, ref.targets)
        idx = torch.randperm(len(ref), generator=torch.Generator().manual_seed(0))[:37]
        a, b = ds.get(idx), ref.get(idx)  # arbitrary order, spread over shards
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert (a.count, a.tokens) == (b.count, b.tokens)


# --- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("digits", {}),
        ("synthetic-images", {"synthetic_examples": 700}),
        ("synthetic-text", {"synthetic_examples": 300, "seq_len": 32}),
        # The writer packs wikitext's UTF-8 bytes into seq_len + 1 windows exactly as
        # load_source cuts them (95/5 byte split, trailing partial window dropped).
        ("wikitext", {"seq_len": 64}),
    ],
)
def test_builtin_shards_read_back_equal_to_the_source(tmp_path, name, kwargs):
    manifest = write_shards(name, tmp_path, rows_per_shard=250, row_group_rows=64, **kwargs)
    train_rows = len(load_source(name, split="train", **kwargs))
    assert manifest.split == "train" and manifest.rows == train_rows
    assert manifest.shards[0].rows == 250 and manifest.shards[0].row_groups[:2] == (64, 64)
    _assert_equal_to_source(tmp_path, name, **kwargs)
    if name == "wikitext":  # tokens are the bytes: one row = seq_len + 1 consecutive bytes
        row = pq.read_table(tmp_path / "train" / "part-00000.parquet").column("tokens")[1]
        assert len(row) == 65 and all(0 <= t < 256 for t in row.as_py())


def test_mnist_shards_read_back_equal_to_the_source(tmp_path):
    manifest = write_shards("mnist", tmp_path, rows_per_shard=16384)
    assert [s.rows for s in manifest.shards] == [16384, 16384, 16384, 10848]
    _assert_equal_to_source(tmp_path, "mnist")


def test_manifest_describes_every_shard(tmp_path):
    write_shards("digits", tmp_path, rows_per_shard=500, row_group_rows=128)
    data = json.loads((tmp_path / "train" / MANIFEST).read_text())
    assert (data["format"], data["version"], data["split"]) == ("scaletrain-shards", 1, "train")
    assert data["task"] == {
        "kind": "classification",
        "input_shape": [1, 8, 8],
        "num_classes": 10,
        "ragged": False,
    }
    # Arrow reads Parquet lists back with the standard's item name, as Spark writes them.
    assert data["schema"] == [["inputs", "list<element: float>"], ["targets", "int64"]]
    assert [s["file"] for s in data["shards"]] == [f"part-0000{i}.parquet" for i in range(3)]
    assert [s["rows"] for s in data["shards"]] == [500, 500, 438] and data["rows"] == 1438
    for s in data["shards"]:
        path = tmp_path / "train" / s["file"]
        assert s["bytes"] == path.stat().st_size
        assert s["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        md = pq.read_metadata(path)
        assert s["row_groups"] == [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        assert max(s["row_groups"]) == 128 and sum(s["row_groups"]) == s["rows"]
        assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression in ("ZSTD",)
    assert read_manifest(tmp_path / "eval").rows == 359
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == [
        MANIFEST,
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
    ]  # no temps


def test_existing_shards_are_kept_unless_overwrite(tmp_path):
    write_shards("digits", tmp_path, rows_per_shard=1000)
    with pytest.raises(FileExistsError, match="overwrite"):
        write_shards("digits", tmp_path, rows_per_shard=500)
    write_shards("digits", tmp_path, rows_per_shard=500, overwrite=True)
    assert ShardedDataset(tmp_path / "train").shard_rows == (500, 500, 438)


# --- file sources -------------------------------------------------------------------------


def test_text_file_is_packed_and_1_document_in_20_is_eval(tmp_path):
    docs = [f"doc {i} é \u4e2d " + "ab" * (i % 37) for i in range(100)]
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
    write_shards(tmp_path / "docs.jsonl", tmp_path / "out", rows_per_shard=40, seq_len=16)
    held = eval_mask(100)
    assert held.sum() == 5 and not held[95:].all()  # 5 documents, not the file's tail
    for split, part in (
        ("train", [d for d, e in zip(docs, held) if not e]),
        ("eval", [d for d, e in zip(docs, held) if e]),
    ):
        stream = np.frombuffer(b"\n\n".join(d.encode() for d in part), dtype=np.uint8)
        n = len(stream) // 17
        windows = torch.from_numpy(stream[: n * 17].astype(np.int64)).view(n, 17)
        got = _read_all(ShardedDataset(tmp_path / "out" / split))
        assert got.inputs.shape == (n, 16)
        assert torch.equal(got.inputs, windows[:, :-1]) and torch.equal(got.targets, windows[:, 1:])


def test_csv_and_json_classification_sources(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 3)).astype(np.float32), rng.integers(0, 4, size=40)
    lines = ["label,b,a,c"] + [
        ",".join([str(y[i])] + [repr(float(v)) for v in x[i]]) for i in range(40)
    ]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning, match="eval split has no rows of .* present in train"):
        write_shards(tmp_path / "t.csv", tmp_path / "csv", rows_per_shard=16)  # 2 eval rows
    train, ev = (ShardedDataset(tmp_path / "csv" / split) for split in ("train", "eval"))
    assert train.spec == TaskSpec("classification", (3,), int(y.max()) + 1)
    assert (len(train), len(ev), train.shard_rows) == (38, 2, (16, 16, 6))  # ceil(5% of 40) = 2
    held = eval_mask(40)  # rows in file order within each split
    assert torch.equal(_read_all(train).inputs, torch.from_numpy(x[~held]))  # CSV column order
    assert torch.equal(_read_all(ev).targets, torch.from_numpy(y[held]))
    assert train.manifest.label_counts == tuple(np.bincount(y[~held], minlength=4))
    assert (train.manifest.label_column, train.manifest.feature_columns) == (
        "label",
        ("b", "a", "c"),
    )
    # A `features` list of a perfect square becomes a (1, s, s) image.
    with open(tmp_path / "img.jsonl", "w") as f:
        f.writelines(
            json.dumps({"label": int(i % 3), "features": [float(i)] * 16}) + "\n" for i in range(30)
        )
    with pytest.warns(UserWarning, match="no rows of"):
        write_shards(tmp_path / "img.jsonl", tmp_path / "img", rows_per_shard=100)
    img = ShardedDataset(tmp_path / "img" / "train")
    assert img.spec == TaskSpec("classification", (1, 4, 4), 3)
    assert torch.equal(_read_all(img).inputs[:, 0, 0, 0], torch.arange(30.0)[~eval_mask(30)])


# --- ranks and the sampler ----------------------------------------------------------------

N_IDS = 1213  # 1213 - ceil(5%) = 1152 train rows = 12 steps of a global batch of 96


@pytest.fixture(scope="module")
def ids_dir(tmp_path_factory) -> Path:
    """Train rows that say who they are: inputs = (row id, -row id), label = row id % 7."""
    root = tmp_path_factory.mktemp("ids")
    held = eval_mask(N_IDS)
    ids = np.full(N_IDS, 10_000)  # eval rows: a number no train row has
    ids[~held] = np.arange(N_IDS - held.sum())  # train row i (after the split) holds i
    ids[held] += np.arange(held.sum())  # eval rows: labels of every class, no warning
    pq.write_table(
        pa.table({"id": ids.astype(np.float64), "neg": -ids.astype(np.float64), "label": ids % 7}),
        root / "ids.parquet",
    )
    write_shards(root / "ids.parquet", root / "shards", rows_per_shard=100, row_group_rows=32)
    return root / "shards" / "train"


def _sampler(ds: ShardedDataset, rank: int, world: int) -> GlobalBatchSampler:
    return GlobalBatchSampler(
        len(ds),
        global_batch=96,
        micro_batch=8,
        dp_rank=rank,
        dp_size=world,
        seed=5,
        shard_rows=ds.shard_rows,
        shuffle_window=128,
    )


def test_ranks_read_the_global_order_once_for_every_world_size(ids_dir):
    sequences = {}
    for world in (1, 2, 3, 4):
        ranks = [ShardedDataset(ids_dir, prefetch=0, cache_row_groups=16) for _ in range(world)]
        samplers = [_sampler(ds, r, world) for r, ds in enumerate(ranks)]
        assert samplers[0].steps_per_epoch == 12 and len(ranks[0]) == 1152  # nothing dropped
        seen = []
        for step in range(12):
            for ds, sampler in zip(ranks, samplers):  # rank order = the global batch's order
                for idx in sampler.micro_batches(step):
                    batch = ds.get(idx)
                    assert torch.equal(batch.inputs[:, 0].long(), idx)  # row id i is row i
                    assert torch.equal(batch.targets, idx % 7) and batch.count == len(idx)
                    seen.append(idx)
        sequences[world] = torch.cat(seen)
        assert torch.equal(sequences[world].sort().values, torch.arange(1152))  # all, once
    order = epoch_order(ranks[0].shard_rows, seed=5, epoch=0, window=128)
    for world in (1, 2, 3, 4):
        assert torch.equal(sequences[world], order)


def test_a_rank_reads_only_the_row_groups_its_rows_live_in(ids_dir):
    manifest = read_manifest(ids_dir)
    starts = np.cumsum([0] + [s.rows for s in manifest.shards])
    total_bytes = 0
    rg_bytes = {}
    for s, info in enumerate(manifest.shards):
        md = pq.read_metadata(ids_dir / info.file)
        for r in range(md.num_row_groups):
            rg = md.row_group(r)
            rg_bytes[s, r] = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
            total_bytes += rg_bytes[s, r]

    def where(i: int) -> tuple[int, int]:  # global row id -> (shard, row group), from the manifest
        s = int(np.searchsorted(starts, i, side="right")) - 1
        return s, int(
            np.searchsorted(np.cumsum(manifest.shards[s].row_groups), i - starts[s], side="right")
        )

    for rank in range(4):
        ds = ShardedDataset(ids_dir, prefetch=0, cache_row_groups=64)
        sampler = _sampler(ds, rank, 4)
        needed = set()
        for step in (0, 1):
            for idx in sampler.micro_batches(step):
                ds.get(idx)
                needed |= {where(i) for i in idx.tolist()}
        assert set(ds.stats.reads) == needed and set(ds.stats.reads.values()) == {1}
        assert ds.stats.row_groups_read == len(needed) == ds.stats.misses
        assert ds.stats.bytes_read == sum(rg_bytes[k] for k in needed) < total_bytes / 4


def test_a_cache_sized_for_the_window_decodes_each_row_group_once_per_epoch(ids_dir):
    for seed in range(3):
        small = ShardedDataset(ids_dir, prefetch=0, cache_row_groups=2)
        sized = ShardedDataset(ids_dir, prefetch=0, cache_row_groups=2)
        assert sized.size_cache_for(128) == 2 * (128 // 25 + 1 + 2)  # 46 groups of 25 rows
        caught = {}
        for name, ds in (("small", small), ("sized", sized)):
            sampler = GlobalBatchSampler(
                len(ds),
                global_batch=96,
                micro_batch=96,
                dp_rank=0,
                dp_size=1,
                seed=seed,
                shard_rows=ds.shard_rows,
                shuffle_window=128,
            )  # 128 % 96 != 0: some batches
            with warnings.catch_warnings(record=True) as caught[name]:  # straddle 2 windows
                warnings.simplefilter("always")
                for step in range(sampler.steps_per_epoch):
                    ds.get(sampler.micro_batches(step)[0])
        assert set(sized.stats.reads.values()) == {1} and len(sized.stats.reads) == 46
        assert small.stats.row_groups_read > 2 * 46 and not caught["sized"]


def test_an_order_that_thrashes_the_cache_is_reported(ids_dir):
    ds = ShardedDataset(ids_dir, prefetch=0, cache_row_groups=4)
    sampler = GlobalBatchSampler(
        len(ds),
        global_batch=96,
        micro_batch=96,
        dp_rank=0,
        dp_size=1,
        seed=0,
        shard_rows=ds.shard_rows,
    )  # no window
    with pytest.warns(UserWarning, match="row groups decoded for .* rows"):
        for step in range(sampler.steps_per_epoch):
            ds.get(sampler.micro_batches(step)[0])


def test_prefetch_makes_the_next_get_a_cache_hit(ids_dir):
    ds = ShardedDataset(ids_dir, prefetch=2, cache_row_groups=16)
    reference = ShardedDataset(ids_dir, prefetch=0)
    sampler = _sampler(ds, 0, 1)
    for step in range(3):
        (idx,) = sampler.micro_batches(step)[:1]
        ds.prefetch(idx)
        before = ds.stats.misses
        batch = ds.get(idx)
        assert ds.stats.misses == before  # get read nothing itself
        assert torch.equal(batch.inputs, reference.get(idx).inputs)
    assert ds.stats.hits + ds.stats.waits > 0 and ds.stats.misses == 0
    assert ds.stats.row_groups_read == len(ds.stats.reads)  # each row group read once
    ds.close()


def test_get_refuses_rows_out_of_range_and_serves_empty_batches(ids_dir):
    ds = ShardedDataset(ids_dir)
    empty = ds.get(torch.tensor([], dtype=torch.int64))
    assert empty.inputs.shape == (0, 2) and empty.targets.shape == (0,) and empty.count == 0
    with pytest.raises(IndexError, match=r"\[0, 1152\)"):
        ds.get(torch.tensor([0, 1152]))


# --- damaged shards -----------------------------------------------------------------------


def _damage(split: Path, kind: str) -> str:
    """Damage part-00001 (or the manifest's entry for it); return the problem's words."""
    shard = split / "part-00001.parquet"
    if kind == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return "truncated"
    if kind == "schema":  # the same rows and row groups, labels stored as int32
        table = pq.read_table(shard)
        table = table.set_column(1, "targets", table.column("targets").cast(pa.int32()))
        pq.write_table(table, shard, row_group_size=128, compression="zstd")
        return r"schema \(inputs: list<element: float>, targets: int32\) differs"
    if kind == "checksum":
        data = bytearray(shard.read_bytes())
        data[len(data) // 3] ^= 0xFF  # inside a data page: footer, rows and size unchanged
        shard.write_bytes(bytes(data))
        return "its bytes differ from those written"
    if kind == "missing":
        shard.unlink()
        return "missing"
    if kind == "rows":
        manifest = json.loads((split / MANIFEST).read_text())
        manifest["shards"][1]["rows"] += 1
        (split / MANIFEST).write_text(json.dumps(manifest))
        return "500 rows in the file, manifest says 501"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncated", "schema", "checksum", "missing", "rows"])
def test_a_damaged_shard_is_refused_by_name(tmp_path, kind):
    write_shards("digits", tmp_path, rows_per_shard=500, row_group_rows=128)
    problem = _damage(tmp_path / "train", kind)
    shard = tmp_path / "train" / "part-00001.parquet"  # named by its path: eval has one too
    with pytest.raises(ShardError, match=rf"shard {re.escape(str(shard))}: .*{problem}"):
        ShardedDataset(tmp_path / "train")
    if kind == "checksum":  # verify=False trusts the bytes: only the checksum catches this
        assert len(ShardedDataset(tmp_path / "train", verify=False)) == 1438


def test_unlisted_part_files_and_bad_manifests_are_refused(tmp_path):
    write_shards("digits", tmp_path, rows_per_shard=500)
    split = tmp_path / "train"
    shutil.copy(split / "part-00000.parquet", split / "part-00007.parquet")
    with pytest.raises(ShardError, match="part-00007.parquet: .*not in its manifest"):
        ShardedDataset(split)
    (split / MANIFEST).write_text("{not json")
    with pytest.raises(ShardError, match="unreadable manifest"):
        ShardedDataset(split)


# --- directories without a manifest (Spark's layout) ---------------------------------------


def _spark_like_dir(
    path: Path, columns: dict[str, tuple[np.ndarray, pa.DataType]], parts: int
) -> None:
    """part-NNNNN-<uuid>-c000.snappy.parquet + _SUCCESS + .crc files, Spark's list naming."""
    path.mkdir()
    (path / "_SUCCESS").write_bytes(b"")
    n = len(next(iter(columns.values()))[0])
    for k, rows in enumerate(np.array_split(np.arange(n), parts)):
        arrays = {}
        for name, (values, item) in columns.items():
            if values.ndim == 2:  # array<...> as Spark writes it: list<element: ...>
                width = values.shape[1]
                offsets = pa.array(np.arange(len(rows) + 1, dtype=np.int32) * width)
                arrays[name] = pa.ListArray.from_arrays(
                    offsets,
                    pa.array(values[rows].reshape(-1), type=item),
                    type=pa.list_(pa.field("element", item)),
                )
            else:
                arrays[name] = pa.array(values[rows], type=item)
        name = f"part-{k:05d}-1b2c3d4e-c000.snappy.parquet"
        pq.write_table(pa.table(arrays), path / name, compression="snappy")
        (path / f".{name}.crc").write_bytes(b"crc")


def test_a_spark_directory_without_manifest_is_read_directly(tmp_path):
    digits = load_source("digits", split="train")
    x, y = digits.inputs.flatten(1).numpy(), digits.targets.numpy()
    _spark_like_dir(
        tmp_path / "img", {"label": (y, pa.int64()), "features": (x, pa.float32())}, parts=3
    )
    ds = ShardedDataset(tmp_path / "img")  # the whole directory; load_dataset splits it
    assert ds.spec == TaskSpec("classification", (1, 8, 8), 10)
    assert ds.manifest.shards[0].sha256 is None and len(ds.shard_rows) == 3
    assert ds.manifest.schema[1] == ("features", "list<element: float>")
    got = _read_all(ds)
    assert torch.equal(got.inputs, digits.inputs) and torch.equal(got.targets, digits.targets)

    _spark_like_dir(
        tmp_path / "flat",
        {"features": (np.ones((20, 10)), pa.float64()), "label": (np.arange(20) % 4, pa.int32())},
        parts=2,
    )
    assert ShardedDataset(tmp_path / "flat").spec == TaskSpec("classification", (10,), 4)

    windows = np.random.default_rng(0).integers(0, 256, size=(50, 17))
    _spark_like_dir(tmp_path / "lm", {"tokens": (windows, pa.int32())}, parts=2)
    lm = ShardedDataset(tmp_path / "lm")
    assert lm.spec == TaskSpec("lm", (16,), 256)
    assert torch.equal(_read_all(lm).targets, torch.from_numpy(windows[:, 1:]))


def test_a_spark_directory_serves_disjoint_held_out_splits(tmp_path):
    ids = np.arange(1000)
    _spark_like_dir(
        tmp_path / "d",
        {"features": (np.stack([ids, ids], 1), pa.float64()), "label": (ids % 10, pa.int64())},
        parts=3,
    )
    with pytest.warns(UserWarning, match="no scaletrain manifest.*1 row in 20") as caught:
        train = load_dataset(tmp_path / "d", "train")
        ev = load_dataset(tmp_path / "d", "eval", shuffle_window=64)
    assert len(caught) == 1  # said once, not once per split
    assert isinstance(train, HeldOutSplit) and (len(train), len(ev)) == (950, 50)
    assert sum(train.shard_rows) == 950 and len(train.shard_rows) == 3
    seen = {
        split: _read_all(ds).inputs[:, 0].long() for split, ds in (("train", train), ("eval", ev))
    }
    assert not set(seen["train"].tolist()) & set(seen["eval"].tolist())  # disjoint
    assert torch.equal(torch.cat(list(seen.values())).sort().values, torch.arange(1000))
    assert torch.equal(seen["eval"], torch.from_numpy(np.flatnonzero(eval_mask(1000))))
    assert torch.equal(_read_all(ev).targets, seen["eval"] % 10)  # rows stay whole
    assert set(_read_all(ev).targets.tolist()) == set(range(10))  # label = row % 10 too
    again = load_dataset(tmp_path / "d", "eval")  # another rank, another run: the same rows
    assert torch.equal(_read_all(again).inputs, _read_all(ev).inputs)


def test_a_spark_directory_with_mixed_schemas_is_refused(tmp_path):
    _spark_like_dir(
        tmp_path / "d",
        {"features": (np.ones((20, 4)), pa.float32()), "label": (np.arange(20), pa.int64())},
        parts=2,
    )
    table = pq.read_table(tmp_path / "d" / "part-00001-1b2c3d4e-c000.snappy.parquet")
    pq.write_table(
        table.drop_columns(["label"]), tmp_path / "d" / "part-00001-1b2c3d4e-c000.snappy.parquet"
    )
    with pytest.raises(ShardError, match="part-00001-1b2c3d4e-c000.snappy.parquet: schema"):
        ShardedDataset(tmp_path / "d")


def test_load_dataset_finds_the_split(tmp_path):
    write_shards("digits", tmp_path, rows_per_shard=1000)
    assert len(load_dataset(tmp_path, "eval")) == 359
    assert len(load_dataset(tmp_path / "train", "train")) == 1438
    with pytest.raises(ValueError, match="holds the 'train' split"):
        load_dataset(tmp_path / "train", "eval")
    with pytest.raises(FileNotFoundError, match="no shards"):
        load_dataset(tmp_path / "nothing", "train")
