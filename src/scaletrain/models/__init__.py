"""The model registry: the one place a model name and size become an `nn.Module`.

Each model module owns its size table (widths, channels, depths) next to its code; this
registry only checks the name, the size and that the model suits the task, then sizes the
model's first and last layers from the `TaskSpec`. Models return logits and hold no loss,
so one train step serves them all. Construction draws from the global torch RNG: the same
`torch.manual_seed` gives the same weights.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from scaletrain.data.sources import TaskSpec
from scaletrain.models.cnn import CNN, CNN_CHANNELS
from scaletrain.models.gpt import GPT, GPT_SHAPES
from scaletrain.models.mlp import MLP, MLP_WIDTHS

MODEL_NAMES = ("mlp", "cnn", "gpt")
MODEL_SIZES = ("tiny", "small", "base")

# name -> (the task kind it fits, how to build it from size, task and dropout)
_REGISTRY: dict[str, tuple[str, Callable[[str, TaskSpec, float], nn.Module]]] = {
    "mlp": (
        "classification",
        lambda size, task, dropout: MLP(
            input_shape=task.input_shape, num_classes=task.num_classes, hidden=MLP_WIDTHS[size],
            dropout=dropout,
        ),
    ),
    "cnn": (
        "classification",
        lambda size, task, dropout: CNN(
            input_shape=task.input_shape, num_classes=task.num_classes, channels=CNN_CHANNELS[size],
            dropout=dropout,
        ),
    ),
    "gpt": (
        "lm",
        lambda size, task, dropout: GPT(
            vocab_size=task.num_classes, block_size=task.input_shape[0], shape=GPT_SHAPES[size],
            dropout=dropout,
        ),
    ),
}


def build_model(name: str, *, size: str, task: TaskSpec, dropout: float = 0.0) -> nn.Module:
    """Build a freshly initialised model for `task`.

    Args:
        name: one of MODEL_NAMES.
        size: one of MODEL_SIZES.
        task: what the data ask: mlp and cnn need kind "classification", gpt needs "lm".
        dropout: dropout probability, 0 to disable.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODEL_NAMES)}")
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; allowed: {', '.join(MODEL_SIZES)}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    kind, build = _REGISTRY[name]
    if task.kind != kind:
        fitting = ", ".join(n for n, (k, _) in _REGISTRY.items() if k == task.kind)
        raise ValueError(
            f"model {name!r} needs a task of kind {kind!r}, got {task.kind!r};"
            f" models for {task.kind!r}: {fitting}"
        )
    return build(size, task, dropout)


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (each shared tensor counted once), trainable or not."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["MODEL_NAMES", "MODEL_SIZES", "build_model", "count_parameters"]
