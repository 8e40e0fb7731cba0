"""One layout's predicted memory, communication and step time: the planner's cost model,
from the meta traces (trace.py) and the hardware profile."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from scaletrain.config import Config
from scaletrain.models.flops import train_flops, transformer_flops, transformer_shape
from scaletrain.planner.layouts import Candidate
from scaletrain.planner.trace import Activations, Held
from scaletrain.precision import matmul_dtype
from scaletrain.runtime.hardware import Link, Profile

# An op's forward run again, of its forward-and-backward cost: 2 of the 6 bytes of traffic
# per byte written that a GPU's byte_s counts (runtime/hardware.py)
RECOMPUTED_SHARE = 1 / 3
# The optimizer's passes over params + grads + state: torch 2.13's AdamW fused with the grad
# norm makes 2 (2.5 clipping), foreach 5.25 (8 kernels over 4 tensors; optim/adam.py)
OPTIMIZER_PASSES = 3


@dataclass(frozen=True)
class Collective:
    """One collective of a step on one mesh dimension, per rank: alpha-beta on its link."""

    name: str  # all_reduce, all_gather, reduce_scatter or send_recv
    dim: str  # mesh dimension: dp_replicate, dp_shard, tp or pp
    group: int  # ranks in its group
    nbytes: float  # bytes on the wire a step
    calls: int  # calls a step
    call_s: float  # s per call beyond the bytes: FSDP2's or DTensor's, else the latency
    bus_bw: float  # bytes/s of the link the group spans
    overlaps: bool  # runs beside compute on a GPU (FSDP's and DDP's)

    @property
    def seconds(self) -> float:
        return self.nbytes / self.bus_bw + self.calls * self.call_s

    def how(self) -> str:
        return (
            f"{self.nbytes / 2**20:,.2f} MiB at {self.bus_bw / 1e9:.3g} GB/s in a group of "
            f"{self.group}, {self.calls:,} calls x {self.call_s * 1e6:.3g} us a call"
        )


@dataclass(frozen=True)
class Terms:
    """A step's time on one rank: compute, communication less what hides behind compute,
    stretched by the bubble, plus the optimizer (`step_s`; `parts()` lists each term)."""

    flops: float  # FLOP: hardware FLOPs, recomputation included
    rate: float  # FLOP/s: what a real matmul reaches of the profile's peak
    matmul_s: float  # s: flops / rate
    ops: float  # forward ops (each runs backward too)
    dispatch_s: float  # s: ops x op_s x turns
    written: float  # bytes the forward's ops write
    memory_s: float  # s: written x byte_s x turns
    recompute_s: float  # s: RECOMPUTED_SHARE x the cost of the ops checkpointing re-runs
    collectives: tuple[Collective, ...]
    sharded_step_s: float  # s: FSDP2's or DTensor's cost once a step, the stage's share
    overlap: bool  # collectives that overlap hide behind compute (GPU streams; gloo: no)
    bubble: float  # fraction of the busy time: (p - 1) / (v m), 0 without a pipeline
    turns: float  # x: a node's ranks over its cores where they outnumber them, else 1
    optimizer_s: float  # s: OPTIMIZER_PASSES x (params + grads + optim) / memory_bw

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.dispatch_s + self.memory_s + self.recompute_s

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.collectives) + self.sharded_step_s

    @property
    def hidden_s(self) -> float:  # what of the overlapping collectives hides behind compute
        overlapped = sum(c.seconds for c in self.collectives if c.overlaps)
        return min(overlapped, self.compute_s) if self.overlap else 0.0

    @property
    def busy_s(self) -> float:
        return self.compute_s + (self.comm_s - self.hidden_s)

    @property
    def stretched_s(self) -> float:
        """The busy time stretched by the bubble; where ranks take turns on the cores, a stage
        in the bubble lends its core: the shared cores' work or the stretched critical path."""
        return max(self.busy_s, self.busy_s / self.turns * (1 + self.bubble))

    @property
    def step_s(self) -> float:
        return self.stretched_s + self.optimizer_s

    def parts(self) -> list[tuple[str, float, str]]:
        """(name, seconds, how) of each term `step_s` adds up."""
        turns = f" x {self.turns:g} (ranks take turns on the cores)" if self.turns > 1 else ""
        return [
            ("matmul", self.matmul_s, f"{self.flops:.4g} FLOP at {self.rate:.4g} FLOP/s"),
            ("dispatch", self.dispatch_s, f"{self.ops:,.0f} ops x op_s{turns}"),
            ("memory", self.memory_s, f"{self.written / 2**20:,.2f} MiB written x byte_s{turns}"),
            ("recompute", self.recompute_s, "the forward of what checkpointing re-runs"),
            *((f"{c.name} {c.dim}", c.seconds, c.how()) for c in self.collectives),
            ("sharded per step", self.sharded_step_s, "FSDP2's or DTensor's cost once a step"),
            ("overlap", -self.hidden_s, "collectives hidden behind compute"),
            ("bubble", self.stretched_s - self.busy_s, f"{self.bubble:.3g} x the busy time"),
            ("optimizer", self.optimizer_s, f"{OPTIMIZER_PASSES} passes over its bytes"),
        ]


@dataclass
class Prediction:
    layout: dict  # the layout's overrides: dotted key -> value
    fits: bool
    memory_bytes: dict[str, int]  # rank 0's at the step's peak, by part (`_memory`)
    comm_bytes: dict[str, float]  # on the wire a step, by collective
    step_time_s: float
    mfu: float | None
    terms: Terms
    notes: list[str] = field(default_factory=list)

    def calls(self, *, name: str | None = None, dim: str | None = None) -> int:
        """Collective calls a step, of one name (all_gather) or on one mesh dimension."""
        on = [c for c in self.terms.collectives if name in (None, c.name) and dim in (None, c.dim)]
        return sum(c.calls for c in on)

    def as_json(self) -> dict:
        keys = ("layout", "fits", "memory_bytes", "comm_bytes", "step_time_s", "mfu")
        terms = asdict(self.terms) | {"parts": {name: s for name, s, _ in self.terms.parts()}}
        return {k: getattr(self, k) for k in keys} | {"terms": terms}


def spans_nodes(lay, dim: str, per_node: int) -> bool:
    """Whether a group of mesh dimension `dim` (a pipeline's: two neighbouring stages) spans
    nodes of `per_node` devices: ranks are row-major over (pp, dp_replicate, dp_shard, tp)."""
    order = ("pp", "dp_replicate", "dp_shard", "tp")
    inner = math.prod(getattr(lay, d) for d in order[order.index(dim) + 1 :])
    return inner * (2 if dim == "pp" else getattr(lay, dim)) > per_node


def predict(
    cand: Candidate,
    *,
    held: Held,
    acts: Activations,
    model: torch.nn.Module,
    example: torch.Tensor,
    profile: Profile,
    ranks_per_node: int,
    budget_bytes: int,
) -> Prediction:
    """One accepted layout's prediction: `held` rank 0's bytes, `acts` one chunk's traced
    activations, `model` the bare model on meta, `example` one example's inputs."""
    config, derived, lay = cand.config, cand.derived, cand.derived.layout
    per_node = min(lay.world_size, ranks_per_node)  # a CPU's ranks share its cores
    # precision.tf32 puts fp32 matmuls on TF32 tensor cores where the profile has them
    tf32 = config.precision.tf32 and "tf32" in profile.flops
    dtype = matmul_dtype(config.precision.mode, tf32=tf32)
    width = 2 if dtype in ("bf16", "fp16") else (8 if dtype == "fp64" else 4)
    shape, seq = transformer_shape(model), example.shape[-1] if example.dim() >= 1 else 1
    hw = train_flops(model, example.unsqueeze(0))  # one example's, no recomputation
    # the costs calibrate measured among the world's ranks (none in a profile without links)
    link = profile.link(lay.world_size) if profile.intra else Link(bus_bw=1.0, latency_s=0.0)
    peak = profile.peak(dtype, ranks_per_node=per_node)

    memory = _memory(config, derived, held, acts, width=width, profile=profile, link=link)
    collectives = _collectives(
        config, derived, held, shape=shape, seq=seq, width=width, profile=profile, link=link,
        per_node=per_node,
    )  # fmt: skip
    terms = _terms(
        config, derived, held, acts, collectives, hw=hw, shape=shape, seq=seq, peak=peak,
        profile=profile, link=link, per_node=per_node,
    )  # fmt: skip

    names = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
    model_flops = hw * config.train.global_batch  # MFU counts no recomputation
    return Prediction(
        layout=cand.overrides, fits=memory["peak"] <= budget_bytes, memory_bytes=memory,
        comm_bytes={n: int(sum(c.nbytes for c in collectives if c.name == n)) for n in names},
        step_time_s=terms.step_s, terms=terms,
        mfu=model_flops / (terms.step_s * peak * lay.world_size) if peak else None,
    )  # fmt: skip


def _memory(config, derived, held, acts, *, width, profile, link) -> dict[str, int]:
    """Rank 0's bytes at a step's peak, by part: what it holds; the activations of the chunks
    in flight (a stage's share), the largest saved tensor again (its gradient) and one block
    recomputing; FSDP's gathered units (running and prefetched; ZeRO-2: all until backward);
    a CPU process's bytes beyond these."""
    lay, pipe = derived.layout, derived.pipeline
    in_flight = pipe.microbatches if pipe else 1  # GPipe holds every chunk
    if pipe and pipe.schedule != "gpipe":  # 1F1B and kin: stage 0 a chunk per (virtual) stage
        in_flight = min(pipe.microbatches, lay.pp * pipe.stages_per_rank)
    share = 1.0 / lay.pp  # a stage's part of the blocks
    activations = int(acts.saved * share * in_flight)
    transient = acts.largest + acts.recompute
    gathered = 0
    if lay.dp_shard > 1:
        gathered = 2 * held.largest_unit
        # ZeRO-2: rank 0's stage whole again
        gathered += 0 if config.parallel.reshard_after_forward else held.params * lay.dp_shard
        gathered = gathered * width // _param_width(config)
    live = held.grads + held.optim + activations + transient + gathered  # a step's, over params
    # a CPU's resident bytes beyond these (0 on a GPU): the larger of two claims on one free
    # heap, the allocator's slack and FSDP2's first use
    first_use = link.fsdp_rss if lay.dp_shard > 1 else 0
    runtime = int(max((profile.rss_ratio - 1.0) * live, first_use))
    return {
        "params": held.params, "grads": held.grads, "optim": held.optim,
        "activations": activations + transient, "buffers": gathered, "runtime": runtime,
        "peak": held.params + live + runtime,
    }  # fmt: skip


def _collectives(
    config, derived, held, *, shape, seq, width, profile, link, per_node
) -> list[Collective]:
    """Rank 0's collectives of a step, ring algorithms' bytes on the wire: replicas all-reduce
    the gradients; FSDP all-gathers the parameters per micro-batch (twice under ZeRO-3) and
    reduce-scatters the gradients; TP moves each block's (B, T, C) stream twice each way;
    a pipeline sends each chunk's boundary both ways."""
    lay, pipe, p = derived.layout, derived.pipeline, config.parallel
    accum, chunks = derived.accumulation, pipe.microbatches if pipe else 1
    out: list[Collective] = []

    def add(name, dim, group, nbytes, calls, *, overlaps, call_s=0.0) -> None:
        on = profile.link(group, spans_nodes=spans_nodes(lay, dim, per_node))
        out.append(
            Collective(name, dim, group, nbytes, calls, call_s or on.latency_s, on.bus_bw, overlaps)
        )

    if lay.dp_replicate > 1:
        r = lay.dp_replicate
        add("all_reduce", "dp_replicate", r, 2 * (r - 1) / r * held.grads, 1, overlaps=True)
    if lay.dp_shard > 1:
        s, units = lay.dp_shard, max(1, held.units)
        call_s, _ = _sharded_costs(profile, link, lay, "fsdp")
        gathers = 2 if p.reshard_after_forward else 1  # ZeRO-3 gathers again for backward
        unsharded = held.params * s  # the stage's parameters
        in_compute = unsharded * width / _param_width(config)  # gathered in the compute dtype
        nbytes = gathers * (s - 1) / s * in_compute * accum
        calls = gathers * units * accum
        add("all_gather", "dp_shard", s, nbytes, calls, overlaps=True, call_s=call_s)
        nbytes = (s - 1) / s * unsharded * accum
        add("reduce_scatter", "dp_shard", s, nbytes, units * accum, overlaps=True, call_s=call_s)
    if lay.tp > 1 and shape is not None:
        t = lay.tp
        stream = config.train.micro_batch * seq * shape.attention_width * width / chunks
        calls = 4 * (shape.layers // lay.pp) * accum * chunks  # per block: 2 forward, 2 backward
        call_s, _ = _sharded_costs(profile, link, lay, "tp")
        if p.sequence_parallel:
            nbytes = calls * (t - 1) / t * stream
            add("all_gather", "tp", t, nbytes, calls, overlaps=False, call_s=call_s)
            add("reduce_scatter", "tp", t, nbytes, calls, overlaps=False, call_s=call_s)
        else:
            nbytes = calls * 2 * (t - 1) / t * stream
            add("all_reduce", "tp", t, nbytes, calls, overlaps=False, call_s=call_s)
    if lay.pp > 1 and shape is not None:
        boundary = config.train.micro_batch * seq * shape.attention_width * width
        boundary /= lay.tp if p.sequence_parallel else 1
        v = pipe.stages_per_rank  # activations and gradients, each in and out, per chunk
        add("send_recv", "pp", 2, 4 * v * boundary * accum, 4 * v * chunks * accum, overlaps=False)
    return out


def _terms(
    config, derived, held, acts, collectives, *, hw, shape, seq, peak, profile, link, per_node
) -> Terms:
    """Rank 0's step, term by term (`Terms`)."""
    lay, pipe = derived.layout, derived.pipeline
    chunk_steps = derived.accumulation * (pipe.microbatches if pipe else 1)
    share = 1.0 / lay.pp  # a stage's part of the blocks, and of their ops and bytes
    # matmuls: hardware FLOPs (what checkpointing runs again too) at what a matmul reaches
    recomputed = held.recomputed_blocks * lay.pp
    if shape is not None and recomputed:
        hw += transformer_flops(shape, batch=1, seq=seq, recomputed_blocks=recomputed)
        hw -= transformer_flops(shape, batch=1, seq=seq)
    flops = hw * derived.examples_per_rank / (lay.tp * lay.pp)
    flops += chunk_steps * share * acts.again_flops  # under "op", the products it recomputes
    rate = (peak or profile.peak("fp32", ranks_per_node=per_node)) * profile.matmul_efficiency
    # beyond the matmuls: each op's dispatch and bytes written, longer where ranks take turns
    turns = max(1.0, per_node / profile.cores) if profile.cores else 1.0
    ops, written = chunk_steps * share * acts.ops, chunk_steps * share * acts.written
    again = acts.again_ops * profile.op_s + acts.again_written * profile.byte_s
    # FSDP2's or DTensor's cost once a step, the stage's share (both: the larger, the
    # parameters are DTensors once); calibrate measured it with the turns
    sharded_step_s = share * max(_sharded_costs(profile, link, lay, k)[1] for k in ("fsdp", "tp"))
    bubble = (lay.pp - 1) / (pipe.stages_per_rank * pipe.microbatches) if lay.pp > 1 else 0.0
    optimizer_s = OPTIMIZER_PASSES * (held.params + held.grads + held.optim) / profile.memory_bw
    return Terms(
        flops=flops, rate=rate, matmul_s=flops / rate,
        ops=ops, dispatch_s=ops * profile.op_s * turns,
        written=written, memory_s=written * profile.byte_s * turns,
        recompute_s=RECOMPUTED_SHARE * chunk_steps * share * again * turns,
        collectives=tuple(collectives), sharded_step_s=sharded_step_s, overlap=profile.overlap,
        bubble=bubble, turns=turns, optimizer_s=optimizer_s,
    )  # fmt: skip


def _sharded_costs(profile: Profile, link: Link, lay, kind: str) -> tuple[float, float]:
    """(s per call, s per step) of FSDP2 ("fsdp") or DTensor ("tp") under `lay`: a group
    smaller than the world pays the pair's costs where calibrate fitted them, else the
    world's per call (0: the link's latency) and the 2-rank one per step."""
    if kind == "fsdp":
        group, pair = lay.dp_shard, (link.fsdp_pair_call_s, link.fsdp_pair_step_s)
        whole = link.fsdp_call_s, profile.fsdp_step_s
    else:
        group, pair = lay.tp, (link.tp_pair_call_s, link.tp_pair_step_s)
        whole = link.tp_call_s, profile.tp_step_s
    if group == 1:
        return 0.0, 0.0
    return pair if group < lay.world_size and pair[0] else whole


def _param_width(config: Config) -> int:
    return {"fp64": 8, "bf16-true": 2}.get(config.precision.mode, 4)
