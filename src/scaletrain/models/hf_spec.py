"""What the techniques need from a Hugging Face model, read from HF's own metadata:
`_no_split_modules` names the block class (FSDP's unit), `base_model_tp_plan` the Megatron
split and `base_model_pp_plan` the pipeline order; nothing is written per architecture."""

from __future__ import annotations

import fnmatch

from torch import nn

from scaletrain.models.spec import TP_STYLES, ModelSpec, PipelineSplit, check_spec


def hf_spec(model: nn.Module) -> ModelSpec:
    """The ModelSpec derived from a PreTrainedModel's own metadata (source "hugging-face").

    blocks: the ModuleList whose children's class is in `model._no_split_modules`;
    tp_plan: `config.base_model_tp_plan`'s colwise/rowwise entries, prefixed by the base
    model's path; pipeline: `config.base_model_pp_plan`'s order around the blocks, plus the
    output head. A field whose metadata is missing is None.
    """
    base = _base_model_path(model)
    spec = ModelSpec(
        blocks=_hf_blocks(model),
        tp_plan=_hf_tp_plan(model, base),
        pipeline=_hf_pipeline(model, base),
        source="hugging-face",
    )
    check_spec(model, spec)
    return spec


def _base_model_path(model: nn.Module) -> str:
    """The base model's module path ("model" for LlamaForCausalLM); "" if it is the model."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    return prefix if isinstance(base, nn.Module) and base is not model else ""


def _join(base: str, name: str) -> str:
    return f"{base}.{name}" if base else name


def _hf_blocks(model: nn.Module) -> str | None:
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in model.named_modules():  # shallowest first
        children = list(module.children())
        if (
            isinstance(module, nn.ModuleList)
            and children
            and all(type(c).__name__ in block_classes for c in children)
        ):
            return name
    return None


def _hf_tp_plan(model: nn.Module, base: str) -> dict[str, str] | None:
    """HF's plan, relative to the base model ("layers.*.self_attn.q_proj"), as fnmatch
    patterns of the full model. HF's "*" stands for a layer index; fnmatch's "*" matches
    it too. Only plain "colwise" and "rowwise" are kept: HF's other styles
    ("embedding_rowwise", "colwise_gather_output", "packed_colwise", "local_*", expert and
    sequence-parallel styles) have no counterpart in scaletrain's TP, and an entry that
    matches anything but nn.Linear (fused expert parameters) is dropped too, so the plan
    check_spec sees is one scaletrain can apply."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not plan:
        return None
    modules = dict(model.named_modules())
    out = {}
    for key, style in plan.items():
        pattern = _join(base, key)
        matched = [m for n, m in modules.items() if fnmatch.fnmatchcase(n, pattern)]
        if style in TP_STYLES and matched and all(isinstance(m, nn.Linear) for m in matched):
            out[pattern] = style
    return out or None


def _hf_pipeline(model: nn.Module, base: str) -> PipelineSplit | None:
    """`base_model_pp_plan` lists the base model's children in forward order (embed_tokens,
    layers, norm); the blocks are the ModuleList among them. The base model's children the
    plan leaves out (rotary_emb: the position embeddings every layer is handed) go with the
    first modules, and the output head (lm_head) closes the last."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    if not plan:
        return None
    modules = dict(model.named_modules())
    names = [_join(base, key) for key in plan]
    blocks = [n for n in names if isinstance(modules.get(n), nn.ModuleList)]
    if len(blocks) != 1 or not all(n in modules for n in names):
        return None
    at = names.index(blocks[0])
    base_module = modules[base]
    unplanned = [
        _join(base, n) for n, _ in base_module.named_children() if _join(base, n) not in names
    ]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = [n for n, m in modules.items() if head is not None and m is head][:1]
    return PipelineSplit(
        first=tuple(names[:at] + unplanned),
        blocks=blocks[0],
        last=tuple(names[at + 1 :] + head_name),
    )
