"""The benchmarks' straggler (bench/straggler.py), which bench/ps.py and the staleness tests
slow one rank with: the built-in model unchanged, and on the slowed rank each training
forward + backward followed by one sleep of (factor - 1) x its time; nothing on evaluation
or on any other rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from scaletrain import TaskSpec
from scaletrain.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import straggler  # noqa: E402

TASK = TaskSpec(kind="classification", input_shape=(64,), num_classes=10)


class FakeClock:
    """perf_counter advancing 1 s a read; sleeps recorded, not slept."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(straggler.time, "perf_counter", fake.perf_counter)
    monkeypatch.setattr(straggler.time, "sleep", fake.sleep)
    return fake


def _step(net: torch.nn.Module) -> None:
    net(torch.randn(4, 64)).sum().backward()


def _straggler(monkeypatch: pytest.MonkeyPatch, *, rank: int, seed: int = 0) -> torch.nn.Module:
    """An mlp tiny through the factory on RANK `rank`, rank 1 slowed 3x."""
    monkeypatch.setenv("RANK", str(rank))
    kwargs = dict(model="mlp", size="tiny", slow_rank=1, factor=3.0)
    return build_model("straggler:build", size="small", task=TASK, seed=seed, kwargs=kwargs)


def test_the_slowed_rank_sleeps_once_per_backward(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = _straggler(monkeypatch, rank=1)
    _step(net)
    assert clock.slept == [2 * 1.0]  # (3 - 1) x the one second between the two reads
    with torch.no_grad():
        net(torch.randn(4, 64))  # evaluation: not slowed
    _step(net)
    _step(net)
    assert clock.slept == [2.0, 2.0, 2.0]  # one sleep per backward, not one more each time


def test_other_ranks_and_the_weights_are_the_built_in_models(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = _straggler(monkeypatch, rank=0, seed=3)
    _step(net)
    assert clock.slept == []
    plain = build_model("mlp", size="tiny", task=TASK, seed=3)
    assert net.state_dict().keys() == plain.state_dict().keys()
    for name, value in plain.state_dict().items():
        assert torch.equal(net.state_dict()[name], value), name
