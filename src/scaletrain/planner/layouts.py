"""Every layout of one world size that the launcher would accept.

A candidate is a set of overrides of the [parallel] keys and train.micro_batch: the degrees
(pp x dp_replicate x dp_shard x tp = the world), under pp the schedule (1f1b, gpipe,
interleaved-1f1b with two stages per rank), the micro-batch (the configured one and every
power-of-two divisor of the per-rank batch below it, down to a quarter), activation
checkpointing (none, op, selective, full; where the model declares blocks) and, under FSDP,
ZeRO-3 or ZeRO-2 (parallel.reshard_after_forward true / false). Each is put through the
launcher's own checks, `launch/resolve.resolve` and `compose.check_model_fits` on the model built on
meta: a layout that would be refused before launch is not a candidate.
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
    keys = {
        "parallel.pp": degrees[0],
        "parallel.dp_replicate": degrees[1],
        "parallel.dp_shard": degrees[2],
        "parallel.tp": degrees[3],
        "parallel.activation_checkpointing": p.activation_checkpointing,
        "train.micro_batch": config.train.micro_batch,
    }
    if degrees[0] > 1:
        keys["parallel.pp_schedule"] = p.pp_schedule
        # chunks per micro-batch and stages per rank as configured (0: the launcher's
        # default, which every other candidate takes)
        if p.pp_microbatches:
            keys["parallel.pp_microbatches"] = p.pp_microbatches
        if p.pp_stages_per_rank:
            keys["parallel.pp_stages_per_rank"] = p.pp_stages_per_rank
    if degrees[2] > 1:
        keys["parallel.reshard_after_forward"] = p.reshard_after_forward
    return keys


def _degrees(world: int) -> list[tuple[int, int, int, int]]:
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [
        (pp, rep, shard, tp)
        for pp, rep, shard, tp in itertools.product(divisors, repeat=4)
        if pp * rep * shard * tp == world
    ]


def _micro_batches(config: Config, dp: int) -> list[int]:
    per_rank = config.train.global_batch // dp if config.train.global_batch % dp == 0 else 0
    if not per_rank:
        return []
    out = {b for b in (per_rank, per_rank // 2, per_rank // 4) if b and per_rank % b == 0}
    if per_rank % config.train.micro_batch == 0 and config.train.micro_batch <= per_rank:
        out.add(config.train.micro_batch)
    return sorted(out, reverse=True)


def candidates(
    config: Config, *, world_size: int, model, only_configured: bool = False
) -> list[Candidate]:
    """The accepted layouts of `world_size` (module docstring), the configured one first
    when it is accepted. `model`: the bare model on meta (its spec and blocks are read).
    `only_configured`: the configured layout alone, and the launcher's error where it
    would refuse it (never another layout in its place)."""
    spec = model_spec(model)
    has_blocks = bool(spec.blocks)
    base = config.model_dump(mode="json")
    configured = layout_overrides(config, world_size=world_size)
    if only_configured:
        return [_accepted(base, configured, world_size=world_size, model=model, spec=spec)]
    seen, out = set(), []
    wanted = [configured]
    for pp, rep, shard, tp in _degrees(world_size):
        schedules = SCHEDULES if pp > 1 else (None,)
        for schedule, mb, ac, zero3 in itertools.product(
            schedules,
            _micro_batches(config, rep * shard),
            AC_MODES if has_blocks else ("none",),
            (True, False) if shard > 1 else (None,),
        ):
            keys = {
                "parallel.pp": pp,
                "parallel.dp_replicate": rep,
                "parallel.dp_shard": shard,
                "parallel.tp": tp,
                "parallel.activation_checkpointing": ac,
                "train.micro_batch": mb,
            }
            if schedule:
                keys["parallel.pp_schedule"] = schedule
            if zero3 is not None:
                keys["parallel.reshard_after_forward"] = zero3
            wanted.append(keys)
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


def _accepted(base: dict, keys: dict, *, world_size: int, model, spec) -> Candidate:
    """`keys` applied to `base` as the launcher would take them, or its UserError."""
    extra = {"parallel.dp": -1, "parallel.pp_microbatches": 0, "parallel.pp_stages_per_rank": 0}
    items = [f"{k}={_toml(v)}" for k, v in {**extra, **keys}.items()]
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


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)
