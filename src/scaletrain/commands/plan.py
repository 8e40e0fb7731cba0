"""The planner's subcommands: `scaletrain plan` (every layout's memory and step time, the
pick first) and `scaletrain calibrate` (this machine's hardware profile)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from scaletrain.config import Config, ConfigError, given_world, load_config
from scaletrain.runtime import written_atomically
from scaletrain.runtime.hardware import (
    BUILTIN,
    CALIBRATED,
    Profile,
    default_profile,
    load_profile,
    profile_toml,
    rank_budget,
)
from scaletrain.runtime.load import Meter

BUILTINS = ", ".join(BUILTIN)
MIN_LOOK_S = 0.3
# half a core more than at calibrate: on the smallest machine this project runs on (2
# cores), a quarter of it, so a layout using every core steps ~25% slower than planned,
# beyond the 15% the planner's median row is held to
BUSIER_CORES = 0.5


def add_parsers(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="predict per-rank memory and step time of every layout of a world size, "
        "best first (nothing is launched)",
    )
    plan.add_argument("config", type=Path, metavar="CONFIG.toml")
    plan.add_argument("overrides", nargs="*", default=[], metavar="section.key=value")
    plan.add_argument("--world", type=int, help="world size (default: the config's degrees')")
    plan.add_argument(
        "--nproc",
        type=int,
        help="ranks per node, as `scaletrain train --nproc` (default: on a CPU profile the "
        "whole world on this machine, on a GPU one a device up to a node's)",
    )
    plan.add_argument(
        "--hardware",
        metavar="NAME|profile.toml",
        help=f"a built-in ({BUILTINS}) or a profile file (default: SCALETRAIN_HARDWARE, "
        f"this GPU's part, or {CALIBRATED} from `scaletrain calibrate`)",
    )
    plan.add_argument("--json", action="store_true", help="print the predictions as JSON")
    plan.add_argument(
        "--all", action="store_true", dest="show_all", help="every layout, not the best 15"
    )
    plan.add_argument(
        "--why", type=int, metavar="N", help="row N's step time, term by term, and their sum"
    )
    cal = sub.add_parser(
        "calibrate",
        help="measure this machine: matmul, memory, collectives, FSDP/TP costs, a model's steps",
    )
    cal.add_argument(
        "config",
        type=Path,
        nargs="?",
        metavar="CONFIG.toml",
        help="measure at its model's shapes and fit the step costs on its model's own steps "
        "(default: the built-in GPT tiny)",
    )
    cal.add_argument("overrides", nargs="*", default=[], metavar="section.key=value")
    cal.add_argument(
        "--world", default="2,4", help="world sizes to time collectives at (default 2,4)"
    )
    cal.add_argument(
        "--out", type=Path, default=CALIBRATED, help=f"profile to write (default {CALIBRATED})"
    )
    cal.add_argument(
        "--busy",
        choices=("wait", "warn", "refuse"),
        default="wait",
        help="on a machine busy with other work: wait for it to go quiet (a minute at most, "
        "then warn), warn and go on, or refuse; the profile records the load (default wait)",
    )


def chosen_profile(name: str | None, device_type: str = "cpu") -> Profile:
    profile = load_profile(name) if name else default_profile(device_type)
    if profile is None:
        raise ConfigError(
            "no hardware profile: run `scaletrain calibrate` once on this machine, or pass "
            f"--hardware with a built-in ({BUILTINS}) or a profile file"
        )
    return profile


def plan_config(
    config: Config,
    *,
    world_size: int,
    profile: Profile,
    ranks_per_node: int | None = None,
    only_configured=False,
):
    """The planner over `config` (the model on meta, the data's first example), each rank's
    memory as `scaletrain train --plan` gives it (hardware.rank_budget)."""
    from scaletrain.planner import build_for_plan, plan_layouts

    dataset, model = build_for_plan(config)
    return plan_layouts(
        config,
        world_size=world_size,
        profile=profile,
        dataset=dataset,
        model=model,
        ranks_per_node=ranks_per_node,
        only_configured=only_configured,
    )


def cmd_plan(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    world = args.world or given_world(config)
    profile = chosen_profile(args.hardware)
    if args.nproc is not None and not 1 <= args.nproc <= world:
        raise ConfigError(f"--nproc {args.nproc}: ranks per node, from 1 to --world ({world})")
    per_node = args.nproc or profile.ranks_per_node(world)
    with Meter() as meter:  # the machine's foreign load while this plans
        preds = plan_config(config, world_size=world, profile=profile, ranks_per_node=per_node)
    if not preds:
        raise ConfigError(f"no layout of {world} ranks is accepted for this config")
    # a CPU profile's times hold on a machine as quiet as at calibrate (a plan shorter than
    # MIN_LOOK_S is too short to judge the load by: /proc/stat counts in 10 ms ticks)
    judged = profile.cores and meter.load.wall_s >= MIN_LOOK_S
    busy = busier_than_calibrated(profile, meter.load) if judged else None
    for warning in (calibrated_elsewhere(profile, config), busy):
        if warning:
            print(f"scaletrain: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps([p.as_json() for p in preds], indent=1))
        return 0
    rows = preds if args.show_all else _shown(preds)
    if args.why is not None and not 1 <= args.why <= len(rows):
        raise ConfigError(f"--why {args.why}: a row of the table, from 1 to {len(rows)}")
    budget, where = rank_budget(profile, ranks_per_node=per_node)
    print(
        f"scaletrain plan: {len(preds)} layouts of {world} ranks, {per_node} a node, profile "
        f"{profile.name!r}; memory per rank {budget / 2**30:.2f} GiB ({where})"
    )
    print(explain(args.why, rows[args.why - 1]) if args.why else format_table(rows))
    return 0


def calibrated_elsewhere(profile: Profile, config: Config) -> str | None:
    """Why the profile's step costs may not hold for `config`'s model, or None: they were
    refined on another model's steps (`scaletrain calibrate CONFIG`). A machine profile,
    taken at calibrate's defaults on the built-in GPT tiny, is for every model."""
    from scaletrain.planner.reference import GPT_TINY, model_label

    planned = model_label(config.model.model_dump(mode="json"))
    default = model_label(GPT_TINY["model"])
    if profile.calibrated_on in ("", default, planned):
        return None
    return (
        f"profile {profile.name!r} was refined on the model {profile.calibrated_on!r}, "
        f"not {planned!r}: its step costs are that model's; `scaletrain calibrate` at its "
        "defaults for this machine's, or with this config for its own"
    )


def busier_than_calibrated(profile: Profile, now) -> str | None:
    """Why the predicted steps may be too fast or too slow for this moment, or None: the
    profile was taken on a busy machine, or the machine is busier now (`now`: a
    runtime.load.Load over the plan) than then."""
    from scaletrain.runtime.load import NOISY_CORES

    if profile.foreign_cores > NOISY_CORES:
        return (
            f"profile {profile.name!r} was calibrated while {profile.foreign_cores:.1f} cores "
            "were busy outside it: every step it predicts is too slow; run `scaletrain "
            "calibrate` again on a quiet machine"
        )
    if now.foreign_cores - profile.foreign_cores > BUSIER_CORES:
        return (
            f"this machine is busier now ({now.describe()}) than when profile "
            f"{profile.name!r} was calibrated: the steps predicted are a quiet machine's"
        )
    return None


def _shown(preds):
    """The table's rows without --all: the best 15, and the configured layout wherever it is."""
    return preds[:15] + [p for p in preds[15:] if "configured" in p.notes]


def describe_layout(layout: dict) -> str:
    """`pp1 rep1 shard2 tp1 mb4 1f1b AC-full ZeRO-3`: a layout's degrees and options."""
    degrees = (("pp", "pp"), ("rep", "dp_replicate"), ("shard", "dp_shard"), ("tp", "tp"))
    parts = [f"{short}{layout[f'parallel.{key}']}" for short, key in degrees]
    parts.append(f"mb{layout['train.micro_batch']}")
    if layout.get("parallel.pp_schedule"):
        parts.append(layout["parallel.pp_schedule"])
    if layout["parallel.activation_checkpointing"] != "none":
        parts.append(f"AC-{layout['parallel.activation_checkpointing']}")
    if "parallel.reshard_after_forward" in layout:
        parts.append("ZeRO-3" if layout["parallel.reshard_after_forward"] else "ZeRO-2")
    return " ".join(parts)


def format_table(preds) -> str:
    mib = 2**20
    head = (
        f"{'#':>3}  {'layout':<44} {'fits':<4} {'peak MiB':>9} {'param':>7} {'grad':>7} "
        f"{'optim':>7} {'act':>7} {'comm MiB':>9} {'step ms':>8} {'MFU':>6}"
    )
    rows = [head]
    for i, p in enumerate(preds, 1):
        m = p.memory_bytes
        mfu = f"{p.mfu:.1%}" if p.mfu is not None else "-"
        mark = " *" if "configured" in p.notes else ""
        rows.append(
            f"{i:>3}  {describe_layout(p.layout):<44} {'yes' if p.fits else 'NO':<4} "
            f"{m['peak'] / mib:>9.1f} {m['params'] / mib:>7.1f} {m['grads'] / mib:>7.1f} "
            f"{m['optim'] / mib:>7.1f} {m['activations'] / mib:>7.1f} "
            f"{sum(p.comm_bytes.values()) / mib:>9.1f} {_figures(p.step_time_s * 1e3):>8} "
            f"{mfu:>6}{mark}"
        )
    rows.append("(* the configured layout; memory per rank, communication per rank and step)")
    return "\n".join(rows)


def explain(number: int, pred) -> str:
    """Row `number`'s step time on one rank, term by term (predict.Terms), and their sum."""
    lines = [f"#{number}  {describe_layout(pred.layout)}: the step on one rank, term by term"]
    for name, seconds, how in pred.terms.parts():
        lines.append(f"  {name:<24} {_figures(seconds * 1e3):>9} ms  {how}")
    lines.append(f"  {'= step':<24} {_figures(pred.step_time_s * 1e3):>9} ms")
    return "\n".join(lines)


def _figures(x: float, digits: int = 4) -> str:
    """`x` to `digits` significant figures, without an exponent (0.1380, 12.35, -1235)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def cmd_calibrate(args: argparse.Namespace) -> int:
    from scaletrain.planner.calibrate import calibrate

    try:
        worlds = sorted({int(w) for w in str(args.world).split(",")})
    except ValueError:
        raise ConfigError(
            f"--world {args.world!r}: a comma-separated list of world sizes, e.g. 2,4"
        ) from None
    shapes = reference = None
    if args.config:
        config = load_config(args.config, args.overrides)
        shapes, reference = model_shapes(config), config.model_dump(mode="json")
    start = time.perf_counter()

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - start:5.0f} s] {line}", flush=True)

    profile = calibrate(
        worlds=worlds,
        shapes=shapes,
        reference=reference,
        name="this-machine",
        busy=args.busy,
        say=say,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with written_atomically(args.out) as tmp:  # a crash leaves the old profile whole
        tmp.write_text(profile_toml(profile))
    print(f"scaletrain: profile written to {args.out}", file=sys.stderr)
    return 0


def model_shapes(config: Config) -> list[tuple[int, int, int]]:
    """(tokens or examples of a micro-batch, in, out) of each linear layer of the model."""
    from scaletrain.planner import build_for_plan

    dataset, model = build_for_plan(config)
    example = dataset.get(torch.zeros(1, dtype=torch.long)).inputs[0]
    rows = config.train.micro_batch * (example.numel() if dataset.spec.kind == "lm" else 1)
    linears = (m for m in model.modules() if isinstance(m, torch.nn.Linear))
    shapes = sorted({(rows, m.in_features, m.out_features) for m in linears})
    return shapes or [(1024, 1024, 1024)]
