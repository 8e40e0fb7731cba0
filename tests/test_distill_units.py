"""Distillation's pure parts, with no process group: every loss against a value worked out by
hand, the layer maps, initialisation from teacher layers, the combined objective on cached
targets, the student wrapper, the cache helpers and the teacher's checksum.

The expected values never come from torch's own KL or MSE: they are written out with
`math.log` / `math.exp` on a few numbers (2 examples x 3 classes and the like), or from the
plain-Python references below (`_kl`, `_hidden_mse`, ...), which loop over lists in the
order the losses' docstrings define them (per example first, then summed over examples).
"""

from __future__ import annotations

import ast
import hashlib
import math
import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from scaletrain.data.sources import IGNORE_INDEX, ArrayDataset, Batch, TaskSpec  # noqa: E402
from scaletrain.distill import cache as kd_cache  # noqa: E402
from scaletrain.distill.losses import (  # noqa: E402
    attention_mse,
    cosine_loss,
    hidden_mse,
    mean_pool,
    soft_target_kl,
    uniform_layer_map,
)
from scaletrain.distill.objective import Needs, Weights, distillation_loss, take_terms  # noqa: E402
from scaletrain.distill.student import (  # noqa: E402
    Distilled,
    StudentOutput,
    init_from_teacher,
    resolve_layer_map,
    student_weights,
)
from scaletrain.distill.teacher import TeacherError, load_teacher, weights_sha256  # noqa: E402
from scaletrain.loss import cross_entropy  # noqa: E402
from scaletrain.user_code import UserCodeError  # noqa: E402

transformers = pytest.importorskip("transformers")

F64 = torch.float64


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# ------------------------------------------------------------- plain-Python references


def _log_softmax(row: list[float], temperature: float = 1.0) -> list[float]:
    z = [v / temperature for v in row]
    top = max(z)
    lse = top + math.log(sum(math.exp(v - top) for v in z))
    return [v - lse for v in z]


def _kl(
    student: list[float], teacher: list[float], temperature: float, index: list[int] | None = None
) -> float:
    """KL(teacher_T || student_T) of one row, without the T^2 factor; with `index`, the
    teacher row holds its top-k values and the student is read at those classes."""
    log_s = _log_softmax(student, temperature)
    if index is not None:
        log_s = [log_s[i] for i in index]
    log_t = _log_softmax(teacher, temperature)
    return sum(math.exp(a) * (a - b) for a, b in zip(log_t, log_s))


def _hidden_mse(s, t, mask) -> float:
    """(B, T, D) lists: per example the mean over real tokens of the mean over D; summed."""
    total = 0.0
    for b in range(len(s)):
        tokens = [i for i in range(len(s[b])) if mask is None or mask[b][i]]
        per_token = [
            sum((x - y) ** 2 for x, y in zip(s[b][i], t[b][i])) / len(s[b][i]) for i in tokens
        ]
        total += sum(per_token) / max(len(tokens), 1)
    return total


def _attention_mse(s, t, mask) -> float:
    """(B, H, T, T) lists: per example the mean over heads and real (query, key) pairs."""
    total = 0.0
    for b in range(len(s)):
        n = len(s[b][0])
        pairs = [
            (q, k)
            for q in range(n)
            for k in range(n)
            if mask is None or (mask[b][q] and mask[b][k])
        ]
        heads = len(s[b])
        total += sum(
            sum((s[b][h][q][k] - t[b][h][q][k]) ** 2 for h in range(heads)) / heads
            for q, k in pairs
        ) / max(len(pairs), 1)
    return total


def _cosine(u: list[float], v: list[float]) -> float:
    dot = sum(a * b for a, b in zip(u, v))
    return dot / (math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v)))


def _mean_pool(h, mask) -> list[list[float]]:
    out = []
    for b in range(len(h)):
        rows = [h[b][i] for i in range(len(h[b])) if mask[b][i]]
        out.append([sum(col) / len(rows) for col in zip(*rows)])
    return out


# ---------------------------------------------------------------------- soft_target_kl


def test_kl_of_two_examples_is_the_hand_value() -> None:
    # Example 0: uniform student (1/3 each), teacher probabilities (1/4, 1/2, 1/4).
    # Example 1: uniform teacher, student probabilities (1/4, 1/4, 1/2).
    student = _t([[0.0, 0.0, 0.0], [0.0, 0.0, math.log(2)]])
    teacher = _t([[0.0, math.log(2), 0.0], [5.0, 5.0, 5.0]])
    by_hand = (
        0.25 * math.log(0.25 / (1 / 3)) * 2
        + 0.5 * math.log(0.5 / (1 / 3))
        + (1 / 3) * (2 * math.log((1 / 3) / 0.25) + math.log((1 / 3) / 0.5))
    )

    got = soft_target_kl(student, teacher, temperature=1.0)

    assert got.dtype == F64 and got.shape == ()
    assert float(got) == pytest.approx(by_hand, rel=1e-12)


def test_kl_temperature_softens_and_scales_by_t_squared() -> None:
    student = _t([[1.0, -2.0, 0.5], [3.0, 0.0, -1.0]])
    teacher = _t([[2.0, 0.0, -1.0], [0.0, 1.5, 1.0]])
    for t in (1.0, 2.0):
        by_hand = t * t * sum(_kl(s, q, t) for s, q in zip(student.tolist(), teacher.tolist()))
        assert float(soft_target_kl(student, teacher, temperature=t)) == pytest.approx(
            by_hand, rel=1e-12
        ), f"T = {t}"
    # Logits doubled at T = 2 soften to the T = 1 distributions: only T^2 = 4 remains.
    plain = float(soft_target_kl(student, teacher, temperature=1.0))
    assert float(soft_target_kl(2 * student, 2 * teacher, temperature=2.0)) == pytest.approx(
        4 * plain, rel=1e-12
    )


def test_kl_top_k_renormalises_the_teacher_and_reads_the_student_there() -> None:
    # Student probabilities (1/6, 2/6, 3/6); the teacher kept classes 2 and 0 with logits 2, 1.
    student = _t([[0.0, math.log(2), math.log(3)]])
    values, index = _t([[2.0, 1.0]]), torch.tensor([[2, 0]])
    p2, p0 = math.e / (math.e + 1), 1 / (math.e + 1)
    by_hand = p2 * (math.log(p2) - math.log(3 / 6)) + p0 * (math.log(p0) - math.log(1 / 6))

    got = soft_target_kl(student, values, temperature=1.0, teacher_index=index)

    assert float(got) == pytest.approx(by_hand, rel=1e-12)
    at_t2 = soft_target_kl(student, values, temperature=2.0, teacher_index=index)
    assert float(at_t2) == pytest.approx(
        4 * _kl(student[0].tolist(), [2.0, 1.0], 2.0, [2, 0]), rel=1e-12
    )


def test_kl_of_a_language_model_sums_the_unmasked_tokens() -> None:
    student = _t([[[1.0, 0.0, 0.0], [0.0, 2.0, 1.0]], [[0.5, 0.5, 0.0], [3.0, 1.0, 0.0]]])
    teacher = _t([[[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]], [[2.0, 0.0, 1.0], [0.0, 0.0, 4.0]]])
    mask = torch.tensor([[True, False], [True, True]])  # token (0, 1) is padding
    by_hand = 4 * sum(
        _kl(student[b, i].tolist(), teacher[b, i].tolist(), 2.0)
        for b, i in [(0, 0), (1, 0), (1, 1)]
    )

    got = soft_target_kl(student, teacher, temperature=2.0, mask=mask)

    assert float(got) == pytest.approx(by_hand, rel=1e-12)
    garbage = teacher.clone()
    garbage[0, 1] = _t([50.0, -50.0, 0.0])  # what a masked token's teacher says does not count
    assert float(soft_target_kl(student, garbage, temperature=2.0, mask=mask)) == pytest.approx(
        by_hand, rel=1e-12
    )


def test_kl_of_bf16_logits_is_computed_in_fp32() -> None:
    student = torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]], dtype=torch.bfloat16)
    teacher = torch.tensor([[3.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.bfloat16)
    by_hand = 4 * sum(_kl(s, t, 2.0) for s, t in zip(student.tolist(), teacher.tolist()))

    got = soft_target_kl(student, teacher, temperature=2.0)

    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(by_hand, rel=1e-6)


# ----------------------------------------------------------------- hidden / attention


def test_hidden_mse_averages_each_example_over_its_real_tokens_then_sums() -> None:
    student = _t(
        [[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]], [[2.0, 0.0], [100.0, 100.0], [100.0, 100.0]]]
    )
    teacher = torch.zeros_like(student)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # Example 0: tokens (1 + 4) / 2 = 2.5 and (9 + 16) / 2 = 12.5, mean 7.5; example 1: 2.
    # (One mean over all 3 real tokens, times B, would give (2.5 + 12.5 + 2) / 3 x 2 = 11.33.)
    assert float(hidden_mse(student, teacher, mask=mask)) == pytest.approx(9.5, rel=1e-12)
    # No mask: every token, padding included.
    by_hand = (2.5 + 12.5 + 10000) / 3 + (2 + 10000 + 10000) / 3
    assert float(hidden_mse(student, teacher)) == pytest.approx(by_hand, rel=1e-12)


def test_attention_mse_counts_pairs_of_real_tokens_only() -> None:
    # Example 0: both tokens real; heads differ from the zero teacher by 1 on 2 pairs each:
    # mean over heads 0.5 on every pair, mean over 4 pairs 0.5.
    # Example 1: token 1 is padding, only pair (0, 0) counts: (0.5^2 + 0.25^2) / 2 = 0.15625.
    student = _t(
        [
            [[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]]],
            [[[0.5, 9.0], [9.0, 9.0]], [[0.25, 9.0], [9.0, 9.0]]],
        ]
    )  # (B, H, T, T)
    teacher = torch.zeros_like(student)
    mask = torch.tensor([[1, 1], [1, 0]])

    assert float(attention_mse(student, teacher, mask=mask)) == pytest.approx(0.65625, rel=1e-12)
    unmasked = 0.5 + (0.15625 + 3 * 81) / 4
    assert float(attention_mse(student, teacher)) == pytest.approx(unmasked, rel=1e-12)


def test_cosine_loss_is_one_minus_cos_summed() -> None:
    student = _t([[1.0, 0.0], [1.0, 2.0]])
    teacher = _t([[3.0, 3.0], [-2.0, 1.0]])  # 45 degrees, then orthogonal
    assert float(cosine_loss(student, teacher)) == pytest.approx(2 - 1 / math.sqrt(2), rel=1e-12)
    assert float(cosine_loss(7 * student, 0.1 * teacher)) == pytest.approx(
        2 - 1 / math.sqrt(2), rel=1e-12
    ), "the scale of either side does not matter"
    per_token = student.reshape(1, 2, 2)  # (B, T, D): summed over tokens too
    assert float(cosine_loss(per_token, teacher.reshape(1, 2, 2))) == pytest.approx(
        2 - 1 / math.sqrt(2), rel=1e-12
    )


def test_mean_pool_averages_the_real_tokens() -> None:
    hidden = _t(
        [[[1.0, 2.0], [3.0, 6.0], [100.0, 100.0]], [[4.0, -4.0], [100.0, 100.0], [100.0, 100.0]]]
    )
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])

    assert mean_pool(hidden, mask).tolist() == [[2.0, 4.0], [4.0, -4.0]]
    assert mean_pool(hidden, None).tolist() == [[104 / 3, 108 / 3], [204 / 3, 196 / 3]]


# ------------------------------------------------- the (sum, count) contract: additivity


def _random_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    # 7 real tokens in the first half, 3 in the second: a mean over all real tokens of the
    # batch would not be additive (with equal halves it would happen to be)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    index = torch.stack([torch.randperm(5, generator=g)[:3] for _ in range(4)])
    return r, mask, index


ADDITIVE = {
    "kl": lambda r, m, i: lambda sl: soft_target_kl(r(4, 5)[sl], r(4, 5)[sl], temperature=3.0),
    "kl-top-k": lambda r, m, i: (
        lambda sl: soft_target_kl(r(4, 5)[sl], r(4, 3)[sl], temperature=2.0, teacher_index=i[sl])
    ),
    "kl-lm-mask": lambda r, m, i: (
        lambda sl: soft_target_kl(
            r(4, 4, 5)[sl], r(4, 4, 5)[sl], temperature=2.0, mask=m[sl].bool()
        )
    ),
    "hidden-mse-mask": lambda r, m, i: (
        lambda sl: hidden_mse(r(4, 4, 3)[sl], r(4, 4, 3)[sl], mask=m[sl])
    ),
    "attention-mse-mask": lambda r, m, i: (
        lambda sl: attention_mse(r(4, 2, 4, 4)[sl], r(4, 2, 4, 4)[sl], mask=m[sl])
    ),
    "cosine": lambda r, m, i: lambda sl: cosine_loss(r(4, 3)[sl], r(4, 3)[sl]),
}


@pytest.mark.parametrize("name", list(ADDITIVE))
def test_every_loss_is_a_sum_over_examples(name: str) -> None:
    """loss(first half) + loss(second half) == loss(whole), in fp64: the train step's contract."""

    def on(rows: slice) -> float:
        r, mask, index = _random_inputs(0)  # the same tensors each call
        return float(ADDITIVE[name](r, mask, index)(rows))

    whole, first, second = on(slice(0, 4)), on(slice(0, 2)), on(slice(2, 4))

    assert first + second == pytest.approx(whole, rel=1e-12, abs=1e-12)
    assert abs(whole - (first + second) / 2) > 1e-6, "the halves' mean must not match (a mean)"


# --------------------------------------------------------------------------- layer maps


@pytest.mark.parametrize(
    "teacher, student, expected",
    [
        (6, 2, [0, 3, 6]),
        (4, 2, [0, 2, 4]),
        (12, 4, [0, 3, 6, 9, 12]),
        (4, 1, [0, 4]),
        (3, 3, [0, 1, 2, 3]),
    ],
)
def test_uniform_layer_map_divisible(teacher: int, student: int, expected: list[int]) -> None:
    assert uniform_layer_map(student, teacher) == expected


@pytest.mark.parametrize("teacher, student", [(6, 4), (7, 3), (12, 5), (5, 2)])
def test_uniform_layer_map_not_divisible_stays_uniform(teacher: int, student: int) -> None:
    mapping = uniform_layer_map(student, teacher)

    assert len(mapping) == student + 1
    assert mapping[0] == 0 and mapping[-1] == teacher
    assert all(a < b for a, b in zip(mapping, mapping[1:])), mapping
    for m, g in enumerate(mapping):  # g(m) = m x N / M, to the nearest state
        assert abs(g - m * teacher / student) <= 0.5, (m, mapping)


@pytest.mark.parametrize("teacher, student", [(2, 4), (1, 3), (3, 5)])
def test_uniform_layer_map_never_maps_a_layer_to_the_embeddings(teacher: int, student: int) -> None:
    """More student layers than teacher layers: a layer still learns a teacher layer (1..N),
    never the embeddings' state 0, which has no attention map."""
    mapping = uniform_layer_map(student, teacher)

    assert len(mapping) == student + 1 and mapping[0] == 0 and mapping[-1] == teacher
    assert all(1 <= g <= teacher for g in mapping[1:]), mapping
    assert all(a <= b for a, b in zip(mapping, mapping[1:])), mapping


def test_resolve_layer_map_defaults_to_uniform_and_keeps_a_valid_map() -> None:
    assert resolve_layer_map([], student_layers=2, teacher_layers=6) == [0, 3, 6]
    assert resolve_layer_map([0, 1, 5], student_layers=2, teacher_layers=6) == [0, 1, 5]


@pytest.mark.parametrize(
    "layer_map, expect",
    [
        ([0, 6], ("distill.layer_map = [0, 6]", "2 entries", "2 layers", "needs 3")),
        ([0, 2, 4, 6], ("4 entries", "needs 3")),
        ([0, 3, 7], ("entries [7]", "0..6")),
        ([-1, 3, 6], ("entries [-1]", "0..6")),
    ],
)
def test_resolve_layer_map_refusals(layer_map: list[int], expect: tuple[str, ...]) -> None:
    with pytest.raises(UserCodeError) as e:
        resolve_layer_map(layer_map, student_layers=2, teacher_layers=6)
    for want in expect:
        assert want in str(e.value), f"{want!r} not in: {e.value}"


def test_resolve_layer_map_refuses_a_layer_on_the_embeddings_under_the_attention_loss() -> None:
    assert resolve_layer_map([0, 0, 6], student_layers=2, teacher_layers=6) == [0, 0, 6]
    with pytest.raises(UserCodeError) as e:
        resolve_layer_map([0, 0, 6], student_layers=2, teacher_layers=6, attention=True)
    for want in ("distill.layer_map = [0, 0, 6]", "embeddings (0)", "no attention map", "1..6"):
        assert want in str(e.value), f"{want!r} not in: {e.value}"
    assert (
        resolve_layer_map([], student_layers=4, teacher_layers=2, attention=True)[1:]
        == uniform_layer_map(4, 2)[1:]
    )


# ------------------------------------------------------------------- init_from_teacher


def _bert(layers: int, *, hidden: int = 32, intermediate: int = 37, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=intermediate,
        vocab_size=50,
        max_position_embeddings=16,
    )
    return transformers.BertModel(cfg).eval()


def test_init_from_teacher_copies_the_named_blocks_and_the_embeddings() -> None:
    teacher, student = _bert(4, seed=0), _bert(2, seed=1)
    t_state = teacher.state_dict()

    copied = init_from_teacher(student, teacher, [1, 3])

    s_state = student.state_dict()
    for name, value in s_state.items():
        if name.startswith("encoder.layer."):
            block, rest = name[len("encoder.layer.") :].split(".", 1)
            source = f"encoder.layer.{[1, 3][int(block)]}.{rest}"
        else:
            source = name
        assert torch.equal(value, t_state[source]), f"{name} != teacher's {source}"
    assert "embeddings.word_embeddings.weight" in copied
    assert "encoder.layer.1.output.dense.weight" in copied
    # copies, not shared storage: the teacher stays frozen while the student trains
    assert (
        s_state["encoder.layer.0.output.dense.weight"].data_ptr()
        != t_state["encoder.layer.1.output.dense.weight"].data_ptr()
    )


@pytest.mark.parametrize(
    "widths, name",
    [
        (dict(intermediate=40), "encoder.layer.0.intermediate.dense.weight"),
        (dict(hidden=16), "embeddings.word_embeddings.weight"),
    ],
)
def test_init_from_teacher_refuses_other_widths_and_copies_nothing(widths: dict, name: str) -> None:
    teacher, student = _bert(4, seed=0), _bert(2, seed=1, **widths)
    before = {k: v.clone() for k, v in student.state_dict().items()}

    with pytest.raises(UserCodeError) as e:
        init_from_teacher(student, teacher, [1, 3])

    assert name in str(e.value) and "teacher's widths" in str(e.value), str(e.value)
    after = student.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refusal copied weights"


@pytest.mark.parametrize("layers", [[1], [0, 1, 2], [0, 4], [-1, 2]])
def test_init_from_teacher_refuses_the_wrong_count_or_a_missing_block(layers: list[int]) -> None:
    with pytest.raises(UserCodeError) as e:
        init_from_teacher(_bert(2, seed=1), _bert(4, seed=0), layers)
    assert f"distill.init_layers = {layers}" in str(e.value)
    assert "2 blocks" in str(e.value) and "0..3" in str(e.value), str(e.value)


# -------------------------------------------------------------- the combined objective


def _w(**kw) -> Weights:
    base = dict(
        alpha=0.0, temperature=1.0, hidden=0.0, attention=0.0, cosine=0.0, cosine_on="pooled"
    )
    return Weights(**{**base, **kw})


def _loss(kind: str, w: Weights, layer_map=(), hard=cross_entropy):
    return distillation_loss(
        hard if kind != "encode" else None,
        teacher=None,
        weights=w,
        needs=Needs(False, False, (), ()),
        layer_map=list(layer_map),
        task_kind=kind,
    )


def _ce(logits: list[float], label: int) -> float:
    return -_log_softmax(logits)[label]


def test_classification_loss_is_one_minus_alpha_ce_plus_alpha_t2_kl() -> None:
    s = _t([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]])
    t = _t([[3.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    labels = torch.tensor([0, 2])
    batch = Batch(
        inputs=torch.zeros(2, 4), targets=labels, count=2, tokens=0, teacher={"logits": t}
    )
    out = StudentOutput(logits=s, last_hidden=None)
    ce = _ce(s[0].tolist(), 0) + _ce(s[1].tolist(), 2)
    kl = _kl(s[0].tolist(), t[0].tolist(), 2.0) + _kl(s[1].tolist(), t[1].tolist(), 2.0)

    for alpha in (0.0, 0.3, 1.0):
        total, count = _loss("classification", _w(alpha=alpha, temperature=2.0))(out, batch)
        assert count == 2
        assert float(total) == pytest.approx((1 - alpha) * ce + alpha * 4 * kl, rel=1e-12), alpha


def test_alpha_one_never_reads_the_labels() -> None:
    def no_hard(output, batch):
        raise AssertionError("alpha = 1 computed the hard loss")

    s, t = _t([[1.0, 0.0, -1.0]]), _t([[0.0, 2.0, 0.0]])
    batch = Batch(
        inputs=torch.zeros(1, 4),
        targets=torch.tensor([1]),
        count=1,
        tokens=0,
        teacher={"logits": t},
    )
    total, _ = _loss("classification", _w(alpha=1.0, temperature=3.0), hard=no_hard)(
        StudentOutput(logits=s, last_hidden=None), batch
    )
    assert float(total) == pytest.approx(9 * _kl(s[0].tolist(), t[0].tolist(), 3.0), rel=1e-12)


def test_cached_top_k_logits_and_cosine_on_logits() -> None:
    s = _t([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]])
    values, index = _t([[3.0, 1.0], [1.0, 0.0]]), torch.tensor([[0, 1], [2, 0]])
    batch = Batch(
        inputs=torch.zeros(2, 4),
        targets=torch.tensor([0, 2]),
        count=2,
        tokens=0,
        teacher={"logits": values, "logits_index": index},
    )
    out = StudentOutput(logits=s, last_hidden=None)
    kl = sum(_kl(s[b].tolist(), values[b].tolist(), 2.0, index[b].tolist()) for b in range(2))

    total, _ = _loss("classification", _w(alpha=1.0, temperature=2.0))(out, batch)
    assert float(total) == pytest.approx(4 * kl, rel=1e-12)

    full = _t([[3.0, 3.0, 0.0], [-2.0, 1.0, 0.0]])
    batch = Batch(
        inputs=torch.zeros(2, 4),
        targets=torch.tensor([0, 2]),
        count=2,
        tokens=0,
        teacher={"logits": full},
    )
    total, _ = _loss("classification", _w(alpha=0.0, cosine=0.5, cosine_on="logits"))(out, batch)
    cos = sum(1 - _cosine(s[b].tolist(), full[b].tolist()) for b in range(2))
    ce = _ce(s[0].tolist(), 0) + _ce(s[1].tolist(), 2)
    assert float(total) == pytest.approx(ce + 0.5 * cos, rel=1e-12)


def test_language_model_loss_skips_ignored_tokens_in_both_terms() -> None:
    s = _t([[[1.0, 0.0, 0.0], [0.0, 2.0, 1.0]], [[0.5, 0.5, 0.0], [3.0, 1.0, 0.0]]])
    t = _t([[[0.0, 1.0, 0.0], [9.0, -9.0, 1.0]], [[2.0, 0.0, 1.0], [0.0, 0.0, 4.0]]])
    targets = torch.tensor([[2, IGNORE_INDEX], [0, 1]])
    batch = Batch(
        inputs=torch.zeros(2, 2, dtype=torch.long),
        targets=targets,
        count=3,
        tokens=4,
        teacher={"logits": t},
    )
    real = [(0, 0, 2), (1, 0, 0), (1, 1, 1)]
    ce = sum(_ce(s[b, i].tolist(), y) for b, i, y in real)
    kl = sum(_kl(s[b, i].tolist(), t[b, i].tolist(), 2.0) for b, i, _ in real)

    total, count = _loss("lm", _w(alpha=0.25, temperature=2.0))(
        StudentOutput(logits=s, last_hidden=None), batch
    )

    assert count == 3
    assert float(total) == pytest.approx(0.75 * ce + 0.25 * 4 * kl, rel=1e-12)


def test_language_model_cosine_on_logits_skips_ignored_tokens() -> None:
    """The cosine on an LM's logits counts the tokens the hard loss and the KL count (targets
    not -100), which the step's count (target tokens) normalises; an ignored position (here
    with logits opposite to the teacher's: cosine -1) adds nothing."""
    s = _t([[[1.0, 0.0, 0.0], [0.0, 2.0, 1.0]], [[0.5, 0.5, 0.0], [3.0, 1.0, 0.0]]])
    t = _t([[[0.0, 1.0, 0.0], [0.0, -2.0, -1.0]], [[2.0, 0.0, 1.0], [0.0, 0.0, 4.0]]])
    targets = torch.tensor([[2, IGNORE_INDEX], [0, 1]])
    batch = Batch(
        inputs=torch.zeros(2, 2, dtype=torch.long),
        targets=targets,
        count=3,
        tokens=4,
        teacher={"logits": t},
    )
    real = [(0, 0, 2), (1, 0, 0), (1, 1, 1)]
    ce = sum(_ce(s[b, i].tolist(), y) for b, i, y in real)
    cos = sum(1 - _cosine(s[b, i].tolist(), t[b, i].tolist()) for b, i, _ in real)

    total, count = _loss("lm", _w(alpha=0.0, cosine=0.5, cosine_on="logits"))(
        StudentOutput(logits=s, last_hidden=None), batch
    )

    assert count == 3
    assert float(total) == pytest.approx(ce + 0.5 * cos, rel=1e-12)


def test_loss_terms_are_the_unweighted_parts_of_the_loss() -> None:
    """`loss_fn.terms` sums each term over the calls since the last take: what the training
    and eval records log as hard_loss and distill/* (divided by the loss's count)."""
    s = _t([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]])
    t = _t([[3.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    batch = Batch(
        inputs=torch.zeros(2, 4),
        targets=torch.tensor([0, 2]),
        count=2,
        tokens=0,
        teacher={"logits": t},
    )
    out = StudentOutput(logits=s, last_hidden=None)
    ce = _ce(s[0].tolist(), 0) + _ce(s[1].tolist(), 2)
    kl = 4 * (_kl(s[0].tolist(), t[0].tolist(), 2.0) + _kl(s[1].tolist(), t[1].tolist(), 2.0))
    cos = sum(1 - _cosine(s[b].tolist(), t[b].tolist()) for b in range(2))
    fn = _loss("classification", _w(alpha=0.3, temperature=2.0, cosine=0.5, cosine_on="logits"))

    assert fn.terms.names == ("hard_loss", "distill/kl", "distill/cosine")
    total = sum(float(fn(out, batch)[0]) for _ in range(2))  # two calls: the sums add
    terms = take_terms(fn)

    assert terms == pytest.approx(
        {"hard_loss": 2 * ce, "distill/kl": 2 * kl, "distill/cosine": 2 * cos}, rel=1e-12
    )
    assert total == pytest.approx(
        0.7 * terms["hard_loss"] + 0.3 * terms["distill/kl"] + 0.5 * terms["distill/cosine"],
        rel=1e-12,
    )
    assert take_terms(fn) == {"hard_loss": 0.0, "distill/kl": 0.0, "distill/cosine": 0.0}
    assert take_terms(cross_entropy) == {}  # a loss without terms
    encoder = _loss(
        "encode", _w(alpha=0.5, hidden=2.0, attention=3.0, cosine=0.5), layer_map=[0, 2, 4]
    )
    assert encoder.terms.names == ("distill/hidden", "distill/attention", "distill/cosine")


@pytest.mark.parametrize(
    "weights, expect",
    [
        (dict(), "distill.cosine_weight = 0.0"),  # the defaults: alpha alone, no encoder term
        (dict(cosine=1.0, cosine_on="logits"), "distill.cosine_on = 'pooled'"),
    ],
)
def test_encoder_weights_that_give_no_loss_are_refused(weights: dict, expect: str) -> None:
    """Sentence data with the default [distill] weights: the loss would be a constant zero
    with no gradient (the first backward raised a traceback); build_distillation refuses it
    like the launcher does (distill/checks.py)."""
    from scaletrain.config import Config
    from scaletrain.distill.build import build_distillation
    from scaletrain.distill.checks import encoder_loss_problem

    cosine, cosine_on = weights.get("cosine", 0.0), weights.get("cosine_on", "pooled")
    assert expect in encoder_loss_problem(
        hidden=0.0, attention=0.0, cosine=cosine, cosine_on=cosine_on
    )
    assert encoder_loss_problem(hidden=0.0, attention=0.0, cosine=1.0, cosine_on="pooled") is None
    config = Config.model_validate(
        {"distill": {"teacher": "unread", "cosine_weight": cosine, "cosine_on": cosine_on}}
    )
    with pytest.raises(UserCodeError, match=re.escape(expect)):
        build_distillation(
            config,
            _bert(2, seed=1),
            task=TaskSpec("encode", (4,), 30522),
            hard=None,
            precision=None,
        )


def _encode_case(seed: int = 0):
    """A 2-layer student mapped to teacher states [0, 2, 4], with every teacher output."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = StudentOutput(
        logits=None,
        last_hidden=r(2, 3, 4),
        hidden={m: r(2, 3, 4) for m in range(3)},
        attentions={m: r(2, 2, 3, 3).softmax(-1) for m in (1, 2)},
    )
    teacher = {
        "pooled": r(2, 4),
        **{f"hidden.{i}": r(2, 3, 4) for i in (0, 1, 2, 3, 4)},
        **{f"attn.{i}": r(2, 2, 3, 3).softmax(-1) for i in (1, 2, 3, 4)},
    }
    batch = Batch(
        inputs=torch.zeros(2, 3, dtype=torch.long),
        targets=torch.zeros(2, dtype=torch.long),
        count=2,
        tokens=0,
        extras={"attention_mask": mask},
        teacher=teacher,
    )
    return out, batch, mask


def test_encoder_loss_adds_cosine_hidden_and_attention_with_their_weights() -> None:
    out, batch, mask = _encode_case()
    tl, m = batch.teacher, mask.tolist()
    cos = sum(
        1 - _cosine(p, q)
        for p, q in zip(_mean_pool(out.last_hidden.tolist(), m), tl["pooled"].tolist())
    )
    hid = sum(
        _hidden_mse(out.hidden[k].tolist(), tl[f"hidden.{g}"].tolist(), m)
        for k, g in enumerate([0, 2, 4])
    )
    att = sum(
        _attention_mse(out.attentions[k].tolist(), tl[f"attn.{g}"].tolist(), m)
        for k, g in [(1, 2), (2, 4)]
    )
    w = _w(alpha=0.5, hidden=2.0, attention=3.0, cosine=0.5)

    total, count = _loss("encode", w, layer_map=[0, 2, 4])(out, batch)

    assert count == 2
    assert float(total) == pytest.approx(0.5 * cos + 2.0 * hid + 3.0 * att, rel=1e-12)
    for only, value in [
        (dict(cosine=1.0), cos),
        (dict(hidden=1.0), hid),
        (dict(attention=1.0), att),
    ]:
        got, _ = _loss("encode", _w(**only), layer_map=[0, 2, 4])(out, batch)
        assert float(got) == pytest.approx(value, rel=1e-12), only


def test_encoder_loss_is_additive_over_examples() -> None:
    out, batch, _ = _encode_case(seed=3)
    fn = _loss("encode", _w(hidden=2.0, attention=3.0, cosine=0.5), layer_map=[0, 2, 4])

    def half(rows: slice) -> float:
        part = StudentOutput(
            logits=None,
            last_hidden=out.last_hidden[rows],
            hidden={k: v[rows] for k, v in out.hidden.items()},
            attentions={k: v[rows] for k, v in out.attentions.items()},
        )
        b = Batch(
            inputs=batch.inputs[rows],
            targets=batch.targets[rows],
            count=1,
            tokens=0,
            extras={k: v[rows] for k, v in batch.extras.items()},
            teacher={k: v[rows] for k, v in batch.teacher.items()},
        )
        return float(fn(part, b)[0])

    assert half(slice(0, 1)) + half(slice(1, 2)) == pytest.approx(
        float(fn(out, batch)[0]), rel=1e-12
    )


# ---------------------------------------------------------------------------- Distilled


def test_projections_are_the_identity_when_the_widths_are_equal() -> None:
    student = _bert(2, seed=1)
    student.set_attn_implementation("eager")  # sdpa returns no attention maps
    net = Distilled(
        student,
        layer_map=[0, 2, 4],
        teacher_width=32,
        hidden=True,
        attentions=True,
        hugging_face=True,
    )
    ids = torch.tensor([[3, 7, 9, 1], [4, 4, 2, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])

    assert len(net.proj) == 3
    for proj in net.proj:
        assert torch.equal(proj.weight, torch.eye(32)) and not proj.bias.any()
    with torch.no_grad():
        out = net(ids, attention_mask=mask)
        own = student(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    assert sorted(out.hidden) == [0, 1, 2] and sorted(out.attentions) == [1, 2]
    for m in range(3):
        assert torch.equal(out.hidden[m], own.hidden_states[m]), m
    assert torch.equal(out.attentions[2], own.attentions[1])
    assert out.logits is None and torch.equal(out.last_hidden, own.last_hidden_state)


def test_distilled_parameters_include_the_projections() -> None:
    student = _bert(2, seed=1)
    net = Distilled(
        student,
        layer_map=[0, 2, 4],
        teacher_width=48,
        hidden=True,
        attentions=False,
        hugging_face=True,
    )
    params = {id(p) for p in net.parameters()}

    assert all(p.shape == (48, 32) for p in (proj.weight for proj in net.proj))
    assert {id(p) for proj in net.proj for p in proj.parameters()} <= params
    assert {id(p) for p in student.parameters()} <= params
    n_student = sum(p.numel() for p in student.parameters())
    assert sum(p.numel() for p in net.parameters()) == n_student + 3 * (32 * 48 + 48)
    # the run's model.safetensors holds the student alone
    bare, weights = student_weights(net, dict(net.state_dict()))
    assert bare is student and weights.keys() == student.state_dict().keys()
    without = Distilled(
        student, layer_map=[], teacher_width=0, hidden=False, attentions=False, hugging_face=True
    )
    assert sum(p.numel() for p in without.parameters()) == n_student


def _wrapped(*, meta: bool, teacher_width: int, seed: int = 7) -> Distilled:
    """A 2-layer BERT student built by the registry (on meta or real) in its wrapper."""
    from scaletrain.models import build_model

    student = build_model(
        "hf",
        size="tiny",
        task=TaskSpec("encode", (8,), 50),
        hf_config="BertConfig",
        kwargs=dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=37,
            vocab_size=50,
            max_position_embeddings=16,
        ),
        seed=seed,
        meta=meta,
    )
    return Distilled(
        student,
        layer_map=[0, 1, 2],
        teacher_width=teacher_width,
        hidden=True,
        attentions=False,
        hugging_face=True,
        seed=seed,
    )


@pytest.mark.parametrize("teacher_width", [32, 48])
def test_a_meta_student_and_a_real_one_start_from_the_same_values(teacher_width: int) -> None:
    """The trainer builds a student on meta and materialises it by models/init.py's module
    rule, or (distill.init_layers, a user model that cannot be) builds it real: both give
    every tensor the same bits. The projections are Distilled.init_module's draw from
    (train.seed, "proj.i"): torch's default Linear init, the identity and a zero bias when
    the widths are equal; the student's own tensors are those it has built alone."""
    from torch import nn

    from scaletrain.models.init import init_plan, is_meta, materialize, module_seed

    real = _wrapped(meta=False, teacher_width=teacher_width)
    meta = _wrapped(meta=True, teacher_width=teacher_width)
    assert is_meta(meta) and not is_meta(real)
    materialize([meta], plan=init_plan(meta), seed=7, device=torch.device("cpu"))

    got, want = meta.state_dict(), real.state_dict()
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    # The student draws under its own names: a wrapped student starts as it would alone.
    alone = _wrapped(meta=False, teacher_width=teacher_width).student.state_dict()
    assert all(torch.equal(got[f"student.{k}"], v) for k, v in alone.items())
    for i, proj in enumerate(meta.proj):
        torch.manual_seed(module_seed(7, f"proj.{i}"))
        default = nn.Linear(32, teacher_width)  # torch's own init under the module's seed
        if teacher_width == 32:
            assert torch.equal(proj.weight, torch.eye(32)) and not proj.bias.any()
        else:
            assert torch.equal(proj.weight, default.weight.detach())
            assert torch.equal(proj.bias, default.bias.detach())
    assert not torch.equal(meta.proj[0].weight, meta.proj[1].weight) or teacher_width == 32


# ------------------------------------------------------------------------ cache helpers


def _dataset(inputs: torch.Tensor, targets: torch.Tensor) -> ArrayDataset:
    return ArrayDataset(inputs, targets, spec=TaskSpec("classification", (2,), 3))


def test_data_fingerprint_sees_one_changed_value() -> None:
    inputs = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    targets = torch.tensor([0, 1, 2, 0, 1])
    base = kd_cache.data_fingerprint(_dataset(inputs, targets))

    assert kd_cache.data_fingerprint(_dataset(inputs.clone(), targets.clone())) == base
    nudged = inputs.clone()
    nudged[3, 1] = torch.nextafter(nudged[3, 1], torch.tensor(100.0))  # one ulp
    assert kd_cache.data_fingerprint(_dataset(nudged, targets)) != base
    relabelled = targets.clone()
    relabelled[4] = 2
    assert kd_cache.data_fingerprint(_dataset(inputs, relabelled)) != base
    order = torch.tensor([1, 0, 2, 3, 4])
    assert kd_cache.data_fingerprint(_dataset(inputs[order], targets[order])) != base
    assert kd_cache.data_fingerprint(_dataset(inputs[:4], targets[:4])) != base


def test_top_k_keeps_the_largest_logits_and_their_classes() -> None:
    logits = _t([[0.1, 3.0, -1.0, 2.0], [5.0, 0.0, 1.0, 4.0]])
    out = kd_cache._top_k({"logits": logits, "pooled": _t([[1.0], [2.0]])}, 2)

    assert out["logits"].tolist() == [[3.0, 2.0], [5.0, 4.0]]
    assert out["logits_index"].tolist() == [[1, 3], [0, 3]]
    assert out["pooled"].tolist() == [[1.0], [2.0]]
    for k in (0, 4, 9):  # all kept: no index
        assert set(kd_cache._top_k({"logits": logits}, k)) == {"logits"}
    assert kd_cache._top_k({"pooled": logits}, 2).keys() == {"pooled"}


def test_cache_round_trip_and_its_refusals(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    ds = _dataset(torch.randn(6, 2, generator=g), torch.tensor([0, 1, 2, 0, 1, 2]))
    teacher_logits = torch.randn(6, 3, generator=g, dtype=F64)
    targets_fn = lambda b: {"logits": teacher_logits[: len(b.targets)] + b.inputs[:, :1]}  # noqa
    info = {
        "teacher_sha256": "ab" * 32,
        "teacher_dtype": "float64",
        "teacher_layers": 0,
        "teacher_width": 0,
    }
    kd_cache.write_cache(
        tmp_path / "c",
        splits={"train": ds},
        targets_fn=targets_fn,
        info=info,
        top_k=0,
        report=lambda line: None,
    )

    cached = kd_cache.with_cache(
        ds,
        str(tmp_path / "c"),
        split="train",
        needs_keys=["logits"],
        teacher_sha256="ab" * 32,
        teacher_dtype="float64",
    )
    rows = torch.tensor([4, 1])
    got = cached.get(rows)
    assert torch.equal(got.teacher["logits"], targets_fn(ds.get(torch.arange(6)))["logits"][rows])
    assert got.teacher["logits"].dtype == F64 and torch.equal(got.inputs, ds.get(rows).inputs)

    other = _dataset(ds.inputs.clone(), ds.targets.flip(0))
    refusals = [
        (dict(ds=other), "the data changed"),
        (dict(teacher_sha256="cd" * 32), "another teacher"),
        (dict(teacher_dtype="float32"), "float64"),
        (dict(needs_keys=["logits", "pooled"]), "lacks the teacher outputs ['pooled']"),
        (dict(split="eval"), "no 'eval' split"),
    ]
    for change, want in refusals:
        kw = {
            **dict(
                cache_dir=str(tmp_path / "c"),
                split="train",
                ds=ds,
                needs_keys=["logits"],
                teacher_sha256="ab" * 32,
                teacher_dtype="float64",
            ),
            **change,
        }
        with pytest.raises(kd_cache.CacheError, match=want.replace("[", r"\[")):
            kd_cache.check_cache(kd_cache.read_info(tmp_path / "c"), **kw)
    with pytest.raises(kd_cache.CacheError, match="already holds a cache"):
        kd_cache.write_cache(
            tmp_path / "c",
            splits={"train": ds},
            targets_fn=targets_fn,
            info=info,
            top_k=0,
            report=lambda line: None,
        )


# ------------------------------------------------------------------------------ teacher


def test_weights_sha256_of_one_file_and_of_several(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"abc")
    (tmp_path / "b").write_bytes(b"xyz" * 2_000_000)  # more than one read chunk
    abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2

    assert weights_sha256([tmp_path / "a"]) == abc
    b = hashlib.sha256(b"xyz" * 2_000_000).hexdigest()
    assert weights_sha256([tmp_path / "b"]) == b
    both = weights_sha256([tmp_path / "a", tmp_path / "b"])
    assert both == hashlib.sha256((abc + b).encode()).hexdigest()
    assert weights_sha256([tmp_path / "b", tmp_path / "a"]) != both


@pytest.fixture
def mlp_run_dir(tmp_path: Path):
    """A scaletrain run directory written by hand: config.toml + model.safetensors."""
    from safetensors.torch import save_file

    from scaletrain.config import Config, config_to_toml
    from scaletrain.models import build_model

    task = TaskSpec("classification", (1, 8, 8), 10)
    config = Config.model_validate(
        {"model": {"name": "mlp", "size": "tiny"}, "data": {"source": "digits"}}
    )
    torch.manual_seed(5)
    model = build_model("mlp", size="tiny", task=task)
    run = tmp_path / "teacher"
    run.mkdir()
    (run / "config.toml").write_text(config_to_toml(config))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(run / "model.safetensors")
    )
    return run, task, model


def test_load_teacher_refuses_another_sha256_naming_both(mlp_run_dir) -> None:
    run, task, _ = mlp_run_dir
    actual = weights_sha256([run / "model.safetensors"])
    wrong = "0123456789abcdef" * 4

    with pytest.raises(TeacherError) as e:
        load_teacher(str(run), task=task, expected_sha256=wrong)

    message = str(e.value)
    assert actual[:16] in message and wrong[:16] in message, message
    assert f"distill.teacher = {str(run)!r}" in message and "refusing" in message


def test_a_checkpoint_teacher_is_pinned_before_its_metadata_is_read(
    mlp_run_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint teacher's SHA-256 is over its files as they lie: a wrong pin is refused
    with nothing unpickled; the right pin loads it, the model the checkpoint holds."""
    from scaletrain.checkpoint import Checkpointer, TrainState
    from scaletrain.checkpoint.files import MANIFEST, _MetadataUnpickler
    from scaletrain.distill.teacher import teacher_sha256
    from scaletrain.precision import make_precision
    from scaletrain.training.optim import build_optimizer, build_scheduler

    run, task, model = mlp_run_dir
    opt = build_optimizer(
        model, name="sgd", lr=0.1, weight_decay=0.0, betas=(0.9, 0.999), momentum=0.0
    )
    state = TrainState(
        model,
        opt,
        build_scheduler(opt, warmup_steps=0, total_steps=1, schedule="constant", min_lr_ratio=1),
        make_precision("fp32", device_type="cpu"),
    )
    Checkpointer(run / "checkpoints", keep=1, async_save=False, config_toml="").save(state)
    step = next((run / "checkpoints").iterdir())
    files = sorted(p for p in step.iterdir() if p.name != MANIFEST)
    sha, wrong = weights_sha256(files), "0123456789abcdef" * 4
    loads = []
    original = _MetadataUnpickler.load
    monkeypatch.setattr(_MetadataUnpickler, "load", lambda self: loads.append(1) or original(self))

    for refused in (
        lambda: teacher_sha256(str(step), expected_sha256=wrong),
        lambda: load_teacher(str(step), task=task, expected_sha256=wrong),
    ):
        with pytest.raises(TeacherError, match="refusing"):
            refused()
    assert loads == [], "the metadata was unpickled before the pin was checked"
    assert teacher_sha256(str(step), expected_sha256=sha) == sha
    teacher = load_teacher(str(step), task=task, expected_sha256=sha)
    assert teacher.sha256 == sha and loads
    state = teacher.module.state_dict()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_load_teacher_with_its_sha256_is_the_frozen_run(mlp_run_dir) -> None:
    run, task, model = mlp_run_dir
    sha = weights_sha256([run / "model.safetensors"])

    teacher = load_teacher(
        str(run), task=task, expected_sha256=sha.upper(), load_dtype=torch.float64
    )

    assert teacher.sha256 == sha and teacher.dtype == F64 and not teacher.module.training
    state = teacher.module.state_dict()
    assert all(torch.equal(state[k], v.double()) for k, v in model.state_dict().items())
    assert not any(p.requires_grad for p in teacher.module.parameters())


def test_a_run_teacher_on_meta_is_placed_as_the_whole_load(mlp_run_dir) -> None:
    """load_teacher(meta=True) of a run directory builds its model on meta and locates its
    weights in model.safetensors (WEIGHTS_ATTR), reading none; place_teacher then reads them
    (here every slice: no mesh) and holds the whole load's bits. float64 weights that float32
    cannot hold stay unrounded in both. A file short of a tensor is refused at load."""
    from safetensors.torch import save_file

    from scaletrain.distill.teacher import place_teacher
    from scaletrain.models.init import WEIGHTS_ATTR, is_meta

    run, task, model = mlp_run_dir
    g = torch.Generator().manual_seed(0)
    state = {
        k: (v.double() + 1e-12 * torch.randn(v.shape, generator=g, dtype=F64)).contiguous()
        for k, v in model.state_dict().items()
    }
    save_file(state, str(run / "model.safetensors"))
    whole = load_teacher(str(run), task=task, load_dtype=F64)
    lazy = load_teacher(str(run), task=task, load_dtype=F64, meta=True)

    assert is_meta(lazy.module) and not is_meta(whole.module)
    assert getattr(lazy.module, WEIGHTS_ATTR).names == set(state)
    assert lazy.sha256 == whole.sha256
    place_teacher(lazy, device=torch.device("cpu"))
    got = lazy.module.state_dict()
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert all(torch.equal(whole.module.state_dict()[k], v) for k, v in state.items())
    assert lazy.weights_read == sum(v.numel() * 8 for v in state.values())
    assert not lazy.module.training and not any(p.requires_grad for p in lazy.module.parameters())

    dropped = sorted(state)[0]
    save_file({k: v for k, v in state.items() if k != dropped}, str(run / "model.safetensors"))
    with pytest.raises(TeacherError, match=f"missing {re.escape(dropped)}"):
        load_teacher(str(run), task=task, load_dtype=F64, meta=True)


def test_the_launcher_checks_a_big_distillation_on_the_meta_device(
    mlp_run_dir, monkeypatch
) -> None:
    """Above CHECK_ON_META_BYTES (the student's tensors plus the teacher's weight files)
    check_user_code builds the student and the teacher on meta and runs the student, the
    teacher and the distillation loss there: no weight is read or drawn. Below it, real."""
    from scaletrain.config import Config
    from scaletrain.distill.teacher import weight_file_bytes
    from scaletrain.models import init as model_init
    from scaletrain.models.init import is_meta
    from scaletrain.training import assemble

    run, _, _ = mlp_run_dir
    config = Config.model_validate(
        {
            "model": {"name": "mlp", "size": "tiny"},
            "data": {"source": "digits"},
            "distill": {"teacher": str(run), "alpha": 0.5},
        }
    )
    assert weight_file_bytes(str(run)) == (run / "model.safetensors").stat().st_size
    built, fits = [], []

    def objective(*args, **kwargs):
        out = real_objective(*args, **kwargs)
        built.append((is_meta(out[0]), is_meta(out[2].teacher.module)))
        return out

    def fit(model, batch, **kwargs):
        real_fit(model, batch, **kwargs)  # raises on failure: nothing fell back
        fits.append((batch.inputs.device.type, kwargs["loss_fn"] is not None))

    def no_reading(*args, **kwargs):
        raise AssertionError("a weight was read or drawn on the meta check")

    real_objective, real_fit = assemble.build_objective, assemble.check_fit
    monkeypatch.setattr(assemble, "build_objective", objective)
    monkeypatch.setattr(assemble, "check_fit", fit)
    assemble.check_user_code(config)
    assert (built, fits) == ([(False, False)], [("cpu", True)])  # small: real

    built.clear(), fits.clear()
    monkeypatch.setattr(assemble, "CHECK_ON_META_BYTES", 0)
    monkeypatch.setattr(model_init, "materialize", no_reading)
    monkeypatch.setattr(model_init.WeightFiles, "read_into", no_reading)
    assemble.check_user_code(config)
    assert (built, fits) == ([(True, True)], [("meta", True)])  # teacher and loss on meta


# ----------------------------------------------------------------------------- layering


def test_sentences_data_import_nothing_from_distill_or_models() -> None:
    """data/ sits below the techniques and the models: data/sentences.py takes its tokenizer
    directory as a plain value from the caller (distill/build.sentence_tokenizer_dir), and
    imports neither distill/ (the packaged teacher's directory) nor models/ (which import
    data.sources: a cycle). Imports inside functions count too."""
    import scaletrain.data.sentences as sentences

    tree = ast.parse(Path(sentences.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    upward = sorted(
        m for m in imported if m.startswith(("scaletrain.distill", "scaletrain.models"))
    )
    assert not upward, f"data/sentences.py imports {upward}"


def test_a_sharded_splits_cache_is_checked_by_its_manifest(monkeypatch) -> None:
    """Parquet shards with a manifest: the cache's data check compares the manifest's
    fingerprint (every shard's SHA-256, checked when the shards open) and rehashes no row;
    another shard's hash is other data. Data without checksummed shards is rehashed."""
    from types import SimpleNamespace

    from scaletrain.data.manifest import ShardInfo

    def split(sha: str | None) -> SimpleNamespace:
        shards = (ShardInfo("part-00000.parquet", 6, 100, sha, (6,)),)
        return SimpleNamespace(
            spec=TaskSpec("classification", (2,), 3),
            manifest=SimpleNamespace(shards=shards),
        )

    class Sized(SimpleNamespace):
        def __len__(self) -> int:
            return 6

    ds, other = Sized(**vars(split("ab" * 32))), Sized(**vars(split("cd" * 32)))
    part = {"rows": 6, "data_sha256": "x", "manifest_sha256": kd_cache.manifest_fingerprint(ds)}

    def no_rehash(ds):
        raise AssertionError("a row was rehashed")

    monkeypatch.setattr(kd_cache, "data_fingerprint", no_rehash)
    assert kd_cache.same_data(part, ds)
    assert not kd_cache.same_data(part, other)
    assert kd_cache.manifest_fingerprint(Sized(**vars(split(None)))) is None
