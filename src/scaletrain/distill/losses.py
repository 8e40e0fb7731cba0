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
- `relation_loss`: MiniLM (Wang et al. 2020): the last layer's self-attention distributions
  softmax(Q K^T / sqrt(d)) and value relations softmax(V V^T / sqrt(d)), per relation head,
  KL(teacher || student) over the real keys, per example averaged over heads and real query
  rows. The relations are T x T, so the two widths may differ: each model's Q, K, V is cut
  into the same R contiguous relation heads of its own width / R (MiniLMv2); with R the
  student's attention heads, the student's relations are its own attention maps, and the
  teacher's too when it has as many heads (MiniLM's own case).
- `contrastive_loss`: InfoNCE on pooled embeddings: example i's student embedding against
  every teacher embedding of the batch, cos / tau, the teacher's own embedding of i the
  positive. The only exception to "one row alone": the batch's other teacher embeddings are
  its negatives. They are constants (the teacher has no gradient), so the loss is still a
  sum over examples of a function of each student row, given the batch's negatives: exact
  under the step's normalisation for a fixed split into micro-batches (distill/objective.py
  says which split).
Language-model logits (B, T, V) are per token: their KL and cosine sum over the unmasked
tokens (targets not -100), which is what the step's count (target tokens) normalises.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp32 at least (bf16 logits lose the small probabilities KL depends on); fp64 stays."""
    return x if x.dtype == torch.float64 else x.float()


def _exact(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off for a loss's own matmuls: the step calls the loss inside its forward
    context, where bf16-mixed would round the scores (and the relations' small
    probabilities) to 8 bits of mantissa. Meta tensors (the launcher's check) have none."""
    if x.is_meta:
        return contextlib.nullcontext()
    return torch.autocast(device_type=x.device.type, enabled=False)


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


def relation_log_probs(
    x: torch.Tensor, y: torch.Tensor, *, heads: int, mask: torch.Tensor | None
) -> torch.Tensor:
    """log softmax(x_r y_r^T / sqrt(d_r)) over the real keys of each relation head r.

    Args:
        x, y: (B, T, D) queries and keys (or values and values), D divisible by `heads`.
        heads: R, the relation heads: x and y are cut into R contiguous slices of D / R, as
            a BERT layer cuts its heads (so R = its heads gives its own attention scores).
        mask: (B, T) attention mask; a padded key gets probability 0 (log -inf).
    Returns:
        (B, R, T, T), at least fp32.
    """
    b, t, d = x.shape
    xr = _wide(x).view(b, t, heads, d // heads).transpose(1, 2)  # (B, R, T, d_r)
    yr = _wide(y).to(xr.dtype).view(b, t, heads, d // heads).transpose(1, 2)  # (B, R, T, d_r)
    with _exact(x):
        scores = xr @ yr.transpose(-1, -2) / math.sqrt(d // heads)  # (B, R, T, T)
    if mask is not None:
        scores = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    return scores.log_softmax(-1)


def relation_kl(
    student_log_p: torch.Tensor, teacher_log_p: torch.Tensor, *, mask: torch.Tensor | None
) -> torch.Tensor:
    """Per example: the mean over heads and real query rows of KL(teacher || student) over
    the real keys; summed over examples.

    Args:
        student_log_p, teacher_log_p: (B, R, T, T) log-probabilities (`relation_log_probs`).
        mask: (B, T) attention mask; None = every token.
    """
    p_t = teacher_log_p.exp()
    terms = p_t * (teacher_log_p - student_log_p.to(p_t.dtype))  # (B, R, T, T)
    if mask is not None:  # padded keys hold -inf - -inf = NaN, weighted 0: taken out
        terms = torch.where(mask.bool()[:, None, None, :], terms, 0.0)
    kl = terms.sum(-1).mean(1)  # (B, T): per query row, over heads
    if mask is None:
        return kl.mean(-1).sum()
    m = mask.to(kl.dtype)
    return ((kl * m).sum(-1) / m.sum(-1).clamp_min(1)).sum()


def relation_loss(
    student_qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    teacher_qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    heads: int,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """MiniLM's L_AT + L_VR, each summed over examples: the KL of the attention distributions
    (Q, K) plus the KL of the value relations (V, V).

    Args:
        student_qkv: the student's last-layer (query, key, value), each (B, T, D_s).
        teacher_qkv: the teacher's, each (B, T, D_t); D_s and D_t divisible by `heads`.
        heads: R relation heads (`relation_log_probs`).
        mask: (B, T) attention mask; None = every token.
    """
    (qs, ks, vs), (qt, kt, vt) = student_qkv, teacher_qkv

    def kl(s1, s2, t1, t2):
        return relation_kl(
            relation_log_probs(s1, s2, heads=heads, mask=mask),
            relation_log_probs(t1, t2, heads=heads, mask=mask),
            mask=mask,
        )

    return kl(qs, ks, qt, kt) + kl(vs, vs, vt, vt)


def contrastive_loss(
    student: torch.Tensor, teacher: torch.Tensor, *, temperature: float
) -> torch.Tensor:
    """InfoNCE summed over the batch: sum_i -log softmax_j(cos(s_i, t_j) / tau)[i].

    Args:
        student: (B, D) pooled student embeddings.
        teacher: (B, D) the teacher's embeddings of the same examples: row i is example i's
            positive, the other rows its negatives (constants: no gradient reaches them).
        temperature: tau > 0.
    """
    s = F.normalize(_wide(student), dim=-1)  # (B, D)
    t = F.normalize(_wide(teacher).to(s.dtype), dim=-1)  # (B, D)
    with _exact(student):
        logits = s @ t.T / temperature  # (B, B): cos(s_i, t_j) / tau
    return (logits.logsumexp(-1) - logits.diagonal()).sum()


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
