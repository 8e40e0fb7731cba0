"""[distill] refusals the launcher makes before any worker starts (plan.resolve calls them)."""

from __future__ import annotations

import re

from scaletrain.config import Config, DistillConfig
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
        changed = [k for k in DistillConfig.model_fields
                   if getattr(d, k) != getattr(DistillConfig(), k)]
        if changed:
            raise ConfigError(f"distill.{changed[0]} = {getattr(d, changed[0])!r} is only read "
                              "with distill.teacher (a teacher to learn from) or distill.cache "
                              "(its cached outputs); set one, or drop the [distill] keys")
        if config.data.source == "sentences":
            raise ConfigError("data.source = 'sentences' has no labels: it trains a student from "
                              "a teacher; set distill.teacher (e.g. 'all-MiniLM-L6-v2')")
        return
    if config.parallel.strategy == "ps":
        raise ConfigError("distillation runs under parallel.strategy = 'collective' (data "
                          "parallel, FSDP); the parameter-server strategy does not run a teacher")
    if layout.tp > 1 or layout.pp > 1:
        raise ConfigError(f"distillation with parallel.tp = {layout.tp}, parallel.pp = "
                          f"{layout.pp}: the student's projections and the teacher run on whole "
                          "examples; use data parallelism (dp, dp_shard) with [distill]")
    if d.teacher_sha256 and not re.fullmatch(r"[0-9a-fA-F]{64}", d.teacher_sha256):
        raise ConfigError(f"distill.teacher_sha256 = {d.teacher_sha256!r} is not a SHA-256 "
                          "(64 hexadecimal digits)")
    if d.init_layers and not d.teacher:
        raise ConfigError(f"distill.init_layers = {d.init_layers} copies the teacher's layers: "
                          "it needs distill.teacher (a cache holds outputs, not weights)")
    from scaletrain.distill.teacher import teacher_kind

    try:
        if d.teacher:
            teacher_kind(d.teacher)
        if d.cache:
            from scaletrain.distill.cache import read_info

            read_info(d.cache)
    except UserError as e:  # TeacherError, CacheError: one-line user mistakes
        raise ConfigError(str(e)) from None
    if d.cosine_weight and d.cosine_on == "pooled" and config.model.name in ("mlp", "cnn", "gpt"):
        raise ConfigError(f"distill.cosine_on = 'pooled' compares an encoder's mean-pooled hidden "
                          f"states; model.name = {config.model.name!r} gives logits: use "
                          "distill.cosine_on = 'logits'")
    if (d.hidden_weight or d.attention_weight) and config.model.name != "hf" \
            and ":" not in config.model.name:
        raise ConfigError(f"distill.hidden_weight / attention_weight need a Hugging Face "
                          f"student (model.name = 'hf'); model.name = {config.model.name!r} "
                          "gives logits only")
