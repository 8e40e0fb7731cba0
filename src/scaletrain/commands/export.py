"""`scaletrain export`: a checkpoint's (or a run's newest checkpoint's) model weights as one
safetensors file, no process group."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scaletrain.config import ConfigError


def cmd_export(args: argparse.Namespace) -> int:
    from scaletrain.checkpoint.files import MANIFEST, CheckpointError, export_weights, latest_valid
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
