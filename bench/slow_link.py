"""Two simulated nodes on one machine, joined by a real, slow link (bench/diloco.py's).

Two network namespaces are the nodes, joined by a veth pair, each end in one of them with
its own address; `tc` limits both ends (netem: a rate and a delay each way; a kernel without
netem, CONFIG_NET_SCH_NETEM, gets the rate alone from tbf, and `Link.note` says so). A node's
processes (`node_command`) run in its namespace, so they reach the other node only over the
link, and the bytes each end sent are read from its veth's counters (`Link.tx_bytes`).

Each node also needs a host name of its own that resolves, on both nodes, to its address on
the link: torch's c10d rendezvous resolves the machine's own name, and hands rank 0's name
to every worker as MASTER_ADDR. With the host's one name (which /etc/hosts often maps to a
loopback address) the second node's workers would look for rank 0's store on their own
loopback and wait there until the store times out; with a hosts file that lacks the name,
the rendezvous fails at once ("Temporary failure in name resolution"). So each node runs in its own UTS namespace (`unshare --uts`) under the
name `Node.hostname`, and `ip netns exec` bind-mounts /etc/netns/NS/hosts, naming both
nodes, over /etc/hosts. gloo's sockets go on the veth (GLOO_SOCKET_IFNAME). Nothing here
touches the machine's own interfaces.

`Link` is a context manager: entering removes what an earlier, killed run left (namespaces,
veths, hosts files), then builds; leaving removes all of it, whatever happened inside.
Needs root, iproute2 (`ip`, `tc`), util-linux `unshare` and network namespaces (`missing`
names the first one absent).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ETC_NETNS = Path("/etc/netns")  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*


@dataclass(frozen=True)
class Node:
    netns: str
    veth: str  # this node's end of the pair (at most 15 characters)
    addr: str
    hostname: str


NODES = (
    Node("stbench0", "stbench0-veth", "10.50.0.1", "stbench-node0"),
    Node("stbench1", "stbench1-veth", "10.50.0.2", "stbench-node1"),
)
# Environment a node must not inherit: it is a fresh machine, not a rank of some other job.
FOREIGN_ENV = ("SLURM_", "TORCHELASTIC_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_")

# --------------------------------------------------------------------------- the link


def missing() -> str | None:
    """Why this machine cannot build the link, in one line; None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc); run it as root"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"needs `{tool}` ({package}), not found on PATH"
    if not Path("/proc/self/ns/net").exists():
        return "needs network namespaces (/proc/self/ns/net is missing: no CONFIG_NET_NS)"
    return None


def sh(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run one setup command; a failure raises with its stderr."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")
    return done


class LinkError(RuntimeError):
    """A command that builds the link failed (the message names it)."""


def qdisc(*, rate_mbit: float, delay_ms: float, netem: bool) -> list[str]:
    """The root qdisc for one end: netem (delay and rate), or tbf (rate only).

    tbf's bucket holds 4 ms of traffic (at least 16 KiB, more than one GSO packet's share at
    a timer tick) and its queue at most 400 ms: TCP fills it and slows down, no drops.
    """
    if netem:
        return ["netem", "delay", f"{delay_ms:g}ms", "rate", f"{rate_mbit:g}mbit"]
    burst = max(16384, int(rate_mbit * 1e6 / 8 * 0.004))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "400ms"]


@dataclass
class Link:
    """The two namespaces and the veth pair between them, shaped on both ends.

    Use as a context manager: entering removes what an earlier run left, then builds; leaving
    removes everything, whatever happened inside.
    """

    rate_mbit: float
    delay_ms: float
    run: Callable[..., subprocess.CompletedProcess] = sh
    nodes: tuple[Node, Node] = NODES
    shaper: str = ""  # the qdisc in use, once shaped
    note: str = ""  # what the link could not do as asked

    def __enter__(self) -> Link:
        self.down()
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        a, b = self.nodes
        for n in self.nodes:
            self.run(["ip", "netns", "add", n.netns])
        self.run(["ip", "link", "add", a.veth, "type", "veth", "peer", "name", b.veth])
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.hostname}\n" for n in self.nodes)
        for n in self.nodes:
            self.run(["ip", "link", "set", n.veth, "netns", n.netns])
            self.run(["ip", "-n", n.netns, "addr", "add", f"{n.addr}/24", "dev", n.veth])
            self.run(["ip", "-n", n.netns, "link", "set", n.veth, "up"])
            self.run(["ip", "-n", n.netns, "link", "set", "lo", "up"])
            (ETC_NETNS / n.netns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / n.netns / "hosts").write_text(hosts)
        self.shape()

    def shape(self) -> None:
        """Both ends: netem when asked for a delay and the kernel has it, else tbf."""
        netem = self.delay_ms > 0
        for n in self.nodes:
            base = ["ip", "netns", "exec", n.netns, "tc", "qdisc", "add", "dev", n.veth, "root"]
            args = qdisc(rate_mbit=self.rate_mbit, delay_ms=self.delay_ms, netem=netem)
            done = self.run(base + args, check=not netem)
            if done.returncode != 0:  # no netem in this kernel (CONFIG_NET_SCH_NETEM)
                netem = False
                self.note = (
                    f"no added delay (asked {self.delay_ms:g} ms): tc could not add netem "
                    f"({done.stderr.strip()}); the rate alone is limited, with tbf"
                )
                self.run(base + qdisc(rate_mbit=self.rate_mbit, delay_ms=0, netem=False))
        self.shaper = "netem" if netem else "tbf"

    def down(self) -> None:
        """Remove both namespaces (their veth ends go with them) and the hosts files."""
        for n in self.nodes:
            self.run(["ip", "netns", "del", n.netns], check=False)
            self.run(["ip", "link", "del", n.veth], check=False)  # made, never moved
            shutil.rmtree(ETC_NETNS / n.netns, ignore_errors=True)
        if ETC_NETNS.is_dir() and not any(ETC_NETNS.iterdir()):
            ETC_NETNS.rmdir()

    def describe(self) -> str:
        delay = f"{self.delay_ms:g} ms delay" if self.shaper == "netem" else "no added delay"
        return f"{self.rate_mbit:g} Mbit/s and {delay} each way ({self.shaper} on both ends)"

    def tx_bytes(self) -> dict[str, int]:
        """Bytes each node has sent over the link so far."""
        sent = {}
        for n in self.nodes:
            path = f"/sys/class/net/{n.veth}/statistics/tx_bytes"  # as seen in its namespace
            sent[n.netns] = int(self.run(["ip", "netns", "exec", n.netns, "cat", path]).stdout)
        return sent


# One TCP connection from node 1 to node 0: 20 one-byte round trips (median RTT), then
# `nbytes` sent and acknowledged by one byte (throughput). Run with the venv's python.
PROBE = r"""
import socket, statistics, sys, time
mode, addr, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "serve":
    s = socket.create_server((addr, port))
    s.settimeout(30)
    c, _ = s.accept()
    for _ in range(20):
        c.sendall(c.recv(1))
    got = 0
    while got < nbytes:
        got += len(c.recv(1 << 20))
    c.sendall(b"k")
else:
    for _ in range(100):
        try:
            c = socket.create_connection((addr, port), timeout=30)
            break
        except OSError:
            time.sleep(0.1)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(20):
        t = time.perf_counter(); c.sendall(b"p"); c.recv(1); rtts.append(time.perf_counter() - t)
    t = time.perf_counter(); c.sendall(b"x" * nbytes); c.recv(1); t = time.perf_counter() - t
    print(statistics.median(rtts) * 1e3, nbytes * 8 / 1e6 / t)
"""


def probe(link: Link, *, port: int, nbytes: int) -> tuple[float, float]:
    """(median RTT in ms, Mbit/s from node 1 to node 0) measured over the link."""
    a, b = link.nodes
    run = ["ip", "netns", "exec"]
    server = subprocess.Popen(
        [*run, a.netns, sys.executable, "-c", PROBE, "serve", a.addr, str(port), str(nbytes)],
        stdout=subprocess.DEVNULL,
    )
    try:
        out = link.run(
            [*run, b.netns, sys.executable, "-c", PROBE, "send", a.addr, str(port), str(nbytes)]
        )
    finally:
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:  # the sender failed: stop the listener too
            server.kill()
            server.wait()
    rtt, mbit = map(float, out.stdout.split())
    return rtt, mbit


# --------------------------------------------------------------------------- the nodes


def node_command(
    node: Node,
    *,
    config: Path,
    overrides: list[str],
    nproc: int,
    endpoint: str,
    rdzv_id: str,
    run_dir: Path,
) -> list[str]:
    """One node's `scaletrain train`, inside its namespace under its own host name."""
    return [
        *("ip", "netns", "exec", node.netns),
        # a host name of its own, which resolves to its address on the link (see the module)
        *("unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', node.hostname),
        *(sys.executable, "-m", "scaletrain", "train", str(config), *overrides),
        *("--nnodes", "2", "--nproc", str(nproc), "--rdzv-endpoint", endpoint),
        *("--rdzv-id", rdzv_id, "--run-dir", str(run_dir)),
    ]


def node_env(node: Node, base: dict[str, str]) -> dict[str, str]:
    """`base` without another job's launcher variables, gloo on the veth, this checkout first."""
    env = {k: v for k, v in base.items() if not k.startswith(FOREIGN_ENV)}
    env["GLOO_SOCKET_IFNAME"] = node.veth
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), base.get("PYTHONPATH")) if p)
    return env


def run_nodes(
    cmds: list[list[str]], envs: list[dict], logs: list[Path], *, timeout: float
) -> list[int]:
    """Start every node, wait for all; when one fails or time runs out, stop the others.

    Each node is its own process group (the launcher and its workers), signalled by its id.
    """
    procs = []
    try:
        for cmd, env, log in zip(cmds, envs, logs):
            with log.open("w") as out:
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            stop(p)
    return [p.returncode for p in procs]


def stop(proc: subprocess.Popen, *, grace_s: float = 40) -> None:
    """SIGTERM a node's process group (it checkpoints nothing here), SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
