"""A multi-layer perceptron over flattened inputs: the smallest model worth parallelising.

It flattens each example whatever its shape, so it fits any classification task; its
Linear layers are the plainest targets for data parallelism and sharding, and the cheapest
way to check that a technique gives the same gradients as one process. There is no loss
inside: `forward` returns logits and the train step owns the loss and its normalisation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from scaletrain.models.init import reset_parameters
from scaletrain.models.protocol import ModelSpec, PipelineSplit

MLP_WIDTHS = {  # hidden widths by size
    "tiny": (64,),
    "small": (256, 256),
    "base": (1024, 1024),
}


class MLP(nn.Module):
    """Flatten -> [Linear -> ReLU -> Dropout] per hidden width -> Linear to logits."""

    # A pipeline stage takes a contiguous run of `net`'s layers (balanced by parameters);
    # nothing lives outside `net`, so there are no ends to keep. No repeated blocks and no
    # TP plan: FSDP shards it as one unit, tensor parallelism is refused.
    scaletrain_spec = ModelSpec(pipeline=PipelineSplit(first=(), blocks="net", last=()))

    # Built on the meta device, each layer gets torch's default init (models/init.py).
    init_module = staticmethod(reset_parameters)

    def __init__(
        self,
        *,
        input_shape: tuple[int, ...],
        num_classes: int,
        hidden: tuple[int, ...],
        dropout: float = 0.0,
    ) -> None:
        """Build the layers; weights use PyTorch's default init from the global seed.

        Args:
            input_shape: shape of one example, e.g. (1, 28, 28); it is flattened.
            num_classes: number of output logits.
            hidden: width of each hidden layer, in order.
            dropout: dropout probability after each hidden activation.
        """
        super().__init__()
        widths = (math.prod(input_shape), *hidden)
        layers: list[nn.Module] = [nn.Flatten()]
        for d_in, d_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(d_in, d_out), nn.ReLU(), nn.Dropout(dropout)]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (B, *input_shape) inputs to (B, num_classes) logits."""
        return self.net(x)  # (B, K)
