"""The model registry: the one place a model name becomes an `nn.Module`.

Three kinds of name:
- a built-in (mlp, cnn, gpt) with a size: each model module owns its size table (widths,
  channels, depths) next to its code; this registry checks the name, the size and that the
  model suits the task, then sizes the first and last layers from the `TaskSpec`;
- "hf": a Hugging Face causal LM from a local directory or a config (models/hf.py);
- an import path 'package.module:function' (or, from the Python API, the function itself):
  the user's factory, called as `function(task, **kwargs)`, must return an `nn.Module`.
Models return logits (or an object with `.logits`) and hold no loss, so one train step
serves them all. Construction draws from the global torch RNG: the same `torch.manual_seed`
gives the same weights on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from scaletrain.data.sources import TaskSpec
from scaletrain.models.cnn import CNN, CNN_CHANNELS
from scaletrain.models.gpt import GPT, GPT_SHAPES
from scaletrain.models.init import INIT_ATTR, init_plan, is_meta, materialize
from scaletrain.models.mlp import MLP, MLP_WIDTHS
from scaletrain.user_code import UserCodeError, call, is_import_path, load_object

MODEL_NAMES = ("mlp", "cnn", "gpt")
MODEL_SIZES = ("tiny", "small", "base")

# name -> (the task kinds it fits, how to build it from size, task and dropout)
_REGISTRY: dict[str, tuple[tuple[str, ...], Callable[[str, TaskSpec, float], nn.Module]]] = {
    "mlp": (  # regression: num_classes outputs, one per target value
        ("classification", "regression"),
        lambda size, task, dropout: MLP(
            input_shape=task.input_shape,
            num_classes=task.num_classes,
            hidden=MLP_WIDTHS[size],
            dropout=dropout,
        ),
    ),
    "cnn": (
        ("classification",),
        lambda size, task, dropout: CNN(
            input_shape=task.input_shape,
            num_classes=task.num_classes,
            channels=CNN_CHANNELS[size],
            dropout=dropout,
        ),
    ),
    "gpt": (
        ("lm",),
        lambda size, task, dropout: GPT(
            vocab_size=task.num_classes,
            block_size=task.input_shape[0],
            shape=GPT_SHAPES[size],
            dropout=dropout,
        ),
    ),
}


def build_model(
    name: str,
    *,
    size: str,
    task: TaskSpec,
    dropout: float = 0.0,
    kwargs: dict[str, Any] | None = None,
    path: str = "",
    hf_config: str = "",
    factory: Callable[..., nn.Module] | None = None,
    param_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    meta: bool = False,
) -> nn.Module:
    """Build a freshly initialised model for `task`.

    The model is built on the meta device and initialised by models/init.py's module rule,
    which gives the same values whatever the layout. With `meta` it comes back
    unmaterialised (the trainer materialises each rank's shards once the layout has split
    it). A model that cannot be built that way (a user factory whose model declares no
    `init_module`, or one that fails on the meta device; a pretrained Hugging Face
    directory) is built whole, initialised from the global torch RNG; `is_meta` tells which.

    Args:
        name: one of MODEL_NAMES, "hf", or an import path 'package.module:function'.
        size: one of MODEL_SIZES (built-in models only).
        task: what the data ask: mlp fits classification and regression, cnn
            classification, gpt and hf language modelling ("lm"); a factory gets the task.
        dropout: dropout probability of a built-in model, 0 to disable.
        kwargs: keyword arguments for a factory or the Hugging Face config.
        path, hf_config: for "hf": a local model directory, or a config file / class name.
        factory: the factory itself (Python API); `name` is then only its label.
        param_dtype: the dtype "hf" loads its weights in (float64 for the fp64 precision
            mode, so that float64 checkpoints are not rounded); other models are built in
            float32 and cast by the precision policy.
        seed: the run's seed (train.seed), from which each module's init is drawn.
        meta: return the model on the meta device where it can be built there.

    Raises:
        UserCodeError: a factory that does not import, raises, or returns no nn.Module.
        HFModelError: a Hugging Face directory or config that cannot train the task.
    """

    def construct() -> nn.Module:
        return _construct(
            name,
            size=size,
            task=task,
            dropout=dropout,
            kwargs=kwargs or {},
            path=path,
            hf_config=hf_config,
            factory=factory,
            param_dtype=param_dtype,
            meta=meta,
        )

    if name == "hf" and path and not meta:  # pretrained weights, read whole
        return construct()
    try:
        with torch.device("meta"):
            model = construct()
    except UserCodeError as meta_error:  # the user's factory, failing on the meta device
        if factory is None and not is_import_path(name):
            raise
        # Built for real: a factory that computes on its tensors' values in __init__ builds
        # whole (its factory runs a second time), and a mistake that fails there too is
        # raised from here. A model that declares an initialiser asked to be built on meta:
        # what failed there is its author's to see.
        model = construct()
        if init_plan(model) is not None:
            raise UserCodeError(
                f"{meta_error} while built on the meta device; the model defines "
                f"`{INIT_ATTR}`, so scaletrain builds it there (shapes only) and initialises "
                "each rank's shards: its __init__ must not read its tensors' values (move "
                f"such code into `{INIT_ATTR}`), or remove `{INIT_ATTR}` to build it whole"
            ) from meta_error
        return model
    plan = init_plan(model)
    if plan is None:  # a module no initialiser covers: the model's own __init__ decides
        return construct()
    if not meta:
        materialize([model], plan=plan, seed=seed, device=torch.device("cpu"))
    return model


def _construct(
    name: str,
    *,
    size: str,
    task: TaskSpec,
    dropout: float,
    kwargs: dict[str, Any],
    path: str,
    hf_config: str,
    factory: Callable[..., nn.Module] | None,
    param_dtype: torch.dtype,
    meta: bool = False,
) -> nn.Module:
    """The dispatch from a name to a model, on whatever device is current (`meta`: a
    pretrained Hugging Face model's weights are located, not read)."""
    if factory is not None or is_import_path(name):
        return _from_factory(name, task=task, kwargs=kwargs, factory=factory)
    if name == "hf":
        from scaletrain.models.hf import build_hf_model

        return build_hf_model(
            path=path, hf_config=hf_config, kwargs=kwargs, task=task, dtype=param_dtype, meta=meta
        )
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown model {name!r}; allowed: {', '.join(MODEL_NAMES)}, 'hf', "
            "or an import path 'package.module:function'"
        )
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; allowed: {', '.join(MODEL_SIZES)}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    kinds, build = _REGISTRY[name]
    if task.kind not in kinds:
        fitting = ", ".join(n for n, (k, _) in _REGISTRY.items() if task.kind in k)
        raise ValueError(
            f"model {name!r} needs a task of kind {' or '.join(map(repr, kinds))}, got "
            f"{task.kind!r}; models for {task.kind!r}: {fitting or 'hf or your own factory'}"
        )
    return build(size, task, dropout)


def _from_factory(
    name: str, *, task: TaskSpec, kwargs: dict[str, Any], factory: Callable[..., nn.Module] | None
) -> nn.Module:
    """The user's factory, called as factory(task, **kwargs); it must return an nn.Module."""
    fn = factory if factory is not None else load_object(name, key="model.name")
    model = call(fn, task, key="model.name", path=name, **kwargs)
    if not isinstance(model, nn.Module):
        raise UserCodeError(
            f"model.name = {name!r} returned a {type(model).__name__}, not a "
            "torch.nn.Module; a factory returns the model it builds"
        )
    if not any(True for _ in model.parameters()):
        raise UserCodeError(
            f"model.name = {name!r} returned a {type(model).__name__} with no "
            "parameters: there is nothing to train"
        )
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (each shared tensor counted once), trainable or not."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["MODEL_NAMES", "MODEL_SIZES", "build_model", "count_parameters", "is_meta"]
