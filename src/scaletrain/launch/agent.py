"""Start workers through PyTorch's elastic agent, the engine behind torchrun.

`scaletrain train cfg.toml --nproc 2` builds a torchrun command line, parses it with
torchrun's own parser (`torch.distributed.run.get_args_parser`) and hands the resulting
LaunchConfig to `elastic_launch`. Each worker runs `python -m scaletrain train ...` again;
it sees TORCHELASTIC_RUN_ID in its environment and trains instead of launching. So torchrun's
multi-node flags mean exactly what they mean to torchrun, and plain
`torchrun -m scaletrain train cfg.toml` works as well.

Platform traps handled here (shared/PLATFORM-NOTES.md):
- Restarts: with the rendezvous TCP store shared between agent and workers, about half of
  restarted attempts broke in init_process_group. We set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  so every attempt's workers get a fresh store.
- Start-up latency: with a fixed node count the rendezvous need not wait for late joiners, so
  `last_call_timeout` is set to 1 s instead of 30 s.
- Listeners: a single-node run binds nothing beyond loopback (LOOPBACK_ENV says how); a
  multi-node run exposes torch's stores on its rendezvous endpoint and MASTER_PORT.
- SLURM: when run inside an allocation (SLURM_JOB_ID set) and no node flags are given, the
  node count, node rank and rendezvous endpoint come from SLURM's environment.

What the user sees and what the logs keep (RUN_DIR/logs/rank-N.log, the console filter, the
failure paragraph, the interrupt line) is launch/output.py's concern; `launch` wires it in.

Hangs: a worker whose collective fails asks the launcher for the other workers' stacks
before it exits (launch/hang.py, `HangWatch`); the failure paragraph then says where each
rank was (`describe_hang`).

Signals:
- Ctrl-C / SIGTERM: torchrun's agent forwards the signal to the workers (SIGTERM: they save
  a checkpoint at the end of the step, see training/signals.py) and waits up to
  SCALETRAIN_SIGTERM_GRACE_S seconds (default 30) before killing them; `launch` then raises
  `Interrupted` and the CLI prints one line with the step, the last checkpoint and how to
  continue, and exits 128 + the signal number (130, 143).
- Workers die with the launcher (runtime.prepare_worker_process: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.launch.hang import HangWatch, describe_hang
from scaletrain.launch.output import ConsoleEcho, agent_log, describe_child_failure, run_dir_logs
from scaletrain.runtime import LAUNCHER_PID_ENV, MERGE_STREAMS_ENV
from scaletrain.runtime.hang import HANG_WATCH_ENV, enable_flight_recorder

SUBPROCESS_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", MERGE_STREAMS_ENV: "1"}
# A single-node run listens on loopback only. torchrun's c10d rendezvous keeps its state in a
# file (store_type=file: no listener at all); the workers are told MASTER_ADDR=127.0.0.1
# (--local-addr), where rank 0 binds the process group's store (runtime.loopback_store), and
# gloo's and NCCL's own sockets go on `lo` unless the user named an interface. A multi-node
# run keeps torch's defaults: the c10d store on --rdzv-endpoint's port and the process
# group's store on MASTER_PORT, both on every interface of their host, and gloo's and NCCL's
# sockets on the interface GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name (else the one the
# host name resolves to).
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
GRACE_ENV, DEFAULT_GRACE_S = "SCALETRAIN_SIGTERM_GRACE_S", 30


def grace_s() -> int:
    """Seconds the agent waits for workers after forwarding a signal before it kills them."""
    raw = os.environ.get(GRACE_ENV, "")
    if not raw:
        return DEFAULT_GRACE_S
    if not raw.isdigit() or int(raw) < 1:
        raise LaunchError(f"{GRACE_ENV} = {raw!r} is invalid: use a whole number of seconds >= 1")
    return int(raw)


class LaunchError(UserError):
    """A bad launcher flag; its message is shown as is."""


@dataclass(frozen=True)
class LaunchSpec:
    """The launcher flags, as torchrun names them."""

    nproc: int = 1
    nnodes: str = "1"
    node_rank: int = 0
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    max_restarts: int = 0
    monitor_interval: float = 0.1

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])

    @property
    def local_only(self) -> bool:
        """One node and no rendezvous endpoint: nothing need listen beyond loopback."""
        return self.max_nodes == 1 and not self.rdzv_endpoint

    @property
    def world_size(self) -> int:
        """Processes over all nodes (the upper bound for an elastic min:max range)."""
        return self.nproc * self.max_nodes

    @property
    def in_process(self) -> bool:
        """One process on one node: run right here, no agent."""
        return self.nproc == 1 and self.nnodes == "1" and self.max_restarts == 0


def validate_spec(spec: LaunchSpec) -> LaunchSpec:
    """Check launcher flags before anything starts; raise LaunchError naming the flag."""
    if spec.nproc < 1:
        raise LaunchError(f"--nproc = {spec.nproc} is invalid: must be >= 1")
    if not re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", spec.nnodes):
        raise LaunchError(f"--nnodes = {spec.nnodes!r} is invalid: use N or MIN:MAX with N >= 1")
    lo, hi = (int(x) for x in (spec.nnodes.split(":") * 2)[:2])
    if lo > hi:
        raise LaunchError(f"--nnodes = {spec.nnodes!r} is invalid: MIN must be <= MAX")
    if spec.max_restarts < 0:
        raise LaunchError(f"--max-restarts = {spec.max_restarts} is invalid: must be >= 0")
    if spec.node_rank < 0 or spec.node_rank >= hi:
        raise LaunchError(f"--node-rank = {spec.node_rank} is invalid: allowed 0..{hi - 1}")
    if spec.rdzv_backend not in ("c10d", "static", "etcd", "etcd-v2"):
        raise LaunchError(
            f"--rdzv-backend = {spec.rdzv_backend!r} is invalid: allowed c10d, static, etcd, etcd-v2"
        )
    if spec.rdzv_endpoint:
        port = re.fullmatch(r"[\w.\-\[\]:]+:(\d{1,5})", spec.rdzv_endpoint)
        if not port or not 1 <= int(port.group(1)) <= 65535:
            raise LaunchError(
                f"--rdzv-endpoint = {spec.rdzv_endpoint!r} is invalid: use HOST:PORT "
                "with a port in 1..65535"
            )
    if hi > 1 and not spec.rdzv_endpoint:
        raise LaunchError(
            f"--nnodes = {spec.nnodes} needs --rdzv-endpoint HOST:PORT (a node every node can "
            "reach), or run inside a SLURM allocation"
        )
    grace_s()  # SCALETRAIN_SIGTERM_GRACE_S: refused here rather than at launch
    return spec


def slurm_defaults(env: dict[str, str]) -> dict[str, object]:
    """Node flags from a SLURM allocation's environment (empty outside SLURM)."""
    if "SLURM_JOB_ID" not in env or "SLURM_NNODES" not in env:
        return {}
    nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "localhost"))
    host = env.get("MASTER_ADDR") or first_slurm_host(nodelist)
    port = env.get("MASTER_PORT", "29500")
    return {
        "nnodes": env["SLURM_NNODES"],
        "node_rank": int(env.get("SLURM_NODEID", "0")),
        "rdzv_endpoint": f"{host}:{port}",
        "rdzv_id": env["SLURM_JOB_ID"],
    }


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[03-05,07],cpu1' -> 'gpu03'."""
    first = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if first is None:
        return "localhost"
    prefix, ranges = first.group(1), first.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def torchrun_argv(
    spec: LaunchSpec,
    worker_args: list[str],
    *,
    log_dir: Path | None = None,
    debug: bool = False,
    rdzv_file: Path | None = None,
) -> list[str]:
    """The torchrun command line (without the program name) that starts the workers.

    Args:
        spec: validated launcher flags.
        worker_args: the `train ...` arguments each worker receives.
        log_dir: where each rank's stderr goes (--log-dir, --redirects 2); None: the console.
        debug: also copy every rank's output to the console (--tee 2).
        rdzv_file: a single-node run's rendezvous store, a file no one else uses
            (LOOPBACK_ENV); None: a temporary file torch makes and leaves behind.
    """
    argv = [
        f"--nproc-per-node={spec.nproc}",
        f"--nnodes={spec.nnodes}",
        f"--max-restarts={spec.max_restarts}",
        f"--monitor-interval={spec.monitor_interval}",
        f"--shutdown-timeout={grace_s()}",
    ]
    if log_dir is not None:
        argv += [f"--log-dir={log_dir}", "--redirects=2", f"--tee={2 if debug else 0}"]
    conf = []  # torchrun takes one --rdzv-conf, its pairs comma-separated
    if spec.local_only:  # see LOOPBACK_ENV
        argv += ["--rdzv-backend=c10d", "--local-addr=127.0.0.1"]
        argv.append(f"--rdzv-id=scaletrain-{os.getpid()}")
        argv += [f"--rdzv-endpoint={rdzv_file}"] if rdzv_file else []
        conf.append("store_type=file")
    else:
        argv += [
            f"--rdzv-backend={spec.rdzv_backend}",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--node-rank={spec.node_rank}",
        ]
        if spec.rdzv_id:
            argv.append(f"--rdzv-id={spec.rdzv_id}")
    if ":" not in spec.nnodes:  # fixed size: no reason to wait for late joiners
        conf.append("last_call_timeout=1")
    if conf:
        argv.append(f"--rdzv-conf={','.join(conf)}")
    return argv + ["-m", "scaletrain", *worker_args]


def under_elastic_agent() -> bool:
    """True inside a worker started by torchrun or by our own launcher."""
    return "TORCHELASTIC_RUN_ID" in os.environ


class Interrupted(Exception):
    """The launcher (or its workers) got SIGINT / SIGTERM / SIGHUP; the workers are gone."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def launch(
    spec: LaunchSpec,
    worker_args: list[str],
    *,
    threads: int,
    run_dir: Path,
    debug: bool = False,
    stall_s: float | None = None,
) -> int:
    """Run the workers through the elastic agent; return 0, or 1 with the failure described.

    Args:
        spec: validated launcher flags.
        worker_args: the `train ...` arguments each worker receives.
        threads: torch/OpenMP threads per worker (the workers set torch's; this sets OpenMP's).
        run_dir: the run directory; each rank's output goes to run_dir/logs/rank-N.log.
        debug: show every rank's output and torchrun's own log on the console, unfiltered.
        stall_s: parallel.timeout_s: when no rank finishes a step for this long, dump every
            rank's stack and say where each was (launch/hang.py); the run goes on.

    Raises:
        Interrupted: a signal stopped the run (after the workers have exited).
    """
    from torch.distributed.elastic.multiprocessing import SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import config_from_args, elastic_launch, get_args_parser

    log_dir = Path(run_dir) / "logs"
    started = time.time()  # a hang report reads only this launch's flight records
    os.environ.update(SUBPROCESS_ENV)
    os.environ[HANG_WATCH_ENV] = str(log_dir)  # where a worker asks for its peers' stacks
    enable_flight_recorder()
    if spec.local_only:
        for key, value in LOOPBACK_ENV.items():
            os.environ.setdefault(key, value)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    rdzv_dir = Path(tempfile.mkdtemp(prefix="scaletrain-rdzv-"))  # removed below
    args = get_args_parser().parse_args(
        torchrun_argv(spec, worker_args, log_dir=log_dir, debug=debug, rdzv_file=rdzv_dir / "store")
    )
    config, cmd, cmd_args = config_from_args(args)
    echo = None if debug else ConsoleEcho(sys.stderr)
    logs = run_dir_logs(
        log_dir, tee=Std.from_str(args.tee), on_attempt=echo.follow if echo else None
    )
    config.logs_specs = logs  # torchrun's hook for naming the log files
    failure, signum = None, None
    watch = HangWatch(log_dir, stall_s=stall_s, logs=lambda: logs.paths)
    try:
        agent_log_path = None if debug else log_dir / "launcher.log"
        with _signals_raise(SignalException), agent_log(agent_log_path):
            elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as e:
        failure = e
    except SignalException as e:  # the agent has stopped the workers before re-raising it
        signum = e.sigval
    except KeyboardInterrupt:  # Ctrl-C before the agent installed its handler
        signum = signal.SIGINT
    finally:
        watch.stop()
        os.environ.pop(HANG_WATCH_ENV, None)
        if echo is not None:
            echo.stop()
        shutil.rmtree(rdzv_dir, ignore_errors=True)
    if failure is not None:
        codes = {f.exitcode for f in failure.failures.values()}
        for sig in (signal.SIGTERM, signal.SIGINT):  # the workers were signalled directly
            if codes <= {128 + sig, -sig}:
                signum = sig
    if signum is not None:
        raise Interrupted(signum)
    if failure is not None:
        hang = describe_hang(log_dir, logs.paths, since=started)
        print(describe_child_failure(failure, logs=logs.paths, hang=hang), file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def _signals_raise(exception: type) -> Iterator[None]:
    """Until the agent installs its own handlers (when the workers start), SIGTERM and SIGHUP
    raise torch's SignalException like the agent's handler does, instead of killing us
    (SIGINT raises KeyboardInterrupt by itself)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise exception(
            f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum)
        )

    # The agent's handlers replace these and stay after it returns: restore all four.
    old = {
        s: signal.getsignal(s)
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)
    }
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
