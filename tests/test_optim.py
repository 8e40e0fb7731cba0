"""Optimizer kernels: fused and foreach compute the same AdamW and SGD updates (float64, 1e-12),
`auto` picks fused where torch has fused kernels for the device."""

from __future__ import annotations

import pytest
import torch

from scaletrain.data.sources import TaskSpec
from scaletrain.models import build_model
from scaletrain.training.optim import build_optimizer, fused_supported, resolve_impl

TASK = TaskSpec(kind="classification", input_shape=(1, 8, 8), num_classes=10)


def _train(impl: str, name: str, steps: int = 6) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model = build_model("mlp", size="small", task=TASK).double()
    opt = build_optimizer(
        model, name=name, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), momentum=0.9, impl=impl
    )
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(16, 1, 8, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, 10, (16,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_matches_foreach(name: str) -> None:
    fused, foreach = _train("fused", name), _train("foreach", name)
    initial = _train("foreach", name, steps=0)
    diff = max(float((fused[k] - foreach[k]).abs().max()) for k in fused)
    moved = max(float((foreach[k] - initial[k]).abs().max()) for k in fused)
    assert diff < 1e-12 and moved > 1e-3, (diff, moved)


def test_auto_picks_fused_on_cpu_and_the_kernels_are_used() -> None:
    model = build_model("mlp", size="tiny", task=TASK)
    params = list(model.parameters())
    assert fused_supported(params)[0] and resolve_impl("auto", params) == "fused"
    opt = build_optimizer(
        model,
        name="adamw",
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        momentum=0.0,
        impl="auto",
    )
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    opt = build_optimizer(
        model,
        name="adamw",
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        momentum=0.0,
        impl="foreach",
    )
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("turbo", params)
