"""The command line: `scaletrain train | explain | report | shard | export | distill-cache | eval`.

Every user mistake (config, overrides, launcher flags, paths, the user's own code) is a
`UserError` (errors.py), caught before any worker starts where it can be and printed as one
paragraph, `scaletrain: error: ...`, with exit status 2. Only `UserError` is caught so: any
other exception, a ValueError from scaletrain's own code included, is our bug and shows its
traceback (exit status 1). A failed run exits with status 1 and says why (which rank, which
collective, which step).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scaletrain.cli_distill import add_parsers as add_distill_parsers
from scaletrain.cli_distill import cmd_distill_cache, cmd_eval
from scaletrain.cli_distill import explain_rows as distill_explain_rows
from scaletrain.cli_plan import add_parsers as add_plan_parsers
from scaletrain.cli_plan import cmd_calibrate, cmd_plan
from scaletrain.config import Config, ConfigError, describe_fields, given_world, load_config
from scaletrain.errors import UserError
from scaletrain.launch import (
    Interrupted,
    LaunchSpec,
    launch,
    slurm_defaults,
    under_elastic_agent,
    validate_spec,
)
from scaletrain.launch_output import describe_interrupt
from scaletrain.plan import resolve
from scaletrain.version import __version__

EXIT_USAGE, EXIT_FAILED = 2, 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own mistakes: same format, status 2
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"scaletrain: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="scaletrain", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="train from a config (launches the workers)")
    _add_config_args(train)
    _add_launch_args(train)
    train.add_argument("--run-dir", type=Path, help="run directory (default runs/<name>-<time>)")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir from its newest valid checkpoint",
    )
    train.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: accept a config that differs from the checkpoint's "
        "in keys an exact resume must keep (printed as a warning)",
    )
    train.add_argument(
        "--plan",
        action="store_true",
        help="train the layout `scaletrain plan` ranks first for this world size "
        "(needs a hardware profile: scaletrain calibrate)",
    )
    train.add_argument(
        "--no-plan-check",
        action="store_true",
        help="launch even when the planner predicts the layout does not fit in memory",
    )
    train.add_argument(
        "--debug",
        action="store_true",
        help="show every rank's full output (C++ frames, tracebacks, torch's "
        "logs) on the console, unfiltered; else it is in RUN_DIR/logs",
    )

    explain = sub.add_parser(
        "explain",
        help="check a config as train would, print what it "
        "derives (world, layout, batch, precision, ...)",
    )
    _add_config_args(explain)
    _add_launch_args(explain)
    explain.add_argument(
        "--all",
        action="store_true",
        dest="all_fields",
        help="also list every config key with its value and meaning",
    )

    shard = sub.add_parser("shard", help="write a dataset as Parquet shards with a manifest")
    shard.add_argument(
        "source",
        help="a built-in source (mnist, digits, wikitext, ...) or a "
        "JSONL / CSV / Parquet file or directory",
    )
    shard.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    shard.add_argument("--rows-per-shard", type=int, default=8192)
    shard.add_argument("--seq-len", type=int, default=128, help="tokens per packed text row")
    shard.add_argument(
        "--engine",
        choices=("local", "spark"),
        default="local",
        help="local: pyarrow in this process; spark: a pyspark job (local mode "
        "here, a cluster for users)",
    )

    export = sub.add_parser("export", help="write a checkpoint's weights as safetensors")
    export.add_argument(
        "checkpoint",
        type=Path,
        metavar="CHECKPOINT",
        help="a checkpoint directory, or a run directory (its newest valid one)",
    )
    export.add_argument("out", type=Path, metavar="OUT.safetensors")

    report = sub.add_parser("report", help="draw loss and throughput curves of runs to a PNG")
    report.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    report.add_argument("--out", type=Path, help="PNG path (default RUN_DIR/report.png)")
    add_distill_parsers(sub)  # distill-cache, eval (cli_distill.py)
    add_plan_parsers(sub)  # plan, calibrate (cli_plan.py)
    return parser


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, metavar="CONFIG.toml", help="TOML config file")
    p.add_argument(
        "overrides", nargs="*", default=[], metavar="section.key=value", help="config overrides"
    )


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launcher (torchrun's flags)")
    g.add_argument(
        "--nproc",
        "--nproc-per-node",
        dest="nproc",
        type=int,
        help="worker processes on this node (default: the product of the "
        "[parallel] degrees (dp_replicate or dp, dp_shard, tp, pp; under ps: "
        "ps.servers + dp) divided by the nodes, else 1)",
    )
    g.add_argument("--nnodes", type=str, help="nodes, N or MIN:MAX (default 1)")
    g.add_argument("--node-rank", type=int, help="this node's rank (static rendezvous)")
    g.add_argument("--rdzv-endpoint", type=str, help="HOST:PORT of the rendezvous")
    g.add_argument("--rdzv-backend", type=str, help="c10d (default), static, etcd")
    g.add_argument("--rdzv-id", type=str, help="job id shared by all nodes")
    g.add_argument("--max-restarts", type=int, help="restarts of the worker group on failure")


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
    from scaletrain.api import prepare_run

    if under_elastic_agent():  # a worker started by torchrun or by our launcher
        from scaletrain.runtime import prepare_worker_process

        prepare_worker_process()  # first: die with the launcher, write into the rank's log
        config = load_config(args.config, args.overrides)
        if config.parallel.strategy == "ps":  # a supervisor; it forks the role (ps/run.py)
            return _run_ps_rank(config, args.run_dir)
        return _run_worker(config, args.run_dir)
    config = load_config(args.config, args.overrides)
    spec = launch_spec(args, config)
    if args.plan:  # the planner's pick: its overrides go to the workers with the user's
        from scaletrain.cli_plan import describe_layout
        from scaletrain.planner.launch import pick_layout

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
    _warn_if_empty(args.config, config)
    for warning in prepared.warnings:
        print(f"scaletrain: warning: {warning}", file=sys.stderr)
    config, run_dir = prepared.config, prepared.run_dir
    if prepared.auto is not None:  # the workers run the mode the launcher resolved
        from scaletrain.training.auto_precision import describe_auto

        print(f"scaletrain: {describe_auto(prepared.auto)}", file=sys.stderr)
        args.overrides = [*args.overrides, f"precision.mode={config.precision.mode}"]
    if prepared.complete is not None:  # --resume of a finished run: say so, touch nothing
        from scaletrain.rundir import describe_finished

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
            code = _run_worker(config, run_dir, exit_process=False, debug=args.debug)
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
            )
    except Interrupted as e:  # Ctrl-C, or a scheduler's SIGTERM: the workers are gone
        print(describe_interrupt(run_dir, signum=e.signum), file=sys.stderr)
        return 128 + e.signum
    if code == 0 and (run_dir / "summary.json").exists():
        _print_outcome(run_dir)
    return code


def _run_worker(
    config: Config, run_dir: Path | None, *, exit_process: bool = True, debug: bool = False
) -> int:
    """Train as one rank; known failures become one message and a status code.

    A worker (exit_process) leaves with 130 on SIGINT and 143 on SIGTERM, saying nothing:
    the launcher reports the interrupt. In the launcher's own process (one process, no
    agent) a signal becomes `Interrupted`, which the CLI turns into its one line.
    """
    import signal
    import traceback

    from scaletrain.checkpoint_files import CheckpointError
    from scaletrain.data.shards import ShardError
    from scaletrain.runtime import CollectiveFailure, exit_worker
    from scaletrain.training import signals
    from scaletrain.training.trainer import TrainingDiverged, train

    code, interrupted = 0, None
    with signals.installed(save_on_term=config.checkpoint.every > 0):
        try:
            train(config, run_dir=run_dir)
            signals.drain()
            if signals.stopped_by_sigterm():  # saved a checkpoint and stopped early
                interrupted = signal.SIGTERM
        except (CollectiveFailure, TrainingDiverged, CheckpointError, ShardError) as e:
            # A failure mid-run (ShardError too: a shard damaged since the launcher read it).
            print(f"scaletrain: error: {e}", file=sys.stderr)
            code = EXIT_FAILED
        except UserError as e:  # a mistake only a built model or data shows; not our bugs
            if debug:
                traceback.print_exc()
            print(f"scaletrain: error: {e}", file=sys.stderr)
            code = EXIT_USAGE
        except (KeyboardInterrupt, signals.Terminated) as e:
            if debug:
                traceback.print_exc()
            interrupted = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM
        except Exception:
            if not exit_process:
                raise  # in the launcher's own process a bug shows as one
            traceback.print_exc()  # into this rank's log; the launcher quotes its last line
            code = EXIT_FAILED
    if interrupted is not None:
        if not exit_process:
            raise Interrupted(interrupted)
        code = 128 + interrupted
    if exit_process:  # leave without the gloo shutdown abort (shared/PLATFORM-NOTES.md)
        exit_worker(code)
    return code


def _run_ps_rank(config: Config, run_dir: Path | None) -> int:
    """Under parallel.strategy = 'ps': this rank's supervisor, which forks the role."""
    from scaletrain.ps.run import run_role
    from scaletrain.ps.supervisor import supervise
    from scaletrain.runtime import exit_worker

    exit_worker(supervise(config, run_dir, role_main=run_role))


def _print_outcome(run_dir: Path) -> None:
    from scaletrain.report import write_report

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


def _warn_if_empty(path: Path, config: Config) -> None:
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


def _train_rows(config: Config) -> int | None:
    """Rows in the training split: from the manifest for shards, else by loading the source
    (the built-in ones load in well under a second); None if they cannot be read."""
    d = config.data
    try:
        if d.source == "shards":
            from scaletrain.data.manifest import MANIFEST, find_split_dir, read_manifest

            split = find_split_dir(Path(d.path), "train")
            if split is not None and (split / MANIFEST).is_file():
                return read_manifest(split).rows
        if d.source == "sentences":  # the items, untokenized (with augment: ~10-20 s)
            from scaletrain.data.sentences import split_texts
            from scaletrain.distill.build import sentence_tokenizer_dir

            return len(
                split_texts(
                    d.kwargs,
                    split="train",
                    seed=config.train.seed,
                    tokenizer_dir=sentence_tokenizer_dir(config),
                )
            )
        from scaletrain.data.loader import load_dataset

        return len(
            load_dataset(
                d.source,
                split="train",
                path=d.path,
                seq_len=d.seq_len,
                synthetic_examples=d.synthetic_examples,
                seed=config.train.seed,
            )
        )
    except (OSError, UserError):  # ShardError, SourceError: preflight names the problem
        return None


def cmd_explain(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from scaletrain.api import preflight_data
    from scaletrain.prelaunch import check_layout_fits
    from scaletrain.training.assemble import brings_own_code, check_user_code

    config = load_config(args.config, args.overrides)
    spec = launch_spec(args, config)
    d = resolve(config, world_size=spec.world_size, nproc_per_node=spec.nproc)
    preflight_data(config)
    if brings_own_code(config):  # the user's model, data or loss: built and run as train does
        check_user_code(config)
    check_layout_fits(config, d)  # what train would refuse about the model and the layout
    _warn_if_empty(args.config, config)
    console = Console()
    device = "cuda" if d.backend == "nccl" else "cpu"
    precision = config.precision.mode
    if precision == "auto":  # what train would run: measured here (or cached)
        from scaletrain.training.auto_precision import resolve_auto

        _, auto = resolve_auto(config, d)
        precision = f"auto -> {auto.mode} ({auto.why})"
    derived = {
        "world size": f"{d.world_size} ({spec.nproc} process(es) x {spec.nnodes} node(s))",
        "parallel layout (mesh)": (
            d.layout.describe()
            if d.ps is None
            else "none: workers and servers talk over torch.distributed.rpc"
        ),
        "data parallel (dp)": (
            f"{d.layout.dp} = dp_replicate {d.layout.dp_replicate} x dp_shard {d.layout.dp_shard}"
            if d.ps is None
            else f"{d.layout.dp} workers, each its share of every step"
        ),
        **_pipeline_rows(config, d),
        **_ps_rows(config, d),
        **distill_explain_rows(config),
        "global batch": config.train.global_batch,
        "micro-batch": config.train.micro_batch,
        "accumulation steps": d.accumulation,
        "examples per rank per step": d.examples_per_rank,
        "threads per process": d.threads,
        "backend": d.backend,
        "precision": precision,
        "optimizer kernels": _optimizer_kernels(config.optim.impl, device),
        "CPU heap policy": _heap_policy(config.train.allocator, device),
        "torch.compile": "on (inductor, before DDP)"
        if config.train.compile
        else "off (train.compile; on a CPU its compile time outweighs what it saves a step "
        "except on long runs: bench/step_anatomy.py --compile, BENCHMARKS.md)",
        "epochs": _epochs(config),
        **_eval_rows(config, d, local_ranks=spec.nproc),
    }
    # What the config comes to first (a screen), then the placement; the key-by-key listing
    # (hundreds of lines) only with --all.
    out = Table(title="derived")
    out.add_column("quantity")
    out.add_column("value")
    for k, v in derived.items():
        out.add_row(k, escape(str(v)))
    console.print(out)
    if d.world_size > 1 and d.ps is None:
        console.print(_placement_table(d))
    if args.all_fields:
        table = Table(title=f"config {args.config}", show_lines=False)
        for col in ("key", "value", "meaning"):
            table.add_column(col)
        for key, value, doc in describe_fields(config):  # as written: "[ps]" is not markup
            table.add_row(escape(key), escape(repr(value)), escape(doc))
        console.print(table)
    else:
        console.print(
            f"every config key, its value and meaning: scaletrain explain "
            f"{escape(str(args.config))} ... --all"
        )
    for warning in d.warnings:
        print(f"scaletrain: warning: {warning}", file=sys.stderr)
    return 0


def _eval_rows(config: Config, d, *, local_ranks: int) -> dict[str, str]:
    """What the final evaluation costs: its forwards per data-parallel rank and, under
    dp_shard, how often FSDP gathers the model for them (train.eval_gather)."""
    from scaletrain.data.sampler import eval_indices
    from scaletrain.training.assemble import build_data, build_net
    from scaletrain.training.evaluate import keeps_gathered

    if d.ps is not None:
        return {}
    t = config.train
    eval_ds = build_data(config, split="eval")
    forwards = len(
        eval_indices(
            len(eval_ds), limit=t.eval_examples, dp_rank=0, dp_size=d.layout.dp, batch=t.micro_batch
        )
    )
    row = f"{min(len(eval_ds), t.eval_examples)} examples, {forwards} forward(s) per dp rank"
    if d.layout.dp_shard > 1 and forwards > 1:
        model = build_net(config, eval_ds, meta=True)
        width = 8 if config.precision.mode == "fp64" else 4  # the master weights' bytes
        size = sum(p.numel() for p in model.parameters()) * width
        keep = keeps_gathered(t.eval_gather, unsharded_bytes=size, local_ranks=local_ranks)
        row += (
            f"; FSDP gathers the model's {size / 2**20:,.1f} MiB "
            + (
                "once and keeps it for all of them"
                if keep
                else f"for each forward ({forwards} x, no more memory than a step)"
            )
            + f" (train.eval_gather = {t.eval_gather!r})"
        )
    return {"final evaluation": row}


def _ps_rows(config: Config, d) -> dict[str, str]:
    """Who serves and who works under parallel.strategy = 'ps', and what a step means."""
    if d.ps is None:
        return {}
    ps, shape = config.ps, d.ps
    rule = {
        "async": "each gradient applied as it arrives",
        "ssp": f"a worker waits while more than {ps.staleness} step(s) ahead of the slowest",
        "sync": "one update per step: the mean of every live worker's gradient",
    }[ps.mode]
    per_step = 1 if ps.mode == "sync" else shape.workers
    return {
        "strategy": f"parameter servers ({ps.mode}: {rule})",
        "servers": f"{shape.servers} (ranks 0..{shape.servers - 1}; parameters split by bytes)",
        "workers": f"{shape.workers} (ranks {shape.servers}..{d.world_size - 1})",
        "server updates per step": f"{per_step} of {config.train.global_batch // shape.workers} "
        "examples each"
        if per_step > 1
        else "1 (the workers' mean)",
        "worker lease": f"{ps.worker_timeout_s:g} s (heartbeats every "
        f"{ps.worker_timeout_s / 4:g} s)",
        "listens on": f"interface {ps.interface!r} only",
    }


def _pipeline_rows(config: Config, d) -> dict[str, str]:
    """The micro-batch arithmetic under pipeline parallelism, and its bubble in theory."""
    pipe = d.pipeline
    if pipe is None:
        return {}
    from scaletrain.parallel.pipeline import idle_fraction_theory

    mb, m = config.train.micro_batch, pipe.microbatches
    stages = d.layout.pp * pipe.stages_per_rank
    bubble = idle_fraction_theory(
        pipe.schedule, pp=d.layout.pp, microbatches=m, stages_per_rank=pipe.stages_per_rank
    )
    return {
        "pipeline": f"{pipe.schedule}: {stages} stages, {pipe.stages_per_rank} per rank",
        "pipeline chunks": f"each micro-batch of {mb} -> {m} chunks of {mb // m} "
        f"(x {d.accumulation} micro-batches per step)",
        "pipeline bubble (theory)": f"{bubble:.1%} of each rank's step idle",
    }


def _placement_table(d):
    """Which ranks hold which pipeline stage, FSDP shard and tensor-parallel slice."""
    from rich.table import Table

    from scaletrain.parallel.pipeline import stage_ids

    layout, pipe = d.layout, d.pipeline
    table = Table(title=f"ranks ({layout.describe()})")
    for col in ("rank", *layout.sizes, "batch share", "holds"):
        table.add_column(col)
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        holds = []
        if pipe is not None:
            ids = stage_ids(
                pp_rank=c["pp"],
                pp=layout.pp,
                stages_per_rank=pipe.stages_per_rank,
                schedule=pipe.schedule,
            )
            holds.append("stage " + ", ".join(map(str, ids)))
        if layout.dp_shard > 1:
            holds.append(f"FSDP shard {c['dp_shard'] + 1}/{layout.dp_shard}")
        if layout.tp > 1:
            holds.append(f"TP slice {c['tp'] + 1}/{layout.tp}")
        if not holds:
            holds.append("a whole replica")
        table.add_row(
            str(rank),
            *(str(c[k]) for k in layout.sizes),
            f"{layout.dp_rank(rank) + 1}/{layout.dp}",
            "; ".join(holds),
        )
    return table


def _optimizer_kernels(impl: str, device: str) -> str:
    """What optim.impl resolves to on this device, and why (for explain)."""
    import torch

    from scaletrain.training.optim import resolve_impl

    probe = [torch.zeros(1, device=device)] if device == "cpu" else []
    if impl != "auto" or not probe:
        return impl
    return f"auto -> {resolve_impl(impl, probe)}"


def _heap_policy(mode: str, device: str) -> str:
    from scaletrain.allocator import AUTO_RELEASE_BYTES, resolve_allocator

    chosen = resolve_allocator(mode, device_type=device)  # the model's size not known here
    if mode != "auto":
        return chosen
    if chosen == "retain":
        return (
            f"auto -> retain (release for a model of {AUTO_RELEASE_BYTES // 2**20} MiB of "
            "parameters or more)"
        )
    return f"auto -> {chosen}"


def _epochs(config: Config) -> str:
    rows, t = _train_rows(config), config.train
    if not rows:
        return "unknown (the training rows could not be counted)"
    return (
        f"{t.steps * t.global_batch / rows:.3g} ({t.steps} steps x {t.global_batch} / {rows} rows)"
    )


def cmd_report(args: argparse.Namespace) -> int:
    from scaletrain.report import write_report

    for run_dir in args.run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise ConfigError(f"{str(run_dir)!r} is not a run directory (no metrics.jsonl)")
    out = args.out or args.run_dirs[0] / "report.png"
    print(f"scaletrain: report {write_report(args.run_dirs, out=out)}")
    return 0


def cmd_shard(args: argparse.Namespace) -> int:
    if args.rows_per_shard < 1:
        raise ConfigError(f"--rows-per-shard = {args.rows_per_shard} is invalid: must be >= 1")
    if args.seq_len < 1:
        raise ConfigError(f"--seq-len = {args.seq_len} is invalid: must be >= 1")
    if args.out_dir.exists() and any(args.out_dir.iterdir()):
        raise ConfigError(
            f"OUT_DIR {str(args.out_dir)!r} is not empty; choose a new directory "
            "so nothing is overwritten"
        )
    import warnings

    from scaletrain.data.manifest import ShardError, read_manifest, summary_lines

    try:
        if args.engine == "spark":  # pyspark is an optional extra: a missing one is an error
            from scaletrain.data.spark import write_shards_spark as write
        else:
            from scaletrain.data.shard_writer import write_shards as write
        # The writers' warnings (a split missing a class) become lines of ours, not tracebacks.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train = write(
                args.source, args.out_dir, rows_per_shard=args.rows_per_shard, seq_len=args.seq_len
            )
        lines = summary_lines(train, read_manifest(args.out_dir / "eval"), out_dir=args.out_dir)
    except (ShardError, ValueError, FileNotFoundError, ImportError) as e:
        raise ConfigError(str(e)) from None
    for line in lines:  # what was understood: columns, classes, features, rows, shards
        print(f"scaletrain: {line}")
    for w in caught:
        print(f"scaletrain: warning: {w.message}", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from scaletrain.checkpoint_files import MANIFEST, CheckpointError, export_weights, latest_valid
    from scaletrain.distill.student import strip_wrapper
    from scaletrain.runtime import honour_umask

    checkpoint = args.checkpoint
    if not checkpoint.is_dir():
        raise ConfigError(f"CHECKPOINT {str(checkpoint)!r} is not a directory")
    final = checkpoint / "model.safetensors"
    if (checkpoint / "checkpoints").is_dir():  # a run directory: its newest valid checkpoint
        checkpoint = latest_valid(
            checkpoint / "checkpoints", report=lambda m: print(m, file=sys.stderr)
        )
        if checkpoint is None:
            raise ConfigError(
                f"{str(args.checkpoint)!r} has no valid checkpoint" + _final_weights_hint(final)
            )
    elif not (checkpoint / MANIFEST).exists() and not checkpoint.name.startswith(
        ("step-", ".tmp-step-")
    ):
        # Neither a checkpoint nor a run directory with checkpoints/: say which it is.
        if (checkpoint / "metrics.jsonl").exists() or final.exists():
            raise ConfigError(
                f"run directory {str(args.checkpoint)!r} has no checkpoints "
                "(it ran with checkpoint.every = 0)" + _final_weights_hint(final)
            )
        raise ConfigError(
            f"CHECKPOINT {str(checkpoint)!r} is neither a checkpoint (no "
            f"{MANIFEST}) nor a run directory (no checkpoints/)"
        )
    try:
        # verifies the manifest first; a distilled run exports its student alone
        out = export_weights(checkpoint, args.out, rename=strip_wrapper)
    except CheckpointError as e:  # a damaged or incomplete checkpoint: the user's input
        raise ConfigError(str(e)) from e
    honour_umask(out)  # safetensors writes 0600
    print(f"scaletrain: wrote {out}: the model weights of {checkpoint.name} ({checkpoint})")
    return 0


def _final_weights_hint(final: Path) -> str:
    if not final.is_file():
        return ""
    return (
        f"; its final weights are already in {final}, in the format export writes "
        "(safetensors, plain parameter names)"
    )


COMMANDS = {
    "train": cmd_train,
    "explain": cmd_explain,
    "report": cmd_report,
    "shard": cmd_shard,
    "export": cmd_export,
    "distill-cache": cmd_distill_cache,
    "eval": cmd_eval,
    "plan": cmd_plan,
    "calibrate": cmd_calibrate,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if argv and argv[0] in subcommands.choices:
        # Intermixed: overrides may come after flags (`train cfg.toml --nproc 2 train.steps=5`).
        args = subcommands.choices[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
    else:
        args = parser.parse_args(argv)  # help, or an error naming the allowed subcommands
    try:
        return COMMANDS[args.command](args)
    except UserError as e:  # ConfigError, LaunchError, UserCodeError, ...: not our bugs
        if getattr(args, "debug", False):  # the user's own code's traceback, on request
            import traceback

            traceback.print_exc()
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
