"""precision.mode = "auto" by measurement (training/auto_precision.py): the faster of fp32
and bf16-mixed on the configured model's own step, decided here with a fake clock (no test
depends on how fast the machine is); the table where bf16 is emulated or on a GPU; the
result cached; a resumed run keeps its mode; the workers get the mode the launcher chose."""

from __future__ import annotations

from pathlib import Path

import pytest

import scaletrain.training.auto_precision as auto
from scaletrain.config import load_config
from scaletrain.launch.resolve import resolve
from scaletrain.precision import Hardware

GPT = [
    "model.name=gpt",
    "model.size=tiny",
    "data.source=wikitext",
    "data.seq_len=32",
    "train.micro_batch=4",
    "train.global_batch=4",
    "precision.mode=auto",
]


class FakeClock:
    """Each step advances the clock by the seconds it is given; nothing is timed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def step(self, *seconds: float):
        left = list(seconds)

        def run() -> None:
            self.now += left.pop(0)

        return run


def test_the_mode_with_the_lower_median_step_wins() -> None:
    clock = FakeClock()
    # bf16's second step is slow (the machine was busy): its median still wins
    steps = {
        "fp32": clock.step(9.0, 0.30, 0.31, 0.29),
        "bf16-mixed": clock.step(9.0, 0.2, 5.0, 0.21),
    }
    mode, medians = auto.faster(steps, clock=clock)
    assert mode == "bf16-mixed" and medians == pytest.approx({"fp32": 0.30, "bf16-mixed": 0.21})
    clock = FakeClock()
    steps = {
        "fp32": clock.step(1.0, 0.10, 0.10, 0.10),
        "bf16-mixed": clock.step(1.0, 0.2, 0.2, 0.2),
    }
    assert auto.faster(steps, clock=clock)[0] == "fp32"  # bf16 that does not pay is not run


def _config(*extra: str):
    return load_config(None, [*GPT, *extra])


def test_where_bf16_is_emulated_auto_keeps_fp32_without_measuring(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(
        auto, "detect_hardware", lambda device: Hardware("cpu", cpu_capability="AVX2")
    )
    monkeypatch.setattr(auto, "_steps", lambda *a, **k: pytest.fail("measured"))
    choice = auto.probe(_config(), threads=1, cache=tmp_path / "c.json")
    assert choice.mode == "fp32" and "emulated" in choice.why and choice.seconds is None


def test_a_measurement_is_cached_per_machine_and_job(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(auto, "detect_hardware", lambda device: Hardware("cpu", avx512_bf16=True))
    calls = []
    monkeypatch.setattr(auto, "_steps", lambda config, **k: calls.append(config) or {})
    monkeypatch.setattr(
        auto, "faster", lambda steps: ("bf16-mixed", {"fp32": 0.3, "bf16-mixed": 0.2})
    )
    cache = tmp_path / "auto.json"
    first = auto.probe(_config(), threads=2, cache=cache)
    again = auto.probe(_config(), threads=2, cache=cache)
    assert first.mode == again.mode == "bf16-mixed" and len(calls) == 1
    assert "before" in again.why and again.seconds == {"fp32": 0.3, "bf16-mixed": 0.2}
    auto.probe(_config(), threads=1, cache=cache)  # other threads: measured again
    auto.probe(_config("model.size=small"), threads=2, cache=cache)  # another model too
    assert len(calls) == 3


def test_a_real_probe_times_both_modes_of_the_models_own_step(tmp_path) -> None:
    """The two steps run (a real build, nothing asserted about which is faster)."""
    steps = auto._steps(_config(), threads=1, code=auto.NO_CODE)
    assert sorted(steps) == ["bf16-mixed", "fp32"]
    for step in steps.values():
        step()


def test_auto_resolves_once_and_a_resumed_run_keeps_its_mode(monkeypatch) -> None:
    measured = auto.AutoChoice("bf16-mixed", "measured", {"fp32": 2.0, "bf16-mixed": 1.0})
    monkeypatch.setattr(auto, "probe", lambda config, **k: measured)
    config = _config()
    derived = resolve(config, world_size=1)
    resolved, choice = auto.resolve_auto(config, derived)
    assert resolved.precision.mode == "bf16-mixed" and choice is measured
    kept, choice = auto.resolve_auto(config, derived, resumed_mode="fp32")
    assert kept.precision.mode == "fp32" and "resumed" in choice.why
    # a run from before the probe resolved auto in every worker: it stays auto
    old, _ = auto.resolve_auto(config, derived, resumed_mode="auto")
    assert old.precision.mode == "auto"
    plain, none = auto.resolve_auto(_config("precision.mode=fp32"), derived)
    assert plain.precision.mode == "fp32" and none is None


def test_the_launcher_hands_its_choice_to_the_workers(monkeypatch, tmp_path: Path) -> None:
    """`scaletrain train` resolves auto once and the run trains in that mode (its summary and
    its config.toml say so); --resume keeps it even where the probe would now say otherwise."""
    from harness import cli_main

    chosen = ["fp32"]
    monkeypatch.setattr(
        auto, "probe", lambda config, **k: auto.AutoChoice(chosen[0], "measured", None)
    )
    run, cfg = tmp_path / "run", tmp_path / "c.toml"
    cfg.write_text("")
    common = ["train", str(cfg), "--run-dir", str(run), *GPT, "train.steps=2", "log.quiet=true"]
    assert cli_main([*common, "train.stop_after=1", "checkpoint.every=1"]) == 0
    assert 'mode = "fp32"' in (run / "config.toml").read_text()
    chosen[0] = "bf16-mixed"  # the probe would now choose otherwise
    assert cli_main([*common, "checkpoint.every=1", "--resume"]) == 0
    import json

    assert json.loads((run / "summary.json").read_text())["precision"] == "fp32"
