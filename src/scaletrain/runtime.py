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
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


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
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    return device


def set_threads(threads: int) -> None:
    """Torch intra-op threads for this process (cores / processes on the node by default)."""
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) identically on every rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over all ranks; a no-op in a single process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
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
        s in text for s in ("Gloo", "gloo", "Connection closed by peer", "Timed out waiting", "NCCL")
    )


def missing_ranks(*, tag: str, wait_s: float = 3.0) -> list[int] | None:
    """After a failed collective, find the ranks that did not report in.

    Every surviving rank writes `failed/<tag>/<rank>` into the rendezvous store, then waits
    up to `wait_s` for the others. Ranks that never write are dead or hung. Returns None when
    the store itself is unreachable (its host, rank 0, is gone).
    """
    if not dist.is_initialized():
        return []
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"failed/{tag}/{rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            present = [r for r in range(world) if store.check([f"failed/{tag}/{r}"])]
            if len(present) == world or time.monotonic() > deadline:
                return [r for r in range(world) if r not in present]
            time.sleep(0.1)
    except Exception:  # the store's host died with its rank: we cannot tell more
        return None


def describe_collective_failure(error: BaseException, *, operation: str, step: int) -> str:
    """One message for a failed collective: which operation, which step, which ranks."""
    missing = missing_ranks(tag=f"step{step}")
    if missing is None:
        who = "rank 0 (which hosts the rendezvous store) is unreachable"
    elif missing:
        who = f"rank(s) {', '.join(map(str, missing))} did not arrive (died or hung)"
    else:
        who = "every rank reported in, so the failure is in the transport"
    first_line = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    return (
        f"collective '{operation}' at step {step} could not complete: {who}. "
        f"Backend said: {first_line}"
    )


def exit_worker(code: int) -> None:
    """Leave a worker process without the gloo shutdown abort: flush, destroy, _exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    os._exit(code)


@contextlib.contextmanager
def collective_guard(operation: str, *, step: int) -> Iterator[None]:
    """Turn a failed or timed-out collective inside the block into a CollectiveFailure
    whose message names the operation, the step and the ranks that did not arrive."""
    try:
        yield
    except Exception as e:
        if is_collective_error(e):
            raise CollectiveFailure(describe_collective_failure(e, operation=operation, step=step)) from None
        raise


def broadcast_object(obj: object) -> object:
    """Rank 0's value of `obj` on every rank (itself in a single process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
