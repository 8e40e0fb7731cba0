"""What the launcher asks the planner: the layout to train (`scaletrain train --plan`) and
whether the configured one fits (`scaletrain train` refuses one predicted not to, unless
--no-plan-check).

The fit check plans only a model that can outgrow a device (a Hugging Face model or the
user's own) and whose parameters, gradients and Adam's moments (16 bytes a parameter) take
a tenth of a rank's memory or more: the built-ins' launches pay nothing for it.
"""

from __future__ import annotations

import json

import torch

from scaletrain.config import Config
from scaletrain.errors import ConfigError
from scaletrain.planner import build_for_plan, plan_layouts
from scaletrain.planner.predict import Prediction
from scaletrain.runtime.hardware import BUILTIN, Link, Profile, default_profile, rank_budget
from scaletrain.training.assemble import NO_CODE, UserCode


def pick_layout(
    config: Config, *, world_size: int, ranks_per_node: int, code: UserCode = NO_CODE
) -> tuple[list[str], Prediction]:
    """`--plan`: the overrides of the fastest layout predicted to fit, and its prediction."""
    profile = _profile()
    budget, _ = rank_budget(profile, ranks_per_node=ranks_per_node)
    # plan_layouts' memory per rank is this budget too (hardware.rank_budget)
    preds = plan_layouts(
        config, world_size=world_size, profile=profile, ranks_per_node=ranks_per_node, code=code
    )
    if not preds or not preds[0].fits:
        smallest = min((p.memory_bytes["peak"] for p in preds), default=0)
        raise ConfigError(
            f"--plan: no layout of {world_size} ranks is predicted to fit in "
            f"{_size(budget)} per rank (the smallest peak is {_size(smallest)}); add ranks, "
            "or train a smaller model"
        )
    items = [f"{k}={json.dumps(v)}" for k, v in preds[0].layout.items()]  # TOML's values
    return ["parallel.dp=-1", *items], preds[0]


def check_fits(
    config: Config, *, world_size: int, ranks_per_node: int, code: UserCode = NO_CODE
) -> None:
    """Raise ConfigError, naming the predicted peak, its parts and the budget, when the
    configured layout's peak exceeds a rank's memory (module docstring: which models)."""
    if not (config.model.name == "hf" or ":" in config.model.name or code.model is not None):
        return
    profile = _profile(required=False)
    budget, where = rank_budget(profile, ranks_per_node=ranks_per_node)
    dataset, model = build_for_plan(config, code)
    if 16 * sum(p.numel() for p in model.parameters()) < budget / 10:
        return
    # without a profile only the memory is asked: a stand-in's times (and link) mean nothing
    profile = profile or Profile("uncalibrated", {"fp32": 1e11}, budget, 1e10, {1: Link(1e9, 1e-4)})
    (pred,) = plan_layouts(
        config, world_size=world_size, profile=profile, dataset=dataset, model=model,
        ranks_per_node=ranks_per_node, budget_bytes=budget, only_configured=True, code=code,
    )  # fmt: skip
    if not pred.fits:
        m = pred.memory_bytes
        raise ConfigError(
            f"this layout is predicted to need {_size(m['peak'])} per rank (parameters "
            f"{_size(m['params'])}, gradients {_size(m['grads'])}, optimizer "
            f"{_size(m['optim'])}, activations {_size(m['activations'])}, gathered "
            f"{_size(m['buffers'])}) and {where} is {_size(budget)}: shard "
            "more (parallel.dp_shard, tp, pp), checkpoint activations, use a smaller "
            "train.micro_batch, or see `scaletrain plan`; --no-plan-check launches anyway"
        )


def _profile(required: bool = True) -> Profile | None:
    profile = default_profile("cuda" if torch.cuda.is_available() else "cpu")
    if profile is None and required:
        raise ConfigError(
            "--plan needs a hardware profile: run `scaletrain calibrate` once on this "
            f"machine, or set SCALETRAIN_HARDWARE to a built-in ({', '.join(BUILTIN)}) "
            "or a profile file"
        )
    return profile


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
