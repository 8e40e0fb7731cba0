"""The built-in GPU profiles (runtime/hardware.py, issue 44 item 7): which one a CUDA device gets, by
its exact name, with its memory from the device; the datasheet rates of each part; and
TF32 as a precision choice (precision.tf32) that sets torch's flags and the rate the
planner counts fp32 matmuls at. No GPU is needed: torch.cuda's answers are mocked.
"""

from __future__ import annotations

import types

import pytest
import torch

GIB = 2**30

# device name (as torch.cuda.get_device_name reports it) -> (the part's built-in profile,
# its dense fp64 / fp32 / tf32 / bf16 TFLOP/s from the part's NVIDIA datasheet)
PARTS = {
    "NVIDIA A100-SXM4-40GB": ("a100-sxm4-40gb", (19.5, 19.5, 156, 312)),
    "NVIDIA A100-SXM4-80GB": ("a100-sxm4-80gb", (19.5, 19.5, 156, 312)),
    "NVIDIA A100-PCIE-40GB": ("a100-pcie-40gb", (19.5, 19.5, 156, 312)),
    "NVIDIA A100 80GB PCIe": ("a100-pcie-80gb", (19.5, 19.5, 156, 312)),
    "NVIDIA H100 80GB HBM3": ("h100-sxm", (67, 67, 494.5, 989.5)),
    "NVIDIA H100 PCIe": ("h100-pcie", (51, 51, 378, 756.5)),
    "NVIDIA H100 NVL": ("h100-nvl", (60, 60, 417.5, 835.5)),
    "NVIDIA H200": ("h200-sxm", (67, 67, 494.5, 989.5)),
    "NVIDIA H200 NVL": ("h200-nvl", (60, 60, 417.5, 835.5)),
}


@pytest.fixture
def device(monkeypatch):
    """A mocked CUDA device: device(name, memory_bytes) makes torch.cuda report it."""
    monkeypatch.delenv("SCALETRAIN_HARDWARE", raising=False)

    def make(name: str, memory: int) -> None:
        props = types.SimpleNamespace(name=name, total_memory=memory)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)

    return make


@pytest.mark.parametrize("name", list(PARTS))
def test_a_gpu_gets_its_exact_parts_datasheet_rates_and_its_own_memory(device, name):
    """An A100-40GB was given 80 GiB and an H100 PCIe or NVL the SXM's figures (the name
    was matched by substring); the memory is what the device reports, not a table's."""
    from scaletrain.runtime.hardware import default_profile

    key, (fp64, fp32, tf32, bf16) = PARTS[name]
    device(name, 37 * GIB + 12345)  # a figure no datasheet gives: it must be the device's
    profile = default_profile("cuda")
    assert profile is not None and profile.name == key
    assert profile.memory_bytes == 37 * GIB + 12345
    assert profile.flops == pytest.approx(
        {
            "fp64": fp64 * 1e12,
            "fp32": fp32 * 1e12,
            "tf32": tf32 * 1e12,
            "bf16": bf16 * 1e12,
            "fp16": bf16 * 1e12,
        }  # fmt: skip
    )
    assert profile.source  # every rate has its document


def test_an_unknown_gpu_gets_no_profile_and_a_near_name_is_not_matched(device):
    """No built-in is guessed for a part not in the table: MFU is then null, as on an
    uncalibrated CPU. A name that merely contains a known one is a different part."""
    from scaletrain.runtime.hardware import default_profile

    for name in ("NVIDIA GeForce RTX 4090", "NVIDIA A100X", "NVIDIA H100 80GB HBM3e 141GB"):
        device(name, 80 * GIB)
        assert default_profile("cuda") is None, name


def test_scaletrain_hardware_still_names_a_built_in_or_a_profile_file(device, monkeypatch):
    """SCALETRAIN_HARDWARE overrides the device's own profile; the short names of before
    (a100, h100, h200) still load, as the SXM parts they always described."""
    from scaletrain.runtime.hardware import BUILTIN, load_profile

    device("NVIDIA A100-PCIE-40GB", 40 * GIB)
    monkeypatch.setenv("SCALETRAIN_HARDWARE", "h100")
    from scaletrain.runtime.hardware import default_profile

    assert default_profile("cuda") == BUILTIN["h100-sxm"] == load_profile("h100")
    assert load_profile("a100") == BUILTIN["a100-sxm4-80gb"]
    assert load_profile("H100-PCIe") == BUILTIN["h100-pcie"]
    assert BUILTIN["h100"] == BUILTIN["h100-sxm"]  # bench/plan_paper.py's name


def test_a_built_in_named_without_its_device_plans_with_the_datasheets_memory():
    """`scaletrain plan --hardware a100-sxm4-40gb` on a machine without one: the memory is
    the part's datasheet figure (40 GB, of HBM sized in GiB), not an 80 GB part's."""
    from scaletrain.runtime.hardware import BUILTIN

    assert BUILTIN["a100-sxm4-40gb"].memory_bytes == 40 * GIB
    assert BUILTIN["a100-pcie-80gb"].memory_bytes == 80 * GIB
    assert BUILTIN["h100-nvl"].memory_bytes == 94 * GIB
    assert BUILTIN["h200"].memory_bytes == 141 * GIB


def test_the_plan_counts_fp32_at_the_plain_rate_and_at_tf32s_where_it_is_on():
    """fp32 matmuls run on the non-tensor FP32 units unless precision.tf32 is on: the
    planner timed plain fp32 at the TF32 tensor rate (8x an A100's FP32) though
    scaletrain never enabled TF32."""
    import dataclasses

    from scaletrain.config import validate_config
    from scaletrain.planner import build_for_plan, plan_layouts
    from scaletrain.runtime.hardware import BUILTIN

    a100 = dataclasses.replace(BUILTIN["a100-sxm4-80gb"], op_s=0.0, byte_s=0.0)
    raw = {
        "model": {"name": "gpt", "size": "tiny"},
        "train": {"global_batch": 4, "micro_batch": 4},
        "data": {"source": "synthetic-text", "seq_len": 16},
    }

    def compute_s(**precision):
        config = validate_config({**raw, "precision": precision})
        dataset, model = build_for_plan(config)
        (pred,) = plan_layouts(
            config, world_size=1, profile=a100, dataset=dataset, model=model, only_configured=True
        )
        return pred.terms.compute_s, pred.mfu * pred.step_time_s

    (plain, plain_mfu), (tf32, tf32_mfu) = compute_s(mode="fp32"), compute_s(mode="fp32", tf32=True)
    assert plain == pytest.approx(tf32 * 156 / 19.5, rel=1e-9)
    # MFU against the rate the matmuls ran at: TF32's peak where it is on
    assert plain_mfu == pytest.approx(tf32_mfu * 156 / 19.5, rel=1e-9)


def test_precision_tf32_sets_torchs_flags_on_cuda_and_says_which_rate_applies():
    from scaletrain.config import validate_config
    from scaletrain.precision import make_precision

    assert validate_config({}).precision.tf32 is False
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        on = make_precision("fp32", device_type="cuda", tf32=True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert on.flops_dtype == "tf32"
        off = make_precision("fp32", device_type="cuda")
        assert not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cudnn.allow_tf32  # fp32 means fp32 in convolutions too
        assert off.flops_dtype == "fp32"
        # autocast's matmuls are bf16 whatever tf32 says; a CPU has no TF32
        assert make_precision("bf16-mixed", device_type="cuda", tf32=True).flops_dtype == "bf16"
        assert make_precision("fp32", device_type="cpu", tf32=True).flops_dtype == "fp32"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
