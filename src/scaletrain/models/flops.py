"""How many floating-point operations a training step costs: the one counter that the
metrics' MFU and the planner's step time read.

Two ways to count, checked against each other (tests/test_flops.py):

- `traced_flops`: torch's own `FlopCounterMode` over one forward and backward of the model
  on the meta device (shapes only: no memory, no time). It counts the matrix products
  (mm, addmm, bmm, convolutions, scaled-dot-product attention), as every published MFU does;
  element-wise work is not counted. Any model that runs on meta can be traced: a user's
  model, a CNN.
- `transformer_flops`: the closed form for a decoder transformer made of `nn.Linear`
  projections and attention, from its shape alone. Forward, per token: 2 x the weights of
  every linear layer (q, k, v, out, the MLP's two or three matrices, the head), plus
  4 x T x (heads x head_dim) per layer for the attention scores and their weighted sum
  (FlopCounterMode counts the full T x T product, causal or not). Backward is twice the
  forward (each product's two gradients). Narayanan et al. 2021 write the same count as
  72 B s l h^2 (1 + s/6h + V/12lh) for a GPT with a 4h MLP; it is exact for the built-in GPT
  and Hugging Face Llama models (grouped-query attention and the gated MLP included).

Activation checkpointing adds one forward of every recomputed block: those are hardware
FLOPs (what the step time pays), not model FLOPs (what MFU counts, as Megatron and
torchtitan do).
"""

from __future__ import annotations

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
    None for any other model (count it with `traced_flops`)."""
    from scaletrain.models.gpt import GPT

    if isinstance(model, GPT):
        blocks = list(model.blocks.children())
        width = blocks[0].attn.q.out_features
    else:
        config = getattr(model, "config", None)
        base = getattr(model, "model", None)
        if config is None or base is None or not hasattr(base, "layers"):
            return None
        blocks = list(base.layers)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        width = config.num_attention_heads * head_dim
    in_blocks = sum(_linear_weights(b) for b in blocks)
    if not blocks or in_blocks % len(blocks):
        return None  # blocks of different widths: trace instead
    return TransformerShape(
        layers=len(blocks),
        attention_width=width,
        block_weights=in_blocks // len(blocks),
        other_weights=_linear_weights(model) - in_blocks,
    )


def _linear_weights(module: nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def transformer_flops(
    shape: TransformerShape, *, batch: int, seq: int, recomputed_blocks: int = 0
) -> int:
    """FLOPs of one forward and backward over `batch` sequences of `seq` tokens.

    recomputed_blocks: blocks that activation checkpointing runs forward a second time
        (0 for model FLOPs, as MFU counts them).
    """
    tokens = batch * seq
    block = 2 * tokens * shape.block_weights + 4 * batch * seq * seq * shape.attention_width
    forward = shape.layers * block + 2 * tokens * shape.other_weights
    return 3 * forward + recomputed_blocks * block


def traced_flops(model: nn.Module, inputs: torch.Tensor, **extras: torch.Tensor) -> int:
    """FLOPs of one forward and backward of `model` on `inputs`, counted by torch's
    FlopCounterMode on the meta device. The trace runs on a copy made of meta tensors (a
    real model's values are not copied; a meta model's parameters get no `.grad`)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = meta_copy(model)  # even a meta model: backward would leave .grad on the caller's
    inputs = inputs.to("meta")
    extras = {k: v.to("meta") for k, v in extras.items()}
    with FlopCounterMode(display=False) as counter:
        out = model(inputs, **extras)
        out = getattr(out, "logits", out)
        (out if isinstance(out, torch.Tensor) else out[0]).float().sum().backward()
    return int(counter.get_total_flops())


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are meta tensors of the same shapes:
    nothing of the real values is copied."""
    import copy

    memo = {}
    for t in (*model.parameters(), *model.buffers()):
        twin = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            twin = nn.Parameter(twin, requires_grad=t.requires_grad)
        memo[id(t)] = twin
    return copy.deepcopy(model, memo)


def layer_flops(model: nn.Module, inputs: torch.Tensor) -> int:
    """FLOPs of one forward and backward of a model whose only products are `nn.Linear` and
    `nn.Conv2d` layers (the built-in MLP and CNN), from each layer's output shape on one
    forward of a twin with uninitialised values: forward 2 x outputs x inputs per output; backward the weight's gradient, and
    the input's unless the input needs none (the first layer's raw data), as autograd and
    FlopCounterMode count them. It needs no dispatch mode, so no import of torch._dynamo
    (2-3 s of CPU per process that would not import it otherwise)."""
    total = [0]

    def count(module, args, out) -> None:
        if isinstance(module, nn.Linear):
            forward = 2 * out.numel() * module.in_features
        else:
            kh, kw = module.kernel_size
            forward = 2 * out.numel() * module.in_channels // module.groups * kh * kw
        total[0] += forward * (2 + bool(args[0].requires_grad))

    # On the CPU with uninitialised values: the built-ins are small, and a meta convolution
    # runs a Python meta kernel whose decorator imports torch._dynamo.
    twin = meta_copy(model).to_empty(device="cpu")
    handles = [
        m.register_forward_hook(count)
        for m in twin.modules()
        if isinstance(m, (nn.Linear, nn.Conv2d))
    ]
    try:
        twin(torch.zeros(inputs.shape, dtype=next(twin.parameters()).dtype))
    finally:
        for h in handles:
            h.remove()
    return total[0]


def train_flops(
    model: nn.Module, inputs: torch.Tensor, *, recomputed_blocks: int = 0, **extras
) -> int:
    """FLOPs of one forward and backward of `model` on `inputs` (B, ...): the closed form
    where the model is a transformer it knows, shape by shape for the built-in MLP and
    CNN, else traced. The metrics' MFU and the planner both count with this."""
    from scaletrain.models.cnn import CNN
    from scaletrain.models.mlp import MLP

    shape = transformer_shape(model)
    if shape is not None and inputs.dim() == 2:
        batch, seq = inputs.shape
        return transformer_flops(shape, batch=batch, seq=seq, recomputed_blocks=recomputed_blocks)
    if isinstance(model, (MLP, CNN)) and not extras:
        return layer_flops(model, inputs)
    return traced_flops(model, inputs, **extras)
