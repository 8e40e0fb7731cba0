"""Sharded data parallelism: FSDP2 (`fully_shard`), ZeRO-3 or ZeRO-2 style.

Each repeated block (the model spec's `blocks`; for a model without any, the model alone)
becomes one FSDP unit, then the root takes what is left (embeddings, norms, head). Between
uses a unit holds only its 1/N shard of parameters, gradients and optimizer state (each a
DTensor sharded on dim 0): the forward all-gathers a unit just before it runs, the backward
all-gathers it again and reduce-scatters its gradients, averaged over the data-parallel
ranks as DDP averages them (the train step's loss weight is the same for both).

- `reshard_after_forward=True` (ZeRO-3): a unit's gathered parameters are freed after its
  forward and gathered again for backward: least memory, one more all-gather per unit.
  `False` (ZeRO-2): they stay gathered from forward to backward.
- The mesh is 1-D ("dp_shard") or, for HSDP, 2-D ("dp_replicate", "dp_shard"): sharded
  within a group, replicated across groups, gradients all-reduced between them.
- Under tensor parallelism the parameters are already DTensors on the "tp" dimension;
  fully_shard then shards them on dim 0 over "dp_shard" too (a 2-D layout).
- Mixed precision is FSDP's own `MixedPrecisionPolicy` (from the precision object): under
  bf16-mixed the all-gathers move bf16 parameters, while the master weights, the optimizer
  state and the gradient reduction stay fp32.
- `offload`: CPUOffloadPolicy keeps the shards and the optimizer step on the CPU between
  uses (a GPU run's memory for host memory and PCIe traffic); pinned memory only with CUDA
  (on a CPU-only build pinning fails).
"""

from __future__ import annotations

import re
import warnings

import torch
from torch import nn


def apply_fsdp(
    model: nn.Module,
    mesh,
    *,
    blocks: list[nn.Module],
    mp_policy,
    reshard_after_forward: bool,
    offload: bool,
) -> nn.Module:
    """Shard `model` (in place: its class becomes an FSDPModule) and return it.

    Args:
        model: the model or one pipeline stage of it, after TP and activation checkpointing.
        mesh: the data-parallel mesh: 1-D "dp_shard", or 2-D ("dp_replicate", "dp_shard").
        blocks: the units to shard one by one (protocol.block_modules), may be empty.
        mp_policy: a torch.distributed.fsdp.MixedPrecisionPolicy.
        reshard_after_forward: ZeRO-3 (True) or ZeRO-2 (False), see the module docstring.
        offload: keep parameters and optimizer state on the CPU (CPUOffloadPolicy).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    common = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=policy)
    for i, block in enumerate(blocks):
        # The last block's backward starts right after its forward: resharding it would
        # only gather it again at once.
        keep = reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, reshard_after_forward=keep, **common)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **common)
    return model


def allow_tensor_parallel_output_view(model: nn.Module) -> None:
    """Silence FSDP2's "returned a view tensor" warning for this one sharded module, whose
    output under tensor parallelism comes out of DTensor's `to_local()`. Call it after
    `apply_fsdp`, only when tp > 1.

    Why the warning does not apply here. torch 2.13 warns (fsdp/_fully_shard/_fsdp_state.py,
    `_register_pre_backward_hook`) when a sharded module's output is a view, because an
    in-place op on a view replaces its autograd history, drops the pre-backward hook FSDP
    registered on it, and so skips the all-gather before that module's backward. Our output
    is a view for one reason: a tensor-parallel layer returns `to_local()`, which is
    `_ToTorchTensor`, a custom autograd Function returning `local_tensor.view_as(...)`
    (tensor/_api.py). Autograd forbids any in-place op on a view made inside a custom
    Function, and on every view of it ("Output 0 of _ToTorchTensor is a view and is being
    modified inplace ... This behavior is forbidden"), so the silent drop cannot happen: an
    in-place op raises instead (tests/test_model_parallel_parity.py, the view probe), and
    the losses the step computes are out of place. The gradients are checked, not assumed:
    the model-parallel parity tests match one process to 1e-9. Without this filter the
    warning prints on every step.

    The filter names this module's FSDP class (e.g. FSDPGPT), so any other module's view
    still warns.
    """
    name = re.escape(type(model).__name__)
    warnings.filterwarnings(
        "ignore",
        category=UserWarning,
        message=rf"FSDP2-wrapped module \({name}\) returned a view tensor",
    )
