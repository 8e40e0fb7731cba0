"""The parameter server's RPC entry points: module-level functions TensorPipe calls by their
qualified name in the server's process, each routed to the one server `serve` registered."""

from __future__ import annotations

import threading

import torch
import torch.distributed.rpc as rpc

from scaletrain.ps.messages import Push, Reply
from scaletrain.ps.server import ParameterServer
from scaletrain.records.memory import global_bytes

_SERVER: ParameterServer | None = None
_READY = threading.Event()
_READY_TIMEOUT_S = 600.0


def serve(server: ParameterServer) -> None:
    """Make `server` the one this process's rpc_* functions route to."""
    global _SERVER
    _SERVER = server
    _READY.set()


def _server() -> ParameterServer:
    if not _READY.wait(_READY_TIMEOUT_S):  # a worker that calls in before the server is built
        raise RuntimeError("the parameter server did not start in time")
    return _SERVER


def rpc_join(worker: int) -> Reply:
    return _server().join(worker)


@rpc.functions.async_execution
def rpc_push(push: Push) -> torch.futures.Future:
    return _server().push(push)


def rpc_heartbeat(worker: int) -> bool:
    return _server().heartbeat(worker)


def rpc_leave(worker: int) -> None:
    _server().leave(worker)


def rpc_membership(worker: int, why: str | None) -> None:
    _server().membership(worker, why)


def rpc_cut(step: int, examples: int, timeout_s: float) -> None:
    _server().cut(step, examples, timeout_s=timeout_s)


def rpc_snapshot() -> dict[str, torch.Tensor]:
    return _server().snapshot()


def rpc_version() -> int:
    return _server().version


def rpc_param_bytes() -> int:
    """The bytes of the parameters this server holds (its partition)."""
    return global_bytes(_server().params)
