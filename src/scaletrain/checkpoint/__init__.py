"""Checkpoints: every stateful piece of a run, saved and restored together.

What is saved (torch.distributed.checkpoint, one directory per checkpoint). Each piece is a
DCP `Stateful` (state_dict / load_state_dict) under its own key, so `dcp.load` restores it
in place:
    model        parameters by plain name (no DDP prefix: get_model_state_dict)
    optim        optimizer moments and param groups, keyed by parameter name
    scheduler    LR schedule position
    precision    fp16-mixed's loss scaler (scale, growth tracker) and the overflow count
    progress     step, skipped steps, examples and tokens seen (the data position follows
                 from the step: the sampler is a pure function of (seed, epoch, step))
    rng.rankR    rank R's torch CPU, CUDA (every device, when present), numpy and python
                 RNG states
    hook.rankR   rank R's DDP comm hook state (parallel/comm_hooks.py): iteration, error
                 feedback, P/Q memory, bytes sent, the bucket layout they are keyed by, and
                 for torch's PowerSGD its numpy RNG and compression statistics
    loop.rankR   rank R's loop state (the trainer's RunProgress): the bad-step streak, the
                 last logged loss, the open metrics window, the comm counter's position
    diloco       under parallel.strategy = 'diloco' (parallel/diloco.py): the inner-step
                 position, the anchors and outer momentum (sharded like the parameters),
                 each island's counts since each fragment synced, the outer updates due;
                 diloco_sent.rankR: the bytes rank R has sent to the other islands
plus `config.toml` (the resolved config) and `manifest.json` (SHA-256 of every file).

Per-rank pieces differ between ranks (error feedback and a window's loss sum are local), so
every rank writes its own entry and takes back its own. Their key sets can grow as a run
goes (PowerSGD adds tensors per bucket), so on load the template comes from the
checkpoint's metadata, not from the fresh objects.

On disk (checkpoint/files.py): DCP writes into `.tmp-step-N/`, which rank 0 renames to
`step-N/` once every rank is done and the manifest is written, so a crash mid-save never
leaves a half checkpoint that looks complete. Loading goes through that module's safe
reader and planner: no pickled code runs, and the model and optimizer must fit exactly.
This module decides what goes in and drives DCP; that one owns the directories.

DiLoCo's islands hold different parameters and inner optimizer states between syncs, so
under it `model` and `optim` are saved per island (`model.islandK.<name>`); within an island
they reshard as any layout's do, and a resume needs as many islands as were saved.

Resharding: DDP replicas hold the same model and optimizer, so a checkpoint written by 2
ranks loads into 1 or 4; each rank takes its own RNG entry when it exists (else keeps its
seeded state). The comm hook and loop entries are restored only on the same world size
(error feedback and per-rank loss sums do not redistribute); on another one they start
fresh on every rank alike, so no rank compresses while another does not.
"""

from __future__ import annotations

import random
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from scaletrain.checkpoint.files import (
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    finalize,
    quiet_single_process,
)
from scaletrain.runtime import barrier


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the pieces


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@dataclass
class _Model:
    """Parameters by plain name (get_model_state_dict drops the DDP prefix)."""

    model: torch.nn.Module

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=True))


# Flattened: every entry, moments and hyper-parameters alike, is keyed by parameter name
# ("state.blocks.0.attn.q.weight.exp_avg", "param_groups.blocks.0.attn.q.weight.lr"), not
# by group index, so a layout with another number of parameter groups (tensor parallelism
# keeps DTensors apart: training/optim.py) or another share of the parameters (a pipeline
# stage) reads exactly its own.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class _Optimizer:
    """Optimizer state keyed by parameter name, so it loads into any layout and world size."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer, options=_FLAT)

    def load_state_dict(self, state: dict) -> None:
        # The kernels are this run's choice, not the checkpoint's (training/optim.py picks
        # them for the layout): a DDP run's fused Adagrad or SGD loaded as fused under FSDP
        # would meet DTensors, which those fused kernels have no rule for.
        kernels = [
            {k: group[k] for k in ("fused", "foreach") if k in group}
            for group in self.optimizer.param_groups
        ]
        set_optimizer_state_dict(self.model, self.optimizer, state, options=_FLAT)
        for group, own in zip(self.optimizer.param_groups, kernels, strict=True):
            group.update(own)


@dataclass
class _Schedule:
    """The schedule's position. Its lambdas and base LRs are rebuilt from the config: the
    base LRs are one per parameter group, and the number of groups depends on the layout
    (training/optim.py), so a checkpoint of one layout would set the wrong count in another."""

    scheduler: torch.optim.lr_scheduler.LRScheduler

    def state_dict(self) -> dict:
        return {
            k: v
            for k, v in self.scheduler.state_dict().items()
            if k not in ("lr_lambdas", "base_lrs", "_last_lr")
        }

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **state})


@dataclass
class _Progress:
    """The counters that say where the run is."""

    state: TrainState

    def state_dict(self) -> dict[str, torch.Tensor]:
        s = self.state
        return {
            "step": torch.tensor(s.step),
            "skipped": torch.tensor(s.skipped_steps),
            "examples_seen": torch.tensor(s.examples_seen),
            "tokens_seen": torch.tensor(s.tokens_seen),
        }

    def load_state_dict(self, state: dict) -> None:
        s = self.state
        s.step, s.skipped_steps = int(state["step"]), int(state["skipped"])
        s.examples_seen, s.tokens_seen = int(state["examples_seen"]), int(state["tokens_seen"])


class _RNG:
    """This process's RNGs: torch CPU, every CUDA device, numpy, python."""

    cuda = torch.cuda  # a class attribute, so a test can stand in a fake GPU for this alone

    def state_dict(self) -> dict[str, torch.Tensor]:
        np_state = np.random.get_state()
        py_version, py_state, py_gauss = random.getstate()
        state = {
            "torch": torch.get_rng_state(),
            "numpy_key": torch.from_numpy(np_state[1].astype(np.int64)),
            "numpy_pos": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
            "numpy_gauss": torch.tensor([np_state[4]], dtype=torch.float64),
            "python": torch.tensor([py_version, *py_state], dtype=torch.int64),
            "python_gauss": torch.tensor([float("nan") if py_gauss is None else py_gauss]),
        }
        if self.cuda.is_available():  # dropout on a GPU draws from the device's generator
            state.update({f"cuda.{i}": s for i, s in enumerate(self.cuda.get_rng_state_all())})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["torch"])
        pos, has_gauss = (int(x) for x in state["numpy_pos"])
        np.random.set_state(
            (
                "MT19937",
                state["numpy_key"].numpy().astype(np.uint32),
                pos,
                has_gauss,
                float(state["numpy_gauss"][0]),
            )
        )
        py = [int(x) for x in state["python"]]
        gauss = float(state["python_gauss"][0])
        random.setstate((py[0], tuple(py[1:]), None if gauss != gauss else gauss))
        devices = self.cuda.device_count() if self.cuda.is_available() else 0
        for key, value in state.items():  # a device this process lacks keeps nothing
            if key.startswith("cuda.") and int(key.removeprefix("cuda.")) < devices:
                self.cuda.set_rng_state(value, int(key.removeprefix("cuda.")))


class _PerRank:
    """A piece that differs between ranks, saved as `rank{R}`; each rank takes back its own.

    Args:
        piece: the Stateful; its state_dict must be flat ({name: tensor or plain value}).
        any_world: restore it on another world size too (RNGs); else only on the same one.
    """

    def __init__(self, piece: Stateful, *, any_world: bool) -> None:
        self.piece = piece
        self.any_world = any_world
        self.template: dict | None = None  # on load: placeholders from the metadata

    def state_dict(self) -> dict:
        return {
            f"rank{_rank()}": self.piece.state_dict() if self.template is None else self.template
        }

    def load_state_dict(self, state: dict) -> None:
        mine = state.get(f"rank{_rank()}")
        if mine:  # a rank that did not exist when saving keeps its fresh state
            self.piece.load_state_dict(mine)


@dataclass
class _Island:
    """A piece that differs between DiLoCo's islands, saved as `island{K}`: the islands'
    keys differ, so DCP keeps each (it keeps one copy of a key every rank saves alike)."""

    piece: Stateful
    island: int

    def state_dict(self) -> dict:
        return {f"island{self.island}": self.piece.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.piece.load_state_dict(state[f"island{self.island}"])


@dataclass
class TrainState:
    """Everything the loop needs to continue: the pieces a checkpoint holds.

    The trainer fills `hook` (the comm hook's HookState, None without one) and `loop` (its
    RunProgress); both are DCP Statefuls with flat state dicts.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Stateful  # scaletrain.precision.Precision
    step: int = 0
    skipped_steps: int = 0
    examples_seen: int = 0  # over every rank, since step 0
    tokens_seen: int = 0  # input tokens (text), over every rank, since step 0
    hook: Stateful | None = None
    loop: Stateful | None = None
    tokens_per_example: int = 0  # text: input tokens per example, for tokens_seen (not saved)
    diloco: object | None = None  # parallel.diloco.DiLoCo under parallel.strategy = 'diloco'

    def pieces(self) -> dict[str, Stateful]:
        """The Statefuls a checkpoint holds, by key (see the module docstring)."""
        model, optim = _Model(self.model), _Optimizer(self.model, self.optimizer)
        if self.diloco is not None:  # the islands' own weights and inner optimizers
            model, optim = _Island(model, self.diloco.island), _Island(optim, self.diloco.island)
        pieces = {
            "model": model,
            "optim": optim,
            "scheduler": _Schedule(self.scheduler),
            "precision": self.precision,
            "progress": _Progress(self),
            "rng": _PerRank(_RNG(), any_world=True),
        }
        if self.hook is not None:
            pieces["hook"] = _PerRank(self.hook, any_world=False)
        if self.loop is not None:
            pieces["loop"] = _PerRank(self.loop, any_world=False)
        if self.diloco is not None:
            pieces["diloco"] = self.diloco
            pieces["diloco_sent"] = _PerRank(self.diloco.sent, any_world=False)
        return pieces


# --------------------------------------------------------------------------- save / load


def _finish_async(
    future: Future, tmp: Path, final: Path, keep: int, report: Callable[[str], None]
) -> None:
    future.result()
    finalize(tmp, final, keep=keep, report=report)


@dataclass
class Checkpointer:
    """Saves TrainStates under `directory` every so often, synchronously or in the background.

    Args (fields):
        directory: RUN_DIR/checkpoints.
        keep: how many complete checkpoints to keep.
        async_save: overlap writing with the following steps (DCP async_save on its own
            gloo group, so its collectives never interleave with the training ones).
        config_toml: the resolved config, stored in each checkpoint.
        report: where warnings go (a checkpoint that could not be pruned); stderr.
        every: save every this many steps (checkpoint.every; 0: only on a stop).
    """

    directory: Path
    keep: int
    async_save: bool
    config_toml: str
    report: Callable[[str], None] = _to_stderr
    every: int = 0
    _pending: Future | None = field(default=None, repr=False)
    _finisher: ThreadPoolExecutor | None = field(default=None, repr=False)
    _group: object = field(default=None, repr=False)
    _stager: object = field(default=None, repr=False)

    def due(self, step: int, *, stop: bool = False) -> bool:
        """Whether to save once `step` steps are done: on the schedule, or at a stop (a
        planned train.stop_after, a SIGTERM) whatever the schedule."""
        return stop or (self.every > 0 and step % self.every == 0)

    def save(self, state: TrainState) -> None:
        self.wait()  # at most one save in flight
        tmp = self.directory / f".tmp-step-{state.step:08d}"
        final = self.directory / f"step-{state.step:08d}"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            (tmp / "config.toml").write_text(self.config_toml)
        barrier()
        quiet_single_process()
        self._write(state.pieces(), tmp, final)

    def _write(self, pieces: dict[str, Stateful], tmp: Path, final: Path) -> None:
        if self.async_save:
            if self._group is None and dist.is_initialized():
                self._group = dist.new_group(backend="gloo")
            if self._stager is None:
                # The default stager copies into fresh shared memory on every save (page
                # faults: ~3x slower on CPU); plain CPU copies, staged before returning so
                # the next optimizer step cannot change what is being written.
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                cuda = torch.cuda.is_available()
                self._stager = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=cuda,
                        use_shared_memory=False,
                        use_async_staging=False,
                        use_non_blocking_copy=cuda,
                    )
                )
            # DCP calls every piece's state_dict() now, before staging returns.
            future = dcp.async_save(
                pieces,
                checkpoint_id=tmp,
                process_group=self._group,
                async_stager=self._stager,
                no_dist=not dist.is_initialized(),
            )
            if _rank() == 0:
                # Rank 0's future resolves after DCP's coordinator has gathered every rank's
                # write results and written the metadata: all data is on disk. The manifest
                # (hashing every byte) and the rename then run off the training thread too.
                if self._finisher is None:
                    self._finisher = ThreadPoolExecutor(max_workers=1)
                future = self._finisher.submit(
                    _finish_async, future, tmp, final, self.keep, self.report
                )
            self._pending = future
        else:
            dcp.save(pieces, checkpoint_id=tmp, no_dist=not dist.is_initialized())
            barrier()
            if _rank() == 0:
                finalize(tmp, final, keep=self.keep, report=self.report)
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


def load(checkpoint: Path, state: TrainState) -> None:
    """Restore `state` in place from a verified checkpoint (any world size; see Resharding).

    Raises:
        CheckpointError: the checkpoint is unsafe, or does not fit this run's model and
            optimizer (a changed model or optimizer), with the reason.
    """
    metadata = SafeFileSystemReader(checkpoint).read_metadata()
    _check_islands(checkpoint, metadata, state)
    same_world = _saved_world_size(metadata) == _world_size()
    pieces = state.pieces()
    for name, piece in list(pieces.items()):
        if isinstance(piece, _PerRank):
            if not (piece.any_world or same_world):
                del pieces[name]  # starts fresh, on every rank alike
                continue
            piece.template = _saved_entries(metadata, f"{name}.rank{_rank()}.")
    quiet_single_process()
    try:
        dcp.load(
            pieces,
            storage_reader=SafeFileSystemReader(checkpoint),
            planner=SafeLoadPlanner(),
            no_dist=not dist.is_initialized(),
        )
    except (CheckpointError, CheckpointException, RuntimeError, KeyError, ValueError) as e:
        cause = _first_failure(e)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(f"{checkpoint}: {cause}") from None
        first_line = (str(cause).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"{checkpoint}: cannot be loaded into this run ({type(cause).__name__}: {first_line})"
        ) from e


def _first_failure(error: BaseException) -> BaseException:
    """The underlying exception: DCP wraps each rank's in a CheckpointException."""
    if isinstance(error, CheckpointException) and error.failures:
        return next(iter(error.failures.values()))[0]
    return error


def _check_islands(checkpoint: Path, metadata: Metadata, state: TrainState) -> None:
    """A DiLoCo checkpoint resumes as DiLoCo with as many islands, and only so."""
    saved = {
        key.split(".")[1] for key in metadata.state_dict_metadata if key.startswith("model.island")
    }
    islands = state.diloco.islands if state.diloco is not None else 0
    if len(saved) == islands:
        return
    if not saved:
        raise CheckpointError(
            f"{checkpoint} was not written under parallel.strategy = 'diloco'; it resumes "
            "under the strategy it was written with"
        )
    raise CheckpointError(
        f"{checkpoint} holds {len(saved)} DiLoCo islands' weights; this run has "
        + (f"{islands} (parallel.dp_replicate)" if islands else "no islands (the strategy)")
        + f": resume with parallel.strategy='diloco' and parallel.dp_replicate={len(saved)} "
        "(the layout inside each island may change)"
    )


def _saved_world_size(metadata: Metadata) -> int:
    """Every rank saves its RNG under rng.rankR, so the saved ranks are in the metadata."""
    return len(
        {key.split(".")[1] for key in metadata.state_dict_metadata if key.startswith("rng.rank")}
    )


def _saved_entries(metadata: Metadata, prefix: str) -> dict:
    """Placeholders for the entries under `prefix`, keyed by the rest of their name: a
    tensor of the saved size and dtype, or None for a plain value."""
    return {
        key.removeprefix(prefix): torch.empty(meta.size, dtype=meta.properties.dtype)
        if isinstance(meta, TensorStorageMetadata)
        else None
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
    }
