"""What `scaletrain calibrate` learns from a model's real training steps.

A CPU's small-model step is mostly outside its matmuls (dispatch and autograd, memory-bound
element-wise work, FSDP2's and DTensor's Python around each collective), and a process holds
more than its live tensors. No kernel benchmark shows either, so calibrate trains a model in
fresh ranks and fits what the planner lacks (the profiling cost model of Galvatron and Alpa):
`step_costs` (op_s, byte_s), `slack_probe` (rss_ratio), `sharded_probes` (FSDP2's and
DTensor's costs) and `first_use_bytes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

GPT_TINY = {
    "model": {"name": "gpt", "size": "tiny"},
    "data": {"source": "wikitext", "seq_len": 128},
    "train": {"seed": 0, "micro_batch": 16},
}
STEP_WAIT_S = 600.0  # a reference rank that keeps the others waiting longer has failed
# steps after which the slack probe's resident peak has stopped rising: GPT tiny's under DDP
# is within 5% of its 160-step peak by then (BENCHMARKS.md, calibrate)
SETTLE_STEPS = 60
# a probe that only times steps: 3 windows of 8 after the warm-up one (24 steps left the
# per-step costs to noise, 40 took calibrate past 2 minutes: BENCHMARKS.md, calibrate)
TIMED_STEPS = 32
WINDOWS = 4  # a probe logs its steps in 4 windows; the first two warm up
KINDS = ("fsdp", "tp")
SHARDED_DIM = {"fsdp": "dp_shard", "tp": "tp"}  # the mesh dimension of each kind's groups
# a fit's points: a rank's examples in 1, 2 and 4 micro-batches a step (1, 2 and 4 times the
# calls), three points on 2 ranks so that one look's noise moves the fit by its share only;
# on more ranks than cores the two far ends (their steps are slower)
LOOKS = (1, 2, 4)
WIDE_LOOKS = (1, 4)


def _config(data: dict, parallel: dict, *, train: dict, **sections):
    """`data` (a config as a dict) under `parallel`, [train] updated, `sections` replaced."""
    from scaletrain.config import validate_config

    data = {k: dict(v) for k, v in data.items() if isinstance(v, dict)}
    data.setdefault("train", {}).update(train)
    return validate_config(data | sections | {"parallel": dict(parallel)})


def reference_config(data: dict, micro_batch: int):
    """`data` as one process training micro-batches of `micro_batch`."""
    return _config(data, {}, train={"micro_batch": micro_batch, "global_batch": micro_batch})


def _micro_batch(data: dict) -> int:
    return int(data.get("train", {}).get("micro_batch", 16))


def reference_batches(data: dict) -> tuple[int, ...]:
    """A quarter, half, once and twice the configured micro-batch: a layout's chunk sizes."""
    mb = _micro_batch(data)
    return tuple(sorted({max(1, mb // 4), max(1, mb // 2), mb, 2 * mb}))


def reference_rank(data: dict, micro_batches: tuple[int, ...], steps: int = 12) -> dict:
    """`step_worker` in a gloo group that waits STEP_WAIT_S for the slowest rank."""
    with gloo_group(timeout_s=STEP_WAIT_S):
        return step_worker(data, micro_batches, steps)


def step_worker(data: dict, micro_batches: tuple[int, ...], steps: int = 12) -> dict:
    """The reference on one thread under the run's heap policy: `steps` rounds of a step at
    each micro-batch in turn (a slow minute falls on each alike), each begun together in a
    process group; per micro-batch the median step after two warm-up rounds."""
    import torch.distributed as dist

    from scaletrain.planner import build_for_plan
    from scaletrain.precision import make_precision
    from scaletrain.runtime.allocator import configure_allocator
    from scaletrain.training.assemble import build_net, build_objective, tensor_bytes
    from scaletrain.training.optim import from_section
    from scaletrain.training.step import forward

    torch.set_num_threads(1)
    config = reference_config(data, max(micro_batches))
    dataset, _ = build_for_plan(config)
    precision = make_precision(config.precision.mode, device_type="cpu")
    net = build_net(config, dataset)
    configure_allocator(config.train.allocator, device_type="cpu", model_bytes=tensor_bytes(net))
    model, loss_fn, _ = build_objective(config, net, dataset, precision=precision)
    model = precision.convert_module(model)
    optimizer, _ = from_section(model, config.optim, total_steps=1)  # as the run builds it
    batches = {mb: dataset.get(torch.arange(mb) % len(dataset)) for mb in micro_batches}
    times: dict[int, list[float]] = {mb: [] for mb in micro_batches}
    for _ in range(steps):
        for mb, batch in batches.items():
            if dist.is_initialized():
                dist.barrier()
            t = time.perf_counter()
            with precision.forward_context():
                loss, _ = loss_fn(forward(model, batch, precision), batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times[mb].append(time.perf_counter() - t)
    return {"step_s": {mb: statistics.median(t[2:]) for mb, t in times.items()}}


def step_costs(
    data: dict, *, flops: dict[str, float], memory_bw: float, concurrent: int, launch, say=print
) -> dict[str, float]:
    """`op_s` and `byte_s`: each reference step less the planner's with neither cost, fitted
    to ops x op_s + bytes written x byte_s. The reference runs in `concurrent` ranks side by
    side, as the busiest world keeps the cores busy; a step is its slowest rank's (a
    synchronous step waits for it). `launch(n, fn, *args)`: rank -> result."""
    from scaletrain.planner import predict_configured
    from scaletrain.runtime.hardware import Profile

    bare = Profile(name="bare", flops=flops, memory_bytes=2**62, memory_bw=memory_bw, cores=1)
    batches = reference_batches(data)
    ranks = launch(concurrent, reference_rank, data, batches).values()
    rows = []
    for mb in batches:
        step_s = max(r["step_s"][mb] for r in ranks)
        pred = predict_configured(reference_config(data, mb), world_size=1, profile=bare)
        rows.append((pred.terms.ops, pred.terms.written, step_s - pred.step_time_s))
        say(f"reference step, micro-batch {mb}, {concurrent} at once: {step_s * 1e3:.1f} ms")
    op_s, byte_s = _nonneg_fit(rows)
    return {"op_s": op_s, "byte_s": byte_s}


def probe_parallel(kind: str, *, world: int, group: int) -> dict:
    """A probe's [parallel] keys: `kind`'s groups of `group` ranks, the rest of the world
    FSDP's replicas (HSDP) or tensor parallelism's pipeline stages."""
    rest = {"fsdp": "dp_replicate", "tp": "pp"}[kind]
    return {SHARDED_DIM[kind]: group, **({rest: world // group} if world > group else {})}


def sharded_config(data: dict, parallel: dict, *, steps: int = SETTLE_STEPS, accumulation: int = 1):
    """`data` trained under `parallel` for `steps` steps, each rank taking the configured
    micro-batch's examples in `accumulation` micro-batches, logged in WINDOWS windows, no
    checkpoint, 8 examples of evaluation."""
    mb = _micro_batch(data) // accumulation
    replicas = parallel.get("dp_replicate", 1) * parallel.get("dp_shard", 1)
    train = {"micro_batch": mb, "global_batch": mb * accumulation * replicas, "steps": steps}
    train |= {"eval_every": 0, "eval_examples": 8}
    log = {"every": max(1, steps // WINDOWS), "quiet": True}
    return _config(data, parallel, train=train, log=log, checkpoint={"every": 0})


def sharded_worker(data: dict, parallel: dict, steps: int, accumulation: int, run_dir: str) -> None:
    """One rank of a probe: the trainer itself."""
    import torch.distributed as dist

    from scaletrain.training.trainer import train

    try:
        config = sharded_config(data, parallel, steps=steps, accumulation=accumulation)
        train(config, run_dir=Path(run_dir))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def slack_probe(data: dict, *, launch, profile, steps: int = SETTLE_STEPS, say=print) -> dict:
    """`rss_ratio`: the model on 2 ranks under DDP for `steps` steps, its largest peak above
    baseline per live byte the planner predicts (its peak less the parameters, which the
    baseline holds, as do DDP's gradients, in its buckets since set-up); {} where it fails."""
    bare = dataclasses.replace(_without_sharding_costs(profile), rss_ratio=1.0)
    settled = _probe(data, {"dp_replicate": 2}, 2, steps, launch, bare, say)
    if settled is None:
        return {}
    memory, train = settled[0].memory_bytes, settled[1]
    peak = max(r["window_peak_above_baseline_bytes"] for r in train)
    live = memory["peak"] - memory["params"]
    value = max(1.0, (peak + memory["grads"]) / live)
    say(
        f"ddp on 2 ranks, {steps} steps: {peak / 2**20:.1f} MiB above baseline, "
        f"{(live - memory['grads']) / 2**20:.1f} MiB of live tensors predicted: "
        f"resident memory {value:.2f} x the live tensors"
    )
    return {"rss_ratio": value}


def sharded_probes(
    data: dict,
    *,
    launch,
    profile,
    worlds: tuple[int, ...] = (2,),
    timed_steps: int = TIMED_STEPS,
    say=print,
) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """FSDP2's and DTensor's costs on the model's own steps: the profile's fields and each
    world's link fields. Per kind, on 2 ranks: probes at LOOKS, whose excess over the
    planner's step is fitted to `{kind}_step_s` + calls x `{kind}_call_s`. On each larger
    world the same fit in groups
    of 2 (`{kind}_pair_*`: with more ranks than cores a call waits on fewer peers), and over
    the whole world its cost per call beside the 2-rank cost per step. A probe the model
    cannot run, or whose rank dies, fits nothing. `profile`: this machine's so far."""
    bare = _without_sharding_costs(profile)
    fields: dict[str, float] = {}
    links: dict[int, dict[str, float]] = {world: {} for world in worlds}

    def probe(parallel, world, run_steps, accumulation=1, plan=bare):
        return _probe(data, parallel, world, run_steps, launch, plan, say, accumulation)

    def fit(kind, parallel, world, looks):
        runs = [probe(parallel, world, timed_steps, a) for a in looks if a <= _micro_batch(data)]
        label = f"{kind} on 2 ranks" if world == 2 else f"{kind} as {parallel} on {world} ranks"
        return _fit_looks(runs, kind, parallel=parallel, label=label, say=say)

    for kind in KINDS:
        fitted = fit(kind, probe_parallel(kind, world=2, group=2), 2, LOOKS)
        if fitted is None:
            continue
        step_s, call_s = fitted
        fields[f"{kind}_step_s"], links.setdefault(2, {})[f"{kind}_call_s"] = step_s, call_s
        for world in (w for w in worlds if w > 2):
            fitted = fit(kind, probe_parallel(kind, world=world, group=2), world, WIDE_LOOKS)
            if fitted is not None:  # a pair cost of 0 means none measured: 1e-12 at least
                links[world][f"{kind}_pair_step_s"] = fitted[0]
                links[world][f"{kind}_pair_call_s"] = max(fitted[1], 1e-12)
            whole = probe_parallel(kind, world=world, group=world)
            stepped = dataclasses.replace(bare, **{f"{kind}_step_s": step_s})
            run = probe(whole, world, timed_steps, plan=stepped)
            excess, calls = _excess(*run, kind) if run else (0.0, 0)
            if calls:
                call_s = links[world][f"{kind}_call_s"] = max(0.0, excess / calls)
                say(
                    f"{kind} as {whole} on {world} ranks: {excess * 1e3:.1f} ms beyond the "
                    f"plan and its cost per step, {calls} calls: {call_s * 1e6:.0f} us a call"
                )
    return fields, links


def _probe(data, parallel, world, steps, launch, bare, say, accumulation=1):
    """(the planner's prediction for one probe, its logged training windows); None where the
    launcher's checks refuse the layout or a rank died."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from scaletrain.errors import UserError
    from scaletrain.planner import predict_configured

    config = sharded_config(data, parallel, steps=steps, accumulation=accumulation)
    try:
        pred = predict_configured(config, world_size=world, profile=bare)
    except UserError as e:
        say(f"{parallel} on {world} ranks: not measured, the model cannot run it ({e})")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            launch(world, sharded_worker, data, parallel, steps, accumulation, tmp)
        except ChildFailedError as e:
            failed = "; ".join(f"rank {r}: {f.message}" for r, f in sorted(e.failures.items()))
            say(f"{parallel} on {world} ranks: not measured, a rank failed ({failed})")
            return None
        rows = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return pred, [r for r in rows if r.get("kind") == "train"]


def _fit_looks(runs: list, kind: str, *, parallel: dict, label: str, say):
    """(cost per step, cost per call) fitted to the probes' excess over the plan, said; None
    where none ran or no calls are planned (no TP plan the planner sees)."""
    looks = [_excess(pred, train, kind) for pred, train in filter(None, runs)]
    if not looks or not looks[0][1]:
        return None
    share = 1.0 / parallel.get("pp", 1)  # a pipeline stage pays its share of the step
    step_s, call_s = _nonneg_fit([(share, calls, excess) for excess, calls in looks])
    said = ", ".join(f"{e * 1e3:.1f} ms beyond the plan with {c} calls" for e, c in looks)
    say(f"{label}: {said}; fitted: {step_s * 1e3:.1f} ms a step + {call_s * 1e6:.0f} us a call")
    return step_s, call_s


def _excess(pred, train: list[dict], kind: str) -> tuple[float, int]:
    """(the median logged step of the run's second half less the planner's, its calls): the
    first half holds a fresh rank's warm-up, its heap still growing (BENCHMARKS.md)."""
    step_s = statistics.median(r["step_time_s"] for r in train[len(train) // 2 :])
    return step_s - pred.step_time_s, pred.calls_by_dim.get(SHARDED_DIM[kind], 0)


def _without_sharding_costs(profile):
    """`profile` without FSDP2's or DTensor's costs (1e-12 a call: 0 means the latency)."""
    none = {f"{k}_{c}_s": 1e-12 for k in KINDS for c in ("call", "pair_call")}
    none |= {f"{k}_pair_step_s": 0.0 for k in KINDS}
    intra = {w: dataclasses.replace(link, **none) for w, link in profile.intra.items()}
    return dataclasses.replace(profile, intra=intra, fsdp_step_s=0.0, tp_step_s=0.0)


def _nonneg_fit(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(p, q), neither below 0, with x p + y q closest to t over `points` (x, y, t): scipy's
    non-negative least squares (one point: all of it on the larger term)."""
    from scipy.optimize import nnls

    (p, q), _ = nnls([(x, y) for x, y, _ in points], [t for *_, t in points])
    return float(p), float(q)


def first_use_bytes(*, units: int = 8, width: int = 64) -> int:
    """In a fresh rank of an open gloo group: the resident rise of its first FSDP2 steps on a
    Linear stack, after plain steps and a collective warmed the rest (autograd, kernels,
    gloo): the code and state FSDP2 loads on first use, a fixed cost per process."""
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401 imported before the baseline, as a run does
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from scaletrain.records.memory import lifetime_peak_bytes

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    x = torch.randn(8, width)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(units)))
    for _ in range(3):
        model(x).sum().backward()
        dist.all_reduce(torch.ones(1024))
    before = lifetime_peak_bytes()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    model = fully_shard(model, mesh=mesh)
    for _ in range(3):
        model(x).sum().backward()
    dist.barrier()
    return lifetime_peak_bytes() - before


@contextlib.contextmanager
def gloo_group(timeout_s: float = 120.0) -> Iterator[None]:
    """This rank's gloo group (the elastic agent's environment, its store on loopback as a
    run's), closed on the way out; a collective that waits `timeout_s` raises."""
    import torch.distributed as dist

    from scaletrain.runtime import init_distributed, read_env

    init_distributed(read_env(), backend="gloo", timeout_s=timeout_s)
    try:
        yield
    finally:
        dist.destroy_process_group()
