"""Checkpoint directories on disk: safe reading, manifests, finding the latest valid one.

`checkpoint/__init__.py` decides *what* a checkpoint holds (the Stateful pieces) and drives DCP's
save and load; this module owns everything about the directories themselves, so a tool
that only inspects, verifies or exports a checkpoint (`scaletrain export`, `report`)
needs none of the training state.

Layout and atomicity: DCP writes into `.tmp-step-N/`; when every rank is done, rank 0
(`finalize`) writes `manifest.json` (size and SHA-256 of every file) and renames the
directory to `step-N/`. A crash mid-save leaves only a `.tmp-` directory, which
`list_checkpoints` ignores, so the previous checkpoint stays the latest valid one. The last
`keep` checkpoints are kept; an old one that cannot be removed is reported, not ignored.

Resume: `latest_valid` takes the newest `step-N/` whose files match its manifest; a
truncated or corrupted one is reported and (on the resuming rank 0) moved aside to
`step-N.corrupt-<time>/`, kept for inspection and never pruned, so the next save of step N
has its name free.

Safety: DCP's stock reader unpickles its `.metadata` file and loads non-tensor items with
`torch.load(weights_only=False)`: both can execute code from the checkpoint. Here the
metadata goes through an unpickler that admits only DCP's metadata classes and torch's
dtype/layout/size values (`SafeFileSystemReader`), and non-tensor items are loaded with
`weights_only=True` (`SafeLoadPlanner`). Model and optimizer entries must match the run
exactly: a missing or extra parameter is an error naming it, not a silent partial load.
The cost is that a checkpoint holding anything else (a pickled custom object) is refused.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from scaletrain.runtime import written_atomically

MANIFEST = "manifest.json"


_CHECKPOINT_NAME = re.compile(r"step-\d+")  # step-N.corrupt-<time> and .tmp-step-N are not


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the problem."""


# --------------------------------------------------------------------------- safe loading


# Every global a DCP `.metadata` file of torch's may name, as exact (module, name) pairs.
# Nothing is admitted by module alone: a module's namespace holds what it imports (pickle
# protocol 4 resolves a dotted name such as "os.system" inside any module), and DCP's own
# modules hold functions that load pickles.
_METADATA_GLOBALS = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "StorageMeta",
                "MetadataIndex",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",  # an Enum of memory formats
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # a layout from its name: torch.strided
        ("torch", "Size"),
        *(
            ("torch", str(t).removeprefix("torch."))
            for t in vars(torch).values()
            if isinstance(t, torch.dtype)
        ),
        ("pathlib", "PosixPath"),  # where the checkpoint was written (storage_meta)
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Admit the exact globals DCP's metadata is made of (_METADATA_GLOBALS), nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) not in _METADATA_GLOBALS:
            raise CheckpointError(
                f"checkpoint metadata refers to {module}.{name}, which a checkpoint has no "
                "reason to contain: refusing to load it"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise CheckpointError("checkpoint metadata holds a persistent reference: refusing it")


def read_metadata(path: Path) -> Metadata:
    """A checkpoint's `.metadata`, read with _MetadataUnpickler and checked to be what DCP
    writes: a Metadata whose storage entries each name a plain file of the checkpoint's
    own directory (no path outside it, no stream transform)."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except Exception as e:  # a damaged or hostile pickle: whatever it raised, it is refused
        raise CheckpointError(f"{path}: unreadable metadata ({type(e).__name__}: {e})") from None
    _check_metadata(metadata, path)
    return metadata


def _check_metadata(metadata: object, path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def refuse(why: str):
        raise CheckpointError(f"{path}: not a checkpoint's metadata ({why}): refusing it")

    if type(metadata) is not Metadata or not isinstance(metadata.state_dict_metadata, dict):
        refuse(f"a {type(metadata).__name__}")
    for info in (metadata.storage_data or {}).values():
        if type(info) is not _StorageInfo:
            refuse(f"a storage entry is a {type(info).__name__}")
        name = info.relative_path
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            refuse(f"a storage entry names {name!r}, not a file of its own directory")
        if getattr(info, "transform_descriptors", None):
            refuse(f"{name} is read through transforms {info.transform_descriptors!r}")


class SafeFileSystemReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DefaultLoadPlanner with non-tensor items loaded as weights_only (no code runs).

    Entries added since a checkpoint was written may be missing from it (they keep their
    fresh state), but a model or optimizer entry missing on either side would silently
    leave a parameter at its initial value or drop one: that is refused, naming the keys.
    """

    def __init__(self, *, exact: tuple[str, ...] = ("model.", "optim.")) -> None:
        super().__init__(allow_partial_load=True)
        self.exact = exact

    def create_local_plan(self):
        saved = self.metadata.state_dict_metadata
        missing = sorted(k for k in self.state_dict if k.startswith(self.exact) and k not in saved)
        if missing:
            raise CheckpointError(_does_not_fit("this run needs", missing))
        return super().create_local_plan()

    def create_global_plan(self, global_plan):
        # An entry no rank asks for is one the run would silently drop. Checked over every
        # rank's plan together: a pipeline stage asks for its own blocks only, and the
        # stages together must ask for them all.
        requested = {item.dest_index.fqn for plan in global_plan for item in plan.items}
        saved = self.metadata.state_dict_metadata
        unused = sorted(k for k in saved if k.startswith(self.exact) and k not in requested)
        if unused:
            raise CheckpointError(_does_not_fit("the checkpoint has extra", unused))
        return super().create_global_plan(global_plan)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def quiet_single_process() -> None:
    """Ignore DCP's warning that it "assumes" one process, which it gives on every save and
    load without a process group even given no_dist=True as scaletrain passes it (a
    one-process run and `export` do so on purpose). For the whole process, not around each
    call (`catch_warnings`): an async save warns from DCP's own thread after the call has
    returned, into a worker's log and the console. Called before each DCP call: a filter
    list restored by someone's `catch_warnings` would have dropped one set at import."""
    warnings.filterwarnings(
        "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
    )


# --------------------------------------------------------------------------- directories


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _move_aside(path: Path, why: str) -> Path:
    """Rename `path` to `<name>.<why>-<time>` (never pruned, never loaded) and return it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.{why}-{stamp}"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.{why}-{stamp}-{n}"), n + 1
    os.rename(path, aside)
    return aside


def finalize(tmp: Path, final: Path, *, keep: int, report: Callable[[str], None]) -> None:
    """Rank 0, after every rank has written: manifest, atomic rename, prune old ones."""
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(tmp.iterdir())
        if p.is_file()
    }
    (tmp / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
    if final.exists():  # rename cannot replace a non-empty directory; keep the old one
        aside = _move_aside(final, "replaced")
        report(f"scaletrain: warning: {final.name} already existed; moved it to {aside.name}")
    os.replace(tmp, final)
    for old in list_checkpoints(final.parent)[:-keep]:
        try:
            shutil.rmtree(old)
        except OSError as e:  # a full or read-only disk must not go unnoticed
            report(f"scaletrain: warning: could not remove old checkpoint {old}: {e}")


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (renamed into place), oldest first."""
    if not directory.is_dir():
        return []
    return sorted(
        p for p in directory.iterdir() if p.is_dir() and _CHECKPOINT_NAME.fullmatch(p.name)
    )


def verify(checkpoint: Path, *, hashes: bool = True) -> None:
    """Raise CheckpointError naming the first file that does not match the manifest.

    Args:
        checkpoint: a step-N directory.
        hashes: also compare every file's SHA-256 (reads every byte); False checks that
            every file is there with its size, which catches an interrupted copy or save.
    """
    manifest = checkpoint / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{checkpoint}: no {MANIFEST} (incomplete save)")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{manifest}: unreadable ({e})") from None
    for name, want in files.items():
        path = checkpoint / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        if path.stat().st_size != want["bytes"]:
            raise CheckpointError(
                f"{path}: {path.stat().st_size} bytes, manifest says {want['bytes']} (truncated?)"
            )
        if hashes and file_sha256(path) != want["sha256"]:
            raise CheckpointError(f"{path}: sha256 mismatch (corrupted)")


def latest_valid(
    directory: Path,
    *,
    report: Callable[[str], None] = print,
    quarantine: bool = False,
    hashes: bool = True,
) -> Path | None:
    """The newest checkpoint whose files match its manifest; broken ones are reported.

    Args:
        directory: RUN_DIR/checkpoints.
        report: where the warnings go.
        quarantine: move a broken one aside to `step-N.corrupt-<time>` (the resuming rank 0
            does, so the run's next save of step N finds its name free); else only skip it.
        hashes: see `verify`.
    """
    for checkpoint in reversed(list_checkpoints(directory)):
        try:
            verify(checkpoint, hashes=hashes)
            return checkpoint
        except CheckpointError as e:
            if not quarantine:
                report(f"scaletrain: warning: skipping checkpoint {checkpoint.name}: {e}")
                continue
            aside = _move_aside(checkpoint, "corrupt")
            report(
                f"scaletrain: warning: checkpoint {checkpoint.name} is damaged ({e}); "
                f"moved it to {aside.name} (kept for inspection) and skipped it"
            )
    return None


def export_weights(
    checkpoint: Path,
    out: Path,
    *,
    rename: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Consolidated model weights of a checkpoint as safetensors, no process group.

    Each tensor keeps the dtype it was trained and saved in (float64 under
    precision.mode="fp64"), as the trainer's model.safetensors does.

    Args:
        checkpoint: a checkpoint directory (verified against its manifest first).
        out: the safetensors file to write.
        rename: maps the weights (under the model's own names) to those exported; the
            caller above hands it down: a distilled run's `distill.student.strip_wrapper`
            exports the student alone, as the run's model.safetensors has it.
    """
    from safetensors.torch import save_file

    verify(checkpoint)
    metadata = SafeFileSystemReader(checkpoint).read_metadata()
    model = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    quiet_single_process()
    dcp.load(
        model,
        storage_reader=SafeFileSystemReader(checkpoint),
        planner=SafeLoadPlanner(exact=()),
        no_dist=True,
    )
    weights = {k.removeprefix("model."): v.contiguous() for k, v in model.items()}
    if rename is not None:
        weights = rename(weights)
    with written_atomically(out) as tmp:  # a crash mid-write leaves an older `out` whole
        save_file(weights, str(tmp))
    return out


def _does_not_fit(what: str, keys: list[str]) -> str:
    return (
        f"the checkpoint does not fit this run's model and optimizer: {what} "
        f"{', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} (was model.* or optim.name "
        "changed?)"
    )
