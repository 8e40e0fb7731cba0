"""What a worker and a parameter server send each other over RPC (pickled by TensorPipe:
plain dataclasses of tensors and numbers), and what a server reports of each update."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Read:
    """Which parameters a gradient was computed on: the server's version when they were
    read, and the slowest live worker's clock then."""

    version: int
    slowest: int


@dataclass
class Reply:
    """A server's answer to a worker.

    status: "go" (tensors: the parameters for `step`), "done" (all steps applied), "stop"
    (a planned stop after a checkpoint), "refused" (declared dead: leave).
    """

    status: str
    step: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    read: Read = Read(0, 0)


@dataclass(frozen=True)
class Push:
    """One worker's gradient for one step, and what it says about itself."""

    worker: int
    step: int
    grads: list[torch.Tensor] | None  # in the server's names' order; None: non-finite
    read: Read
    loss_sum: float  # summed loss over the worker's examples in the step
    count: int  # the loss's normaliser (examples or target tokens)
    examples: int
    examples_per_s: float  # the worker's own rate over its last step (compute + waits)


@dataclass(frozen=True)
class Update:
    """What applying (or collecting) one gradient did, for the metrics."""

    push: Push
    staleness: int  # clock.py's staleness_of
    delay: int  # server updates applied between the read and this one
    version: int  # the server's version after it
    applied: bool  # False: a non-finite gradient, skipped
