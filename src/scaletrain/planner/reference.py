"""What `scaletrain calibrate` learns from a model's own training steps. A CPU's small-model
step is mostly outside its matmuls (dispatch, autograd, element-wise work, FSDP2's and
DTensor's Python around each collective) and a process holds more than its live tensors: no
kernel benchmark shows these, so calibrate trains a model in fresh ranks and fits what the
planner lacks, as the profiling cost models of Galvatron and Alpa do."""

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
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401 before first_use_worker's baseline, as a run's
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.fsdp import fully_shard

from scaletrain.config import validate_config
from scaletrain.errors import UserError
from scaletrain.planner import build_for_plan, predict_configured
from scaletrain.precision import make_precision
from scaletrain.records.memory import lifetime_peak_bytes
from scaletrain.runtime import init_distributed, read_env
from scaletrain.runtime.allocator import configure_allocator
from scaletrain.runtime.hardware import Profile
from scaletrain.training.assemble import build_net, build_objective, tensor_bytes
from scaletrain.training.optim import from_section
from scaletrain.training.step import forward

GPT_TINY = {
    "model": {"name": "gpt", "size": "tiny"},
    "data": {"source": "wikitext", "seq_len": 128},
    "train": {"seed": 0, "micro_batch": 16},
}
STEP_WAIT_S = 600.0  # a rank that keeps its peers waiting longer has failed
SETTLE_STEPS = 60  # the slack probe's resident peak has stopped rising (BENCHMARKS.md)
TIMED_STEPS = 32  # a timed probe's steps, logged in WINDOWS windows (BENCHMARKS.md: why 32)
WINDOWS = 4
KINDS = ("fsdp", "tp")
SHARDED_DIM = {"fsdp": "dp_shard", "tp": "tp"}  # the mesh dimension of each kind's groups
# a fit's points: a rank's examples in 1, 2 and 4 micro-batches (1, 2, 4 x the calls); with
# more ranks than cores the two ends only (each of their steps is slower)
LOOKS, WIDE_LOOKS = (1, 2, 4), (1, 4)


def _config(data: dict, parallel: dict, *, train: dict, **sections):
    """`data` (a config as a dict) under `parallel`, [train] updated, `sections` replaced."""
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
    with gloo_group(timeout_s=STEP_WAIT_S):
        return step_worker(data, micro_batches, steps)


def step_worker(data: dict, micro_batches: tuple[int, ...], steps: int = 12) -> dict:
    """The reference on one thread: `steps` rounds of a step at each micro-batch in turn (a
    slow minute falls on each alike), begun together in a process group; per micro-batch
    the median step after two warm-up rounds."""
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
    to ops x op_s + bytes written x byte_s. `concurrent` ranks run it side by side, as the
    busiest world keeps the cores busy; a step is the slowest rank's."""
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
    say(f"beyond the matmuls: {op_s * 1e6:.1f} us per op, {byte_s * 1e9:.3f} ns per byte written")
    return {"op_s": op_s, "byte_s": byte_s}


def probe_parallel(kind: str, *, world: int, group: int) -> dict:
    """A probe's [parallel] keys: `kind`'s groups of `group` ranks, the rest of the world
    FSDP's replicas (HSDP) or tensor parallelism's pipeline stages."""
    rest = {"fsdp": "dp_replicate", "tp": "pp"}[kind]
    return {SHARDED_DIM[kind]: group, **({rest: world // group} if world > group else {})}


def sharded_config(data: dict, parallel: dict, *, steps: int = SETTLE_STEPS, accumulation: int = 1):
    """`data` trained under `parallel` for `steps` steps, each rank's micro-batch split in
    `accumulation`, logged in WINDOWS windows, without checkpoints or much evaluation."""
    mb = _micro_batch(data) // accumulation
    replicas = parallel.get("dp_replicate", 1) * parallel.get("dp_shard", 1)
    train = {"micro_batch": mb, "global_batch": mb * accumulation * replicas, "steps": steps}
    train |= {"eval_every": 0, "eval_examples": 8}
    log = {"every": max(1, steps // WINDOWS), "quiet": True}
    return _config(data, parallel, train=train, log=log, checkpoint={"every": 0})


def sharded_worker(data: dict, parallel: dict, steps: int, accumulation: int, run_dir: str) -> None:
    """One rank of a probe: the trainer itself."""
    from scaletrain.training.trainer import train

    config = sharded_config(data, parallel, steps=steps, accumulation=accumulation)
    with gloo_group(timeout_s=STEP_WAIT_S):
        train(config, run_dir=Path(run_dir))


def slack_probe(data: dict, *, launch, profile, steps: int = SETTLE_STEPS, say=print) -> dict:
    """`rss_ratio`: the model on 2 ranks under DDP, its largest peak above baseline per live
    byte predicted (the baseline holds the parameters and DDP's gradient buckets); {} where
    it fails."""
    bare = dataclasses.replace(_without_sharding_costs(profile), rss_ratio=1.0)
    settled = _probe(data, {"dp_replicate": 2}, 2, steps, launch, bare, say)
    if settled is None:
        return {}
    memory = settled[0].memory_bytes
    peak = max(r["window_peak_above_baseline_bytes"] for r in settled[1])
    value = max(1.0, (peak + memory["grads"]) / (memory["peak"] - memory["params"]))
    say(f"ddp on 2 ranks, {steps} steps: resident memory {value:.2f} x the live tensors predicted")
    return {"rss_ratio": value}


def sharded_probes(
    data: dict, *, launch, profile, worlds=(2,), timed_steps: int = TIMED_STEPS, say=print
) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """FSDP2's and DTensor's costs: the profile's fields and each world's link fields. Per
    kind, on 2 ranks, probes at LOOKS whose excess over the planner's step is fitted to
    `{kind}_step_s` + calls x `{kind}_call_s`; on a larger world the same fit in groups of 2
    (`{kind}_pair_*`: with more ranks than cores a call waits on fewer peers) and a probe of
    the whole world for its cost per call (else the pair's). A probe that cannot run fits
    nothing."""
    bare = _without_sharding_costs(profile)
    fields: dict[str, float] = {}
    links: dict[int, dict[str, float]] = {world: {} for world in (2, *worlds)}

    def probe(parallel, world, accumulation=1):
        return _probe(data, parallel, world, timed_steps, launch, bare, say, accumulation)

    def fit(kind, world, accumulations):
        """(cost per step, cost per call) fitted to the probes' excess over the plan; None
        where none ran or none has calls (a model without a TP plan)."""
        parallel = probe_parallel(kind, world=world, group=2)
        runs = [probe(parallel, world, a) for a in accumulations if a <= _micro_batch(data)]
        looks = [_excess(pred, train, kind) for pred, train in filter(None, runs)]
        if not looks or not looks[0][1]:
            return None
        share = 1.0 / parallel.get("pp", 1)  # a pipeline stage pays its share of the step
        step_s, call_s = _nonneg_fit([(share, calls, excess) for excess, calls in looks])
        label = f"{kind} on 2 ranks" if world == 2 else f"{kind} as {parallel} on {world} ranks"
        said = ", ".join(f"{e * 1e3:.1f} ms beyond the plan with {c} calls" for e, c in looks)
        say(f"{label}: {said}; fitted: {step_s * 1e3:.1f} ms a step + {call_s * 1e6:.0f} us a call")
        return step_s, call_s

    for kind in KINDS:
        fitted = fit(kind, 2, LOOKS)
        if fitted is None:
            continue
        step_s, call_s = fitted
        fields[f"{kind}_step_s"], links[2][f"{kind}_call_s"] = step_s, call_s
        for world in (w for w in worlds if w > 2):
            link = links[world]
            fitted = fit(kind, world, WIDE_LOOKS)
            if fitted is not None:  # a pair cost of 0 means none measured: 1e-12 at least
                link[f"{kind}_pair_step_s"] = fitted[0]
                link[f"{kind}_pair_call_s"] = max(fitted[1], 1e-12)
            whole = probe_parallel(kind, world=world, group=world)
            run = probe(whole, world)
            excess, calls = _excess(*run, kind) if run else (0.0, 0)
            link[f"{kind}_call_s"] = link.get(f"{kind}_pair_call_s", 0.0)
            if calls:  # beyond the 2-rank cost per step
                link[f"{kind}_call_s"] = max(0.0, (excess - step_s) / calls)
                say(
                    f"{kind} as {whole} on {world} ranks: {excess * 1e3:.1f} ms beyond the plan, "
                    f"{calls} calls: {link[f'{kind}_call_s'] * 1e6:.0f} us a call"
                )
    return fields, links


def _probe(data, parallel, world, steps, launch, bare, say, accumulation=1):
    """(the planner's prediction for one probe, its logged train rows); None where the
    launcher refuses the layout or a rank died."""
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


def _excess(pred, train: list[dict], kind: str) -> tuple[float, int]:
    """(the run's median step less the planner's, its calls), over the second half: the
    first holds a fresh rank's warm-up, its heap still growing (BENCHMARKS.md)."""
    step_s = statistics.median(r["step_time_s"] for r in train[len(train) // 2 :])
    return step_s - pred.step_time_s, pred.calls(dim=SHARDED_DIM[kind])


def _without_sharding_costs(profile):
    """`profile` without FSDP2's or DTensor's costs (1e-12 a call: 0 means the latency)."""
    none = {f"{k}_{c}_s": 1e-12 for k in KINDS for c in ("call", "pair_call")}
    none |= {f"{k}_pair_step_s": 0.0 for k in KINDS}
    intra = {w: dataclasses.replace(link, **none) for w, link in profile.intra.items()}
    return dataclasses.replace(profile, intra=intra, fsdp_step_s=0.0, tp_step_s=0.0)


def _nonneg_fit(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(p, q) >= 0 with x p + y q closest to t over `points` (x, y, t): scipy's NNLS."""
    from scipy.optimize import nnls

    (p, q), _ = nnls([(x, y) for x, y, _ in points], [t for *_, t in points])
    return float(p), float(q)


def first_use_worker(*, units: int = 8, width: int = 64) -> int:
    """A fresh rank's resident rise over its first FSDP2 steps on a Linear stack, after plain
    steps and a collective warmed the rest: what FSDP2 loads on first use, once a process."""
    torch.set_num_threads(1)
    with gloo_group():
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
    """This rank's gloo group, as a run's, closed on the way out."""
    init_distributed(read_env(), backend="gloo", timeout_s=timeout_s)
    try:
        yield
    finally:
        dist.destroy_process_group()
