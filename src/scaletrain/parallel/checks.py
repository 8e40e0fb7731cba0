"""What the parallel techniques refuse before any process starts, and the shapes they derive.

Each check is a pure function of plain values (degrees, key values), testable without a
config or a process group, raising `ConfigError` with the key, the value and what is
allowed. `launch/resolve.resolve` is the one caller: it reads the config's sections and hands the
values down, so this room imports nothing above itself. The layout's own degrees are checked
by `layout.layout_of`, the pipeline schedule by `pipeline.check_schedule`; here sit the rules
between techniques:

- `check_collective`: combinations of DDP, FSDP, TP, PP, compile, fp16 and comm hooks that
  cannot work together, each refusal saying why;
- `pipeline_shape`: under pp > 1, the schedule, chunks and stages per rank with their
  defaults filled in (a `PipelineShape`), checked by the schedule;
- `ps_layout`: under parallel.strategy = 'ps', who serves and who works (a `PSShape`).
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.errors import ConfigError
from scaletrain.parallel.layout import ParallelLayout
from scaletrain.parallel.pipeline import PipelineConfigError, check_schedule


def check_collective(
    layout: ParallelLayout,
    *,
    comm_hook: str,
    compile: bool,
    precision: str,
    optim_impl: str,
    sequence_parallel: bool,
    seq_len: int | None,
    islands: bool = False,
) -> None:
    """Refuse combinations of the collective techniques that cannot work.

    Args:
        layout: the resolved degrees.
        comm_hook, sequence_parallel: parallel.comm_hook, parallel.sequence_parallel.
        compile: train.compile; precision: precision.mode; optim_impl: optim.impl.
        seq_len: data.seq_len when the model splits positions under sequence parallelism
            (the built-in GPT), else None.
        islands: parallel.strategy = 'diloco': dp_replicate is islands, not DDP replicas
            (any layout runs inside each; parallel/diloco.py checks its own keys).
    """
    ddp = layout.dp_replicate > 1 and layout.dp_shard == 1 and not islands
    if ddp and (layout.tp > 1 or layout.pp > 1):
        raise ConfigError(
            f"parallel.dp_replicate = {layout.dp_replicate} with tp = {layout.tp} and pp = "
            f"{layout.pp}: DDP replicates whole models and does not compose with tensor or "
            "pipeline parallelism; shard instead (parallel.dp_shard="
            + str(layout.dp_replicate)
            + ", FSDP) or combine both as HSDP (dp_replicate x dp_shard)"
        )
    if layout.dp_shard > 1 and comm_hook != "none":
        raise ConfigError(
            f"parallel.comm_hook = {comm_hook!r} compresses DDP's all-reduce, "
            f"but dp_shard = {layout.dp_shard} reduce-scatters with FSDP; use "
            "parallel.comm_hook='none' with sharding"
        )
    if (layout.tp > 1 or layout.pp > 1 or layout.dp_shard > 1) and compile:
        raise ConfigError(
            "train.compile = true is for the DDP path only here; with "
            f"{layout.describe()} set train.compile=false"
        )
    if precision == "fp16-mixed" and optim_impl == "fused" and layout.splits_gradients:
        raise ConfigError(
            f"optim.impl = 'fused' with precision.mode = 'fp16-mixed' under "
            f"{layout.describe()}: the fused kernels cannot take the loss "
            "scaler's overflow flag with sharded (DTensor) parameters; use "
            "optim.impl='foreach' or 'auto'"
        )
    if precision == "fp16-mixed" and layout.tp > 1 and layout.dp_shard == 1:
        raise ConfigError(
            f"precision.mode = 'fp16-mixed' with tp = {layout.tp} and no dp_shard: "
            "tensor parallelism leaves the norms and embeddings plain tensors "
            "beside its DTensors, and the loss scaler cannot unscale both in one "
            "call; add parallel.dp_shard (FSDP makes every parameter a DTensor) "
            "or use precision.mode='bf16-mixed' (no loss scaling)"
        )
    if layout.tp > 1 and sequence_parallel and seq_len is not None and seq_len % layout.tp:
        raise ConfigError(
            f"data.seq_len = {seq_len} is not divisible by parallel.tp "
            f"= {layout.tp}: sequence parallelism gives every tensor-parallel rank "
            "an equal share of the positions; use a seq_len that tp divides, or "
            "parallel.sequence_parallel=false"
        )


@dataclass(frozen=True)
class PipelineShape:
    """What pipeline parallelism does with each micro-batch."""

    schedule: str
    microbatches: int  # chunks of train.micro_batch in flight through the stages
    stages_per_rank: int
    n_blocks: int | None  # the built-in GPT's depth (None: known once the model is built)


def pipeline_shape(
    layout: ParallelLayout,
    *,
    schedule: str,
    microbatches: int,
    stages_per_rank: int,
    micro_batch: int,
    n_blocks: int | None,
) -> PipelineShape | None:
    """The pipeline's shape with its defaults filled in (None when pp = 1).

    Args:
        layout: the resolved degrees.
        schedule, microbatches, stages_per_rank: parallel.pp_schedule, pp_microbatches and
            pp_stages_per_rank as given (0 = the default: pp x stages chunks; 1 stage per
            rank for gpipe/1f1b, else 2).
        micro_batch: train.micro_batch, split into `microbatches` equal chunks.
        n_blocks: the model's depth when known before it is built.
    """
    if layout.pp == 1:
        return None
    interleaved = schedule in ("interleaved-1f1b", "zero-bubble")
    stages = stages_per_rank or (2 if interleaved else 1)
    chunks = microbatches or layout.pp * stages
    try:
        check_schedule(
            schedule, pp=layout.pp, microbatches=chunks, stages_per_rank=stages, n_blocks=n_blocks
        )
    except PipelineConfigError as e:
        raise ConfigError(str(e)) from None
    if micro_batch % chunks:
        raise ConfigError(
            f"train.micro_batch = {micro_batch} must be divisible by "
            f"parallel.pp_microbatches = {chunks} (each micro-batch is split into "
            f"that many equal chunks for the pipeline)"
        )
    return PipelineShape(
        schedule=schedule, microbatches=chunks, stages_per_rank=stages, n_blocks=n_blocks
    )


@dataclass(frozen=True)
class PSShape:
    """Who does what under parallel.strategy = 'ps'."""

    servers: int  # ranks 0 .. servers-1
    workers: int  # ranks servers .. world-1

    def role(self, rank: int) -> tuple[str, int]:
        """("server", k) or ("worker", w) for a global rank."""
        return ("server", rank) if rank < self.servers else ("worker", rank - self.servers)


# What the parameter-server strategy refuses beside it: each worker holds the whole model and
# pushes plain gradients; nothing else shards, splits or compresses them.
PS_REFUSES_DEGREES = ("dp_shard", "tp", "pp")


def ps_layout(
    *,
    servers: int,
    world_size: int,
    dp: int,
    dp_replicate: int,
    degrees: dict[str, int],
    comm_hook: str,
    compile: bool,
    precision: str,
    lease_s: float,
    timeout_s: float,
) -> tuple[ParallelLayout, PSShape]:
    """The parameter-server roles, checked against the world: the workers are the
    data-parallel replicas (the sampler's dp), the servers hold the parameters.

    Args:
        servers: ps.servers; world_size: processes launched.
        dp, dp_replicate: parallel.dp and parallel.dp_replicate (-1 = not given).
        degrees: parallel.dp_shard, tp and pp by name (PS_REFUSES_DEGREES).
        comm_hook, compile, precision: parallel.comm_hook, train.compile, precision.mode.
        lease_s, timeout_s: ps.worker_timeout_s and parallel.timeout_s.
    """
    workers = world_size - servers
    if workers < 1:
        raise ConfigError(
            f"parallel.strategy = 'ps' with ps.servers = {servers} needs at "
            f"least {servers + 1} processes (servers + one worker), but the "
            f"world has {world_size}; use --nproc {servers + 1} or more, or set "
            "parallel.dp to the number of workers"
        )
    replicate = dp_replicate if dp_replicate != -1 else dp
    if replicate not in (-1, workers):
        key = "parallel.dp" if dp != -1 else "parallel.dp_replicate"
        raise ConfigError(
            f"{key} = {replicate} under parallel.strategy = 'ps' is the number "
            f"of workers, but {world_size} processes - ps.servers = {servers} "
            f"leaves {workers}; use --nproc {servers + replicate} or "
            f"{key}={workers}"
        )
    for key in PS_REFUSES_DEGREES:
        value = degrees[key]
        if value not in (1, -1) or (key == "dp_shard" and value == -1):
            raise ConfigError(
                f"parallel.{key} = {value} does not compose with parallel.strategy "
                "= 'ps': each worker holds the whole model and the servers hold "
                f"its parameters; use parallel.{key}=1, or the collective strategy"
            )
    if comm_hook != "none":
        raise ConfigError(
            f"parallel.comm_hook = {comm_hook!r} compresses DDP's all-reduce, "
            "which parallel.strategy = 'ps' does not run; use comm_hook='none'"
        )
    if compile:
        raise ConfigError(
            "train.compile = true is for the collective strategy only here; set "
            "train.compile=false with parallel.strategy = 'ps'"
        )
    if precision == "fp16-mixed":
        raise ConfigError(
            "precision.mode = 'fp16-mixed' is not supported with parallel.strategy "
            "= 'ps' (a worker's loss scaler would have to skip pushes the servers "
            "wait for); use 'bf16-mixed', 'fp32' or 'fp64'"
        )
    if lease_s >= timeout_s:
        raise ConfigError(
            f"ps.worker_timeout_s = {lease_s:g} must be below parallel.timeout_s = "
            f"{timeout_s:g}: the servers wait for a silent worker (in their RPCs, the sync "
            "step's agreement and a checkpoint cut) until it is declared dead, so a lease "
            "that long times the run out first; lower ps.worker_timeout_s or raise "
            "parallel.timeout_s"
        )
    return (
        ParallelLayout(dp_replicate=workers).resolve(workers),
        PSShape(servers=servers, workers=workers),
    )
