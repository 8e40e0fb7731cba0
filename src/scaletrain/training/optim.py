"""Optimizer and learning-rate schedule from the [optim] section's values.

`optim.name` is any optimizer torch.optim ships, by its lowercase name (the list is read
from the installed torch: config.optimizer_names), or the user's own Optimizer subclass by
import path (user_code.py). Its constructor gets optim.lr, weight_decay, betas and momentum
where its signature takes them, `optim.kwargs` for the rest, and the fused or foreach
kernels (optim.impl) where it offers them. `check_optimizer` holds the section against the
constructor before any worker starts; the same functions refuse a mistake where the
optimizer is built, so it reads the same either way.

Two of torch's optimizers need more than a constructor call (training/optimizers.py): muon
is Muon on the hidden layers' matrices and AdamW on the rest, as one Optimizer; Muon,
Adafactor and Rprop step on whole tensors where the layout shards the parameters. The
user's own class gets the parameters as the layout holds them (DTensors under dp_shard and
tp), as torch's element-wise optimizers do.

Schedules (`lr_multiplier`): a linear warmup, then constant, cosine, linear or
warmup-stable-decay, as a LambdaLR stepped once per optimizer step.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Collection, Mapping
from typing import Any

import torch

from scaletrain.config import OptimConfig, optimizer_names
from scaletrain.errors import ConfigError
from scaletrain.training.optimizers import (
    MuonWithAdamW,
    hidden_matrices,
    plain_name,
    whole_tensor_step,
)
from scaletrain.user_code import UserCodeError, is_import_path, load_object

OPTIMIZER_IMPLS = ("auto", "fused", "foreach")
# [optim] fields passed to every constructor whose signature takes them.
SHARED = ("lr", "weight_decay", "betas", "momentum")
# torch's optimizers whose step must see whole tensors under dp_shard / tp
# (training/optimizers.py: Muon's orthogonalisation, Adafactor's factored moments and
# Rprop's masked updates); muon's Muon half is built so by MuonWithAdamW.
WHOLE_TENSOR_STEP = ("adafactor", "rprop")
# Those whose fused kernels take DTensor parameters (muon: its AdamW half); torch 2.13's fused
# SGD and Adagrad have no DTensor sharding rule: under dp_shard / tp the others run foreach.
FUSED_ON_DTENSORS = ("adam", "adamw", "muon")


# --------------------------------------------------------------------------- the class


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """torch.optim's class for a lowercase name, or the user's class for an import path.

    Raises:
        UserCodeError: an import path that does not import, or names no Optimizer subclass.
    """
    if is_import_path(name):
        cls = load_object(name, key="optim.name")
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise UserCodeError(
                f"optim.name = {name!r} is a {type(cls).__name__}, not a subclass of "
                "torch.optim.Optimizer"
            )
        return cls
    if name not in optimizer_names():  # config validation refuses these first
        raise ConfigError(f"optim.name = {name!r} is not an optimizer torch.optim ships")
    return next(
        cls
        for cls in vars(torch.optim).values()
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
        if cls.__name__.lower() == name
    )


def _accepted(cls: type) -> tuple[set[str], bool]:
    """The constructor's keyword parameters (not `params`), and whether it takes **kwargs."""
    params = list(inspect.signature(cls).parameters.values())[1:]  # after `params`
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return named, any(p.kind == p.VAR_KEYWORD for p in params)


def constructor_kwargs(
    cls: type, *, name: str, shared: Mapping[str, Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """What the constructor gets besides the parameters and the kernels: the `shared` values
    (SHARED: optim.lr, ...) its signature takes, then `kwargs` (optim.kwargs).

    Raises:
        ConfigError: a kwargs key that is one of the [optim] fields (or fused / foreach, which
            optim.impl sets), or one the constructor does not take, naming the allowed ones.
    """
    named, open_ended = _accepted(cls)
    for key in kwargs:
        field = key if key in SHARED else "impl" if key in ("fused", "foreach") else None
        if field is not None:
            raise ConfigError(
                f"optim.kwargs.{key} repeats optim.{field}: set optim.{field} instead "
                f"(it is passed to every optimizer that takes {key!r})"
            )
    unknown = sorted(set(kwargs) - named) if not open_ended else []
    if unknown:
        allowed = sorted(named - {*SHARED, "fused", "foreach"})
        raise ConfigError(
            f"optim.kwargs.{unknown[0]}: optim.name = {name!r} "
            f"({cls.__module__}.{cls.__qualname__}) takes no argument {unknown[0]!r}; "
            f"allowed in optim.kwargs: {', '.join(allowed) or '(none)'}"
        )
    taken = {k: tuple(v) if k == "betas" else v for k, v in shared.items() if k in named}
    return {**taken, **kwargs}


def _shared(optim: OptimConfig) -> dict[str, Any]:
    return {k: getattr(optim, k) for k in SHARED}


def check_optimizer(optim: OptimConfig) -> None:
    """The [optim] section against its optimizer's constructor, before any worker starts:
    the class imports, optim.kwargs fits its signature, optim.impl names kernels it has.

    Raises:
        ConfigError, UserCodeError: naming the key, the value and what is allowed.
    """
    cls = optimizer_class(optim.name)
    constructor_kwargs(cls, name=optim.name, shared=_shared(optim), kwargs=optim.kwargs)
    if optim.name == "muon":  # the kernels go to its AdamW half
        return
    named, _ = _accepted(cls)
    if optim.impl != "auto" and optim.impl not in named:
        offered = [impl for impl in ("fused", "foreach") if impl in named]
        raise ConfigError(
            f"optim.impl = {optim.impl!r}: {cls.__qualname__} has no {optim.impl} kernels; "
            f"allowed for optim.name = {optim.name!r}: auto"
            + "".join(f", {impl}" for impl in offered)
        )


# --------------------------------------------------------------------------- kernels


def fused_supported(params: list[torch.Tensor]) -> tuple[bool, str]:
    """Whether torch's fused optimizer kernels take these parameters, and why (or why not).

    The decision is torch's own (the check its optimizers make when `fused=True` is asked
    for): every parameter floating point, of a supported type, on a device with fused kernels.
    """
    from torch.optim.optimizer import _default_to_fused_or_foreach

    fused, _ = _default_to_fused_or_foreach(params, differentiable=False, use_fused=True)
    devices = sorted({p.device.type for p in params})
    if fused:
        return True, f"torch has fused kernels for these parameters on {devices}"
    return False, f"torch's fused kernels do not take these parameters (devices {devices})"


def resolve_impl(impl: str, params: list[torch.Tensor]) -> str:
    """ "auto" -> "fused" where the device has fused kernels, else "foreach"."""
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer impl {impl!r} is not one of {OPTIMIZER_IMPLS}")
    if impl == "auto":
        return "fused" if fused_supported(params)[0] else "foreach"
    return impl


def layout_impl(optim: OptimConfig, *, splits_gradients: bool, loss_scaled: bool) -> str:
    """optim.impl, or "foreach" where a fused kernel cannot run under a layout that splits
    gradients: with fp16's loss scaler (a fused kernel takes its found-inf flag as a plain
    tensor, which it cannot mix with DTensor parameters), or for an optimizer whose fused
    kernel has no DTensor sharding rule (not in FUSED_ON_DTENSORS)."""
    if splits_gradients and (loss_scaled or optim.name not in FUSED_ON_DTENSORS):
        return "foreach"
    return optim.impl


def chosen_kernels(optim: OptimConfig, params: list[torch.Tensor]) -> str:
    """The kernels optim.impl gives this optimizer over `params`: "fused", "foreach", or
    "its own" for a class that offers neither (muon: its AdamW half's)."""
    cls = torch.optim.AdamW if optim.name == "muon" else optimizer_class(optim.name)
    return next(iter(_kernels(cls, optim.impl, params)), "its own")


def _kernels(cls: type, impl: str, params: list[torch.Tensor]) -> dict[str, bool]:
    """fused=True or foreach=True, where the class takes it; {} for a class with neither."""
    named, _ = _accepted(cls)
    chosen = resolve_impl(impl, params)
    if chosen == "fused" and "fused" not in named:
        chosen = "foreach"
    return {chosen: True} if chosen in named else {}


def _kernel_groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """One parameter group, or two under tensor parallelism without FSDP: a fused or foreach
    kernel takes either plain tensors or DTensors, never both in one call, and TP leaves
    the embeddings, norms and head plain. Both groups have the same hyper-parameters."""
    from torch.distributed.tensor import DTensor

    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": g} for g in (plain, sharded) if g] or [{"params": params}]


# --------------------------------------------------------------------------- building


def build_optimizer(
    model: torch.nn.Module,
    *,
    name: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    momentum: float,
    impl: str = "auto",
    kwargs: Mapping[str, Any] | None = None,
    hidden: Collection[str] | None = None,
) -> torch.optim.Optimizer:
    """The named optimizer over every trainable parameter of `model`.

    Args:
        model: the module whose trainable parameters are optimized.
        name: a torch.optim optimizer's lowercase name, or 'package.module:Class'.
        lr, weight_decay, betas, momentum: passed where the constructor takes them.
        impl: "fused" (one kernel over all parameters: the MLP-base job's whole step is
            1.22x faster than foreach on CPU, BENCHMARKS.md), "foreach"
            (multi-tensor ops), or "auto" (fused where the device supports it), each where
            the class offers it. Both compute the same update; tests/test_optim.py checks
            them against each other in fp64.
        kwargs: the constructor's other arguments (optim.kwargs).
        hidden: muon: the names of the parameters Muon takes (`hidden_matrices` of the
            whole model); None = those of `model` itself.
    """
    kwargs = dict(kwargs or {})
    shared = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "momentum": momentum}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if name == "muon":
        hidden = set(hidden_matrices(model) if hidden is None else hidden)
        matrices = [p for n, p in named if plain_name(n) in hidden]
        rest = [p for n, p in named if plain_name(n) not in hidden]
        muon = constructor_kwargs(torch.optim.Muon, name=name, shared=shared, kwargs=kwargs)
        muon.setdefault("adjust_lr_fn", "match_rms_adamw")  # one lr for both halves
        adamw = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        adamw.update(_kernels(torch.optim.AdamW, impl, rest) if rest else {})
        return MuonWithAdamW(_kernel_groups(matrices), _kernel_groups(rest), muon=muon, adamw=adamw)
    cls = optimizer_class(name)
    if name in WHOLE_TENSOR_STEP:
        cls = whole_tensor_step(cls)
    arguments = constructor_kwargs(cls, name=name, shared=shared, kwargs=kwargs)
    arguments.update(_kernels(cls, impl, params))
    return cls(_kernel_groups(params), **arguments)


def from_section(
    model: torch.nn.Module,
    optim: OptimConfig,
    *,
    total_steps: int,
    impl: str | None = None,
    per_step: int = 1,
    hidden: Collection[str] | None = None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer and schedule the [optim] section describes, over `model`'s trainable
    parameters: what the trainer, the parameter servers and `auto`'s probe all build.

    Args:
        model: the module (or a parameter server's shard) to optimize.
        optim: the frozen [optim] section.
        total_steps: optimizer steps the schedule spans (train.steps).
        impl: the kernels, where the caller must override optim.impl (None: optim.impl).
        per_step: scheduler steps per optimizer step (a parameter server steps once per
            gradient: several make a global step).
        hidden: muon: the parameters Muon takes, by name (`hidden_matrices` of the whole
            model, for a pipeline stage or a server's shard); None = `model`'s own.
    """
    optimizer = build_optimizer(
        model,
        name=optim.name,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=optim.betas,
        momentum=optim.momentum,
        impl=impl or optim.impl,
        kwargs=optim.kwargs,
        hidden=hidden,
    )
    scheduler = build_scheduler(
        optimizer,
        warmup_steps=optim.warmup_steps * per_step,
        total_steps=total_steps * per_step,
        schedule=optim.schedule,
        min_lr_ratio=optim.min_lr_ratio,
        decay_fraction=optim.decay_fraction,
    )
    return optimizer, scheduler


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """One line for the run's start: the class and the arguments that differ from its
    defaults (the peak lr, before any warmup) or, for muon, what each half takes."""
    if isinstance(optimizer, MuonWithAdamW):
        counts = []
        for flag in (True, False):
            params = [p for g in optimizer.param_groups if g["muon"] is flag for p in g["params"]]
            # a DTensor's numel is the whole tensor's
            counts.append((len(params), sum(p.numel() for p in params)))
        (m, m_values), (a, a_values) = counts
        return (
            f"optimizer: muon - on this rank Muon takes {m} hidden-layer matrices "
            f"({m_values:,} values), AdamW the other {a} tensors ({a_values:,} values: "
            "embeddings, output head, norms, biases)"
        )
    cls = getattr(optimizer, "wrapped", type(optimizer))
    group = {**optimizer.param_groups[0]}
    group["lr"] = group.get("initial_lr", group["lr"])
    defaults = {
        k: v.default
        for k, v in inspect.signature(cls).parameters.items()
        if k in group and k != "params"
    }
    shown = [f"{k}={group[k]!r}" for k in sorted(defaults) if k == "lr" or group[k] != defaults[k]]
    where = "torch.optim" if cls.__module__.startswith("torch.optim") else cls.__module__
    return f"optimizer: {where}.{cls.__qualname__}({', '.join(shown)})"


# --------------------------------------------------------------------------- schedules


def lr_multiplier(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: str,
    min_lr_ratio: float,
    decay_fraction: float = 0.2,
) -> float:
    """LR / peak LR at optimizer step `step` (0-based): linear warmup from 1/warmup_steps to
    1 over the first warmup_steps, then:

    - constant: 1;
    - cosine, linear: from 1 at the first step after warmup to min_lr_ratio at the last
      (step total_steps - 1);
    - wsd (warmup-stable-decay): 1 until the last round(decay_fraction x total_steps)
      steps (at least one), which decay linearly to min_lr_ratio, reached at the last step.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * total_steps))
        progress = min(1.0, max(0, step - (total_steps - decay_steps) + 1) / decay_steps)
        return 1.0 - (1.0 - min_lr_ratio) * progress
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    if schedule == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"schedule {schedule!r} is not one of constant, cosine, linear, wsd")


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: str,
    min_lr_ratio: float,
    decay_fraction: float = 0.2,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `lr_multiplier`, advanced once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            schedule=schedule,
            min_lr_ratio=min_lr_ratio,
            decay_fraction=decay_fraction,
        ),
    )
