"""FLOPs of one training step, the counter MFU and the planner read: matrix products only
(mm, bmm, convolutions, attention), as published MFU counts them. A transformer's closed form,
the built-in MLP and CNN layer by layer, and torch's FlopCounterMode for any other model
agree where they overlap (tests/test_planner.py)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TransformerShape:
    """What the closed form needs of a decoder transformer."""

    layers: int  # blocks
    attention_width: int  # query heads x head dim (the T x T products' width)
    block_weights: int  # sum of in x out over one block's linear layers
    other_weights: int  # the same outside the blocks (the LM head)


def transformer_shape(model: nn.Module) -> TransformerShape | None:
    """The shape of a built-in GPT or a Hugging Face decoder (on any device, meta included);
    None for any other model."""
    from scaletrain.models.gpt import GPT

    config = getattr(model, "config", None)
    if isinstance(model, GPT):
        blocks = list(model.blocks.children())
        width = blocks[0].attn.q.out_features
    elif config is not None and hasattr(getattr(model, "model", None), "layers"):
        blocks = list(model.model.layers)
        heads = config.num_attention_heads
        width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    else:
        return None
    in_blocks = sum(_linear_weights(b) for b in blocks)
    if not blocks or in_blocks % len(blocks):
        return None  # blocks of different widths: trace instead
    return TransformerShape(
        layers=len(blocks), attention_width=width, block_weights=in_blocks // len(blocks),
        other_weights=_linear_weights(model) - in_blocks,
    )  # fmt: skip


def _linear_weights(module: nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def transformer_flops(
    shape: TransformerShape, *, batch: int, seq: int, recomputed_blocks: int = 0
) -> int:
    """FLOPs of a forward and backward over `batch` sequences of `seq` tokens: forward, per
    token, 2 x every linear layer's weights plus 4 x T x attention_width a block (scores and
    their weighted sum), backward twice that (Narayanan et al. 2021's 72 B s l h^2 (1 + s/6h
    + V/12lh)). `recomputed_blocks` run forward again: hardware FLOPs; 0: model FLOPs (MFU)."""
    tokens = batch * seq
    block = 2 * tokens * shape.block_weights + 4 * tokens * seq * shape.attention_width
    forward = shape.layers * block + 2 * tokens * shape.other_weights
    return 3 * forward + recomputed_blocks * block


def traced_flops(model: nn.Module, inputs: torch.Tensor, **extras: torch.Tensor) -> int:
    """FLOPs of a forward and backward of `model` on `inputs`: FlopCounterMode on a meta copy."""
    from torch.utils.flop_counter import FlopCounterMode

    model = meta_copy(model)  # even a meta model: backward would leave .grad on the caller's
    inputs, extras = inputs.to("meta"), {k: v.to("meta") for k, v in extras.items()}
    with FlopCounterMode(display=False) as counter:
        out = model(inputs, **extras)
        out = getattr(out, "logits", out)
        (out if isinstance(out, torch.Tensor) else out[0]).float().sum().backward()
    return int(counter.get_total_flops())


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with meta parameters and buffers of the same shapes (no values)."""
    memo = {}
    for t in (*model.parameters(), *model.buffers()):
        twin = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            twin = nn.Parameter(twin, requires_grad=t.requires_grad)
        memo[id(t)] = twin
    return copy.deepcopy(model, memo)


def layer_flops(model: nn.Module, inputs: torch.Tensor) -> int:
    """FLOPs of a forward and backward of a model whose only products are `nn.Linear` and
    `nn.Conv2d` (the built-in MLP and CNN) from each layer's output shape, without the trace
    that would import torch._dynamo at every run's start: forward 2 x outputs x inputs per
    output, backward the weight's gradient and the input's unless it needs none."""
    total = 0

    def count(module, args, out) -> None:
        nonlocal total
        if isinstance(module, nn.Linear):
            forward = 2 * out.numel() * module.in_features
        else:
            kh, kw = module.kernel_size
            forward = 2 * out.numel() * module.in_channels // module.groups * kh * kw
        total += forward * (2 + bool(args[0].requires_grad))

    # a copy on the CPU, uninitialised: a meta convolution's kernel would import torch._dynamo
    twin = meta_copy(model).to_empty(device="cpu")
    for layer in twin.modules():
        if isinstance(layer, (nn.Linear, nn.Conv2d)):
            layer.register_forward_hook(count)
    twin(torch.zeros(inputs.shape, dtype=next(twin.parameters()).dtype))
    return total


def train_flops(model: nn.Module, inputs: torch.Tensor, **extras: torch.Tensor) -> int:
    """FLOPs of a forward and backward of `model` on `inputs` (B, ...): the closed form for a
    transformer it knows, layer by layer for the built-in MLP and CNN, else traced."""
    from scaletrain.models.cnn import CNN
    from scaletrain.models.mlp import MLP

    shape = transformer_shape(model)
    if shape is not None and inputs.dim() == 2:
        return transformer_flops(shape, batch=inputs.shape[0], seq=inputs.shape[1])
    if isinstance(model, (MLP, CNN)) and not extras:
        return layer_flops(model, inputs)
    return traced_flops(model, inputs, **extras)
