"""The parameter-server strategy (parallel.strategy = "ps"): roles, RPC, supervisor, outputs.

The same launcher starts the same ranks as for the collective strategy; each rank's role is
its number: ranks 0 .. ps.servers-1 are servers, the rest are workers (parallel/checks.py PSShape).

    torchrun agent -> rank r: supervisor (ps/supervisor.py, `supervise`)
                         -> child: python -m scaletrain train ... (`run_role`)
                              init_rpc (TensorPipe, listening on ps.interface only)
                              server k: its shard, optimizer, checkpoints (server.py)
                              worker w: pull, gradient, push (worker.py)

Why a supervisor (ps/supervisor.py): torchrun's agent tears the whole group down when any
rank exits non-zero, so a worker killed by the OOM killer would end the run.

Server 0 also keeps the run directory: config.toml, metrics.jsonl (ps/metrics.py: a record
every log.every global steps, with the staleness and delay of every update in it),
evaluations every train.eval_every global steps on a background thread, and at the end the
final evaluation, then model.safetensors (every server's shard gathered into the whole
model, buffers and tied weights kept) and summary.json (with the staleness histogram),
written by training/finish.py as a collective run writes them. Server 0 is also the one
authority on which workers are alive (ps/server.py).
A global step is train.global_batch examples applied, so that train.steps, log.every,
eval_every and checkpoint.every mean the same numbers of examples as under DDP: under async
and ssp one step is `workers` updates of global_batch / workers examples each.

Servers save checkpoints in the collective strategy's format (checkpoint/__init__.py: model.* and
optim.* keyed by parameter name, so a checkpoint loads into another number of servers)
over a gloo group of the servers alone; the workers hold no state (their data position is
their step, their RNG is reseeded per step).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed.rpc as rpc

from scaletrain.config import Config, ConfigError
from scaletrain.launch.resolve import Derived, resolve
from scaletrain.ps.connect import init_rpc, init_server_group
from scaletrain.ps.partition import model_partition
from scaletrain.ps.parts import AllWorkersDead, role_model
from scaletrain.ps.serve import run_server
from scaletrain.ps.supervisor import (
    EXIT_REFUSED,
    EXIT_SERVER_LOST,
    EXIT_THREAD_FAILED,
)
from scaletrain.ps.threads import ThreadFailed
from scaletrain.ps.worker import ServerLost, run_worker
from scaletrain.runtime.allocator import configure_allocator

# ---------------------------------------------------------------------- the role


def run_role(config: Config, run_dir: Path) -> int:
    """This rank's server or worker, from RPC up to RPC down; the exit status."""
    from scaletrain.checkpoint.files import CheckpointError
    from scaletrain.runtime import read_env, set_threads
    from scaletrain.user_code import UserCodeError

    penv = read_env()
    derived = resolve(config, world_size=penv.world_size, nproc_per_node=penv.local_world_size)
    role, index = derived.ps.role(penv.rank)
    set_threads(derived.threads)
    configure_allocator(config.train.allocator, device_type="cpu")
    # Where tests and operators find the process to signal: in the rank's log, under the
    # prefix of the log's header, which the console leaves out (launch/output.py).
    print(
        f"# scaletrain worker: rank {penv.rank} is ps {role} {index}, pid {os.getpid()}",
        file=sys.stderr,
        flush=True,
    )
    code = 0
    store = init_rpc(config, penv.rank, penv.world_size, role=role, index=index)
    try:
        if role == "server":
            init_server_group(config, store, index, servers=derived.ps.servers)
            run_server(config, derived, index=index, run_dir=run_dir)
        else:
            code = _work(config, derived, index=index)
    except (ConfigError, UserCodeError) as e:
        print(f"scaletrain: error: {e}", file=sys.stderr, flush=True)
        code = 2
    except ServerLost as e:
        print(f"scaletrain: worker {index}: {e}; leaving", file=sys.stderr, flush=True)
        code = EXIT_SERVER_LOST
    except (CheckpointError, AllWorkersDead) as e:
        print(f"scaletrain: error: {e}", file=sys.stderr, flush=True)
        code = 1
    except ThreadFailed as e:  # the traceback to the log, one paragraph naming the thread
        _log_traceback(e)
        who = f"parameter server {index}" if role == "server" else f"worker {index}"
        print(f"scaletrain: error: {_thread_failure(e, who, run_dir)}", file=sys.stderr, flush=True)
        code = EXIT_THREAD_FAILED
    finally:
        # graceful=True waits for every peer, and hangs on a dead one (shared/PLATFORM-NOTES.md).
        rpc.shutdown(graceful=False)
    return code


def _thread_failure(e: ThreadFailed, who: str, run_dir: Path) -> str:
    """The paragraph for a background thread that raised: a bug of ours, unless it was the
    sync applier's collective (a peer server gone, whose own failure the launcher names)."""
    from scaletrain.runtime import is_collective_error

    why = "a collective failed" if is_collective_error(e.__cause__) else "a bug in scaletrain"
    return (
        f"{who}: {e} ({why}: its traceback is in this rank's log); the run ends. The run's "
        f"checkpoints survive: continue with scaletrain train ... --run-dir {run_dir} --resume"
    )


def _log_traceback(e: BaseException) -> None:
    """The exception's traceback into the rank's log in one write: a line another thread
    writes meanwhile (a C++ log record) cannot land inside it, where the console's filter
    would take it for the traceback's end and show the rest."""
    sys.stderr.write("".join(traceback.format_exception(e)))
    sys.stderr.flush()


# ---------------------------------------------------------------------- worker


def _work(config: Config, derived: Derived, *, index: int) -> int:
    from scaletrain.data.sampler import GlobalBatchSampler

    model, precision, train_ds, loss_fn = role_model(config, derived)
    t, ps = config.train, config.ps
    sampler = GlobalBatchSampler(
        len(train_ds),
        global_batch=t.global_batch,
        micro_batch=t.micro_batch,
        dp_rank=index,
        dp_size=derived.ps.workers,
        seed=t.seed,
        shard_rows=train_ds.shard_rows,
        shuffle_window=config.data.shuffle_window,
    )
    outcome = run_worker(
        model,
        worker=index,
        partition=model_partition(model, servers=derived.ps.servers),
        sampler=sampler,
        train_ds=train_ds,
        loss_fn=loss_fn,
        precision=precision,
        # sync: the servers clip the averaged gradient, as DDP does
        grad_clip=0.0 if ps.mode == "sync" else config.optim.grad_clip,
        device=torch.device("cpu"),
        timeout_s=config.parallel.timeout_s,
        lease_s=ps.worker_timeout_s,
        seed=t.seed,
    )
    print(
        f"scaletrain: worker {index}: {outcome.status} after {outcome.steps_done} steps "
        f"(last loss {outcome.last_loss:.4g})",
        file=sys.stderr,
        flush=True,
    )
    if outcome.status == "refused":
        print(
            f"scaletrain: worker {index} was declared dead by the servers (silent for more "
            f"than ps.worker_timeout_s = {ps.worker_timeout_s:g} s); its late gradients were "
            "refused; leaving",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_REFUSED
    return 0


# ---------------------------------------------------------------------- server
