"""The distillation loss: one (summed loss, count) function, like any loss the step calls.

    loss = (1 - alpha) x hard(student, labels)            classifiers and language models
         + alpha x T^2 x KL(teacher_T || student_T)        (Hinton et al. 2015)
         + hidden_weight x sum_m MSE(W_m h_m, H_g(m))      (FitNets, TinyBERT)
         + attention_weight x sum_m MSE(A_m, A_g(m))       (TinyBERT)
         + cosine_weight x (1 - cos(student, teacher))     (DistilBERT), pooled or logits
         + relation_weight x (KL(attention) + KL(values))  (MiniLM), last layer
         + contrastive_weight x InfoNCE(pooled student, pooled teachers of the micro-batch)

Every term is summed over examples (tokens for an LM's KL), so the train step's single
global normaliser applies to the sum: the combined loss keeps dp x accumulation parity.
It is called inside the step's forward context, right after the student's forward; the
teacher runs there too (its own dtype, inference mode: distill/teacher.py) or, with a cache,
its outputs arrive with the batch (`Batch.teacher`, distill/cache.py) and no teacher exists.

The contrastive term alone couples examples: example i's negatives are the teacher
embeddings of the other examples of its micro-batch on its rank (no collective; constants,
so the sum over i is still a sum of per-row losses given the micro-batch). "One process"
therefore means the same micro-batches: dp = n with micro-batch m equals one process with
micro-batch m accumulating the n x k micro-batches of the same global batch (rank r reads
the r-th contiguous block of it, cut into micro-batches of m, where one process cuts the
whole batch: data/sampler.py). The objective depends on train.micro_batch (m - 1
negatives), and its held-out value on how an evaluation cuts its batches (micro_batch
examples of each rank's strided share): compare that value between runs of one layout.

The loss also keeps each term's unweighted sum (`DistillationLoss.terms`), which the trainer
and the evaluation log as hard_loss, distill/kl, distill/hidden, distill/attention,
distill/cosine, distill/relation and distill/contrastive, normalised and reduced like the
loss itself.

Teacher targets, online or cached, are one flat dict: "logits" (and "logits_index" for
top-k), "pooled" (B, D) mean-pooled last hidden state, "hidden.L" (B, T, D) teacher state L,
"attn.L" (B, H, T, T) teacher block L's attention, "query.last", "key.last", "value.last"
(B, T, D) the last layer's projections (the relations are computed from them by the loss,
online or cached alike). `Needs` says which a run reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scaletrain.data.sources import IGNORE_INDEX, Batch
from scaletrain.distill.losses import (
    attention_mse,
    contrastive_loss,
    cosine_loss,
    hidden_mse,
    mean_pool,
    relation_loss,
    soft_target_kl,
)
from scaletrain.distill.student import StudentOutput
from scaletrain.distill.teacher import Teacher, run_teacher
from scaletrain.loss import LossFn

LOGIT_KINDS = ("classification", "lm")


@dataclass(frozen=True)
class Weights:
    alpha: float
    temperature: float
    hidden: float
    attention: float
    cosine: float
    cosine_on: str  # "pooled" or "logits"
    relation: float = 0.0
    contrastive: float = 0.0
    contrastive_temperature: float = 0.05


# The teacher's last-layer projections the relation term reads, in (query, key, value) order.
QKV_KEYS = ("query.last", "key.last", "value.last")


@dataclass(frozen=True)
class Needs:
    """The teacher outputs a run reads (what the cache must hold)."""

    logits: bool
    pooled: bool
    hidden: tuple[int, ...]  # teacher states
    attentions: tuple[int, ...]  # teacher blocks (1-based, as states)
    qkv: bool = False  # the last layer's query, key and value (the relation term)

    def keys(self) -> list[str]:
        return (
            (["logits"] if self.logits else [])
            + (["pooled"] if self.pooled else [])
            + [f"hidden.{i}" for i in self.hidden]
            + [f"attn.{i}" for i in self.attentions]
            + (list(QKV_KEYS) if self.qkv else [])
        )


def needs_of(w: Weights, *, task_kind: str, layer_map: list[int]) -> Needs:
    logit_task = task_kind in LOGIT_KINDS
    return Needs(
        logits=logit_task and (w.alpha > 0 or (w.cosine > 0 and w.cosine_on == "logits")),
        pooled=(w.cosine > 0 and w.cosine_on == "pooled") or w.contrastive > 0,
        hidden=tuple(sorted(set(layer_map))) if w.hidden > 0 else (),
        attentions=tuple(sorted(set(layer_map[1:]))) if w.attention > 0 else (),
        qkv=w.relation > 0,
    )


def teacher_targets(teacher: Teacher, batch: Batch, needs: Needs) -> dict[str, torch.Tensor]:
    """Run the teacher on a batch and keep what `needs` names (the cache's format)."""
    out = run_teacher(
        teacher,
        batch,
        hidden=bool(needs.hidden),
        attentions=bool(needs.attentions),
        qkv=needs.qkv,
    )
    targets: dict[str, torch.Tensor] = {}
    if needs.logits:
        targets["logits"] = out["output"]
    if needs.pooled:
        last = out["hidden"][-1] if "hidden" in out else out["output"]  # (B, T, D)
        targets["pooled"] = mean_pool(last, batch.extras.get("attention_mask"))
    for i in needs.hidden:
        targets[f"hidden.{i}"] = out["hidden"][i]
    for i in needs.attentions:
        targets[f"attn.{i}"] = out["attentions"][i - 1]
    if needs.qkv:
        targets.update(zip(QKV_KEYS, out["qkv"]))  # each (B, T, D)
    return targets


# The names each term is logged under (training records and eval records), unweighted and
# normalised like the loss: loss = (1 - alpha) x hard_loss + alpha x distill/kl
# + hidden_weight x distill/hidden + attention_weight x distill/attention
# + cosine_weight x distill/cosine + relation_weight x distill/relation
# + contrastive_weight x distill/contrastive. distill/kl includes the T^2 factor.
HARD, KL, HIDDEN, ATTENTION, COSINE, RELATION, CONTRASTIVE = (
    "hard_loss",
    "distill/kl",
    "distill/hidden",
    "distill/attention",
    "distill/cosine",
    "distill/relation",
    "distill/contrastive",
)


class LossTerms:
    """Each term's summed value (float64, detached) over the loss's calls since `take()`.

    The loss adds to it on every call; whoever owns the calls takes the sums: the trainer
    after each step (its metrics window), the evaluation around its batches. They are sums
    like the loss's, so they are all-reduced over the data-parallel group and divided by the
    same count as the loss: 1 process and dp = 2 log the same terms (the contrastive term's
    held-out value excepted: its negatives are each rank's eval batch, module docstring).
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._sums = dict.fromkeys(names, 0.0)

    def add(self, values: dict[str, torch.Tensor]) -> None:
        for name, value in values.items():
            if value.is_meta:  # the launcher's check on shapes: no value to add
                continue
            self._sums[name] += float(value.detach().double())

    def take(self) -> dict[str, float]:
        sums, self._sums = self._sums, dict.fromkeys(self.names, 0.0)
        return sums


def take_terms(loss_fn: LossFn) -> dict[str, float]:
    """The summed terms a loss recorded since the last take ({} for a loss without terms)."""
    terms = getattr(loss_fn, "terms", None)
    return terms.take() if isinstance(terms, LossTerms) else {}


def term_names(w: Weights, *, task_kind: str) -> tuple[str, ...]:
    """The terms a run's loss has, in the order of the objective's formula."""
    logit_task = task_kind in LOGIT_KINDS
    return tuple(
        name
        for name, on in (
            (HARD, logit_task and w.alpha < 1),
            (KL, logit_task and w.alpha > 0),
            (HIDDEN, w.hidden > 0),
            (ATTENTION, w.attention > 0),
            (COSINE, w.cosine > 0),
            (RELATION, w.relation > 0),
            (CONTRASTIVE, w.contrastive > 0),
        )
        if on
    )


class DistillationLoss:
    """The combined loss as a LossFn (StudentOutput, batch) -> (sum, count), with its terms.

    Args:
        hard: the hard-label loss (train.loss), None for sentence data (no labels).
        teacher: the online teacher, None when every batch carries cached targets.
        weights: the [distill] weights.
        needs: what the teacher provides.
        layer_map: student state m -> teacher state (m = 0 the embeddings).
        task_kind: the data's kind.
        relation_heads: R, the relation heads of the relation term (the student's attention
            heads); 0 without it.
    """

    def __init__(
        self,
        hard: LossFn | None,
        *,
        teacher: Teacher | None,
        weights: Weights,
        needs: Needs,
        layer_map: list[int],
        task_kind: str,
        relation_heads: int = 0,
    ) -> None:
        self.hard, self.teacher, self.w, self.needs = hard, teacher, weights, needs
        self.layer_map, self.task_kind = layer_map, task_kind
        self.relation_heads = relation_heads
        self.terms = LossTerms(term_names(weights, task_kind=task_kind))

    def __call__(self, output: StudentOutput, batch: Batch) -> tuple[torch.Tensor, int]:
        w = self.w
        terms = self.unweighted(output, batch)
        weight = {
            HARD: 1 - w.alpha,
            KL: w.alpha,
            HIDDEN: w.hidden,
            ATTENTION: w.attention,
            COSINE: w.cosine,
            RELATION: w.relation,
            CONTRASTIVE: w.contrastive,
        }
        total = torch.zeros((), device=batch.targets.device)
        for name, value in terms.items():
            total = total + weight[name] * value
        self.terms.add(terms)
        return total, batch.count

    def unweighted(self, output: StudentOutput, batch: Batch) -> dict[str, torch.Tensor]:
        """Each term's sum over the batch's examples (tokens for an LM), before its weight."""
        w = self.w
        t = batch.teacher if batch.teacher else teacher_targets(self.teacher, batch, self.needs)
        # (B, T) the tokens an LM's loss counts (targets not -100); None for one row per example
        lm_mask = batch.targets != IGNORE_INDEX if self.task_kind == "lm" else None
        terms: dict[str, torch.Tensor] = {}
        if self.task_kind in LOGIT_KINDS:
            if w.alpha < 1:
                terms[HARD] = self.hard(output, batch)[0]
            if w.alpha > 0:
                terms[KL] = soft_target_kl(
                    output.logits,
                    t["logits"],
                    temperature=w.temperature,
                    teacher_index=t.get("logits_index"),
                    mask=lm_mask,
                )
        return {**terms, **self.representation_terms(output, batch, t, lm_mask=lm_mask)}

    def representation_terms(
        self,
        output: StudentOutput,
        batch: Batch,
        t: dict[str, torch.Tensor],
        *,
        lm_mask: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """The terms on hidden states, attention, embeddings or logits' directions (before
        their weights), in the objective's order."""
        w, layer_map = self.w, self.layer_map
        mask = batch.extras.get("attention_mask")  # (B, T) for sentence data
        terms: dict[str, torch.Tensor] = {}
        if w.hidden > 0:
            terms[HIDDEN] = sum(
                hidden_mse(state, t[f"hidden.{layer_map[m]}"], mask=mask)
                for m, state in output.hidden.items()
            )
        if w.attention > 0:
            terms[ATTENTION] = sum(
                attention_mse(attn, t[f"attn.{layer_map[m]}"], mask=mask)
                for m, attn in output.attentions.items()
            )
        pooled = None
        if (w.cosine > 0 and w.cosine_on == "pooled") or w.contrastive > 0:
            pooled = mean_pool(output.last_hidden, mask)  # (B, D)
        if w.cosine > 0 and w.cosine_on == "pooled":
            terms[COSINE] = cosine_loss(pooled, t["pooled"])
        elif w.cosine > 0:
            terms[COSINE] = cosine_loss(output.logits, t["logits"], mask=lm_mask)
        if w.relation > 0:
            student = (output.qkv["query"], output.qkv["key"], output.qkv["value"])
            teacher = tuple(t[k] for k in QKV_KEYS)
            terms[RELATION] = relation_loss(student, teacher, heads=self.relation_heads, mask=mask)
        if w.contrastive > 0:
            # In-batch: this micro-batch's teacher embeddings are the negatives (module doc).
            terms[CONTRASTIVE] = contrastive_loss(
                pooled, t["pooled"], temperature=w.contrastive_temperature
            )
        return terms


def distillation_loss(
    hard: LossFn | None,
    *,
    teacher: Teacher | None,
    weights: Weights,
    needs: Needs,
    layer_map: list[int],
    task_kind: str,
    relation_heads: int = 0,
) -> DistillationLoss:
    """The combined loss (see `DistillationLoss`)."""
    return DistillationLoss(
        hard,
        teacher=teacher,
        weights=weights,
        needs=needs,
        layer_map=layer_map,
        task_kind=task_kind,
        relation_heads=relation_heads,
    )
