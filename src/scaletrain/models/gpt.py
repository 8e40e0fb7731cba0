"""A byte-level, decoder-only transformer in the manner of nanoGPT.

Token and learned position embeddings, `n_layer` pre-LayerNorm blocks (causal self-attention,
then a 4x GELU MLP, each added to the residual stream), a final LayerNorm and an lm_head.
Attention is `F.scaled_dot_product_attention(is_causal=True)`, which picks a fused kernel
where one exists and never materialises a (T, T) mask in Python.

Choices made for the techniques built on top, and what they cost:

* lm_head is NOT tied to the token embedding. Checkpoints are saved with safetensors, which
  refuses tensors that share storage; the untied head adds V x C parameters (33k at "small").
* Separate q, k, v projections (not one fused qkv Linear), and heads are counted from the
  tensor (`view(B, T, -1, head_dim)`). Tensor parallelism then shards q/k/v and `mlp.fc`
  column-wise and `attn.proj`/`mlp.proj` row-wise, and each rank simply sees fewer heads;
  a fused qkv would mix q, k and v columns on one rank. Cost: three small matmuls, not one.
* Blocks sit in an `nn.ModuleDict` keyed "0".."n-1" and `forward` skips a `tok_emb` or
  `lm_head` set to None. A pipeline stage is this model with the other stages' blocks
  deleted and its ends set to None (torchtitan's recipe); key names, and so checkpoint
  names, stay the same on every stage.
* Initialisation is nanoGPT's, drawn from the global torch RNG: normal(0, 0.02) for Linear
  and Embedding weights, zero biases, and the residual projections scaled down by
  sqrt(2 * n_layer) so the residual stream's variance doesn't grow with depth.

No loss inside: `forward` returns logits (B, T, V) and the train step owns the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.protocol import ModelSpec, PipelineSplit, SequenceSplit


@dataclass(frozen=True)
class GPTShape:
    """Depth and width of a GPT."""

    n_layer: int
    n_head: int
    n_embd: int


GPT_SHAPES = {  # every size has 32-dim heads; 6 heads would not divide 256
    "tiny": GPTShape(n_layer=2, n_head=2, n_embd=64),
    "small": GPTShape(n_layer=4, n_head=4, n_embd=128),
    "base": GPTShape(n_layer=6, n_head=8, n_embd=256),
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    def __init__(self, *, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not divisible by n_head {n_head}")
        self.head_dim = n_embd // n_head
        self.q, self.k, self.v = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        # -1 heads: under tensor parallelism each rank holds n_head / tp of them.
        q, k, v = (  # 3 x (B, nh, T, hs)
            proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(  # (B, nh, T, hs)
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hs)
        return self.resid_drop(self.proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward: C -> 4C -> GELU -> C."""

    def __init__(self, *, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, *, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd=n_embd, n_head=n_head, dropout=dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd=n_embd, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    """Decoder-only transformer from token ids (B, T) to next-token logits (B, T, V)."""

    # What FSDP, tensor and pipeline parallelism need (models/protocol.py): the blocks, the
    # Megatron split of each block (q, k, v and mlp.fc by columns, the two projections back
    # into the residual stream by rows), and the ends a pipeline's first and last stage keep.
    scaletrain_spec = ModelSpec(
        blocks="blocks",
        tp_plan={
            "blocks.*.attn.q": "colwise",
            "blocks.*.attn.k": "colwise",
            "blocks.*.attn.v": "colwise",
            "blocks.*.attn.proj": "rowwise",
            "blocks.*.mlp.fc": "colwise",
            "blocks.*.mlp.proj": "rowwise",
        },
        pipeline=PipelineSplit(
            first=("tok_emb", "pos_emb"), blocks="blocks", last=("ln_f", "lm_head")
        ),
        # Sequence parallelism: the stream is split by positions after the embeddings'
        # dropout, every norm runs on its share, attention and the MLP gather it back, and
        # the head gathers the last norm's output (logits come out whole on every rank).
        sequence=SequenceSplit(
            enter="drop",
            norms=("blocks.*.ln_1", "blocks.*.ln_2", "ln_f"),
            gather=("blocks.*.attn", "blocks.*.mlp"),
            head="lm_head",
        ),
    )

    def __init__(
        self, *, vocab_size: int, block_size: int, shape: GPTShape, dropout: float = 0.0
    ) -> None:
        """Build and initialise (nanoGPT's scheme) from the global torch RNG.

        Args:
            vocab_size: number of token ids (256 for bytes) and of output logits.
            block_size: longest sequence; the number of learned positions.
            shape: depth, heads and width.
            dropout: dropout on embeddings, attention weights and residual branches.
        """
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, shape.n_embd)
        self.pos_emb = nn.Embedding(block_size, shape.n_embd)
        self.drop = nn.Dropout(dropout)
        block = dict(n_embd=shape.n_embd, n_head=shape.n_head, dropout=dropout)
        self.blocks = nn.ModuleDict(
            {str(i): Block(**block) for i in range(shape.n_layer)}
        )  # "0".."L-1"
        self.ln_f = nn.LayerNorm(shape.n_embd)
        self.lm_head = nn.Linear(shape.n_embd, vocab_size, bias=False)  # untied: safetensors
        self._init_weights(n_layer=shape.n_layer)

    def _init_weights(self, *, n_layer: int) -> None:
        self.n_layer = n_layer
        for name, module in self.named_modules():
            self.init_module(name, module)

    def init_module(self, name: str, module: nn.Module) -> None:
        """nanoGPT's init of one module's own tensors, from torch's global RNG: the rule
        models/init.py applies per module when the model is built on the meta device.

        Linear and Embedding weights normal(0, 0.02), biases zero, LayerNorm ones and
        zeros; attn.proj and mlp.proj, which write into the residual stream, are scaled
        down by sqrt(2 * n_layer) so that its variance does not grow with depth.
        """
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = name.endswith(".proj")
            std = 0.02 / math.sqrt(2 * self.n_layer) if residual else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map token ids (B, T), T <= block_size, to logits (B, T, V).

        On a middle or last pipeline stage (tok_emb set to None) x is the residual stream
        (B, T, C) instead; on a first or middle one (lm_head None) that stream is returned.
        """
        if self.tok_emb is not None:
            T = x.shape[1]
            if T > self.block_size:
                raise ValueError(
                    f"sequence of {T} tokens is longer than block_size {self.block_size}"
                )
            pos = torch.arange(T, device=x.device)  # (T,)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))  # (B, T, C) + (T, C)
        for block in self.blocks.values():
            x = block(x)  # (B, T, C)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))  # (B, T, V)
        return x
