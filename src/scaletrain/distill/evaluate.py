"""Evaluation of sentence encoders, for judging a distilled student against its teacher.

An encoder is anything that maps a list of texts to an ``(N, D)`` array (``Encode``), so the
same benchmarks score the teacher, a student ``BertModel`` still in memory, or a checkpoint
on disk. ``hf_encoder`` builds one from a Hugging Face model with mean (or CLS) pooling,
the way all-MiniLM-L6-v2 produces its sentence embeddings.

The benchmarks, all from gensim's bundled test data so that nothing is downloaded (their
files are read by data/benchmarks.py, the same text data/leakage.py keeps out of training):

* ``lee_pearson``: 50 news documents (``lee.cor``) and a 50 x 50 matrix of human similarity
  (``similarities0-1.txt``, upper triangle filled); the 1225 pairs ``i < j`` are scored by
  the cosine of the two document embeddings (Pearson, with Spearman alongside).
* ``wordsim353`` / ``simlex999``: word pairs with human scores; each word is encoded alone,
  as a one-word sentence, and the pair is scored by cosine (Spearman). Pairs listed twice
  with different scores are kept as listed, as the published numbers do.
* ``polarity_probe``: a task the student is never tuned on. A logistic-regression probe on
  the frozen embeddings of ``pang_lee_polarity.cor`` (200 movie-review sentences, 100 per
  class), stratified 5-fold cross-validated accuracy, repeated over 5 seeded shuffles and
  averaged. Embeddings are scaled to unit length first: the probe then sees the same cosine
  geometry the other benchmarks score, it neither rewards nor punishes the overall scale of
  an encoder's output (which distillation by cosine leaves free), and being per-example it
  leaks nothing across folds; the repeats make the spread over seeds small next to the
  student/teacher gaps it is meant to show.
* ``topic_probe``: the same probe on another unseen task, topic: the 200 Usenet posts of
  gensim's ``mini_newsgroup`` (20 Newsgroups' alt.atheism and sci.space, 100 each), headers,
  quotes and signatures removed, labelled by the group they were posted to (read without
  unpickling: data/benchmarks.py).
* ``mean_cosine`` on ``held_out_sentences()``: agreement with the teacher on news sentences
  from ``lee_background.cor`` that no training set reads: the first sentence of each story,
  which data/corpora.py reserves; the figure BENCHMARKS.md has always given.
* ``mean_cosine`` per kind of text on ``held_out_by_kind()``: the held-out part (1 in 20,
  by a hash of the text) of every corpus, Wikipedia, news, the language reference, the
  packages' questions, instructions, headlines and technical prose: how closely the
  student follows its teacher on each register, none of it ever trained on.

No text scored here is training text: data/leakage.py drops every training item that
equals or contains any of it (the benchmarks' words included).

Trade-offs: documents longer than ``max_len`` tokens are truncated. Lee's documents run to
126 words, longer in WordPiece tokens, so ``max_len=128`` cuts the tail of some: the teacher
scores Lee Pearson 0.654 at 128 and 0.656 (the published figure) at its own limit of 256.
Compare a student and its teacher at the same ``max_len``.
Texts are encoded in batches sorted by length, which removes most padding and is the main
reason encoding is fast on CPU; the results come back in the caller's order.

Speed (``speed_ratio``): how much faster the student encodes than the teacher, its forward
passes alone. Both encoders tokenize the texts first, untimed (the same tokenizer; its cost
is reported apart, as sentences per second), then rounds time the teacher's and the
student's forwards back to back, so that whatever else the machine does at that moment
slows both; the ratio is the median of the rounds' ratios, and rounds continue (5 to 40)
until the ratio's 95% confidence interval is within 5% of it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy import stats
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import RepeatedStratifiedKFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import Normalizer

from scaletrain.data.benchmarks import lee_corpus, polarity_data, topic_data, word_pairs
from scaletrain.data.catalog import READERS
from scaletrain.data.catalog import held_out_sentences as held_out_of
from scaletrain.data.corpora import evaluation_news

Encode = Callable[[list[str]], np.ndarray]  # texts -> (N, D) float64 embeddings, not normalised

# The one number per benchmark that a student/teacher ratio is taken of.
SCORE_KEYS: dict[str, str] = {
    "lee_pearson": "pearson",
    "wordsim353": "spearman",
    "simlex999": "spearman",
    "polarity": "accuracy",
    "topic": "accuracy",
}
POOLINGS = ("mean", "cls")


# ---------------------------------------------------------------------------- encoders


@dataclass
class HFEncoder:
    """A Hugging Face encoder as an ``Encode``, with its two halves apart for timing:
    ``tokenize`` (texts -> length-sorted padded batches) and ``forward`` (batches -> pooled
    embeddings). Calling it does both and returns the caller's order."""

    model: torch.nn.Module
    tokenizer: object
    max_len: int
    batch_size: int
    pooling: str

    def __call__(self, texts: list[str]) -> np.ndarray:
        texts = list(texts)
        # Sort by length so each batch pads to a similar length; undo the order at the end.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        sorted_emb = self.forward(self.tokenize([texts[i] for i in order]))  # (N, D)
        out = np.empty_like(sorted_emb)
        out[order] = sorted_emb
        return out

    def tokenize(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        """``texts`` in batches of ``batch_size`` in the order given, each padded to its longest."""
        return [
            self.tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_len,
                return_tensors="pt",
            )
            for start in range(0, len(texts), self.batch_size)
        ]

    def forward(self, batches: list[dict[str, torch.Tensor]]) -> np.ndarray:
        """Pooled embeddings of tokenized batches, float64 ``(N, D)`` in batch order."""
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()  # dropout off: embeddings must not depend on the call
        try:
            with torch.inference_mode():
                chunks = [
                    _embed_batch(model, enc, device=device, pooling=self.pooling) for enc in batches
                ]
        finally:
            model.train(was_training)
        return np.concatenate(chunks) if chunks else np.zeros((0, 0))


def hf_encoder(
    model_dir_or_module: str | Path | torch.nn.Module,
    *,
    tokenizer_dir: str | Path,
    max_len: int = 128,
    batch_size: int = 64,
    pooling: str = "mean",
    dtype: torch.dtype = torch.float32,
) -> HFEncoder:
    """Wrap a Hugging Face encoder (a local directory or a module in memory) as an ``Encode``.

    Args:
        model_dir_or_module: a local model directory, loaded with ``AutoModel`` offline from
            its safetensors weights only (pickles are never opened), or an
            ``nn.Module`` called as ``model(input_ids=..., attention_mask=...)`` whose output has
            ``last_hidden_state`` (or is a tuple whose first element is it). A module is used
            on its own device and dtype; its train/eval mode is restored after each call.
        tokenizer_dir: directory holding the tokenizer (``AutoTokenizer``, offline).
        max_len: longer texts are truncated to this many tokens, special tokens included.
        batch_size: texts per forward pass.
        pooling: ``"mean"`` over the attention mask, or ``"cls"`` (the first token).
        dtype: dtype for a model loaded from a directory; ignored for a module.
    """
    from transformers import AutoModel, AutoTokenizer  # slow import: only when an encoder is built

    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r}: expected one of {POOLINGS}")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    if isinstance(model_dir_or_module, torch.nn.Module):
        model = model_dir_or_module
    else:
        if not any(Path(model_dir_or_module).glob("*.safetensors")):
            raise ValueError(
                f"{str(model_dir_or_module)!r} has no *.safetensors weights: only "
                "safetensors are loaded (a pickle such as pytorch_model.bin can "
                "run code when loaded)"
            )
        # use_safetensors: never fall back to a pickle beside the safetensors.
        model = AutoModel.from_pretrained(
            str(model_dir_or_module), local_files_only=True, use_safetensors=True, dtype=dtype
        )
        model.eval()
    return HFEncoder(model, tokenizer, max_len=max_len, batch_size=batch_size, pooling=pooling)


def _embed_batch(
    model: torch.nn.Module, enc: dict[str, torch.Tensor], *, device: torch.device, pooling: str
) -> np.ndarray:
    """Pooled embeddings of one tokenized batch, as float64 numpy ``(B, D)``."""
    ids = enc["input_ids"].to(device)  # (B, T)
    mask = enc["attention_mask"].to(device)  # (B, T)
    out = model(input_ids=ids, attention_mask=mask)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # (B, T, D)
    hidden = hidden.float()  # pool in fp32 even for a bf16 model, so sums do not lose bits
    if pooling == "cls":
        pooled = hidden[:, 0]  # (B, D)
    else:
        m = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)  # (B, D)
    return pooled.cpu().double().numpy()


def encode_speed(encode: Encode, texts: list[str], *, repeats: int = 3) -> float:
    """Sentences per second of ``encode`` on ``texts``, best of ``repeats`` timed calls.

    Args:
        encode: the encoder to time.
        texts: the texts encoded in one call per repeat.
        repeats: number of timed calls; the fastest counts, which discards warm-up and noise
            from other processes.
    """
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        encode(texts)
        best = min(best, time.perf_counter() - start)
    return len(texts) / best


def speed_ratio(
    student: HFEncoder,
    teacher: HFEncoder,
    texts: list[str],
    *,
    min_rounds: int = 5,
    max_rounds: int = 40,
    tolerance: float = 0.05,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """The student's encode speed over the teacher's, forward passes alone (see the module
    docstring), and the tokenizer's speed measured apart.

    Args:
        student, teacher: the encoders; each tokenizes ``texts`` once, untimed, with its own
            tokenizer and batch size.
        texts: what both encode every round (sorted by length, as encoding does).
        min_rounds, max_rounds: rounds of (teacher forward, student forward) back to back.
        tolerance: stop once the 95% confidence interval of the median ratio (normal
            approximation, 1.2533 x the standard error of the mean) is within this fraction
            of it on each side.
        clock: the timer (a test passes a fake one).

    Returns:
        ``{"ratio", "ci95", "rounds", "student_sentences_per_s", "teacher_sentences_per_s",
        "tokenize_sentences_per_s"}``; the speeds are the medians of the rounds.
    """
    ordered = sorted(texts, key=len)
    start = clock()
    student_batches = student.tokenize(ordered)
    tokenize_s = clock() - start
    teacher_batches = teacher.tokenize(ordered)
    student.forward(student_batches[:1])  # warm-up: first-call allocations are not speed
    teacher.forward(teacher_batches[:1])
    s_times: list[float] = []
    t_times: list[float] = []
    ratios: list[float] = []
    half_width = float("inf")
    while len(ratios) < max_rounds:
        for encoder, batches, times in (
            (teacher, teacher_batches, t_times),
            (student, student_batches, s_times),
        ):
            start = clock()
            encoder.forward(batches)
            times.append(max(clock() - start, 1e-12))
        ratios.append(t_times[-1] / s_times[-1])
        if len(ratios) >= min_rounds:
            median = statistics.median(ratios)
            sem = statistics.stdev(ratios) / len(ratios) ** 0.5
            half_width = 1.96 * 1.2533 * sem  # the median's standard error ~ 1.2533 x the mean's
            if half_width <= tolerance * median:
                break
    median = statistics.median(ratios)
    return {
        "ratio": median,
        "ci95": [median - half_width, median + half_width],
        "rounds": len(ratios),
        "student_sentences_per_s": len(texts) / statistics.median(s_times),
        "teacher_sentences_per_s": len(texts) / statistics.median(t_times),
        "tokenize_sentences_per_s": len(texts) / max(tokenize_s, 1e-12),
    }


# ---------------------------------------------------------------------------- data


def held_out_sentences(n: int = 300) -> list[str]:
    """``n`` news sentences from ``lee_background.cor`` that training never reads,
    deterministic, each of at least 5 words (``data/corpora.evaluation_news``).

    Args:
        n: how many; the first ``n`` of a round-robin order over the 300 stories, so the
            default 300 is the first sentence of each story (the set scored since the
            start); past 300 come the news sentences the corpora's hash holds out.
    """
    pool = evaluation_news()
    if n > len(pool):
        raise ValueError(
            f"n={n}: lee_background.cor has only {len(pool)} usable sentences held out of training"
        )
    return list(pool[:n])


def held_out_by_kind() -> dict[str, list[str]]:
    """Each corpus's held-out sentences, what training never reads, by kind of text: "news"
    is all of ``evaluation_news`` (the reserved first sentences and the hash's), every other
    corpus its 1 in 20 (``data/catalog.held_out_sentences``)."""
    return {
        name: list(evaluation_news()) if name == "news" else held_out_of([name]) for name in READERS
    }


# ---------------------------------------------------------------------------- benchmarks


def _unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length; a zero row stays zero (its cosines are 0, not NaN)."""
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norm == 0, 1.0, norm)


def _pair_cosines(encode: Encode, pairs: tuple[tuple[str, str, float], ...]) -> np.ndarray:
    """Cosine of each pair ``(a, b, _)``, encoding each distinct word once."""
    vocab = sorted({w for a, b, _ in pairs for w in (a, b)})
    index = {w: k for k, w in enumerate(vocab)}
    emb = _unit(np.asarray(encode(vocab), dtype=np.float64))  # (V, D)
    a = emb[[index[p[0]] for p in pairs]]  # (P, D)
    b = emb[[index[p[1]] for p in pairs]]  # (P, D)
    return np.einsum("pd,pd->p", a, b)


def _word_benchmark(encode: Encode, name: str) -> dict:
    pairs = word_pairs(name)
    cos = _pair_cosines(encode, pairs)
    rho = stats.spearmanr(cos, [p[2] for p in pairs]).statistic
    return {"spearman": float(rho), "pairs": len(pairs)}


def wordsim353(encode: Encode) -> dict:
    """Spearman of cosine against human relatedness on WordSim-353: ``{"spearman", "pairs"}``."""
    return _word_benchmark(encode, "wordsim353.tsv")


def simlex999(encode: Encode) -> dict:
    """Spearman of cosine against human similarity on SimLex-999: ``{"spearman", "pairs"}``."""
    return _word_benchmark(encode, "simlex999.txt")


def lee_pearson(encode: Encode) -> dict:
    """Lee document similarity: ``{"pearson", "spearman", "pairs": 1225}`` over the pairs ``i < j``."""
    docs, human = lee_corpus()
    emb = _unit(np.asarray(encode(list(docs)), dtype=np.float64))  # (50, D)
    i, j = np.triu_indices(len(docs), k=1)
    cos = (emb @ emb.T)[i, j]  # (1225,), same row-major order as `human`
    return {
        "pearson": float(stats.pearsonr(cos, human).statistic),
        "spearman": float(stats.spearmanr(cos, human).statistic),
        "pairs": len(cos),
    }


def polarity_probe(encode: Encode, *, seed: int = 0, repeats: int = 5) -> dict:
    """Sentiment probe on frozen embeddings: ``{"accuracy", "examples": 200}``.

    Args:
        encode: the encoder under test.
        seed: seeds the shuffles of the stratified 5-fold splits; the same seed gives the same
            folds for every encoder, so scores are comparable.
        repeats: how many differently shuffled 5-fold splits the accuracy is averaged over
            (5 x 5 fits of a 200-example probe take about 0.2 s).
    """
    texts, y = polarity_data()
    return _probe(encode, list(texts), y, seed=seed, repeats=repeats)


def topic_probe(encode: Encode, *, seed: int = 0, repeats: int = 5) -> dict:
    """Topic probe on frozen embeddings (alt.atheism or sci.space, ``topic_data``):
    ``{"accuracy", "examples"}``, the probe and folds of ``polarity_probe``."""
    texts, y = topic_data()
    return _probe(encode, list(texts), y, seed=seed, repeats=repeats)


def _probe(encode: Encode, texts: list[str], y: np.ndarray, *, seed: int, repeats: int) -> dict:
    """Unit-length embeddings, logistic regression, stratified 5-fold x ``repeats``."""
    x = np.asarray(encode(texts), dtype=np.float64)  # (N, D)
    probe = make_pipeline(Normalizer(), LogisticRegression(max_iter=2000))
    folds = RepeatedStratifiedKFold(n_splits=5, n_repeats=repeats, random_state=seed)
    acc = cross_val_score(probe, x, y, cv=folds, scoring="accuracy")
    return {"accuracy": float(acc.mean()), "examples": len(y)}


def mean_cosine(student: Encode, teacher: Encode, texts: list[str]) -> float:
    """Mean over ``texts`` of the cosine between the student's and the teacher's embedding.

    Both must embed into the same space (same width); a student of another width needs its
    projection applied inside its ``Encode`` first.
    """
    s = np.asarray(student(list(texts)), dtype=np.float64)  # (N, D)
    t = np.asarray(teacher(list(texts)), dtype=np.float64)  # (N, D)
    if s.shape != t.shape:
        raise ValueError(
            f"student embeddings {s.shape} and teacher embeddings {t.shape} differ in shape"
        )
    return float(np.einsum("nd,nd->n", _unit(s), _unit(t)).mean())


def _scores(encode: Encode) -> dict:
    return {
        "lee_pearson": lee_pearson(encode),
        "wordsim353": wordsim353(encode),
        "simlex999": simlex999(encode),
        "polarity": polarity_probe(encode),
        "topic": topic_probe(encode),
    }


def encoder_report(encode: Encode, *, teacher: Encode | None = None) -> dict:
    """Every benchmark in one dict; with a teacher, also its scores, the ratios and agreement.

    Args:
        encode: the encoder under test (the student).
        teacher: when given, adds ``"teacher"`` (the same five entries), ``"ratio"``
            (student over teacher for the score named in ``SCORE_KEYS``),
            ``"cosine_held_out"`` (``mean_cosine`` on ``held_out_sentences()``, the news
            scored since the start), ``"cosine_by_kind"`` (kind -> ``{"cosine",
            "sentences"}`` on ``held_out_by_kind()``) and ``"worst_first"``.
    """
    report = _scores(encode)
    if teacher is not None:
        ref = _scores(teacher)
        report["teacher"] = ref
        report["ratio"] = {k: report[k][key] / ref[k][key] for k, key in SCORE_KEYS.items()}
        report["cosine_held_out"] = mean_cosine(encode, teacher, held_out_sentences())
        report["cosine_by_kind"] = {
            kind: {"cosine": mean_cosine(encode, teacher, texts), "sentences": len(texts)}
            for kind, texts in held_out_by_kind().items()
            if texts
        }
        report["worst_first"] = worst_first(report)
    return report


def worst_first(report: dict) -> list[tuple[str, float]]:
    """Every figure of a report with a teacher, the worst first: each score's ratio to the
    teacher (``"ratio"``) and each kind's cosine to it (``"cosine_by_kind"``); on both, 1 is
    the teacher's own. Ties keep the report's order."""
    figures = [*report["ratio"].items()]
    figures += [(kind, c["cosine"]) for kind, c in report.get("cosine_by_kind", {}).items()]
    return sorted(figures, key=lambda item: item[1])
