"""Activation checkpointing: keep a block's input, recompute its activations in backward.

A block's intermediate activations (attention scores' inputs, the 4C-wide MLP hidden
layer) are the largest saved tensors of a transformer; checkpointing a block keeps only its
input and runs its forward again during backward: roughly one more forward of the block,
for activation memory that no longer grows with the block's width (PLATFORM-NOTES: saved
activations 816 MB -> 64 MB, 1.44x step time). Gradients are identical: the recomputation
runs the same ops on the same values (dropout replays its RNG state).

Modes: "full" checkpoints every block; "selective" every other one (torchtitan's layer-wise
selective option with frequency 2): about half the saving for about half the cost; "op"
checkpoints every block but keeps what attention and every other matrix product return,
the 1st, 3rd, ... of the block (torch's selective checkpoint contexts, with a policy by
op: torchtitan's "op" option), and a tensor-parallel reduce-scatter's output, so backward
runs again the cheap element-wise ops (norms, activations, residual adds, rotary) and half
the matmuls: on Llama 3 8B's block at 8,192 tokens it keeps q, v, the MLP's gate and its
down projection (23,552 of 43,008 matmul outputs per token) and multiplies again k, the
attention projection and the MLP's up projection (37% of the block's matmul FLOPs).

Blocks are wrapped with torch's `checkpoint_wrapper` (non-reentrant), in place in their
container; the wrapper's prefix never reaches a state dict (torch.distributed.checkpoint
and `state_dict` both drop it), so checkpoints do not depend on the setting.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

AC_MODES = ("none", "full", "selective", "op")
WRAPPED_PREFIX = "_checkpoint_wrapped_module."
_aten = torch.ops.aten
# the matrix products "op" keeps every other one of, counted per block call
MATMUL_OPS = frozenset(
    (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default)
)
# what "op" always keeps: attention's outputs (FLOPs and memory traffic to recompute) and a
# reduce-scatter's (a collective to run again)
KEPT_OPS = frozenset(
    (
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    )
)


class OpPolicy:
    """Which outputs one call of an "op" block keeps: attention's and reduce-scatters'
    always, a matrix product's when it is the block's 1st, 3rd, 5th, ... torch asks in the
    forward only (its recomputation replays the forward's answers by op and invocation),
    so one count serves. The planner's trace asks the same object (planner/trace.py)."""

    def __init__(self) -> None:
        self.matmuls = 0  # the block call's matrix products so far

    def keeps(self, func) -> bool:
        if func in MATMUL_OPS:
            self.matmuls += 1
            return self.matmuls % 2 == 1
        return func in KEPT_OPS

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        keep = self.keeps(func)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def op_policy_contexts():
    """The forward and recompute contexts of one "op" block call (torch's selective
    checkpoint): a fresh count of its matrix products each call."""
    return create_selective_checkpoint_contexts(OpPolicy())


def apply_activation_checkpointing(model: nn.Module, *, blocks_path: str, mode: str) -> nn.Module:
    """Wrap the blocks under `blocks_path` of `model` for recomputation; return `model`.

    Args:
        model: the model or a pipeline stage of it (after TP, before FSDP).
        blocks_path: the container of repeated blocks (the model spec's `blocks`).
        mode: one of AC_MODES.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}; allowed: {', '.join(AC_MODES)}")
    if mode == "none":
        return model
    container = model.get_submodule(blocks_path)
    extra = {"context_fn": op_policy_contexts} if mode == "op" else {}
    for i, (name, block) in enumerate(list(container.named_children())):
        if mode in ("full", "op") or i % 2 == 0:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=True, **extra)
            container.register_module(name, wrapped)
    return model
