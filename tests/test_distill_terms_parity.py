"""The relation and contrastive terms keep data parallelism's guarantee, each proven by the
runs themselves in float64 within 1e-9 (gloo, the workers' own entry), and from the cache.

- MiniLM's relation term (with the pooled cosine) is a sum over examples: dp = 2 with
  2 micro-batches of 4 per rank ends with the weights, per-step losses and logged terms
  (training and held-out) of one process with 2 micro-batches of 8.
- The contrastive term (distill.contrastive_weight alone) takes its negatives from the
  micro-batch on its rank, so its reference is one process with the same micro-batch size:
  dp = 2 with micro-batches of 4 equals one process that accumulates 4 micro-batches of 4
  (the sampler cuts the global batch at the same places), training records included. One
  process with micro-batches of 8 trains another objective (7 negatives, not 3): the check
  can fail, and says which reference it reproduces. Held-out records are not compared: an
  evaluation's batches are each rank's strided share (distill/objective.py).
- Both terms from a cache written by `scaletrain distill-cache` (the teacher's last-layer
  query, key and value, 3 x T x D a row, and its pooled embedding) train the online run; so
  do FSDP2 (dp_shard = 2) and full activation checkpointing, under which the hooks that
  catch the student's last-layer projections see wrapped or recomputed blocks.

The teacher is test_distill_parity's random 4-layer BERT (2 heads, width 32) and the student
its 2-layer BERT initialised from teacher blocks [1, 3] on words of different token lengths
(padding differs between rows). Plain SGD, no clipping: a wrong normaliser shows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_distill_cache import write_cache
from test_distill_parity import BERT_STUDENT, BERT_WIDTHS, TOL, assert_same_run

from harness import Case, load_weights, max_abs_diff, records

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# BERT_STUDENT's hidden, attention and cosine terms off: each new term alone, but for the
# relation term the pooled cosine (the relations alone train nothing of the last layer after
# its projections: distill/checks.py refuses them).
ALONE = ["distill.hidden_weight=0.0", "distill.attention_weight=0.0", "distill.cosine_weight=0.0"]
RELATION = [
    "distill.hidden_weight=0.0",
    "distill.attention_weight=0.0",
    "distill.relation_weight=1.0",
]
CONTRASTIVE = [*ALONE, "distill.contrastive_weight=1.0", "distill.contrastive_temperature=0.1"]
BOTH = [*ALONE, "distill.relation_weight=1.0", "distill.contrastive_weight=0.5"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("distill-terms")


@pytest.fixture(scope="module")
def bert_teacher(work: Path) -> Path:
    """test_distill_parity's random 4-layer BERT drawn with weights 10 x larger: at BERT's
    own init (0.02) its attention is uniform to 1e-8 and the relations teach nothing."""
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=4, initializer_range=0.2, **BERT_WIDTHS)
    transformers.BertModel(config).save_pretrained(work / "bert-teacher")
    return work / "bert-teacher"


def layout(*, dp: int, micro: int, overrides: list[str]) -> Case:
    """BERT_STUDENT with `dp` ranks and micro-batches of `micro` in a global batch of 16."""
    return Case.of(
        BERT_STUDENT,
        f"parallel.dp={dp}",
        "train.global_batch=16",
        f"train.micro_batch={micro}",
        *overrides,
    )


@pytest.fixture(scope="module")
def cache(work: Path, bert_teacher: Path) -> Path:
    """A cache of the teacher outputs both terms read, written by `scaletrain distill-cache`."""
    config = work / "bert.toml"
    config.write_text(BERT_STUDENT)
    return write_cache(config, work / "cache", [f"distill.teacher={bert_teacher}", *BOTH])


@pytest.fixture(scope="module")
def runs(trained, bert_teacher: Path, cache: Path) -> dict[str, Path]:
    """Every run of this file: one job on 1 rank, one on 2."""
    online = [f"distill.teacher={bert_teacher}"]
    cached = [*online, f"distill.cache={cache}"]  # the teacher read for init_layers only
    cases = {
        1: {
            "relation-dp1": layout(dp=1, micro=8, overrides=[*online, *RELATION]),
            "contrastive-dp1-m4": layout(dp=1, micro=4, overrides=[*online, *CONTRASTIVE]),
            "contrastive-dp1-m8": layout(dp=1, micro=8, overrides=[*online, *CONTRASTIVE]),
        },
        2: {
            "relation-dp2": layout(dp=2, micro=4, overrides=[*online, *RELATION]),
            "contrastive-dp2-m4": layout(dp=2, micro=4, overrides=[*online, *CONTRASTIVE]),
            "both-online": layout(dp=2, micro=4, overrides=[*online, *BOTH]),
            "both-cached": layout(dp=2, micro=4, overrides=[*cached, *BOTH]),
            # the student's projections caught by hooks under FSDP2 and under activation
            # checkpointing (which runs the last block again in backward)
            "both-fsdp": layout(dp=1, micro=4, overrides=[*online, *BOTH, "parallel.dp_shard=2"]),
            "both-checkpointed": layout(
                dp=2, micro=4, overrides=[*online, *BOTH, "parallel.activation_checkpointing=full"]
            ),
        },
    }
    return {
        name: result.run_dir
        for world, asked in cases.items()
        for name, result in trained(asked, world_size=world).items()
    }


def assert_same_terms(a: Path, b: Path, weights: dict[str, float], *, kinds: tuple[str, ...]):
    """Each record of `b` of the given kinds logs `a`'s terms within TOL, and its loss is the
    weighted sum of its terms."""
    for kind in kinds:
        ref, got = records(a, kind), records(b, kind)
        assert len(ref) == len(got) > 0, kind
        for r, g in zip(ref, got):
            assert {k: g[k] for k in weights} == pytest.approx(
                {k: r[k] for k in weights}, abs=TOL, rel=TOL
            ), (kind, r["step"])
            assert g["loss"] == pytest.approx(
                sum(w * g[k] for k, w in weights.items()), rel=1e-12
            ), (kind, g)


def moved_from_the_teacher(run: Path, teacher: Path) -> float:
    """How far the student's blocks went from teacher blocks 1 and 3, where they started."""
    start = load_file(str(teacher / "model.safetensors"))
    got = load_weights(run)
    return max(
        float(
            (got[f"encoder.layer.{i}.{w}"].double() - start[f"encoder.layer.{t}.{w}"].double())
            .abs()
            .max()
        )
        for i, t in enumerate((1, 3))
        for w in ("attention.self.query.weight", "output.dense.weight")
    )


def test_relation_distillation_dp2_matches_one_process(
    runs: dict[str, Path], bert_teacher: Path
) -> None:
    one, two = runs["relation-dp1"], runs["relation-dp2"]
    assert_same_run(one, two)
    weights = {"distill/cosine": 1.0, "distill/relation": 1.0}
    assert_same_terms(one, two, weights, kinds=("train", "eval"))
    assert moved_from_the_teacher(one, bert_teacher) > 1e6 * TOL  # the check can fail
    relation = [r["distill/relation"] for r in records(one)]
    assert relation[-1] < relation[0], relation  # the term is learned


def test_contrastive_dp2_matches_one_process_with_the_same_micro_batches(
    runs: dict[str, Path], bert_teacher: Path
) -> None:
    one, two = runs["contrastive-dp1-m4"], runs["contrastive-dp2-m4"]
    assert_same_run(one, two)
    assert_same_terms(one, two, {"distill/contrastive": 1.0}, kinds=("train",))
    assert moved_from_the_teacher(one, bert_teacher) > 1e6 * TOL
    # The objective is the micro-batch's: 8 examples (7 negatives) is another loss, from the
    # first step (the same weights, a larger softmax).
    other = runs["contrastive-dp1-m8"]
    diff = max_abs_diff(load_weights(one), load_weights(other))
    assert diff > 1e-6, f"micro-batches of 8 trained the micro-batch-4 objective ({diff:.3g})"
    first = records(one)[0]["distill/contrastive"], records(other)[0]["distill/contrastive"]
    assert first[1] > first[0] + 0.1, first


def test_both_terms_from_the_cache_train_the_online_run(runs: dict[str, Path], cache: Path) -> None:
    info = json.loads((cache / "cache.json").read_text())
    shapes = info["splits"]["train"]["shapes"]
    assert info["outputs"] == ["pooled", "query.last", "key.last", "value.last"]
    # 3 x T x D float64 a row for the relations (seq_len 16, width 32), D for the pooled
    for key in ("query.last", "key.last", "value.last"):
        assert shapes[key] == {"shape": [16, 32], "dtype": "float64"}
    assert shapes["pooled"] == {"shape": [32], "dtype": "float64"}
    online, cached = runs["both-online"], runs["both-cached"]
    assert_same_run(online, cached)
    weights = {"distill/relation": 1.0, "distill/contrastive": 0.5}
    assert_same_terms(online, cached, weights, kinds=("train", "eval"))


@pytest.mark.parametrize("layout_name", ["both-fsdp", "both-checkpointed"])
def test_both_terms_under_fsdp_and_activation_checkpointing(
    runs: dict[str, Path], layout_name: str
) -> None:
    """dp_shard = 2 (FSDP2) and dp = 2 with every block checkpointed train the dp = 2 run."""
    assert_same_run(runs["both-online"], runs[layout_name])
    weights = {"distill/relation": 1.0, "distill/contrastive": 0.5}
    assert_same_terms(runs["both-online"], runs[layout_name], weights, kinds=("train",))
