"""`scaletrain calibrate`: measure this machine and write its hardware profile.

- Matmul FLOP/s per dtype with one thread, at the shapes the model multiplies when a config
  is given (tokens of a micro-batch x each linear layer's in x out, weighted by FLOPs), else
  at 1024^3. A CPU profile keeps the per-core rate and the core count: a rank of a world
  of N on C cores gets max(1, C // N) threads, and shares the cores when N > C.
- Memory bandwidth: a large tensor copied (the optimizer's and element-wise work's bound).
- All-reduce and all-gather on the backend, per world size, at message sizes from 4 KiB to
  64 MiB and the three smallest again after them, timed on ranks started by torch's own
  elastic agent (`elastic_launch`): latency and bus bandwidth fitted to t = latency + bytes
  on the wire / bandwidth (`_fit`, each size at its fastest look); on the same ranks,
  FSDP's and tensor parallelism's cost per collective call (reference.py).
- What a step costs beyond its matmuls, fitted from real steps of a reference model
  (reference.py); a rank's resident memory beyond its live tensors, from the model
  trained by the trainer on 2 ranks under DDP; and from its sharded steps on 2 ranks, the
  resident bytes FSDP2 holds per byte of parameters and DTensor per live byte, and their
  costs per step and per collective call on the model's own units, and on each larger
  world size a cost per step and per call of its own in groups of 2, and per call over
  the world.
- The machine's pace: the reference timed again before the sharded probes and after each
  (reference.pace), their steps taken at the reference's speed; and the whole profile
  then kept at the median of those paces and the reference's own moment
  (hardware.slowed): a shared VM's speed moves by a quarter from minute to minute, and a
  profile is for the machine's typical speed, not one minute's.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from scaletrain.launch.agent import LOOPBACK_ENV, SUBPROCESS_ENV
from scaletrain.planner.reference import (
    GPT_TINY,
    collective_overheads,
    fastest_looks,
    first_use_worker,
    gloo_group,
    model_label,
    sharded_probes,
    slack_probe,
    step_costs,
)
from scaletrain.runtime.hardware import Link, Profile, cpu_name, slowed

SIZES = tuple(4096 * 4**k for k in range(8))  # 4 KiB .. 64 MiB
DTYPE_OF = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


def _median_seconds(fn, *, reps: int, budget_s: float = 1.0) -> float:
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    return statistics.median(times)


def matmul_rate(dtype: torch.dtype, shapes: list[tuple[int, int, int]]) -> float:
    """FLOP/s of one thread over `shapes` (m, k, n), the total FLOPs over the total time."""
    flops = seconds = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        seconds += _median_seconds(lambda a=a, b=b: a @ b, reps=20, budget_s=0.5)
        flops += 2 * m * k * n
    return flops / seconds


def memory_bandwidth() -> float:
    src = torch.ones(2**25)  # 128 MiB
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() * src.element_size() / seconds  # read and write


def _fit(points: list[tuple[float, float]]) -> Link:
    """t = latency + bytes / bw from (bytes on the wire, seconds), a size timed in more than
    one look taken at its fastest: the latency is the fastest of the three smallest
    messages, the bandwidth the largest's rate beyond it (a least-squares line over sizes
    4 KiB..64 MiB is all large messages and puts the intercept anywhere, below zero
    included). On gloo, 2 ranks' median all-reduce of a small message sits at 2-4 ms about
    one look in three, 0.2-0.8 ms otherwise (21 of 64 looks, with or without a busy
    neighbour): all three smallest sat there once (GPT small's calibrate read 3.3 ms), so
    `collective_worker` looks at them again after the largest (six looks)."""
    points = sorted(fastest_looks(points).items())
    latency = min(t for _, t in points[:3])
    largest_bytes, largest_s = points[-1]
    return Link(bus_bw=largest_bytes / max(largest_s - latency, 1e-12), latency_s=latency)


def collective_worker(sizes: tuple[int, ...]) -> dict:
    """One rank of the collectives' measurement (started by elastic_launch)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    with gloo_group():
        world = dist.get_world_size()
        out = {"all_reduce": [], "all_gather": []}
        for nbytes in (*sizes, *sorted(sizes)[:3]):  # the smallest again, after the largest
            x = torch.ones(nbytes // 4)
            gathered = torch.empty(x.numel() * world)

            def reduce(x=x):
                dist.all_reduce(x)

            def gather(x=x, g=gathered):
                dist.all_gather_single(g, x)

            # the same count on every rank (a time budget would let ranks stop apart and
            # pair one rank's all-reduce with another's all-gather: a hang)
            reps = 15 if nbytes < 2**22 else 4
            t_ar = _median_seconds(reduce, reps=reps, budget_s=float("inf"))
            t_ag = _median_seconds(gather, reps=reps, budget_s=float("inf"))
            # bytes each rank puts on the wire in a ring
            out["all_reduce"].append((2 * (world - 1) / world * nbytes, t_ar))
            out["all_gather"].append(((world - 1) * nbytes, t_ag))
        out.update(collective_overheads(world))
        return out


def measure_collectives(world: int, *, sizes: tuple[int, ...] = SIZES) -> tuple[Link, Link, dict]:
    """(all-reduce, all-gather, FSDP's and TP's seconds per call) of `world` ranks of this
    machine on gloo."""
    got = _launch(world, collective_worker, sizes)[0]
    return _fit(got["all_reduce"]), _fit(got["all_gather"]), got


def measure_first_use(world: int) -> dict[str, int]:
    """The resident bytes a rank adds on its first FSDP2 steps, in fresh ranks
    (reference.first_use_worker); the largest rank's."""
    return {"fsdp_rss": max(_launch(world, first_use_worker).values())}


def _launch(world: int, fn, *args) -> dict:
    """`fn(*args)` on `world` ranks started by torch's elastic agent; rank -> its result."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # loopback only, as a single-node `scaletrain train` (launch.LOOPBACK_ENV): a file-backed
    # rendezvous, rank 0's group store on 127.0.0.1 (gloo_group), gloo on `lo`
    for key, value in {**SUBPROCESS_ENV, **LOOPBACK_ENV}.items():
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory(prefix="scaletrain-rdzv-") as rdzv_dir:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=world,
            run_id=f"calibrate-{os.getpid()}",
            rdzv_backend="c10d",
            rdzv_endpoint=str(Path(rdzv_dir) / "store"),
            rdzv_configs={"store_type": "file"},
            local_addr="127.0.0.1",
            max_restarts=0,
            monitor_interval=0.1,
            start_method="spawn",
        )
        return elastic_launch(config, fn)(*args)


def calibrate(
    *,
    worlds: list[int],
    shapes: list[tuple[int, int, int]] | None,
    reference: dict | None = None,
    name: str,
    say=print,
) -> Profile:
    """Measure this machine (module docstring) and return its profile.

    Args:
        shapes: the model's matmul shapes (m, k, n); None: 1024^3.
        reference: the config (as a dict) whose model's real steps fit the costs beyond the
            matmuls (reference.py); None: the built-in GPT tiny.
    """
    torch.set_num_threads(1)
    shapes = shapes or [(1024, 1024, 1024)]
    flops = {}
    for key in ("fp32", "bf16", "fp64"):
        flops[key] = matmul_rate(DTYPE_OF[key], shapes)
        say(f"matmul {key}: {flops[key] / 1e9:.1f} GFLOP/s per core")
    bw = memory_bandwidth()
    say(f"memory bandwidth: {bw / 1e9:.1f} GB/s")
    cores = len(os.sched_getaffinity(0))
    # the reference steps as the busiest world's ranks run them: side by side on its cores
    busy = min(cores, max(worlds))
    costs = step_costs(
        reference, flops=flops, memory_bw=bw, concurrent=busy, launch=_launch, say=say
    )
    say(
        f"beyond the matmuls: {costs['op_s'] * 1e6:.1f} us per op, "
        f"{costs['byte_s'] * 1e9:.3f} ns per byte written"
    )
    intra = {}
    for world in worlds:
        *links, calls = measure_collectives(world)
        for kind, link in zip(("all-reduce", "all-gather"), links, strict=True):
            say(
                f"gloo {kind}, {world} ranks: bus bandwidth {link.bus_bw / 1e9:.2f} GB/s, "
                f"latency {link.latency_s * 1e6:.0f} us"
            )
        first = measure_first_use(world)
        say(
            f"{world} ranks, per call: FSDP {calls['fsdp_call_s'] * 1e6:.0f} us, "
            f"tensor parallel {calls['tp_call_s'] * 1e6:.0f} us; FSDP's first use per rank: "
            f"{first['fsdp_rss'] / 2**20:.1f} MiB"
        )
        # one link per world size: the slower of the two (reduce-scatter is all-gather's twin)
        intra[world] = Link(
            bus_bw=min(link.bus_bw for link in links),
            latency_s=max(link.latency_s for link in links),
            fsdp_call_s=calls["fsdp_call_s"],
            tp_call_s=calls["tp_call_s"],
            **first,
        )
    profile = Profile(
        name=name,
        flops=flops,
        memory_bytes=_total_memory(),
        memory_bw=bw,
        intra=intra,
        devices_per_node=max(worlds),
        overlap=False,
        cores=cores,
        **costs,
        calibrated_on=model_label((reference or GPT_TINY)["model"]),
        source=f"scaletrain calibrate on {cpu_name()}, {cores} cores, {time.strftime('%Y-%m-%d')}",
    )
    profile = dataclasses.replace(
        profile, **slack_probe(reference, launch=_launch, profile=profile, say=say)
    )
    fields, links, paces = sharded_probes(
        reference,
        launch=_launch,
        profile=profile,
        worlds=tuple(intra),
        concurrent=busy,
        say=say,
    )
    # the configured model's own costs per call replace the Linear stack's where a probe
    # measured them; the rest (a model without a TP plan, tp over a whole world > 2) keep
    # the stack's
    intra = {w: dataclasses.replace(link, **links.get(w, {})) for w, link in intra.items()}
    profile = dataclasses.replace(profile, intra=intra, **fields)
    # Everything above was timed at (or taken to) the machine's speed when the reference
    # ran, one minute of it. A shared VM's speed moves by a quarter from minute to minute:
    # the profile is kept at the median of that moment and every pace timed since.
    typical = statistics.median([1.0, *paces])
    say(
        "the machine over calibrate: "
        + ", ".join(f"{x:.2f}" for x in [1.0, *paces])
        + f"x as slow as at the reference; the profile is kept at the median, {typical:.2f}x"
    )
    return slowed(profile, typical)


def _total_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0
