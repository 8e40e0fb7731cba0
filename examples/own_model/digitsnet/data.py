"""A map-style dataset, returned by a function scaletrain calls as `digits(split, **data.kwargs)`.

scikit-learn's 8x8 digits (shipped with the package, no download), flattened to 64 features
in [0, 1]; a fixed 80/20 split into train and eval.
"""

from __future__ import annotations

import numpy as np
import torch

import scaletrain


class Digits(torch.utils.data.Dataset):
    """Item i is a dict: "inputs" (64,) float32 and "targets" () int64."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.inputs = torch.from_numpy(images.astype(np.float32) / 16.0)  # (N, 64)
        self.targets = torch.from_numpy(labels.astype(np.int64))  # (N,)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.inputs[i], "targets": self.targets[i]}


def digits(split: str, *, train_fraction: float = 0.8):
    """(dataset, task) for one split ("train" or "eval")."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)  # (1797, 64), (1797,)
    order = np.random.RandomState(0).permutation(len(labels))
    cut = int(train_fraction * len(labels))
    rows = order[:cut] if split == "train" else order[cut:]
    task = scaletrain.TaskSpec(kind="classification", input_shape=(64,), num_classes=10)
    return Digits(images[rows], labels[rows]), task
