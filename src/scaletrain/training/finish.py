"""The end of a run: model.safetensors, hf-model/ (for a Hugging Face model), summary.json.

A split model (dp_shard, tp or pp) is saved by every rank at once (`save_split_weights`):
each rank writes its shards with torch.distributed.checkpoint's Hugging Face writer, and
rank 0 joins them into one model.safetensors region by region. No rank ever holds more of
the model than its shards and one piece being copied: not the whole model on rank 0, as a
gathered state dict would put it.

One function for both strategies, so that what a run leaves behind does not depend on how
it trained: the collective trainer (training/trainer.py) and the parameter servers' server
0 (ps/finish.py) both call `finish_run`. The weights are written by `save_model` from the whole
module when no gathered state dict is given: buffers included, and one name kept for
weights tied to each other (safetensors refuses aliases). A parameter server's copy of
`named_parameters()` would drop both.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file, save_model

from scaletrain.config import Config
from scaletrain.distill.build import sentence_tokenizer_dir
from scaletrain.distill.student import student_weights
from scaletrain.launch.resolve import Derived
from scaletrain.launch.rundir import write_summary
from scaletrain.parallel.compose import unwrap
from scaletrain.records.metrics import MetricsLogger
from scaletrain.runtime import honour_umask, written_atomically

WRITTEN = "written"  # `weights` when save_split_weights has written model.safetensors


def save_split_weights(model: torch.nn.Module, *, run_dir: Path) -> None:
    """RUN_DIR/model.safetensors from a split model: a collective, every rank calls it.

    Each rank writes its own shards (DCP's `HuggingFaceStorageWriter`, save_distributed)
    into RUN_DIR/.model-shards/sharded, one file per tensor: the writer serialises a file
    whole in memory, so one file per tensor keeps a rank's extra memory to one tensor's
    shard, not all of its shards. Rank 0 then consolidates them into one safetensors file
    of full tensors (DCP's consolidation, the function the writer calls itself: one full
    tensor in memory at a time), which becomes model.safetensors. Plain parameter names
    (torch's model state dict), the master dtype; under [distill] the student's alone, by
    its own names."""
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    net, _ = student_weights(unwrap(model), None)  # under [distill]: the student alone
    state = get_model_state_dict(net)  # this rank's shards (DTensors)
    staging = run_dir / ".model-shards"
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, list(state))  # under pp each stage holds other names
    every = sorted({name for part in names for name in part})
    writer = HuggingFaceStorageWriter(
        str(staging / "sharded"),
        fqn_to_index_mapping={name: i + 1 for i, name in enumerate(every)},  # a file each
        save_distributed=True,
    )
    dcp.save(state, storage_writer=writer)
    del state
    if dist.get_rank() == 0:
        consolidate_safetensors_files(
            input_dir=str(staging / "sharded"),
            output_dir=str(staging),
            fqn_to_index_mapping=dict.fromkeys(every, 1),  # one output file
        )
        (staging / "model-00001-of-00001.safetensors").replace(run_dir / "model.safetensors")
        honour_umask(run_dir / "model.safetensors")
        shutil.rmtree(staging)
    dist.barrier()


def write_weights(
    run_dir: Path,
    *,
    model: torch.nn.Module,
    weights: dict[str, torch.Tensor] | str | None,
    config: Config,
) -> None:
    """model.safetensors (and hf-model/ for model.name = "hf") in the dtype that was trained.

    Args:
        run_dir: the run directory.
        model: the trained module (DDP-wrapped or not; under [distill] the wrapper).
        weights: a full state dict gathered from every rank (a pipeline's stages), WRITTEN
            when `save_split_weights` has written model.safetensors already, or None when
            `model` is the whole model on this rank.
        config: the run's config (the model's name and size go into the metadata).
    """
    net, weights = student_weights(unwrap(model), weights)  # under [distill]: the student alone
    if weights == WRITTEN:
        if config.model.name == "hf":  # its directory: the config beside the same file
            from scaletrain.models.hf_files import save_hf_beside

            with written_atomically(run_dir / "hf-model") as tmp:
                save_hf_beside(
                    net,
                    tmp,
                    run_dir / "model.safetensors",
                    tokenizer_dir=sentence_tokenizer_dir(config),
                )
        return
    meta = {"model": config.model.name, "size": config.model.size}
    # Each output under a temporary name first: a crash mid-write leaves the old one whole.
    with written_atomically(run_dir / "model.safetensors") as tmp:
        if weights is None:
            save_model(net, str(tmp), metadata=meta)
        else:
            save_file(weights, str(tmp), metadata=meta)
        honour_umask(tmp)  # safetensors writes 0600
    if config.model.name == "hf":  # also as a model directory: model.path can fine-tune it
        from scaletrain.models.hf_files import save_hf

        with written_atomically(run_dir / "hf-model") as tmp:
            save_hf(
                net, tmp, state_dict=weights, tokenizer_dir=sentence_tokenizer_dir(config)
            )  # sentences: a whole encoder


def finish_run(
    run_dir: Path,
    *,
    model: torch.nn.Module,
    weights: dict[str, torch.Tensor] | None,
    config: Config,
    derived: Derived,
    train_s: float,
    eval_s: float,
    last_loss: float,
    eval_record: dict,
    skipped: int,
    precision_mode: str,
    steps_run: int | None = None,
    examples: int | None = None,
    tokens_per_example: int = 0,
    extra: dict | None = None,
    logger: MetricsLogger | None = None,
) -> dict:
    """Rank 0 (server 0 under "ps") writes the final weights and the summary; returns it.

    Args:
        run_dir, model, weights, config: as in `write_weights`.
        derived: the resolved layout (its world size goes into the summary).
        train_s: seconds this process spent training (its loop, evaluations excluded).
        eval_s: seconds it spent evaluating (mid-run and final).
        last_loss: mean training loss of the last logged window.
        eval_record: the final evaluation.
        skipped: steps (updates) skipped for a non-finite gradient.
        precision_mode: what ran ("auto" resolved).
        steps_run: global steps this process ran (a resumed run: since the resume); the
            examples are steps_run x train.global_batch unless `examples` is given.
        examples: examples trained on by this run (the parameter servers count them).
        tokens_per_example: tokens per example, for tokens_per_s (0: not a token model).
        extra: more sections of the summary (the parameter servers' "ps").
        logger: rank 0's metrics sinks: the trackers that keep files get the report PNG
            (drawn here for them), summary.json and config.toml.
    """
    write_weights(run_dir, model=model, weights=weights, config=config)
    if examples is None:
        examples = (steps_run or 0) * config.train.global_batch  # this process's share
    summary = {
        "final_loss": last_loss,  # mean training loss of the last log.every-step window
        "eval": eval_record,
        "train_time_s": train_s,  # the training loop's, evaluations excluded
        "eval_time_s": eval_s,
        "steps": config.train.steps,
        "skipped_steps": skipped,
        "world_size": derived.world_size,
        "examples": examples,  # trained on by this run (a resumed one: since the resume)
        "examples_per_s": examples / max(train_s, 1e-9),  # over train_time_s
        "tokens_per_s": examples * tokens_per_example / max(train_s, 1e-9),
        "precision": precision_mode,
        **(extra or {}),
    }
    write_summary(run_dir, summary)  # valid JSON: a NaN loss is written as null
    if logger is not None:
        logger.complete(_tracked_files(run_dir) if logger.takes_artifacts else ())
    return summary


def _tracked_files(run_dir: Path) -> list[Path]:
    """What the trackers keep of a finished run. The report is drawn here, on rank 0, for
    them: the launcher draws it again after the workers end (`scaletrain train`)."""
    from scaletrain.records.report import write_report

    report = write_report([run_dir], out=run_dir / "report.png")
    return [report, run_dir / "summary.json", run_dir / "config.toml"]
