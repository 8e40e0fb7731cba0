"""What a model declares to the techniques built on top: its blocks, a TP plan, a pipeline split.

FSDP wraps each repeated block as its own unit and activation checkpointing recomputes
each one; tensor parallelism needs to know which Linear layers split by columns and which
by rows; a pipeline needs to know which modules open the model (embeddings), which repeat
(the blocks it divides among stages) and which close it (final norm, head). A model says so
with one small frozen `ModelSpec`, named by module paths (`named_modules` names), so that
no technique needs to know the model's class:

    model.scaletrain_spec = ModelSpec(
        blocks="blocks",                                # the container of repeated blocks
        tp_plan={"blocks.*.attn.q": "colwise", "blocks.*.attn.proj": "rowwise", ...},
        pipeline=PipelineSplit(first=("tok_emb",), blocks="blocks", last=("ln_f", "head")),
    )

Where a spec comes from (`model_spec`, the one place it is decided):
1. the `scaletrain_spec` attribute, when the model (class or instance) sets one: the
   built-in GPT sets all three; a user factory may set it on the module it returns;
2. a Hugging Face `PreTrainedModel`: derived from its own metadata (`models/hf.py`);
3. anything else: blocks = the deepest-first largest container whose children are all of one
   class (an `nn.ModuleList` of layers, say), no TP plan, no pipeline split.

A technique that needs what a model lacks calls `require`, which refuses with a message
that names the model, what is missing and how to declare it. Every path in a spec is
checked against the model when the spec is read (`check_spec`), so a typo fails at build
time, not in the middle of sharding.

The declarations and `check_spec` live in models/spec.py (re-exported here): models/hf.py
reads them there, so this module may ask hf.py for a Hugging Face model's spec without an
import cycle.
"""

from __future__ import annotations

import fnmatch
import sys
from typing import Any

import torch
from torch import nn

# The declarations, re-exported: `from scaletrain.models.protocol import ModelSpec` goes on working.
from scaletrain.models.spec import (
    SPEC_ATTR,
    TP_STYLES,
    ModelSpec,
    ModelSpecError,
    PipelineSplit,
    SequenceSplit,
    check_spec,
)

__all__ = [
    "REQUIRES",
    "SPEC_ATTR",
    "TECHNIQUES",
    "TP_STYLES",
    "ModelSpec",
    "ModelSpecError",
    "PipelineSplit",
    "SequenceSplit",
    "block_modules",
    "check_spec",
    "find_repeated_blocks",
    "model_spec",
    "output_logits",
    "require",
    "sequence_targets",
    "tp_targets",
]

# What each technique needs the model to declare: the ModelSpec field, and what it holds.
REQUIRES: dict[str, tuple[str, str]] = {
    "fsdp": ("blocks", "repeated blocks (FSDP shards each block as its own unit)"),
    "activation-checkpointing": ("blocks", "repeated blocks (each is recomputed in backward)"),
    "tp": ("tp_plan", "tensor-parallel plan"),
    "pp": ("pipeline", "pipeline split"),
}
TECHNIQUES = tuple(REQUIRES)


def model_spec(model: nn.Module) -> ModelSpec:
    """The model's spec: declared, derived from Hugging Face metadata, or the default; checked.

    Args:
        model: the bare model (not wrapped in DDP).

    Raises:
        ModelSpecError: a declared path does not name a module of the right kind.
    """
    declared = getattr(model, SPEC_ATTR, None)
    if declared is not None:
        if not isinstance(declared, ModelSpec):
            raise ModelSpecError(
                f"{type(model).__name__}.{SPEC_ATTR} is a "
                f"{type(declared).__name__}, not a scaletrain ModelSpec"
            )
        spec = declared
    elif _is_hugging_face(model):
        from scaletrain.models.hf import hf_spec

        spec = hf_spec(model)
    else:
        spec = ModelSpec(blocks=find_repeated_blocks(model), source="default")
    check_spec(model, spec)
    return spec


def _is_hugging_face(model: nn.Module) -> bool:
    if "transformers" not in sys.modules:  # never import transformers just to ask
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def find_repeated_blocks(model: nn.Module) -> str | None:
    """Path of the container with the most children that are all of one class (at least
    two); the shallowest wins a tie. None when the model repeats nothing."""
    best, best_len = None, 1
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or not name:
            continue
        children = list(module.children())
        if len(children) > best_len and len({type(c) for c in children}) == 1:
            best, best_len = name, len(children)
    return best


def block_modules(model: nn.Module, spec: ModelSpec) -> list[nn.Module]:
    """The repeated blocks in order (FSDP's and activation checkpointing's units)."""
    if spec.blocks is None:
        return []
    return list(model.get_submodule(spec.blocks).children())


def require(spec: ModelSpec, technique: str, *, model_label: str) -> None:
    """Refuse a technique the model has not declared what it needs for.

    Args:
        spec: the model's spec (`model_spec`).
        technique: one of TECHNIQUES.
        model_label: how the user named the model (e.g. "model.name = 'pkg.mod:build'").
    """
    if technique not in REQUIRES:
        raise ValueError(f"unknown technique {technique!r}; allowed: {', '.join(TECHNIQUES)}")
    field_name, what = REQUIRES[technique]
    if getattr(spec, field_name):  # a blocks path, a non-empty plan, a split
        return
    raise ModelSpecError(
        f"{model_label} declares no {what}, which {technique} needs: set "
        f"`{SPEC_ATTR} = scaletrain.ModelSpec({field_name}=...)` on the module the factory "
        f"returns (docs/ARCHITECTURE.md, 'The model protocol'), or turn {technique} off"
    )


def sequence_targets(model: nn.Module, spec: ModelSpec) -> dict[str, str]:
    """The sequence split expanded to module paths: {"drop": "enter", "blocks.0.ln_1":
    "norm", "blocks.0.attn": "gather", "lm_head": "head", ...} ({} without one)."""
    seq = spec.sequence
    if seq is None:
        return {}
    patterns = [
        (seq.enter, "enter"),
        *((p, "norm") for p in seq.norms),
        *((p, "gather") for p in seq.gather),
    ] + ([(seq.head, "head")] if seq.head else [])
    return {
        name: role
        for name, _ in model.named_modules()
        for pattern, role in patterns
        if name and fnmatch.fnmatchcase(name, pattern)
    }


def tp_targets(model: nn.Module, spec: ModelSpec) -> dict[str, str]:
    """The plan expanded to module paths: {"blocks.0.attn.q": "colwise", ...}."""
    out: dict[str, str] = {}
    for name, _ in model.named_modules():
        for pattern, style in (spec.tp_plan or {}).items():
            if fnmatch.fnmatchcase(name, pattern):
                out[name] = style
    return out


def output_logits(output: Any) -> torch.Tensor:
    """The tensor a loss reads from a model's output: the output itself, or its `.logits`
    (a Hugging Face ModelOutput), or the first item of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"the model returned a {type(output).__name__}; scaletrain's losses need a "
        "tensor, an object with .logits, or a tuple whose first item is a tensor"
    )
