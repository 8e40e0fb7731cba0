"""Every layout of one world size that the launcher would accept.

A candidate overrides the [parallel] keys and train.micro_batch: the degrees (pp x
dp_replicate x dp_shard x tp = the world), under pp the schedule, the micro-batch (the
configured one and the per-rank batch over 1, 2 and 4), activation checkpointing where the
model declares blocks and, under FSDP, ZeRO-3 or ZeRO-2 (reshard_after_forward). Each goes
through the launcher's own checks (`resolve`, `check_model_fits` on the meta model): a
layout refused before launch is not a candidate.
"""

from __future__ import annotations

import itertools
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
        # chunks and stages per rank only where configured (0: the launcher's default,
        # which every other candidate takes)
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
    """The accepted layouts of `world_size`, the configured one first when it is accepted.

    Args:
        model: the bare model on meta (its spec and blocks are read).
        only_configured: the configured layout alone, and the launcher's error where it
            would refuse it (never another layout in its place).
    """
    spec = model_spec(model)
    base = config.model_dump(mode="json")
    configured = layout_overrides(config, world_size=world_size)
    if only_configured:
        return [_accepted(base, configured, world_size=world_size, model=model, spec=spec)]
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    wanted = [configured]
    for degrees in itertools.product(divisors, repeat=4):
        pp, rep, shard, tp = degrees
        if pp * rep * shard * tp != world_size:
            continue
        for schedule, mb, ac, zero3 in itertools.product(
            SCHEDULES if pp > 1 else (None,),
            _micro_batches(config, rep * shard),
            AC_MODES if spec.blocks else ("none",),
            (True, False) if shard > 1 else (None,),
        ):
            keys = _keys(degrees, ac, mb)
            if schedule:
                keys["parallel.pp_schedule"] = schedule
            if zero3 is not None:
                keys["parallel.reshard_after_forward"] = zero3
            wanted.append(keys)
    seen, out = set(), []
    for keys in wanted:
        frozen = tuple(sorted(keys.items()))
        if frozen in seen:
            continue
        seen.add(frozen)
        try:
            out.append(_accepted(base, keys, world_size=world_size, model=model, spec=spec))
        except UserError:
            continue  # a layout the launcher refuses
    return out


def toml_value(value) -> str:
    """`value` as a dotted override's right-hand side writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)


def _keys(degrees: tuple, ac: str, micro_batch: int) -> dict:
    names = ("parallel.pp", "parallel.dp_replicate", "parallel.dp_shard", "parallel.tp")
    return {
        **dict(zip(names, degrees)),
        "parallel.activation_checkpointing": ac,
        "train.micro_batch": micro_batch,
    }


def _micro_batches(config: Config, dp: int) -> list[int]:
    per_rank = config.train.global_batch // dp if config.train.global_batch % dp == 0 else 0
    if not per_rank:
        return []
    out = {b for b in (per_rank, per_rank // 2, per_rank // 4) if b and per_rank % b == 0}
    if per_rank % config.train.micro_batch == 0 and config.train.micro_batch <= per_rank:
        out.add(config.train.micro_batch)
    return sorted(out, reverse=True)


def _accepted(base: dict, keys: dict, *, world_size: int, model, spec) -> Candidate:
    """`keys` applied to `base` as the launcher would take them, or its UserError."""
    extra = {"parallel.dp": -1, "parallel.pp_microbatches": 0, "parallel.pp_stages_per_rank": 0}
    items = [f"{k}={toml_value(v)}" for k, v in {**extra, **keys}.items()]
    config = validate_config(apply_overrides(base, items))
    derived = resolve(config, world_size=world_size)
    check_model_fits(
        model,
        spec,
        layout=derived.layout,
        parallel=config.parallel,
        pipeline=derived.pipeline,
        model_label=f"model.name = {config.model.name!r}",
    )
    return Candidate(overrides=keys, config=config, derived=derived)
