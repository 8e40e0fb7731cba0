"""Activation checkpointing: keep a block's input, recompute its activations in backward.

A block's intermediate activations (attention scores' inputs, the 4C-wide MLP hidden
layer) are the largest saved tensors of a transformer; checkpointing a block keeps only its
input and runs its forward again during backward: roughly one more forward of the block,
for activation memory that no longer grows with the block's width (PLATFORM-NOTES: saved
activations 816 MB -> 64 MB, 1.44x step time). Gradients are identical: the recomputation
runs the same ops on the same values (dropout replays its RNG state).

Modes: "full" checkpoints every block; "selective" every other one (torchtitan's layer-wise
selective option with frequency 2): about half the saving for about half the cost; "op"
checkpoints every block but keeps what its matrix products and attention return (torch's
selective checkpoint contexts, with a policy by op: torchtitan's "op" option, which also
recomputes every second matmul), so backward runs again only the cheap element-wise ops
(norms, activations, residual adds, rotary) whose outputs are as large as the matmuls'.

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
# what "op" keeps from a block's forward: the matrix products and attention (their outputs
# cost FLOPs to recompute; everything else costs only memory traffic)
SAVED_OPS = frozenset(
    (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    )
)


def _keep_matmuls(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def op_policy_contexts():
    """The forward and recompute contexts of an "op" block (torch's selective checkpoint)."""
    return create_selective_checkpoint_contexts(_keep_matmuls)


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
