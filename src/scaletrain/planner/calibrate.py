"""`scaletrain calibrate`: matmul FLOP/s per dtype on one thread, memory bandwidth, gloo's
collectives per world size (latency + bytes / bus bandwidth), FSDP2's first use, then GPT
tiny's own steps (reference.py), in ranks torch's elastic agent forks from one server that
imported torch once. A profile timed beside another job predicts every layout too slow, so
calibrate watches the machine's foreign load (runtime/load.py) and records it."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from scaletrain.errors import UserError
from scaletrain.launch.agent import LOOPBACK_ENV, SUBPROCESS_ENV
from scaletrain.planner import reference
from scaletrain.runtime.hardware import Link, Profile, cpu_name, total_memory
from scaletrain.runtime.load import Load, Meter, foreign_load, wait_quiet

SIZES = (4096, 16384, 65536, 2**26)  # `_fit` reads the three smallest and the largest
DTYPE_OF = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
QUIET_WAIT_S = 60.0  # how long `--busy wait` waits for the machine to go quiet
# what every rank imports: loaded once in the fork server, not once per rank
PRELOAD = ["torch", "torch.distributed.fsdp", "torch._dynamo", "scaletrain.training.trainer"]


class BusyMachine(UserError):
    pass


def _median_seconds(fn, *, reps: int, budget_s: float = 1.0) -> float:
    """`fn`'s median time over `reps` calls after a warm-up (3 at least, fewer past `budget_s`)."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < reps and (len(times) < 3 or time.perf_counter() - start <= budget_s):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_rate(dtype: torch.dtype, n: int = 1024) -> float:
    """FLOP/s of one thread on an n x n x n matmul."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _median_seconds(lambda: a @ b, reps=20, budget_s=0.5)


def memory_bandwidth() -> float:
    src = torch.ones(2**25)  # 128 MiB
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() * src.element_size() / seconds  # read and write


def _fit(points: list[tuple[float, float]]) -> Link:
    """t = latency + bytes / bw over (bytes on the wire, seconds), each size at its fastest:
    the latency the three smallest's, the bandwidth the largest's beyond it (a line fitted
    through them can put the latency below zero)."""
    fastest = {b: min(t for size, t in points if size == b) for b, _ in points}
    points = sorted(fastest.items())
    latency = min(t for _, t in points[:3])
    largest_bytes, largest_s = points[-1]
    return Link(bus_bw=largest_bytes / max(largest_s - latency, 1e-12), latency_s=latency)


def measure_first_use() -> int:
    """FSDP2's first use on 2 ranks spawned as a run's (a forked one shares the server's)."""
    return max(launch(2, reference.first_use_worker, start_method="spawn").values())


def collective_worker(sizes: tuple[int, ...]) -> dict:
    """One rank: each collective at each size, then the three smallest again, the same count
    of calls on every rank (a time budget could pair one's all-reduce with another's gather)."""
    torch.set_num_threads(1)
    with reference.gloo_group():
        out = {"all_reduce": [], "all_gather": []}
        world = dist.get_world_size()
        for nbytes in (*sizes, *sorted(sizes)[:3]):
            x = torch.ones(nbytes // 4)
            g = torch.empty(x.numel() * world)  # gathered
            reps = 15 if nbytes < 2**22 else 4
            t_ar = _median_seconds(partial(dist.all_reduce, x), reps=reps, budget_s=1e9)
            t_ag = _median_seconds(partial(dist.all_gather_single, g, x), reps=reps, budget_s=1e9)
            out["all_reduce"].append((2 * (world - 1) / world * nbytes, t_ar))
            out["all_gather"].append(((world - 1) * nbytes, t_ag))
        return out


def measure_link(world: int, *, sizes: tuple[int, ...] = SIZES) -> tuple[Link, dict]:
    """`world` ranks' gloo link, each term the worse of all-reduce's and all-gather's fits
    (reduce-scatter is all-gather's twin), and rank 0's timings."""
    got = launch(world, collective_worker, sizes)[0]
    fits = [_fit(got["all_reduce"]), _fit(got["all_gather"])]
    return Link(bus_bw=min(f.bus_bw for f in fits), latency_s=max(f.latency_s for f in fits)), got


def launch(world: int, fn, *args, start_method: str = "forkserver") -> dict:
    """`fn(*args)` on `world` ranks of torch's elastic agent, forked from the preloaded
    server (or spawned), on loopback as a one-node run: rank -> its result."""
    for key, value in {**SUBPROCESS_ENV, **LOOPBACK_ENV}.items():
        os.environ.setdefault(key, value)
    multiprocessing.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="scaletrain-rdzv-") as rdzv_dir:
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"calibrate-{os.getpid()}",
            rdzv_backend="c10d", rdzv_endpoint=str(Path(rdzv_dir) / "store"),
            rdzv_configs={"store_type": "file"}, local_addr="127.0.0.1", max_restarts=0,
            monitor_interval=0.1, start_method=start_method,
        )  # fmt: skip
        return elastic_launch(config, fn)(*args)


def calibrate(*, worlds: list[int], name: str, busy: str = "wait", say=print) -> Profile:
    """This machine's profile. `busy`, on a machine busy with other work: "wait" (up to
    QUIET_WAIT_S, then warn), "warn", or "refuse" (BusyMachine before or after measuring)."""
    load = foreign_load(1.0)
    if load.noisy and busy == "wait":
        say(f"{load.describe()}: waiting up to {QUIET_WAIT_S:.0f} s for the machine to go quiet")
        load = wait_quiet(limit_s=QUIET_WAIT_S)
    _judge(load, busy=busy, when="before calibrate began", say=say)
    loads = [load]

    @contextlib.contextmanager
    def phase(what: str):
        with Meter() as meter:
            yield
        loads.append(meter.load)
        if meter.load.noisy:
            say(f"{what}: {meter.load.describe()}; its figures are slower than this machine's")

    torch.set_num_threads(1)
    model, cores = reference.GPT_TINY, len(os.sched_getaffinity(0))
    with phase("matmuls and memory"):
        flops = {key: matmul_rate(dtype) for key, dtype in DTYPE_OF.items()}
        bw = memory_bandwidth()
    say(", ".join(f"matmul {k}: {v / 1e9:.1f} GFLOP/s per core" for k, v in flops.items()))
    say(f"memory bandwidth: {bw / 1e9:.1f} GB/s")
    with phase("reference steps"):
        concurrent = min(cores, max(worlds))  # as the busiest world keeps the cores busy
        costs = reference.step_costs(
            model, flops=flops, memory_bw=bw, concurrent=concurrent, launch=launch, say=say
        )
    intra = {}
    with phase("collectives"):
        first_use = measure_first_use()
        say(f"FSDP2's first use: {first_use / 2**20:.1f} MiB a rank")
        for world in worlds:
            link, _ = measure_link(world)
            intra[world] = dataclasses.replace(link, fsdp_rss=first_use)
            say(
                f"gloo on {world} ranks: bus bandwidth {link.bus_bw / 1e9:.2f} GB/s, "
                f"latency {link.latency_s * 1e6:.0f} us"
            )
    source = f"scaletrain calibrate on {cpu_name()}, {cores} cores, {time.strftime('%Y-%m-%d')}"
    profile = Profile(
        name=name, flops=flops, memory_bytes=total_memory(), memory_bw=bw, intra=intra,
        devices_per_node=max(worlds), cores=cores, **costs, source=source,
    )  # fmt: skip
    with phase("the heap's slack"):
        slack = reference.slack_probe(model, launch=launch, profile=profile, say=say)
        profile = dataclasses.replace(profile, **slack)
    with phase("sharded steps"):
        fields, links = reference.sharded_probes(
            model, launch=launch, profile=profile, worlds=tuple(intra), say=say
        )
    worst = max(loads, key=lambda load: load.foreign_cores)
    intra = {w: dataclasses.replace(link, **links.get(w, {})) for w, link in intra.items()}
    profile = dataclasses.replace(
        profile, intra=intra, **fields, foreign_cores=round(worst.foreign_cores, 3),
        steal_cores=round(max(load.steal_cores for load in loads), 3),
    )  # fmt: skip
    _judge(worst, busy=busy, when="while calibrate measured", say=say)
    return profile


def _judge(load: Load, *, busy: str, when: str, say) -> None:
    """Refuse a busy machine's figures under --busy refuse; else say that they are slow."""
    if not load.noisy:
        return
    paragraph = (
        f"{load.describe()} {when}. A profile taken beside another job predicts every layout "
        "too slow; the profile records the load (foreign_cores) and `scaletrain plan` "
        "repeats this warning. Stop the other work and run `scaletrain calibrate` again "
        "(--busy wait|warn|refuse chooses what calibrate does on a busy machine)."
    )
    if busy == "refuse":
        raise BusyMachine(paragraph)
    say(f"warning: {paragraph}")
