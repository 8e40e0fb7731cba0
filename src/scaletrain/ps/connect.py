"""How the parameter servers and workers meet: one TCP store bound to ps.interface's address
(rank 0 binds it), RPC over TensorPipe on that interface only, and the servers' own gloo
group for their checkpoints."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.rpc as rpc

from scaletrain.config import Config, ConfigError
from scaletrain.ps.worker import server_name, worker_name
from scaletrain.runtime import tcp_store_on


def init_rpc(config: Config, rank: int, world: int, *, role: str, index: int):
    """RPC up on a rendezvous store that listens on ps.interface only; returns the store
    (the servers' checkpoint group uses it too)."""
    # TensorPipe listens on the interface TP_SOCKET_IFNAME names, and only there; the
    # servers' gloo group (checkpoints, sync's clipping norm) on GLOO_SOCKET_IFNAME's, which
    # gloo otherwise picks from the host name.
    os.environ["TP_SOCKET_IFNAME"] = config.ps.interface
    os.environ["GLOO_SOCKET_IFNAME"] = config.ps.interface
    store = _store(config, rank, world)
    # init_rpc meets on a store it makes from a URL: hand it ours through a scheme of our own.
    dist.register_rendezvous_handler(
        "scaletrain-ps", lambda url, **kw: iter([(store, rank, world)])
    )
    # The uv (TCP) transport and basic channel only: TensorPipe's shared-memory transport
    # busy-polls a core's share per process, which on a CPU host is taken from the workers'
    # compute.
    options = rpc.TensorPipeRpcBackendOptions(
        init_method="scaletrain-ps://",
        rpc_timeout=config.parallel.timeout_s,
        num_worker_threads=16,
        _transports=["uv"],
        _channels=["basic"],
    )
    name = server_name(index) if role == "server" else worker_name(index)
    with warnings.catch_warnings():  # init_rpc's unrelated deprecation notice (pytorch#149393)
        warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
        rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    return store


def interface_address(name: str) -> str:
    """The IPv4 address of a network interface ("lo" -> 127.0.0.1)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # SIOCGIFADDR
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise ConfigError(
                f"ps.interface = {name!r} has no IPv4 address on this machine "
                f"({e.strerror}); use an interface `ip -brief addr` lists"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def _store(config: Config, rank: int, world: int) -> dist.TCPStore:
    """The TCP store at MASTER_ADDR:MASTER_PORT that RPC and the servers' group meet on.

    c10d's own env:// rendezvous binds its store to every interface; rank 0 here listens on
    ps.interface's address only (runtime.tcp_store_on).
    """
    port, timeout = int(os.environ["MASTER_PORT"]), timedelta(seconds=config.parallel.timeout_s)
    address = interface_address(config.ps.interface)
    if rank != 0 and config.ps.interface != "lo":
        address = os.environ["MASTER_ADDR"]  # rank 0's host, reached over that interface
    return tcp_store_on(address, port, world_size=world, is_master=rank == 0, timeout=timeout)


def init_server_group(config: Config, store, index: int, *, servers: int) -> None:
    """A gloo group of the servers alone, for their checkpoints (DCP), on the rendezvous
    store (a PrefixStore keeps its keys apart from RPC's)."""
    if servers == 1:
        return
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("ps-servers", store),
        rank=index,
        world_size=servers,
        timeout=timedelta(seconds=config.parallel.timeout_s),
    )
