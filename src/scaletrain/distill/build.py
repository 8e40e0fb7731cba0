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
from scaletrain.distill.student import (
    Distilled,
    init_from_teacher,
    last_layer_qkv,
    n_blocks,
    resolve_layer_map,
)
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
        relation=d.relation_weight,
        contrastive=d.contrastive_weight,
        contrastive_temperature=d.contrastive_temperature,
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
    inner = {
        "hidden_weight": w.hidden,
        "attention_weight": w.attention,
        "relation_weight": w.relation,
        "contrastive_weight": w.contrastive,
    }
    on = [f"distill.{k} = {v}" for k, v in inner.items() if v > 0]
    if on and not hugging_face:
        raise UserCodeError(
            f"{', '.join(on)}: read a Hugging Face student's and teacher's hidden states, "
            "attention maps or projections; "
            f"model.name = {config.model.name!r} gives logits only"
        )
    problem = (
        encoder_loss_problem(
            hidden=w.hidden,
            attention=w.attention,
            cosine=w.cosine,
            cosine_on=w.cosine_on,
            relation=w.relation,
            contrastive=w.contrastive,
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
    relation_heads = models_fit_terms(
        w, task_kind=task.kind, student=student, teacher=teacher, cache_info=cache_info
    )
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
        relations=w.relation > 0,
    )
    loss_fn = distillation_loss(
        hard,
        teacher=teacher,
        weights=w,
        needs=needs,
        layer_map=layer_map,
        task_kind=task.kind,
        relation_heads=relation_heads,
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


def models_fit_terms(
    w: Weights,
    *,
    task_kind: str,
    student: nn.Module,
    teacher: Teacher | None,
    cache_info: dict | None,
) -> int:
    """Refuse a relation or contrastive term the models cannot give; returns the relation
    heads R (the student's attention heads; 0 without the relation term).

    Raises:
        UserCodeError: naming the key, its value and what the models would need.
    """
    for key, weight in (("relation_weight", w.relation), ("contrastive_weight", w.contrastive)):
        if weight > 0 and task_kind != "encode":
            raise UserCodeError(
                f"distill.{key} = {weight} compares a bidirectional encoder's "
                f"representations of sentences (data kind 'encode'); the data are "
                f"{task_kind!r}: use sentence data (data.source = 'sentences'), or set it to 0"
            )
    heads = 0
    if w.relation > 0:
        heads = int(student.config.num_attention_heads)
        last_layer_qkv(student)
        width = _teacher_width(teacher, cache_info, key="query.last")
        if width % heads:
            raise UserCodeError(
                f"distill.relation_weight = {w.relation}: the teacher's queries ({width} "
                f"wide) do not split into the student's {heads} attention heads, the "
                "relation heads both sides are cut into; give the student a number of "
                "heads that divides the teacher's width"
            )
    if w.contrastive > 0:
        width = _teacher_width(teacher, cache_info, key="pooled")
        own = int(student.config.hidden_size)
        if width and width != own:
            raise UserCodeError(
                f"distill.contrastive_weight = {w.contrastive} compares the student's "
                f"pooled embeddings ({own} wide) with the teacher's ({width} wide) by "
                "cosine: give the student the teacher's hidden_size"
            )
    return heads


def _teacher_width(teacher: Teacher | None, cache_info: dict | None, *, key: str) -> int:
    """The width of the teacher's output `key` ("query.last": its last layer's queries,
    "pooled": its embeddings), from the loaded teacher or the cache (0: the cache lacks it,
    which check_cache refuses)."""
    if teacher is None:
        shapes = (cache_info or {}).get("splits", {}).get("train", {}).get("shapes", {})
        return int(shapes[key]["shape"][-1]) if key in shapes else 0
    if not teacher.hugging_face:
        raise UserCodeError(
            f"distill.teacher = {teacher.source!r} is not a Hugging Face transformer encoder: "
            "distill.relation_weight and distill.contrastive_weight read an encoder's "
            "projections and hidden states"
        )
    if key == "query.last":
        return int(last_layer_qkv(teacher.module)[0].out_features)
    return int(teacher.module.config.hidden_size)


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
