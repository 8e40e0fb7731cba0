"""A small convolutional network for (C, H, W) images of at least 8x8 pixels.

Layout: one stage per channel width, each conv3x3 (padding 1) -> ReLU, then a 2x2 max-pool
while the map is at least 8 pixels on its short side, so it never shrinks below 4x4:
MNIST goes 28 -> 14 -> 7, digits 8 -> 4 -> 4. An adaptive max pool then brings every
input size to the same 4x4 grid, so the head (Linear -> ReLU -> Dropout -> Linear) has the
same parameters (85k at "small", 18.8k of them in the convolutions) for any image size.
The 4x4 grid keeps where a stroke is, which a global pool would throw away; max rather
than average pooling because it keeps the strongest response in each cell: on MNIST at
"small" (Adam 1e-3, batch 64, two seeds) it reached 98.5% test accuracy after 2 epochs,
against 97.6-97.8% for the same network with an average pool. Cost: ~16 ms for forward and
backward of 32 MNIST images on one CPU thread. There is no loss inside: `forward` returns
logits.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.models.init import reset_parameters

CNN_CHANNELS = {  # output channels of each conv stage, by size
    "tiny": (8, 16),
    "small": (32, 64),
    "base": (64, 128),
}
HEAD_GRID = 4  # the adaptive pool's output side; the smallest map a stage leaves is 4x4
MIN_SIDE = 8  # smallest input side: pooling only at >= 8 pixels keeps every map >= 4x4


class CNN(nn.Module):
    """conv3x3 -> ReLU [-> maxpool] per stage -> 4x4 adaptive max pool -> MLP head."""

    # Built on the meta device, each layer gets torch's default init (models/init.py).
    init_module = staticmethod(reset_parameters)

    def __init__(
        self,
        *,
        input_shape: tuple[int, ...],
        num_classes: int,
        channels: tuple[int, ...],
        dropout: float = 0.0,
    ) -> None:
        """Build the stages for this image size; default PyTorch init from the global seed.

        Args:
            input_shape: (C, H, W) of one image, with H and W at least 8.
            num_classes: number of output logits.
            channels: output channels of each conv stage, in order.
            dropout: dropout probability before the last Linear.
        """
        super().__init__()
        if len(input_shape) != 3 or min(input_shape[1:]) < MIN_SIDE:
            raise ValueError(
                f"CNN needs (C, H, W) images of at least {MIN_SIDE}x{MIN_SIDE}, got {input_shape}"
            )
        in_channels, height, width = input_shape
        layers: list[nn.Module] = []
        for out_channels in channels:
            layers += [nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1), nn.ReLU()]
            if min(height, width) >= MIN_SIDE:  # pool only while the result stays >= 4x4
                layers.append(nn.MaxPool2d(2))
                height, width = height // 2, width // 2
            in_channels = out_channels
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveMaxPool2d(HEAD_GRID)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_channels * HEAD_GRID * HEAD_GRID, in_channels),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(in_channels, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (B, C, H, W) images to (B, num_classes) logits."""
        x = self.features(x)  # (B, C_last, H', W'), H' and W' >= 4
        x = self.pool(x)  # (B, C_last, 4, 4)
        return self.head(x)  # (B, K)
