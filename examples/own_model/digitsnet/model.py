"""A residual MLP, built by a factory scaletrain calls as `build(task, **model.kwargs)`."""

from __future__ import annotations

import math

import torch
from torch import nn

import scaletrain


class ResidualBlock(nn.Module):
    """x + W2 relu(W1 LayerNorm(x)): width -> 2 width -> width."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))  # (B, width)


class ResidualMLP(nn.Module):
    """Flattened inputs -> `depth` residual blocks -> one logit per class."""

    def __init__(self, *, inputs: int, classes: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)
        # What FSDP and tensor parallelism need to know (scaletrain.ModelSpec): the repeated
        # blocks, and which Linear layers split by columns (up) and by rows (down).
        self.scaletrain_spec = scaletrain.ModelSpec(
            blocks="blocks",
            tp_plan={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"},
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.flatten(1))  # (B, width)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, classes)


def build(task: scaletrain.TaskSpec, *, width: int = 64, depth: int = 2) -> nn.Module:
    """The factory: sized from the data's task (`task.input_shape`, `task.num_classes`)."""
    return ResidualMLP(
        inputs=math.prod(task.input_shape), classes=task.num_classes, width=width, depth=depth
    )
