"""`scaletrain report`: loss, throughput and eval curves of one or more runs, as a PNG."""

from __future__ import annotations

import argparse

from scaletrain.config import ConfigError


def cmd_report(args: argparse.Namespace) -> int:
    from scaletrain.records.report import write_report

    for run_dir in args.run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise ConfigError(f"{str(run_dir)!r} is not a run directory (no metrics.jsonl)")
    out = args.out or args.run_dirs[0] / "report.png"
    print(f"scaletrain: report {write_report(args.run_dirs, out=out)}")
    return 0
