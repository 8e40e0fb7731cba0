"""What a model declares to the techniques built on top: its blocks, a TP plan, a pipeline split.

The declarations alone (`ModelSpec` and its parts) and `check_spec`, which holds a spec
against the model's modules. models/protocol.py says where a model's spec comes from
(`model_spec`) and what each technique asks of it (`require`); models/hf.py derives one from
a Hugging Face model's metadata. Both import this module and it imports neither, so the
three have no import cycle (protocol asks hf lazily, hf reads only the declarations here).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from scaletrain.errors import UserError

SPEC_ATTR = "scaletrain_spec"
# Tensor-parallel styles, as torch.distributed.tensor.parallel names its layer plans:
# ColwiseParallel (the Linear's output features are split), RowwiseParallel (its input
# features are split and the partial outputs summed).
TP_STYLES = ("colwise", "rowwise")


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
            raise ModelSpecError(
                f"{where}: blocks {path!r} must name an nn.ModuleList, "
                f"ModuleDict or Sequential of the model ({found})"
            )
    if spec.pipeline:
        for path in (*spec.pipeline.first, *spec.pipeline.last):
            if path not in modules:
                raise ModelSpecError(
                    f"{where}: pipeline module {path!r} is not a module of the model"
                )
    if spec.sequence is not None:
        seq = spec.sequence
        for pattern in (seq.enter, *seq.norms, *seq.gather, *((seq.head,) if seq.head else ())):
            if not any(fnmatch.fnmatchcase(n, pattern) for n in modules if n):
                raise ModelSpecError(
                    f"{where}: sequence split pattern {pattern!r} matches no module"
                )
    for pattern, style in (spec.tp_plan or {}).items():
        if style not in TP_STYLES:
            raise ModelSpecError(
                f"{where}: tp_plan[{pattern!r}] = {style!r}; allowed styles: {', '.join(TP_STYLES)}"
            )
        matched = [m for n, m in modules.items() if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ModelSpecError(f"{where}: tp_plan pattern {pattern!r} matches no module")
        if not all(isinstance(m, (nn.Linear, nn.Embedding)) for m in matched):
            kinds = sorted({type(m).__name__ for m in matched})
            raise ModelSpecError(
                f"{where}: tp_plan pattern {pattern!r} matches {kinds}; "
                "only nn.Linear and nn.Embedding layers split"
            )
