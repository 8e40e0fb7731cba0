"""Tensor parallelism: each block's matmuls split over the ranks of the "tp" mesh dimension.

Megatron's split, written as DTensor layer plans (`parallelize_module`): the projections
out of the residual stream (q, k, v, the MLP's first Linear) are split by output features
(`ColwiseParallel`: each rank computes n_head / tp heads and 4C / tp hidden units), the
projections back into it (attention's output, the MLP's second Linear) by input features
(`RowwiseParallel`: partial outputs summed by one all-reduce). Two all-reduces per block in
forward, two in backward; nothing else is communicated. The plan comes from the model's
spec (models/protocol.py: declared by the GPT, derived from `base_model_tp_plan` for a
Hugging Face Llama), so this module knows no architecture.

What stays whole on every tensor-parallel rank: the embeddings, the norms and the head.
They see the same (replicated) activations and receive the same gradients, so they stay in
step without communication. Sequence parallelism (sharding the norms' activations along the
sequence) and a vocabulary-parallel head would save activation memory for long sequences
and large vocabularies; they are not applied here (the byte-level GPT has 256 logits).
"""

from __future__ import annotations

from torch import nn

from scaletrain.errors import UserError


class TensorParallelError(UserError):
    """A model whose shapes do not split over the tensor-parallel degree."""


def check_tp_fit(model: nn.Module, targets: dict[str, str], *, tp: int, model_label: str) -> None:
    """Refuse a degree that does not divide what it splits: the features of every planned
    Linear, and the heads of an attention module (its `head_dim` attribute) under it.

    Args:
        model: the bare model (a meta-device copy is enough).
        targets: module path -> "colwise" | "rowwise" (protocol.tp_targets).
        tp: the tensor-parallel degree.
        model_label: how the user named the model, for the message.
    """
    for path, style in targets.items():
        layer = model.get_submodule(path)
        if not isinstance(layer, nn.Linear):
            continue
        features = layer.out_features if style == "colwise" else layer.in_features
        parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
        head_dim = getattr(parent, "head_dim", None)
        if isinstance(head_dim, int) and head_dim > 0 and features % head_dim == 0:
            heads = features // head_dim
            if heads % tp:
                raise TensorParallelError(
                    f"parallel.tp = {tp} does not divide the {heads} heads of {path!r} in "
                    f"{model_label}: each tensor-parallel rank computes whole heads; use a tp "
                    f"that divides {heads}"
                )
        if features % tp:
            raise TensorParallelError(
                f"parallel.tp = {tp} does not divide the {features} "
                f"{'output' if style == 'colwise' else 'input'} features of {path!r} "
                f"({style}) in {model_label}; use a tp that divides {features}"
            )


def apply_tp(
    model: nn.Module, tp_mesh, *, targets: dict[str, str], sequence: dict[str, str] | None = None
) -> nn.Module:
    """Split the planned layers of `model` over `tp_mesh` (in place) and return it.

    Args:
        model: the bare model, or a pipeline stage of it (plan entries for modules the stage
            does not hold are skipped).
        tp_mesh: the 1-D "tp" dimension of the run's DeviceMesh.
        targets: module path -> "colwise" | "rowwise" (protocol.tp_targets on the whole model).
        sequence: module path -> "enter" | "norm" | "gather" | "head"
            (protocol.sequence_targets) to add sequence parallelism; None or {}: plain TP.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    held = dict(model.named_modules())
    sp = bool(sequence)
    plan = {}
    for path, style in targets.items():
        if path not in held:
            continue
        if style == "colwise":
            plan[path] = ColwiseParallel()
        else:  # with SP the partial sums are reduce-scattered into each rank's positions
            plan[path] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    for path, role in (sequence or {}).items():
        if path not in held:
            continue
        if role == "enter":  # (B, T, C) whole -> this rank's (B, T/tp, C): a local slice
            plan[path] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1)
            )
        elif role == "norm":
            plan[path] = SequenceParallel()
        elif role == "gather":  # all-gather the positions before the column-wise matmuls
            plan[path] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        else:  # head: gather positions in, columns (vocabulary) out: whole logits
            plan[path] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    parallelize_module(model, tp_mesh, plan)
    return model
