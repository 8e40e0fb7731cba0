"""The benchmarks' straggler: a built-in model that runs `factor` times slower on one rank.

bench/ps.py compares DDP with parameter servers when one worker is slow, as a slower or
busier machine would be. The slowing is the benchmark's, not the product's, so it lives
here as a model factory (`model.name = "straggler:build"`, bench/ on PYTHONPATH; the
model's other keys in `[model.kwargs]`):

- `build` returns the built-in `model` of `size`, unchanged (same parameters, names and
  initialisation, so its model.safetensors loads into the built-in model);
- on the process whose torchrun `RANK` is `slow_rank`, each forward that records a graph
  notes its start, and when the backward has produced every parameter's gradient the rank
  sleeps (factor - 1) x the time since: its forward and backward take `factor` times as
  long. Under DDP the other ranks then wait for it in the gradient all-reduce; a
  parameter-server worker pushes later.

Which rank to slow is the benchmark's to say: DDP's data-parallel rank 0 is RANK 0; with one
parameter server (rank 0), worker 0 is RANK 1.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from scaletrain import TaskSpec
from scaletrain.models import build_model


def build(
    task: TaskSpec,
    *,
    model: str = "cnn",
    size: str = "small",
    slow_rank: int = -1,
    factor: float = 1.0,
) -> nn.Module:
    """The built-in `model` of `size` for `task`; slowed `factor` times on RANK `slow_rank`.

    Built on the meta device like the built-in model (the caller materialises it from the
    run's seed), so the weights are the built-in model's under the same seed.
    """
    net = build_model(model, size=size, task=task, meta=True)
    if factor > 1 and os.environ.get("RANK") == str(slow_rank):
        slow_down(net, factor=factor)
    return net


def slow_down(net: nn.Module, *, factor: float) -> None:
    """Make `net`'s forward + backward take `factor` times as long (see the module)."""

    def forward_started(module: nn.Module, args: object) -> None:
        if not torch.is_grad_enabled():  # evaluation: not slowed
            return
        started = time.perf_counter()
        params = [p for p in module.parameters() if p.requires_grad]
        handle = None

        def backward_done(grads: object) -> None:
            handle.remove()  # once per forward
            time.sleep((factor - 1) * (time.perf_counter() - started))

        handle = torch.autograd.graph.register_multi_grad_hook(params, backward_done, mode="all")

    net.register_forward_pre_hook(forward_started)
