"""A parameter server's role: its shard and optimizer, restored from the newest checkpoint, served
over RPC until every worker has left; server 0 also keeps the leases, the metrics and the
cuts at which the servers checkpoint together."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc

from scaletrain.config import Config, config_to_toml, flatten_config
from scaletrain.launch.resolve import Derived
from scaletrain.ps import endpoints
from scaletrain.ps.finish import evaluate_gathered, finish_ps_run, server_versions
from scaletrain.ps.metrics import ServerMetrics, ServerProgress
from scaletrain.ps.parts import server_part, shard_module
from scaletrain.ps.server import ParameterServer, Update
from scaletrain.ps.supervisor import (
    FINISHED_MARKER,
)
from scaletrain.ps.worker import server_name
from scaletrain.training.optim import describe_optimizer
from scaletrain.training.progress import Startup


def run_server(config: Config, derived: Derived, *, index: int, run_dir: Path) -> None:
    from scaletrain.checkpoint import Checkpointer, TrainState
    from scaletrain.checkpoint import load as load_checkpoint
    from scaletrain.launch.rundir import write_config
    from scaletrain.records.metrics import MetricsLogger
    from scaletrain.runtime import all_reduce_min, all_reduce_sum, barrier, broadcast_object

    t, o, ps, shape = config.train, config.optim, config.ps, derived.ps
    main = index == 0
    startup = Startup(enabled=main and not config.log.quiet)  # a collective run's lines
    startup.say(
        f"{shape.servers} parameter server(s) and {shape.workers} worker(s) up, "
        f"{derived.threads} thread(s) each"
    )
    part = server_part(config, derived, index=index, startup=startup)
    eval_ds, precision, loss_fn, params = part.eval_ds, part.precision, part.loss_fn, part.params
    shard = shard_module(params)
    per_step = 1 if ps.mode == "sync" else shape.workers  # gradients per global step
    optimizer, scheduler = _optimizer(config, shard, per_step=per_step, hidden=part.hidden)
    startup.say(describe_optimizer(optimizer))
    progress = ServerProgress()
    state = TrainState(shard, optimizer, scheduler, precision, loop=progress)
    resume_from = broadcast_object(_latest_checkpoint(run_dir) if main else None)
    if resume_from is not None:
        load_checkpoint(Path(resume_from), state)
    elif main:
        write_config(run_dir, config)
    c = config.checkpoint
    checkpointer = Checkpointer(
        run_dir / "checkpoints",
        keep=c.keep,
        async_save=c.async_save,
        config_toml=config_to_toml(config),
    )
    # Said before the progress bar starts, which would take the line's start.
    startup.say(
        f"ready: step {state.step + 1} of {t.steps} starting (the first is slower: warm-up)"
    )
    logger = MetricsLogger(
        run_dir,
        total_steps=t.steps,
        enabled=main,
        quiet=config.log.quiet,
        tensorboard=config.log.tensorboard,
        start_step=state.step,
        trackers=config.log.trackers,
        params=flatten_config(config.model_dump(mode="json")),
    )
    if resume_from is not None:
        logger.message(f"scaletrain: resumed from {resume_from} at step {state.step}")
    for warning in derived.warnings:
        logger.message(f"scaletrain: warning: {warning}")
    metrics = None
    if main:
        metrics = ServerMetrics(
            config,
            derived,
            logger=logger,
            start_step=state.step,
            evaluate=lambda: evaluate_gathered(
                config,
                shape.servers,
                eval_ds=eval_ds,
                precision=precision,
                loss_fn=loss_fn,
            ),
            versions=lambda own: server_versions(own, shape.servers),
        )
        progress.metrics = metrics

    def save(step: int) -> None:
        state.step = step
        state.examples_seen = server.examples
        checkpointer.save(state)
        checkpointer.wait()

    announced: list = []  # server 0's membership messages in flight (RPC futures)

    def on_update(u: Update) -> None:
        if metrics is not None:
            metrics.update(
                u,
                alive=len(server.clocks.live),
                lr=optimizer.param_groups[0]["lr"],
                version=server.version,
            )

    server = ParameterServer(
        index=index,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        workers=shape.workers,
        mode=ps.mode,
        staleness=ps.staleness,
        inverse_lr=ps.staleness_lr == "inverse",
        lease_s=ps.worker_timeout_s,
        join_s=config.parallel.timeout_s,
        steps=t.steps,
        global_batch=t.global_batch,
        start_step=state.step,
        checkpoint_every=c.every,
        stop_after=t.stop_after,
        save=save,
        on_update=on_update,
        report=lambda m: print(m, file=sys.stderr, flush=True),
        authority=main,  # server 0 decides who is alive, and tells the others
        announce=lambda w, why: announced.extend(
            _announce(w, why, shape.servers, timeout_s=ps.worker_timeout_s)
        ),
        grad_clip=o.grad_clip if ps.mode == "sync" else 0.0,
        reduce_squares=all_reduce_sum,
        reduce_min=all_reduce_min,
        schedule_examples=t.global_batch // per_step,
        tell_cut=lambda step, examples: _tell_cut(
            step, examples, shape.servers, timeout_s=config.parallel.timeout_s
        ),
    )
    _restore(progress, server=server, metrics=metrics)
    started = time.perf_counter()
    endpoints.serve(server)
    try:
        server.wait_until_done()
        _settle(announced)
        train_s = time.perf_counter() - started  # server 0's evaluations overlap it
        if metrics is not None:
            metrics.close()
        if main and not server.stopping:
            finish_ps_run(
                run_dir,
                config,
                derived,
                server=server,
                metrics=metrics,
                train_s=train_s,
                precision=precision,
                loss_fn=loss_fn,
                eval_ds=eval_ds,
            )
        elif main:
            logger.message(
                f"scaletrain: stopped after step {t.stop_after} (train.stop_after); "
                f"continue with: scaletrain train ... --run-dir {run_dir} --resume"
            )
    finally:
        checkpointer.close()
        logger.close()
    barrier()  # the other servers serve server 0's final gather until here
    if main:
        _mark_finished(run_dir, server)


def _optimizer(config: Config, shard: torch.nn.Module, *, per_step: int, hidden=None):
    """The shard's optimizer and LR schedule; the schedule counts gradients (`per_step` of
    them make a global step); `hidden`: muon's matrices, chosen on the whole model."""
    from scaletrain.training.optim import from_section

    return from_section(
        shard, config.optim, total_steps=config.train.steps, per_step=per_step, hidden=hidden
    )


def _restore(
    progress: ServerProgress, *, server: ParameterServer, metrics: ServerMetrics | None
) -> None:
    """Hand a resumed checkpoint's counters to the server and server 0's metrics."""
    progress.server = server

    def part(prefix: str) -> dict:
        return {
            k.removeprefix(prefix): v for k, v in progress.loaded.items() if k.startswith(prefix)
        }

    if progress.loaded:
        server.load_state_dict(part("server."))
        if metrics is not None:
            metrics.load_state_dict(part("metrics."))
    if metrics is not None:  # the run's position in examples, as the server counts it
        metrics.examples = metrics.start_examples = server.examples


def _mark_finished(run_dir: Path, server: ParameterServer) -> None:
    """RUN_DIR/logs/ps-finished: the servers are done (the supervisors' signal)."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs" / FINISHED_MARKER).write_text(
        json.dumps({"dead_workers": {str(w): why for w, why in server.clocks.dead.items()}}) + "\n"
    )


def _announce(worker: int, why: str | None, servers: int, *, timeout_s: float) -> list:
    """Server 0 (the membership authority) tells the other servers that `worker` died (why)
    or left (None); the calls' futures, not waited for (ParameterServer.membership says
    why)."""
    return [
        rpc.rpc_async(
            server_name(k), endpoints.rpc_membership, args=(worker, why), timeout=timeout_s
        )
        for k in range(1, servers)
    ]


def _tell_cut(step: int, examples: int, servers: int, *, timeout_s: float) -> list:
    """Server 0 tells the other servers to write their part of the checkpoint of global
    `step` once they have applied `examples`; the calls' futures, which answer when done."""
    return [
        rpc.rpc_async(
            server_name(k),
            endpoints.rpc_cut,
            args=(step, examples, timeout_s),
            timeout=2 * timeout_s,
        )
        for k in range(1, servers)
    ]


def _settle(calls: list) -> None:
    """Wait for server 0's membership messages; a server that did not answer is gone, and
    its supervisor ends the run."""
    for call in calls:
        try:
            call.wait()
        except RuntimeError:
            pass


def _latest_checkpoint(run_dir: Path) -> str | None:
    from scaletrain.checkpoint.files import latest_valid

    found = latest_valid(
        run_dir / "checkpoints", report=lambda m: print(m, file=sys.stderr), quarantine=True
    )
    return str(found) if found else None
