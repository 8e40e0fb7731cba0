"""What the planner traces on meta, from the trainer's own code through the layout's own
`parallelize`, in torch's FakeProcessGroup, with no formula to drift: what one rank holds to
the byte (counted by the metrics' functions, so a prediction and a run's logged bytes are one
function), and one micro-batch's activations, ops and bytes written (its forward run on fake
tensors). The caller scales a pipeline stage's share."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from scaletrain.config import Config
from scaletrain.launch.resolve import Derived
from scaletrain.models.flops import meta_copy
from scaletrain.models.init import is_meta
from scaletrain.models.protocol import model_spec
from scaletrain.parallel.checkpointing import MATMUL_OPS, OpPolicy
from scaletrain.parallel.compose import parallelize
from scaletrain.parallel.layout import ParallelLayout
from scaletrain.precision import make_precision
from scaletrain.records.memory import held_bytes, local_bytes
from scaletrain.training.assemble import NO_CODE, UserCode, build_net, build_objective
from scaletrain.training.optim import from_section
from scaletrain.training.step import forward


@dataclass(frozen=True)
class Held:
    """One rank's bytes: what the metrics log as param_bytes, grad_bytes, optim_state_bytes."""

    params: int
    grads: int
    optim: int
    largest_unit: int  # the largest FSDP unit's whole parameters (what one all-gather holds)
    units: int  # FSDP units on this rank (one all-gather and one reduce-scatter each)
    recomputed_blocks: int  # blocks whose forward matmuls backward runs again on this rank


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """A process group of `world_size` where this process is `rank` and nothing is sent."""
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError("the planner's fake process group needs a process without one")
    hook = sys.excepthook  # init_process_group wraps it with a "[rankN]: " prefix, for good
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


@contextlib.contextmanager
def parallelized(config: Config, layout: ParallelLayout, *, dataset, pipeline=None, code=NO_CODE):
    """Yields rank 0's (Parallelized, precision, loss_fn): the run's model built on meta as
    the trainer builds it, through `layout`'s own `parallelize`, in a fake process group."""
    precision = make_precision(
        config.precision.mode, device_type="cpu", sharded=layout.splits_gradients
    )
    with torch.device("meta"):
        net = build_net(config, dataset, code=code, meta=True)
        model, loss_fn, _ = build_objective(
            config, net, dataset, precision=precision, code=code, teacher_meta=True
        )
    if not is_meta(model):  # built whole (a user model without init_module): its shapes
        model = meta_copy(model)
    model = precision.convert_module(model)
    with fake_world(layout.world_size, 0):
        par = parallelize(
            model, spec=model_spec(model), layout=layout, rank=0, device=torch.device("cpu"),
            parallel=config.parallel, pipeline=pipeline, precision=precision, loss_fn=loss_fn,
            shapes_only=True,
        )  # fmt: skip
        yield par, precision, loss_fn


def held_on_rank(config: Config, derived: Derived, *, dataset, code: UserCode = NO_CODE) -> Held:
    """The bytes rank 0 holds under `derived`'s layout, the optimizer stepped once on zero
    gradients so that its state exists."""
    with parallelized(
        config, derived.layout, dataset=dataset, pipeline=derived.pipeline, code=code
    ) as (par, _, _):
        # foreach: its state is the fused kernel's, shape for shape
        optimizer, _ = from_section(par.model, config.optim, total_steps=1, impl="foreach")
        trained = [p for p in par.model.parameters() if p.requires_grad]
        for p in trained:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        held = held_bytes(par.model, optimizer)
        units, largest = _fsdp_units(par.model)
        wrapped = sum(isinstance(m, CheckpointWrapper) for m in par.model.modules())
        return Held(
            params=held["param_bytes"], grads=local_bytes(p.grad for p in trained),
            optim=held["optim_state_bytes"], largest_unit=largest, units=units,
            # under "op" the trace counts what runs again (Activations.again_flops)
            recomputed_blocks=0 if config.parallel.activation_checkpointing == "op" else wrapped,
        )  # fmt: skip


def _fsdp_units(model: nn.Module) -> tuple[int, int]:
    """The FSDP units, and the largest one's own parameters' whole bytes (one all-gather's)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    largest = 0
    for unit in units:
        inner = [m for m in unit.modules() if isinstance(m, FSDPModule) and m is not unit]
        nested = {id(p) for m in inner for p in m.parameters()}
        own = (p for p in unit.parameters() if id(p) not in nested)
        largest = max(largest, sum(p.numel() * p.element_size() for p in own))
    return len(units), largest


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
        self.ops = self.written = self.kept = self.inside = self.again_ops = self.again_written = 0
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
    if func is torch.ops._c10d_functional.wait_tensor.default:
        return []  # hands back its input (fake tensors make it a new one)
    held = {_local(t).untyped_storage()._cdata for t in tree_leaves(inputs) if torch.is_tensor(t)}
    outs = [_local(t) for t in tree_leaves(out) if torch.is_tensor(t)]
    return [t for t in outs if t.untyped_storage()._cdata not in held]


def traced_activations(
    config: Config, *, dataset, examples: int, tp: int, code: UserCode = NO_CODE
) -> Activations:
    """Activations of a micro-batch of `examples` under tensor parallelism `tp` and the
    config's checkpointing and precision. Each tensor autograd saves counts once by its
    storage; so do a checkpointed block's input and, under "op", the outputs its policy
    keeps, which no saved-tensor hook sees."""
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
        entries.extend(_local(a).untyped_storage().nbytes() for a in args if torch.is_tensor(a))
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
    counted = {k: getattr(counter, k) for k in ("ops", "written", "again_ops", "again_written")}
    return Activations(kept, largest, recompute, **counted, again_flops=again_flops)


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
