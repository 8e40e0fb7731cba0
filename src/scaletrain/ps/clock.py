"""When a worker may start its next step: the rules of async, SSP and sync, as data.

Every server keeps a `Clocks`: for each worker the number of its gradients it has applied
(its clock: the worker's next step), and which workers are dead or have left (neither is
live: nobody waits for them). A worker parked after its
push may go on when `may_start` says so:

- async: at once (Downpour SGD).
- ssp: while clock - (slowest live worker's clock) <= staleness (Stale Synchronous
  Parallel, Ho et al. 2013). staleness = 0 is bulk-synchronous.
- sync: the step's update is applied only when every live worker's gradient is in, so all
  live clocks move together; the server releases them then.

Two more rules apply in every mode (ps/server.py): the run is done once train.steps x
global_batch examples are applied, however many steps each worker took (a fast worker does
more than a straggler; a dead worker's share is made up by the others), and at a
checkpoint's global step no worker gets an answer until every live worker waits on the
server (a consistent cut: every server then holds the same gradients). The staleness of an update is measured in the same clocks: the step it
was computed for minus the slowest live worker's clock when its parameters were read, so
that ssp's bound is a bound on the logged staleness.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Clocks:
    """Per-worker clocks and membership. Every server keeps one; which workers are dead or
    gone is decided by server 0 alone and told to the others (ps/server.py)."""

    clock: dict[int, int]  # worker -> gradients applied (= its next step)
    dead: dict[int, str] = field(default_factory=dict)  # worker -> why it was declared dead
    left: set[int] = field(default_factory=set)  # workers that said goodbye

    @property
    def live(self) -> list[int]:
        """The workers sync, ssp and the checkpoint cut wait for: neither dead nor gone (a
        worker that left sends nothing more, so waiting for it would be waiting forever)."""
        return [w for w in self.clock if w not in self.dead and w not in self.left]

    def slowest(self) -> int | None:
        """The smallest clock of a live worker (None when none is alive)."""
        live = self.live
        return min(self.clock[w] for w in live) if live else None


def may_start(clocks: Clocks, worker: int, *, mode: str, staleness: int) -> bool:
    """May `worker` (alive, not finished, not at a checkpoint) start step clocks.clock[worker]?"""
    if mode == "ssp":
        return clocks.clock[worker] - clocks.slowest() <= staleness
    return True  # async; sync releases its workers when it applies the step


def staleness_of(step: int, *, slowest_at_read: int) -> int:
    """Steps between the one a gradient was computed for and the slowest live worker's
    clock when its parameters were read (0 under sync; <= the bound under ssp)."""
    return step - slowest_at_read
