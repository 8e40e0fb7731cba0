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
import sys
from pathlib import Path

from scaletrain.commands.distill import add_parsers as add_distill_parsers
from scaletrain.commands.distill import cmd_distill_cache, cmd_eval
from scaletrain.commands.explain import cmd_explain
from scaletrain.commands.export import cmd_export
from scaletrain.commands.plan import add_parsers as add_plan_parsers
from scaletrain.commands.plan import cmd_calibrate, cmd_plan
from scaletrain.commands.report import cmd_report
from scaletrain.commands.shard import cmd_shard
from scaletrain.commands.train import cmd_train
from scaletrain.errors import EXIT_USAGE, UserError
from scaletrain.version import __version__


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
    add_distill_parsers(sub)  # distill-cache, eval (commands/distill.py)
    add_plan_parsers(sub)  # plan, calibrate (commands/plan.py)
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
