"""Every layout of one world size that the launcher would accept: each candidate's keys go
through the launcher's own checks (`resolve`, `check_model_fits` on the meta model)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from scaletrain.config import Config, apply_overrides, validate_config
from scaletrain.errors import UserError
from scaletrain.launch.resolve import Derived, resolve
from scaletrain.models.protocol import model_spec
from scaletrain.parallel.compose import check_model_fits

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
AC_MODES = ("none", "op", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    overrides: dict  # dotted key -> value: the `parallel.*` keys and train.micro_batch
    config: Config
    derived: Derived


def layout_overrides(config: Config, *, world_size: int) -> dict:
    """The configured layout, written as a candidate's overrides (its -1 degree inferred)."""
    p = config.parallel
    try:
        lay = resolve(config, world_size=world_size).layout
        degrees = (lay.pp, lay.dp_replicate, lay.dp_shard, lay.tp)
    except UserError:
        degrees = (p.pp, max(p.dp_replicate, p.dp), p.dp_shard, p.tp)
    keys = _keys(degrees, p.activation_checkpointing, config.train.micro_batch)
    if degrees[0] > 1:
        keys["parallel.pp_schedule"] = p.pp_schedule
        # chunks and stages per rank only where configured (0: every candidate's default)
        if p.pp_microbatches:
            keys["parallel.pp_microbatches"] = p.pp_microbatches
        if p.pp_stages_per_rank:
            keys["parallel.pp_stages_per_rank"] = p.pp_stages_per_rank
    if degrees[2] > 1:
        keys["parallel.reshard_after_forward"] = p.reshard_after_forward
    return keys


def candidates(
    config: Config, *, world_size: int, model, only_configured: bool = False
) -> list[Candidate]:
    """The accepted layouts of `world_size`, the configured one first where accepted: the
    degrees, under pp the schedule, the micro-batch, activation checkpointing where `model`
    (bare, on meta) declares blocks, under FSDP ZeRO-3 or 2. `only_configured`: the
    configured layout alone, or the launcher's error refusing it."""
    spec = model_spec(model)
    base = config.model_dump(mode="json")
    configured = layout_overrides(config, world_size=world_size)
    if only_configured:
        return [_accepted(base, configured, world_size=world_size, model=model, spec=spec)]
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    wanted = {tuple(sorted(configured.items())): configured}  # each layout once, in order
    for pp, rep, shard, tp in itertools.product(divisors, repeat=4):
        if pp * rep * shard * tp != world_size:
            continue
        for schedule, mb, ac, zero3 in itertools.product(
            SCHEDULES if pp > 1 else (None,),
            _micro_batches(config, rep * shard),
            AC_MODES if spec.blocks else ("none",),
            (True, False) if shard > 1 else (None,),
        ):
            keys = _keys((pp, rep, shard, tp), ac, mb)
            if schedule:
                keys["parallel.pp_schedule"] = schedule
            if zero3 is not None:
                keys["parallel.reshard_after_forward"] = zero3
            wanted.setdefault(tuple(sorted(keys.items())), keys)
    out = []
    for keys in wanted.values():
        try:
            out.append(_accepted(base, keys, world_size=world_size, model=model, spec=spec))
        except UserError:
            continue  # a layout the launcher refuses
    return out


def _keys(degrees: tuple, ac: str, micro_batch: int) -> dict:
    names = ("parallel.pp", "parallel.dp_replicate", "parallel.dp_shard", "parallel.tp")
    keys = dict(zip(names, degrees))
    return {**keys, "parallel.activation_checkpointing": ac, "train.micro_batch": micro_batch}


def _micro_batches(config: Config, dp: int) -> list[int]:
    """The configured micro-batch and the per-rank batch over 1, 2 and 4, where they divide it."""
    if config.train.global_batch % dp:
        return []
    per_rank = config.train.global_batch // dp
    sizes = (per_rank, per_rank // 2, per_rank // 4, config.train.micro_batch)
    return sorted({b for b in sizes if 0 < b <= per_rank and per_rank % b == 0}, reverse=True)


def _accepted(base: dict, keys: dict, *, world_size: int, model, spec) -> Candidate:
    """`keys` applied to `base` as the launcher would take them, or its UserError."""
    extra = {"parallel.dp": -1, "parallel.pp_microbatches": 0, "parallel.pp_stages_per_rank": 0}
    items = [f"{k}={json.dumps(v)}" for k, v in {**extra, **keys}.items()]  # TOML's values
    config = validate_config(apply_overrides(base, items))
    derived = resolve(config, world_size=world_size)
    check_model_fits(
        model, spec, layout=derived.layout, parallel=config.parallel, pipeline=derived.pipeline,
        model_label=f"model.name = {config.model.name!r}",
    )  # fmt: skip
    return Candidate(overrides=keys, config=config, derived=derived)
