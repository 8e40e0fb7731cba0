"""One parameter server: a shard of the parameters, its optimizer, the workers' clocks.

Workers call it over torch.distributed.rpc, through the module-level `rpc_*` functions at
the bottom, which route to this process's server. One call per step and server:
`rpc_push` applies (under sync: collects) a worker's gradient and answers with the
parameters for its next step once the mode's rule lets it go on (clock.py). An answer that
must wait is parked as a torch Future (`rpc.functions.async_execution`): no RPC thread is
held while a worker waits, so a small thread pool cannot deadlock.

Membership has one authority, server 0 (`authority=True`): only it keeps leases (every
push and heartbeat to it renews the worker's), and a watcher thread there declares a worker
dead when its lease is older than `lease_s`. Server 0 then tells every other server
(`announce` -> `rpc_membership`), so that all of them refuse the worker's later messages
(a SIGSTOPped worker that wakes up is told so and leaves) and none applies a gradient the
others refuse. A worker that leaves (done, stopped, refused) tells every server itself, and
server 0 tells them again (a worker killed half-way through its goodbyes). Neither a dead
nor a departed worker is live: sync, ssp and the checkpoint cut stop waiting for it, and
under sync a dead worker's gradient still waiting for its step is dropped on every server.

Sync steps are applied by one thread per server (`_apply_sync_steps`), which first agrees
with the other servers on whose gradients every one of them holds (`reduce_min` over a
mask of workers: an all-reduce over the servers' gloo group) and applies the mean of those
alone. A worker stopped between its pushes of one step to two servers has its gradient on
one and not the other: the one holding it may complete the step at once, the other only
once server 0 has declared the worker dead; the agreement then leaves that gradient out on
both, so the shards stay one model. The collectives run on that thread, off the lock and
off the lease watcher: a server waiting in one for another server must still be able to
declare the stopped worker dead, or the two wait for each other (seen: a gloo timeout).

Sync clips like DDP: the mean gradient of the step, not each worker's. Each server holds a
shard, so the servers sum their shards' squared norms (`reduce_squares`: an all-reduce over
their gloo group) and each scales its shard by the same min(1, grad_clip / norm).

The LR schedule follows examples applied (`schedule_examples` per schedule step), not
updates: under sync with a worker dead an update is a fraction of a global step, and
counting updates would end the schedule early.

The checkpoint cut is decided by server 0 too: once every live worker waits for its answer,
it tells the others (`tell_cut` -> `rpc_cut`) the step and how many examples it has applied;
each waits until it has applied as many (gradients still in flight) and all write the step
together.

Threads: the RPC agent's pool runs the handlers; the lease watcher (server 0); the sync
applier (sync); one Condition guards the state. The two background threads are started by
ps/threads.py: one that raises fails the server (`_thread_failed`), which answers every
waiting worker with the error and ends `wait_until_done` with it, instead of leaving the
workers to wait for a step or a death that never comes.
Heartbeats only write a timestamp (atomic under the GIL) and take no lock, so a checkpoint
written under the lock does not make the workers waiting for it look dead.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable

import torch

from scaletrain.ps.clock import Clocks, may_start, staleness_of
from scaletrain.ps.messages import Push, Read, Reply, Update
from scaletrain.ps.threads import ThreadFailed
from scaletrain.ps.threads import start as start_thread
from scaletrain.training.grad_norm import clip_grads_, global_grad_norm


class ParameterServer:
    """The state and rules of one server; rpc_* below call its methods.

    Args:
        index: this server's number (its rank).
        params: the parameters it holds, by name (the order the workers send gradients in).
        optimizer, scheduler: over exactly those parameters ([optim]).
        workers: how many workers there are (0 .. workers-1).
        mode: "async", "ssp" or "sync".
        staleness: ssp's bound in steps.
        inverse_lr: scale each update's learning rate by 1 / (1 + its delay).
        lease_s: a worker not heard from for this long is declared dead.
        join_s: how long a worker may take to first call in.
        steps: the run's length in global steps (train.steps): it is done once steps x
            global_batch examples are applied, however many steps each worker took.
        global_batch: examples per global step (train.global_batch).
        start_step: the global step the run starts at (a resumed checkpoint's).
        start_clocks: each worker's clock at the start (a checkpoint's; default start_step).
        start_examples: examples applied before the start (default start_step x global_batch).
        checkpoint_every: save at every multiple of this global step (0: never).
        stop_after: save and tell the workers to stop at this global step (0: never).
        save: writes a checkpoint of global step N; called under the lock at a consistent
            cut (every live worker waiting on server 0, so every server holds the same
            gradients): on server 0 when it sees that, on the others when told (`cut`).
        on_update: told of every gradient applied or skipped, under the lock.
        report: where one-line messages go (a worker declared dead).
        authority: this server decides membership (server 0): it keeps the leases.
        announce: the authority's messenger to the other servers, called off the lock with
            (worker, why it died) or (worker, None) when it left; it must not wait for them.
        grad_clip: sync only: max global norm of the step's mean gradient; 0: no clipping.
        reduce_squares: sums a float64 scalar over every server (identity for one server).
        reduce_min: sync only: the element-wise minimum of an int64 tensor over every server
            (identity for one server): which workers' gradients every server holds.
        schedule_examples: examples per step of the LR schedule (default global_batch).
        tell_cut: the authority's messenger for a checkpoint: called under the lock with
            (global step, examples applied) just before it saves; it starts the other
            servers' part of the save (`cut`) and returns their calls' futures.
    """

    def __init__(
        self,
        *,
        index: int,
        params: dict[str, torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        workers: int,
        mode: str,
        staleness: int,
        inverse_lr: bool,
        lease_s: float,
        join_s: float,
        steps: int,
        global_batch: int,
        start_step: int,
        checkpoint_every: int,
        stop_after: int,
        start_clocks: list[int] | None = None,
        start_examples: int | None = None,
        save: Callable[[int], None],
        on_update: Callable[[Update], None],
        report: Callable[[str], None] = print,
        authority: bool = True,
        announce: Callable[[int, str | None], None] | None = None,
        grad_clip: float = 0.0,
        reduce_squares: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        reduce_min: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        schedule_examples: int | None = None,
        tell_cut: Callable[[int, int], list] | None = None,
    ) -> None:
        self.index, self.names, self.params = index, list(params), list(params.values())
        self.optimizer, self.scheduler = optimizer, scheduler
        self.mode, self.staleness, self.inverse_lr = mode, staleness, inverse_lr
        self.lease_s, self.steps, self.global_batch = lease_s, steps, global_batch
        self.checkpoint_every, self.stop_after = checkpoint_every, stop_after
        self.save, self.on_update, self.report = save, on_update, report
        self.authority, self.announce = authority, announce
        self.grad_clip, self.reduce_squares, self.reduce_min = grad_clip, reduce_squares, reduce_min
        self.schedule_examples = schedule_examples or global_batch
        self.tell_cut = tell_cut
        self.cond = threading.Condition()
        self.clocks = Clocks(
            clock={
                w: start_step if start_clocks is None else start_clocks[w] for w in range(workers)
            }
        )
        # Examples whose gradients this server applied: the run's progress in global steps.
        self.examples = start_step * global_batch if start_examples is None else start_examples
        first_contact = time.monotonic() + join_s  # a worker's first lease runs from here
        self.last_seen = {w: first_contact for w in range(workers)}
        self.version = 0  # updates applied by this server over the whole run
        self.saved = start_step  # the newest step a checkpoint holds (or the start)
        self.stopping = False  # a planned stop's checkpoint is written
        self.parked: list[tuple[int, torch.futures.Future]] = []
        self.pending: dict[int, Push] = {}  # sync: this step's gradients so far
        self.applying: dict[int, Push] = {}  # sync: the step the applier works on, off the lock
        # sync: workers whose gradient the servers agreed to leave out (server 0 declared them
        # dead; this server may not know yet): held until it does, then refused.
        self.left_out: set[int] = set()
        # A failed save, collective or background thread ends the server.
        self.failure: BaseException | None = None
        self._stop = threading.Event()  # set once the run is over: the watcher ends
        self._threads: list[threading.Thread] = []
        if authority:  # the others learn of deaths from it (`membership`)
            self._start(self._watch_leases, "leases")
        if mode == "sync":
            self._start(self._apply_sync_steps, "sync")

    def _start(self, body: Callable[[], None], what: str) -> None:
        name = f"ps-server-{self.index}-{what}"
        self._threads.append(start_thread(body, name=name, on_failure=self._thread_failed))

    def _thread_failed(self, failed: ThreadFailed) -> None:
        """A background thread raised (a bug, or a collective of the sync applier's that
        failed): the server fails, every waiting worker is answered with the error now and
        `wait_until_done` raises it."""
        with self.cond:
            self.failure = self.failure or failed
            self.applying = {}
            self._release()

    # ------------------------------------------------------------------ worker calls

    def join(self, worker: int) -> Reply:
        """A worker starting (or resuming): its step and the current parameters."""
        with self.cond:
            if worker in self.clocks.dead:
                return Reply("refused", self.clocks.clock[worker])
            self.last_seen[worker] = time.monotonic()
            return self._go(worker)

    def push(self, push: Push) -> torch.futures.Future:
        """Apply (or collect) a gradient; the Future resolves with the worker's next Reply."""
        reply: torch.futures.Future = torch.futures.Future()
        with self.cond:
            w = push.worker
            if w in self.clocks.dead or push.step != self.clocks.clock[w]:
                # Dead, or a message from before a restart: never applied.
                reply.set_result(Reply("refused", self.clocks.clock[w]))
                return reply
            self.last_seen[w] = time.monotonic()
            if self._finished():  # the run's examples are in (another worker's came first)
                reply.set_result(Reply("done", self.clocks.clock[w]))
                return reply
            if self.mode == "sync":  # the applier thread takes the step once it is complete
                self.pending[w] = push
            else:
                self._apply_one(push)
            self.parked.append((w, reply))
            self._release()
        return reply

    def heartbeat(self, worker: int) -> bool:
        """Renew the worker's lease; False once it has been declared dead."""
        if worker in self.clocks.dead:
            return False
        self.last_seen[worker] = time.monotonic()  # no lock: a plain store (see the docstring)
        return True

    def leave(self, worker: int) -> None:
        """A worker is done (finished, stopped or refused) and exits: nobody waits for it."""
        self.membership(worker, None)

    def membership(self, worker: int, why: str | None) -> None:
        """`worker` died (why) or left (None): from now on it is not live here, and if this
        server is the authority, nowhere.

        In three moves: mark it under the lock; (the authority) announce it to the other
        servers, without waiting; then release what waited for it (a sync step may be
        complete without it now: the applier thread is woken).
        """
        with self.cond:
            if worker in self.clocks.left or worker in self.clocks.dead:
                return
            if why is None:
                self.clocks.left.add(worker)
            else:
                self.clocks.dead[worker] = why
                by = "" if self.authority else " by server 0"  # who decided: one authority
                self.report(
                    f"scaletrain: parameter server {self.index}: worker {worker} "
                    f"declared dead{by} ({why}); going on with {len(self.clocks.live)} "
                    "worker(s), its later messages refused"
                )
            # Under sync its gradient for the step may be in here and not on another server
            # (stopped between its pushes): no server applies it.
            self.pending.pop(worker, None)
        if self.authority and self.announce is not None:  # off the lock: RPCs
            self.announce(worker, why)
        with self.cond:
            self._release()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of this server's parameters, by name (for evaluation and the final save)."""
        with self.cond:
            return {n: p.detach().clone() for n, p in zip(self.names, self.params)}

    # ------------------------------------------------------------------ the server's own

    def wait_until_done(self) -> None:
        """Block until every worker has left or died, or the server failed; stop the lease
        watcher and the sync applier; raise the failure (a save's, a background thread's)."""
        with self.cond:
            while not self._done():
                self.cond.wait(timeout=0.5)
        self.close()
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """Stop the lease watcher and the sync applier (idempotent)."""
        self._stop.set()
        with self.cond:
            self.cond.notify_all()  # the applier waits on the condition
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def _done(self) -> bool:
        return self.failure is not None or all(
            w in self.clocks.left or w in self.clocks.dead for w in self.clocks.clock
        )

    def declare_dead(self, worker: int, why: str) -> None:
        """`worker` is dead from now on: refused, waited for by nobody; the authority tells
        the other servers."""
        self.membership(worker, why)

    def _watch_leases(self) -> None:
        """The authority's watcher: declares silent workers dead, until the run is over."""
        tick = min(self.lease_s / 4, 0.5)
        while not self._stop.wait(tick):
            now = time.monotonic()
            for w, seen in list(self.last_seen.items()):
                if (
                    w not in self.clocks.dead
                    and w not in self.clocks.left
                    and now - seen > self.lease_s
                ):
                    self.declare_dead(
                        w,
                        f"not heard from for {now - seen:.1f} s "
                        f"(ps.worker_timeout_s = {self.lease_s:g})",
                    )
            if self._done():
                return

    # ------------------------------------------------------------------ under the lock

    def _go(self, worker: int) -> Reply:
        """The parameters as they are now, for the worker's next step."""
        read = Read(version=self.version, slowest=self.clocks.slowest() or 0)
        # Copies: the RPC agent serializes after this returns, and the next update would
        # change a tensor it still reads.
        return Reply(
            "go", self.clocks.clock[worker], [p.detach().clone() for p in self.params], read
        )

    def _apply_one(self, push: Push) -> None:
        """async / ssp: this gradient alone is the update."""
        delay = self.version - push.read.version
        applied = push.grads is not None
        if applied:
            self._step(push.grads, lr_scale=1.0 / (1 + delay) if self.inverse_lr else 1.0)
        self.clocks.clock[push.worker] += 1
        self.examples += push.examples
        self._advance_schedule()
        self.on_update(
            Update(
                push,
                staleness_of(push.step, slowest_at_read=push.read.slowest),
                delay,
                self.version,
                applied,
            )
        )

    def _apply_sync_steps(self) -> None:
        """sync's applier thread: once every live worker's gradient for the step is in,
        agree with the other servers on which of them all hold (off the lock: collectives),
        then apply their mean, weighted by the loss's counts (so it is the gradient of the
        mean loss over every example of the step, as DDP's all-reduce makes it), clipped by
        its global norm. Anything that raises here (a collective that failed or timed out
        included) fails the server: ps/threads.py hands it to `_thread_failed`."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self._stop.is_set() or self._step_complete())
                if self._stop.is_set():
                    return
                self.applying, self.pending = self.pending, {}
            pushes, mean = self._agree_on_mean(self.applying)
            with self.cond:
                self._apply_sync(pushes, mean)
                self.left_out |= set(self.applying) - {p.worker for p in pushes}
                self.applying = {}
                self._release()

    def _step_complete(self) -> bool:
        return bool(self.pending) and all(w in self.pending for w in self.clocks.live)

    def _agree_on_mean(self, held: dict[int, Push]) -> tuple[list[Push], list | None]:
        """The step's pushes every server holds (in worker order: reproducible) and their
        clipped mean (None: nothing to apply, or it overflowed, as DDP would skip it). Every
        server reaches this for every step, and takes the same branches: a worker sends a
        non-finite gradient as None to all."""
        mask = torch.zeros(len(self.clocks.clock), dtype=torch.int64)
        mask[sorted(held)] = 1
        everywhere = self.reduce_min(mask)
        pushes = [held[w] for w in sorted(held) if everywhere[w]]
        finite = [p for p in pushes if p.grads is not None]
        total = sum(p.count for p in finite)
        if not finite or total == 0:
            return pushes, None
        mean = [
            sum(p.grads[i] * (p.count / total) for p in finite) for i in range(len(self.params))
        ]
        return pushes, mean if self._clip_mean(mean) else None

    def _apply_sync(self, pushes: list[Push], mean: list[torch.Tensor] | None) -> None:
        """Under the lock: the agreed step's update, clocks, examples and records."""
        before = self.version
        if mean is not None:
            self._step(mean, lr_scale=1.0)
        for p in pushes:
            self.clocks.clock[p.worker] += 1
            self.examples += p.examples
        self._advance_schedule()
        for p in pushes:
            self.on_update(
                Update(
                    p,
                    staleness_of(p.step, slowest_at_read=p.read.slowest),
                    before - p.read.version,
                    self.version,
                    p.grads is not None,
                )
            )

    def _clip_mean(self, mean: list[torch.Tensor]) -> bool:
        """Clip the step's mean gradient (this server's shard of it) to grad_clip by the norm
        of the whole gradient, the servers' squared shard norms summed; False if it is not
        finite. training/step.py's rule (grad_norm.clip_grads_) on the same global norm."""
        if self.grad_clip <= 0:
            return True
        squares = self.reduce_squares(global_grad_norm(mean).double() ** 2)
        norm = squares.sqrt()
        if not bool(torch.isfinite(norm)):
            return False
        clip_grads_(mean, max_norm=self.grad_clip, total_norm=norm)
        return True

    def _advance_schedule(self) -> None:
        """Step the LR schedule to examples applied / schedule_examples (a sync update with a
        worker dead is a fraction of a schedule step; skipped updates count, as in
        training/step.py)."""
        target = self.examples // self.schedule_examples
        with warnings.catch_warnings():  # LambdaLR's order check knows nothing of servers
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
            while self.scheduler.last_epoch < target:
                self.scheduler.step()

    def _step(self, grads: list[torch.Tensor], *, lr_scale: float) -> None:
        for p, g in zip(self.params, grads):
            p.grad = g.to(p.dtype)
        groups = self.optimizer.param_groups
        base = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] *= lr_scale
        self.optimizer.step()
        for g, lr in zip(groups, base):
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def global_step(self) -> int:
        return self.examples // self.global_batch

    def _finished(self) -> bool:
        return self.global_step() >= self.steps

    def _due_cut(self) -> int | None:
        """The checkpoint (or planned stop) the run has reached and not yet written."""
        every, done = self.checkpoint_every, self.global_step()
        marks = [self.stop_after] if self.stop_after else []
        if every:
            marks.append((self.saved // every + 1) * every)
        due = [m for m in marks if self.saved < m <= done and m < self.steps]
        return min(due) if due else None

    def _release(self) -> None:
        """Answer every parked worker that may go on now; write a checkpoint at a cut.

        A cut (server 0 only): once the run has reached a checkpoint's global step, no worker
        gets an answer until every live worker is parked here. A worker pushes its step to
        every server and waits for all of them before its next, so then every server has
        applied, or will once what is in flight arrives, exactly the same gradients: the
        servers' shards and clocks in the checkpoint are of one instant. The other servers
        hold nobody (one that held its own answers deadlocked with server 0 when the
        gradients reached the two in different orders) and save when told (`cut`).
        """
        cut = self._due_cut() if self.authority else None
        parked = {w for w, _ in self.parked}
        if (
            cut is not None
            and self.failure is None
            and not self.pending
            and not self.applying
            and all(w in parked for w in self.clocks.live)
        ):
            told = self.tell_cut(cut, self.examples) if self.tell_cut is not None else []
            self._save_cut(cut)
            for call in told:  # each answers once its part of the same collective save is done
                try:
                    call.wait()
                except RuntimeError as e:
                    self.failure = self.failure or e
            cut = None if self.failure is None else cut
        still = []
        for w, reply in self.parked:
            s = self.clocks.clock[w]
            if w in self.clocks.dead:
                reply.set_result(Reply("refused", s))
            elif self.failure is not None:
                reply.set_exception(
                    RuntimeError(f"parameter server {self.index} failed: {self.failure}")
                )
            elif w in self.pending or w in self.applying or w in self.left_out or cut is not None:
                # sync: not applied yet (or left out, until this server hears it is dead); a
                # cut: hold
                still.append((w, reply))
            elif self.stopping:
                reply.set_result(Reply("stop", s))
            elif self._finished():
                reply.set_result(Reply("done", s))
            elif may_start(self.clocks, w, mode=self.mode, staleness=self.staleness):
                reply.set_result(self._go(w))
            else:
                still.append((w, reply))
        self.parked = still
        self.cond.notify_all()

    def _save_cut(self, cut: int) -> None:
        try:
            self.save(cut)  # every live worker waits for an answer: nothing moves
            self.saved = cut
            self.stopping = cut == self.stop_after
        except BaseException as e:  # noqa: BLE001  ended by wait_until_done
            self.failure = e

    def cut(self, step: int, examples: int, *, timeout_s: float) -> None:
        """Server 0 is writing the checkpoint of global `step` with `examples` applied: wait
        until this server has applied as many (the pushes still in flight; each applied one
        notifies the condition), then write its part of the same collective checkpoint."""
        with self.cond:
            arrived = self.cond.wait_for(
                lambda: self.examples >= examples or self.failure is not None, timeout=timeout_s
            )
            if not arrived:
                self.failure = RuntimeError(
                    f"parameter server {self.index} had {self.examples} examples applied "
                    f"when server 0 wrote the checkpoint of step {step} with {examples}"
                )
            if self.failure is None:
                self._save_cut(step)
            self._release()

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """The counters a checkpoint keeps: every worker's clock, examples applied (the run's
        position and the LR schedule's), version, and the membership at the cut."""
        return {
            "version": self.version,
            "examples": self.examples,
            "clocks": ",".join(str(self.clocks.clock[w]) for w in sorted(self.clocks.clock)),
            "dead": ",".join(map(str, sorted(self.clocks.dead))),
            "left": ",".join(map(str, sorted(self.clocks.left))),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters; a worker dead or gone at the checkpoint is a member again
        (a restart starts every worker)."""
        self.version, self.examples = int(state["version"]), int(state["examples"])
        clocks = [int(c) for c in state["clocks"].split(",")]
        if len(clocks) == len(self.clocks.clock):  # else the start_step every worker got
            self.clocks.clock = dict(enumerate(clocks))
