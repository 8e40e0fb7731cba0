"""The two encoder terms of issue 46, with no process group: MiniLM's self-attention relation
loss and the in-batch contrastive loss, each against values worked out by hand, the relations
read from a real BERT against its own attention maps, the combined objective, the teacher's
outputs for the cache, and the refusals the build makes.

Expected values come from `math` on a few numbers, or from the plain-Python references below,
which loop over lists in the order the losses' docstrings define them.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from scaletrain.data.sources import Batch, TaskSpec  # noqa: E402
from scaletrain.distill.losses import (  # noqa: E402
    contrastive_loss,
    mean_pool,
    relation_kl,
    relation_log_probs,
    relation_loss,
)
from scaletrain.distill.objective import (  # noqa: E402
    Needs,
    Weights,
    distillation_loss,
    needs_of,
    take_terms,
    teacher_targets,
    term_names,
)
from scaletrain.distill.student import Distilled, StudentOutput, last_layer_qkv  # noqa: E402
from scaletrain.distill.teacher import Teacher  # noqa: E402
from scaletrain.user_code import UserCodeError  # noqa: E402

transformers = pytest.importorskip("transformers")

F64 = torch.float64


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# ------------------------------------------------------------- plain-Python references


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    e = [math.exp(v - top) for v in row]
    return [v / sum(e) for v in e]


def _relations(x, y, *, heads: int, real: list[int]) -> list[list[list[float]]]:
    """(T, D) lists -> [head][query][key] softmax(x_r . y_r / sqrt(d_r)) over real keys."""
    d = len(x[0]) // heads
    out = []
    for r in range(heads):
        cut = slice(r * d, (r + 1) * d)
        rows = []
        for q in range(len(x)):
            scores = [sum(a * b for a, b in zip(x[q][cut], y[k][cut])) / math.sqrt(d) for k in real]
            rows.append(_softmax(scores))
        out.append(rows)
    return out


def _relation_kl(s, t, *, real: list[int]) -> float:
    """Mean over heads and real query rows of KL(t || s) over the real keys."""
    heads = len(s)
    per_row = [
        sum(sum(p * math.log(p / q) for p, q in zip(t[r][i], s[r][i])) for r in range(heads))
        / heads
        for i in real
    ]
    return sum(per_row) / len(real)


def _relation_loss(student, teacher, *, heads: int, mask) -> float:
    """student, teacher: (q, k, v) each (B, T, D) lists; MiniLM's L_AT + L_VR summed over B."""
    total = 0.0
    for b in range(len(mask)):
        real = [i for i, m in enumerate(mask[b]) if m]
        (qs, ks, vs), (qt, kt, vt) = ([x[b] for x in student], [x[b] for x in teacher])
        total += _relation_kl(
            _relations(qs, ks, heads=heads, real=real),
            _relations(qt, kt, heads=heads, real=real),
            real=real,
        )
        total += _relation_kl(
            _relations(vs, vs, heads=heads, real=real),
            _relations(vt, vt, heads=heads, real=real),
            real=real,
        )
    return total


def _cos(u, v) -> float:
    dot = sum(a * b for a, b in zip(u, v))
    return dot / math.sqrt(sum(a * a for a in u) * sum(b * b for b in v))


def _info_nce(s, t, *, tau: float) -> float:
    """sum_i -log( exp(cos(s_i, t_i) / tau) / sum_j exp(cos(s_i, t_j) / tau) )."""
    total = 0.0
    for i in range(len(s)):
        logits = [_cos(s[i], t[j]) / tau for j in range(len(t))]
        total += -math.log(_softmax(logits)[i])
    return total


# ------------------------------------------------------------------- relation_log_probs


def test_relation_probabilities_of_one_head_by_hand() -> None:
    """x = [[1, 0], [0, 2]], y = [[1, 1], [2, 0]], one head of d = 2: the query row 0 scores
    (1 / sqrt 2, 2 / sqrt 2), row 1 (2 / sqrt 2, 0); with the second token padded, every
    row's one real key has probability 1 and the padded key 0."""
    x, y = _t([[[1.0, 0.0], [0.0, 2.0]]]), _t([[[1.0, 1.0], [2.0, 0.0]]])
    r2 = math.sqrt(2)

    p = relation_log_probs(x, y, heads=1, mask=None).exp()[0, 0]  # (T, T)

    e = math.exp
    want = [
        [e(1 / r2) / (e(1 / r2) + e(2 / r2)), e(2 / r2) / (e(1 / r2) + e(2 / r2))],
        [e(2 / r2) / (e(2 / r2) + 1), 1 / (e(2 / r2) + 1)],
    ]
    assert sum(want, []) == pytest.approx(p.flatten().tolist(), rel=1e-12)
    padded = relation_log_probs(x, y, heads=1, mask=torch.tensor([[1, 0]])).exp()[0, 0]
    assert padded.tolist() == [[1.0, 0.0], [1.0, 0.0]]


def test_relation_heads_are_contiguous_slices_of_the_width() -> None:
    """Two heads of d = 2 on x = [[1, 2, 0, 1], [3, 0, 1, 1]] (x x^T): head 0 reads columns
    0-1 (dot products 5, 3; 3, 9), head 1 columns 2-3 (1, 1; 1, 2), each over sqrt 2, as a
    BERT layer cuts its heads (interleaved columns would give other numbers)."""
    x = _t([[[1.0, 2.0, 0.0, 1.0], [3.0, 0.0, 1.0, 1.0]]])
    r2 = math.sqrt(2)

    p = relation_log_probs(x, x, heads=2, mask=None).exp()[0]  # (R, T, T)

    head0 = [*_softmax([5 / r2, 3 / r2]), *_softmax([3 / r2, 9 / r2])]
    head1 = [*_softmax([1 / r2, 1 / r2]), *_softmax([1 / r2, 2 / r2])]
    assert p.flatten().tolist() == pytest.approx(head0 + head1, rel=1e-12)


def test_relation_kl_of_two_rows_by_hand() -> None:
    """One head, two real tokens: the teacher's rows (1/2, 1/2) and (1/4, 3/4), the student's
    (1/4, 3/4) and (1/2, 1/2); KL per row then the mean over the two rows."""
    t = _t([[[[0.5, 0.5], [0.25, 0.75]]]]).log()
    s = _t([[[[0.25, 0.75], [0.5, 0.5]]]]).log()
    row0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    row1 = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)

    got = relation_kl(s, t, mask=None)

    assert float(got) == pytest.approx((row0 + row1) / 2, rel=1e-12)
    assert float(relation_kl(t, t, mask=None)) == 0.0


# ------------------------------------------------------------------------ relation_loss


def _relation_case(seed: int = 0, *, student_width: int = 4, teacher_width: int = 6):
    """Two examples of 3 tokens (the second with one padded), two relation heads, a student
    of width 4 and a teacher of width 6: the relations are T x T whatever the widths."""
    g = torch.Generator().manual_seed(seed)
    student = tuple(torch.randn(2, 3, student_width, generator=g, dtype=F64) for _ in range(3))
    teacher = tuple(torch.randn(2, 3, teacher_width, generator=g, dtype=F64) for _ in range(3))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return student, teacher, mask


def test_relation_loss_is_minilms_attention_plus_value_kl_per_example() -> None:
    student, teacher, mask = _relation_case()
    want = _relation_loss(
        [x.tolist() for x in student], [x.tolist() for x in teacher], heads=2, mask=mask.tolist()
    )

    got = relation_loss(student, teacher, heads=2, mask=mask)

    assert float(got) == pytest.approx(want, rel=1e-12)
    assert float(relation_loss(teacher, teacher, heads=2, mask=mask)) == pytest.approx(0, abs=1e-15)
    # a sum over examples: the halves add up to the whole
    halves = [
        relation_loss(
            tuple(x[i : i + 1] for x in student),
            tuple(x[i : i + 1] for x in teacher),
            heads=2,
            mask=mask[i : i + 1],
        )
        for i in (0, 1)
    ]
    assert float(sum(halves)) == pytest.approx(float(got), rel=1e-12)


def test_relation_loss_ignores_padded_tokens_and_keeps_gradients_finite() -> None:
    """The padded token's query, key and value (any values) change neither the loss nor the
    real tokens' gradients, and no gradient is NaN (a padded key is -inf in both log-probs)."""
    student, teacher, mask = _relation_case(seed=1)

    def run(fill: float):
        s = tuple(x.clone() for x in student)
        t = tuple(x.clone() for x in teacher)
        for x in (*s, *t):
            x[1, 2] = fill  # the padded token of example 1
        s = tuple(x.requires_grad_() for x in s)
        loss = relation_loss(s, t, heads=2, mask=mask)
        loss.backward()
        return float(loss.detach()), [x.grad for x in s]

    (a, grads_a), (b, grads_b) = run(0.0), run(1e3)

    assert a == pytest.approx(b, rel=1e-12)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.isfinite(ga).all() and torch.isfinite(gb).all()
        assert torch.allclose(ga[0], gb[0], rtol=1e-10) and torch.allclose(ga[1, :2], gb[1, :2])
        assert not ga[1, 2].any() and not gb[1, 2].any()  # nothing reaches the padded token


def _bert(layers: int, *, hidden: int = 32, heads: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=37,
        vocab_size=50,
        max_position_embeddings=16,
    )
    return transformers.BertModel(cfg).double().eval()


IDS = torch.tensor([[3, 7, 9, 1], [4, 4, 2, 0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])


def test_the_students_relations_are_its_own_last_attention_maps() -> None:
    """Distilled(relations=True) catches the last layer's query, key and value exactly: with
    R = its heads, softmax(Q K^T / sqrt(d)) over the real keys is the attention map BERT
    itself returns (eager), for every real query row; under sdpa (no maps) the same Q, K, V."""
    student = _bert(2, heads=4, seed=1)
    student.set_attn_implementation("eager")
    net = Distilled(
        student,
        layer_map=[],
        teacher_width=0,
        hidden=False,
        attentions=False,
        hugging_face=True,
        relations=True,
    )
    with torch.no_grad():
        out = net(IDS, attention_mask=MASK)
        own = student(IDS, attention_mask=MASK, output_attentions=True).attentions[-1]

    assert sorted(out.qkv) == ["key", "query", "value"]
    maps = relation_log_probs(out.qkv["query"], out.qkv["key"], heads=4, mask=MASK).exp()
    assert torch.allclose(maps[0], own[0], atol=1e-14)
    assert torch.allclose(maps[1, :, :3], own[1, :, :3], atol=1e-14)  # the real query rows
    student.set_attn_implementation("sdpa")
    with torch.no_grad():
        sdpa = net(IDS, attention_mask=MASK)
    assert all(torch.allclose(sdpa.qkv[k], out.qkv[k], atol=1e-14) for k in out.qkv)
    layer = student.encoder.layer[-1].attention.self
    assert last_layer_qkv(student) == (layer.query, layer.key, layer.value)
    # without the relation term no hook is set and nothing is returned
    plain = Distilled(
        student, layer_map=[], teacher_width=0, hidden=False, attentions=False, hugging_face=True
    )
    with torch.no_grad():
        assert plain(IDS, attention_mask=MASK).qkv == {}
    assert not layer.query._forward_hooks


def test_the_teachers_last_layer_projections_are_its_targets() -> None:
    """teacher_targets with the relation term: "query.last", "key.last", "value.last" are
    the teacher's last layer's Linear outputs (what the cache stores, (B, T, D) each), and
    "pooled" with the contrastive term; nothing else."""
    bert = _bert(3, hidden=24, heads=3)
    teacher = Teacher(module=bert, dtype=F64, sha256="", source="t", hugging_face=True)
    batch = Batch(
        inputs=IDS, targets=torch.zeros(2), count=2, tokens=0, extras={"attention_mask": MASK}
    )
    needs = needs_of(_w(relation=1.0, contrastive=1.0), task_kind="encode", layer_map=[])

    got = teacher_targets(teacher, batch, needs)

    assert needs.keys() == ["pooled", "query.last", "key.last", "value.last"]
    assert sorted(got) == sorted(needs.keys())
    layer = bert.encoder.layer[-1]
    with torch.no_grad():
        hidden = bert(IDS, attention_mask=MASK, output_hidden_states=True).hidden_states
        x = hidden[-2]  # the last layer's input
        for key, lin in zip(
            ("query", "key", "value"),
            (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value),
        ):
            assert got[f"{key}.last"].shape == (2, 4, 24)
            assert torch.allclose(got[f"{key}.last"], lin(x), atol=1e-14), key
        assert torch.allclose(got["pooled"], mean_pool(hidden[-1], MASK), atol=1e-14)
    assert not got["query.last"].is_inference()  # autograd may save it


def test_a_model_without_query_key_value_is_refused_by_name() -> None:
    """DistilBERT names its projections q_lin, k_lin, v_lin: the relation term cannot read it
    and says so, naming the key."""
    cfg = transformers.DistilBertConfig(
        vocab_size=50, dim=16, n_layers=2, n_heads=2, hidden_dim=20, max_position_embeddings=16
    )
    with pytest.raises(UserCodeError, match="distill.relation_weight") as e:
        last_layer_qkv(transformers.DistilBertModel(cfg))
    assert "query, key and value" in str(e.value)


# --------------------------------------------------------------------- contrastive_loss


def test_contrastive_loss_of_two_examples_by_hand() -> None:
    """s = [[1, 0], [0, 1]], t = [[1, 0], [1, 1]], tau = 0.5: cos(s0, t0) = 1, cos(s0, t1) =
    1/sqrt 2, cos(s1, t0) = 0, cos(s1, t1) = 1/sqrt 2; each row's -log softmax at its own
    teacher, summed."""
    s, t = _t([[1.0, 0.0], [0.0, 1.0]]), _t([[1.0, 0.0], [1.0, 1.0]])
    r = 1 / math.sqrt(2)
    row0 = math.log(math.exp(2) + math.exp(2 * r)) - 2
    row1 = math.log(math.exp(0) + math.exp(2 * r)) - 2 * r

    got = contrastive_loss(s, t, temperature=0.5)

    assert float(got) == pytest.approx(row0 + row1, rel=1e-12)
    # the scale of the embeddings does not matter (cosine), the temperature does
    assert float(contrastive_loss(3 * s, 0.5 * t, temperature=0.5)) == pytest.approx(
        row0 + row1, rel=1e-12
    )
    # tau = 1: the softer softmax gives the positives less of each row
    soft = math.log(math.exp(1) + math.exp(r)) - 1 + math.log(1 + math.exp(r)) - r
    assert float(contrastive_loss(s, t, temperature=1.0)) == pytest.approx(soft, rel=1e-12)
    assert soft > row0 + row1


def test_contrastive_loss_is_a_sum_of_rows_given_the_batchs_negatives() -> None:
    """Against the reference on 4 rows, and the property the step's normalisation needs:
    the gradient of student row i depends on row i and the batch's teacher rows only (they
    are constants); splitting the batch changes the negatives, so the halves do not add up
    to the whole (which is why distill/objective.py fixes the split: the micro-batch)."""
    g = torch.Generator().manual_seed(2)
    s = torch.randn(4, 5, generator=g, dtype=F64, requires_grad=True)
    t = torch.randn(4, 5, generator=g, dtype=F64)

    whole = contrastive_loss(s, t, temperature=0.1)
    whole.backward()

    want = _info_nce(s.tolist(), t.tolist(), tau=0.1)
    assert float(whole.detach()) == pytest.approx(want, rel=1e-12)
    halves = contrastive_loss(s[:2], t[:2], temperature=0.1) + contrastive_loss(
        s[2:], t[2:], temperature=0.1
    )
    assert abs(float(halves.detach()) - float(whole.detach())) > 1e-3
    row = s.detach()[1:2].clone().requires_grad_()  # row 1 alone, against the same 4 teachers
    alone = -(torch.nn.functional.cosine_similarity(row, t, dim=-1) / 0.1).log_softmax(-1)[1]
    alone.backward()
    assert torch.allclose(row.grad[0], s.grad[1], rtol=1e-12)


# ---------------------------------------------------------------- the combined objective


def _w(**kw) -> Weights:
    base = dict(
        alpha=0.0, temperature=1.0, hidden=0.0, attention=0.0, cosine=0.0, cosine_on="pooled"
    )
    return Weights(**{**base, **kw})


def test_the_new_terms_default_to_off_and_change_no_recipe() -> None:
    """relation_weight and contrastive_weight default to 0: a config without them has the
    terms, needs and cache keys it had (the MiniLM recipes' included)."""
    from pathlib import Path

    from scaletrain.config import DistillConfig, load_config
    from scaletrain.distill.build import weights_of

    d = DistillConfig()
    assert (d.relation_weight, d.contrastive_weight, d.contrastive_temperature) == (0, 0, 0.05)
    three = load_config(Path(__file__).parents[1] / "configs" / "distill-minilm-3.toml", [])
    w = weights_of(three)
    assert (w.relation, w.contrastive) == (0, 0)
    assert term_names(w, task_kind="encode") == ("distill/hidden", "distill/cosine")
    needs = needs_of(w, task_kind="encode", layer_map=[0, 1, 5, 6])
    assert needs.keys() == ["pooled", "hidden.0", "hidden.1", "hidden.5", "hidden.6"]


def test_encoder_loss_adds_relation_and_contrastive_with_their_weights() -> None:
    """The objective on cached targets: 0.5 x cosine + 2 x relation + 3 x contrastive (tau
    0.2), each term logged unweighted under its name; the student and teacher widths differ
    for the relation (4 and 6) and match for the pooled terms."""
    (qs, ks, vs), (qt, kt, vt), mask = _relation_case(seed=4)
    g = torch.Generator().manual_seed(5)
    last, pooled_t = (
        torch.randn(2, 3, 4, generator=g, dtype=F64),
        torch.randn(2, 4, generator=g, dtype=F64),
    )
    out = StudentOutput(logits=None, last_hidden=last, qkv={"query": qs, "key": ks, "value": vs})
    batch = Batch(
        inputs=torch.zeros(2, 3, dtype=torch.long),
        targets=torch.zeros(2, dtype=torch.long),
        count=2,
        tokens=0,
        extras={"attention_mask": mask},
        teacher={"pooled": pooled_t, "query.last": qt, "key.last": kt, "value.last": vt},
    )
    m = mask.tolist()
    pooled_s = [
        [sum(last[b, i, j].item() for i in range(3) if m[b][i]) / sum(m[b]) for j in range(4)]
        for b in range(2)
    ]
    cos = sum(1 - _cos(p, q) for p, q in zip(pooled_s, pooled_t.tolist()))
    rel = _relation_loss(
        [x.tolist() for x in (qs, ks, vs)], [x.tolist() for x in (qt, kt, vt)], heads=2, mask=m
    )
    nce = _info_nce(pooled_s, pooled_t.tolist(), tau=0.2)
    w = _w(cosine=0.5, relation=2.0, contrastive=3.0, contrastive_temperature=0.2)
    fn = distillation_loss(
        None,
        teacher=None,
        weights=w,
        needs=Needs(False, True, (), (), qkv=True),
        layer_map=[],
        task_kind="encode",
        relation_heads=2,
    )

    total, count = fn(out, batch)

    assert count == 2
    assert float(total) == pytest.approx(0.5 * cos + 2.0 * rel + 3.0 * nce, rel=1e-12)
    assert fn.terms.names == ("distill/cosine", "distill/relation", "distill/contrastive")
    assert take_terms(fn) == pytest.approx(
        {"distill/cosine": cos, "distill/relation": rel, "distill/contrastive": nce}, rel=1e-12
    )


# ------------------------------------------------------------------------ build refusals


def _build(kwargs: dict, *, student, task_kind: str = "encode", cache_info=None):
    from scaletrain.config import Config
    from scaletrain.distill.build import build_distillation

    config = Config.model_validate({"distill": {"teacher": "unread", **kwargs}})
    return build_distillation(
        config,
        student,
        task=TaskSpec(task_kind, (4,), 30522),
        hard=None,
        precision=None,
        cache_info=cache_info,
    )


def _cache_info(**shapes) -> dict:
    return {
        "teacher_layers": 0,
        "teacher_width": 24,
        "splits": {"train": {"shapes": {k: {"shape": v} for k, v in shapes.items()}}},
    }


@pytest.mark.parametrize(
    "kwargs, student, shapes, task, expect",
    [
        # the student's 4 heads do not cut the teacher's 30-wide queries
        (
            dict(relation_weight=1.0, contrastive_weight=1.0),
            dict(hidden=32, heads=4),
            {"query.last": [4, 30]},
            "encode",
            ("distill.relation_weight = 1.0", "30 wide", "4 attention heads"),
        ),
        # cosine over pooled embeddings of two widths
        (
            dict(contrastive_weight=1.0),
            dict(hidden=32, heads=2),
            {"pooled": [24]},
            "encode",
            ("distill.contrastive_weight = 1.0", "(32 wide)", "(24 wide)", "hidden_size"),
        ),
        # the relations alone: nothing reaches the student's output
        (
            dict(relation_weight=2.0),
            dict(hidden=32, heads=2),
            {"query.last": [4, 32]},
            "encode",
            ("distill.relation_weight = 2.0", "no gradient", "distill.cosine_weight"),
        ),
        # a language model's causal attention / no pooled sentence embedding
        (
            dict(relation_weight=1.0),
            dict(hidden=32, heads=2),
            {},
            "lm",
            ("distill.relation_weight = 1.0", "data kind 'encode'", "'lm'"),
        ),
        (
            dict(contrastive_weight=0.5),
            dict(hidden=32, heads=2),
            {},
            "lm",
            ("distill.contrastive_weight = 0.5", "'lm'"),
        ),
    ],
)
def test_the_build_refuses_models_the_terms_cannot_read(kwargs, student, shapes, task, expect):
    """From a cache (its shapes give the teacher's widths, no teacher is loaded)."""
    with pytest.raises(UserCodeError) as e:
        _build(
            {**kwargs, "cache": "unread"},
            student=_bert(2, **student),
            task_kind=task,
            cache_info=_cache_info(**shapes),
        )
    for want in expect:
        assert want in str(e.value), (want, str(e.value))


def test_the_build_wires_the_relation_heads_and_the_students_projections() -> None:
    """From a cache whose teacher is 24 wide: R = the student's 2 heads, the wrapper returns
    the student's last-layer projections, and the loss needs the three cached outputs."""
    kd = _build(
        {"relation_weight": 1.0, "contrastive_weight": 1.0, "cache": "unread"},
        student=_bert(2, hidden=24, heads=2),
        cache_info=_cache_info(**{"query.last": [4, 24], "pooled": [24]}),
    )
    assert kd.loss_fn.relation_heads == 2 and kd.model.want_qkv
    assert kd.needs.keys() == ["pooled", "query.last", "key.last", "value.last"]
    with torch.no_grad():
        out = kd.model(IDS, attention_mask=MASK)
    assert sorted(out.qkv) == ["key", "query", "value"]


def test_a_cache_lacking_the_relations_outputs_names_the_key(monkeypatch) -> None:
    """check_cache's refusal says which [distill] key reads the missing outputs."""
    from scaletrain.distill import cache as kd_cache

    info = {
        "teacher_sha256": "ab" * 32,
        "teacher_dtype": "float64",
        "splits": {"train": {"rows": 0, "data_sha256": "", "shapes": {"pooled": {}}}},
    }
    monkeypatch.setattr(kd_cache, "same_data", lambda part, ds: True)  # the data: not the point
    with pytest.raises(kd_cache.CacheError) as e:
        kd_cache.check_cache(
            info,
            cache_dir="c",
            split="train",
            ds=None,
            needs_keys=["pooled", "query.last", "key.last", "value.last"],
            teacher_sha256=None,
            teacher_dtype="float64",
        )
    assert "['query.last', 'key.last', 'value.last']" in str(e.value)
    assert "distill.relation_weight" in str(e.value)


def test_the_terms_compute_in_fp32_under_the_steps_bf16_autocast() -> None:
    """The step calls the loss inside its forward context: under bf16-mixed autocast the
    relation scores and the contrastive similarities are still fp32 matmuls (bf16 would
    round them to 8 bits of mantissa, ~1e-2 here), as outside it."""
    g = torch.Generator().manual_seed(6)
    student = tuple(torch.randn(2, 5, 8, generator=g) for _ in range(3))
    teacher = tuple(torch.randn(2, 5, 12, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    s, t = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)

    def both():
        return (
            float(relation_loss(student, teacher, heads=2, mask=mask)),
            float(contrastive_loss(s, t, temperature=0.05)),
        )

    plain = both()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = both()

    assert mixed == pytest.approx(plain, rel=1e-6)
