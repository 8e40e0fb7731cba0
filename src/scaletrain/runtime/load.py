"""Foreign load: the CPU time that processes outside this process's tree take on its CPUs.

A timing on a shared machine is only as good as the cores it had. `Meter` reads, at its
start and end, the busy time of the CPUs this process may run on (/proc/stat's `cpuN`
lines of `os.sched_getaffinity`) and the CPU time of this process's tree: itself, its reaped
children (`getrusage`) and its live descendants (/proc/PID/stat, through their parent
links). What the CPUs spent beyond the tree, per second, is foreign load: others' work,
which waiting may clear (`wait_quiet`). Steal, the time the hypervisor gave another VM,
slows a run as much but no waiting here clears it: it is reported apart. A child that left
the tree alive (a daemon that double-forked) counts as foreign from then on.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Collection
from dataclasses import dataclass

# A tenth of a core: a measurement using both cores of a 2-core machine (this project's
# development VM) loses at most 5% of its time to it, half the 10% the planner's pick is
# held to (bench/plan.py). The benches have retried runs above it since they began.
NOISY_CORES = 0.10


@dataclass(frozen=True)
class Load:
    """CPU-seconds per second of wall time that others took on this process's CPUs."""

    foreign_cores: float  # processes outside this tree (steal excluded)
    steal_cores: float  # another VM on the host
    wall_s: float

    @property
    def noisy(self) -> bool:
        return self.foreign_cores > NOISY_CORES

    def describe(self) -> str:
        return (
            f"{self.foreign_cores:.1f} cores busy outside this run "
            f"({self.steal_cores:.1f} stolen by another VM)"
        )


def cpu_ticks(stat: str, cpus: Collection[int]) -> tuple[int, int]:
    """(busy, steal) clock ticks of `cpus` in /proc/stat's text `stat`.

    Busy is user + nice + system (guest time is inside user and nice). irq and softirq are
    left out: 2 gloo ranks all-reducing over loopback spend about NOISY_CORES in softirq
    (BENCHMARKS.md, "the planner's calibrate"), which a kernel built with
    IRQ_TIME_ACCOUNTING charges to no process, so our own collectives would read as foreign. Under tick accounting the
    interrupted process is charged too, and leaving them out only undercounts others by it.
    """
    busy = steal = 0
    for line in stat.splitlines():
        name, _, values = line.partition(" ")
        if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, *_, st = map(int, values.split()[:8])
            busy += user + nice + system
            steal += st
    return busy, steal


def tree_cpu_s() -> float:
    """CPU seconds used so far by this process, its reaped children and its live
    descendants. A child reaped between two samples moves from the walk to RUSAGE_CHILDREN,
    so each sample is the tree's whole time at its instant."""
    own = sum(
        r.ru_utime + r.ru_stime
        for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                # after the command's ")": state, ppid, ..., utime, stime, cutime, cstime
                rest = f.read().rpartition(")")[2].split()
        except OSError:  # it exited since the listing
            continue
        ticks = sum(map(int, rest[11:15]))
        children.setdefault(int(rest[1]), []).append((int(entry.name), ticks))
    ticks, parents = 0, [os.getpid()]
    while parents:
        for pid, t in children.get(parents.pop(), ()):
            ticks += t
            parents.append(pid)
    return own + ticks / os.sysconf("SC_CLK_TCK")


def _sample(cpus: Collection[int]) -> tuple[float, float, float, float]:
    """(wall, busy s, steal s, tree CPU s), now."""
    with open("/proc/stat") as f:
        busy, steal = cpu_ticks(f.read(), cpus)
    hz = os.sysconf("SC_CLK_TCK")
    return time.perf_counter(), busy / hz, steal / hz, tree_cpu_s()


class Meter:
    """`with Meter() as m: ...`, then `m.load`: the foreign load while the block ran."""

    def __enter__(self) -> Meter:
        self._cpus = os.sched_getaffinity(0)  # the block may pin itself elsewhere
        self._start = _sample(self._cpus)
        return self

    def __exit__(self, *exc) -> None:
        self.load = self.now()

    def now(self) -> Load:
        """The foreign load since the block began."""
        wall, busy, steal, own = (b - a for a, b in zip(self._start, _sample(self._cpus)))
        wall = max(wall, 1e-9)
        return Load(max(0.0, busy - own) / wall, steal / wall, wall)


def foreign_load(seconds: float = 1.0) -> Load:
    """The foreign load over `seconds` of sleep."""
    with Meter() as m:
        time.sleep(seconds)
    return m.load


def wait_quiet(*, limit_s: float, threshold: float = NOISY_CORES, step_s: float = 1.0) -> Load:
    """Sample `step_s` at a time until a sample's foreign load is at most `threshold` or
    `limit_s` has passed; the last sample."""
    deadline = time.monotonic() + limit_s
    while True:
        load = foreign_load(step_s)
        if load.foreign_cores <= threshold or time.monotonic() >= deadline:
            return load
