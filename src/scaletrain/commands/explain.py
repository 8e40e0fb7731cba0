"""`scaletrain explain`: the checks `train` runs, then what it derives (world, layout,
batches, precision, kernels, epochs), and with --all every key with its value and meaning."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scaletrain.commands.distill import explain_rows as distill_explain_rows
from scaletrain.commands.train import launch_spec, warn_if_empty
from scaletrain.config import Config, describe_fields, load_config
from scaletrain.errors import UserError
from scaletrain.launch.resolve import resolve


def _train_rows(config: Config) -> int | None:
    """Rows in the training split: from the manifest for shards, else by loading the source
    (the built-in ones load in well under a second); None if they cannot be read."""
    d = config.data
    try:
        if d.source == "shards":
            from scaletrain.data.manifest import MANIFEST, find_split_dir, read_manifest

            split = find_split_dir(Path(d.path), "train")
            if split is not None and (split / MANIFEST).is_file():
                return read_manifest(split).rows
        if d.source == "sentences":  # the items, untokenized (with augment: ~10-20 s)
            from scaletrain.data.sentences import split_texts
            from scaletrain.distill.build import sentence_tokenizer_dir

            return len(
                split_texts(
                    d.kwargs,
                    split="train",
                    seed=config.train.seed,
                    tokenizer_dir=sentence_tokenizer_dir(config),
                )
            )
        from scaletrain.data.loader import load_dataset

        return len(
            load_dataset(
                d.source,
                split="train",
                path=d.path,
                seq_len=d.seq_len,
                synthetic_examples=d.synthetic_examples,
                seed=config.train.seed,
            )
        )
    except (OSError, UserError):  # ShardError, SourceError: preflight names the problem
        return None


def cmd_explain(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from scaletrain.commands.api import preflight_data
    from scaletrain.commands.prelaunch import check_layout_fits
    from scaletrain.training.assemble import brings_own_code, check_user_code

    config = load_config(args.config, args.overrides)
    spec = launch_spec(args, config)
    d = resolve(config, world_size=spec.world_size, nproc_per_node=spec.nproc)
    preflight_data(config)
    if brings_own_code(config):  # the user's model, data or loss: built and run as train does
        check_user_code(config)
    check_layout_fits(config, d)  # what train would refuse about the model and the layout
    warn_if_empty(args.config, config)
    console = Console()
    device = "cuda" if d.backend == "nccl" else "cpu"
    precision = config.precision.mode
    if precision == "auto":  # what train would run: measured here (or cached)
        from scaletrain.training.auto_precision import resolve_auto

        _, auto = resolve_auto(config, d)
        precision = f"auto -> {auto.mode} ({auto.why})"
    derived = {
        "world size": f"{d.world_size} ({spec.nproc} process(es) x {spec.nnodes} node(s))",
        "parallel layout (mesh)": (
            d.layout.describe()
            if d.ps is None
            else "none: workers and servers talk over torch.distributed.rpc"
        ),
        "data parallel (dp)": (
            f"{d.layout.dp} = dp_replicate {d.layout.dp_replicate} x dp_shard {d.layout.dp_shard}"
            if d.ps is None
            else f"{d.layout.dp} workers, each its share of every step"
        ),
        **_pipeline_rows(config, d),
        **_ps_rows(config, d),
        **_diloco_rows(config, d),
        **distill_explain_rows(config),
        "global batch": config.train.global_batch,
        "micro-batch": config.train.micro_batch,
        "accumulation steps": d.accumulation,
        "examples per rank per step": d.examples_per_rank,
        "threads per process": d.threads,
        "backend": d.backend,
        "precision": precision,
        "optimizer kernels": _optimizer_kernels(config.optim, device),
        "CPU heap policy": _heap_policy(config.train.allocator, device),
        "torch.compile": "on (inductor, before DDP)"
        if config.train.compile
        else "off (train.compile; on a CPU its compile time outweighs what it saves a step "
        "except on long runs: bench/step_anatomy.py --compile, BENCHMARKS.md)",
        "epochs": _epochs(config),
        **_eval_rows(config, d, local_ranks=spec.nproc),
    }
    # What the config comes to first (a screen), then the placement; the key-by-key listing
    # (hundreds of lines) only with --all.
    out = Table(title="derived")
    out.add_column("quantity")
    out.add_column("value")
    for k, v in derived.items():
        out.add_row(k, escape(str(v)))
    console.print(out)
    if d.world_size > 1 and d.ps is None:
        console.print(_placement_table(d))
    if args.all_fields:
        table = Table(title=f"config {args.config}", show_lines=False)
        for col in ("key", "value", "meaning"):
            table.add_column(col)
        for key, value, doc in describe_fields(config):  # as written: "[ps]" is not markup
            table.add_row(escape(key), escape(repr(value)), escape(doc))
        console.print(table)
    else:
        console.print(
            f"every config key, its value and meaning: scaletrain explain "
            f"{escape(str(args.config))} ... --all"
        )
    for warning in d.warnings:
        print(f"scaletrain: warning: {warning}", file=sys.stderr)
    return 0


def _eval_rows(config: Config, d, *, local_ranks: int) -> dict[str, str]:
    """What the final evaluation costs: its forwards per data-parallel rank and, under
    dp_shard, how often FSDP gathers the model for them (train.eval_gather)."""
    from scaletrain.data.sampler import eval_indices
    from scaletrain.training.assemble import build_data, build_net
    from scaletrain.training.evaluate import keeps_gathered

    if d.ps is not None:
        return {}
    t = config.train
    eval_ds = build_data(config, split="eval")
    forwards = len(
        eval_indices(
            len(eval_ds), limit=t.eval_examples, dp_rank=0, dp_size=d.layout.dp, batch=t.micro_batch
        )
    )
    row = f"{min(len(eval_ds), t.eval_examples)} examples, {forwards} forward(s) per dp rank"
    if d.layout.dp_shard > 1 and forwards > 1:
        model = build_net(config, eval_ds, meta=True)
        width = 8 if config.precision.mode == "fp64" else 4  # the master weights' bytes
        size = sum(p.numel() for p in model.parameters()) * width
        keep = keeps_gathered(t.eval_gather, unsharded_bytes=size, local_ranks=local_ranks)
        row += (
            f"; FSDP gathers the model's {size / 2**20:,.1f} MiB "
            + (
                "once and keeps it for all of them"
                if keep
                else f"for each forward ({forwards} x, no more memory than a step)"
            )
            + f" (train.eval_gather = {t.eval_gather!r})"
        )
    return {"final evaluation": row}


def _ps_rows(config: Config, d) -> dict[str, str]:
    """Who serves and who works under parallel.strategy = 'ps', and what a step means."""
    if d.ps is None:
        return {}
    ps, shape = config.ps, d.ps
    rule = {
        "async": "each gradient applied as it arrives",
        "ssp": f"a worker waits while more than {ps.staleness} step(s) ahead of the slowest",
        "sync": "one update per step: the mean of every live worker's gradient",
    }[ps.mode]
    per_step = 1 if ps.mode == "sync" else shape.workers
    return {
        "strategy": f"parameter servers ({ps.mode}: {rule})",
        "servers": f"{shape.servers} (ranks 0..{shape.servers - 1}; parameters split by bytes)",
        "workers": f"{shape.workers} (ranks {shape.servers}..{d.world_size - 1})",
        "server updates per step": f"{per_step} of {config.train.global_batch // shape.workers} "
        "examples each"
        if per_step > 1
        else "1 (the workers' mean)",
        "worker lease": f"{ps.worker_timeout_s:g} s (heartbeats every "
        f"{ps.worker_timeout_s / 4:g} s)",
        "listens on": f"interface {ps.interface!r} only",
    }


def _diloco_rows(config: Config, d) -> dict[str, str]:
    """The islands under parallel.strategy = 'diloco', and what crosses between them."""
    if config.parallel.strategy != "diloco":
        return {}
    dl, layout = config.diloco, d.layout
    inside = {k: v for k, v in layout.sizes.items() if k != "dp_replicate"}
    island = " x ".join(f"{k}={v}" for k, v in inside.items()) or "1 rank"
    stream = (
        f", {dl.fragments} fragments staggered by {dl.sync_every // dl.fragments} steps"
        + (f", each overlapping {dl.overlap_steps} step(s)" if dl.overlap_steps else "")
        if dl.fragments > 1
        else ""
    )
    return {
        "strategy": f"DiLoCo: {layout.dp_replicate} island(s) of {island}",
        "islands meet": (
            f"every {dl.sync_every} steps{stream}: pseudo-gradients ({dl.quantize}) "
            f"averaged over dp_replicate, outer SGD lr {dl.outer_lr} momentum "
            f"{dl.outer_momentum}{' (Nesterov)' if dl.nesterov else ''}"
        ),
    }


def _pipeline_rows(config: Config, d) -> dict[str, str]:
    """The micro-batch arithmetic under pipeline parallelism, and its bubble in theory."""
    pipe = d.pipeline
    if pipe is None:
        return {}
    from scaletrain.parallel.pipeline import idle_fraction_theory

    mb, m = config.train.micro_batch, pipe.microbatches
    stages = d.layout.pp * pipe.stages_per_rank
    bubble = idle_fraction_theory(
        pipe.schedule, pp=d.layout.pp, microbatches=m, stages_per_rank=pipe.stages_per_rank
    )
    return {
        "pipeline": f"{pipe.schedule}: {stages} stages, {pipe.stages_per_rank} per rank",
        "pipeline chunks": f"each micro-batch of {mb} -> {m} chunks of {mb // m} "
        f"(x {d.accumulation} micro-batches per step)",
        "pipeline bubble (theory)": f"{bubble:.1%} of each rank's step idle",
    }


def _placement_table(d):
    """Which ranks hold which pipeline stage, FSDP shard and tensor-parallel slice."""
    from rich.table import Table

    from scaletrain.parallel.pipeline import stage_ids

    layout, pipe = d.layout, d.pipeline
    table = Table(title=f"ranks ({layout.describe()})")
    for col in ("rank", *layout.sizes, "batch share", "holds"):
        table.add_column(col)
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        holds = []
        if pipe is not None:
            ids = stage_ids(
                pp_rank=c["pp"],
                pp=layout.pp,
                stages_per_rank=pipe.stages_per_rank,
                schedule=pipe.schedule,
            )
            holds.append("stage " + ", ".join(map(str, ids)))
        if layout.dp_shard > 1:
            holds.append(f"FSDP shard {c['dp_shard'] + 1}/{layout.dp_shard}")
        if layout.tp > 1:
            holds.append(f"TP slice {c['tp'] + 1}/{layout.tp}")
        if not holds:
            holds.append("a whole replica")
        table.add_row(
            str(rank),
            *(str(c[k]) for k in layout.sizes),
            f"{layout.dp_rank(rank) + 1}/{layout.dp}",
            "; ".join(holds),
        )
    return table


def _optimizer_kernels(optim, device: str) -> str:
    """What optim.impl resolves to for this optimizer on this device (for explain)."""
    import torch

    from scaletrain.training.optim import chosen_kernels

    probe = [torch.zeros(1, device=device)] if device == "cpu" else []
    if optim.impl != "auto" or not probe:
        return optim.impl
    return f"auto -> {chosen_kernels(optim, probe)}"


def _heap_policy(mode: str, device: str) -> str:
    from scaletrain.runtime.allocator import AUTO_RELEASE_BYTES, resolve_allocator

    chosen = resolve_allocator(mode, device_type=device)  # the model's size not known here
    if mode != "auto":
        return chosen
    if chosen == "retain":
        return (
            f"auto -> retain (release for a model of {AUTO_RELEASE_BYTES // 2**20} MiB of "
            "parameters or more)"
        )
    return f"auto -> {chosen}"


def _epochs(config: Config) -> str:
    rows, t = _train_rows(config), config.train
    if not rows:
        return "unknown (the training rows could not be counted)"
    return (
        f"{t.steps * t.global_batch / rows:.3g} ({t.steps} steps x {t.global_batch} / {rows} rows)"
    )
