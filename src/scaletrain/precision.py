"""Numeric precision as a small object: forward context, backward, unscale, optimizer step.

The train step calls the same four methods whatever the mode; it never patches
`model.forward`. Modes:

- fp32: plain.
- bf16-mixed: autocast to bf16 for matmuls/convs, fp32 master weights and optimizer state.
  bf16 has fp32's exponent range, so no loss scaling is needed.
- fp16-mixed: autocast to fp16 plus a dynamic loss scaler (torch.amp.GradScaler): the loss
  is multiplied by the scale before backward, gradients are unscaled before clipping; an
  overflow (inf/NaN gradient) skips the optimizer step and halves the scale; after
  `growth_interval` clean steps the scale doubles. Only this mode owns a scaler.
- bf16-true: parameters themselves in bf16 (half the memory, no fp32 master copy).
- fp64: parameters, activations, gradients and optimizer state in float64. A mode for
  verifying numerics, not for speed: fp32 summation order changes with the CPU's kernels
  (AMX or not, avx512 or not), so a parity test in fp32 needs a tolerance tuned to one CPU;
  in float64 the same test holds to 1e-9 on every CPU, which makes it a proof.
- auto: the launcher measures fp32 against bf16-mixed on the configured model where the CPU
  runs bf16 natively (training/auto_precision.py) and hands the workers the faster. Where
  nothing is measured (a GPU, bf16 emulated, a worker under plain torchrun) the capability
  table `decide_auto` decides: bf16-mixed where the hardware has fast bf16 (CPU
  avx512_bf16 or AMX; CUDA compute capability >= 8.0), else fp32. The CPU's capabilities
  come from torch's own checks (the ones its oneDNN kernels dispatch on), not /proc/cpuinfo.

The forward context also holds the attention kernel measured fastest for the model
(`attention`, runtime/attention.py), which the checkpoint keeps.

A mode asked for by name may be slower than fp32 on the machine it runs on: bf16 on a CPU
without avx512_bf16 or AMX is emulated, about 100x slower than fp32, and fp16 on a CPU
without AMX-FP16 about 200x (BENCHMARKS.md, "Precision and accumulation"). `slow_precision_warning` says so, naming the CPU's capability and the instruction set
it lacks; `explain` and `train` print it (launch/resolve.resolve collects it with its warnings).

TF32 (`precision.tf32`, CUDA only): fp32 matmuls and convolutions on the tensor cores, their
inputs rounded to a 10-bit mantissa. `make_precision` sets torch's two flags either way, so
that fp32 is full fp32 unless asked (cuDNN's flag is on by default, which would run a
convolution's fp32 on TF32 while the planner counts the plain FP32 rate); `flops_dtype`
names the rate the hardware profile gives such a run's matmuls.

FSDP2's MixedPrecisionPolicy will stand in for autocast when FSDP is applied: the same object
then reports `param_dtype`/`reduce_dtype` and returns a null forward context.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import Literal

import torch

from scaletrain.runtime.attention import attention_context

PrecisionMode = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp64", "auto"]
PRECISION_MODES: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp64", "auto")


@dataclass(frozen=True)
class Hardware:
    """What `auto` decides on: the device and its bf16 capabilities."""

    device_type: str  # "cpu" or "cuda"
    avx512_bf16: bool = False  # CPU: native bf16 dot products
    amx: bool = False  # CPU: AMX tiles (bf16 matrix units)
    cuda_capability: tuple[int, int] | None = None
    cpu_capability: str = ""  # torch.backends.cpu.get_cpu_capability(): AVX2, AVX512, ...
    amx_fp16: bool = False  # CPU: AMX-FP16 (fast fp16 matrix units)


def matmul_dtype(mode: str, *, tf32: bool = False) -> str:
    """The hardware profile's key (runtime/hardware.py) for the rate `mode`'s matmuls run at (a
    resolved mode, not "auto"); `tf32`: fp32's run on TF32 tensor cores."""
    named = {"bf16-mixed": "bf16", "bf16-true": "bf16", "fp16-mixed": "fp16", "fp64": "fp64"}
    return named.get(mode, "tf32" if tf32 else "fp32")


def set_tf32(enabled: bool) -> None:
    """CUDA's fp32 matmuls and cuDNN's fp32 convolutions on TF32 tensor cores, or not."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def detect_hardware(device_type: str) -> Hardware:
    """This machine's capabilities, from torch's own checks (what its kernels dispatch on)."""
    if device_type == "cuda":
        return Hardware("cuda", cuda_capability=torch.cuda.get_device_capability())
    return Hardware(
        "cpu",
        avx512_bf16=torch.cpu._is_avx512_bf16_supported(),
        amx=torch.cpu._is_amx_tile_supported(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        amx_fp16=torch.cpu._is_amx_fp16_supported(),
    )


def decide_auto(hw: Hardware) -> tuple[str, str]:
    """The decision table of `auto`: (mode, why) for the given hardware."""
    if hw.device_type == "cuda":
        major, minor = hw.cuda_capability or (0, 0)
        if major >= 8:
            return "bf16-mixed", f"GPU compute capability {major}.{minor} >= 8.0 has fast bf16"
        return "fp32", f"GPU compute capability {major}.{minor} < 8.0 lacks fast bf16"
    found = [name for name, has in (("AMX", hw.amx), ("avx512_bf16", hw.avx512_bf16)) if has]
    if found:
        return "bf16-mixed", f"CPU has {' and '.join(found)}"
    return "fp32", f"CPU{_capability(hw)} has neither avx512_bf16 nor AMX"


def choose_auto(device_type: str) -> tuple[str, str]:
    """The mode `auto` resolves to on this hardware, and why."""
    return decide_auto(detect_hardware(device_type))


def _capability(hw: Hardware) -> str:
    return f" (capability {hw.cpu_capability})" if hw.cpu_capability else ""


def slow_precision_warning(mode: str, hw: Hardware) -> str | None:
    """Why `mode` runs slower than fp32 on this hardware, or None (`auto` never does).

    The numbers are measurements (module docstring), said so that a user who asked for bf16
    on a CPU that emulates it knows what the minutes per step are and what to change.
    """
    if hw.device_type != "cpu":
        return None
    if mode in ("bf16-mixed", "bf16-true") and not (hw.avx512_bf16 or hw.amx):
        return (
            f"precision.mode = {mode!r} is about 100x slower than fp32 on this CPU"
            f"{_capability(hw)}: it has neither avx512_bf16 nor AMX, so every bf16 "
            "matmul is emulated; use precision.mode = 'auto' (fp32 here, bf16-mixed where the CPU "
            "has avx512_bf16 or AMX) or 'fp32'"
        )
    if mode == "fp16-mixed" and not hw.amx_fp16:
        return (
            f"precision.mode = 'fp16-mixed' is about 200x slower than fp32 on this CPU"
            f"{_capability(hw)}: it lacks AMX-FP16, so fp16 matmuls are emulated; use "
            "precision.mode = 'auto' (bf16-mixed only where the CPU has avx512_bf16 or "
            "AMX, else fp32) or 'fp32'"
        )
    return None


@dataclass
class Precision:
    """One precision policy; build it with `make_precision`."""

    mode: str
    device_type: str
    autocast_dtype: torch.dtype | None = None  # None: no autocast
    param_dtype: torch.dtype = torch.float32
    scaler: torch.amp.GradScaler | None = None  # fp16-mixed only
    overflow_steps: int = field(default=0)
    tf32: bool = False  # CUDA: fp32 matmuls on TF32 tensor cores (make_precision set it)
    # the SDPA backend measured fastest for the model (runtime/attention.py; None: torch's choice)
    attention: str | None = None

    @property
    def flops_dtype(self) -> str:
        """The hardware profile's key for the rate this policy's matmuls run at (MFU's)."""
        return matmul_dtype(self.mode, tf32=self.tf32 and self.device_type == "cuda")

    def convert_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """Cast parameters for `bf16-true` and `fp64`; mixed modes keep fp32 master weights."""
        return model.to(self.param_dtype) if self.param_dtype != torch.float32 else model

    def convert_input(self, inputs: torch.Tensor) -> torch.Tensor:
        """Floating-point inputs follow the parameters' dtype (bf16-true, fp64); ids stay ints."""
        if self.param_dtype != torch.float32 and inputs.is_floating_point():
            return inputs.to(self.param_dtype)
        return inputs

    def forward_context(self) -> ContextManager:
        """Autocast region for forward and loss (none in fp32, bf16-true and fp64), with the
        attention kernel measured fastest for the model (`attention`), if any."""
        stack = contextlib.ExitStack()
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.device_type, dtype=self.autocast_dtype))
        stack.enter_context(attention_context(self.attention))
        return stack

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward from: scaled by the loss scale in fp16-mixed."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def init_scale_on(self, device: torch.device) -> None:
        """fp16: create the loss scale on this rank now. GradScaler makes it on the first
        `scale`, but a pipeline's earlier stages never scale a loss (the last stage does)
        and still unscale gradients that carry that same scale."""
        if self.scaler is not None:
            self.scaler.scale(torch.zeros((), device=device))

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the (scaled, in fp16-mixed) loss, on the forward's attention
        kernel: activation checkpointing runs the forward again inside it."""
        with attention_context(self.attention):
            self.scale(loss).backward()

    def fsdp_policy(self):
        """FSDP2's MixedPrecisionPolicy for this mode: under bf16-mixed the all-gathered
        parameters are bf16 (half the bytes; autocast would cast them for the matmuls anyway)
        while gradients are reduced in fp32 into fp32 master shards. Other modes keep the
        parameters' own dtype throughout."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.mode == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide gradients by the loss scale so clipping sees true values (fp16 only)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, *, grads_finite: bool) -> bool:
        """Step unless gradients are non-finite; returns whether the step was applied.

        fp16-mixed: GradScaler skips the step itself on overflow and lowers the scale.
        """
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
            if not grads_finite:
                self.overflow_steps += 1
            return grads_finite
        if grads_finite:
            optimizer.step()
        return grads_finite

    @property
    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def state_dict(self) -> dict:
        return {
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "overflow_steps": self.overflow_steps,
            "attention": self.attention or "",
        }

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.overflow_steps = int(state.get("overflow_steps", 0))
        if "attention" in state:  # a resumed run keeps the kernel its run measured
            self.attention = state["attention"] or None


def make_precision(
    mode: str,
    *,
    device_type: str,
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
    sharded: bool = False,
    tf32: bool = False,
) -> Precision:
    """The one place a mode string becomes a Precision.

    Args:
        mode: one of PRECISION_MODES ("auto" is resolved with `choose_auto`).
        device_type: "cpu" or "cuda".
        init_scale: fp16-mixed initial loss scale.
        growth_interval: fp16-mixed clean steps before the scale doubles.
        sharded: gradients are split over ranks (FSDP, TP, PP): fp16-mixed then uses
            ShardedGradScaler, which agrees on an overflow across every rank, so no rank
            steps while another skips.
        tf32: precision.tf32: on CUDA, torch's TF32 flags are set to it (module docstring).
    """
    if mode == "auto":
        mode, _ = choose_auto(device_type)
    if device_type == "cuda":
        set_tf32(tf32)
    precision = _policy(mode, device_type, init_scale, growth_interval, sharded)
    precision.tf32 = tf32
    return precision


def _policy(
    mode: str, device_type: str, init_scale: float, growth_interval: int, sharded: bool
) -> Precision:
    match mode:
        case "fp32":
            return Precision(mode, device_type)
        case "bf16-mixed":
            return Precision(mode, device_type, autocast_dtype=torch.bfloat16)
        case "bf16-true":
            return Precision(mode, device_type, param_dtype=torch.bfloat16)
        case "fp64":
            return Precision(mode, device_type, param_dtype=torch.float64)
        case "fp16-mixed":
            if sharded:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                scaler = ShardedGradScaler(
                    device_type, init_scale=init_scale, growth_interval=growth_interval
                )
            else:
                scaler = torch.amp.GradScaler(
                    device_type, init_scale=init_scale, growth_interval=growth_interval
                )
            return Precision(mode, device_type, autocast_dtype=torch.float16, scaler=scaler)
    raise ValueError(f"precision mode {mode!r} is not one of {PRECISION_MODES}")
