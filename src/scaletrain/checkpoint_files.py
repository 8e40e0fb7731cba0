"""Checkpoint directories on disk: safe reading, manifests, finding the latest valid one.

`checkpoint.py` decides *what* a checkpoint holds (the Stateful pieces) and drives DCP's
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

import contextlib
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
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

MANIFEST = "manifest.json"
_CHECKPOINT_NAME = re.compile(r"step-\d+")  # step-N.corrupt-<time> and .tmp-step-N are not


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the problem."""


# --------------------------------------------------------------------------- safe loading


class _MetadataUnpickler(pickle.Unpickler):
    """Admit DCP's metadata dataclasses and plain torch values, nothing that can run code."""

    _TORCH_NAMES = {
        "Size",
        "device",
        "strided",
        "sparse_coo",
        "contiguous_format",
        "channels_last",
        "preserve_format",
        "channels_last_3d",
    }

    _ALLOWED = {
        ("torch.serialization", "_get_layout"),  # how layouts pickle
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),  # file names
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }

    def find_class(self, module: str, name: str):
        if (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "collections" and name in ("OrderedDict", "defaultdict"))
            or (
                module == "builtins"
                and name in ("set", "frozenset", "slice", "tuple", "list", "dict")
            )
        ):
            return super().find_class(module, name)
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and (
            name in self._TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which a "
            "checkpoint has no reason to contain: refusing to load it"
        )


class SafeFileSystemReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        with open(self._get_metadata_path(rank), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

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


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that it "assumes" one process even when told so (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


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
    with single_process_quiet():
        dcp.load(
            model,
            storage_reader=SafeFileSystemReader(checkpoint),
            planner=SafeLoadPlanner(exact=()),
            no_dist=True,
        )
    weights = {k.removeprefix("model."): v.contiguous() for k, v in model.items()}
    if rename is not None:
        weights = rename(weights)
    save_file(weights, str(out))
    return out


def _does_not_fit(what: str, keys: list[str]) -> str:
    return (
        f"the checkpoint does not fit this run's model and optimizer: {what} "
        f"{', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} (was model.* or optim.name "
        "changed?)"
    )
