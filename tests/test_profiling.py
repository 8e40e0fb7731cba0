"""Profiling: log.profile_steps = [2, 3] leaves, on each of 2 ranks, a trace that `json.load`s
(Chrome/Perfetto JSON in RUN_DIR/profile/rank-N/, where TensorBoard's profiler looks) whose
events name train steps 2 and 3 and no other; without it nothing is written.

Also, with torch.cuda's memory calls replaced (no GPU here): an out-of-memory error on CUDA
writes the allocator's snapshot to RUN_DIR/memory/rank-N-oom.pickle and goes on, the run's
history recorded from before the model is built; on CPU, or with log.oom_snapshot = false,
nothing is recorded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import scaletrain.training.trainer as trainer
from scaletrain.config import validate_config
from scaletrain.records.profiling import OOM_HISTORY_ENTRIES, OomSnapshot

from harness import Case, config_toml

CONFIG = config_toml(
    "profiled",
    train={"steps": 4, "global_batch": 16, "micro_batch": 8},
    log={"every": 1, "quiet": True},
)


@pytest.fixture(scope="module")
def runs(trained) -> dict[str, Path]:
    cases = {
        "profiled": Case.of(CONFIG, "parallel.dp=2", "log.profile_steps=[2, 3]"),
        "plain": Case.of(CONFIG, "parallel.dp=2"),
    }
    return {name: r.run_dir for name, r in trained(cases, world_size=2).items()}


def _step_names(trace: dict) -> set[str]:
    return {
        e["name"]
        for e in trace["traceEvents"]
        if isinstance(e, dict) and str(e.get("name", "")).startswith("train_step ")
    }


@pytest.mark.slow
def test_trace_of_the_chosen_steps_on_every_rank(runs: dict[str, Path]) -> None:
    for rank in (0, 1):
        traces = list((runs["profiled"] / "profile" / f"rank-{rank}").glob("*.pt.trace.json"))
        assert len(traces) == 1, traces
        trace = json.loads(traces[0].read_text())
        assert _step_names(trace) == {"train_step 2", "train_step 3"}
        # what a step ran is in it: the gradient all-reduce DDP started inside step 2 or 3
        names = {str(e.get("name")) for e in trace["traceEvents"] if isinstance(e, dict)}
        assert any("all_reduce" in n for n in names), sorted(names)[:50]
    assert not (runs["plain"] / "profile").exists()


# ----------------------------------------------------------------------------- OOM


@pytest.fixture
def cuda_memory(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """torch.cuda.memory's history calls, recorded instead of made."""
    calls: dict[str, list] = {"record": [], "dump": []}
    monkeypatch.setattr(
        torch.cuda.memory,
        "_record_memory_history",
        lambda *a, **kw: calls["record"].append(kw),
    )
    monkeypatch.setattr(
        torch.cuda.memory, "_dump_snapshot", lambda path: calls["dump"].append(path)
    )
    return calls


def test_oom_on_cuda_keeps_the_snapshot_and_the_error_goes_on(tmp_path, cuda_memory) -> None:
    guard = OomSnapshot.arm(True, device=torch.device("cuda", 0), run_dir=tmp_path, rank=3)
    assert cuda_memory["record"][0]["max_entries"] == OOM_HISTORY_ENTRIES
    with pytest.raises(ValueError), guard:  # not an OOM: no snapshot
        raise ValueError("shapes")
    assert cuda_memory["dump"] == []
    with pytest.raises(torch.OutOfMemoryError), guard:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert cuda_memory["dump"] == [str(tmp_path / "memory" / "rank-3-oom.pickle")]
    assert (tmp_path / "memory").is_dir()


@pytest.mark.parametrize("enabled, device", [(True, "cpu"), (False, "cuda")])
def test_no_history_on_cpu_or_when_off(tmp_path, cuda_memory, enabled, device) -> None:
    guard = OomSnapshot.arm(enabled, device=torch.device(device), run_dir=tmp_path, rank=0)
    with pytest.raises(torch.OutOfMemoryError), guard:
        raise torch.OutOfMemoryError("out of memory")
    assert cuda_memory == {"record": [], "dump": []}


def test_trainer_records_from_before_the_build(tmp_path, cuda_memory, monkeypatch) -> None:
    """The trainer's wiring, one process: on a CUDA device the history starts before the
    model is built, and an OOM while building leaves rank 0's snapshot in the run."""
    order = []

    def build(*args, **kwargs):
        order.append(("build", len(cuda_memory["record"])))
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(trainer, "init_distributed", lambda *a, **kw: torch.device("cuda", 0))
    monkeypatch.setattr(trainer, "build", build)
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config = validate_config(
        {
            "model": {"name": "mlp", "size": "tiny"},
            "data": {"source": "digits"},
            "train": {"steps": 1, "global_batch": 4, "micro_batch": 4},
            "log": {"quiet": True},
        }
    )
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train(config, run_dir=tmp_path / "run")
    assert order == [("build", 1)]  # recording began before the build
    assert cuda_memory["dump"] == [str(tmp_path / "run" / "memory" / "rank-0-oom.pickle")]
