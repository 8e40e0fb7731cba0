"""Every piece of a TrainState survives a checkpoint round trip, in one process: model,
optimizer, schedule, the fp16 loss scaler (scale and growth tracker, moved by real
overflows), overflow and skipped counts, examples and tokens seen, every RNG (torch CPU,
each CUDA device, numpy, python), the comm hook's state (stock PowerSGD's error feedback,
P/Q memory, numpy RNG and statistics; our batched hook's), and the loop's streak, window
and comm byte count. A checkpoint that does not fit the model or optimizer is refused by
name, and per-rank pieces are not restored on another world size."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as stock_powersgd

import scaletrain.checkpoint as checkpoint
from scaletrain.checkpoint import Checkpointer, TrainState, load
from scaletrain.checkpoint.files import CheckpointError, latest_valid
from scaletrain.data.sources import Batch, TaskSpec
from scaletrain.models import build_model
from scaletrain.parallel.comm_hooks import HookState
from scaletrain.precision import make_precision
from scaletrain.training.optim import build_optimizer, build_scheduler
from scaletrain.training.progress import CommCounter, RunProgress, Window
from scaletrain.training.step import train_step

TASK = TaskSpec("classification", (1, 8, 8), 10)


class FakeCuda:
    """Two "GPUs" whose generators are byte tensors, for the RNG piece alone."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.states = [
            torch.randint(0, 256, (16,), dtype=torch.uint8, generator=g) for _ in range(2)
        ]

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.states)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.states]

    def set_rng_state(self, state: torch.Tensor, device: int) -> None:
        self.states[device] = state.clone()


def _powersgd_hook_state(seed: int) -> HookState:
    g = torch.Generator().manual_seed(seed)
    ps = stock_powersgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=1,
        start_powerSGD_iter=2,
        min_compression_rate=1,
        random_seed=seed,
    )
    state = HookState(process_group=None, name="powersgd", powersgd=ps)
    if seed == 0:  # the one that ran: state the fresh one (seed 1) must take over
        ps.rng.randint(1_000_000_000, size=3)  # moved: the next Q initialisation differs
        ps.iter, ps.total_numel_before_compression, ps.total_numel_after_compression = 7, 900, 60
        ps.next_stats_report = 11
        for i, n in ((0, 40), (1, 12)):
            ps.error_dict[i] = torch.randn(n, generator=g)
            ps.p_memory_dict[i] = torch.randn(n // 4, generator=g)
            ps.q_memory_dict[i] = torch.randn(n // 2, generator=g)
        state.layout = {0: (5, 4, 3), 1: (2, 1, 0)}
        state.bytes_sent = 4321
    return state


def _batched_hook_state(seed: int) -> HookState:
    g = torch.Generator().manual_seed(seed)
    state = HookState(process_group=None, name="batched-powersgd", start_iter=2)
    if seed == 0:
        state.iteration, state.bytes_sent = 6, 999
        state.error = {0: torch.randn(36, generator=g)}
        state.q_memory = {0: torch.randn(6, 1, generator=g)}
        state.p_memory = {0: torch.randn(6, 1, generator=g)}
        state.layout = {0: (3, 2, 1, 0)}
    return state


def _state(seed: int, hook: HookState) -> tuple[TrainState, CommCounter]:
    torch.manual_seed(seed)
    model = build_model("mlp", size="tiny", task=TASK, dropout=0.2)
    opt = build_optimizer(
        model, name="adamw", lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), momentum=0.0
    )
    sched = build_scheduler(
        opt, warmup_steps=2, total_steps=10, schedule="cosine", min_lr_ratio=0.1
    )
    # A scale this large overflows fp16 gradients: the scaler halves it, steps are skipped.
    precision = make_precision(
        "fp16-mixed", device_type="cpu", init_scale=2.0**40, growth_interval=2
    )
    comm = CommCounter(model, hook, ddp=False)
    state = TrainState(
        model,
        opt,
        sched,
        precision,
        hook=hook,
        loop=RunProgress(first_step=0, comm=comm),
        tokens_per_example=0,
    )
    return state, comm


def _run_steps(state: TrainState, steps: int) -> None:
    g = torch.Generator().manual_seed(state.step)
    for _ in range(steps):
        batch = Batch(
            torch.randn(8, 1, 8, 8, generator=g),
            torch.randint(0, 10, (8,), generator=g),
            count=8,
            tokens=0,
        )
        result = train_step(
            state.model,
            [batch],
            optimizer=state.optimizer,
            scheduler=state.scheduler,
            precision=state.precision,
            grad_clip=1.0,
            dp_size=1,
            ragged_counts=False,
        )
        state.step += 1
        state.skipped_steps += not result.stepped
        state.examples_seen += 8


def _draws() -> tuple:
    return (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])


@pytest.mark.parametrize("make_hook", [_powersgd_hook_state, _batched_hook_state])
def test_round_trip_restores_every_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_hook
) -> None:
    monkeypatch.setattr(checkpoint._RNG, "cuda", FakeCuda(seed=0))
    state, comm = _state(0, make_hook(0))
    _run_steps(state, 6)
    assert state.skipped_steps >= 2 and state.precision.overflow_steps == state.skipped_steps
    assert state.precision.loss_scale < 2.0**40  # the scale moved
    state.tokens_seen = 12345
    loop = state.loop
    loop.bad_in_row, loop.first_bad, loop.last_loss = 2, "net.3.weight", 1.25
    loop.window = Window(loss_sum=7.5, count=48, steps=3, start=time.perf_counter() - 2.0)
    comm.seen = 4000
    Checkpointer(tmp_path, keep=1, async_save=False, config_toml="").save(state)
    cuda_saved = [s.clone() for s in checkpoint._RNG.cuda.states]
    expected_draws = _draws()
    scaler = state.precision.scaler.state_dict()

    monkeypatch.setattr(checkpoint._RNG, "cuda", FakeCuda(seed=1))  # another "process"
    other, other_comm = _state(1, make_hook(1))
    load(latest_valid(tmp_path), other)

    assert _draws() == expected_draws  # torch, numpy and python RNGs
    assert all(torch.equal(a, b) for a, b in zip(checkpoint._RNG.cuda.states, cuda_saved))
    for (k, a), b in zip(state.model.state_dict().items(), other.model.state_dict().values()):
        assert torch.equal(a, b), k
    sa, sb = state.optimizer.state_dict()["state"], other.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(
        torch.equal(sa[i][k], sb[i][k]) for i in sa for k in ("exp_avg", "exp_avg_sq", "step")
    )
    assert other.scheduler.last_epoch == state.scheduler.last_epoch == 6
    assert other.optimizer.param_groups[0]["lr"] == state.optimizer.param_groups[0]["lr"]
    assert other.precision.scaler.state_dict() == scaler  # scale and growth tracker
    assert other.precision.overflow_steps == state.precision.overflow_steps
    assert (other.step, other.skipped_steps, other.examples_seen, other.tokens_seen) == (
        6,
        state.skipped_steps,
        48,
        12345,
    )
    got = other.loop
    assert (got.bad_in_row, got.first_bad, got.last_loss) == (2, "net.3.weight", 1.25)
    assert (got.window.loss_sum, got.window.count, got.window.steps) == (7.5, 48, 3)
    assert 2.0 <= time.perf_counter() - got.window.start < 60  # elapsed time carried over
    assert other_comm.seen == 4000
    _assert_same_hook_state(other.hook, state.hook)


def _assert_same_hook_state(got: HookState, want: HookState) -> None:
    assert (got.iteration, got.bytes_sent, got.layout) == (
        want.iteration,
        want.bytes_sent,
        want.layout,
    )
    assert got.unchecked == set(want.layout)  # checked against DDP's buckets on first use
    for name in ("error", "q_memory", "p_memory"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.keys() == b.keys() and all(torch.equal(a[i], b[i]) for i in a), name
    if want.powersgd is None:
        return
    a, b = got.powersgd, want.powersgd
    for slot in ("error_dict", "p_memory_dict", "q_memory_dict"):
        x, y = getattr(a, slot), getattr(b, slot)
        assert x.keys() == y.keys() and all(torch.equal(x[i], y[i]) for i in x), slot
    for slot in (
        "iter",
        "total_numel_before_compression",
        "total_numel_after_compression",
        "next_stats_report",
    ):
        assert getattr(a, slot) == getattr(b, slot), slot
    assert a.rng.randint(1_000_000_000) == b.rng.randint(1_000_000_000)  # its Q seeds


def test_per_rank_pieces_start_fresh_on_another_world_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, _ = _state(0, _batched_hook_state(0))
    _run_steps(state, 1)
    state.loop.bad_in_row = 2
    Checkpointer(tmp_path, keep=1, async_save=False, config_toml="").save(state)
    monkeypatch.setattr(checkpoint, "_world_size", lambda: 2)  # saved by 1 rank, loaded by 2
    other, _ = _state(1, _batched_hook_state(1))
    load(latest_valid(tmp_path), other)
    assert other.step == 1 and torch.equal(
        next(iter(other.model.parameters())), next(iter(state.model.parameters()))
    )
    assert other.hook.iteration == 0 and not other.hook.error  # every rank alike: fresh
    assert other.loop.bad_in_row == 0


@pytest.mark.parametrize(
    "hidden, optimizer, needle",
    [
        ((64, 64), "adamw", "this run needs model.net.7.bias"),  # a layer more
        ((32,), "adamw", "cannot be loaded into this run"),  # same names, other shapes
        ((64,), "sgd", "this run needs optim."),  # AdamW's entries saved, SGD's here
    ],
)
def test_a_checkpoint_that_does_not_fit_is_refused_by_name(
    tmp_path: Path, hidden: tuple, optimizer: str, needle: str
) -> None:
    from scaletrain.models.mlp import MLP

    state, _ = _state(0, _batched_hook_state(0))  # MLP tiny: one hidden layer of 64
    _run_steps(state, 1)
    Checkpointer(tmp_path, keep=1, async_save=False, config_toml="").save(state)
    model = MLP(input_shape=TASK.input_shape, num_classes=10, hidden=hidden)
    opt = build_optimizer(
        model, name=optimizer, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), momentum=0.9
    )
    sched = build_scheduler(
        opt, warmup_steps=2, total_steps=10, schedule="cosine", min_lr_ratio=0.1
    )
    other = TrainState(model, opt, sched, make_precision("fp16-mixed", device_type="cpu"))
    with pytest.raises(CheckpointError, match=needle) as e:
        load(latest_valid(tmp_path), other)
    assert "step-00000001" in str(e.value)


class _Bucket:
    """What the hooks read of a DDP GradBucket to know its layout."""

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self._index, self._params = index, params

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return self._params


def test_restored_hook_state_is_used_only_under_the_bucket_layout_it_was_saved_in() -> None:
    from scaletrain.parallel.comm_hooks import _record_layout

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    saved = {
        "iteration": 5,
        "bytes_sent": 0,
        "error.0": torch.ones(6),
        "layout.0": torch.tensor([2, 1, 0]),
    }  # gradient-ready order: a rebuilt bucket
    state = HookState(
        process_group=None,
        name="batched-powersgd",
        positions={id(p): i for i, p in enumerate(params)},
    )
    state.load_state_dict(saved)
    _record_layout(state, _Bucket(0, params[::-1]))
    assert 0 in state.error and not state.unchecked
    state.load_state_dict(saved)
    with pytest.warns(UserWarning, match="bucket 0 holds other parameters"):
        _record_layout(state, _Bucket(0, params))  # a fresh DDP's bucket: forward order
    assert 0 not in state.error and state.layout[0] == (0, 1, 2)
