"""The planner: per-rank memory and step time of every layout before launch, and a pick.

    layouts.py   the layouts of a world size that the launcher accepts (its own checks)
    trace.py     what a rank holds, exact, and one micro-batch's activations: traced on meta
    predict.py   memory peak, bytes per collective, step time, MFU (the cost model)

`plan_layouts` ranks every candidate that fits by predicted step time (`scaletrain plan`);
`pick_layout` and `check_fits` are what the launcher asks: the layout `train --plan` trains,
and whether the configured one fits (refused unless --no-plan-check). The check plans only a
model that can outgrow a device (a Hugging Face or the user's own) whose parameters,
gradients and Adam's moments (16 bytes a parameter) take a tenth of a rank's memory or more.
"""

from __future__ import annotations

import json

import torch

from scaletrain.config import Config
from scaletrain.errors import ConfigError
from scaletrain.planner.layouts import candidates, layout_overrides
from scaletrain.planner.predict import Prediction, predict
from scaletrain.planner.trace import held_on_rank, traced_activations
from scaletrain.precision import Hardware, decide_auto, detect_hardware
from scaletrain.runtime.hardware import BUILTIN, Link, Profile, default_profile, rank_budget
from scaletrain.training.assemble import NO_CODE, UserCode, build_data, build_net


def plan_layouts(
    config: Config,
    *,
    world_size: int,
    profile: Profile,
    dataset=None,
    model=None,
    ranks_per_node: int | None = None,
    budget_bytes: int | None = None,
    only_configured: bool = False,
    code: UserCode = NO_CODE,
) -> list[Prediction]:
    """Predictions for the accepted layouts of `world_size`: those that fit, fastest first,
    then the rest, smallest peak first; the configured one's notes say `configured`.
    `only_configured`: that layout alone, or the launcher's UserError refusing it. `code`:
    the Python API's own model, data and loss."""
    if dataset is None or model is None:
        dataset, model = build_for_plan(config, code)
    if config.precision.mode == "auto":  # as a run on `profile`'s hardware would decide it:
        # a GPU profile's part (every built-in is Ampere or later), else this CPU
        on = detect_hardware("cpu") if profile.cores else Hardware("cuda", cuda_capability=(8, 0))
        precision = config.precision.model_copy(update={"mode": decide_auto(on)[0]})
        config = config.model_copy(update={"precision": precision})
    per_node = ranks_per_node or profile.ranks_per_node(world_size)
    if budget_bytes is None:
        budget_bytes, _ = rank_budget(profile, ranks_per_node=per_node)
    found = candidates(config, world_size=world_size, model=model, only_configured=only_configured)
    example = dataset.get(torch.zeros(1, dtype=torch.long)).inputs[0]
    held: dict = {}  # traced once by what changes a rank's bytes
    acts: dict = {}  # and by what changes one micro-batch's (or pipeline chunk's)
    out = []
    for i, cand in enumerate(found):
        lay, pipe = cand.derived.layout, cand.derived.pipeline
        ac = cand.config.parallel.activation_checkpointing
        stages = (pipe.schedule, pipe.stages_per_rank) if pipe else (None, 1)
        held_key = (lay.pp, lay.dp_replicate, lay.dp_shard, lay.tp, *stages, ac)
        if held_key not in held:
            held[held_key] = held_on_rank(cand.config, cand.derived, dataset=dataset, code=code)
        chunk = cand.config.train.micro_batch // (pipe.microbatches if pipe else 1)
        if (lay.tp, ac, chunk) not in acts:
            acts[lay.tp, ac, chunk] = traced_activations(
                cand.config, dataset=dataset, examples=chunk, tp=lay.tp, code=code
            )
        pred = predict(
            cand, held=held[held_key], acts=acts[lay.tp, ac, chunk], model=model, example=example,
            profile=profile, ranks_per_node=per_node, budget_bytes=budget_bytes,
        )  # fmt: skip
        if i == 0 and cand.overrides == layout_overrides(config, world_size=world_size):
            pred.notes.append("configured")
        out.append(pred)
    return sorted(
        out, key=lambda p: (not p.fits, p.step_time_s if p.fits else p.memory_bytes["peak"])
    )


def predict_configured(config: Config, *, world_size: int, profile: Profile) -> Prediction:
    """The prediction for `config`'s own layout on `world_size` ranks."""
    return plan_layouts(config, world_size=world_size, profile=profile, only_configured=True)[0]


def build_for_plan(config: Config, code: UserCode = NO_CODE):
    """The training data and the bare model on meta, as the launcher's checks build them."""
    torch.manual_seed(config.train.seed)
    dataset = build_data(config, split="train", code=code)
    with torch.device("meta"):
        model = build_net(config, dataset, code=code, meta=True)
    return dataset, model


def pick_layout(
    config: Config, *, world_size: int, ranks_per_node: int, code: UserCode = NO_CODE
) -> tuple[list[str], Prediction]:
    """`--plan`: the overrides of the fastest layout predicted to fit, and its prediction."""
    profile = default_profile()
    if profile is None:
        raise ConfigError(
            "--plan needs a hardware profile: run `scaletrain calibrate` once on this "
            f"machine, or set SCALETRAIN_HARDWARE to a built-in ({', '.join(BUILTIN)}) "
            "or a profile file"
        )
    budget, _ = rank_budget(profile, ranks_per_node=ranks_per_node)  # plan_layouts' too
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
    """ConfigError, naming the predicted peak, its parts and the budget, where the configured
    layout's peak exceeds a rank's memory (module docstring: which models)."""
    if not (config.model.name == "hf" or ":" in config.model.name or code.model is not None):
        return
    profile = default_profile()
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


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
