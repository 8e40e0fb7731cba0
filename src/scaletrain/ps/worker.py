"""A parameter-server worker: pull, compute a gradient on its own data, push, repeat.

    join every server (in parallel) -> load their parameters -> for each step:
        micro-batches of this worker's share -> forward/backward (precision, accumulation)
        -> clip -> [straggler sleep] -> push each server its part of the gradient (in
        parallel) -> each answers with its parameters for the next step -> load them

Data: the worker reads its share of every global step, as a data-parallel rank does
(`GlobalBatchSampler` with dp_rank = worker, dp_size = workers): disjoint between workers,
and together the whole global order. Under sync, W workers therefore see exactly what W DDP
ranks see, step by step.

Normalisation: a worker's gradient is that of the mean loss over its own examples of the
step (its micro-batches' summed losses over its count: training/step.py's
`accumulate_gradients` with dp = 1); the servers apply it alone (async, ssp: clipped by the
worker) or average the workers' by count and clip the average (sync, as DDP does).

Liveness: a heartbeat thread renews the worker's lease on server 0 (the one that decides
membership for all servers) every lease/4 seconds, so a long step does not look like a dead
worker; a SIGSTOPped process stops sending and is declared dead. Every call carries a
timeout (a stopped server would otherwise never answer). A heartbeat thread that raises
(ps/threads.py) would let a worker with long steps be declared dead for nothing: the
worker raises its failure after the step instead, and ps/run.py ends the run naming it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed.rpc as rpc

from scaletrain.data.loader import Dataset
from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.data.sources import Batch
from scaletrain.loss import LossFn
from scaletrain.precision import Precision
from scaletrain.ps import endpoints
from scaletrain.ps.messages import Push, Read, Reply
from scaletrain.ps.threads import ThreadFailed
from scaletrain.ps.threads import start as start_thread
from scaletrain.training.step import accumulate_gradients, clip_gradients


class ServerLost(RuntimeError):
    """A server stopped answering; the message names it."""


@dataclass
class WorkerOutcome:
    status: str  # "done", "stop" or "refused"
    steps_done: int  # this worker's clock when it left
    last_loss: float


def server_name(k: int) -> str:
    return f"ps-server-{k}"


def worker_name(w: int) -> str:
    return f"ps-worker-{w}"


def gradient(
    model: torch.nn.Module,
    micro_batches: list[Batch],
    *,
    precision: Precision,
    loss_fn: LossFn,
    grad_clip: float,
) -> tuple[list[torch.Tensor] | None, float, int]:
    """This worker's gradient for one step: (gradients by parameter, or None if non-finite;
    summed loss; count).

    training/step.py's own code: `accumulate_gradients` with dp_size = 1 (the gradient of
    the sum of the step's losses over their count, accumulated over the micro-batches),
    then `clip_gradients`. grad_clip is the worker's own clip under async and ssp (its
    gradient alone is an update); under sync it is 0 and the servers clip the average, as
    DDP does (ps/server.py).
    """
    loss_sum, count = accumulate_gradients(
        model, micro_batches, precision=precision, dp_size=1, ragged_counts=False, loss_fn=loss_fn
    )
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    _, finite = clip_gradients(grads, grad_clip=grad_clip)
    if not finite:  # every server is told None: none applies any of it
        model.zero_grad(set_to_none=True)
        return None, float(loss_sum), count
    grads = [g.detach().clone() for g in grads]
    model.zero_grad(set_to_none=True)
    return grads, float(loss_sum), count


class _Heartbeat:
    """Renews this worker's lease until stopped; on server 0 alone, which decides who is
    alive for every server (ps/server.py)."""

    def __init__(self, worker: int, *, lease_s: float) -> None:
        self.worker, self.lease_s = worker, lease_s
        self.refused = threading.Event()
        self.failure: ThreadFailed | None = None
        self._stop = threading.Event()
        self._thread = start_thread(
            self._run, name=f"ps-worker-{worker}-heartbeat", on_failure=self._failed
        )

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                renewed = rpc.rpc_async(
                    server_name(0),
                    endpoints.rpc_heartbeat,
                    args=(self.worker,),
                    timeout=self.lease_s,
                ).wait()
            except RuntimeError:  # server 0 gone, or RPC going down: the next push says so
                continue
            if not renewed:
                self.refused.set()

    def _failed(self, failed: ThreadFailed) -> None:
        self.failure = failed

    def check(self) -> None:
        """Raise the heartbeat thread's failure, if it failed."""
        if self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        self._stop.set()


def run_worker(
    model: torch.nn.Module,
    *,
    worker: int,
    partition: list[list[str]],
    sampler: GlobalBatchSampler,
    train_ds: Dataset,
    loss_fn: LossFn,
    precision: Precision,
    grad_clip: float,
    device: torch.device,
    timeout_s: float,
    lease_s: float,
    seed: int = 0,
) -> WorkerOutcome:
    """Train as worker `worker` until the servers say done, stop or refused.

    Args:
        model: this worker's copy (its parameters are overwritten by the servers').
        worker: this worker's number (0 .. workers-1).
        partition: each server's parameter names (ps/partition.py), the order of its tensors.
        sampler: the global order; this worker's share is its dp_rank.
        train_ds, loss_fn, precision: as in training.
        grad_clip: max norm of this worker's gradient (async, ssp); 0 disables clipping
            (sync: the servers clip the averaged gradient).
        device: where the model runs.
        timeout_s: how long a push may wait for its answer (ssp, sync and checkpoints park).
        lease_s: ps.worker_timeout_s; heartbeats go out every lease_s / 4.
        seed: train.seed; the RNG (dropout) is reseeded from (seed, worker, step) before
            every step, so a resumed worker draws what it would have drawn (no RNG state).
    """
    params = dict(model.named_parameters())
    shards = [[params[n] for n in names] for names in partition]
    order = [n for n, p in params.items() if p.requires_grad]  # `gradient`'s order
    positions = [[order.index(n) for n in names] for names in partition]
    replies = _all(
        rpc.rpc_async(server_name(k), endpoints.rpc_join, args=(worker,), timeout=timeout_s)
        for k in range(len(partition))
    )
    heartbeat = _Heartbeat(worker, lease_s=lease_s)
    last_loss, step = float("nan"), replies[0].step
    try:
        while all(r.status == "go" for r in replies):
            _load(shards, replies)
            step = replies[0].step
            started = time.perf_counter()
            torch.manual_seed(hash((seed, worker, step)) % 2**63)  # ints hash the same everywhere
            micro = [train_ds.get(idx).to(device) for idx in sampler.micro_batches(step)]
            grads, loss_sum, count = gradient(
                model, micro, precision=precision, loss_fn=loss_fn, grad_clip=grad_clip
            )
            examples = sum(len(mb.targets) for mb in micro)
            rate = examples / max(time.perf_counter() - started, 1e-9)
            last_loss = loss_sum / max(count, 1)
            replies = _all(
                rpc.rpc_async(
                    server_name(k),
                    endpoints.rpc_push,
                    args=(
                        Push(
                            worker=worker,
                            step=step,
                            grads=None if grads is None else [grads[i] for i in positions[k]],
                            read=replies[k].read,
                            loss_sum=loss_sum,
                            count=count,
                            examples=examples,
                            examples_per_s=rate,
                        ),
                    ),
                    timeout=timeout_s,
                )
                for k in range(len(partition))
            )
            step += 1
            heartbeat.check()  # a dead heartbeat ends the run now, not when a lease runs out
            if heartbeat.refused.is_set():
                break
    finally:
        heartbeat.stop()
    status = (
        "refused"
        if heartbeat.refused.is_set() or any(r.status == "refused" for r in replies)
        else replies[0].status
    )
    # Every server at once (best effort: one that is gone cannot be told): a server whose
    # sync step completes without this worker waits for the others to do the same.
    goodbyes = [
        rpc.rpc_async(server_name(k), endpoints.rpc_leave, args=(worker,), timeout=lease_s)
        for k in range(len(partition))
    ]
    for call in goodbyes:
        try:
            call.wait()
        except RuntimeError:
            pass
    return WorkerOutcome(status=status, steps_done=step, last_loss=last_loss)


def _all(calls) -> list[Reply]:
    """Wait for every call; a server that does not answer becomes ServerLost naming it."""
    calls = list(calls)
    out = []
    for k, call in enumerate(calls):
        try:
            out.append(call.wait())
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ServerLost(f"parameter server {k} (rank {k}) did not answer: {first}") from e
    return out


@torch.no_grad()
def _load(shards: list[list[torch.nn.Parameter]], replies: list[Reply]) -> None:
    for params, reply in zip(shards, replies):
        for p, t in zip(params, reply.tensors):
            p.copy_(t)


__all__ = [
    "Read",
    "ServerLost",
    "ThreadFailed",
    "WorkerOutcome",
    "gradient",
    "run_worker",
    "server_name",
    "worker_name",
]
