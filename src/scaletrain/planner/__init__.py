"""The planner: per-rank memory and step time of every layout before launch, and a pick.

    layouts.py      the layouts of a world size that the launcher accepts (its own checks)
    held.py         params, grads, optimizer state per rank, exact: the layout's own
                    `parallelize` on meta, in a fake process group
    activations.py  one micro-batch's activations, traced under FakeTensorMode
    predict.py      memory peak, bytes per collective, step time, MFU (the cost model)

`plan_layouts` runs them over every candidate and ranks those that fit by predicted step
time; `scaletrain plan` prints it, `scaletrain train --plan` trains the first.
"""

from __future__ import annotations

import torch

from scaletrain.config import Config
from scaletrain.planner.activations import traced_activations
from scaletrain.planner.held import held_on_rank
from scaletrain.planner.layouts import candidates, layout_overrides
from scaletrain.planner.predict import Prediction, predict
from scaletrain.runtime.hardware import Profile, rank_budget
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
    then the others, smallest peak first; the configured layout's notes say `configured`.
    `only_configured`: that layout alone, or the launcher's UserError refusing it. Defaults:
    `build_for_plan`'s data and meta model, `Profile.ranks_per_node`, `rank_budget`'s bytes;
    `code`: the Python API's own model, data and loss."""
    if dataset is None or model is None:
        dataset, model = build_for_plan(config, code)
    config = resolve_auto_precision(config, profile)
    per_node = ranks_per_node or profile.ranks_per_node(world_size)
    if budget_bytes is None:
        budget_bytes, _ = rank_budget(profile, ranks_per_node=per_node)
    found = candidates(config, world_size=world_size, model=model, only_configured=only_configured)
    example = dataset.get(torch.zeros(1, dtype=torch.long)).inputs[0]
    held: dict = {}  # by what changes a rank's parameters, gradients and optimizer state
    acts: dict = {}  # by what changes one micro-batch's (or pipeline chunk's) activations
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
            cand.config,
            cand.derived,
            layout_keys=cand.overrides,
            held=held[held_key],
            acts=acts[lay.tp, ac, chunk],
            model=model,
            example=example,
            profile=profile,
            ranks_per_node=per_node,
            budget_bytes=budget_bytes,
        )
        if i == 0 and cand.overrides == layout_overrides(config, world_size=world_size):
            pred.notes.append("configured")
        out.append(pred)
    return sorted(
        out, key=lambda p: (not p.fits, p.step_time_s if p.fits else p.memory_bytes["peak"])
    )


def predict_configured(
    config: Config, *, world_size: int, profile: Profile, ranks_per_node: int | None = None
) -> Prediction:
    """The prediction for `config`'s own layout on `world_size` ranks."""
    (pred,) = plan_layouts(
        config,
        world_size=world_size,
        profile=profile,
        ranks_per_node=ranks_per_node,
        only_configured=True,
    )
    return pred


def resolve_auto_precision(config: Config, profile: Profile) -> Config:
    """`config` with precision.mode "auto" decided as a run on `profile`'s hardware would:
    a GPU profile's part (every built-in is Ampere or later), else this CPU."""
    from scaletrain.precision import Hardware, decide_auto, detect_hardware

    if config.precision.mode != "auto":
        return config
    on = detect_hardware("cpu") if profile.cores else Hardware("cuda", cuda_capability=(8, 0))
    mode, _ = decide_auto(on)
    precision = config.precision.model_copy(update={"mode": mode})
    return config.model_copy(update={"precision": precision})


def build_for_plan(config: Config, code: UserCode | None = None):
    """The training data and the bare model on meta, as the launcher's checks build them."""
    code = code or NO_CODE
    torch.manual_seed(config.train.seed)
    dataset = build_data(config, split="train", code=code)
    with torch.device("meta"):
        model = build_net(config, dataset, code=code, meta=True)
    return dataset, model
