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
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from scaletrain.errors import UserError

SPEC_ATTR = "scaletrain_spec"
# Tensor-parallel styles, as torch.distributed.tensor.parallel names its layer plans:
# ColwiseParallel (the Linear's output features are split), RowwiseParallel (its input
# features are split and the partial outputs summed).
TP_STYLES = ("colwise", "rowwise")
TECHNIQUES = ("fsdp", "activation-checkpointing", "tp", "pp")


class ModelSpecError(UserError):
    """A model's declaration is inconsistent with its modules, or lacks what a technique needs."""


@dataclass(frozen=True)
class PipelineSplit:
    """How a model divides into pipeline stages.

    The first stage keeps `first`, the last keeps `last`, and the children of `blocks` are
    divided among the stages in order; a stage's model is the full model with the other
    stages' pieces removed, so parameter names stay the same on every stage.
    """

    first: tuple[str, ...]  # modules before the blocks (token and position embeddings)
    blocks: str  # the container whose children are divided among the stages
    last: tuple[str, ...]  # modules after the blocks (final norm, output head)


@dataclass(frozen=True)
class SequenceSplit:
    """Where sequence parallelism (Megatron-SP) splits the residual stream around a TP plan.

    Between the tensor-parallel matmuls each TP rank keeps only T / tp positions of the
    stream (dim 1): the norms, the residual adds and dropout run on that share, and the
    row-wise projections reduce-scatter into it instead of all-reducing.
    """

    enter: str  # the module whose output is the stream entering the blocks: split there
    norms: tuple[str, ...]  # patterns: norms that run on the sequence share
    gather: tuple[str, ...]  # patterns: modules whose input share is all-gathered first
    head: str | None = None  # the output Linear after the last norm: split by columns,
    # its input gathered and its output gathered whole


@dataclass(frozen=True)
class ModelSpec:
    """What a model declares; every field is a module path as `named_modules` spells it."""

    blocks: str | None = None  # container (ModuleList / ModuleDict / Sequential) of repeated blocks
    tp_plan: Mapping[str, str] | None = None  # module path pattern (fnmatch) -> TP_STYLES
    pipeline: PipelineSplit | None = None
    sequence: SequenceSplit | None = None  # with tp_plan: sequence parallelism's split points
    source: str = field(default="declared", compare=False)  # declared, hugging-face, default


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
            raise ModelSpecError(f"{type(model).__name__}.{SPEC_ATTR} is a "
                                 f"{type(declared).__name__}, not a scaletrain ModelSpec")
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
    if technique not in TECHNIQUES:
        raise ValueError(f"unknown technique {technique!r}; allowed: {', '.join(TECHNIQUES)}")
    missing = {"fsdp": spec.blocks is None, "activation-checkpointing": spec.blocks is None,
               "tp": not spec.tp_plan, "pp": spec.pipeline is None}[technique]
    if not missing:
        return
    what = {"fsdp": "repeated blocks (FSDP shards each block as its own unit)",
            "activation-checkpointing": "repeated blocks (each is recomputed in backward)",
            "tp": "tensor-parallel plan", "pp": "pipeline split"}[technique]
    field_name = {"fsdp": "blocks", "activation-checkpointing": "blocks", "tp": "tp_plan",
                  "pp": "pipeline"}[technique]
    raise ModelSpecError(
        f"{model_label} declares no {what}, which {technique} needs: set "
        f"`{SPEC_ATTR} = scaletrain.ModelSpec({field_name}=...)` on the module the factory "
        f"returns (docs/ARCHITECTURE.md, 'The model protocol'), or turn {technique} off")


def check_spec(model: nn.Module, spec: ModelSpec) -> None:
    """Every path in the spec names a module of the right kind; TP styles are known."""
    modules = dict(model.named_modules())
    where = f"{type(model).__name__}'s ModelSpec ({spec.source})"
    for path in [spec.blocks] + ([spec.pipeline.blocks] if spec.pipeline else []):
        if path is None:
            continue
        module = modules.get(path)
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            found = "no such module" if module is None else f"a {type(module).__name__}"
            raise ModelSpecError(f"{where}: blocks {path!r} must name an nn.ModuleList, "
                                 f"ModuleDict or Sequential of the model ({found})")
    if spec.pipeline:
        for path in (*spec.pipeline.first, *spec.pipeline.last):
            if path not in modules:
                raise ModelSpecError(f"{where}: pipeline module {path!r} is not a module of "
                                     "the model")
    if spec.sequence is not None:
        seq = spec.sequence
        for pattern in (seq.enter, *seq.norms, *seq.gather, *((seq.head,) if seq.head else ())):
            if not any(fnmatch.fnmatchcase(n, pattern) for n in modules if n):
                raise ModelSpecError(f"{where}: sequence split pattern {pattern!r} matches no "
                                     "module")
    for pattern, style in (spec.tp_plan or {}).items():
        if style not in TP_STYLES:
            raise ModelSpecError(f"{where}: tp_plan[{pattern!r}] = {style!r}; allowed styles: "
                                 f"{', '.join(TP_STYLES)}")
        matched = [m for n, m in modules.items() if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ModelSpecError(f"{where}: tp_plan pattern {pattern!r} matches no module")
        if not all(isinstance(m, (nn.Linear, nn.Embedding)) for m in matched):
            kinds = sorted({type(m).__name__ for m in matched})
            raise ModelSpecError(f"{where}: tp_plan pattern {pattern!r} matches {kinds}; "
                                 "only nn.Linear and nn.Embedding layers split")


def sequence_targets(model: nn.Module, spec: ModelSpec) -> dict[str, str]:
    """The sequence split expanded to module paths: {"drop": "enter", "blocks.0.ln_1":
    "norm", "blocks.0.attn": "gather", "lm_head": "head", ...} ({} without one)."""
    seq = spec.sequence
    if seq is None:
        return {}
    patterns = [(seq.enter, "enter"), *((p, "norm") for p in seq.norms),
                *((p, "gather") for p in seq.gather)] + ([(seq.head, "head")] if seq.head else [])
    return {name: role for name, _ in model.named_modules() for pattern, role in patterns
            if name and fnmatch.fnmatchcase(name, pattern)}


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
    raise TypeError(f"the model returned a {type(output).__name__}; scaletrain's losses need a "
                    "tensor, an object with .logits, or a tuple whose first item is a tensor")
