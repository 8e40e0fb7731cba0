"""Checkpoints: every stateful piece of a run, saved and restored together.

What is saved (torch.distributed.checkpoint, one directory per checkpoint):
    model      parameters by plain name (DDP prefix stripped by get_state_dict)
    optim      optimizer moments and param groups
    scheduler  LR schedule position
    precision  loss scaler (fp16-mixed) and overflow count
    rng        every rank's torch / numpy / python RNG state, under its own key
    progress   step, skipped steps (the data position follows from the step: the sampler is
               a pure function of (seed, epoch, step))
plus `config.toml` (the resolved config) and `manifest.json` (SHA-256 of every file).

Atomic: DCP writes into `.tmp-step-N/`; when every rank is done, rank 0 writes the
manifest and renames the directory to `step-N/`. A crash mid-save leaves only a `.tmp-`
directory, which is ignored, so the previous checkpoint stays the latest valid one. On
load, the newest `step-N/` whose files match its manifest wins; a truncated or corrupted
one is reported and skipped. The last `keep` checkpoints are kept.

Safety: DCP's stock reader unpickles its `.metadata` file and loads non-tensor items with
`torch.load(weights_only=False)`: both can execute code from the checkpoint. Here the
metadata goes through an unpickler that admits only DCP's metadata classes and torch's
dtype/layout/size values, and non-tensor items are loaded with `weights_only=True`.

Resharding: DDP replicas hold the same state, so a checkpoint written by 2 ranks loads into
1 or 4; each rank takes its own RNG entry when it exists (else keeps its seeded state).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from scaletrain.runtime import barrier

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the problem."""


# --------------------------------------------------------------------------- safe loading


class _MetadataUnpickler(pickle.Unpickler):
    """Admit DCP's metadata dataclasses and plain torch values, nothing that can run code."""

    _TORCH_NAMES = {"Size", "device", "strided", "sparse_coo", "contiguous_format",
                    "channels_last", "preserve_format", "channels_last_3d"}

    _ALLOWED = {("torch.serialization", "_get_layout"),  # how layouts pickle
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # file names
                ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (
            module == "collections" and name in ("OrderedDict", "defaultdict")
        ) or (module == "builtins" and name in ("set", "frozenset", "slice", "tuple", "list",
                                                "dict")):
            return super().find_class(module, name)
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and (name in self._TORCH_NAMES
                                  or isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}, which a "
                              "checkpoint has no reason to contain: refusing to load it")


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
    """DefaultLoadPlanner with non-tensor items loaded as weights_only (no code runs)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# --------------------------------------------------------------------------- state


def _rng_state() -> dict[str, torch.Tensor]:
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy_key": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_state[4]], dtype=torch.float64),
        "python": torch.tensor([py_version, *py_state], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if py_gauss is None else py_gauss]),
    }


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    pos, has_gauss = (int(x) for x in state["numpy_pos"])
    np.random.set_state(("MT19937", state["numpy_key"].numpy().astype(np.uint32), pos, has_gauss,
                         float(state["numpy_gauss"][0])))
    py = [int(x) for x in state["python"]]
    gauss = float(state["python_gauss"][0])
    random.setstate((py[0], tuple(py[1:]), None if gauss != gauss else gauss))


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it "assumes" one process even when told so (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass
class TrainState:
    """Everything the loop needs to continue: the pieces a checkpoint holds."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: object  # scaletrain.precision.Precision (state_dict / load_state_dict)
    step: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sched = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": sched,
            "precision": self.precision.state_dict(),
            "rng": {f"rank{_rank()}": _rng_state()},
            "progress": {"step": torch.tensor(self.step), "skipped": torch.tensor(self.skipped_steps)},
        }

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=StateDictOptions(strict=True))
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **state["scheduler"]})
        self.precision.load_state_dict(state["precision"])
        mine = state["rng"].get(f"rank{_rank()}")
        if mine:  # a rank that did not exist when saving keeps its seeded state
            _set_rng_state(mine)
        self.step = int(state["progress"]["step"])
        self.skipped_steps = int(state["progress"]["skipped"])


# --------------------------------------------------------------------------- save / load


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _finalize(tmp: Path, final: Path, *, keep: int) -> None:
    """Rank 0, after every rank has written: manifest, atomic rename, prune old ones."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
    os.replace(tmp, final)
    for old in list_checkpoints(final.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _finish_async(future: Future, tmp: Path, final: Path, keep: int) -> None:
    future.result()
    _finalize(tmp, final, keep=keep)


@dataclass
class Checkpointer:
    """Saves TrainStates under `directory` every so often, synchronously or in the background.

    Args (fields):
        directory: RUN_DIR/checkpoints.
        keep: how many complete checkpoints to keep.
        async_save: overlap writing with the following steps (DCP async_save on its own
            gloo group, so its collectives never interleave with the training ones).
        config_toml: the resolved config, stored in each checkpoint.
    """

    directory: Path
    keep: int
    async_save: bool
    config_toml: str
    _pending: Future | None = field(default=None, repr=False)
    _finisher: ThreadPoolExecutor | None = field(default=None, repr=False)
    _group: object = field(default=None, repr=False)
    _stager: object = field(default=None, repr=False)

    def save(self, state: TrainState) -> None:
        self.wait()  # at most one save in flight
        tmp = self.directory / f".tmp-step-{state.step:08d}"
        final = self.directory / f"step-{state.step:08d}"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            (tmp / "config.toml").write_text(self.config_toml)
        barrier()
        sd = state.state_dict()
        with _single_process_quiet():
            self._write(sd, tmp, final)

    def _write(self, sd: dict, tmp: Path, final: Path) -> None:
        if self.async_save:
            if self._group is None and dist.is_initialized():
                self._group = dist.new_group(backend="gloo")
            if self._stager is None:
                # The default stager copies into fresh shared memory on every save (page
                # faults: ~3x slower on CPU); plain CPU copies, staged before returning so
                # the next optimizer step cannot change what is being written.
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                cuda = torch.cuda.is_available()
                self._stager = DefaultStager(StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                    use_non_blocking_copy=cuda))
            future = dcp.async_save(sd, checkpoint_id=tmp, process_group=self._group,
                                    async_stager=self._stager, no_dist=not dist.is_initialized())
            if _rank() == 0:
                # Rank 0's future resolves after DCP's coordinator has gathered every rank's
                # write results and written the metadata: all data is on disk. The manifest
                # (hashing every byte) and the rename then run off the training thread too.
                if self._finisher is None:
                    self._finisher = ThreadPoolExecutor(max_workers=1)
                future = self._finisher.submit(_finish_async, future, tmp, final, self.keep)
            self._pending = future
        else:
            dcp.save(sd, checkpoint_id=tmp, no_dist=not dist.is_initialized())
            barrier()
            if _rank() == 0:
                _finalize(tmp, final, keep=self.keep)
            barrier()

    def close(self) -> None:
        """Finish any save in flight and release the staging buffers."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._finisher is not None:
            self._finisher.shutdown()
            self._finisher = None

    def wait(self) -> None:
        """Block until a save in flight is written (and, on rank 0, renamed into place)."""
        if self._pending is not None:
            future, self._pending = self._pending, None
            future.result()



def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (renamed into place), oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith("step-"))


def verify(checkpoint: Path) -> None:
    """Raise CheckpointError naming the first file that does not match the manifest."""
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
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, manifest says "
                                  f"{want['bytes']} (truncated?)")
        if _sha256(path) != want["sha256"]:
            raise CheckpointError(f"{path}: sha256 mismatch (corrupted)")


def latest_valid(directory: Path, *, report=print) -> Path | None:
    """The newest checkpoint whose files match its manifest; broken ones are reported."""
    for checkpoint in reversed(list_checkpoints(directory)):
        try:
            verify(checkpoint)
            return checkpoint
        except CheckpointError as e:
            report(f"scaletrain: warning: skipping checkpoint {checkpoint.name}: {e}")
    return None


def load(checkpoint: Path, state: TrainState) -> None:
    """Restore `state` in place from a verified checkpoint (any world size)."""
    sd = state.state_dict()
    sd["rng"] = _all_rng_keys(checkpoint)
    with _single_process_quiet():
        dcp.load(sd, storage_reader=SafeFileSystemReader(checkpoint),
                 planner=SafeLoadPlanner(allow_partial_load=True),
                 no_dist=not dist.is_initialized())
    state.load_state_dict(sd)


def _all_rng_keys(checkpoint: Path) -> dict:
    """Placeholders for the RNG entries this rank can take (its own, if it was saved)."""
    metadata = SafeFileSystemReader(checkpoint).read_metadata()
    key = f"rng.rank{_rank()}."
    mine = {k.removeprefix(key): v for k, v in metadata.state_dict_metadata.items()
            if k.startswith(key)}
    if not mine:
        return {}
    return {f"rank{_rank()}": {name: torch.empty(meta.size, dtype=meta.properties.dtype)
                               for name, meta in mine.items()}}


def export_weights(checkpoint: Path, out: Path) -> Path:
    """Consolidated fp32 model weights of a checkpoint as safetensors, no process group."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    verify(checkpoint)
    metadata = SafeFileSystemReader(checkpoint).read_metadata()
    model = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with _single_process_quiet():
        dcp.load(model, storage_reader=SafeFileSystemReader(checkpoint),
                 planner=SafeLoadPlanner(allow_partial_load=True), no_dist=True)
    save_file({k.removeprefix("model."): v.float().contiguous() for k, v in model.items()},
              str(out))
    return out
