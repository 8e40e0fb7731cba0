"""The run's plan: a validated Config and a world size become `Derived` values.

`resolve` is the one function that checks the config against the world before any worker
starts (the launcher calls it with the planned world; every worker calls it again with the
real one). It reads the config's sections and hands plain values to each room's own checks,
which sit beside what they protect:

    parallel/layout.py    layout_of: the degrees against the world size (LayoutError)
    parallel/checks.py    check_collective, pipeline_shape (check_schedule), ps_layout
    parallel/diloco.py    check_diloco: [diloco] keys against the layout
    distill/checks.py     check_distill_config: [distill] keys, teacher and cache
    here                  rules that span sections: model vs data source, batch
                          divisibility, the planned stop, torch.compile's needs, [ps]
                          keys under the collective strategy

Every refusal is one `ConfigError` naming the key, the value and what is allowed. Checks
that need the model built (its TP plan, its blocks) run later, in commands/prelaunch.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from scaletrain.config import BUILTIN_MODELS, TEXT_SOURCES, Config
from scaletrain.distill.checks import check_distill_config
from scaletrain.errors import ConfigError
from scaletrain.parallel.checks import (
    PipelineShape,
    PSShape,
    check_collective,
    pipeline_shape,
    ps_layout,
)
from scaletrain.parallel.diloco import check_diloco
from scaletrain.parallel.layout import ParallelLayout, layout_of
from scaletrain.precision import detect_hardware, slow_precision_warning
from scaletrain.user_code import is_import_path


@dataclass(frozen=True)
class Derived:
    """Values that follow from the config and the world the launcher starts."""

    world_size: int
    layout: ParallelLayout
    accumulation: int  # micro-batches per optimizer step on each rank
    examples_per_rank: int  # per optimizer step
    threads: int  # torch threads per process
    backend: str  # gloo or nccl
    pipeline: PipelineShape | None = None  # under pp > 1: schedule, chunks, stages per rank
    ps: PSShape | None = None  # parallel.strategy = 'ps': servers and workers
    warnings: tuple[str, ...] = ()  # legal but probably unwanted choices, printed at start


def resolve(config: Config, *, world_size: int, nproc_per_node: int | None = None) -> Derived:
    """Check the config against a world size and derive the step's shape.

    Args:
        config: a validated Config.
        world_size: total processes over all nodes.
        nproc_per_node: processes on this node (for threads); defaults to world_size.

    Raises:
        ConfigError: inconsistent combination (e.g. global batch not divisible).
    """
    nproc_per_node = nproc_per_node or world_size
    layout, ps = _layout(config, world_size=world_size)
    t = config.train
    per_step = t.micro_batch * layout.dp
    if t.global_batch % per_step != 0:
        raise ConfigError(
            f"train.global_batch = {t.global_batch} must be divisible by train.micro_batch x dp "
            f"= {t.micro_batch} x {layout.dp} = {per_step} (so every rank runs whole micro-batches; "
            f"dp = dp_replicate x dp_shard = {layout.dp_replicate} x {layout.dp_shard}); "
            f"e.g. train.global_batch={max(per_step, t.global_batch // per_step * per_step)}"
        )
    pipe = _check_collective(config, layout) if ps is None else None
    _check_diloco(config, layout)
    _check_model_and_data(config)
    check_distill_config(config, layout)
    _check_sources(config)
    if t.stop_after and t.stop_after >= t.steps:
        raise ConfigError(
            f"train.stop_after = {t.stop_after} must be below train.steps = "
            f"{t.steps} (0 disables the planned stop)"
        )
    if t.compile:
        _check_compile(bucket_cap_mb=config.parallel.bucket_cap_mb, dp=layout.dp)
    backend = config.parallel.backend
    if backend == "auto":
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if config.parallel.fsdp_offload and backend == "nccl":
        raise ConfigError(
            "parallel.fsdp_offload = true is refused on GPUs (backend nccl): the offloaded "
            "gradients live on the CPU, and the gradient-norm and loss all-reduces would need "
            "a CPU (gloo) process group beside NCCL, which scaletrain does not create yet; "
            "allowed: fsdp_offload on CPU runs (gloo), where it is tested against one process"
        )
    cores = len(os.sched_getaffinity(0))
    threads = t.threads or max(1, cores // nproc_per_node)
    return Derived(
        world_size=world_size,
        layout=layout,
        pipeline=pipe,
        ps=ps,
        accumulation=t.global_batch // per_step,
        examples_per_rank=t.global_batch // layout.dp,
        threads=threads,
        backend=backend,
        warnings=_warnings(
            config,
            layout,
            backend=backend,
            threads=threads,
            cores=cores,
            nproc_per_node=nproc_per_node,
        ),
    )


def _layout(config: Config, *, world_size: int) -> tuple[ParallelLayout, PSShape | None]:
    """The degrees (collective) or the servers and workers (ps), checked against the world."""
    pc = config.parallel
    if pc.strategy == "ps":
        return ps_layout(
            servers=config.ps.servers,
            world_size=world_size,
            dp=pc.dp,
            dp_replicate=pc.dp_replicate,
            degrees={"dp_shard": pc.dp_shard, "tp": pc.tp, "pp": pc.pp},
            comm_hook=pc.comm_hook,
            compile=config.train.compile,
            precision=config.precision.mode,
            lease_s=config.ps.worker_timeout_s,
            timeout_s=pc.timeout_s,
        )
    layout = layout_of(
        dp=pc.dp,
        dp_replicate=pc.dp_replicate,
        dp_shard=pc.dp_shard,
        tp=pc.tp,
        pp=pc.pp,
        world_size=world_size,
    )
    _check_keys_unused(config, "ps")
    return layout, None


def _check_collective(config: Config, layout: ParallelLayout) -> PipelineShape | None:
    """The collective techniques' refusals (parallel/checks.py), fed from the config."""
    pc, gpt = config.parallel, config.model.name == "gpt"
    check_collective(
        layout,
        comm_hook=pc.comm_hook,
        compile=config.train.compile,
        precision=config.precision.mode,
        optim_impl=config.optim.impl,
        sequence_parallel=pc.sequence_parallel,
        seq_len=config.data.seq_len if gpt else None,
        islands=pc.strategy == "diloco",
    )
    n_blocks = None
    if gpt and layout.pp > 1:  # the built-in GPT's depth is known before it is built
        from scaletrain.models.gpt import GPT_SHAPES

        n_blocks = GPT_SHAPES[config.model.size].n_layer
    return pipeline_shape(
        layout,
        schedule=pc.pp_schedule,
        microbatches=pc.pp_microbatches,
        stages_per_rank=pc.pp_stages_per_rank,
        micro_batch=config.train.micro_batch,
        n_blocks=n_blocks,
    )


def _check_diloco(config: Config, layout: ParallelLayout) -> None:
    """[diloco] is read only by its strategy, and checked against the layout there."""
    if config.parallel.strategy == "diloco":
        check_diloco(
            config.diloco,
            island_splits=layout.world_size > layout.dp_replicate,
            comm_hook=config.parallel.comm_hook,
            precision=config.precision.mode,
        )
        return
    _check_keys_unused(config, "diloco")


def _check_keys_unused(config: Config, section: str) -> None:
    """[ps] and [diloco] are read only by the strategy of the same name: a key changed
    under another strategy is a mistake. Compared with the defaults, not "given": a stored
    config.toml writes every key."""
    values = getattr(config, section)
    default = type(values)()
    changed = sorted(
        k for k in type(values).model_fields if getattr(values, k) != getattr(default, k)
    )
    if changed:
        raise ConfigError(
            f"{section}.{changed[0]} is only read with parallel.strategy = '{section}' "
            f"(parallel.strategy is {config.parallel.strategy!r}); set "
            f"parallel.strategy='{section}' or remove the [{section}] keys"
        )


def _check_model_and_data(config: Config) -> None:
    """The keys that only some model names and data sources read are given only with them."""
    m, d = config.model, config.data
    if m.name in BUILTIN_MODELS and m.kwargs:
        raise ConfigError(
            f"model.kwargs = {m.kwargs!r} is only read by model.name = 'hf' or an "
            f"import path; the built-in {m.name!r} is sized by model.size"
        )
    if m.name == "hf" and bool(m.path) == bool(m.hf_config):
        raise ConfigError(
            "model.name = 'hf' needs exactly one of model.path (a local model "
            "directory to fine-tune) and model.hf_config (a config.json or a "
            "transformers config class such as 'LlamaConfig', to train from "
            f"scratch); got path = {m.path!r}, hf_config = {m.hf_config!r}"
        )
    for key in ("path", "hf_config"):
        if getattr(m, key) and m.name != "hf":
            raise ConfigError(
                f"model.{key} = {getattr(m, key)!r} is only read with model.name "
                f"= 'hf' (model.name is {m.name!r})"
            )
    if m.name == "hf" and m.path and m.kwargs:
        raise ConfigError(
            f"model.kwargs = {m.kwargs!r} is only read with model.hf_config; a "
            "model directory (model.path) brings its own config.json"
        )
    if d.kwargs and not is_import_path(d.source) and d.source != "sentences":
        raise ConfigError(
            f"data.kwargs = {d.kwargs!r} is only read by a data function "
            f"(data.source = 'package.module:function'), not by {d.source!r}"
        )


def _check_sources(config: Config) -> None:
    """A built-in model meets a data source of its kind; data.path goes with shards only."""
    source, model = config.data.source, config.model.name
    shards = source == "shards"  # their task is known only when they are opened
    user_data = is_import_path(source)  # so is a user's dataset's
    if model == "gpt" and source not in TEXT_SOURCES and not (shards or user_data):
        raise ConfigError(
            f"model.name = 'gpt' needs a text source, but data.source = {source!r} "
            f"(allowed with gpt: {', '.join(map(repr, TEXT_SOURCES))})"
        )
    if model in ("mlp", "cnn") and source in TEXT_SOURCES:
        raise ConfigError(
            f"model.name = {model!r} needs an image source, but data.source = "
            f"{source!r} (use model.name='gpt' for text)"
        )
    if shards and not config.data.path:
        raise ConfigError(
            "data.source = 'shards' needs data.path, the directory the shards are "
            "in (written by `scaletrain shard SOURCE OUT_DIR` or by Spark)"
        )
    if not shards and config.data.path:
        raise ConfigError(
            f"data.path = {config.data.path!r} is only used with data.source = "
            f"'shards' (data.source is {source!r})"
        )


def _check_compile(*, bucket_cap_mb: float, dp: int) -> None:
    """train.compile needs a C++ compiler (inductor builds its kernels with one), and under
    DDP dynamo splits the graph at bucket boundaries with a first bucket of 1 MiB, which it
    asserts is no larger than the others."""
    import shutil

    compilers = ("g++", "c++", "clang++")
    if not any(shutil.which(c) for c in compilers):
        raise ConfigError(
            f"train.compile = true needs a C++ compiler for inductor's kernels, "
            f"but none of {', '.join(compilers)} is on PATH: install one (e.g. "
            "g++) or set train.compile=false"
        )
    if dp > 1 and bucket_cap_mb < 1.0:
        raise ConfigError(
            f"parallel.bucket_cap_mb = {bucket_cap_mb} is invalid with "
            f"train.compile = true and dp = {dp}: compiled DDP needs buckets of "
            "at least 1 MiB (its first bucket's size); use "
            "parallel.bucket_cap_mb >= 1 or train.compile=false"
        )


def _warnings(
    config: Config,
    layout: ParallelLayout,
    *,
    backend: str,
    threads: int,
    cores: int,
    nproc_per_node: int,
) -> tuple[str, ...]:
    """Legal but probably unwanted choices, printed when the run starts."""
    out = []
    if backend != "nccl" and (
        slow := slow_precision_warning(config.precision.mode, detect_hardware("cpu"))
    ):  # bf16 without avx512_bf16/AMX
        out.append(slow)
    if config.parallel.strategy == "diloco" and layout.dp_replicate == 1:
        out.append(
            "parallel.strategy = 'diloco' with one island (parallel.dp_replicate = 1): "
            "nothing is exchanged; each sync is the outer step on this island's progress alone"
        )
    if config.parallel.comm_hook != "none" and layout.dp == 1:
        out.append(f"parallel.comm_hook = {config.parallel.comm_hook!r} has no effect with dp = 1")
    if nproc_per_node * threads > cores:
        out.append(
            f"{nproc_per_node} process(es) x {threads} thread(s) = {nproc_per_node * threads} "
            f"threads on {cores} core(s): the node is oversubscribed and every step waits for "
            f"the slowest; use --nproc <= {cores}, or train.threads so that processes x "
            f"threads <= {cores}"
        )
    return tuple(out)
