"""The distillation loss: one (summed loss, count) function, like any loss the step calls.

    loss = (1 - alpha) x hard(student, labels)            classifiers and language models
         + alpha x T^2 x KL(teacher_T || student_T)        (Hinton et al. 2015)
         + hidden_weight x sum_m MSE(W_m h_m, H_g(m))      (FitNets, TinyBERT)
         + attention_weight x sum_m MSE(A_m, A_g(m))       (TinyBERT)
         + cosine_weight x (1 - cos(student, teacher))     (DistilBERT), pooled or logits

Every term is summed over examples (tokens for an LM's KL), so the train step's single
global normaliser applies to the sum: the combined loss keeps dp x accumulation parity.
It is called inside the step's forward context, right after the student's forward; the
teacher runs there too (its own dtype, inference mode: distill/teacher.py) or, with a cache,
its outputs arrive with the batch (`Batch.teacher`, distill/cache.py) and no teacher exists.

Teacher targets, online or cached, are one flat dict: "logits" (and "logits_index" for
top-k), "pooled" (B, D) mean-pooled last hidden state, "hidden.L" (B, T, D) teacher state L,
"attn.L" (B, H, T, T) teacher block L's attention. `Needs` says which a run reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scaletrain.data.sources import IGNORE_INDEX, Batch
from scaletrain.distill.losses import (attention_mse, cosine_loss, hidden_mse, mean_pool,
                                       soft_target_kl)
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


@dataclass(frozen=True)
class Needs:
    """The teacher outputs a run reads (what the cache must hold)."""

    logits: bool
    pooled: bool
    hidden: tuple[int, ...]  # teacher states
    attentions: tuple[int, ...]  # teacher blocks (1-based, as states)

    def keys(self) -> list[str]:
        return ((["logits"] if self.logits else []) + (["pooled"] if self.pooled else [])
                + [f"hidden.{i}" for i in self.hidden] + [f"attn.{i}" for i in self.attentions])


def needs_of(w: Weights, *, task_kind: str, layer_map: list[int]) -> Needs:
    logit_task = task_kind in LOGIT_KINDS
    return Needs(logits=logit_task and (w.alpha > 0 or (w.cosine > 0 and w.cosine_on == "logits")),
                 pooled=w.cosine > 0 and w.cosine_on == "pooled",
                 hidden=tuple(sorted(set(layer_map))) if w.hidden > 0 else (),
                 attentions=tuple(sorted(set(layer_map[1:]))) if w.attention > 0 else ())


def teacher_targets(teacher: Teacher, batch: Batch, needs: Needs) -> dict[str, torch.Tensor]:
    """Run the teacher on a batch and keep what `needs` names (the cache's format)."""
    out = run_teacher(teacher, batch, hidden=bool(needs.hidden), attentions=bool(needs.attentions))
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
    return targets


def distillation_loss(hard: LossFn | None, *, teacher: Teacher | None, weights: Weights,
                      needs: Needs, layer_map: list[int], task_kind: str) -> LossFn:
    """The combined loss as a LossFn (StudentOutput, batch) -> (sum, count).

    Args:
        hard: the hard-label loss (train.loss), None for sentence data (no labels).
        teacher: the online teacher, None when every batch carries cached targets.
        weights: the [distill] weights.
        needs: what the teacher provides.
        layer_map: student state m -> teacher state (m = 0 the embeddings).
        task_kind: the data's kind.
    """
    w = weights

    def loss_fn(output: StudentOutput, batch: Batch) -> tuple[torch.Tensor, int]:
        t = batch.teacher if batch.teacher else teacher_targets(teacher, batch, needs)
        mask = batch.extras.get("attention_mask")  # (B, T) for sentence data
        total = torch.zeros((), device=batch.targets.device)
        if task_kind in LOGIT_KINDS:
            if w.alpha < 1:
                total = total + (1 - w.alpha) * hard(output, batch)[0]
            if w.alpha > 0:
                lm_mask = batch.targets != IGNORE_INDEX if task_kind == "lm" else None
                total = total + w.alpha * soft_target_kl(
                    output.logits, t["logits"], temperature=w.temperature,
                    teacher_index=t.get("logits_index"), mask=lm_mask)
        for m, state in output.hidden.items():
            total = total + w.hidden * hidden_mse(state, t[f"hidden.{layer_map[m]}"], mask=mask)
        for m, attn in output.attentions.items():
            total = total + w.attention * attention_mse(attn, t[f"attn.{layer_map[m]}"], mask=mask)
        if w.cosine > 0:
            if w.cosine_on == "pooled":
                total = total + w.cosine * cosine_loss(mean_pool(output.last_hidden, mask),
                                                       t["pooled"])
            else:
                total = total + w.cosine * cosine_loss(output.logits, t["logits"])
        return total, batch.count

    return loss_fn
