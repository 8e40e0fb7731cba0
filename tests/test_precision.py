"""Precision policies, in one process through the real train step: fp16 overflow skips the
step and lowers the scale; bf16-mixed trains within tolerance of fp32; `auto` picks bf16 on
hardware with fast bf16 (a decision table over torch's capability checks); fp64 keeps every
tensor in float64; persistent overflow names the first parameter that overflowed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.data.sources import load_source
from scaletrain.models import build_model
from scaletrain.precision import (
    PRECISION_MODES,
    Hardware,
    choose_auto,
    decide_auto,
    detect_hardware,
    make_precision,
)
from scaletrain.training.optim import build_optimizer, build_scheduler
from scaletrain.training.step import train_step


def _setup(mode: str, *, init_scale: float = 2.0**16, seed: int = 0, lr: float = 3e-3):
    torch.manual_seed(seed)
    data = load_source("digits", split="train")
    model = build_model("mlp", size="small", task=data.spec)
    precision = make_precision(mode, device_type="cpu", init_scale=init_scale)
    model = precision.convert_module(model)
    opt = build_optimizer(
        model, name="adamw", lr=lr, weight_decay=0.0, betas=(0.9, 0.999), momentum=0.0
    )
    sched = build_scheduler(
        opt, warmup_steps=0, total_steps=100, schedule="constant", min_lr_ratio=1.0
    )
    sampler = GlobalBatchSampler(
        len(data), global_batch=64, micro_batch=32, dp_rank=0, dp_size=1, seed=seed
    )
    return data, model, precision, opt, sched, sampler


def _step(data, model, precision, opt, sched, sampler, step: int):
    micro = [data.get(i) for i in sampler.micro_batches(step)]
    return train_step(
        model,
        micro,
        optimizer=opt,
        scheduler=sched,
        precision=precision,
        grad_clip=1.0,
        dp_size=1,
        ragged_counts=False,
    )


def _train(mode: str, steps: int) -> tuple[float, float]:
    """(mean loss of the last 10 steps, eval accuracy)."""
    data, model, precision, opt, sched, sampler = _setup(mode)
    losses = []
    for step in range(steps):
        r = _step(data, model, precision, opt, sched, sampler, step)
        losses.append(float(r.loss_sum) / r.count)
    evals = load_source("digits", split="eval")
    with torch.no_grad(), precision.forward_context():
        acc = float(
            (model(precision.convert_input(evals.inputs)).argmax(-1) == evals.targets)
            .float()
            .mean()
        )
    return sum(losses[-10:]) / 10, acc


def test_fp16_overflow_skips_the_step_and_lowers_the_scale() -> None:
    # A loss scale of 2^40 overflows fp16 (max 65504) in the first backward.
    data, model, precision, opt, sched, sampler = _setup("fp16-mixed", init_scale=2.0**40)
    before = copy.deepcopy(model.state_dict())
    r = _step(data, model, precision, opt, sched, sampler, 0)
    assert not r.stepped and r.first_nonfinite is not None
    assert precision.loss_scale == 2.0**39 and precision.overflow_steps == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    for step in range(1, 40):  # the scale falls until steps go through
        r = _step(data, model, precision, opt, sched, sampler, step)
    assert r.stepped and precision.loss_scale < 2.0**39
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fp16_clean_steps_grow_the_scale() -> None:
    data, model, precision, opt, sched, sampler = _setup("fp16-mixed", init_scale=256.0)
    precision.scaler.set_growth_factor(2.0)
    precision.scaler._growth_interval = 3
    for step in range(3):
        assert _step(data, model, precision, opt, sched, sampler, step).stepped
    assert precision.loss_scale == 512.0


class _MatmulDtypes(TorchDispatchMode):
    """Records the input dtypes of every matmul that actually runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.seen |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "mode,matmul_dtype",
    [("bf16-mixed", torch.bfloat16), ("fp32", torch.float32), ("fp64", torch.float64)],
)
def test_matmuls_run_in_the_mode_s_dtype(mode: str, matmul_dtype: torch.dtype) -> None:
    # A no-op forward context would leave bf16-mixed's matmuls in fp32: this sees it.
    data, model, precision, opt, sched, sampler = _setup(mode)
    micro = [data.get(i) for i in sampler.micro_batches(0)]
    with _MatmulDtypes() as seen:
        with precision.forward_context():
            model(precision.convert_input(micro[0].inputs))
    assert seen.seen == {matmul_dtype}, (mode, seen.seen)


def test_bf16_mixed_trains_within_tolerance_of_fp32() -> None:
    loss32, acc32 = _train("fp32", 60)
    loss16, acc16 = _train("bf16-mixed", 60)
    assert abs(loss16 - loss32) < 0.05 + 0.1 * loss32, (loss32, loss16)
    assert abs(acc16 - acc32) < 0.03, (acc32, acc16)
    assert acc32 > 0.9


def test_fp64_keeps_parameters_gradients_and_optimizer_state_in_float64() -> None:
    data, model, precision, opt, sched, sampler = _setup("fp64")
    r = _step(data, model, precision, opt, sched, sampler, 0)
    assert r.stepped and r.loss_sum.dtype == torch.float64
    assert all(p.dtype == torch.float64 for p in model.parameters())
    moments = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert moments and all(m.dtype == torch.float64 for m in moments)


def test_bf16_true_keeps_parameters_in_bf16_and_learns() -> None:
    data, model, precision, opt, sched, sampler = _setup("bf16-true")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    first = _step(data, model, precision, opt, sched, sampler, 0)
    for step in range(1, 40):
        last = _step(data, model, precision, opt, sched, sampler, step)
    assert float(last.loss_sum) / last.count < 0.5 * float(first.loss_sum) / first.count


@pytest.mark.parametrize(
    "hw,mode",
    [
        (Hardware("cpu", avx512_bf16=True, amx=True), "bf16-mixed"),
        (Hardware("cpu", avx512_bf16=True, amx=False), "bf16-mixed"),
        (Hardware("cpu", avx512_bf16=False, amx=True), "bf16-mixed"),
        (Hardware("cpu", avx512_bf16=False, amx=False), "fp32"),
        (Hardware("cuda", cuda_capability=(9, 0)), "bf16-mixed"),
        (Hardware("cuda", cuda_capability=(8, 0)), "bf16-mixed"),
        (Hardware("cuda", cuda_capability=(7, 5)), "fp32"),
    ],
)
def test_auto_decision_table(hw: Hardware, mode: str) -> None:
    chosen, why = decide_auto(hw)
    assert chosen == mode and why


def test_auto_on_this_machine_uses_torch_s_own_checks() -> None:
    hw = detect_hardware("cpu")
    assert hw.avx512_bf16 == torch.cpu._is_avx512_bf16_supported()
    assert hw.amx == torch.cpu._is_amx_tile_supported()
    assert choose_auto("cpu") == decide_auto(hw)
    assert make_precision("auto", device_type="cpu").mode == decide_auto(hw)[0]


def test_every_mode_builds_and_bad_mode_is_refused() -> None:
    for mode in PRECISION_MODES:
        make_precision(mode, device_type="cpu")
    with pytest.raises(ValueError, match="fp8"):
        make_precision("fp8", device_type="cpu")


@pytest.mark.parametrize(
    "capability, avx512_bf16, amx, slow",
    [
        ("AVX2", False, False, True),  # this kind of machine: bf16 emulated, ~100x slower
        ("AVX512", False, False, True),
        ("AVX512", True, False, False),
        ("AVX512", False, True, False),
    ],
)
def test_a_precision_slower_than_fp32_on_this_cpu_is_warned(
    capability: str,
    avx512_bf16: bool,
    amx: bool,
    slow: bool,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`explain` (and `train`: the trainer logs resolve's warnings on rank 0) says when the
    precision asked for runs slower than fp32 on this CPU, naming its capability and the
    missing instruction sets; `auto` never warns, it picks fp32 there."""
    from scaletrain.config import validate_config
    from scaletrain.launch.resolve import resolve

    from harness import cli_main, forbid_starting

    forbid_starting(monkeypatch, tmp_path)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        '[model]\nname = "mlp"\n[data]\nsource = "digits"\n'
        "[train]\nsteps = 2\nglobal_batch = 8\nmicro_batch = 8\n"
    )

    for mode in ("bf16-mixed", "bf16-true", "auto"):
        assert cli_main(["explain", str(cfg), f"precision.mode={mode}"]) == 0
        out, err = capsys.readouterr()
        warned = [line for line in err.splitlines() if "slower than fp32" in line]
        if slow and mode != "auto":
            assert len(warned) == 1 and warned[0].startswith("scaletrain: warning: "), err
            assert f"precision.mode = {mode!r}" in warned[0]
            assert f"capability {capability}" in warned[0]
            assert "avx512_bf16" in warned[0] and "AMX" in warned[0] and "'auto'" in warned[0]
        else:
            assert not warned, err
        if mode == "auto":
            assert ("auto -> fp32" if slow else "auto -> bf16-mixed") in out, out
    config = validate_config({"precision": {"mode": "bf16-mixed"}})
    warnings = resolve(config, world_size=1, nproc_per_node=1).warnings  # the trainer's
    assert any("slower than fp32" in w for w in warnings) == slow


def test_fp16_warning_no_longer_recommends_bf16_blindly(monkeypatch: pytest.MonkeyPatch) -> None:
    from scaletrain.config import validate_config
    from scaletrain.launch.resolve import resolve

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    warnings = resolve(
        validate_config({"precision": {"mode": "fp16-mixed"}}), world_size=1, nproc_per_node=1
    ).warnings
    fp16 = [w for w in warnings if "fp16-mixed" in w]
    assert len(fp16) == 1 and "capability AVX2" in fp16[0] and "'auto'" in fp16[0], warnings
    assert "use 'bf16-mixed'" not in fp16[0]
