"""The planner's subcommands: `scaletrain plan` (every layout's memory and step time, the
pick first) and `scaletrain calibrate` (this machine's hardware profile)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from scaletrain.config import ConfigError, given_world, load_config
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
from scaletrain.runtime.load import NOISY_CORES, Meter

BUILTINS = ", ".join(BUILTIN)
MIN_LOOK_S = 0.3  # a shorter plan cannot judge the load: /proc/stat counts 10 ms ticks
# half a core busier than at calibrate: a quarter of the smallest machine (2 cores), whose
# layouts then step ~25% slower than planned, past the 15% held for the median row
BUSIER_CORES = 0.5


def add_parsers(sub) -> None:
    plan = sub.add_parser("plan", help="predict every layout's memory and step time per rank")
    plan.add_argument("config", type=Path, metavar="CONFIG.toml")
    plan.add_argument("overrides", nargs="*", default=[], metavar="section.key=value")
    plan.add_argument("--world", type=int, help="world size (default: the config's degrees')")
    plan.add_argument("--nproc", type=int, help="ranks per node, as train --nproc")
    default = f"SCALETRAIN_HARDWARE, this GPU's part, else {CALIBRATED}"
    help = f"a built-in ({BUILTINS}) or a profile file (default: {default})"
    plan.add_argument("--hardware", metavar="NAME|profile.toml", help=help)
    plan.add_argument("--json", action="store_true", help="print the predictions as JSON")
    plan.add_argument("--all", action="store_true", dest="show_all", help="not only the best 15")
    plan.add_argument("--why", type=int, metavar="N", help="row N's step time, term by term")
    cal = sub.add_parser("calibrate", help="measure this machine into a hardware profile")
    cal.add_argument("--world", default="2,4", help="world sizes to measure (default 2,4)")
    cal.add_argument("--out", type=Path, default=CALIBRATED, help=f"default {CALIBRATED}")
    busy = "on a busy machine: wait for quiet (a minute, then warn), warn, or refuse"
    cal.add_argument("--busy", choices=("wait", "warn", "refuse"), default="wait", help=busy)


def cmd_plan(args: argparse.Namespace) -> int:
    from scaletrain.planner import plan_layouts

    config = load_config(args.config, args.overrides)
    world = args.world or given_world(config)
    profile = load_profile(args.hardware) if args.hardware else default_profile()
    if profile is None:
        raise ConfigError(
            "no hardware profile: run `scaletrain calibrate` once on this machine, or pass "
            f"--hardware with a built-in ({BUILTINS}) or a profile file"
        )
    if args.nproc is not None and not 1 <= args.nproc <= world:
        raise ConfigError(f"--nproc {args.nproc}: ranks per node, from 1 to --world ({world})")
    per_node = args.nproc or profile.ranks_per_node(world)
    with Meter() as meter:  # the machine's foreign load while this plans
        preds = plan_layouts(config, world_size=world, profile=profile, ranks_per_node=per_node)
    if not preds:
        raise ConfigError(f"no layout of {world} ranks is accepted for this config")
    # a CPU profile's times hold on a machine as quiet as at calibrate
    if profile.cores and (busy := busier_than_calibrated(profile, meter.load)):
        print(f"scaletrain: warning: {busy}", file=sys.stderr)
    if args.json:
        print(json.dumps([p.as_json() for p in preds], indent=1))
        return 0
    # without --all the best 15, and the configured layout wherever it is
    rows = [p for i, p in enumerate(preds) if args.show_all or i < 15 or "configured" in p.notes]
    if args.why is not None and not 1 <= args.why <= len(rows):
        raise ConfigError(f"--why {args.why}: a row of the table, from 1 to {len(rows)}")
    budget, where = rank_budget(profile, ranks_per_node=per_node)
    print(
        f"scaletrain plan: {len(preds)} layouts of {world} ranks, {per_node} a node, profile "
        f"{profile.name!r}; memory per rank {budget / 2**30:.2f} GiB ({where})"
    )
    print(explain(args.why, rows[args.why - 1]) if args.why else format_table(rows))
    return 0


def busier_than_calibrated(profile: Profile, now) -> str | None:
    """Why the steps predicted may not hold now, or None: the profile was taken on a busy
    machine, or the machine is busier now (`now`: a runtime.load.Load) than then."""
    if profile.foreign_cores > NOISY_CORES:
        return (
            f"profile {profile.name!r} was calibrated while {profile.foreign_cores:.1f} cores "
            "were busy outside it: every step it predicts is too slow; run `scaletrain "
            "calibrate` again on a quiet machine"
        )
    if now.wall_s >= MIN_LOOK_S and now.foreign_cores - profile.foreign_cores > BUSIER_CORES:
        return (
            f"this machine is busier now ({now.describe()}) than when profile "
            f"{profile.name!r} was calibrated: the steps predicted are a quiet machine's"
        )
    return None


def describe_layout(layout: dict) -> str:
    """`pp1 rep1 shard2 tp1 mb4 1f1b AC-full ZeRO-3`: a layout's degrees and options."""
    degrees = (("pp", "pp"), ("rep", "dp_replicate"), ("shard", "dp_shard"), ("tp", "tp"))
    parts = [f"{short}{layout[f'parallel.{key}']}" for short, key in degrees]
    ac = layout["parallel.activation_checkpointing"]
    zero = {True: "ZeRO-3", False: "ZeRO-2"}.get(layout.get("parallel.reshard_after_forward"))
    parts += [f"mb{layout['train.micro_batch']}", layout.get("parallel.pp_schedule")]
    parts += [ac != "none" and f"AC-{ac}", zero]
    return " ".join(p for p in parts if p)


def format_table(preds) -> str:
    mib = 2**20
    rows = [
        f"{'#':>3}  {'layout':<44} {'fits':<4} {'peak MiB':>9} {'param':>7} {'grad':>7} "
        f"{'optim':>7} {'act':>7} {'comm MiB':>9} {'step ms':>8} {'MFU':>6}"
    ]
    for i, p in enumerate(preds, 1):
        m = {k: v / mib for k, v in p.memory_bytes.items()}
        mfu = f"{p.mfu:.1%}" if p.mfu is not None else "-"
        mark = " *" if "configured" in p.notes else ""
        rows.append(
            f"{i:>3}  {describe_layout(p.layout):<44} {'yes' if p.fits else 'NO':<4} "
            f"{m['peak']:>9.1f} {m['params']:>7.1f} {m['grads']:>7.1f} {m['optim']:>7.1f} "
            f"{m['activations']:>7.1f} {sum(p.comm_bytes.values()) / mib:>9.1f} "
            f"{_figures(p.step_time_s * 1e3):>8} {mfu:>6}{mark}"
        )
    rows.append("(* the configured layout; memory per rank, communication per rank and step)")
    return "\n".join(rows)


def explain(number: int, pred) -> str:
    """Row `number`'s step on one rank, term by term (predict.Terms), and their sum."""
    lines = [f"#{number}  {describe_layout(pred.layout)}: the step on one rank, term by term"]
    for name, seconds, how in pred.terms.parts():
        lines.append(f"  {name:<24} {_figures(seconds * 1e3):>9} ms  {how}")
    lines.append(f"  {'= step':<24} {_figures(pred.step_time_s * 1e3):>9} ms")
    return "\n".join(lines)


def _figures(x: float) -> str:
    """`x` to 4 significant figures, without an exponent (0.1380, 12.35, -1235)."""
    decimals = max(0, 3 - math.floor(math.log10(abs(x)))) if x and math.isfinite(x) else 0
    return f"{x:.{decimals}f}"


def cmd_calibrate(args: argparse.Namespace) -> int:
    from scaletrain.planner.calibrate import calibrate

    try:
        worlds = sorted({int(w) for w in str(args.world).split(",")})
    except ValueError:
        raise ConfigError(f"--world {args.world!r}: world sizes, comma-separated: 2,4") from None
    start = time.perf_counter()

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - start:5.0f} s] {line}", flush=True)

    profile = calibrate(worlds=worlds, name="this-machine", busy=args.busy, say=say)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with written_atomically(args.out) as tmp:  # a crash leaves the old profile whole
        tmp.write_text(profile_toml(profile))
    print(f"scaletrain: profile written to {args.out}", file=sys.stderr)
    return 0
