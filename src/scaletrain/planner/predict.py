"""One layout's predicted memory, communication and step time, from what was measured on
meta (planner/held.py, planner/activations.py) and the hardware profile.

Memory per rank (the peak of a step):
    params + grads + optimizer state      exact, from the layout's own code (held.py)
  + activations x micro-batches in flight traced (activations.py); a pipeline stage keeps
                                          its blocks' share, for as many chunks as its
                                          schedule holds (1F1B: pp - stage, GPipe: all)
  + the largest saved tensor once more    its gradient during backward (the logits')
  + one checkpointed block's activations  while it recomputes
  + FSDP's gathered parameters            two units (the one running, the one prefetched);
                                          ZeRO-2 keeps every unit gathered until backward
  + runtime (a CPU profile)               what a process holds beyond its live tensors:
                                          rss_fixed + the larger of (rss_ratio - 1) x what
                                          a step adds (the allocator's slack: calibrate's
                                          DDP probe) and what FSDP2 or DTensor add once
                                          settled (calibrate's fsdp_rss + fsdp_rss_per_byte
                                          x the stage's parameters; (tp_rss_ratio - 1) x
                                          what a step adds; the larger once where a layout
                                          has both)

Communication per rank and step, by collective (ring algorithms, bytes on the wire):
    DDP / HSDP replicas   all-reduce of the gradients, 2 (r - 1) / r x their bytes, once a step
    FSDP                  all-gather (r - 1) / r x the unsharded parameters per micro-batch,
                          twice under ZeRO-3 (forward and backward); reduce-scatter of the
                          gradients per micro-batch
    tensor parallel       per block and micro-batch (under pp: per chunk of it), forward and
                          backward: with sequence parallelism two all-gathers and two
                          reduce-scatters of the (B, T, C) stream, without it two
                          all-reduces; the head's logits all-gathered
    pipeline              send/recv of each chunk's (B, T, C) boundary, forward and backward

Step time: compute (hardware FLOPs, recomputation included, over the profile's rate for
the compute dtype, a GPU's at the share of it a real matmul reaches; plus the forward's
traced ops x op_s and written bytes x byte_s, each with its backward, fitted by calibrate
on a reference model's real steps, and a third of that again for the ops activation
checkpointing runs a second time: only their forward, about 2 of the 6 bytes of traffic
per byte written) + the optimizer's pass over its bytes (memory bandwidth) + the
collectives (bytes over the bus bandwidth, plus per call the framework's measured cost for
FSDP and tensor parallelism, a group smaller than the world at calibrate's figure for
groups of 2, else the link's latency) + on a CPU FSDP2's and DTensor's measured cost once
a step (the stage's share; for a group of 2 among more ranks the figure fitted with its
calls), of which what does not overlap (on a GPU FSDP's and DDP's collectives hide
behind compute; gloo on a CPU overlaps nothing),
stretched by the pipeline's bubble (p - 1) / (v m). Where a CPU's ranks outnumber its
cores, a stage waiting in the bubble lends its core to the others: the step is then the
longer of the shared cores' work and the critical path (a rank's work at a whole core,
stretched by the bubble).
MFU = model FLOPs (no recomputation) / (step time x peak x world).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from scaletrain.config import Config
from scaletrain.launch.resolve import Derived
from scaletrain.models.flops import train_flops, transformer_flops, transformer_shape
from scaletrain.planner.activations import Activations
from scaletrain.planner.held import Held
from scaletrain.precision import matmul_dtype
from scaletrain.runtime.hardware import Link, Profile

RECOMPUTED_SHARE = 1 / 3  # of an op's cost (forward and backward), what its forward alone costs


@dataclass
class Prediction:
    layout: dict
    fits: bool
    memory_bytes: dict[str, int]
    comm_bytes: dict[str, float]
    step_time_s: float
    mfu: float | None
    comm_calls: dict[str, int] = field(default_factory=dict)  # collective calls per step
    calls_by_dim: dict[str, int] = field(default_factory=dict)  # the same by mesh dimension
    compute_s: float = 0.0
    comm_s: float = 0.0
    optim_s: float = 0.0
    ops: float = 0.0  # forward ops a step runs on this rank (each runs backward too)
    written: float = 0.0  # bytes those forward ops write
    bubble: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return {
            "layout": self.layout,
            "fits": self.fits,
            "memory_bytes": self.memory_bytes,
            "comm_bytes": self.comm_bytes,
            "step_time_s": self.step_time_s,
            "mfu": self.mfu,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "bubble": self.bubble,
        }


def spans_nodes(lay, dim: str, per_node: int) -> bool:
    """Whether a group of mesh dimension `dim` (a pipeline's: two neighbouring stages) has
    ranks on two nodes of `per_node` devices. Ranks are row-major over (pp, dp_replicate,
    dp_shard, tp) (parallel/layout.py), so a group's ranks are `inner` apart, where `inner`
    is the product of the degrees after its own, and it spans inner x size ranks."""
    order = ("pp", "dp_replicate", "dp_shard", "tp")
    inner = math.prod(getattr(lay, d) for d in order[order.index(dim) + 1 :])
    size = 2 if dim == "pp" else getattr(lay, dim)
    return inner * size > per_node


def compute_dtype(config: Config, profile: Profile) -> str:
    """The profile's key for the rate the config's matmuls run at: precision.tf32 puts fp32
    on TF32 tensor cores where the profile has them (a CPU's has none)."""
    tf32 = config.precision.tf32 and "tf32" in profile.flops
    return matmul_dtype(config.precision.mode, tf32=tf32)


def predict(
    config: Config,
    derived: Derived,
    *,
    layout_keys: dict,
    held: Held,
    acts: Activations,
    model: torch.nn.Module,
    example: torch.Tensor,
    profile: Profile,
    ranks_per_node: int,
    budget_bytes: int,
) -> Prediction:
    """The prediction for one accepted layout (module docstring).

    Args:
        held: rank 0's bytes under this layout; acts: one chunk's traced activations
            (a micro-batch, or under pp one chunk of it) under this layout's tp and AC.
        model: the bare model on meta (its shape and FLOPs); example: one example's inputs.
        ranks_per_node: the launch's ranks on one node (a CPU's share its cores; a group
            wider than a node spans nodes).
        budget_bytes: memory per rank to fit in (hardware.rank_budget).
    """
    lay, p = derived.layout, config.parallel
    mb = config.train.micro_batch
    pipe = derived.pipeline
    chunks = pipe.microbatches if pipe else 1
    stages = pipe.stages_per_rank if pipe else 1
    dtype = compute_dtype(config, profile)
    width = 2 if dtype in ("bf16", "fp16") else (8 if dtype == "fp64" else 4)

    # memory
    share = 1.0 / lay.pp  # a stage's part of the blocks (and of their ops and bytes)
    if pipe is None:
        in_flight = 1
    elif pipe.schedule == "gpipe":
        in_flight = chunks
    else:
        in_flight = min(chunks, lay.pp * stages)
    activations = int(acts.saved * share * in_flight)
    transient = acts.largest + acts.recompute
    unsharded = held.params * lay.dp_shard  # rank 0's stage, whole again
    gathered = 0
    if lay.dp_shard > 1:
        gathered = (
            2 * held.largest_unit if p.reshard_after_forward else unsharded + 2 * held.largest_unit
        )
        gathered = gathered * width // _param_width(config)
    # the costs calibrate measured among the world's ranks (none in a profile without links)
    world_link = profile.link(lay.world_size) if profile.intra else Link(bus_bw=1.0, latency_s=0.0)
    live = held.grads + held.optim + activations + transient + gathered  # a step's, over params
    runtime = _runtime_bytes(profile, lay, world_link, live=live, stage_params=unsharded * lay.tp)
    peak = held.params + live + runtime
    memory = {
        "params": held.params,
        "grads": held.grads,
        "optim": held.optim,
        "activations": activations + transient,
        "buffers": gathered,
        "runtime": runtime,
        "peak": peak,
    }

    # communication: (collective, mesh dimension, group size, bytes, calls, overlaps compute
    # on a GPU, seconds per call beyond the bytes where calibrate measured the framework's
    # own: else the link's latency)
    flows: list[tuple[str, str, int, float, int, bool, float]] = []
    accum = derived.accumulation
    shape = transformer_shape(model)
    units = max(1, held.units)
    if lay.dp_replicate > 1:
        r = lay.dp_replicate
        flows.append(("all_reduce", "dp_replicate", r, 2 * (r - 1) / r * held.grads, 1, True, 0.0))
    if lay.dp_shard > 1:
        s = lay.dp_shard
        fsdp_s = _per_call(world_link, "fsdp", group=s, world=lay.world_size)
        gathers = 2 if p.reshard_after_forward else 1
        unsharded_c = unsharded * width / _param_width(config)
        flows.append(
            (
                "all_gather",
                "dp_shard",
                s,
                gathers * (s - 1) / s * unsharded_c * accum,
                gathers * units * accum,
                True,
                fsdp_s,
            )
        )
        flows.append(
            (
                "reduce_scatter",
                "dp_shard",
                s,
                (s - 1) / s * unsharded * accum,
                units * accum,
                True,
                fsdp_s,
            )
        )
    seq = example.shape[-1] if example.dim() >= 1 else 1
    if lay.tp > 1 and shape is not None:
        t = lay.tp
        stream = mb * seq * shape.attention_width * width / chunks  # a chunk's (B, T, C)
        blocks = shape.layers // lay.pp
        calls = 4 * blocks * accum * chunks  # two in forward, two in backward, per block and chunk
        per_call = _per_call(world_link, "tp", group=t, world=lay.world_size)
        if p.sequence_parallel:
            gathered_s = calls * (t - 1) / t * stream
            flows.append(("all_gather", "tp", t, gathered_s, calls, False, per_call))
            flows.append(("reduce_scatter", "tp", t, gathered_s, calls, False, per_call))
        else:
            reduced = calls * 2 * (t - 1) / t * stream
            flows.append(("all_reduce", "tp", t, reduced, calls, False, per_call))
    if lay.pp > 1 and shape is not None:
        boundary = mb * seq * shape.attention_width * width / (lay.tp if p.sequence_parallel else 1)
        sends = 4 * stages * chunks * accum
        flows.append(("send_recv", "pp", 2, 4 * stages * boundary * accum, sends, False, 0.0))
    comm = {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0, "send_recv": 0.0}
    comm_calls = dict.fromkeys(comm, 0)
    calls_by_dim: dict[str, int] = {}
    for name, dim, _, nbytes, calls, *_ in flows:
        comm[name] += nbytes
        comm_calls[name] += calls
        calls_by_dim[dim] = calls_by_dim.get(dim, 0) + calls

    # time
    examples_per_rank = derived.examples_per_rank
    hw = train_flops(model, example.unsqueeze(0), recomputed_blocks=0)
    model_flops_rank = hw * examples_per_rank / (lay.tp * lay.pp)
    recomputed = held.recomputed_blocks * (lay.pp if lay.pp > 1 else 1)
    if shape is not None and recomputed:
        extra = transformer_flops(shape, batch=1, seq=seq, recomputed_blocks=recomputed)
        extra -= transformer_flops(shape, batch=1, seq=seq)
        hw_rank = (hw + extra) * examples_per_rank / (lay.tp * lay.pp)
    else:
        hw_rank = model_flops_rank
    # under "op" the matrix products its policy recomputes, as the trace counted them
    hw_rank += accum * chunks * share * acts.again_flops
    per_node = min(lay.world_size, ranks_per_node)
    rate = profile.peak(dtype, ranks_per_node=per_node) or profile.peak(
        "fp32", ranks_per_node=per_node
    )
    rate *= profile.matmul_efficiency  # what a real matmul reaches of that peak
    # Beyond the matmuls (profile.op_s and byte_s, fitted by calibrate on a reference model's
    # real steps): every op's dispatch and the element-wise work's memory traffic, per chunk,
    # and the forward again of what activation checkpointing recomputes in backward
    chunk_steps = accum * chunks
    ops = chunk_steps * share * acts.ops
    written = chunk_steps * share * acts.written
    ops_paid = ops + RECOMPUTED_SHARE * chunk_steps * share * acts.again_ops
    written_paid = written + RECOMPUTED_SHARE * chunk_steps * share * acts.again_written
    overhead_s = ops_paid * profile.op_s + written_paid * profile.byte_s
    overhead_s *= profile.slowdown(per_node)
    compute_s = hw_rank / rate + overhead_s
    optim_s = 3 * (held.params + held.grads + held.optim) / profile.memory_bw
    comm_s = overlapped = 0.0
    for _, dim, group, nbytes, calls, overlaps, per_call in flows:
        link = profile.link(group, spans_nodes=spans_nodes(lay, dim, per_node))
        seconds = nbytes / link.bus_bw + calls * (per_call or link.latency_s)
        comm_s += seconds
        overlapped += seconds if overlaps else 0.0
    # FSDP2's and DTensor's cost once a step beyond their calls (a CPU's: calibrate measured
    # it, with the calls it goes with), the stage's share of it; a layout with both pays the
    # larger once (its parameters are DTensors once). Not stretched where ranks outnumber
    # cores: with it stretched, GPT small's and base's dp_shard 2 x tp 2 on 4 ranks of 2
    # cores were predicted at 1.27-1.30x and 1.08x their measured steps; without, 1.05-1.17x
    # and 1.03-1.09x (BENCHMARKS.md)
    fsdp_step = _per_step(profile, world_link, "fsdp", group=lay.dp_shard, world=lay.world_size)
    tp_step = _per_step(profile, world_link, "tp", group=lay.tp, world=lay.world_size)
    comm_s += share * max(fsdp_step if lay.dp_shard > 1 else 0.0, tp_step if lay.tp > 1 else 0.0)
    exposed = comm_s - (min(overlapped, compute_s) if profile.overlap else 0.0)
    bubble = (lay.pp - 1) / (stages * chunks) if lay.pp > 1 else 0.0
    busy = compute_s + exposed
    turns = profile.slowdown(per_node)
    if turns > 1:
        # more ranks than cores (a CPU): a stage waiting in the bubble hands its core to the
        # other ranks, so the step is the longer of the shared cores' work and the
        # pipeline's critical path (a rank's own work at a whole core, stretched by the bubble)
        step = max(busy, busy / turns * (1 + bubble)) + optim_s
    else:
        step = busy * (1 + bubble) + optim_s
    model_flops_step = hw * config.train.global_batch
    peak_flops = profile.peak(dtype, ranks_per_node=per_node)
    mfu = model_flops_step / (step * peak_flops * lay.world_size) if peak_flops else None
    return Prediction(
        layout=layout_keys,
        fits=peak <= budget_bytes,
        memory_bytes=memory,
        comm_bytes={k: int(v) for k, v in comm.items()},
        step_time_s=step,
        comm_calls=comm_calls,
        calls_by_dim=calls_by_dim,
        mfu=mfu,
        compute_s=compute_s,
        comm_s=comm_s,
        optim_s=optim_s,
        ops=ops,
        written=written,
        bubble=bubble,
    )


def _runtime_bytes(profile: Profile, lay, first_use: Link, *, live: int, stage_params: int) -> int:
    """A CPU process's resident memory beyond its live tensors (0 on a GPU profile):
    rss_fixed, plus the largest of the claims on the same free heap:
    - the allocator's slack on what a step adds, (rss_ratio - 1) x the live bytes;
    - under FSDP2, what it adds once a rank's steps have settled (a one-process reference
      has none of it): a fixed part (the code and state it loads) and a part per byte of
      the stage's whole parameters (the holes its gathered buffers leave in the heap);
    - under tensor parallelism, DTensor's slack, (tp_rss_ratio - 1) x the live bytes: in
      proportion to what a step adds, with no fixed part (a fixed first use put GPT small's
      pp 2 x tp 2 27% over; reference._settled_rss).
    A layout with both pays the larger once (their sum over-predicted dp_shard x tp by ~30
    MiB). Why the largest and not the sum: all are free blocks the heap keeps, and the next
    step's activations and gathered buffers reuse whichever are there. Measured: small's
    ZeRO-3 settles at 95, 89 and 92 MiB above baseline at micro-batch 8, 4 and 8 with full
    recomputation, while its live bytes go 46, 28 and 22 (BENCHMARKS.md, the planner)."""
    sharded = max(
        first_use.fsdp_rss + profile.fsdp_rss_per_byte * stage_params if lay.dp_shard > 1 else 0,
        (profile.tp_rss_ratio - 1.0) * live if lay.tp > 1 else 0,
    )
    return int(profile.rss_fixed + max((profile.rss_ratio - 1.0) * live, sharded))


def _per_call(link: Link, kind: str, *, group: int, world: int) -> float:
    """Seconds per FSDP ("fsdp") or tensor-parallel ("tp") call beyond its bytes in a group
    of `group` among `world` ranks: calibrate's figure for groups of 2 where the group is
    smaller than the world and it has one, else the whole world's (0: the link's latency)."""
    pair = getattr(link, f"{kind}_pair_call_s")
    return pair if group < world and pair else getattr(link, f"{kind}_call_s")


def _per_step(profile: Profile, link: Link, kind: str, *, group: int, world: int) -> float:
    """FSDP2's ("fsdp") or DTensor's ("tp") cost once a step, the whole model's, that goes
    with `_per_call`'s figure: the pair's own (calibrate fitted the two together on this
    world's ranks) where the calls are the pair's, else calibrate's on 2 ranks."""
    if group < world and getattr(link, f"{kind}_pair_call_s"):
        return getattr(link, f"{kind}_pair_step_s")
    return getattr(profile, f"{kind}_step_s")


def _param_width(config: Config) -> int:
    return {"fp64": 8, "bf16-true": 2}.get(config.precision.mode, 4)
