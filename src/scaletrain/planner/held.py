"""What one rank holds, to the byte, without building anything real: parameters, gradients
and optimizer state of any layout, from the layout's own code.

The model is built on the meta device as the trainer builds it (`build_net`, the
distillation wrapper, the precision cast), and handed to the trainer's own `parallelize`
(pipeline split, tensor parallel, activation checkpointing, FSDP) inside a fake process
group of the planned world, joined as the rank asked for: torch's FakeProcessGroup, which
makes DeviceMesh, DTensor and `fully_shard` do everything but communicate. Each DTensor then
has the local shape this rank would hold. The optimizer is the trainer's
(`build_optimizer`), stepped once on zero gradients so that its state exists, as shapes.
The counts are the metrics' own (`memory.held_bytes`, `local_bytes`), so a prediction and
a run's logged `param_bytes`, `grad_bytes` and `optim_state_bytes` are computed by one
function on the same tensors; tests/test_planner.py holds them equal for every layout.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.config import Config
from scaletrain.launch.resolve import Derived
from scaletrain.models.flops import meta_copy
from scaletrain.models.init import is_meta
from scaletrain.models.protocol import model_spec
from scaletrain.parallel.compose import parallelize
from scaletrain.precision import make_precision
from scaletrain.records.memory import held_bytes, local_bytes
from scaletrain.training.assemble import NO_CODE, UserCode, build_net, build_objective
from scaletrain.training.optim import build_optimizer


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
    """A process group of `world_size` in which this process is `rank` and nothing is sent
    (torch's FakeProcessGroup). Only where no real group is open: the launcher, a test."""
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError("the planner's fake process group needs a process without one")
    # init_process_group wraps sys.excepthook to prefix "[rankN]: " and nothing unwraps it:
    # a launcher that planned 26 layouts printed its next traceback with 26 prefixes a line
    hook = sys.excepthook
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def held_on_rank(
    config: Config, derived: Derived, *, dataset, rank: int = 0, code: UserCode = NO_CODE
) -> Held:
    """The bytes rank `rank` holds under `derived`'s layout (see the module docstring).

    Args:
        config: the run's config (model, precision, optimizer, [parallel] keys).
        derived: `launch.resolve.resolve(config, world_size=...)`.
        dataset: the training data (its task sizes the model), built once by the caller.
    """
    layout = derived.layout
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
    with fake_world(layout.world_size, rank):
        par = parallelize(
            model,
            spec=model_spec(model),
            layout=layout,
            rank=rank,
            device=torch.device("cpu"),
            parallel=config.parallel,
            pipeline=derived.pipeline,
            precision=precision,
            loss_fn=loss_fn,
            shapes_only=True,
        )
        o = config.optim
        optimizer = build_optimizer(  # foreach: its state is the fused kernel's, shape for shape
            par.model,
            name=o.name,
            lr=o.lr,
            weight_decay=o.weight_decay,
            betas=o.betas,
            momentum=o.momentum,
            impl="foreach",
        )
        trained = [p for p in par.model.parameters() if p.requires_grad]
        for p in trained:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        held = held_bytes(par.model, optimizer)
        return Held(
            params=held["param_bytes"],
            grads=local_bytes(p.grad for p in trained),
            optim=held["optim_state_bytes"],
            largest_unit=_largest_unit(par.model),
            units=_units(par.model),
            recomputed_blocks=_recomputed(par.model, mode=config.parallel.activation_checkpointing),
        )


def _largest_unit(model: nn.Module) -> int:
    """The whole (unsharded) bytes of the largest FSDP unit's own parameters: what one
    all-gather materialises (0 without FSDP)."""
    from torch.distributed.fsdp import FSDPModule

    largest = 0
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        own = {
            id(p)
            for sub in unit.modules()
            if isinstance(sub, FSDPModule) and sub is not unit
            for p in sub.parameters()
        }
        size = sum(p.numel() * p.element_size() for p in unit.parameters() if id(p) not in own)
        largest = max(largest, size)
    return largest


def _units(model: nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


def _recomputed(model: nn.Module, *, mode: str) -> int:
    """The checkpointed blocks whose matmuls run again in backward: every wrapped one, but
    none under "op", whose policy keeps every other matmul's output (the trace counts the
    FLOPs of those it runs again: Activations.again_flops)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    if mode == "op":
        return 0
    return sum(isinstance(m, CheckpointWrapper) for m in model.modules())
