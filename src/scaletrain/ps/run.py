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

Servers save checkpoints in the collective strategy's format (checkpoint.py: model.* and
optim.* keyed by parameter name, so a checkpoint loads into another number of servers)
over a gloo group of the servers alone; the workers hold no state (their data position is
their step, their RNG is reseeded per step).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from scaletrain.allocator import configure_allocator
from scaletrain.config import Config, ConfigError, config_to_toml
from scaletrain.data.loader import Dataset
from scaletrain.loss import LossFn
from scaletrain.memory import global_bytes
from scaletrain.plan import Derived, resolve
from scaletrain.precision import Precision
from scaletrain.ps import server as ps_server
from scaletrain.ps.metrics import ServerMetrics, ServerProgress
from scaletrain.ps.partition import model_partition
from scaletrain.ps.server import ParameterServer, Update
from scaletrain.ps.supervisor import (
    EXIT_REFUSED,
    EXIT_SERVER_LOST,
    EXIT_THREAD_FAILED,
    FINISHED_MARKER,
)
from scaletrain.ps.threads import ThreadFailed
from scaletrain.ps.worker import ServerLost, run_worker, server_name, worker_name
from scaletrain.runtime import tcp_store_on
from scaletrain.training.progress import Startup


class AllWorkersDead(RuntimeError):
    """The servers outlived every worker: the run has no result to speak of."""


# ---------------------------------------------------------------------- the role


def run_role(config: Config, run_dir: Path) -> int:
    """This rank's server or worker, from RPC up to RPC down; the exit status."""
    from scaletrain.checkpoint_files import CheckpointError
    from scaletrain.runtime import read_env, set_threads
    from scaletrain.user_code import UserCodeError

    penv = read_env()
    derived = resolve(config, world_size=penv.world_size, nproc_per_node=penv.local_world_size)
    role, index = derived.ps.role(penv.rank)
    set_threads(derived.threads)
    configure_allocator(config.train.allocator, device_type="cpu")
    # Where tests and operators find the process to signal: in the rank's log, under the
    # prefix of the log's header, which the console leaves out (launch_output.py).
    print(
        f"# scaletrain worker: rank {penv.rank} is ps {role} {index}, pid {os.getpid()}",
        file=sys.stderr,
        flush=True,
    )
    code = 0
    store = _init_rpc(config, penv.rank, penv.world_size, role=role, index=index)
    try:
        if role == "server":
            _init_server_group(config, store, index, servers=derived.ps.servers)
            _serve(config, derived, index=index, run_dir=run_dir)
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


def _init_rpc(config: Config, rank: int, world: int, *, role: str, index: int):
    """RPC up on a rendezvous store that listens on ps.interface only; returns the store
    (the servers' checkpoint group uses it too)."""
    # TensorPipe listens on the interface TP_SOCKET_IFNAME names, and only there; the
    # servers' gloo group (checkpoints, sync's clipping norm) on GLOO_SOCKET_IFNAME's, which
    # gloo otherwise picks from the host name.
    os.environ["TP_SOCKET_IFNAME"] = config.ps.interface
    os.environ["GLOO_SOCKET_IFNAME"] = config.ps.interface
    store = _store(config, rank, world)
    # init_rpc meets on a store it makes from a URL: hand it ours through a scheme of our own.
    dist.register_rendezvous_handler(
        "scaletrain-ps", lambda url, **kw: iter([(store, rank, world)])
    )
    # The uv (TCP) transport and basic channel only: TensorPipe's shared-memory transport
    # busy-polls a core's share per process, which on a CPU host is taken from the workers'
    # compute.
    options = rpc.TensorPipeRpcBackendOptions(
        init_method="scaletrain-ps://",
        rpc_timeout=config.parallel.timeout_s,
        num_worker_threads=16,
        _transports=["uv"],
        _channels=["basic"],
    )
    name = server_name(index) if role == "server" else worker_name(index)
    with warnings.catch_warnings():  # init_rpc's unrelated deprecation notice (pytorch#149393)
        warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
        rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    return store


def interface_address(name: str) -> str:
    """The IPv4 address of a network interface ("lo" -> 127.0.0.1)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # SIOCGIFADDR
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise ConfigError(
                f"ps.interface = {name!r} has no IPv4 address on this machine "
                f"({e.strerror}); use an interface `ip -brief addr` lists"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def _store(config: Config, rank: int, world: int) -> dist.TCPStore:
    """The TCP store at MASTER_ADDR:MASTER_PORT that RPC and the servers' group meet on.

    c10d's own env:// rendezvous binds its store to every interface; rank 0 here listens on
    ps.interface's address only (runtime.tcp_store_on).
    """
    port, timeout = int(os.environ["MASTER_PORT"]), timedelta(seconds=config.parallel.timeout_s)
    address = interface_address(config.ps.interface)
    if rank != 0 and config.ps.interface != "lo":
        address = os.environ["MASTER_ADDR"]  # rank 0's host, reached over that interface
    return tcp_store_on(address, port, world_size=world, is_master=rank == 0, timeout=timeout)


def _init_server_group(config: Config, store, index: int, *, servers: int) -> None:
    """A gloo group of the servers alone, for their checkpoints (DCP), on the rendezvous
    store (a PrefixStore keeps its keys apart from RPC's)."""
    if servers == 1:
        return
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("ps-servers", store),
        rank=index,
        world_size=servers,
        timeout=timedelta(seconds=config.parallel.timeout_s),
    )


def _fresh_net(
    config: Config, dataset: Dataset, precision: Precision, *, meta: bool = False
) -> torch.nn.Module:
    """The model as every role builds it, train.seed set just before: a model that cannot
    be built on meta draws its initial values from the global RNG (a user model's frozen
    parameters and random buffers included, which no server holds), so a worker, a server
    and server 0's gathered model get the same ones whatever each did with the RNG first."""
    from scaletrain.runtime import seed_everything
    from scaletrain.training.assemble import build_net

    seed_everything(config.train.seed)
    return precision.convert_module(build_net(config, dataset, meta=meta))


def _build_model(config: Config, derived: Derived):
    """Model, precision, train set: identical on every rank (same seed)."""
    from scaletrain.precision import make_precision
    from scaletrain.runtime import seed_everything
    from scaletrain.training.assemble import build_data, build_loss

    seed_everything(config.train.seed)  # a user's data may draw from the global RNG
    train_ds = build_data(config, split="train")
    precision = make_precision(config.precision.mode, device_type="cpu")
    model = _fresh_net(config, train_ds, precision)
    return model, precision, train_ds, build_loss(config, train_ds)


@dataclass(frozen=True)
class ServerPart:
    """What one server holds."""

    eval_ds: Dataset  # the held-out set: its task, and server 0's evaluations
    precision: Precision
    loss_fn: LossFn
    params: dict[str, torch.nn.Parameter]  # its partition, at the workers' initial values


def _server_part(config: Config, derived: Derived, *, index: int, startup: Startup) -> ServerPart:
    """What server `index` holds. The model is built on the meta device and only the
    partition is drawn (models/init.py's module rule, the values the workers' whole
    builds get); a model that cannot be built on meta is built whole and all but the
    partition dropped. No server reads the training set."""
    from scaletrain.models.init import init_plan, initial_values, is_meta
    from scaletrain.precision import make_precision
    from scaletrain.training.assemble import build_loss

    eval_ds = _eval_data(config)
    startup.say(
        f"data: {len(eval_ds)} evaluation examples on server 0, the training set on the "
        f"workers (data.source = {config.data.source!r})"
    )
    precision = make_precision(config.precision.mode, device_type="cpu")
    model = _fresh_net(config, eval_ds, precision, meta=True)
    names = model_partition(model, servers=derived.ps.servers)[index]
    if is_meta(model):
        values = initial_values(model, names, plan=init_plan(model), seed=config.train.seed)
        params = {n: torch.nn.Parameter(v) for n, v in values.items()}
    else:
        whole = dict(model.named_parameters())
        params = {n: whole[n] for n in names}
    shape, mode = derived.ps, config.ps.mode
    startup.say(
        f"model: {sum(p.numel() for p in model.parameters()):,} parameters (model.name = "
        f"{config.model.name!r}, {'built on meta' if is_meta(model) else 'built whole'}), "
        f"layout {shape.servers} parameter server(s) + {shape.workers} worker(s), "
        f"ps.mode = {mode!r}"
    )
    model_bytes = global_bytes(model.parameters())
    print(  # every server's, in its log (before server 0's progress bar starts)
        f"scaletrain: server {index} holds {len(params)} parameter tensor(s), "
        f"{_mib(global_bytes(params.values()))} of the model's {_mib(model_bytes)}",
        file=sys.stderr,
        flush=True,
    )
    return ServerPart(
        eval_ds=eval_ds,
        precision=precision,
        loss_fn=build_loss(config, eval_ds),
        params=params,
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# ---------------------------------------------------------------------- worker


def _work(config: Config, derived: Derived, *, index: int) -> int:
    from scaletrain.data.sampler import GlobalBatchSampler

    model, precision, train_ds, loss_fn = _build_model(config, derived)
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
        slow_factor=ps.slow_factor if ps.slow_worker == index else 1.0,
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


def shard_module(params: dict[str, torch.nn.Parameter]) -> torch.nn.Module:
    """A module holding exactly these parameters under their dotted names (nested plain
    modules), so that the checkpoint code keys them as the whole model does."""
    root = torch.nn.Module()
    for name, p in params.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, p)
    return root


def _serve(config: Config, derived: Derived, *, index: int, run_dir: Path) -> None:
    from scaletrain.checkpoint import Checkpointer, TrainState
    from scaletrain.checkpoint import load as load_checkpoint
    from scaletrain.metrics import MetricsLogger
    from scaletrain.rundir import write_config
    from scaletrain.runtime import all_reduce_min, all_reduce_sum, barrier, broadcast_object

    t, o, ps, shape = config.train, config.optim, config.ps, derived.ps
    main = index == 0
    startup = Startup(enabled=main and not config.log.quiet)  # a collective run's lines
    startup.say(
        f"{shape.servers} parameter server(s) and {shape.workers} worker(s) up, "
        f"{derived.threads} thread(s) each"
    )
    part = _server_part(config, derived, index=index, startup=startup)
    eval_ds, precision, loss_fn, params = part.eval_ds, part.precision, part.loss_fn, part.params
    shard = shard_module(params)
    per_step = 1 if ps.mode == "sync" else shape.workers  # gradients per global step
    optimizer, scheduler = _optimizer(config, shard, per_step=per_step)
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
            evaluate=lambda: _evaluate(
                config,
                shape.servers,
                eval_ds=eval_ds,
                precision=precision,
                loss_fn=loss_fn,
            ),
            versions=lambda own: _versions(own, shape.servers),
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
    ps_server.serve(server)
    try:
        server.wait_until_done()
        _settle(announced)
        train_s = time.perf_counter() - started  # server 0's evaluations overlap it
        if metrics is not None:
            metrics.close()
        if main and not server.stopping:
            _finish(
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


def _optimizer(config: Config, shard: torch.nn.Module, *, per_step: int):
    """The shard's optimizer and LR schedule; the schedule counts gradients (`per_step` of
    them make a global step)."""
    from scaletrain.training.optim import from_section

    return from_section(shard, config.optim, total_steps=config.train.steps, per_step=per_step)


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
            server_name(k), ps_server.rpc_membership, args=(worker, why), timeout=timeout_s
        )
        for k in range(1, servers)
    ]


def _tell_cut(step: int, examples: int, servers: int, *, timeout_s: float) -> list:
    """Server 0 tells the other servers to write their part of the checkpoint of global
    `step` once they have applied `examples`; the calls' futures, which answer when done."""
    return [
        rpc.rpc_async(
            server_name(k),
            ps_server.rpc_cut,
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
    from scaletrain.checkpoint_files import latest_valid

    found = latest_valid(
        run_dir / "checkpoints", report=lambda m: print(m, file=sys.stderr), quarantine=True
    )
    return str(found) if found else None


def _eval_data(config: Config):
    from scaletrain.training.assemble import build_data

    return build_data(config, split="eval")


def _versions(own: int, servers: int) -> dict[int, int]:
    """Every server's update count (server 0's given), for updates/s."""
    out = {0: own}
    for k in range(1, servers):
        try:
            out[k] = rpc.rpc_sync(server_name(k), ps_server.rpc_version, timeout=10)
        except RuntimeError:
            pass
    return out


def _param_bytes_by_server(own: int, servers: int) -> dict[str, int]:
    """Every server's resident parameter bytes (server 0's given)."""
    out = {"0": own}
    for k in range(1, servers):
        out[str(k)] = rpc.rpc_sync(server_name(k), ps_server.rpc_param_bytes, timeout=60)
    return out


def _gathered_model(config: Config, servers: int, *, eval_ds, precision) -> torch.nn.Module:
    """The whole model with every server's current parameters, for an evaluation or the
    final save: built for the moment (its buffers initialised as the workers' are), each
    server's shard copied in as it arrives, dropped by the caller afterwards. Only the
    trainable parameters come from the servers: the rest (frozen parameters, buffers) is
    the workers' because `_fresh_net` draws it as they do."""
    model = _fresh_net(config, eval_ds, precision)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k in range(servers):
            shard = rpc.rpc_sync(server_name(k), ps_server.rpc_snapshot, timeout=60)
            for n, value in shard.items():
                params[n].copy_(value)
            del shard
    return model


def _evaluate(config: Config, servers: int, *, eval_ds, precision, loss_fn, model=None) -> dict:
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


def _finish(
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
    record = _evaluate(
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
            str(k): v for k, v in _versions(server.version, derived.ps.servers).items()
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
