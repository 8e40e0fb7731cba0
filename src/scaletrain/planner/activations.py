"""Activation memory, ops and bytes written of one micro-batch: its forward run on fake
tensors through the layout's own tensor parallelism and activation checkpointing
(held.parallelized), no formula to drift. The caller scales a pipeline stage's share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from scaletrain.config import Config
from scaletrain.parallel.checkpointing import MATMUL_OPS, OpPolicy
from scaletrain.parallel.layout import ParallelLayout
from scaletrain.planner.held import parallelized
from scaletrain.training.assemble import NO_CODE, UserCode
from scaletrain.training.step import forward


@dataclass(frozen=True)
class Activations:
    saved: int  # bytes kept from forward to backward, one micro-batch
    largest: int  # the largest single saved tensor (its gradient is as large, for a moment)
    recompute: int  # one checkpointed block's activations, held while it recomputes
    ops: int  # aten ops of the forward (each costs a dispatch: the CPU's floor per op)
    written: int  # bytes the forward's ops write (element-wise work is bound by memory)
    again_ops: int = 0  # of those, the ops backward runs again (checkpointed, not kept)
    again_written: int = 0  # and the bytes they write
    again_flops: int = 0  # under "op", the FLOPs of the matrix products it runs again


class _OpCounter(TorchDispatchMode):
    """Counts the ops that run and the bytes they write to new storage (a DTensor: its local
    shard). Inside a checkpointed block: the ops backward runs again and their bytes, or
    the bytes of what an "op" block's `policy` keeps (a fresh policy each call)."""

    def __init__(self, *, keeps_ops: bool) -> None:
        super().__init__()
        self.ops = self.written = self.kept = self.inside = 0
        self.again_ops = self.again_written = 0
        self.keeps_ops = keeps_ops
        self.policy: OpPolicy | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        fresh = _new_storage(func, out, (args, kwargs))
        nbytes = sum(t.numel() * t.element_size() for t in fresh)
        self.written += nbytes
        if self.inside and self.policy is not None and self.policy.keeps(func):
            self.kept += nbytes
        elif self.inside and fresh:  # run again in backward (not a view: selective
            # checkpointing hands back what it keeps as detached aliases)
            self.again_ops += 1
            self.again_written += nbytes
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # no dispatch, no autograd


def _new_storage(func, out, inputs) -> list[torch.Tensor]:
    """The local tensors of an op's outputs that are on a storage none of its inputs have."""

    def local_tensors(tree):
        return [_local(t) for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]

    if func is torch.ops._c10d_functional.wait_tensor.default:
        return []  # hands back its input (fake tensors make it a new one)
    held = {t.untyped_storage()._cdata for t in local_tensors(inputs)}
    return [t for t in local_tensors(out) if t.untyped_storage()._cdata not in held]


def traced_activations(
    config: Config, *, dataset, examples: int, tp: int, code: UserCode = NO_CODE
) -> Activations:
    """Activations of a micro-batch of `examples` under tensor parallelism `tp` and the
    config's checkpointing and precision. Each tensor autograd saves counts once by its
    storage; so do a checkpointed block's input and, under "op", the outputs its policy
    keeps, which no saved-tensor hook sees."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    layout = ParallelLayout(pp=1, dp_replicate=1, dp_shard=1, tp=tp)
    batch = dataset.get(torch.arange(examples) % len(dataset))
    counter = _OpCounter(keeps_ops=config.parallel.activation_checkpointing == "op")
    saved: dict[int, int] = {}  # storage -> bytes
    entries: list[int] = []
    first_call: list[tuple[tuple, dict]] = []  # the first checkpointed block's arguments

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        saved[storage._cdata] = storage.nbytes()
        return t

    def at_entry(module, args, kwargs) -> None:
        tensors = [a for a in args if torch.is_tensor(a)]
        entries.extend(_local(a).untyped_storage().nbytes() for a in tensors)
        if not first_call:
            first_call.append((args, kwargs))
        counter.inside += 1
        counter.policy = OpPolicy() if counter.keeps_ops else None

    def at_exit(module, args, output) -> None:
        counter.inside -= 1

    with parallelized(config, layout, dataset=dataset, code=code) as (par, precision, loss_fn):
        wrapped = [m for m in par.model.modules() if isinstance(m, CheckpointWrapper)]
        for m in wrapped:
            m.register_forward_pre_hook(at_entry, with_kwargs=True)
            m.register_forward_hook(at_exit)
        with FakeTensorMode(allow_non_fake_inputs=True):
            par.model.to_empty(device="cpu")
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
                with precision.forward_context():
                    loss_fn(forward(par.model, batch, precision), batch)
            kept = sum(saved.values()) + sum(entries) + counter.kept
            largest = max(saved.values(), default=0)
            recompute = again_flops = 0
            if wrapped:  # one block run plainly: what its recomputation holds
                saved.clear()
                block = wrapped[0]._checkpoint_wrapped_module
                args, kwargs = first_call[0]  # an HF layer takes its rotary tables by keyword
                x, *rest = args

                def run_block():
                    with precision.forward_context():
                        block(x.detach().requires_grad_(), *rest, **kwargs)

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    run_block()
                recompute = sum(saved.values())
                if counter.keeps_ops:  # every block is wrapped under "op"
                    again_flops = len(wrapped) * _again_flops(run_block)
    return Activations(
        saved=kept,
        largest=largest,
        recompute=recompute,
        ops=counter.ops,
        written=counter.written,
        again_ops=counter.again_ops,
        again_written=counter.again_written,
        again_flops=again_flops,
    )


def _again_flops(run_block) -> int:
    """The FLOPs of the matmuls one "op" block runs again in backward: those its policy does
    not keep, up to the last op that saves a tensor (torch's recomputation stops there), by
    torch's own formulas at a DTensor's local shapes. `run_block` runs the block plainly."""
    from torch.utils.flop_counter import flop_registry

    policy = OpPolicy()
    flops: list[int] = []  # each op's, in order
    upto = 0  # the ops run when a tensor was last saved for backward

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in MATMUL_OPS and not policy.keeps(func):
                a, k, o = tree_map_only(DTensor, _local, (args, kwargs or {}, out))
                flops.append(flop_registry[func.overloadpacket](*a, **k, out_val=o))
            else:
                flops.append(0)
            return out

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal upto
        upto = len(flops)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Mode():
        run_block()
    return sum(flops[:upto])
