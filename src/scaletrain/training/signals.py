"""Stop signals in a worker: SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C).

torchrun's agent forwards the signal it receives to every worker. What a worker does:

- SIGINT: Python's KeyboardInterrupt, at once; the CLI turns it into exit status 130.
- SIGTERM with checkpointing on (checkpoint.every > 0): the handler only sets a flag. The
  loop asks `stop_requested()` after every step (trainer `_checkpoint_or_stop`); when it
  says yes, every rank saves a checkpoint of that step and leaves with status 143. The
  launcher waits SCALETRAIN_SIGTERM_GRACE_S seconds (default 30, launch/agent.py) for that,
  then kills the workers; a save cut short leaves only a `.tmp-` directory, so the
  previous checkpoint stays the newest valid one.
- SIGTERM without checkpointing, or a second SIGTERM: `Terminated` is raised at once.

Every rank must stop after the same step, or one rank would enter the checkpoint's
collectives while another runs the next step's all-reduce. The signal reaches the ranks at
slightly different times, so the local flags are combined: after each step every rank
starts a non-blocking all-reduce (MAX) of its flag and reads the one it started a step
earlier, which finished long ago. All ranks read the same collective, so they agree; the
price is one step of delay and a 4-byte message overlapped with the next step.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


class Terminated(BaseException):
    """SIGTERM where no checkpoint is to be saved; a BaseException like KeyboardInterrupt."""


@dataclass
class _State:
    save_on_term: bool = False  # checkpointing is on: SIGTERM asks for a save
    requested_at: float | None = None  # when this process got SIGTERM (monotonic)
    agreed: bool = False  # every rank has seen a stop request (or this one, in one process)
    stopped: bool = False  # the loop saved and stopped because of it
    pending: tuple[dist.Work, torch.Tensor] | None = None  # last step's flag all-reduce


_state = _State()


@contextlib.contextmanager
def installed(*, save_on_term: bool) -> Iterator[None]:
    """Handle SIGTERM in this process while the block runs (main thread only).

    Args:
        save_on_term: True when checkpointing is on: SIGTERM then asks the loop to save and
            stop after the current step; else SIGTERM raises `Terminated` at once.
    """
    global _state
    _state = _State(save_on_term=save_on_term)
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach only the main thread; nothing to handle here
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _on_sigterm(signum, frame) -> None:
    if not _state.save_on_term or _state.requested_at is not None:
        raise Terminated()  # nothing to save, or asked twice: leave now
    _state.requested_at = time.monotonic()


def stop_requested() -> bool:
    """Whether the ranks have agreed to stop after this step; call once per step on all ranks."""
    if not _state.save_on_term:
        return False
    local = _state.requested_at is not None
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        _state.agreed = local
        return local
    if _state.pending is not None:  # the flags as they were one step ago, on every rank
        work, flag = _state.pending
        work.wait()
        _state.agreed = bool(flag.item())
    flag = torch.tensor([int(local)], dtype=torch.int32)
    _state.pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
    return _state.agreed


def drain() -> None:
    """Wait for the last flag all-reduce, so no collective is left pending at exit."""
    if _state.pending is not None:
        work, _ = _state.pending
        _state.pending = None
        work.wait()


def mark_stopped() -> None:
    """The loop has saved and stopped because of SIGTERM."""
    _state.stopped = True


def stopped_by_sigterm() -> bool:
    """True once the loop has saved and stopped because of SIGTERM."""
    return _state.stopped
