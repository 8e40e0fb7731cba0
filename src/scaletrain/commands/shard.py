"""`scaletrain shard`: a data source or a user's file written as Parquet shards and a manifest."""

from __future__ import annotations

import argparse
import sys

from scaletrain.config import ConfigError


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
