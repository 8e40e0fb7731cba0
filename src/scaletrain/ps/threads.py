"""The parameter-server strategy's background threads, started so that none dies alone.

A thread that raises ends by itself and nothing else notices: server 0's lease watcher
would stop declaring silent workers dead, a server's sync applier would stop applying
steps, a worker's heartbeat would stop renewing its lease, and everyone waiting on them
would wait until the RPC timeout. `start` wraps the thread's body: any exception it lets
out becomes a `ThreadFailed` naming the thread (the original as its cause, traceback
kept) and is handed to the owner, which ends the run with it (ps/server.py answers every
waiting worker with it; ps/worker.py raises it after the step). An exception there is a
bug of ours: ps/run.py writes its traceback to the rank's log and one paragraph naming the
thread to the console.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class ThreadFailed(RuntimeError):
    """A background thread raised; the message names it, `__cause__` is the exception."""

    def __init__(self, thread: str, error: BaseException) -> None:
        super().__init__(f"thread {thread} failed: {type(error).__name__}: {error}")
        self.thread = thread
        self.__cause__ = error


def start(
    body: Callable[[], None], *, name: str, on_failure: Callable[[ThreadFailed], None]
) -> threading.Thread:
    """Start a daemon thread `name` running `body`; an exception out of `body` goes to
    `on_failure` (on that thread, as its last act) as a ThreadFailed."""

    def run() -> None:
        try:
            body()
        except BaseException as e:  # noqa: BLE001  any way out is the owner's to report
            on_failure(ThreadFailed(name, e))

    thread = threading.Thread(target=run, daemon=True, name=name)
    thread.start()
    return thread
