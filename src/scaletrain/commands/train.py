"""`scaletrain train`: the checks every launch runs, then the workers (or one process here),
and the closing lines (where the run is, what it reached)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scaletrain.commands.worker import run_ps_rank, run_worker
from scaletrain.config import Config, given_world, load_config
from scaletrain.launch.agent import (
    Interrupted,
    LaunchSpec,
    launch,
    slurm_defaults,
    under_elastic_agent,
    validate_spec,
)
from scaletrain.launch.output import describe_interrupt


def launch_spec(args: argparse.Namespace, config: Config) -> LaunchSpec:
    """Launcher flags < SLURM's environment < defaults, then validated."""
    import os

    given = {
        k: v
        for k, v in vars(args).items()
        if k
        in (
            "nproc",
            "nnodes",
            "node_rank",
            "rdzv_endpoint",
            "rdzv_backend",
            "rdzv_id",
            "max_restarts",
        )
        and v is not None
    }
    values = {**slurm_defaults(dict(os.environ)), **given}
    nnodes = str(values.get("nnodes", "1"))
    if "nproc" not in values:  # infer from the [parallel] degrees when they are given
        max_nodes = int(nnodes.split(":")[-1]) if nnodes.replace(":", "").isdigit() else 1
        world = given_world(config)
        values["nproc"] = world // max_nodes if max_nodes > 0 and world % max_nodes == 0 else 1
    values["nnodes"] = nnodes
    return validate_spec(LaunchSpec(**values))


def cmd_train(args: argparse.Namespace) -> int:
    from scaletrain.commands.api import prepare_run

    if under_elastic_agent():  # a worker started by torchrun or by our launcher
        from scaletrain.runtime import prepare_worker_process

        prepare_worker_process()  # first: die with the launcher, write into the rank's log
        config = load_config(args.config, args.overrides)
        if config.parallel.strategy == "ps":  # a supervisor; it forks the role (ps/run.py)
            return run_ps_rank(config, args.run_dir)
        return run_worker(config, args.run_dir)
    config = load_config(args.config, args.overrides)
    spec = launch_spec(args, config)
    if args.plan:  # the planner's pick: its overrides go to the workers with the user's
        from scaletrain.commands.plan import describe_layout
        from scaletrain.planner import pick_layout

        picked, pred = pick_layout(config, world_size=spec.world_size, ranks_per_node=spec.nproc)
        args.overrides = [*args.overrides, *picked]
        config = load_config(args.config, args.overrides)
        print(
            f"scaletrain: plan: {describe_layout(pred.layout)} (predicted "
            f"{pred.step_time_s:.3g} s a step, {pred.memory_bytes['peak'] / 2**20:,.0f} MiB "
            "per rank; `scaletrain plan` lists every layout)",
            file=sys.stderr,
        )
    # The checks the Python API runs too: config against the world, data, user code, run dir.
    prepared = prepare_run(
        config,
        spec=spec,
        run_dir=args.run_dir,
        resume=args.resume,
        allow_config_change=args.allow_config_change,
        plan_check=not args.no_plan_check,
    )
    warn_if_empty(args.config, config)
    for warning in prepared.warnings:
        print(f"scaletrain: warning: {warning}", file=sys.stderr)
    config, run_dir = prepared.config, prepared.run_dir
    if prepared.auto is not None:  # the workers run the mode the launcher resolved
        from scaletrain.training.auto_precision import describe_auto

        print(f"scaletrain: {describe_auto(prepared.auto)}", file=sys.stderr)
        args.overrides = [*args.overrides, f"precision.mode={config.precision.mode}"]
    if prepared.complete is not None:  # --resume of a finished run: say so, touch nothing
        from scaletrain.launch.rundir import describe_finished

        print(describe_finished(run_dir, prepared.complete))
        return 0
    if not spec.in_process and not config.log.quiet:  # the workers take a while to speak
        print(
            f"scaletrain: config, data and code checked ({_waited():.1f} s); starting "
            f"{spec.nproc} worker(s) on this node (their logs: {run_dir / 'logs'})",
            file=sys.stderr,
            flush=True,
        )
    try:
        if spec.in_process:
            code = run_worker(config, run_dir, exit_process=False, debug=args.debug)
        else:
            # Workers always resume from a valid checkpoint in the run directory when one
            # exists: that is how an elastic restart continues.
            worker_args = ["train", str(args.config), *args.overrides, "--run-dir", str(run_dir)]
            code = launch(
                spec,
                worker_args,
                threads=prepared.derived.threads,
                run_dir=run_dir,
                debug=args.debug,
                stall_s=config.parallel.timeout_s,
            )
    except Interrupted as e:  # Ctrl-C, or a scheduler's SIGTERM: the workers are gone
        print(describe_interrupt(run_dir, signum=e.signum), file=sys.stderr)
        return 128 + e.signum
    if code == 0 and (run_dir / "summary.json").exists():
        _print_outcome(run_dir)
    return code


def _print_outcome(run_dir: Path) -> None:
    from scaletrain.records.report import write_report

    summary = json.loads((run_dir / "summary.json").read_text())
    report = write_report([run_dir], out=run_dir / "report.png")
    metric = ", ".join(f"{k} {_number(v)}" for k, v in summary["eval"].items())
    # The time the user waited (this process's, imports and start-up included), what of it
    # training and evaluating took, and the rate over the training alone, as the bar's.
    final = (
        "no step (train.steps = 0: the initial weights)"
        if summary["steps"] == 0
        else f"final loss {_number(summary['final_loss'])}"
    )
    rate = (
        f"; {summary['examples_per_s']:.0f} examples/s while training"
        if summary["examples"]
        else ""
    )
    print(
        f"scaletrain: done in {_waited():.1f} s ({summary['train_time_s']:.1f} s training, "
        f"{summary['eval_time_s']:.1f} s evaluating), {final}, eval {metric}{rate}"
    )
    print(f"scaletrain: run directory {run_dir}")
    print(f"scaletrain: report {report}")


def _waited() -> float:
    """Seconds since this process started: what the user has waited so far."""
    from scaletrain.training.progress import process_age_s

    return process_age_s() or 0.0


def _number(value: float | None) -> str:
    """A summary value: None is what a non-finite one is written as (summary.json is JSON)."""
    return "not finite" if value is None else f"{value:.4g}"


def warn_if_empty(path: Path, config: Config) -> None:
    """An empty config file trains on every default: legal, but rarely meant."""
    import tomllib

    if not tomllib.loads(path.read_text()):  # load_config has read and parsed it already
        print(
            f"scaletrain: warning: config file {str(path)!r} sets nothing, so every key not "
            f"given as an override has its default (model.name = {config.model.name!r}, "
            f"data.source = {config.data.source!r}, train.steps = {config.train.steps}); "
            f"`scaletrain explain {path}` lists them all",
            file=sys.stderr,
        )
