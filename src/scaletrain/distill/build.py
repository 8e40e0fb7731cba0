"""Distillation wired from the config: teacher, student wrapper and loss, in that order.

`build_distillation` is the one place `[distill]` is read for training (the launcher's
checks are in `check_distill_config`): it loads and verifies the teacher (or reads the
cache's description of it), maps and initialises the student's layers from it, casts the
teacher to its precision, wraps the student with its projections (`Distilled`) and returns
the combined loss. The trainer then treats the wrapped student and the loss like any model
and loss: precision, DDP / FSDP, accumulation and checkpoints need nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from scaletrain.config import Config
from scaletrain.data.loader import Dataset
from scaletrain.data.sources import TaskSpec
from scaletrain.distill.checks import encoder_loss_problem
from scaletrain.distill.objective import Needs, Weights, distillation_loss, needs_of
from scaletrain.distill.student import Distilled, init_from_teacher, n_blocks, resolve_layer_map
from scaletrain.distill.teacher import (
    MINILM,
    Teacher,
    load_teacher,
    resolve_tokenizer_dir,
    set_precision,
    teacher_dtype,
    teacher_sha256,
)
from scaletrain.loss import LossFn
from scaletrain.models.init import is_meta
from scaletrain.precision import Precision
from scaletrain.user_code import UserCodeError


def distilling(config: Config) -> bool:
    return bool(config.distill.teacher or config.distill.cache)


def weights_of(config: Config) -> Weights:
    d = config.distill
    return Weights(
        alpha=d.alpha,
        temperature=d.temperature,
        hidden=d.hidden_weight,
        attention=d.attention_weight,
        cosine=d.cosine_weight,
        cosine_on=d.cosine_on,
    )


@dataclass
class Distillation:
    model: Distilled  # the student with its projections: what the trainer trains
    loss_fn: LossFn
    teacher: Teacher | None  # None when the run reads a cache
    needs: Needs
    layer_map: list[int]
    initialised: list[str]  # student weights copied from the teacher
    teacher_sha256: str | None = None  # of the teacher loaded here (None: none was loaded)


def build_distillation(
    config: Config,
    student: nn.Module,
    *,
    task: TaskSpec,
    hard: LossFn | None,
    precision: Precision,
    cache_info: dict | None = None,
    teacher_meta: bool = False,
) -> Distillation:
    """Teacher, layer map, initialisation, teacher precision, wrapper and loss.

    Args:
        config: the run's config ([distill] on).
        student: the freshly built student (bare, in float32 or float64): real, or on the
            meta device (the wrapper then is too, for the trainer to materialise each rank's
            shards); real with distill.init_layers, which copies teacher values into it.
        task: the data's task.
        hard: the hard-label loss, None for sentence data.
        precision: the student's precision (the teacher's 'same' follows it).
        cache_info: with distill.cache, the cache's metadata (teacher layers and width).
        teacher_meta: build a Hugging Face teacher on the meta device, for
            `place_teacher` to read each rank's slices (the trainer under dp_shard); not
            with init_layers, which copies its values now.
    """
    d, w = config.distill, weights_of(config)
    hugging_face = _is_hf(student)
    if (w.hidden > 0 or w.attention > 0) and not hugging_face:
        raise UserCodeError(
            "distill.hidden_weight and distill.attention_weight need a Hugging "
            "Face student and teacher (their hidden states and attention maps); "
            f"model.name = {config.model.name!r} gives logits only"
        )
    problem = (
        encoder_loss_problem(
            hidden=w.hidden, attention=w.attention, cosine=w.cosine, cosine_on=w.cosine_on
        )
        if task.kind == "encode"
        else None
    )
    if problem:
        raise UserCodeError(problem)
    if w.cosine > 0 and w.cosine_on == "pooled" and task.kind != "encode":
        raise UserCodeError(
            f"distill.cosine_on = 'pooled' compares an encoder's mean-pooled "
            f"hidden states, but the data are {task.kind!r} (a classifier or LM "
            "gives logits): use distill.cosine_on = 'logits'"
        )
    if (
        w.cosine > 0
        and w.cosine_on == "logits"
        and cache_info
        and any("logits_index" in part["shapes"] for part in cache_info["splits"].values())
    ):
        raise UserCodeError(
            f"distill.cosine_on = 'logits' needs every logit, but distill.cache "
            f"kept the top {cache_info['top_k']} (distill.top_k): write the cache "
            "with top_k = 0, or use the KL (alpha) alone"
        )
    teacher = None
    if not d.cache or d.init_layers:  # the cache replaces the teacher, except to copy layers
        load_dtype = torch.float64 if precision.param_dtype == torch.float64 else torch.float32
        teacher = load_teacher(
            d.teacher,
            task=task,
            expected_sha256=d.teacher_sha256,
            load_dtype=load_dtype,
            attentions=w.attention > 0,
            meta=teacher_meta and not d.init_layers,  # init_layers copies its values now
        )
    if w.attention > 0:
        student.set_attn_implementation("eager")  # sdpa returns no attention maps
    if getattr(student, "pooler", None) is not None and task.kind == "encode":
        # BERT's pooler (a dense layer on the first token) feeds none of the losses, which
        # read hidden states; DDP requires every parameter to get a gradient.
        student.pooler = None
    layer_map: list[int] = []
    if w.hidden > 0 or w.attention > 0:
        teacher_layers = (
            n_blocks(teacher.module) if cache_info is None else int(cache_info["teacher_layers"])
        )
        layer_map = resolve_layer_map(
            d.layer_map,
            student_layers=n_blocks(student),
            teacher_layers=teacher_layers,
            attention=w.attention > 0,
        )
    if d.init_layers and is_meta(student):  # a caller's mistake: nothing would be copied
        raise ValueError("distill.init_layers copies teacher values: build the student real")
    initialised = (
        init_from_teacher(student, teacher.module, list(d.init_layers)) if d.init_layers else []
    )
    needs = needs_of(w, task_kind=task.kind, layer_map=layer_map)
    sha = teacher.sha256 if teacher is not None else None
    if d.cache:
        teacher = None  # loaded only to copy its layers
    else:
        teacher = set_precision(teacher, run_teacher_dtype(config, precision))
    width = 0
    if w.hidden > 0:
        width = (
            int(cache_info["teacher_width"])
            if cache_info is not None
            else int(teacher.module.config.hidden_size)
        )
    model = Distilled(
        student,
        layer_map=layer_map,
        teacher_width=width,
        hidden=w.hidden > 0,
        attentions=w.attention > 0,
        hugging_face=hugging_face,
        seed=config.train.seed,  # a real student's projections, drawn as a meta one's
    )
    loss_fn = distillation_loss(
        hard, teacher=teacher, weights=w, needs=needs, layer_map=layer_map, task_kind=task.kind
    )
    return Distillation(
        model=model,
        loss_fn=loss_fn,
        teacher=teacher,
        needs=needs,
        layer_map=layer_map,
        initialised=initialised,
        teacher_sha256=sha,
    )


def run_teacher_dtype(config: Config, precision: Precision) -> torch.dtype:
    return teacher_dtype(
        config.distill.teacher_precision,
        student_param_dtype=precision.param_dtype,
        student_compute_bf16=precision.mode == "bf16-mixed",
    )


def cached_splits(
    config: Config, kd: Distillation, *, precision: Precision, splits: dict[str, Dataset]
) -> dict[str, Dataset]:
    """Each split with its cached teacher outputs, once the cache is checked against the run:
    its data, its teacher, its dtype, the outputs needed.

    The teacher is distill.teacher's weights (a run, a checkpoint, whose weights are exported
    to hash them, or a Hugging Face directory), which must also match distill.teacher_sha256
    when both are given; with the cache alone, distill.teacher_sha256 (when given) is the
    cache's teacher."""
    from scaletrain.distill.cache import with_cache

    d = config.distill
    if d.teacher:
        sha = kd.teacher_sha256 or teacher_sha256(d.teacher, expected_sha256=d.teacher_sha256)
        key = "distill.teacher"
    else:
        sha, key = d.teacher_sha256 or None, "distill.teacher_sha256"
    dtype = str(run_teacher_dtype(config, precision)).removeprefix("torch.")
    return {
        split: with_cache(
            ds,
            d.cache,
            split=split,
            needs_keys=kd.needs.keys(),
            teacher_sha256=sha,
            teacher_dtype=dtype,
            teacher_key=key,
        )
        for split, ds in splits.items()
    }


def sentence_tokenizer_dir(config: Config) -> Path | None:
    """The tokenizer directory of data.source = 'sentences' (data.kwargs.tokenizer, default the
    packaged teacher's), None for other data. Decided here, above the data layer, and handed
    to it (data/sentences.py) and to the student's hf-model/ as a plain path."""
    if config.data.source != "sentences":
        return None
    return resolve_tokenizer_dir(str(config.data.kwargs.get("tokenizer", MINILM)))


def _is_hf(module: nn.Module) -> bool:
    from scaletrain.models.protocol import _is_hugging_face

    return _is_hugging_face(module)
