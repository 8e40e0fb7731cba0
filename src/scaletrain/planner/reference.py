"""What `scaletrain calibrate` learns from real training steps rather than from kernels alone.

A small model on a CPU spends most of a step outside its matmuls: each op's dispatch and
autograd bookkeeping, element-wise work bound by memory, and in a sharded layout the Python
around each collective (FSDP's copy-in and copy-out, DTensor's redistribution). And a
process's resident memory rises by more than its live tensors (glibc keeps freed blocks,
threads take stacks, kernels their scratch). None of this shows in a matmul benchmark, so
calibrate measures it on real steps:

- `step_costs`: the configured model (`scaletrain calibrate CONFIG`; else the built-in GPT
  `tiny`) trained for real at four micro-batches (a quarter, half, once and twice the
  configured one: the sizes a layout's chunks run at) in turn, a step at each per round,
  one thread, under the heap policy the run would apply (runtime/allocator.py), in fresh processes
  (the calibration's own large buffers out of their heap): as many side by side as the
  cores a world's ranks keep busy, started as ranks by torch's elastic agent, each step
  begun together (a gloo barrier, not timed), and per micro-batch the slowest one's
  median step kept. In turn, not one after another: this VM's speed moves by a quarter
  from minute to minute, and a slow minute that fell on one micro-batch bent the fitted
  line (GPT small's steps at micro-batch 4 and 8 were once measured 98 and 116 ms). Ranks
  share the machine's caches and memory bandwidth, and a synchronous step waits for the
  slowest.
  Measured on a 2-core AMD EPYC VM (avx2, no avx512), GPT small at micro-batch 8: one
  process alone under glibc's defaults 115.6 ms a step, two side by side under the run's
  `retain` 146.7 ms, its 2-rank DDP run 178 ms with its all-reduce (BENCHMARKS.md, the
  planner). This is the profiling-based cost model of layout searchers (Galvatron,
  Alpa): the model is measured once, and every distributed layout is predicted from that.
  Each step's time less its matmuls (FLOPs over the measured rate) and its optimizer pass
  is fitted to ops x op_s + bytes written x byte_s by least squares, neither below 0
  (`_nonneg_fit`), with the forward's ops and written bytes counted by the planner's own
  trace (activations.py). The ops hardly change with the micro-batch, so op_s is the
  line's intercept: fitted through two points (as it was) it moved 1.9 -> 4.0 -> 7.0 us
  between three calibrates of GPT small, from 6 steps' medians a few per cent apart.
- `slack_probe`: the configured model trained by the trainer on 2 ranks under DDP (which
  adds no sharding costs of its own) until its resident peak settles: what it holds
  beyond the planner's live bytes, per live byte, is `rss_ratio` (`rss_fixed` 0), what
  the planner adds on a CPU profile (on a GPU the reference is the allocator's own peak).
  It was fitted on the one-process reference's 12 steps: 1.33 and 1.34 for GPT small and
  base, where their DDP and pipeline ranks settle at 1.4-1.5 and 1.15-1.2 (BENCHMARKS.md).
- `collective_overheads` (on the ranks that time the collectives): a stack of small Linear
  units run forward and backward under FSDP2 and under DTensor tensor parallelism, against
  the same stack unsharded; the difference per collective call is `fsdp_call_s` and
  `tp_call_s`, gloo's latency and the framework's Python together, per world size. Where
  `sharded_probes` measures the configured model's own, those replace them.
- `first_use_worker` (fresh ranks): the resident memory a process adds the first time it
  runs FSDP2, after plain steps warmed the rest: `fsdp_rss`, a fixed cost per rank that
  the planner adds to a CPU layout using it. (Tensor parallelism shows none in a real run:
  below.)
- `sharded_probes`: the configured model trained for real by the trainer on 2 ranks, under
  dp_shard = 2 and under tp = 2, until the resident peak has settled (SETTLE_STEPS), and
  again for TIMED_STEPS taking each step in 2, in 4 and in 1 micro-batch (twice, 4 times
  and once the calls). Their median step times (at 1 micro-batch the faster of the two
  looks), less the planner's step without FSDP2's and DTensor's costs, fit a cost per step
  (`fsdp_step_s`, `tp_step_s`: GPT base, 31-38 ms under FSDP2) and one per call on the
  model's own units (`fsdp_call_s`, `tp_call_s` of the 2-rank link: a GPT block's FSDP2
  copy-in and copy-out and its DTensor ops cost more than a Linear unit's). On each larger
  world size short runs time groups of 2 among its ranks, in 1, 2, 4 and again 1
  micro-batch, fitted to their own cost per step and per call (`*_pair_step_s`,
  `*_pair_call_s` of its link: with more ranks than cores, a call waits on fewer peers in
  a group of 2, and GPT small's tensor parallelism on 4 ranks of 2 cores showed no cost
  per step beside ~7 ms a call, where on 2 ranks part of it came once a step), and FSDP
  over all of them (`fsdp_call_s` of its link). Each timed run's steps are taken at the
  machine's speed when the reference ran (`pace`: the reference timed again before and
  after it, against the profile's `reference_round_s`). Under either, glibc's heap keeps
  the holes that FSDP2's gathered parameters and gradients, or DTensor's gathered and
  scattered copies of the stream, leave between activations, and a rank settles higher
  than its live tensors and the slack explain (BENCHMARKS.md, the planner), measured here
  on the 2-rank probes' settled peaks (`_settled_rss`): under FSDP2 beyond its first use,
  per byte of the stage's whole parameters (`fsdp_rss_per_byte`: it grows with the model,
  3.5-5x on the GPT); under tensor parallelism per live byte (`tp_rss_ratio`: GPT small's
  ranks held 1.05-1.11x their live tensors beyond them, base's 0.65-0.74x, pipeline stages or not,
  and no fixed part). A stack of Linear layers does not show either (its few activations
  leave the heap no holes to keep).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

GPT_TINY = {
    "model": {"name": "gpt", "size": "tiny"},
    "data": {"source": "wikitext", "seq_len": 128},
    "train": {"seed": 0, "micro_batch": 16},
}


def model_label(model: dict) -> str:
    """The model of a config's [model] section (as a dict) in one line, what a profile
    records it was calibrated on and `scaletrain plan` compares: its name, a built-in's
    size, and what shapes the user's or a Hugging Face model."""
    import json

    from scaletrain.config import BUILTIN_MODELS, ModelConfig

    m = ModelConfig(**model)
    parts = [m.name, f"size={m.size}" if m.name in BUILTIN_MODELS else ""]
    parts += [f"hf_config={m.hf_config}" if m.hf_config else "", f"path={m.path}" if m.path else ""]
    if m.kwargs:
        parts.append("kwargs=" + json.dumps(m.kwargs, sort_keys=True, separators=(",", ":")))
    return " ".join(p for p in parts if p)


def reference_config(data: dict, micro_batch: int):
    """`data` (a config as a dict) as one process training micro-batches of `micro_batch`."""
    from scaletrain.config import validate_config

    data = {k: dict(v) for k, v in data.items() if isinstance(v, dict)}
    data["train"].update(micro_batch=micro_batch, global_batch=micro_batch)
    data["parallel"] = {}  # the defaults: one process
    return validate_config(data)


def _micro_batch(data: dict) -> int:
    """The configured micro-batch of `data` (a config as a dict; the default 16)."""
    return int(data.get("train", {}).get("micro_batch", 16))


def reference_batches(data: dict) -> tuple[int, ...]:
    """The micro-batches to fit at: a quarter, half, once and twice the configured one."""
    mb = _micro_batch(data)
    return tuple(sorted({max(1, mb // 4), max(1, mb // 2), mb, 2 * mb}))


STEP_WAIT_S = 600.0  # a reference process that keeps the others waiting longer has failed


def reference_rank(data: dict, micro_batches: tuple[int, ...], steps: int = 12) -> dict:
    """One of the reference's processes side by side (started by torch's elastic agent):
    `step_worker` in their gloo group, so that each step begins with the others'. A barrier
    waits out the slowest process's model build and then its steps (a large model's on a
    CPU: minutes), so up to STEP_WAIT_S before the group gives up on it."""
    with gloo_group(timeout_s=STEP_WAIT_S):
        return step_worker(data, micro_batches, steps)


def step_worker(data: dict, micro_batches: tuple[int, ...], steps: int = 12) -> dict:
    """One fresh process: the reference trained on one thread, under the heap policy the
    run would apply, `steps` rounds of one step at each of `micro_batches` in turn (round
    robin: a minute in which a shared machine runs slow falls on every micro-batch alike,
    and bends the fitted line's level, not its slope); per micro-batch the median step time
    after two warm-up rounds. In a process group (`reference_rank`), each step begins when
    every process in it is ready, as a synchronous rank's does (a barrier, not timed)."""
    import torch.distributed as dist

    from scaletrain.planner import build_for_plan
    from scaletrain.precision import make_precision
    from scaletrain.runtime.allocator import configure_allocator
    from scaletrain.training.assemble import build_net, build_objective, tensor_bytes
    from scaletrain.training.optim import build_optimizer
    from scaletrain.training.step import forward

    torch.set_num_threads(1)
    config = reference_config(data, max(micro_batches))
    dataset, _ = build_for_plan(config)
    precision = make_precision(config.precision.mode, device_type="cpu")
    net = build_net(config, dataset)
    configure_allocator(config.train.allocator, device_type="cpu", model_bytes=tensor_bytes(net))
    model, loss_fn, _ = build_objective(config, net, dataset, precision=precision)
    model = precision.convert_module(model)
    o = config.optim
    optimizer = build_optimizer(
        model, name=o.name, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, momentum=o.momentum
    )
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
    data: dict | None,
    *,
    flops: dict[str, float],
    memory_bw: float,
    concurrent: int,
    launch,
    say=print,
) -> dict[str, float]:
    """op_s and byte_s fitted from the reference's real steps (module docstring), every
    micro-batch in turn in `concurrent` fresh processes side by side (the cores a world's
    ranks keep busy), each micro-batch's slowest median kept; and reference_round_s, those
    medians summed (what `pace` times again). `data`: the config as a dict (None: GPT
    tiny); `launch(n, fn, *args)` starts ranks and returns rank -> result
    (calibrate._launch)."""
    from scaletrain.planner import predict_configured
    from scaletrain.runtime.hardware import Profile

    data = data or GPT_TINY
    # the planner's own prediction with no per-op or per-byte terms: what the fit adds to
    bare = Profile(name="bare", flops=flops, memory_bytes=2**62, memory_bw=memory_bw, cores=1)
    steps = reference_steps(data, launch=launch, concurrent=concurrent)
    rows = []
    for mb, step_s in steps.items():
        config = reference_config(data, mb)
        pred = predict_configured(config, world_size=1, profile=bare)
        rows.append((pred.ops, pred.written, step_s - pred.step_time_s))
        say(
            f"reference step ({config.model.name} {config.model.size or ''}, micro-batch {mb}, "
            f"1 thread, {concurrent} at once, the micro-batches in turn): {step_s * 1e3:.1f} ms"
        )
    op_s, byte_s = _nonneg_fit(rows)
    return {"op_s": op_s, "byte_s": byte_s, "reference_round_s": sum(steps.values())}


def reference_steps(data: dict, *, launch, concurrent: int) -> dict[int, float]:
    """The reference's median step at each of its micro-batches (`reference_batches`, in
    turn), in `concurrent` fresh ranks side by side: the slowest rank's each."""
    batches = reference_batches(data)
    ranks = launch(concurrent, reference_rank, data, batches).values()
    return {mb: max(r["step_s"][mb] for r in ranks) for mb in batches}


def pace(data: dict | None, *, launch, concurrent: int, profile) -> float:
    """How much slower this machine runs now than when calibrate timed its reference: the
    reference timed again exactly as `step_costs` timed it (its micro-batches in turn, the
    same rounds and warm-up, in `concurrent` ranks side by side), one round's steps summed
    over the profile's `reference_round_s`; 1 where the profile has none. A shorter timing
    of one micro-batch alone (6 steps after 2 of warm-up) read 1.03-1.6x on a machine whose
    runs were no slower (not explained: it warms up on fewer and smaller steps than the
    reference did). `launch` as for `step_costs`."""
    if not profile.reference_round_s:
        return 1.0
    data = data or GPT_TINY
    now = reference_steps(data, launch=launch, concurrent=concurrent)
    return sum(now.values()) / profile.reference_round_s


SETTLE_STEPS = 160  # steps after which an FSDP2 rank's resident peak has stopped rising
TIMED_STEPS = 40  # a probe that only times steps: 3 windows after the warm-up one
KINDS = ("fsdp", "tp")
# a sharded fit's points: a rank's examples a step in 1, 2 and 4 micro-batches (1, 2 and 4
# times the calls), the first looked at twice, the looks in this order (minutes apart)
LOOKS = (1, 2, 4, 1)
SHARDED_DIM = {"fsdp": "dp_shard", "tp": "tp"}  # the mesh dimension of each kind's groups
# each kind's resident-memory field (left at the Profile's default where its probe does
# not run: nothing beyond the first use, resident = live)
RSS_FIELD = {"fsdp": "fsdp_rss_per_byte", "tp": "tp_rss_ratio"}


def probe_parallel(kind: str, *, world: int, group: int) -> dict:
    """The [parallel] keys of a probe: `kind`'s groups of `group` ranks, the rest of the
    world's ranks FSDP's replicas (HSDP) or tensor parallelism's pipeline stages (DDP does
    not compose with it)."""
    rest = {"fsdp": "dp_replicate", "tp": "pp"}[kind]
    return {SHARDED_DIM[kind]: group, **({rest: world // group} if world > group else {})}


def sharded_config(data: dict, parallel: dict, *, steps: int = SETTLE_STEPS, accumulation: int = 1):
    """`data` (a config as a dict) trained under `parallel` for `steps` steps, each rank
    taking the configured micro-batch's examples a step in `accumulation` micro-batches,
    windows of 10, no checkpoint, 8 examples of evaluation at the end."""
    from scaletrain.config import validate_config

    mb = _micro_batch(data)
    data = {k: dict(v) for k, v in data.items() if isinstance(v, dict)}
    data.setdefault("train", {})
    replicas = parallel.get("dp_replicate", 1) * parallel.get("dp_shard", 1)
    data["train"].update(
        micro_batch=mb // accumulation,
        global_batch=mb // accumulation * accumulation * replicas,
        steps=steps,
        eval_every=0,
        eval_examples=8,
    )
    data["parallel"] = dict(parallel)
    data["log"] = {"every": 10, "quiet": True}
    data["checkpoint"] = {"every": 0}
    return validate_config(data)


def sharded_worker(data: dict, parallel: dict, steps: int, accumulation: int, run_dir: str) -> None:
    """One rank of a sharded probe (started by elastic_launch): the trainer itself on
    `sharded_config(data, parallel, ...)`."""
    from pathlib import Path

    import torch.distributed as dist

    from scaletrain.training.trainer import train

    config = sharded_config(data, parallel, steps=steps, accumulation=accumulation)
    try:
        train(config, run_dir=Path(run_dir))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def slack_probe(
    data: dict | None, *, launch, profile, steps: int = SETTLE_STEPS, say=print
) -> dict[str, float]:
    """`rss_fixed` and `rss_ratio` (module docstring): the configured model trained by the
    trainer on 2 ranks under DDP for `steps` steps; its largest logged peak above baseline
    against the planner's live bytes. DDP's gradients are views into buckets it allocates
    at set-up, so the baseline already holds them. Nothing where the launcher refuses the
    layout. `launch` and `profile` as for `sharded_probes`."""
    import dataclasses

    data = data or GPT_TINY
    bare = dataclasses.replace(_without_sharding_costs(profile), rss_fixed=0.0, rss_ratio=1.0)
    settled = _probe(data, {"dp_replicate": 2}, 2, steps, launch, bare, say)
    if settled is None:  # the launcher refused it: no slack measured
        return {}
    pred, train = settled
    peak, live = _settled_peak(pred, train)
    memory = pred.memory_bytes
    ratio = max(1.0, (peak + memory["grads"]) / live)
    say(
        f"DDP on 2 ranks, {steps} steps: {peak / 2**20:.1f} MiB above baseline, "
        f"{(live - memory['grads']) / 2**20:.1f} MiB of live tensors beyond it predicted: "
        f"resident memory {ratio:.2f} x the live tensors"
    )
    return {"rss_fixed": 0.0, "rss_ratio": ratio}


def sharded_probes(
    data: dict | None,
    *,
    launch,
    profile,
    worlds: tuple[int, ...] = (2,),
    concurrent: int = 1,
    steps: int = SETTLE_STEPS,
    timed_steps: int = TIMED_STEPS,
    say=print,
) -> tuple[dict[str, float], dict[int, dict[str, float]], list[float]]:
    """What the configured model's own sharded steps show (module docstring), per `kind`
    (fsdp, tp): (the profile's fields, each world size's link fields, the paces timed).

    On 2 ranks, `steps` steps (the resident peak settles):
    - `fsdp_rss_per_byte` and `tp_rss_ratio`: the largest logged peak above baseline
      against the planner's live bytes (`_settled_rss`);
    - with timed probes taking each step in 2, in 4 and in 1 micro-batch (LOOKS: twice,
      4 times and once the calls): the median logged step times after the first window,
      less what the planner predicts with no cost per step or per call, each call count's
      fastest look (`_fastest`: 1 micro-batch is looked at twice, settled and timed),
      fitted to `{kind}_step_s` + calls x `{kind}_call_s` (neither below 0): a cost per
      step (what does not grow with the calls; which part of the step holds it is not
      measured) and one per call. Two points (1 and 2 micro-batches, one look each) put
      all of one look's noise into the fit: GPT base's tp cost per step came out 7, 97,
      141 and 357 ms in four calibrates.
    On each larger world size, timed: groups of 2 among its ranks (FSDP's with replicas,
    HSDP; tensor parallelism's with pipeline stages), in LOOKS' micro-batches, what
    their steps hold beyond the planner's fitted as on 2 ranks to `{kind}_pair_step_s`
    (the stage paying its share) + calls x `{kind}_pair_call_s`; for FSDP, one group of
    all of them, what its steps hold beyond the planner's and the 2-rank cost per step,
    per call (`fsdp_call_s`).
    Every step time is taken at the machine's speed when the profile's reference was timed:
    the reference step is timed again (`pace`, in `concurrent` ranks side by side, as
    step_costs ran it) before the first probe and after each, and a probe's steps are
    divided by the mean of the paces around it. Without it, a minute in which this VM ran a
    quarter slower put a quarter of the step into FSDP2's cost per step or per call.
    A probe the model cannot run (no TP plan) or with no calls planned fits nothing.
    `launch(world, fn, *args)` starts ranks (calibrate._launch); `profile`: this machine's so
    far (its matmul rate, costs beyond the matmuls, reference step, slack, links and first
    use)."""
    import dataclasses

    from scaletrain.runtime.hardware import Profile

    data = data or GPT_TINY
    bare = _without_sharding_costs(profile)
    unmeasured = {f.name: f.default for f in dataclasses.fields(Profile)}
    fields: dict[str, float] = {}
    links: dict[int, dict[str, float]] = {w: {} for w in worlds}
    paces = [pace(data, launch=launch, concurrent=concurrent, profile=profile)]

    def paced(parallel, world, n_steps, plan, accumulation=1):
        """`_probe`, and the machine's pace over it (the mean of those around it)."""
        run = _probe(data, parallel, world, n_steps, launch, plan, say, accumulation)
        if run is None:
            return None
        paces.append(pace(data, launch=launch, concurrent=concurrent, profile=profile))
        return (*run, (paces[-2] + paces[-1]) / 2)

    for kind in KINDS:
        fields[RSS_FIELD[kind]] = unmeasured[RSS_FIELD[kind]]
        pair = probe_parallel(kind, world=2, group=2)
        settled = paced(pair, 2, steps, bare)
        if settled is None:
            continue
        pred, train, settled_pace = settled
        peak, live = _settled_peak(pred, train)
        stage = pred.memory_bytes["params"] * 2  # the one stage's whole parameters
        held, said = _settled_rss(kind, peak=peak, live=live, stage=stage, profile=profile)
        fields |= held
        say(
            f"{kind} on 2 ranks, {steps} steps: {peak / 2**20:.1f} MiB above baseline, "
            f"{live / 2**20:.1f} MiB of live tensors predicted: {said}"
        )
        looks = [_excess(pred, train, settled_pace, kind)]
        if not looks[0][1]:  # tp on a model whose blocks the planner cannot see: none planned
            continue
        # the settled probe is the first look at 1 micro-batch; then the others, timed
        runs = [paced(pair, 2, timed_steps, bare, a) for a in _looks(data)[1:]]
        looks += [_excess(*run, kind) for run in runs if run]
        points = _fastest(looks)
        step_s, call_s = _nonneg_fit([(1.0, calls, excess) for excess, calls in points])
        fields[f"{kind}_step_s"] = step_s
        links.setdefault(2, {})[f"{kind}_call_s"] = call_s
        say(
            f"{kind} on 2 ranks: "
            + _beyond(looks)
            + f"; each call count at its fastest: {step_s * 1e3:.1f} ms a step + "
            + f"{call_s * 1e6:.0f} us a call (the machine "
            + ", ".join(f"{x:.2f}" for x in paces)
            + "x as slow as at the reference, timed around the probes)"
        )
        for world in (w for w in worlds if w > 2):
            # groups of 2 among the world's ranks: a cost per step (the stage's share paid)
            # and per call of their own, fitted apart as on 2 ranks
            pair = probe_parallel(kind, world=world, group=2)
            share = 1.0 / pair.get("pp", 1)
            runs = [paced(pair, world, timed_steps, bare, a) for a in _looks(data)]
            looks = [_excess(*run, kind) for run in runs if run]
            points = _fastest(looks)
            if points and points[0][1]:
                pair_step, pair_call = _nonneg_fit([(share, c, e) for e, c in points])
                links[world][f"{kind}_pair_step_s"] = pair_step
                # 1e-12, not 0: a pair cost of 0 would mean none measured (predict._per_call)
                links[world][f"{kind}_pair_call_s"] = max(pair_call, 1e-12)
                say(
                    f"{kind} as {pair} on {world} ranks: "
                    + _beyond(looks)
                    + f"; each call count at its fastest: {pair_step * 1e3:.1f} ms a step "
                    + f"(a stage pays {share:.2f} of it) + {pair_call * 1e6:.0f} us a call"
                )
            if kind == "tp":  # tensor parallelism over a whole world > 2: the stack's
                continue
            # FSDP over all of the world's ranks: its calls beside the 2-rank cost per step
            stepped = dataclasses.replace(bare, **{f"{kind}_step_s": step_s})
            parallel = probe_parallel(kind, world=world, group=world)
            run = paced(parallel, world, timed_steps, stepped)
            excess, calls = _excess(*run, kind) if run else (0.0, 0)
            if not calls:
                continue
            links[world][f"{kind}_call_s"] = max(0.0, excess / calls)
            say(
                f"{kind} as {parallel} on {world} ranks: {excess * 1e3:.1f} ms beyond the "
                f"plan and its cost per step, {calls} calls: "
                f"{links[world][f'{kind}_call_s'] * 1e6:.0f} us a call (the machine "
                f"{run[2]:.2f}x as slow as at the reference)"
            )
    return fields, links, paces


def _looks(data: dict) -> tuple[int, ...]:
    """The micro-batches a step the sharded fits look at (LOOKS), those the configured
    micro-batch can be split into."""
    return tuple(a for a in LOOKS if a <= _micro_batch(data))


def fastest_looks(looks) -> dict:
    """{key: its smallest time} over (key, seconds) looks: a size or call count timed more
    than once taken at its fastest (calibrate's collectives; the sharded fits)."""
    fastest: dict = {}
    for key, t in looks:
        fastest[key] = min(t, fastest.get(key, t))
    return fastest


def _fastest(looks: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """Each call count's fastest look (excess, calls), by calls. A look this VM ran slow
    beyond what the paces around it caught (GPT base's tp 2 at 1 micro-batch once 395 ms
    beyond the plan in calibrate, 143 ms in the bench's own run of it) pulled the
    fitted line by as much; a second look minutes later drops it."""
    fastest = fastest_looks((calls, excess) for excess, calls in looks)
    return [(excess, calls) for calls, excess in sorted(fastest.items())]


def _beyond(looks: list[tuple[float, int]]) -> str:
    """The probes' (excess, calls), in the order they ran, as calibrate says them."""
    return ", ".join(f"{e * 1e3:.1f} ms beyond the plan with {c} calls" for e, c in looks)


def _probe(data, parallel, world, steps, launch, bare, say, accumulation=1):
    """The planner's prediction for one probe and its logged training windows, or None
    where the launcher's own checks refuse the layout (a model without a TP plan) or a
    rank failed: the probe fits nothing and calibrate goes on with the others (GPT base's
    tp 2 x pp 2 at 2 micro-batches once died in gloo's reduce-scatter, SIGSEGV, 18
    minutes into a calibrate that then lost all of them)."""
    import json
    import tempfile
    from pathlib import Path

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


def _settled_rss(
    kind: str, *, peak: int, live: int, stage: int, profile
) -> tuple[dict[str, float], str]:
    """What a settled 2-rank probe's peak above baseline says of the heap, and the line
    that says it: under FSDP2 (`fsdp_rss_per_byte`) what it holds beyond the live bytes,
    rss_fixed and the first use, per byte of the stage's whole parameters; under tensor
    parallelism (`tp_rss_ratio`) the resident bytes per live byte. Measured: GPT small's
    and base's tensor-parallel ranks hold beyond their live tensors in proportion to them
    with no fixed part (pp 2 x tp 2's ranks half what tp 2's hold, with half the live
    bytes), where a fixed first use (a Linear stack's 40 MiB) put small's pp 2 x tp 2 27%
    over (BENCHMARKS.md, the planner)."""
    if kind == "tp":
        ratio = max(1.0, (peak - profile.rss_fixed) / live)
        return {"tp_rss_ratio": ratio}, f"resident memory {ratio:.2f} x the live tensors"
    per_byte = max(0.0, (peak - live - profile.rss_fixed - profile.link(2).fsdp_rss) / stage)
    said = (
        f"{per_byte:.2f} x the stage's {stage / 2**20:.1f} MiB of parameters beyond the "
        "slack and first use"
    )
    return {"fsdp_rss_per_byte": per_byte}, said


def _settled_peak(pred, train: list[dict]) -> tuple[int, int]:
    """(the probe's largest logged peak above baseline; the planner's live bytes for it:
    its peak less the parameters, which the baseline holds, and less the CPU's runtime
    terms, which the probes' fits are beside)."""
    memory = pred.memory_bytes
    peak = max(r["window_peak_above_baseline_bytes"] for r in train)
    return peak, memory["peak"] - memory["params"] - memory["runtime"]


def _excess(pred, train: list[dict], slower: float, kind: str) -> tuple[float, int]:
    """(the median logged step time after the first window, which warms up, at the
    profile's speed (over `slower`, the machine's pace then: `pace`), less the planner's
    step; the step's `kind` collective calls)."""
    step_s = statistics.median(r["step_time_s"] for r in train[1:] or train) / slower
    return step_s - pred.step_time_s, pred.calls_by_dim.get(SHARDED_DIM[kind], 0)


def _without_sharding_costs(profile):
    """`profile` with no FSDP2 or DTensor cost per step and none per call (1e-12 a call: 0
    would mean the link's latency), what the probes' excess is over."""
    import dataclasses

    none = {f"{k}_call_s": 1e-12 for k in KINDS} | {f"{k}_pair_call_s": 1e-12 for k in KINDS}
    none |= {f"{k}_pair_step_s": 0.0 for k in KINDS}
    intra = {w: dataclasses.replace(link, **none) for w, link in profile.intra.items()}
    return dataclasses.replace(profile, intra=intra, fsdp_step_s=0.0, tp_step_s=0.0)


def _nonneg_fit(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(p, q), neither below 0, with x p + y q closest to t over `points` (x, y, t) by least
    squares: the free solution where both come out non-negative, else the better of p alone
    and q alone (the other 0), q where they tie (one sharded probe, a micro-batch of 1: all
    of its excess per call, as before the cost per step was fitted)."""
    sxx = sum(x * x for x, _, _ in points)
    syy = sum(y * y for _, y, _ in points)
    sxy = sum(x * y for x, y, _ in points)
    sxt = sum(x * t for x, _, t in points)
    syt = sum(y * t for _, y, t in points)
    det = sxx * syy - sxy * sxy
    if det:
        p, q = (sxt * syy - syt * sxy) / det, (sxx * syt - sxy * sxt) / det
        if p >= 0 and q >= 0:
            return p, q

    def residual(p: float, q: float) -> float:
        return sum((x * p + y * q - t) ** 2 for x, y, t in points)

    p_only = (max(0.0, sxt / sxx) if sxx else 0.0, 0.0)
    q_only = (0.0, max(0.0, syt / syy) if syy else 0.0)
    tie = 1e-12 * sum(t * t for _, _, t in points)  # rounding, not a better fit
    return p_only if residual(*p_only) < residual(*q_only) - tie else q_only


def collective_overheads(world: int, *, units: int = 8, width: int = 64) -> dict[str, float]:
    """Seconds per FSDP collective call and per tensor-parallel collective call on `world`
    ranks (module docstring). Call on every rank of an initialised gloo group."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, width)
    plain = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(units)))
    t_plain = _fwd_bwd_seconds(plain, x)

    sharded = shard_stack(copy.deepcopy(plain), mesh, kind="fsdp")
    t_fsdp = _fwd_bwd_seconds(sharded, x)
    # per unit: all-gather in forward, again in backward (reshard after forward), reduce-scatter
    fsdp_call_s = max(0.0, (t_fsdp - t_plain) / (3 * units))

    pairs = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(units)))
    t_pairs = _fwd_bwd_seconds(pairs, x)
    t_tp = _fwd_bwd_seconds(shard_stack(pairs, mesh, kind="tp"), x)
    # per column-row pair: one all-reduce in forward, one in backward
    tp_call_s = max(0.0, (t_tp - t_pairs) / units)
    dist.barrier()
    return {"fsdp_call_s": fsdp_call_s, "tp_call_s": tp_call_s}


def first_use_worker(*, units: int = 8, width: int = 64) -> int:
    """One rank of a fresh process: the resident rise of its first FSDP2 steps, after plain
    steps and a collective have warmed the rest (autograd, the kernels, gloo). What the rise
    holds: the code and Python state FSDP2 loads on first use (its lazy initialisation,
    the library pages it faults in), a fixed cost per process that a one-process reference
    run never pays. Started by `elastic_launch` (calibrate.measure_first_use)."""
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401 imported before the baseline, as a run does
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.records.memory import lifetime_peak_bytes

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
        model = shard_stack(model, mesh, kind="fsdp")
        for _ in range(3):
            model(x).sum().backward()
        dist.barrier()
        return lifetime_peak_bytes() - before


@contextlib.contextmanager
def gloo_group(timeout_s: float = 120.0) -> Iterator[None]:
    """This rank's gloo group (the elastic agent's environment), closed on the way out; a
    collective that waits `timeout_s` raises instead of hanging calibrate."""
    import torch.distributed as dist

    from scaletrain.runtime import init_distributed, read_env

    # the store on loopback, as a training run's (runtime.loopback_store)
    init_distributed(read_env(), backend="gloo", timeout_s=timeout_s)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_stack(model: torch.nn.Sequential, mesh, *, kind: str) -> torch.nn.Module:
    """A stack of Linear layers under FSDP2 ("fsdp": each layer a unit, then the root) or
    tensor parallelism ("tp": column-wise and row-wise in turn, one all-reduce per pair)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if kind == "fsdp":
        for layer in model:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    plan = {
        str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(len(model))
    }
    return parallelize_module(model, mesh, plan)


def _fwd_bwd_seconds(model: torch.nn.Module, x: torch.Tensor, reps: int = 15) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(reps + 2):
        if dist.is_initialized():
            dist.barrier()
        t = time.perf_counter()
        model(x).sum().backward()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])
