"""A rank's entry: what `python -m scaletrain train` runs under an elastic agent (torchrun's or
scaletrain's launcher). A known failure becomes one message and an exit status; a SIGINT or
SIGTERM, 130 or 143, said by the launcher."""

from __future__ import annotations

import sys
from pathlib import Path

from scaletrain.config import Config
from scaletrain.errors import EXIT_FAILED, EXIT_USAGE, UserError
from scaletrain.launch.agent import (
    Interrupted,
)


def run_worker(
    config: Config, run_dir: Path | None, *, exit_process: bool = True, debug: bool = False
) -> int:
    """Train as one rank; known failures become one message and a status code.

    A worker (exit_process) leaves with 130 on SIGINT and 143 on SIGTERM, saying nothing:
    the launcher reports the interrupt. In the launcher's own process (one process, no
    agent) a signal becomes `Interrupted`, which the CLI turns into its one line.
    """
    import signal
    import traceback

    from scaletrain.checkpoint.files import CheckpointError
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


def run_ps_rank(config: Config, run_dir: Path | None) -> int:
    """Under parallel.strategy = 'ps': this rank's supervisor, which forks the role."""
    from scaletrain.ps.run import run_role
    from scaletrain.ps.supervisor import supervise
    from scaletrain.runtime import exit_worker

    exit_worker(supervise(config, run_dir, role_main=run_role))
