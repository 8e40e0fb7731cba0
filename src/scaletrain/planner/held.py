"""What one rank holds, to the byte: parameters, gradients and optimizer state of any
layout, from the trainer's own code on meta in torch's FakeProcessGroup, counted by the
metrics' own functions: a prediction and a run's logged bytes are one function."""

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
from scaletrain.parallel.layout import ParallelLayout
from scaletrain.precision import make_precision
from scaletrain.records.memory import held_bytes, local_bytes
from scaletrain.training.assemble import NO_CODE, UserCode, build_net, build_objective
from scaletrain.training.optim import from_section


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
def parallelized(
    config: Config,
    layout: ParallelLayout,
    *,
    dataset,
    rank: int = 0,
    pipeline=None,
    code: UserCode = NO_CODE,
) -> Iterator[tuple]:
    """Yields (Parallelized, precision, loss_fn): the run's model built on meta as the
    trainer builds it, through `layout`'s own `parallelize`, in a fake process group."""
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
            pipeline=pipeline,
            precision=precision,
            loss_fn=loss_fn,
            shapes_only=True,
        )
        yield par, precision, loss_fn


def held_on_rank(
    config: Config, derived: Derived, *, dataset, rank: int = 0, code: UserCode = NO_CODE
) -> Held:
    """The bytes rank `rank` holds under `derived`'s layout, the optimizer stepped once on
    zero gradients so that its state exists."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    with parallelized(
        config, derived.layout, dataset=dataset, rank=rank, pipeline=derived.pipeline, code=code
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
            params=held["param_bytes"],
            grads=local_bytes(p.grad for p in trained),
            optim=held["optim_state_bytes"],
            largest_unit=largest,
            units=units,
            # under "op" the trace counts what runs again (Activations.again_flops)
            recomputed_blocks=0 if config.parallel.activation_checkpointing == "op" else wrapped,
        )


def _fsdp_units(model: nn.Module) -> tuple[int, int]:
    """The FSDP units, and the largest one's own parameters' whole bytes (one all-gather's)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    largest = 0
    for unit in units:
        inner = [m for m in unit.modules() if isinstance(m, FSDPModule) and m is not unit]
        nested = {id(p) for m in inner for p in m.parameters()}
        own = (p for p in unit.parameters() if id(p) not in nested)
        largest = max(largest, sum(p.numel() * p.element_size() for p in own))
    return len(units), largest
