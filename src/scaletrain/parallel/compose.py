"""The one order in which parallel techniques are applied, and what the step needs of them.

Order (written down once, here): precision cast -> (later: tensor parallel -> activation
checkpointing -> FSDP) -> torch.compile -> DDP -> DDP comm hook. DDP goes last because it
must see the final parameters; its comm hook (gradient compression) is registered on the
wrapper. The module is compiled in place (`nn.Module.compile`) before DDP wraps it, so
parameter names stay plain (no `_orig_mod.` prefix in checkpoints) and DDP's gradient hooks
fire on the compiled graph's gradients as on eager ones.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch.nn.parallel import DistributedDataParallel

from scaletrain.parallel.comm_hooks import HookState, register_comm_hook
from scaletrain.parallel.ddp import apply_ddp
from scaletrain.parallel.layout import ParallelLayout


def parallelize(model: torch.nn.Module, *, layout: ParallelLayout, device: torch.device,
                bucket_cap_mb: float, gradient_as_bucket_view: bool, comm_hook: str = "none",
                powersgd_rank: int = 1, powersgd_start_iter: int = 10, compile: bool = False,
                ) -> tuple[torch.nn.Module, HookState | None]:
    """Apply the layout's techniques to `model` in the documented order.

    With dp == 1 nothing is wrapped: a single process trains the bare module.
    Returns the model and the comm hook's state (bytes sent), None without a hook.

    Args:
        compile: compile the module with torch.compile (inductor) before DDP wraps it.
    """
    model = model.to(device)
    if compile:
        model.compile()  # in place: the same module and parameter names, a compiled forward
    hook_state = None
    if layout.dp > 1:
        model = apply_ddp(model, device=device, bucket_cap_mb=bucket_cap_mb,
                          gradient_as_bucket_view=gradient_as_bucket_view)
        hook_state = register_comm_hook(model, name=comm_hook, powersgd_rank=powersgd_rank,
                                        powersgd_start_iter=powersgd_start_iter)
    return model, hook_state


def gradient_sync(model: torch.nn.Module, *, enabled: bool) -> ContextManager:
    """Context for one micro-batch's backward: sync gradients across ranks or not.

    Skipping the sync on all but the last micro-batch lets gradients accumulate locally and
    be all-reduced once per optimizer step.
    """
    if not enabled and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module, without the DDP wrapper (plain parameter names)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
