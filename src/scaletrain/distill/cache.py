"""The teacher-output cache: the teacher's outputs over a dataset, in Parquet, keyed by both.

`scaletrain distill-cache CONFIG OUT_DIR` runs the teacher once over the train and eval
splits, in row order, and writes OUT_DIR/{train,eval}/part-NNNNN.parquet (one row per data
row, one fixed-size list column per output: "logits" (top-k values, with "logits_index",
when distill.top_k > 0), "pooled", "hidden.L", "attn.L", "query.last", "key.last",
"value.last") and OUT_DIR/cache.json, which
records what the outputs depend on:
- the teacher's weights SHA-256 and its dtype;
- each split's data fingerprint: the SHA-256 of every row's inputs, extras and targets in
  row order (the data as the trainer sees them, whichever source or shards they come from),
  and the row count; for Parquet shards with a manifest, also the manifest's (each shard's
  SHA-256), which a run checks instead of rehashing every row (`same_data`);
- which outputs, their shapes, top_k, and the teacher's layer count and width.
The outputs are streamed (`CachedDataset`): a row group at a time, as batches need them.
A run with distill.cache checks all of it before the first step: other data, another
teacher (distill.teacher's weights, whatever kind of teacher it is, or distill.teacher_sha256
when the cache is given alone), another teacher dtype or an output the cache
lacks is refused with a message naming the difference; a cache is never silently reused.
Then no teacher is loaded: each batch carries its rows' outputs (`Batch.teacher`).

Outputs are stored in the dtype the teacher computed: float32, float64, or bfloat16 as its
16 bits in an int16 column (half the bytes of float32, lossless: a bf16 value is what the
teacher gave). What a recipe reads decides the size: pooled (D) and the mapped hidden
states (T x D each) are ~50 KB a row per state at T = 64 and D = 384 in bf16; an attention
map (H x T x T) is twice a hidden state, which is why the MiniLM recipes train without
attention maps. The relation term (distill.relation_weight) reads the last layer's query, key
and value (3 x T x D: three hidden states, ~147 KB a row at T = 64, D = 384 in bf16), from
which the loss computes both relations as online; the contrastive term reads "pooled" (D:
768 bytes in bf16), nothing more where the pooled cosine already cached it. A cache holds every output its config needs, so another recipe on the same
data and teacher whose needs are a subset (the 2-layer MiniLM student's states {0, 5, 6} in
the 3-layer's {0, 1, 5, 6}) reads the same cache: it is written once.

In fp64 a cached run reads exactly what the online teacher gives; in fp32 and
bf16 the teacher's kernels differ with threads and batch size, so the outputs agree to about
1e-5 (fp32) or one ulp (bf16), not bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from scaletrain.data.loader import Dataset
from scaletrain.data.sources import Batch
from scaletrain.user_code import UserCodeError

INFO = "cache.json"
ROWS_PER_FILE = 8192
CHUNK = 256  # rows per teacher forward while writing, and per hashing read
# A row group's target size (`_group_rows`): a streamed read decodes a whole row group for one
# row, and batches draw rows at random, so a batch of B rows decodes ~B row groups. At 256 KiB
# a row group holds one row of the MiniLM recipe's cache (~200 KB: four 64 x 384 bf16 states),
# and 32 random rows decode in ~40 ms; at 4 MiB (21 such rows) they took ~800 ms, more than
# the teacher's forward the cache replaces. Narrow rows (logits) still group by CHUNK.
ROW_GROUP_BYTES = 256 * 2**10
MIN_GROUP_ROWS = 1


class CacheError(UserCodeError):
    """A cache that does not fit the run; one line, exit status 2."""


def data_fingerprint(ds: Dataset) -> str:
    """SHA-256 of every row's inputs, extras and targets, in row order, and the task."""
    h = hashlib.sha256(repr(ds.spec).encode())
    for start in range(0, len(ds), CHUNK):
        b = ds.get(torch.arange(start, min(start + CHUNK, len(ds))))
        for name, t in [("inputs", b.inputs), ("targets", b.targets), *sorted(b.extras.items())]:
            h.update(name.encode())
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def manifest_fingerprint(ds: Dataset) -> str | None:
    """SHA-256 of a Parquet-shard split's manifest entries (each shard's name, rows, size
    and SHA-256, which the reader checks on open) and the task: a cheap check of the same
    data, as strict as rehashing every row. None for data without checksummed shards."""
    manifest = getattr(ds, "manifest", None)
    shards = getattr(manifest, "shards", ())
    if not shards or any(s.sha256 is None for s in shards):
        return None
    h = hashlib.sha256(repr(ds.spec).encode())
    for s in shards:
        h.update(f"{s.file}:{s.rows}:{s.bytes}:{s.sha256}".encode())
    return h.hexdigest()


def same_data(part: dict, ds: Dataset) -> bool:
    """The data a cache split was written for is `ds`: by the manifest where the split has
    one (read at open, no row decoded), else by every row's hash."""
    if part["rows"] != len(ds):
        return False
    cheap = manifest_fingerprint(ds)
    if cheap is not None and part.get("manifest_sha256"):
        return cheap == part["manifest_sha256"]
    return part["data_sha256"] == data_fingerprint(ds)


def write_cache(
    out_dir: Path,
    *,
    splits: dict[str, Dataset],
    targets_fn,
    info: dict,
    top_k: int,
    report=print,
    advance=lambda rows: None,
) -> dict:
    """Write each split's teacher outputs and cache.json; returns the info written.

    Args:
        out_dir: the cache directory (created; an existing cache.json is refused).
        splits: "train" and "eval" datasets.
        targets_fn: batch -> dict of teacher outputs (objective.teacher_targets).
        info: the teacher's sha256, dtype, source, layers and width, and the needs.
        top_k: logits kept per example or token (0 = all).
        report: one line per split written.
        advance: called with each chunk's row count once it is written (a progress bar).
    """
    out_dir = Path(out_dir)
    if (out_dir / INFO).exists():
        raise CacheError(
            f"{str(out_dir)!r} already holds a cache ({INFO}); remove it or choose "
            "another directory (a cache is never overwritten in place)"
        )
    info = {**info, "top_k": top_k, "splits": {}}
    for split, ds in splits.items():
        (out_dir / split).mkdir(parents=True, exist_ok=True)
        shapes, writer, part, rows_in_file = {}, None, 0, 0
        for start in range(0, len(ds), CHUNK):
            batch = ds.get(torch.arange(start, min(start + CHUNK, len(ds))))
            outputs = _top_k(targets_fn(batch), top_k)
            table = _to_table(outputs, shapes)
            if writer is None or rows_in_file >= ROWS_PER_FILE:
                if writer is not None:
                    writer.close()
                writer = pq.ParquetWriter(
                    out_dir / split / f"part-{part:05d}.parquet", table.schema
                )
                part, rows_in_file = part + 1, 0
            writer.write_table(table, row_group_size=_group_rows(table))
            rows_in_file += table.num_rows
            advance(table.num_rows)
        if writer is not None:
            writer.close()
        info["splits"][split] = {
            "rows": len(ds),
            "data_sha256": data_fingerprint(ds),
            "manifest_sha256": manifest_fingerprint(ds),
            "shapes": shapes,
        }
        report(f"scaletrain: cached {len(ds)} {split} rows ({', '.join(shapes)})")
    (out_dir / INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _group_rows(table: pa.Table) -> int:
    """Rows per row group: CHUNK, fewer for wide rows (hidden states of long sequences), so
    that a row group, what a streamed read decodes for one row, stays near ROW_GROUP_BYTES."""
    row_bytes = max(1, table.nbytes // max(1, table.num_rows))
    return max(MIN_GROUP_ROWS, min(CHUNK, ROW_GROUP_BYTES // row_bytes))


def _top_k(outputs: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    if k <= 0 or "logits" not in outputs or outputs["logits"].shape[-1] <= k:
        return outputs
    values, index = outputs["logits"].topk(k, dim=-1)
    return {**outputs, "logits": values, "logits_index": index}


def _to_table(outputs: dict[str, torch.Tensor], shapes: dict) -> pa.Table:
    columns = {}
    for key, t in outputs.items():
        t = t.detach()
        if t.is_floating_point() and t.dtype not in (torch.float64, torch.bfloat16):
            t = t.float()  # fp16 is exact in fp32
        shapes[key] = {"shape": list(t.shape[1:]), "dtype": str(t.dtype).removeprefix("torch.")}
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)  # the bits: numpy has no bfloat16 (`_from_bits` undoes it)
        flat = t.reshape(t.shape[0], -1).numpy()
        columns[key] = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
    return pa.table(columns)


def read_info(cache_dir: str | Path) -> dict:
    path = Path(cache_dir).expanduser() / INFO
    if not path.is_file():
        raise CacheError(
            f"distill.cache = {str(cache_dir)!r} has no {INFO}: not a cache written "
            "by `scaletrain distill-cache CONFIG OUT_DIR`"
        )
    return json.loads(path.read_text())


def check_cache(
    info: dict,
    *,
    cache_dir: str,
    split: str,
    ds: Dataset,
    needs_keys: list[str],
    teacher_sha256: str | None,
    teacher_dtype: str,
    teacher_key: str = "distill.teacher",
) -> None:
    """Refuse a cache made for other data, another teacher or dtype, or lacking an output.

    Args:
        teacher_sha256: the run's teacher (None: not known, not checked).
        teacher_key: where that SHA-256 comes from, for the message ("distill.teacher" or
            "distill.teacher_sha256").
    """
    where = f"distill.cache = {cache_dir!r}"
    check_cache_teacher(
        info, cache_dir=cache_dir, teacher_sha256=teacher_sha256, teacher_key=teacher_key
    )
    part = info["splits"].get(split)
    if part is None:
        raise CacheError(f"{where} has no {split!r} split")
    if not same_data(part, ds):
        raise CacheError(
            f"{where} was written for other {split} data ({part['rows']} rows, data "
            f"SHA-256 {part['data_sha256'][:12]}...) than this run's ({len(ds)} rows): "
            "the data changed since `scaletrain distill-cache`; write the cache again"
        )
    if teacher_dtype != info["teacher_dtype"]:
        raise CacheError(
            f"{where} was computed with the teacher in {info['teacher_dtype']}, this "
            f"run's distill.teacher_precision gives {teacher_dtype}"
        )
    missing = [k for k in needs_keys if k not in part["shapes"]]
    if missing:
        keys = sorted({_read_by(k) for k in missing})
        raise CacheError(
            f"{where} lacks the teacher outputs {missing} this run's [distill] "
            f"weights need ({', '.join(keys)}; it holds {sorted(part['shapes'])}); write "
            "it with this config"
        )


def _read_by(output: str) -> str:
    """The [distill] key whose term reads a cached output (for a refusal's message)."""
    kind = output.split(".", 1)[0]
    return {
        "logits": "distill.alpha or distill.cosine_on = 'logits'",
        "pooled": "distill.cosine_weight or distill.contrastive_weight",
        "hidden": "distill.hidden_weight",
        "attn": "distill.attention_weight",
    }.get(kind, "distill.relation_weight")  # query.last, key.last, value.last


def check_cache_teacher(
    info: dict, *, cache_dir: str, teacher_sha256: str | None, teacher_key: str = "distill.teacher"
) -> None:
    """Refuse a cache of another teacher than the run's (its weights' SHA-256)."""
    if teacher_sha256 is None or teacher_sha256.lower() == info["teacher_sha256"]:
        return
    raise CacheError(
        f"distill.cache = {cache_dir!r} holds the outputs of another teacher "
        f"(weights SHA-256 {info['teacher_sha256'][:12]}..., {teacher_key} gives "
        f"{teacher_sha256.lower()[:12]}...): write the cache again for this teacher"
    )


class CachedDataset:
    """A dataset whose batches carry their rows' cached teacher outputs, streamed: the
    cache's Parquet row groups are read as batches need them and only the last one read is
    kept (`cache_row_groups`), so the cache's resident memory is one row group plus the
    batch's own rows, whatever the cache's size. Rows are found through the files' footers
    (row counts per row group); no output is read at open. Each file is opened (memory-mapped)
    on its first read and stays open: a cache of wide rows has a row group per row, and a
    footer of a few MB that must not be parsed again for every row."""

    def __init__(
        self,
        base: Dataset,
        cache_dir: Path,
        *,
        split: str,
        shapes: dict,
        cache_row_groups: int = 1,
    ) -> None:
        self.base, self.spec = base, base.spec
        self.shapes, self.cache_row_groups = shapes, cache_row_groups
        self.files = sorted((cache_dir / split).glob("part-*.parquet"))
        self.groups: list[tuple[int, int]] = []  # global row group -> (file, row group)
        sizes = []
        for f, path in enumerate(self.files):
            meta = pq.ParquetFile(path).metadata
            for r in range(meta.num_row_groups):
                self.groups.append((f, r))
                sizes.append(meta.row_group(r).num_rows)
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # (G + 1,)
        if int(self.starts[-1]) != len(base):
            raise CacheError(
                f"{cache_dir / split}: {int(self.starts[-1])} cached rows for {len(base)} "
                "data rows: write the cache again"
            )
        self.held: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()  # decoded groups
        self.row_groups_read = 0
        self._open: dict[int, pq.ParquetFile] = {}  # file -> its reader, opened on first read

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}}  # a copy in another process opens its own

    def __len__(self) -> int:
        return len(self.base)

    @property
    def shard_rows(self) -> tuple[int, ...]:
        return self.base.shard_rows

    def prefetch(self, indices: torch.Tensor) -> None:
        self.base.prefetch(indices)

    def resident_bytes(self) -> int:
        """The bytes of the decoded row groups held now (the cache's share of memory)."""
        return sum(t.numel() * t.element_size() for g in self.held.values() for t in g.values())

    def get(self, indices: torch.Tensor) -> Batch:
        batch = self.base.get(indices)
        idx = np.asarray(indices, dtype=np.int64)
        group = np.searchsorted(self.starts, idx, side="right") - 1  # (B,)
        out = {
            k: torch.empty(
                (len(idx), *meta["shape"]), dtype=getattr(torch, meta["dtype"])
            )  # (B, ...)
            for k, meta in self.shapes.items()
        }
        for g in np.unique(group).tolist():  # each row group once per batch
            pos = torch.from_numpy(np.flatnonzero(group == g))
            rows = torch.from_numpy(idx[pos.numpy()] - self.starts[g])
            for k, values in self._row_group(g).items():
                out[k].index_copy_(0, pos, values.index_select(0, rows))
        return replace(batch, teacher=out)

    def _row_group(self, g: int) -> dict[str, torch.Tensor]:
        if g in self.held:
            self.held.move_to_end(g)
            return self.held[g]
        f, r = self.groups[g]
        if f not in self._open:
            self._open[f] = pq.ParquetFile(self.files[f], memory_map=True)
        table = self._open[f].read_row_group(r, columns=list(self.shapes))
        decoded = {}
        for key, meta in self.shapes.items():
            column = table.column(key).combine_chunks()
            flat = np.array(column.flatten()).reshape(table.num_rows, -1)  # a writable copy
            decoded[key] = _from_bits(torch.from_numpy(flat), meta["dtype"]).view(
                table.num_rows, *meta["shape"]
            )
        self.row_groups_read += 1
        self.held[g] = decoded
        while len(self.held) > self.cache_row_groups:
            self.held.popitem(last=False)
        return decoded


def _from_bits(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """A column's values as the dtype the cache recorded (bfloat16 is stored as its bits)."""
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def with_cache(
    ds: Dataset,
    cache_dir: str,
    *,
    split: str,
    needs_keys: list[str] | None = None,
    teacher_sha256: str | None = None,
    teacher_dtype: str | None = None,
    teacher_key: str = "distill.teacher",
) -> CachedDataset:
    """`ds` with the cache's outputs for `split`, after `check_cache` (when the run's needs are given)."""
    info = read_info(cache_dir)
    if needs_keys is not None:
        check_cache(
            info,
            cache_dir=cache_dir,
            split=split,
            ds=ds,
            needs_keys=needs_keys,
            teacher_sha256=teacher_sha256,
            teacher_dtype=teacher_dtype or info["teacher_dtype"],
            teacher_key=teacher_key,
        )
    shapes = info["splits"][split]["shapes"]
    return CachedDataset(ds, Path(cache_dir).expanduser(), split=split, shapes=shapes)
