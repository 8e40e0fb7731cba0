"""The parameter server's rules, with no process group and no RPC: placement, clocks, and a
`ParameterServer` driven in-process by hand-written pushes.

`ParameterServer.push` returns a torch Future that resolves when the mode lets the worker
go on; here a "parked" worker is a Future that is not done yet, and every number checked is
computed by hand in float64 from the gradients the test pushed.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
import torch

from scaletrain.ps.clock import Clocks, may_start, staleness_of
from scaletrain.ps.partition import PartitionError, model_partition, partition_by_bytes
from scaletrain.ps.server import ParameterServer, Push, Read, Reply, Update

LR = 0.1


# ---------------------------------------------------------------------- partition_by_bytes


def _random_sizes(seed: int, n: int) -> dict[str, int]:
    rng = random.Random(seed)
    return {
        f"layer{i}.{rng.choice(['weight', 'bias'])}": rng.choice([4, 64, 4096])
        * rng.randint(1, 300)
        for i in range(n)
    }


@pytest.mark.parametrize(
    "seed, n, servers", [(0, 7, 2), (1, 20, 3), (2, 50, 4), (3, 9, 9), (4, 13, 5), (5, 100, 7)]
)
def test_partition_is_balanced_complete_and_keeps_model_order(
    seed: int, n: int, servers: int
) -> None:
    sizes = _random_sizes(seed, n)

    parts = partition_by_bytes(sizes, servers=servers)

    assert len(parts) == servers
    placed = [name for part in parts for name in part]
    assert sorted(placed) == sorted(sizes), "every name exactly once"
    assert all(parts), "every server holds at least one tensor"
    order = list(sizes)
    for part in parts:  # within a server, the model's order
        assert part == sorted(part, key=order.index)
    load = [sum(sizes[name] for name in part) for part in parts]
    assert max(load) - min(load) <= max(sizes.values()), (load, max(sizes.values()))


def test_partition_known_answer_and_ties_to_the_lowest_server() -> None:
    # LPT: c (100) -> 0; a (60) -> 1; b (50) -> 1 (60 < 100); d (40) -> 0 (100 < 110).
    sizes = {"a": 60, "b": 50, "c": 100, "d": 40}
    assert partition_by_bytes(sizes, servers=2) == [["c", "d"], ["a", "b"]]
    # Equal sizes: model order decides, ties go to the lowest index.
    assert partition_by_bytes({"x": 8, "y": 8, "z": 8}, servers=3) == [["x"], ["y"], ["z"]]
    assert partition_by_bytes({"x": 8, "y": 8, "z": 8}, servers=2) == [["x", "z"], ["y"]]
    assert partition_by_bytes(sizes, servers=1) == [list(sizes)]


def test_partition_is_deterministic() -> None:
    sizes = _random_sizes(11, 40)
    first = partition_by_bytes(sizes, servers=3)
    for _ in range(5):
        assert partition_by_bytes(dict(sizes), servers=3) == first


def test_more_servers_than_tensors_is_refused() -> None:
    sizes = {"a": 4, "b": 4, "c": 4}
    assert partition_by_bytes(sizes, servers=3) == [["a"], ["b"], ["c"]]  # the limit is fine
    with pytest.raises(PartitionError, match=r"ps.servers = 4 .* only 3 parameter tensors"):
        partition_by_bytes(sizes, servers=4)
    assert issubclass(PartitionError, ValueError)


def test_model_partition_over_a_real_model() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model[0].bias.requires_grad_(False)  # a frozen tensor is not served
    parts = model_partition(model, servers=2)
    # 0.weight 16384 B -> 0; 2.weight 2560 B -> 1; 2.bias 40 B -> 1.
    assert parts == [["0.weight"], ["2.weight", "2.bias"]]
    with pytest.raises(PartitionError):
        model_partition(model, servers=4)


# ---------------------------------------------------------------------- clocks


def test_clocks_live_and_slowest() -> None:
    c = Clocks(clock={0: 5, 1: 3, 2: 4})
    assert c.live == [0, 1, 2] and c.slowest() == 3
    c.dead[1] = "gone"
    assert c.live == [0, 2] and c.slowest() == 4  # a dead worker holds nobody back
    c.dead.update({0: "x", 2: "y"})
    assert c.live == [] and c.slowest() is None


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_may_start_async_and_sync_never_hold(mode: str) -> None:
    c = Clocks(clock={0: 100, 1: 0})
    assert may_start(c, 0, mode=mode, staleness=0)


def test_may_start_ssp_bound() -> None:
    c = Clocks(clock={0: 3, 1: 1, 2: 2})
    assert may_start(c, 0, mode="ssp", staleness=2)  # 3 - 1 = 2 <= 2
    assert not may_start(c, 0, mode="ssp", staleness=1)  # 2 > 1
    assert may_start(c, 1, mode="ssp", staleness=0)  # the slowest may always go
    assert may_start(c, 2, mode="ssp", staleness=1)
    c.dead[1] = "gone"  # now the slowest live worker is at 2
    assert may_start(c, 0, mode="ssp", staleness=1)
    assert not may_start(c, 0, mode="ssp", staleness=0)


def test_staleness_of() -> None:
    assert staleness_of(7, slowest_at_read=7) == 0
    assert staleness_of(7, slowest_at_read=4) == 3


# ---------------------------------------------------------------------- the server in-process


class Recorder:
    """The server's callbacks, recording what they were told."""

    def __init__(self) -> None:
        self.saves: list[int] = []
        self.updates: list[Update] = []
        self.reports: list[str] = []

    def save(self, step: int) -> None:
        self.saves.append(step)

    def on_update(self, u: Update) -> None:
        self.updates.append(u)


EXAMPLES = 4  # examples in one push (unless a test gives another count)


def make_server(
    rec: Recorder,
    *,
    mode: str,
    workers: int = 2,
    staleness: int = 1,
    inverse_lr: bool = False,
    lease_s: float = 1e6,
    join_s: float = 1e6,
    steps: int = 100,
    global_batch: int | None = None,
    start_step: int = 0,
    checkpoint_every: int = 0,
    stop_after: int = 0,
    momentum: float = 0.0,
    index: int = 0,
    **kwargs,
) -> ParameterServer:
    """A server of two float64 parameters (w: 3 values, b: 1), zero-initialised, plain SGD.

    A global step is `global_batch` examples applied: by default one push of EXAMPLES from
    every worker, as each worker's share of train.global_batch is in a real run. More
    keyword arguments go to ParameterServer (authority, announce, grad_clip, ...)."""
    params = {
        "w": torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)),
        "b": torch.nn.Parameter(torch.zeros(1, dtype=torch.float64)),
    }
    optimizer = torch.optim.SGD(list(params.values()), lr=LR, momentum=momentum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return ParameterServer(
        index=index,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        workers=workers,
        mode=mode,
        staleness=staleness,
        inverse_lr=inverse_lr,
        lease_s=lease_s,
        join_s=join_s,
        steps=steps,
        global_batch=global_batch or EXAMPLES * workers,
        start_step=start_step,
        checkpoint_every=checkpoint_every,
        stop_after=stop_after,
        save=rec.save,
        on_update=rec.on_update,
        report=rec.reports.append,
        **kwargs,
    )


def grads(*values: float) -> list[torch.Tensor]:
    """A gradient for (w, b): w's three values, then b's one."""
    return [
        torch.tensor(values[:3], dtype=torch.float64),
        torch.tensor(values[3:], dtype=torch.float64),
    ]


G0, G1 = (1.0, -2.0, 0.5, 3.0), (0.25, 4.0, -1.5, -1.0)


def push(
    server: ParameterServer,
    reply: Reply,
    worker: int,
    g: tuple[float, ...] | None,
    *,
    count: int = EXAMPLES,
    step: int | None = None,
    settle: bool = True,
) -> torch.futures.Future:
    """Worker `worker` pushes gradient g for the step `reply` told it to run (under sync, if
    `settle`: and the step is applied, if the push completed it)."""
    future = server.push(
        Push(
            worker=worker,
            step=reply.step if step is None else step,
            grads=None if g is None else grads(*g),
            read=reply.read,
            loss_sum=1.0 * count,
            count=count,
            examples=count,
            examples_per_s=100.0,
        )
    )
    if settle:
        settled(server)
    return future


def settled(server: ParameterServer) -> None:
    """Sync applies a complete step on its own thread: wait until it has (a no-op when no
    step is complete, and under async and ssp)."""
    with server.cond:
        assert server.cond.wait_for(
            lambda: not server.applying and not server._step_complete(), timeout=10
        ), "a complete sync step was not applied"


def params_of(server: ParameterServer) -> torch.Tensor:
    snap = server.snapshot()
    return torch.cat([snap["w"], snap["b"]])


def as_vec(g: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(g, dtype=torch.float64)


def done_reply(f: torch.futures.Future) -> Reply:
    """The worker's answer; under sync the applier thread may still be giving it."""
    deadline = time.monotonic() + 10
    while not f.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert f.done(), "the worker is still parked"
    return f.wait()


def test_join_gives_the_current_parameters() -> None:
    rec = Recorder()
    server = make_server(rec, mode="async", start_step=3)
    reply = server.join(1)
    assert reply.status == "go" and reply.step == 3
    assert reply.read == Read(version=0, slowest=3)
    assert [t.tolist() for t in reply.tensors] == [[0.0, 0.0, 0.0], [0.0]]


def test_async_applies_each_push_at_once() -> None:
    rec = Recorder()
    server = make_server(rec, mode="async")
    r0, r1 = server.join(0), server.join(1)

    a = done_reply(push(server, r0, 0, G0))  # never waits for worker 1

    expect = -LR * as_vec(G0)
    assert a.status == "go" and a.step == 1
    torch.testing.assert_close(torch.cat(a.tensors), expect, rtol=0, atol=1e-15)
    torch.testing.assert_close(params_of(server), expect, rtol=0, atol=1e-15)
    b = done_reply(push(server, r1, 1, G1))
    expect = expect - LR * as_vec(G1)
    assert b.status == "go" and b.step == 1
    torch.testing.assert_close(torch.cat(b.tensors), expect, rtol=0, atol=1e-15)
    assert server.version == 2 and server.clocks.clock == {0: 1, 1: 1}
    assert [(u.push.worker, u.delay, u.version, u.applied) for u in rec.updates] == [
        (0, 0, 1, True),
        (1, 1, 2, True),
    ]
    # The reply's tensors are copies: a later update does not change what a worker holds.
    done_reply(push(server, b, 1, G0))
    torch.testing.assert_close(torch.cat(b.tensors), expect, rtol=0, atol=1e-15)


def test_ssp_parks_a_worker_too_far_ahead_until_the_slowest_pushes() -> None:
    rec = Recorder()
    server = make_server(rec, mode="ssp", staleness=1)
    r0, r1 = server.join(0), server.join(1)

    r0 = done_reply(push(server, r0, 0, G0))  # 1 - 0 <= 1: go
    parked = push(server, r0, 0, G0)  # clock 2, slowest 0: 2 > 1

    assert r0.step == 1 and not parked.done()
    assert server.clocks.clock == {0: 2, 1: 0}  # its gradient is applied, only the reply waits
    r1 = done_reply(push(server, r1, 1, G1))  # the slowest reaches 1
    assert r1.status == "go" and r1.step == 1
    released = done_reply(parked)
    assert released.status == "go" and released.step == 2 and released.read.slowest == 1


def _drive(
    server: ParameterServer, rec: Recorder, *, workers: int, order: list[int]
) -> list[Update]:
    """Push until every worker is done, picking at each turn the first worker in `order`
    (a fixed, skewed preference: worker order[0] runs fastest) whose reply is ready."""
    replies = {w: server.join(w) for w in range(workers)}
    waiting: dict[int, torch.futures.Future] = {}
    finished: set[int] = set()
    turns = 0
    while len(finished) < workers:
        turns += 1
        assert turns < 10_000, "stuck"
        for w, f in list(waiting.items()):
            if f.done():
                replies[w] = f.wait()
                del waiting[w]
        ready = [w for w in order if w not in waiting and w not in finished]
        for w in ready:
            if replies[w].status != "go":
                finished.add(w)
        ready = [w for w in ready if w not in finished]
        if not ready:
            assert waiting or len(finished) == workers, "nobody can move"
            continue
        w = ready[0]
        waiting[w] = push(server, replies[w], w, G0 if w % 2 else G1)
    assert all(r.status == "done" for r in replies.values())
    return rec.updates


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_ssp_staleness_never_exceeds_the_bound(bound: int) -> None:
    rec = Recorder()
    server = make_server(rec, mode="ssp", workers=3, staleness=bound, steps=12)
    updates = _drive(server, rec, workers=3, order=[0, 1, 2])
    assert len(updates) == 36
    stalenesses = [u.staleness for u in updates]
    assert max(stalenesses) == bound, stalenesses  # reached (the fast worker runs ahead) ...
    assert min(stalenesses) >= 0  # ... and never passed


def test_async_with_the_same_schedule_runs_past_that_bound() -> None:
    """The driver above is able to produce staleness: without ssp's hold it exceeds 3."""
    rec = Recorder()
    server = make_server(rec, mode="async", workers=3, steps=12)
    updates = _drive(server, rec, workers=3, order=[0, 1, 2])
    assert max(u.staleness for u in updates) > 3


def test_sync_applies_the_count_weighted_mean_once_all_have_pushed() -> None:
    rec = Recorder()
    server = make_server(rec, mode="sync", momentum=0.9)
    r0, r1 = server.join(0), server.join(1)

    a = push(server, r0, 0, G0, count=3)
    assert not a.done(), "sync parks the first worker until the step is complete"
    torch.testing.assert_close(params_of(server), torch.zeros(4, dtype=torch.float64))
    assert server.version == 0 and rec.updates == []
    b = push(server, r1, 1, G1, count=5)

    mean = (3 * as_vec(G0) + 5 * as_vec(G1)) / 8  # the gradient of the 8 examples' mean loss
    expect = -LR * mean  # SGD with momentum: the first step is plain
    ra, rb = done_reply(a), done_reply(b)
    assert (ra.status, ra.step, rb.status, rb.step) == ("go", 1, "go", 1)
    for r in (ra, rb):
        torch.testing.assert_close(torch.cat(r.tensors), expect, rtol=1e-15, atol=1e-17)
    assert server.version == 1
    assert [(u.push.worker, u.staleness, u.delay, u.version) for u in rec.updates] == [
        (0, 0, 0, 1),
        (1, 0, 0, 1),
    ]

    # Step 2, the other way round and other counts; momentum carries the first step's mean.
    c = push(server, rb, 1, G0, count=1)
    assert not c.done()
    d = push(server, ra, 0, G1, count=7)
    mean2 = (7 * as_vec(G1) + 1 * as_vec(G0)) / 8
    buf = 0.9 * mean + mean2
    torch.testing.assert_close(
        torch.cat(done_reply(c).tensors), expect - LR * buf, rtol=1e-15, atol=1e-17
    )
    torch.testing.assert_close(
        torch.cat(done_reply(d).tensors), expect - LR * buf, rtol=1e-15, atol=1e-17
    )
    assert server.version == 2


def test_sync_skips_a_non_finite_gradient_and_averages_the_rest() -> None:
    rec = Recorder()
    server = make_server(rec, mode="sync")
    r0, r1 = server.join(0), server.join(1)
    a = push(server, r0, 0, None, count=3)
    b = push(server, r1, 1, G1, count=5)
    torch.testing.assert_close(
        torch.cat(done_reply(a).tensors), -LR * as_vec(G1), rtol=1e-15, atol=1e-17
    )
    assert done_reply(b).step == 1 and server.clocks.clock == {0: 1, 1: 1}
    assert [u.applied for u in rec.updates] == [False, True]


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_dead_workers_push_is_refused_and_it_holds_nobody(mode: str) -> None:
    rec = Recorder()
    server = make_server(rec, mode=mode, staleness=0)
    r0, r1 = server.join(0), server.join(1)
    server.declare_dead(1, "test")
    assert len(rec.reports) == 1 and "worker 1 declared dead (test)" in rec.reports[0]

    refused = done_reply(push(server, r1, 1, G1))
    a = done_reply(push(server, r0, 0, G0))  # alone now: nothing to wait for

    assert refused.status == "refused" and refused.tensors == []
    assert a.status == "go" and a.step == 1
    torch.testing.assert_close(params_of(server), -LR * as_vec(G0), rtol=0, atol=1e-15)
    assert [u.push.worker for u in rec.updates] == [0]
    assert server.join(1).status == "refused" and not server.heartbeat(1)


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_worker_declared_dead_releases_one_already_waiting_for_it(mode: str) -> None:
    rec = Recorder()
    server = make_server(rec, mode=mode, staleness=0)
    r0, r1 = server.join(0), server.join(1)
    waiting = push(server, r0, 0, G0)
    assert not waiting.done()

    server.declare_dead(1, "test")

    a = done_reply(waiting)
    assert a.status == "go" and a.step == 1
    torch.testing.assert_close(torch.cat(a.tensors), -LR * as_vec(G0), rtol=0, atol=1e-15)
    assert done_reply(push(server, r1, 1, G1)).status == "refused"


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_lease_expiry_declares_the_silent_worker_dead(mode: str) -> None:
    rec = Recorder()
    lease = 0.5
    server = make_server(rec, mode=mode, staleness=0, lease_s=lease, join_s=0)
    r0 = server.join(0)  # worker 1 never calls in
    waiting = push(server, r0, 0, G0)
    assert not waiting.done()
    deadline = time.monotonic() + 6 * lease
    while not waiting.done() and time.monotonic() < deadline:
        assert server.heartbeat(0)  # worker 0 stays alive (every lease / 10)
        time.sleep(lease / 10)

    a = done_reply(waiting)
    assert a.status == "go" and a.step == 1
    assert list(server.clocks.dead) == [1] and "not heard from" in server.clocks.dead[1]
    assert "ps.worker_timeout_s = 0.5" in server.clocks.dead[1]
    assert any("worker 1 declared dead" in m for m in rec.reports)
    assert server.heartbeat(0) and not server.heartbeat(1)


def test_the_checkpoint_cut_holds_everyone_until_all_are_there() -> None:
    """Global step 2 = 16 examples = 4 pushes of 4, whoever makes them; then no worker is
    answered until every live worker waits on the server, and save(2) runs once."""
    rec = Recorder()
    server = make_server(rec, mode="async", checkpoint_every=2, steps=10)  # 8 examples a step
    r0, r1 = server.join(0), server.join(1)

    for _ in range(3):  # worker 0 alone: 12 examples, global step 1
        r0 = done_reply(push(server, r0, 0, G0))
    held = push(server, r0, 0, G0)  # 16 examples: the cut is due, worker 1 is not waiting

    assert not held.done() and rec.saves == []
    assert server.global_step() == 2 and server.clocks.clock == {0: 4, 1: 0}
    last = push(server, r1, 1, G1)  # now every live worker waits: the cut is complete

    assert rec.saves == [2]
    r0, r1 = done_reply(held), done_reply(last)
    assert (r0.status, r0.step, r1.status, r1.step) == ("go", 4, "go", 1)  # clocks differ

    # The next cut is global step 4 (32 examples); step 2 is not saved again.
    r1 = done_reply(push(server, r1, 1, G1))  # 24
    r0 = done_reply(push(server, r0, 0, G0))  # 28
    assert rec.saves == [2]
    held = push(server, r0, 0, G0)  # 32: due
    assert not held.done() and rec.saves == [2]
    last = push(server, r1, 1, G1)
    assert rec.saves == [2, 4]
    assert [done_reply(f).status for f in (held, last)] == ["go", "go"]


def test_a_dead_worker_does_not_hold_the_cut() -> None:
    rec = Recorder()
    server = make_server(rec, mode="async", checkpoint_every=1, steps=10)
    r0 = server.join(0)
    server.join(1)
    r0 = done_reply(push(server, r0, 0, G0))  # 4 examples: step 0 still
    held = push(server, r0, 0, G0)  # 8: the cut at step 1 waits for worker 1
    assert not held.done() and rec.saves == []

    server.declare_dead(1, "test")

    assert rec.saves == [1] and done_reply(held).status == "go"


def test_the_last_step_is_no_cut_and_done_follows() -> None:
    rec = Recorder()
    server = make_server(rec, mode="async", workers=1, checkpoint_every=1, steps=2)
    r = server.join(0)
    r = done_reply(push(server, r, 0, G0))
    assert rec.saves == [1] and r.status == "go"
    r = done_reply(push(server, r, 0, G0))
    assert r.status == "done" and r.step == 2 and rec.saves == [1]


def test_the_run_ends_on_examples_applied_however_the_workers_shared_them() -> None:
    """steps x global_batch examples end the run: a fast worker's extra steps count, and a
    push arriving after the end is answered "done" and not applied."""
    rec = Recorder()
    server = make_server(rec, mode="async", steps=2)  # 16 examples: 4 pushes
    r0, r1 = server.join(0), server.join(1)
    for _ in range(3):
        r0 = done_reply(push(server, r0, 0, G0))
    assert r0.status == "go" and r0.step == 3  # worker 0 is 3 steps in, worker 1 at 0

    end = done_reply(push(server, r1, 1, G1))  # the 16th example
    late = done_reply(push(server, r0, 0, G0))

    assert end.status == "done" and late.status == "done"
    assert server.version == 4 and len(rec.updates) == 4
    expect = -LR * (3 * as_vec(G0) + as_vec(G1))  # (one element cancels to ~1e-17)
    torch.testing.assert_close(params_of(server), expect, rtol=1e-15, atol=1e-15)


def test_stop_after_saves_then_says_stop() -> None:
    rec = Recorder()
    server = make_server(rec, mode="async", stop_after=2, steps=10)  # stop at 16 examples
    r0, r1 = server.join(0), server.join(1)
    r0 = done_reply(push(server, r0, 0, G0))
    r1 = done_reply(push(server, r1, 1, G1))
    r0 = done_reply(push(server, r0, 0, G0))
    held = push(server, r1, 1, G1)  # 16: due, worker 0 is not waiting yet
    assert not held.done() and rec.saves == []
    last = push(server, r0, 0, G0)
    assert rec.saves == [2]
    assert [done_reply(f).status for f in (held, last)] == ["stop", "stop"]
    assert server.stopping


def test_staleness_lr_inverse_divides_the_lr_by_one_plus_the_delay() -> None:
    rec = Recorder()
    server = make_server(rec, mode="async", inverse_lr=True, workers=3)
    r0, r1, r2 = server.join(0), server.join(1), server.join(2)  # all read version 0

    done_reply(push(server, r0, 0, G0))  # delay 0: lr
    done_reply(push(server, r1, 1, G1))  # delay 1: lr / 2
    done_reply(push(server, r2, 2, G0))  # delay 2: lr / 3

    expect = -LR * as_vec(G0) - LR / 2 * as_vec(G1) - LR / 3 * as_vec(G0)
    torch.testing.assert_close(params_of(server), expect, rtol=1e-15, atol=1e-17)
    assert [u.delay for u in rec.updates] == [0, 1, 2]
    assert server.optimizer.param_groups[0]["lr"] == LR  # the schedule's lr is restored


def test_staleness_lr_none_keeps_the_lr() -> None:
    rec = Recorder()
    server = make_server(rec, mode="async", inverse_lr=False)
    r0, r1 = server.join(0), server.join(1)
    done_reply(push(server, r0, 0, G0))
    done_reply(push(server, r1, 1, G1))
    assert rec.updates[1].delay == 1
    torch.testing.assert_close(
        params_of(server), -LR * (as_vec(G0) + as_vec(G1)), rtol=1e-15, atol=1e-17
    )


def test_a_non_finite_push_is_skipped_but_advances_the_clock() -> None:
    rec = Recorder()
    server = make_server(rec, mode="async")
    r0 = server.join(0)
    r0 = done_reply(push(server, r0, 0, None))
    assert r0.status == "go" and r0.step == 1
    assert server.clocks.clock[0] == 1 and server.version == 0
    torch.testing.assert_close(params_of(server), torch.zeros(4, dtype=torch.float64))
    assert [(u.applied, u.version) for u in rec.updates] == [(False, 0)]
    r0 = done_reply(push(server, r0, 0, G0))  # the next one is applied as usual
    assert r0.step == 2 and server.version == 1


def test_a_duplicate_or_out_of_order_step_is_refused_and_not_applied() -> None:
    rec = Recorder()
    server = make_server(rec, mode="async")
    first = server.join(0)
    done_reply(push(server, first, 0, G0))
    before = params_of(server)

    again = done_reply(push(server, first, 0, G0))  # step 0 a second time
    ahead = done_reply(push(server, first, 0, G0, step=5))  # the clock is at 1

    assert again.status == "refused" and ahead.status == "refused"
    assert again.step == 1 and ahead.step == 1
    torch.testing.assert_close(params_of(server), before, rtol=0, atol=0)
    assert server.version == 1 and len(rec.updates) == 1 and server.clocks.clock[0] == 1


def test_done_after_the_last_step_and_wait_until_done() -> None:
    rec = Recorder()
    server = make_server(rec, mode="sync", steps=1)
    r0, r1 = server.join(0), server.join(1)
    a, b = push(server, r0, 0, G0), push(server, r1, 1, G1)
    assert [done_reply(f).status for f in (a, b)] == ["done", "done"]
    server.leave(0)
    server.declare_dead(1, "test")
    server.wait_until_done()  # returns: everyone left or died


# ---------------------------------------------------------------------- membership


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_worker_that_left_is_waited_for_by_nobody(mode: str) -> None:
    """A worker gone (done on one server, lost another) is not live: sync completes the
    step and ssp lets the others run without it."""
    rec = Recorder()
    server = make_server(rec, mode=mode, staleness=0)
    r0, _ = server.join(0), server.join(1)
    waiting = push(server, r0, 0, G0)
    assert not waiting.done()

    server.leave(1)

    a = done_reply(waiting)
    assert a.status == "go" and a.step == 1
    torch.testing.assert_close(torch.cat(a.tensors), -LR * as_vec(G0), rtol=0, atol=1e-15)
    assert server.clocks.live == [0]


def test_a_worker_that_left_does_not_hold_the_cut() -> None:
    rec = Recorder()
    server = make_server(rec, mode="async", checkpoint_every=1, steps=10)
    r0 = server.join(0)
    server.join(1)
    r0 = done_reply(push(server, r0, 0, G0))
    held = push(server, r0, 0, G0)  # 8 examples: the cut at step 1 waits for worker 1
    assert not held.done() and rec.saves == []

    server.leave(1)

    assert rec.saves == [1] and done_reply(held).status == "go"


def _two_servers(
    rec0: Recorder, rec1: Recorder, *, mode: str, lease_s: float = 1e6, join_s: float = 1e6
) -> tuple[ParameterServer, ParameterServer]:
    """Server 0 (the authority) tells server 1 of every death and departure, as run.py's
    `_announce` does over RPC."""
    s1 = make_server(rec1, mode=mode, index=1, authority=False)
    s0 = make_server(
        rec0,
        mode=mode,
        lease_s=lease_s,
        join_s=join_s,
        announce=lambda w, why: s1.membership(w, why),
    )
    return s0, s1


def test_server_zero_alone_decides_who_is_dead_and_tells_the_others() -> None:
    rec0, rec1 = Recorder(), Recorder()
    lease = 0.3
    s0, s1 = _two_servers(rec0, rec1, mode="async", lease_s=lease, join_s=0)
    assert [t.name for t in s1._threads] == []  # no lease clock of its own: it cannot disagree
    r1 = s1.join(1)
    deadline = time.monotonic() + 20 * lease
    while 1 not in s1.clocks.dead and time.monotonic() < deadline:
        s0.heartbeat(0)  # worker 0 stays alive, worker 1 is silent on server 0
        s1.heartbeat(1)  # ... though it still talks to server 1: that is not a lease
        time.sleep(lease / 10)

    assert list(s0.clocks.dead) == [1] and list(s1.clocks.dead) == [1]
    assert s1.clocks.dead[1] == s0.clocks.dead[1]  # the authority's reason, verbatim
    assert any("parameter server 0: worker 1 declared dead" in m for m in rec0.reports)
    assert any(
        "parameter server 1: worker 1 declared dead by server 0 (not heard from" in m
        for m in rec1.reports
    )
    # Its late push is refused by both, applied by neither: the shards stay one model.
    assert done_reply(push(s1, r1, 1, G1)).status == "refused"
    assert s1.version == 0 and rec1.updates == []
    s0.leave(0)  # the authority's leave reaches server 1 too
    assert s1.clocks.left == {0}
    s0.wait_until_done()
    s1.wait_until_done()


def test_two_servers_cut_one_checkpoint_when_the_pushes_reach_them_in_other_orders() -> None:
    """Async, checkpoint at global step 1 (8 examples). Server 1 gets worker 0's push first
    and worker 1's second; server 0 the other way round. Server 1 reaches the cut having
    answered worker 0 already, server 0 having answered worker 1: a server that held its own
    answers at the cut would wait for a worker parked on the other server, forever. Server 0
    alone holds; once every worker waits on it, it tells server 1 (`tell_cut`), which saves
    once the gradient still in flight to it has arrived: both hold the same examples."""
    rec0, rec1 = Recorder(), Recorder()
    s1 = make_server(rec1, mode="async", index=1, authority=False, checkpoint_every=1)
    told: list[threading.Thread] = []

    def tell_cut(step: int, examples: int) -> list:
        done: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            s1.cut(step, examples, timeout_s=30)
            done.set_result(None)

        told.append(threading.Thread(target=run, daemon=True))
        told[-1].start()
        return [done]

    s0 = make_server(rec0, mode="async", checkpoint_every=1, tell_cut=tell_cut)
    a0, b0, a1, b1 = s0.join(0), s0.join(1), s1.join(0), s1.join(1)
    a1 = done_reply(push(s1, a1, 0, G0))  # server 1: 4 examples
    b0 = done_reply(push(s0, b0, 1, G1))  # server 0: 4
    b1 = done_reply(push(s1, b1, 1, G1))  # server 1: 8, the cut; worker 1 goes on there
    held_a = push(s0, a0, 0, G0)  # server 0: 8, the cut; worker 0 waits on it
    assert not held_a.done() and rec0.saves == rec1.saves == []
    # Worker 1's next step reaches server 0 first: every worker waits there now.
    answers: list[torch.futures.Future] = []
    closing = threading.Thread(target=lambda: answers.append(push(s0, b0, 1, G1)), daemon=True)
    closing.start()
    deadline = time.monotonic() + 30
    while not told and time.monotonic() < deadline:
        time.sleep(0.01)
    assert told, "server 0 never told server 1 of the cut"
    assert rec1.saves == []  # server 1 waits for worker 1's gradient still in flight
    late = push(s1, b1, 1, G1)  # ... which arrives: server 1 has 12 examples, as server 0
    closing.join(timeout=30)
    assert not closing.is_alive(), "the cut did not complete"

    assert rec0.saves == rec1.saves == [1]
    assert s0.examples == s1.examples == 12
    assert s0.clocks.clock == s1.clocks.clock == {0: 1, 1: 2}
    assert [done_reply(f).status for f in (held_a, late, *answers)] == ["go", "go", "go"]


def test_under_sync_a_dead_workers_waiting_gradient_is_applied_nowhere() -> None:
    """Worker 1 was stopped between its pushes: its gradient reached server 1, not server 0.
    When it is declared dead, both servers apply worker 0's gradient alone (worker 0's push
    to server 1 is still on its way, or server 1 would have applied the step with both)."""
    rec0, rec1 = Recorder(), Recorder()
    s0, s1 = _two_servers(rec0, rec1, mode="sync")
    r0_0, r0_1, r1_1 = s0.join(0), s1.join(0), s1.join(1)
    s0.join(1)
    late = push(s1, r1_1, 1, G1)  # never reaches server 0
    a0 = push(s0, r0_0, 0, G0)
    assert not (a0.done() or late.done())

    s0.declare_dead(1, "test")

    assert done_reply(late).status == "refused"
    a1 = push(s1, r0_1, 0, G0)
    # Answered once the step is applied (the servers' appliers run in their own threads).
    assert done_reply(a0).status == done_reply(a1).status == "go"
    expect = -LR * as_vec(G0)
    torch.testing.assert_close(params_of(s0), expect, rtol=0, atol=1e-15)
    torch.testing.assert_close(params_of(s1), params_of(s0), rtol=0, atol=0)


class PairedCollective:
    """Two in-process servers' all-reduces, paired as their gloo group pairs them: each call
    waits (10 s at most) for the other server's, and both get the reduced tensor."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)
        self.slot: dict[int, torch.Tensor] = {}

    def reducer(self, index: int, op) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.slot[index] = t.clone()
            self.barrier.wait()
            out = op(self.slot[0], self.slot[1])
            self.barrier.wait()  # both have read the slots before the next call fills them
            return t.copy_(out)

        return reduce


def test_under_sync_a_gradient_one_server_lacks_is_left_out_by_both() -> None:
    """Worker 1 was stopped between its pushes: its gradient reached server 0, not server 1.
    Server 0 completes the step at once (every live worker has pushed to it) and waits in
    the agreement for server 1, which waits for worker 1 until server 0's lease watcher
    declares it dead. Both then apply worker 0's gradient alone. Before, server 0 ran the
    step's all-reduce on the thread that completed it, holding the lock (the lease watcher's
    too, once a death completed the step): the watcher could not declare worker 1 dead and
    the two servers waited for each other until gloo's timeout (seen in test_ps_faults); and
    without the agreement each would apply what it holds, and the shards split."""
    rec0, rec1 = Recorder(), Recorder()
    pair, lease = PairedCollective(), 0.3
    s1 = make_server(
        rec1, mode="sync", index=1, authority=False, reduce_min=pair.reducer(1, torch.minimum)
    )
    s0 = make_server(
        rec0,
        mode="sync",
        lease_s=lease,
        join_s=0,
        announce=lambda w, why: s1.membership(w, why),
        reduce_min=pair.reducer(0, torch.minimum),
    )
    r0_0, r1_0, r0_1 = s0.join(0), s0.join(1), s1.join(0)
    s1.join(1)
    stopped = push(s0, r1_0, 1, G1, settle=False)  # never reaches server 1
    a0 = push(s0, r0_0, 0, G0, settle=False)  # server 0's step is complete: it agrees ...
    a1 = push(s1, r0_1, 0, G0, settle=False)  # ... with server 1, which waits for worker 1
    deadline = time.monotonic() + 30 * lease
    while not (a0.done() and a1.done()) and time.monotonic() < deadline:
        s0.heartbeat(0)  # worker 0 stays alive; worker 1 is silent
        time.sleep(lease / 10)

    assert done_reply(a0).status == done_reply(a1).status == "go"
    assert done_reply(stopped).status == "refused"
    assert list(s0.clocks.dead) == list(s1.clocks.dead) == [1]
    torch.testing.assert_close(params_of(s0), -LR * as_vec(G0), rtol=0, atol=1e-15)
    torch.testing.assert_close(params_of(s1), params_of(s0), rtol=0, atol=0)
    assert [u.push.worker for u in rec0.updates] == [u.push.worker for u in rec1.updates] == [0]
    assert s0.clocks.clock == s1.clocks.clock == {0: 1, 1: 0}


def test_the_lease_watcher_and_the_sync_applier_end_with_the_run() -> None:
    rec = Recorder()
    server = make_server(rec, mode="sync", lease_s=0.2)
    assert [t.name for t in server._threads] == ["ps-server-0-leases", "ps-server-0-sync"]
    assert all(t.is_alive() for t in server._threads)
    server.leave(0)
    server.declare_dead(1, "test")
    server.wait_until_done()
    assert not any(t.is_alive() for t in server._threads)


# ---------------------------------------------------------------------- sync: DDP's rules


def test_sync_steps_the_lr_schedule_by_examples_applied() -> None:
    """With a worker dead each sync update is half a global step: the schedule moves once
    per global step of examples, not once per update (it would end twice too early)."""
    rec = Recorder()
    server = make_server(rec, mode="sync")  # global_batch: 2 workers x 4 examples
    r0, r1 = server.join(0), server.join(1)
    a, b = push(server, r0, 0, G0), push(server, r1, 1, G1)
    r0 = done_reply(a)
    done_reply(b)
    assert server.scheduler.last_epoch == 1  # one whole global step
    server.declare_dead(1, "test")
    r0 = done_reply(push(server, r0, 0, G0))  # 4 examples: half a step
    assert server.scheduler.last_epoch == 1
    done_reply(push(server, r0, 0, G0))  # 8: a whole one
    assert server.scheduler.last_epoch == 2 and server.version == 3


def test_sync_clips_the_averaged_gradient_by_its_global_norm() -> None:
    """DDP clips the mean gradient of the step; so does sync, not each worker's own."""
    rec = Recorder()
    server = make_server(rec, mode="sync", grad_clip=1.0)
    r0, r1 = server.join(0), server.join(1)
    a, b = push(server, r0, 0, G0), push(server, r1, 1, G1)
    mean = (as_vec(G0) + as_vec(G1)) / 2
    norm = float(mean.norm())
    assert norm > 1.0  # the clip bites
    torch.testing.assert_close(
        torch.cat(done_reply(a).tensors), -LR * mean / (norm + 1e-6), rtol=1e-15, atol=1e-17
    )
    done_reply(b)


def test_sync_clipping_sums_the_servers_squared_norms() -> None:
    """Each server clips its shard by the whole gradient's norm: reduce_squares adds the
    other servers' squares (here a constant standing in for them)."""
    rec = Recorder()
    other = 12.0  # the squared norm of the shards held elsewhere
    server = make_server(rec, mode="sync", grad_clip=1.0, reduce_squares=lambda sq: sq + other)
    r0, r1 = server.join(0), server.join(1)
    a, b = push(server, r0, 0, G0), push(server, r1, 1, G1)
    mean = (as_vec(G0) + as_vec(G1)) / 2
    norm = (float(mean.norm()) ** 2 + other) ** 0.5
    torch.testing.assert_close(
        torch.cat(done_reply(a).tensors), -LR * mean / (norm + 1e-6), rtol=1e-15, atol=1e-17
    )
    done_reply(b)


# ---------------------------------------------------------------------- the metrics writer


class _Logger:
    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.evals: list[dict] = []

    def log_step(self, record: dict) -> None:
        self.steps.append(record)

    def log_eval(self, record: dict) -> None:
        self.evals.append(record)

    def advance(self, n: int) -> None:
        pass


def test_an_evaluation_that_raises_loses_no_later_record(capsys) -> None:
    from types import SimpleNamespace

    from scaletrain.ps.metrics import ServerMetrics

    config = SimpleNamespace(
        train=SimpleNamespace(global_batch=8, eval_every=1, steps=4), log=SimpleNamespace(every=1)
    )
    derived = SimpleNamespace(ps=SimpleNamespace(workers=2))
    calls = []

    def evaluate() -> dict:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("the model's forward broke")
        return {"loss": 0.5}

    logger = _Logger()
    metrics = ServerMetrics(
        config,
        derived,
        logger=logger,
        start_step=0,
        evaluate=evaluate,
        versions=lambda own: {0: own},
    )
    for step in range(4):
        for w in range(2):
            p = Push(
                worker=w,
                step=step,
                grads=None,
                read=Read(0, 0),
                loss_sum=4.0,
                count=4,
                examples=4,
                examples_per_s=1.0,
            )
            metrics.update(Update(p, 0, 0, step + 1, True), alive=2, lr=0.1, version=step + 1)

    with pytest.raises(ValueError, match="forward broke"):
        metrics.close()
    assert [r["step"] for r in logger.steps] == [1, 2, 3, 4]  # every window after it too
    assert [r["step"] for r in logger.evals] == [2, 3]
    assert "eval record at step 1 raised ValueError" in capsys.readouterr().err
