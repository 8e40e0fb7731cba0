"""A background thread of the parameter-server strategy that raises ends the run at once,
named, instead of dying alone while the others wait for it until their RPC timeout.

The three threads: server 0's lease watcher, a server's sync applier, a worker's heartbeat.
In-process, the fault is injected by monkeypatch into a `ParameterServer`: the workers it
holds are answered with the error and `wait_until_done` raises it, naming the thread.
Through the launcher, a user model's factory (written into the test's directory) breaks
one thread in every process that builds the model; parallel.timeout_s is far past the
test's own timeout, so a run that ends at all ended by the failure's path, not an RPC
timeout. The console then holds one paragraph naming the thread, no traceback; the rank's
log keeps the traceback (an exception in our own thread is a bug of ours).
"""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from scaletrain.ps import worker as ps_worker
from scaletrain.ps.server import ParameterServer
from test_ps_units import G0, G1, Recorder, make_server, push

from harness import run_cli

WAIT_S = 10.0  # for a parked worker's answer in-process: it comes at once when it comes
RUN_TIMEOUT_S = 120.0  # a broken run through the launcher ends in seconds when it ends


def _injected(thread: str) -> ValueError:
    return ValueError(f"injected into {thread}")


def _answer_error(future: torch.futures.Future) -> str:
    """The error a parked worker is answered with (fails if it is still parked)."""
    deadline = time.monotonic() + WAIT_S
    while not future.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert future.done(), "the worker is still parked: nothing reacted to the thread's end"
    with pytest.raises(RuntimeError) as e:
        future.wait()
    return str(e.value)


def _break_lease_watcher(monkeypatch: pytest.MonkeyPatch) -> None:
    done = ParameterServer._done

    def broken(self: ParameterServer) -> bool:
        if threading.current_thread().name.endswith("-leases"):  # the watcher's every tick
            raise _injected("leases")
        return done(self)

    monkeypatch.setattr(ParameterServer, "_done", broken)


def test_a_failed_lease_watcher_answers_the_waiting_worker_and_ends_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _break_lease_watcher(monkeypatch)
    server = make_server(Recorder(), mode="ssp", staleness=0, lease_s=0.2)
    r0, _ = server.join(0), server.join(1)
    waiting = push(server, r0, 0, G0)  # ssp 0: parked until worker 1 pushes, which it never does

    said = _answer_error(waiting)

    assert "thread ps-server-0-leases failed: ValueError: injected into leases" in said
    with pytest.raises(RuntimeError, match="thread ps-server-0-leases failed") as e:
        server.wait_until_done()
    assert isinstance(e.value.__cause__, ValueError)  # the original, with its traceback
    assert not any(t.is_alive() for t in server._threads)


def test_a_failed_sync_applier_answers_the_waiting_workers_and_ends_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(self: ParameterServer, *args) -> None:
        raise _injected("sync")

    monkeypatch.setattr(ParameterServer, "_apply_sync", broken)
    server = make_server(Recorder(), mode="sync")
    r0, r1 = server.join(0), server.join(1)
    waiting = [push(server, r0, 0, G0, settle=False), push(server, r1, 1, G1, settle=False)]

    for future in waiting:  # the step was complete: the applier took it, and raised
        assert "thread ps-server-0-sync failed: ValueError: injected into sync" in (
            _answer_error(future)
        )
    with pytest.raises(RuntimeError, match="thread ps-server-0-sync failed"):
        server.wait_until_done()
    assert not any(t.is_alive() for t in server._threads)


def test_a_failed_heartbeat_is_raised_by_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    def rpc_async(*args, **kwargs):
        raise _injected("heartbeat")

    monkeypatch.setattr(ps_worker.rpc, "rpc_async", rpc_async)
    heartbeat = ps_worker._Heartbeat(3, lease_s=0.04)  # its first beat after 0.01 s
    heartbeat._thread.join(timeout=WAIT_S)
    try:
        with pytest.raises(RuntimeError, match="thread ps-worker-3-heartbeat failed: ValueError"):
            heartbeat.check()  # what the worker calls after every step
    finally:
        heartbeat.stop()


def test_a_heartbeat_that_cannot_reach_server_0_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """An RPC error is server 0 gone (the next push says so), not a failed thread."""
    calls = threading.Semaphore(0)

    def rpc_async(*args, **kwargs):
        calls.release()
        raise RuntimeError("connection refused")

    monkeypatch.setattr(ps_worker.rpc, "rpc_async", rpc_async)
    heartbeat = ps_worker._Heartbeat(3, lease_s=0.04)
    try:
        for _ in range(3):  # three beats, each failed
            assert calls.acquire(timeout=WAIT_S)
        heartbeat.check()
        assert heartbeat._thread.is_alive()
    finally:
        heartbeat.stop()


def test_the_paragraph_says_a_bug_unless_a_collective_failed(tmp_path: Path) -> None:
    from scaletrain.ps.run import _thread_failure
    from scaletrain.ps.threads import ThreadFailed

    bug = _thread_failure(
        ThreadFailed("ps-server-0-leases", KeyError(3)), "parameter server 0", tmp_path
    )
    assert bug.startswith(
        "parameter server 0: thread ps-server-0-leases failed: KeyError: 3 (a bug"
    )
    assert f"--run-dir {tmp_path} --resume" in bug
    gloo = ThreadFailed("ps-server-1-sync", RuntimeError("[gloo] Connection closed by peer"))
    assert "(a collective failed:" in _thread_failure(gloo, "parameter server 1", tmp_path)


# ---------------------------------------------------------------------- through the launcher

FAULTY = '''
import math
import threading

import torch.distributed.rpc as rpc
from torch import nn


def _break(thread):
    """Make one of scaletrain's background threads raise in this process."""
    from scaletrain.ps import endpoints, server

    error = ValueError(f"injected into {thread}")
    if thread == "leases":
        done = server.ParameterServer._done

        def _done(self):
            if threading.current_thread().name.endswith("-leases"):
                raise error
            return done(self)

        server.ParameterServer._done = _done
    elif thread == "sync":

        def _apply_sync(self, *args):
            raise error

        server.ParameterServer._apply_sync = _apply_sync
    elif thread == "heartbeat":
        send = rpc.rpc_async

        def rpc_async(to, func, *args, **kwargs):
            if func is endpoints.rpc_heartbeat:
                raise error
            return send(to, func, *args, **kwargs)

        rpc.rpc_async = rpc_async


def build(task, fault=""):
    if fault and not getattr(build, "broken", False):  # each process builds more than once
        build.broken = True
        _break(fault)
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(task.input_shape), task.num_classes))
'''

CONFIG = """
name = "ps-threads"
[model]
name = "faulty:build"
[model.kwargs]
fault = "{fault}"
[data]
source = "digits"
[train]
steps = 10000000
global_batch = 32
micro_batch = 32
[parallel]
strategy = "ps"
dp = 1
timeout_s = 3600
[ps]
mode = "{mode}"
worker_timeout_s = 2
[log]
quiet = true
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, mode, rank, who, thread",
    [
        ("leases", "async", 0, "parameter server 0", "ps-server-0-leases"),
        ("sync", "sync", 0, "parameter server 0", "ps-server-0-sync"),
        ("heartbeat", "async", 1, "worker 0", "ps-worker-0-heartbeat"),
    ],
)
def test_a_failed_thread_ends_the_run_with_one_paragraph_naming_it(
    tmp_path: Path, fault: str, mode: str, rank: int, who: str, thread: str
) -> None:
    """train.steps is far past what any machine runs in the test's time, and the RPC
    timeout far past the test's timeout: the run ends only because the thread failed."""
    (tmp_path / "faulty.py").write_text(textwrap.dedent(FAULTY))
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG.format(fault=fault, mode=mode))
    run_dir = tmp_path / "run"

    r = run_cli(
        ["train", str(config), "--nproc", "2", "--run-dir", str(run_dir)],
        timeout=RUN_TIMEOUT_S,
        cwd=tmp_path,
    )

    console = r.stdout + r.stderr
    assert r.returncode != 0, console[-3000:]
    errors = [line for line in console.splitlines() if line.startswith("scaletrain: error:")]
    assert len(errors) == 1, console[-3000:]
    said = f"{who}: thread {thread} failed: ValueError: injected into {fault}"
    assert said in errors[0] and f"rank {rank} " in errors[0], errors[0]
    assert "Traceback" not in console, console[-3000:]
    log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
    assert "Traceback (most recent call last)" in log and "ValueError: injected" in log, log[-3000:]
    assert not (run_dir / "summary.json").exists()
