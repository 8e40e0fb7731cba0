"""Distillation losses, each summed over examples: the train step's (sum, count) contract.

Every function returns the SUM over the batch's examples of a per-example loss that depends
on that example's row alone, so the step's global normalisation (divide by the examples of
the whole step, over micro-batches and ranks: training/step.py) makes the gradient that of
the mean over one global batch whatever dp and accumulation are. A loss that averaged over
the batch here would be divided twice and weighted per micro-batch.

- `soft_target_kl`: Hinton et al. 2015: KL(teacher_T || student_T) of the softened
  distributions softmax(z / T), times T^2 so the soft gradients keep the hard loss's scale
  as T changes. With `top_k` teacher logits (the cache keeps only those) the teacher's
  distribution is renormalised on its top k classes and the student's log-probabilities are
  read there from its full softmax.
- `hidden_mse`: FitNets / TinyBERT: mean squared error between a (projected) student
  hidden state and the teacher's, per example averaged over its unmasked tokens and the
  features.
- `attention_mse`: TinyBERT: mean squared error between attention maps (B, H, T, T), per
  example averaged over heads and the unmasked query x key positions.
- `cosine_loss`: DistilBERT's cosine embedding loss with target 1: 1 - cos(student, teacher)
  per example, on pooled embeddings or logits.
Language-model logits (B, T, V) are per token: their KL and cosine sum over the unmasked
tokens (targets not -100), which is what the step's count (target tokens) normalises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp32 at least (bf16 logits lose the small probabilities KL depends on); fp64 stays."""
    return x if x.dtype == torch.float64 else x.float()


def soft_target_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    temperature: float,
    teacher_index: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """T^2 x KL(softmax(teacher / T) || softmax(student / T)), summed over examples (or tokens).

    Args:
        student_logits: (B, C) or (B, T, C).
        teacher_logits: the same shape, or (..., k) top-k values with `teacher_index`.
        temperature: T > 0; T = 1 is the plain KL.
        teacher_index: (..., k) int64 class ids of top-k teacher logits, None for all classes.
        mask: (B, T) bool, tokens that count (LM targets that are not -100); None = all.
    """
    t = temperature
    log_p_s = F.log_softmax(_wide(student_logits) / t, dim=-1)  # (..., C)
    if teacher_index is not None:
        log_p_s = log_p_s.gather(-1, teacher_index)  # (..., k): the student where the teacher kept
    log_p_t = F.log_softmax(_wide(teacher_logits).to(log_p_s.dtype) / t, dim=-1)  # (..., k or C)
    per_item = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)  # (B,) or (B, T)
    if mask is not None:
        per_item = per_item * mask
    return per_item.sum() * (t * t)


def hidden_mse(
    student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, *, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per example: mean over its unmasked tokens and the D features of the squared error; summed.

    Args:
        student_hidden: (B, T, D) the student's state, already projected to the teacher's width.
        teacher_hidden: (B, T, D).
        mask: (B, T) attention mask (1 = a real token); None = every token.
    """
    sq = (_wide(student_hidden) - _wide(teacher_hidden)).pow(2).mean(-1)  # (B, T)
    if mask is None:
        return sq.mean(-1).sum()
    m = mask.to(sq.dtype)
    return ((sq * m).sum(-1) / m.sum(-1).clamp_min(1)).sum()


def attention_mse(
    student_attn: torch.Tensor, teacher_attn: torch.Tensor, *, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per example: mean over heads and unmasked (query, key) pairs of the squared error; summed.

    Args:
        student_attn: (B, H, T, T) attention probabilities.
        teacher_attn: (B, H, T, T), the same number of heads.
        mask: (B, T) attention mask; a pair counts when both its query and key are real tokens.
    """
    sq = (_wide(student_attn) - _wide(teacher_attn)).pow(2).mean(1)  # (B, T, T), over heads
    if mask is None:
        return sq.mean((-2, -1)).sum()
    m = mask.to(sq.dtype)
    pairs = m[:, :, None] * m[:, None, :]  # (B, T, T)
    return ((sq * pairs).sum((-2, -1)) / pairs.sum((-2, -1)).clamp_min(1)).sum()


def cosine_loss(
    student: torch.Tensor, teacher: torch.Tensor, *, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum over examples of 1 - cos(student_i, teacher_i); inputs (B, D), or (B, T, D) per token.

    Args:
        student, teacher: (B, D) pooled embeddings or logits, or (B, T, V) per-token logits.
        mask: (B, T) bool, the tokens that count (LM targets that are not -100), as the KL and
            the hard loss count them; None = all.
    """
    cos = F.cosine_similarity(_wide(student), _wide(teacher).to(_wide(student).dtype), dim=-1)
    per_item = 1 - cos  # (B,) or (B, T)
    if mask is not None:
        per_item = per_item * mask
    return per_item.sum()


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, T, D) -> (B, D): the mean over unmasked tokens (sentence-transformers' pooling)."""
    if mask is None:
        return hidden.mean(1)
    m = mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


def uniform_layer_map(student_layers: int, teacher_layers: int) -> list[int]:
    """TinyBERT's map g(m) = m x N / M: student layer m (1..M) learns teacher layer g(m)
    (rounded, and at least 1: a layer never learns the embeddings, which have no attention
    map), and the embeddings (0) learn the teacher's embeddings (0). Returns M + 1 entries."""
    return [0] + [
        max(1, round(m * teacher_layers / student_layers)) for m in range(1, student_layers + 1)
    ]
