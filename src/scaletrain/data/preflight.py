"""Pre-launch data checks: refuse data that cannot train before any worker starts.

`check_data` is called by the command line after the config is validated and before the
launcher spawns a process, so that a wrong `data.path`, a model that does not fit the
data, a `data.seq_len` the text shards were not written at, or a truncated or damaged
shard is one message and exit status 2, not an error from every rank a minute later. It
reads metadata only: the manifests, every shard's footer (checked against the manifest's
sizes, rows and footer checksums by `open_split`), and for a directory without a manifest
(plain Spark output) the first row of one file. That is one small read per shard. Hashing
every byte would read the whole dataset at each launch and each `scaletrain explain`, so
the full SHA-256, which alone sees a flip inside a data page, is left to `ShardedDataset`
in the workers, as are labels and the other rows.

It takes explicit arguments, not the `Config`, so that `data/` does not import the
config; each message names the config key, the value and what is allowed, like a
`ConfigError`, and `DataCheckError` is a ValueError like it, so the caller can show it the
same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from scaletrain.data.holdout import EVAL_EVERY
from scaletrain.data.manifest import (
    MANIFEST,
    ShardError,
    find_split_dir,
    infer_task,
    open_split,
    read_footers,
    read_manifest,
)
from scaletrain.data.sources import SPLITS, TASK_KINDS
from scaletrain.errors import UserError

# The task kinds each model name trains on: the built-ins as in models/__init__.py's
# registry (kept here so data/ imports no model code), and "hf" (a Hugging Face causal LM);
# a user's factory ("package.module:function") is not checked here. And the smallest image
# side the CNN accepts (models/cnn.py MIN_SIDE). tests/test_data_preflight.py checks both
# stay in step.
MODEL_KINDS: dict[str, frozenset[str]] = {
    "mlp": frozenset({"classification", "regression"}),
    "cnn": frozenset({"classification"}),
    "gpt": frozenset({"lm"}),
    "hf": frozenset({"lm"}),
}
CNN_MIN_SIDE = 8
_DATA_WORDS = {
    "classification": "classification data",
    "regression": "regression data",
    "lm": "text",
}


class DataCheckError(UserError):
    """The data at `data.path` cannot train this config; the message says why and the fix."""


def check_data(*, source: str, path: str, seq_len: int, model_name: str) -> str | None:
    """Check `data.*` against the data on disk, reading metadata only.

    Args:
        source: `data.source`; only "shards" is checked (built-in sources are checked by
            the config itself).
        path: `data.path`: a `scaletrain shard` output (train/ and eval/), one split
            directory, or a Parquet directory without a manifest (Spark's output).
        seq_len: `data.seq_len`; for text shards it must equal the seq_len they were
            written at.
        model_name: `model.name`; the data's task kind must be one it trains on
            (`MODEL_KINDS`; other names, such as an import path, are not checked here).

    Returns a note for the user when the data are usable but worth a word (a directory
    without a manifest, whose eval split is held out of its rows), else None.

    Raises:
        DataCheckError: the path is missing, a file, or holds no shards, a split is missing, the
            model does not fit the data's task, seq_len differs from the shards', or a shard
            is missing, truncated or has a damaged footer.
    """
    if source != "shards":
        return None
    root = Path(path)
    if not root.is_dir():
        what = "is a file" if root.exists() else "does not exist"
        raise DataCheckError(
            f"data.path = {path!r} {what}; it must be the directory "
            f"`scaletrain shard SOURCE OUT_DIR` (or a Spark job) wrote"
        )
    dirs = {split: find_split_dir(root, split) for split in SPLITS}
    if dirs["train"] is None:
        raise DataCheckError(
            f"data.path = {path!r} is not a shard directory: neither it nor "
            f"{str(root / 'train')!r} holds {MANIFEST} or part-*.parquet "
            f"files; write shards there with `scaletrain shard SOURCE "
            f"OUT_DIR`, or point data.path at such a directory"
        )
    if dirs["eval"] is None:
        raise DataCheckError(
            f"data.path = {path!r} has a train split ({dirs['train']}) but no "
            f"eval split: expected {str(root / 'eval')!r} next to it, with "
            f"{MANIFEST} or part-*.parquet files"
        )
    kind, shape = _describe(dirs["train"], path=path)
    _check_model(kind, shape, model_name=model_name, path=path)
    if kind == "lm" and shape[0] != seq_len:
        written = shape[0]
        raise DataCheckError(
            f"data.seq_len = {seq_len} differs from the seq_len the text "
            f"shards at data.path = {path!r} were written at ({written}); "
            f"set data.seq_len={written}, or write the shards again with "
            f"`scaletrain shard SOURCE OUT_DIR --seq-len {seq_len}`"
        )
    _check_files(dirs.values(), path=path)
    if not (dirs["train"] / MANIFEST).exists():
        return (
            f"data.path = {path!r} has no scaletrain manifest: eval is 1 row in "
            f"{EVAL_EVERY} of its rows, held out of training (the same rows on every rank "
            f"and run)"
        )
    return None


def _describe(split_dir: Path, *, path: str) -> tuple[str, tuple[int, ...]]:
    """The split's task kind and example shape: from its manifest, or inferred from footers
    and one row (labels unread)."""
    try:
        if (split_dir / MANIFEST).exists():
            task = read_manifest(split_dir).task
            return task.kind, task.input_shape
        return infer_task(split_dir)
    except ShardError as e:
        raise DataCheckError(f"data.path = {path!r}: {e}") from None


def _check_files(split_dirs: Iterable[Path], *, path: str) -> None:
    """Every shard's footer, and with a manifest its size, rows and footer checksum."""
    for split_dir in dict.fromkeys(split_dirs):  # one directory may serve both splits
        try:
            if (split_dir / MANIFEST).exists():
                open_split(split_dir, verify=False)
            else:
                read_footers(split_dir)
        except ShardError as e:
            raise DataCheckError(f"data.path = {path!r}: {e}") from None


def _kinds_words(kinds: list[str]) -> str:
    """ "classification data or regression data (task kind 'classification' or 'regression')"."""
    return (
        " or ".join(_DATA_WORDS[k] for k in kinds)
        + f" (task kind {' or '.join(repr(k) for k in kinds)})"
    )


def _check_model(kind: str, shape: tuple[int, ...], *, model_name: str, path: str) -> None:
    kinds = MODEL_KINDS.get(model_name)
    if kinds is None:
        return  # a user's model (an import path): its factory decides
    data = (
        f"the shards at data.path = {path!r} hold {_DATA_WORDS[kind]} (task kind "
        f"{kind!r}, examples of shape {shape})"
    )
    if kind not in kinds:
        fitting = ", ".join(repr(m) for m, ks in MODEL_KINDS.items() if kind in ks)
        needs = _kinds_words([k for k in TASK_KINDS if k in kinds])
        raise DataCheckError(
            f"model.name = {model_name!r} needs {needs}, but {data}; models "
            f"for this data: {fitting or 'none built in'}"
        )
    if model_name == "cnn" and (len(shape) != 3 or min(shape[1:]) < CNN_MIN_SIDE):
        raise DataCheckError(
            f"model.name = 'cnn' needs images (C, H, W) of at least "
            f"{CNN_MIN_SIDE}x{CNN_MIN_SIDE}, but {data}; use model.name='mlp' "
            f"for flat features"
        )
