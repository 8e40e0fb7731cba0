"""[distill] refusals the launcher makes before any worker starts (launch/resolve.resolve calls them)."""

from __future__ import annotations

import re

from scaletrain.config import BUILTIN_MODELS, DATA_SOURCES, Config, DistillConfig
from scaletrain.errors import ConfigError, UserError
from scaletrain.parallel.layout import ParallelLayout


def check_distill_config(config: Config, layout: ParallelLayout) -> None:
    """Refuse [distill] keys without a teacher or cache, and layouts distillation lacks.

    Raises:
        ConfigError: naming the key, its value and what is allowed.
    """
    d = config.distill
    on = bool(d.teacher or d.cache)
    if not on:
        changed = [
            k for k in DistillConfig.model_fields if getattr(d, k) != getattr(DistillConfig(), k)
        ]
        if changed:
            raise ConfigError(
                f"distill.{changed[0]} = {getattr(d, changed[0])!r} is only read "
                "with distill.teacher (a teacher to learn from) or distill.cache "
                "(its cached outputs); set one, or drop the [distill] keys"
            )
        if config.data.source == "sentences":
            raise ConfigError(
                "data.source = 'sentences' has no labels: it trains a student from "
                "a teacher; set distill.teacher (e.g. 'all-MiniLM-L6-v2')"
            )
        return
    if config.parallel.strategy == "ps":
        raise ConfigError(
            "distillation runs under parallel.strategy = 'collective' (data "
            "parallel, FSDP); the parameter-server strategy does not run a teacher"
        )
    if layout.tp > 1 or layout.pp > 1:
        raise ConfigError(
            f"distillation with parallel.tp = {layout.tp}, parallel.pp = "
            f"{layout.pp}: the student's projections and the teacher run on whole "
            "examples; use data parallelism (dp, dp_shard) with [distill]"
        )
    if d.teacher_sha256 and not re.fullmatch(r"[0-9a-fA-F]{64}", d.teacher_sha256):
        raise ConfigError(
            f"distill.teacher_sha256 = {d.teacher_sha256!r} is not a SHA-256 "
            "(64 hexadecimal digits)"
        )
    if d.init_layers and not d.teacher:
        raise ConfigError(
            f"distill.init_layers = {d.init_layers} copies the teacher's layers: "
            "it needs distill.teacher (a cache holds outputs, not weights)"
        )
    if config.data.source == "sentences":
        problem = encoder_loss_problem(
            hidden=d.hidden_weight,
            attention=d.attention_weight,
            cosine=d.cosine_weight,
            cosine_on=d.cosine_on,
            relation=d.relation_weight,
            contrastive=d.contrastive_weight,
        )
        if problem:
            raise ConfigError(problem)
    try:
        _check_paths(config)
    except UserError as e:  # TeacherError, CacheError: one-line user mistakes
        raise ConfigError(str(e)) from None
    check_encoder_terms(config)
    if d.cosine_weight and d.cosine_on == "pooled" and config.model.name in ("mlp", "cnn", "gpt"):
        raise ConfigError(
            f"distill.cosine_on = 'pooled' compares an encoder's mean-pooled hidden "
            f"states; model.name = {config.model.name!r} gives logits: use "
            "distill.cosine_on = 'logits'"
        )
    if (
        (d.hidden_weight or d.attention_weight)
        and config.model.name != "hf"
        and ":" not in config.model.name
    ):
        raise ConfigError(
            f"distill.hidden_weight / attention_weight need a Hugging Face "
            f"student (model.name = 'hf'); model.name = {config.model.name!r} "
            "gives logits only"
        )


def _check_paths(config) -> None:
    """The teacher, the sentences' tokenizer and the cache exist and, with the cache alone,
    distill.teacher_sha256 names the cache's teacher (a given teacher's own weights are
    hashed in the launcher, where the cache is checked against the data: distill/build.py).

    Raises:
        TeacherError, CacheError: one-line user mistakes.
    """
    from scaletrain.distill.teacher import MINILM, resolve_tokenizer_dir, teacher_kind

    d = config.distill
    if d.teacher:
        teacher_kind(d.teacher)
    if config.data.source == "sentences":
        resolve_tokenizer_dir(str(config.data.kwargs.get("tokenizer", MINILM)))
    if d.cache:
        from scaletrain.distill.cache import check_cache_teacher, read_info

        check_cache_teacher(
            read_info(d.cache),
            cache_dir=d.cache,
            teacher_sha256=None if d.teacher else d.teacher_sha256 or None,
            teacher_key="distill.teacher_sha256",
        )


def encoder_loss_problem(
    *,
    hidden: float,
    attention: float,
    cosine: float,
    cosine_on: str,
    relation: float = 0.0,
    contrastive: float = 0.0,
) -> str | None:
    """Why these [distill] weights give an encoder (data kind "encode": no labels, no logits)
    no loss, or None. The KL (alpha) and a cosine on logits read logits, which an encoder
    lacks; with no hidden, attention, pooled-cosine, relation or contrastive term the loss
    would be a constant zero with no gradient, which the first backward rejects with a
    traceback; the relation term alone trains no part of the last layer after its
    projections. Called before launch for data.source = 'sentences' and by distill/build.py
    for any encoder data."""
    if cosine > 0 and cosine_on == "logits":
        return (
            "distill.cosine_on = 'logits' compares logits, and a sentence encoder (data "
            "kind 'encode') gives none: use distill.cosine_on = 'pooled'"
        )
    if hidden == 0 and attention == 0 and cosine == 0 and relation == 0 and contrastive == 0:
        return (
            "a sentence encoder (data kind 'encode', e.g. data.source = 'sentences') has no "
            "labels and gives no logits, so distill.alpha (the soft-target KL) has nothing to "
            "compare; with distill.hidden_weight = 0.0, distill.attention_weight = 0.0, "
            "distill.cosine_weight = 0.0, distill.relation_weight = 0.0 and "
            "distill.contrastive_weight = 0.0 the loss would be zero with no gradient: set at "
            "least one of them > 0 (e.g. distill.cosine_weight = 1.0)"
        )
    if relation > 0 and hidden == 0 and cosine == 0 and contrastive == 0:
        return (
            f"distill.relation_weight = {relation} reads only the last layer's queries, keys "
            "and values: with distill.hidden_weight, distill.cosine_weight and "
            "distill.contrastive_weight all 0.0 no term reaches the student's output, so its "
            "last layer's attention output and feed-forward get no gradient (data parallel "
            "refuses such a step, and the embeddings it gives would be untrained): set one "
            "of them > 0 beside it (e.g. distill.cosine_weight = 1.0)"
        )
    return None


# The teacher outputs each encoder term reads, as the cache names them (objective.Needs).
TERM_OUTPUTS = {
    "relation_weight": ("query.last", "key.last", "value.last"),
    "contrastive_weight": ("pooled",),
}


def check_encoder_terms(config: Config) -> None:
    """Refuse distill.relation_weight / contrastive_weight > 0 where they cannot be computed:
    a student or teacher that is not a Hugging Face encoder, data that are not sentences, a
    micro-batch with no negatives, a cache without the teacher outputs they read.

    Raises:
        ConfigError: naming the key, its value and what is allowed.
    """
    d = config.distill
    for key, value in (
        ("relation_weight", d.relation_weight),
        ("contrastive_weight", d.contrastive_weight),
    ):
        if value > 0:
            problem = _encoder_term_problem(config, f"distill.{key} = {value}", key)
            if problem:
                raise ConfigError(problem)


def _encoder_term_problem(config: Config, where: str, key: str) -> str | None:
    d, source, name = config.distill, config.data.source, config.model.name
    what = (
        "compares the last layer's self-attention of a bidirectional transformer encoder "
        "(MiniLM's relations)"
        if key == "relation_weight"
        else "contrasts an encoder's mean-pooled sentence embeddings"
    )
    if name in BUILTIN_MODELS:
        return f"{where} {what}; model.name = {name!r} is not one: use model.name = 'hf'"
    if source in DATA_SOURCES and source not in ("sentences", "shards"):
        return f"{where} {what}; data.source = {source!r} is not sentences: use 'sentences'"
    teacher_model = _teacher_model_name(d.teacher) if d.teacher else None
    if teacher_model in BUILTIN_MODELS:
        return (
            f"{where} {what}; distill.teacher = {d.teacher!r} is a scaletrain run of "
            f"model.name = {teacher_model!r}, not one: give a Hugging Face encoder teacher"
        )
    if key == "contrastive_weight" and config.train.micro_batch < 2:
        return (
            f"{where} takes its negatives from the other examples of each micro-batch; "
            f"train.micro_batch = {config.train.micro_batch} leaves none: use 2 or more"
        )
    if d.cache:
        from scaletrain.distill.cache import read_info

        held = read_info(d.cache).get("outputs", [])
        missing = [k for k in TERM_OUTPUTS[key] if k not in held]
        if missing:
            return (
                f"{where} reads the teacher outputs {missing}, which distill.cache = "
                f"{d.cache!r} does not hold (it holds {held}): write a cache with this "
                "config (scaletrain distill-cache CONFIG OUT_DIR), or set it to 0"
            )
    return None


def _teacher_model_name(source: str) -> str | None:
    """The model.name of a scaletrain run (or checkpoint) teacher; None for a Hugging Face
    directory, or a run whose config does not load (loading it says why)."""
    from scaletrain.config import load_config
    from scaletrain.distill.teacher import teacher_kind

    kind, d = teacher_kind(source)
    if kind == "hf":
        return None
    run = d if kind == "run" else d.parent.parent
    try:
        return load_config(run / "config.toml").model.name
    except ConfigError:
        return None
