"""Process-level runtime: who am I, the process group, threads, seeds, and clean exit.

Everything here collapses to one process: with world size 1 no process group is created
and no collective runs, so the same train step runs in a test, a notebook or `--nproc 1`.

Two platform traps (shared/PLATFORM-NOTES.md) are handled here:
- A collective that cannot complete: the process group is created with the configured
  timeout; when a collective fails, `missing_ranks` asks the rendezvous store which ranks
  did not report in, so the message names them instead of a bare gloo error.
- Ranks can abort at interpreter shutdown ("terminate called without an active
  exception", a gloo thread freeing work late). Workers leave through `exit_worker`, which
  destroys the group and calls `os._exit` once every file is flushed.

A worker started by scaletrain's launcher also calls `prepare_worker_process` first: it dies
with the launcher (`kill -9` of the launcher must not leave workers training unsupervised)
and writes stdout and stderr, in order, into one log file (RUN_DIR/logs/rank-N.log).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from scaletrain.runtime import hang

# Set by the launcher (launch/agent.py) for its workers, read by them in prepare_worker_process.
LAUNCHER_PID_ENV = "SCALETRAIN_LAUNCHER_PID"  # a worker dies when this process does
MERGE_STREAMS_ENV = "SCALETRAIN_MERGE_STREAMS"  # "1": a worker points stdout at its stderr log


@dataclass(frozen=True)
class ProcessEnv:
    """This process's place in the world, as torchrun (or nothing) describes it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_env() -> ProcessEnv:
    """Read RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, set by torchrun's elastic agent."""
    env = os.environ
    return ProcessEnv(
        rank=int(env.get("RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1))),
    )


def init_distributed(penv: ProcessEnv, *, backend: str, timeout_s: float) -> torch.device:
    """Join the process group (world size > 1) and return this rank's device.

    Args:
        penv: this process's place in the world.
        backend: "gloo" or "nccl".
        timeout_s: after this many seconds a pending collective raises instead of hanging.
    """
    if backend == "nccl":
        device = torch.device("cuda", penv.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if penv.world_size > 1 and not dist.is_initialized():
        hang.enable_flight_recorder()  # read when the group starts: its record of collectives
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,
            store=loopback_store(penv, timeout=timeout),
            rank=penv.rank,
            world_size=penv.world_size,
        )
    return device


def loopback_store(penv: ProcessEnv, *, timeout: timedelta) -> dist.TCPStore | None:
    """The process group's store on MASTER_ADDR:MASTER_PORT when that is a loopback address
    (a single-node launch), else None: init_process_group's own env:// store.

    torch's TCPStore listens on every interface whatever host it is given; a single-node run
    must expose nothing off the machine, so rank 0 binds the listening socket to the
    loopback address itself and hands it over. Under an agent that shares its own store with
    its workers (plain torchrun), the workers are its clients and None is returned.
    """
    env = os.environ
    address = env.get("MASTER_ADDR", "")
    if (
        penv.world_size == 1
        or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        or not is_loopback(address)
    ):
        return None
    return tcp_store_on(
        address,
        int(env["MASTER_PORT"]),
        world_size=penv.world_size,
        is_master=penv.rank == 0,
        timeout=timeout,
    )


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 or "localhost"."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def tcp_store_on(
    address: str, port: int, *, world_size: int, is_master: bool, timeout: timedelta
) -> dist.TCPStore:
    """A TCPStore whose server (is_master) listens on `address` only, not on every interface
    as TCPStore binds by itself: the socket is bound here and its descriptor handed over."""
    host = "127.0.0.1" if address == "localhost" else address.strip("[]")
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    # detach(): the store now owns the descriptor; the Python socket must not close it.
    return dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def prepare_worker_process() -> None:
    """First thing in a worker started by scaletrain's launcher (a no-op elsewhere).

    - Dies with the launcher: prctl(PR_SET_PDEATHSIG, SIGKILL), so a `kill -9` of the
      launcher (which cannot forward anything) does not leave workers running unsupervised.
      If the launcher is already gone by the time this runs, exit at once.
    - The launcher redirects this process's stderr into RUN_DIR/logs/rank-N.log (torchrun's
      --redirects); stdout is pointed at the same file, so the log holds the rank's whole
      output in the order it was written, and starts with one line saying who wrote it.
    - SIGUSR1 dumps this rank's Python stacks into that log, then its Flight Recorder record
      (runtime/hang.py): what a hang report is made of.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            print(
                f"scaletrain: warning: prctl(PR_SET_PDEATHSIG) failed: "
                f"{os.strerror(ctypes.get_errno())}; this worker will outlive a killed "
                "launcher",
                file=sys.stderr,
                flush=True,
            )
        if os.getppid() != int(launcher):  # the launcher died before prctl took effect
            os._exit(143)
    if os.environ.get(MERGE_STREAMS_ENV) == "1":
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        penv = read_env()
        print(
            f"# scaletrain worker: rank {penv.rank} of {penv.world_size} (local rank "
            f"{penv.local_rank}), pid {os.getpid()}, host {os.uname().nodename}, "
            f"torch {torch.__version__}, started {time.strftime('%Y-%m-%d %H:%M:%S')}",
            file=sys.stderr,
            flush=True,
        )
    hang.install()  # after the streams are merged: the stacks go into the rank's log


@contextlib.contextmanager
def written_atomically(path: os.PathLike | str) -> Iterator[Path]:
    """A temporary name beside `path` to write a file or a directory at; it takes `path`'s
    place only when the block ends, so a crash or an error mid-write leaves an existing
    `path` whole (and no half-written one behind). Removed if the block raises.

    A file is renamed over the old one (atomic). A directory cannot be renamed over a
    non-empty one: the old one is renamed aside first, then removed, so for that instant
    the old directory exists, whole, under the name `.NAME.old-PID`.
    """
    import shutil

    def remove(p: Path) -> None:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)

    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    remove(tmp)  # this process's own, from an earlier attempt
    remove(old)
    try:
        yield tmp
        if tmp.is_dir() and path.is_dir():
            os.rename(path, old)
            os.rename(tmp, path)
            remove(old)
        else:
            os.replace(tmp, path)
    finally:
        remove(tmp)


def honour_umask(path: os.PathLike | str) -> None:
    """Give a finished output file the mode a new file gets (0666 minus the umask).

    safetensors writes its files with mode 0600; weights are meant to be read by others.
    """
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    # Read, not set-and-restore: os.umask(0) would briefly apply to files other threads create.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)  # no /proc: the classic way
    os.umask(umask)
    return umask


def set_threads(threads: int) -> None:
    """Torch intra-op threads for this process (cores / processes on the node by default)."""
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) identically on every rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def all_reduce_sum(tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place sum over the ranks of `group` (None: all ranks); a no-op in a single process."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_min(tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place element-wise minimum over the ranks of `group`; a no-op in a single process."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return tensor


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class CollectiveFailure(RuntimeError):
    """A collective could not complete; the message names the operation and missing ranks."""


def is_collective_error(error: BaseException) -> bool:
    """Errors raised by a failed or timed-out collective (gloo and NCCL)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text
        for s in ("Gloo", "gloo", "Connection closed by peer", "Timed out waiting", "NCCL")
    )


def missing_ranks(*, tag: str, wait_s: float = 3.0) -> list[int] | None:
    """After a failed collective, find the ranks that did not report in.

    Every surviving rank writes `failed/<tag>/<rank>` into the rendezvous store, then waits
    up to `wait_s` for the others. Ranks that never write are dead or hung. Returns None when
    the store itself is unreachable (its host, rank 0, is gone); any other store failure
    (e.g. its own timeout) is raised as the DistError it is.
    """
    if not dist.is_initialized():
        return []
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    try:
        store.set(f"failed/{tag}/{rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            present = [r for r in range(world) if store.check([f"failed/{tag}/{r}"])]
            if len(present) == world or time.monotonic() > deadline:
                return [r for r in range(world) if r not in present]
            time.sleep(0.1)
    except (dist.DistNetworkError, ConnectionError):  # refused, reset, broken pipe
        return None  # the store's host died (rank 0, or the agent under plain torchrun)


def describe_collective_failure(error: BaseException, *, operation: str, step: int) -> str:
    """One message for a failed collective: which operation, which step, which ranks."""
    try:
        missing = missing_ranks(tag=f"step{step}")
    except dist.DistError as e:  # the store answered, but not usefully (e.g. its own timeout)
        who = (
            f"the ranks that did not arrive could not be found, as the rendezvous store "
            f"failed too ({type(e).__name__}: {_first_line(e)})"
        )
    else:
        if missing is None:
            who = "rank 0 (which hosts the rendezvous store) is unreachable"
        elif missing:
            who = f"rank(s) {', '.join(map(str, missing))} did not arrive (died or hung)"
        else:
            who = "every rank reported in, so the failure is in the transport"
    return (
        f"collective '{operation}' at step {step} could not complete: {who}. "
        f"Backend said: {_first_line(error)}"
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def exit_worker(code: int) -> None:
    """Leave a worker process without the gloo shutdown abort: flush, destroy, _exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError as e:  # the group broke with a peer; expected after a failure
            if code == 0:
                print(
                    f"scaletrain: warning: destroy_process_group failed after a clean run: "
                    f"{_first_line(e)}",
                    file=sys.stderr,
                    flush=True,
                )
    os._exit(code)


@contextlib.contextmanager
def collective_guard(operation: str, *, step: int) -> Iterator[None]:
    """Turn a failed or timed-out collective inside the block into a CollectiveFailure
    whose message names the operation, the step and the ranks that did not arrive.

    First the hang report's part of this rank (runtime/hang.py): its stack and Flight
    Recorder record into the logs, and, under scaletrain's launcher, the other ranks' too,
    before any rank is stopped.
    """
    try:
        yield
    except Exception as e:
        if is_collective_error(e):
            hang.on_collective_failure(e, operation=operation, step=step)
            # Chained, not hidden: the message says what failed, __cause__ keeps what gloo said.
            message = describe_collective_failure(e, operation=operation, step=step)
            raise CollectiveFailure(message) from e
        raise


def broadcast_object(obj: object) -> object:
    """Rank 0's value of `obj` on every rank (itself in a single process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
