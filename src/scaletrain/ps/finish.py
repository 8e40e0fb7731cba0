"""Server 0's evaluations and the end of a parameter-server run: the whole model gathered from
the servers one shard at a time, evaluated, and written as a collective run writes it."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc

from scaletrain.config import Config
from scaletrain.launch.resolve import Derived
from scaletrain.ps import endpoints
from scaletrain.ps.metrics import ServerMetrics
from scaletrain.ps.parts import AllWorkersDead, fresh_net
from scaletrain.ps.server import ParameterServer
from scaletrain.ps.worker import server_name
from scaletrain.records.memory import global_bytes


def server_versions(own: int, servers: int) -> dict[int, int]:
    """Every server's update count (server 0's given), for updates/s."""
    out = {0: own}
    for k in range(1, servers):
        try:
            out[k] = rpc.rpc_sync(server_name(k), endpoints.rpc_version, timeout=10)
        except RuntimeError:
            pass
    return out


def _param_bytes_by_server(own: int, servers: int) -> dict[str, int]:
    """Every server's resident parameter bytes (server 0's given)."""
    out = {"0": own}
    for k in range(1, servers):
        out[str(k)] = rpc.rpc_sync(server_name(k), endpoints.rpc_param_bytes, timeout=60)
    return out


def _gathered_model(config: Config, servers: int, *, eval_ds, precision) -> torch.nn.Module:
    """The whole model with every server's current parameters, for an evaluation or the
    final save: built for the moment (its buffers initialised as the workers' are), each
    server's shard copied in as it arrives, dropped by the caller afterwards. Only the
    trainable parameters come from the servers: the rest (frozen parameters, buffers) is
    the workers' because `fresh_net` draws it as they do."""
    model = fresh_net(config, eval_ds, precision)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k in range(servers):
            shard = rpc.rpc_sync(server_name(k), endpoints.rpc_snapshot, timeout=60)
            for n, value in shard.items():
                params[n].copy_(value)
            del shard
    return model


def evaluate_gathered(
    config: Config, servers: int, *, eval_ds, precision, loss_fn, model=None
) -> dict:
    """Server 0's evaluation on the gathered model (`model`, or one gathered now)."""
    from scaletrain.training.evaluate import eval_record, eval_totals

    if model is None:
        model = _gathered_model(config, servers, eval_ds=eval_ds, precision=precision)
    totals = eval_totals(
        model,
        eval_ds,
        limit=config.train.eval_examples,
        batch=config.train.micro_batch,
        dp_rank=0,
        dp_size=1,
        counts=True,
        precision=precision,
        device=torch.device("cpu"),
        loss_fn=loss_fn,
    )
    return eval_record(totals, kind=eval_ds.spec.kind, loss_name=config.train.loss)


def finish_ps_run(
    run_dir: Path,
    config: Config,
    derived: Derived,
    *,
    server: ParameterServer,
    metrics: ServerMetrics,
    train_s: float,
    precision,
    loss_fn,
    eval_ds,
) -> None:
    """Server 0: the final evaluation, then what a collective run writes (training/finish.py:
    model.safetensors with the model's buffers and tied weights, hf-model/, summary.json),
    with the servers' own section in the summary."""
    from scaletrain.training.finish import finish_run

    model = _gathered_model(config, derived.ps.servers, eval_ds=eval_ds, precision=precision)
    eval_started = time.perf_counter()
    record = evaluate_gathered(
        config,
        derived.ps.servers,
        eval_ds=eval_ds,
        precision=precision,
        loss_fn=loss_fn,
        model=model,
    )
    metrics.logger.log_eval({"step": config.train.steps, **record})
    dead = {str(w): why for w, why in sorted(server.clocks.dead.items())}
    ps = {
        "mode": config.ps.mode,
        "servers": derived.ps.servers,
        "workers": derived.ps.workers,
        "workers_alive": derived.ps.workers - len(dead),
        "dead_workers": dead,
        "updates": server.version,
        # Every server's count: under sync they are equal, or the shards took different steps.
        "updates_by_server": {
            str(k): v for k, v in server_versions(server.version, derived.ps.servers).items()
        },
        "staleness_histogram": {str(k): n for k, n in sorted(metrics.staleness_hist.items())},
        "delay_histogram": {str(k): n for k, n in sorted(metrics.delay_hist.items())},
        "staleness_bound": config.ps.staleness if config.ps.mode == "ssp" else None,
        # What each server holds: its partition, not the model (ps/partition.py).
        "param_bytes_by_server": _param_bytes_by_server(
            global_bytes(server.params), derived.ps.servers
        ),
        "model_param_bytes": global_bytes(model.parameters()),
    }
    summary = finish_run(
        run_dir,
        model=model,
        weights=None,
        config=config,
        derived=derived,
        train_s=train_s,
        eval_s=time.perf_counter() - eval_started,  # the final one (mid-run ones overlap)
        last_loss=metrics.last_loss,
        eval_record=record,
        skipped=metrics.skipped,
        precision_mode=precision.mode,
        examples=metrics.examples - metrics.start_examples,  # by this run
        extra={"ps": ps},
        logger=metrics.logger,
    )
    metrics.logger.message(
        f"scaletrain: parameter servers done: {server.version} updates on server 0, "
        f"{summary['ps']['workers_alive']} of {derived.ps.workers} workers alive"
        + (f" (dead: {', '.join(f'worker {w}: {why}' for w, why in dead.items())})" if dead else "")
    )
    if len(dead) == derived.ps.workers:
        raise AllWorkersDead(
            f"every worker died (the summary is written); their logs are in {run_dir / 'logs'}"
        )
