"""The attention kernel chosen by measurement (runtime/attention.py): the fastest backend over a
model's own SDPA calls, decided with a fake clock here (no timing in a test); the calls
recorded as autocast runs them; the choice applied by the precision policy's forward
context and kept by checkpoints (test_resume.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scaletrain.data.sources import TaskSpec
from scaletrain.models import build_model
from scaletrain.precision import make_precision
from scaletrain.runtime.attention import AttentionCall, fastest_backend, record_calls

A = AttentionCall((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8), torch.bfloat16, None, True, False)
B = AttentionCall((2, 4, 32, 8), (2, 2, 32, 8), (2, 2, 32, 8), torch.bfloat16, None, True, True)


def test_the_backend_with_the_least_time_over_every_call_is_chosen() -> None:
    # FLASH is faster on A, MATH on B; A is made twice: 2 x 1 + 5 = 7 against 2 x 2 + 2 = 6.
    seconds = {(A, "FLASH_ATTENTION"): 1.0, (B, "FLASH_ATTENTION"): 5.0}
    seconds |= {(A, "MATH"): 2.0, (B, "MATH"): 2.0}
    chosen, totals = fastest_backend([A, B, A], timer=lambda call, b: seconds[(call, b)])
    assert chosen == "MATH" and totals == {"FLASH_ATTENTION": 7.0, "MATH": 6.0}
    # made once each instead: FLASH 1 + 5 = 6 against MATH 2 + 2 = 4; A alone, FLASH
    assert fastest_backend([A, B], timer=lambda c, b: seconds[(c, b)])[0] == "MATH"
    assert fastest_backend([A, A], timer=lambda c, b: seconds[(c, b)])[0] == "FLASH_ATTENTION"


def test_a_backend_that_cannot_run_a_call_is_left_out_and_no_call_chooses_nothing() -> None:
    def timer(call, backend):
        if backend == "FLASH_ATTENTION" and call.gqa:
            raise RuntimeError("No available kernel. Aborting execution.")
        return 9.0

    assert fastest_backend([A, B], timer=timer) == ("MATH", {"MATH": 18.0})
    assert fastest_backend([], timer=timer) == (None, {})


def test_the_calls_are_recorded_in_the_dtype_autocast_runs_them_in() -> None:
    torch.manual_seed(0)
    model = build_model("gpt", size="tiny", task=TaskSpec("lm", (16,), 256))
    x = torch.randint(0, 256, (2, 16))
    for mode, dtype in (("bf16-mixed", torch.bfloat16), ("fp32", torch.float32)):
        precision = make_precision(mode, device_type="cpu")

        def run(precision=precision):
            with precision.forward_context():
                model(x)

        calls = record_calls(run)
        assert len(calls) == 2 and all(c.dtype == dtype for c in calls)  # one per block
        assert calls[0].query == (2, 2, 16, 32) and calls[0].causal
        assert calls[0].widened(8, 2).query == (8, 2, 16, 32)
    # fp32 inputs under autocast (a Llama's rotary embedding leaves q and k in fp32):
    # autocast runs SDPA in bf16, and that is the kernel to time
    q = torch.randn(2, 4, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (call,) = record_calls(lambda: F.scaled_dot_product_attention(q, q, q))
    assert call.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["MATH", "FLASH_ATTENTION"])
def test_the_precision_policy_runs_attention_on_the_chosen_kernel(backend: str) -> None:
    precision = make_precision("bf16-mixed", device_type="cpu")
    precision.attention = backend
    q = torch.randn(1, 2, 8, 4)
    with precision.forward_context():
        assert torch.backends.cuda.math_sdp_enabled() == (backend == "MATH")
        assert torch.backends.cuda.flash_sdp_enabled() == (backend == "FLASH_ATTENTION")
        assert F.scaled_dot_product_attention(q, q, q).dtype == torch.bfloat16
    assert torch.backends.cuda.flash_sdp_enabled()  # torch's own choice outside


@pytest.mark.parametrize("backend", ["MATH", "FLASH_ATTENTION"])
def test_checkpointing_recomputes_attention_on_the_kernel_its_forward_ran(backend: str) -> None:
    """Activation checkpointing runs a block's forward again inside backward: there the
    chosen kernel must hold too. Backward ran outside the forward context, so a run whose
    measurement chose MATH recomputed with torch's default (flash) and stopped with
    CheckpointError (HF Llama, ZeRO-3, full checkpointing, bench/plan.py)."""
    from scaletrain.parallel.checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    model = build_model("gpt", size="tiny", task=TaskSpec("lm", (16,), 64))
    apply_activation_checkpointing(model, blocks_path="blocks", mode="full")
    precision = make_precision("fp32", device_type="cpu")
    precision.attention = backend
    ids = torch.randint(0, 64, (2, 16))
    with precision.forward_context():
        loss = model(ids).float().logsumexp(-1).sum()
    precision.backward(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
