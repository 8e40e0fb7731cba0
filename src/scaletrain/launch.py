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
- SLURM: when run inside an allocation (SLURM_JOB_ID set) and no node flags are given, the
  node count, node rank and rendezvous endpoint come from SLURM's environment.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

SUBPROCESS_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class LaunchError(ValueError):
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
            f"--rdzv-backend = {spec.rdzv_backend!r} is invalid: allowed c10d, static, etcd, etcd-v2")
    if spec.rdzv_endpoint:
        port = re.fullmatch(r"[\w.\-\[\]:]+:(\d{1,5})", spec.rdzv_endpoint)
        if not port or not 1 <= int(port.group(1)) <= 65535:
            raise LaunchError(f"--rdzv-endpoint = {spec.rdzv_endpoint!r} is invalid: use HOST:PORT "
                              "with a port in 1..65535")
    if hi > 1 and not spec.rdzv_endpoint:
        raise LaunchError(
            f"--nnodes = {spec.nnodes} needs --rdzv-endpoint HOST:PORT (a node every node can "
            "reach), or run inside a SLURM allocation")
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


def torchrun_argv(spec: LaunchSpec, worker_args: list[str]) -> list[str]:
    """The torchrun command line (without the program name) that starts the workers."""
    argv = [f"--nproc-per-node={spec.nproc}", f"--nnodes={spec.nnodes}",
            f"--max-restarts={spec.max_restarts}", f"--monitor-interval={spec.monitor_interval}"]
    if spec.max_nodes == 1 and not spec.rdzv_endpoint:
        # torchrun's --standalone: a private c10d store on a free local port.
        argv += ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
                 f"--rdzv-id=scaletrain-{os.getpid()}"]
    else:
        argv += [f"--rdzv-backend={spec.rdzv_backend}", f"--rdzv-endpoint={spec.rdzv_endpoint}",
                 f"--node-rank={spec.node_rank}"]
        if spec.rdzv_id:
            argv.append(f"--rdzv-id={spec.rdzv_id}")
    if ":" not in spec.nnodes:  # fixed size: no reason to wait for late joiners
        argv.append("--rdzv-conf=last_call_timeout=1")
    return argv + ["-m", "scaletrain", *worker_args]


def under_elastic_agent() -> bool:
    """True inside a worker started by torchrun or by our own launcher."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def launch(spec: LaunchSpec, worker_args: list[str], *, threads: int) -> int:
    """Run the workers through the elastic agent; return 0, or 1 with the failure described.

    Args:
        spec: validated launcher flags.
        worker_args: the `train ...` arguments each worker receives.
        threads: torch/OpenMP threads per worker (the workers set torch's; this sets OpenMP's).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import config_from_args, elastic_launch, get_args_parser

    os.environ.update(SUBPROCESS_ENV)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    args = get_args_parser().parse_args(torchrun_argv(spec, worker_args))
    config, cmd, cmd_args = config_from_args(args)
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as e:
        print(describe_child_failure(e), file=sys.stderr)
        return 1
    return 0


def describe_child_failure(error) -> str:
    """Name every failed rank: its exit code or the signal that killed it."""
    lines = ["scaletrain: the run failed:"]
    for rank, failure in sorted(error.failures.items()):
        if failure.exitcode < 0:
            import signal

            try:
                what = f"was killed by {signal.Signals(-failure.exitcode).name}"
            except ValueError:
                what = f"was killed by signal {-failure.exitcode}"
        else:
            what = f"exited with code {failure.exitcode}"
        lines.append(f"  rank {rank} (pid {failure.pid}, local rank {failure.local_rank}) {what}")
    return "\n".join(lines)
