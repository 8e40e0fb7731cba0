"""TinyBERT's data augmentation (Jiao et al. 2020, section 3.1) in the teacher's own word space.

TinyBERT expands each training sentence into N variants: every replaceable word is, with
probability p, replaced by one of its K best candidates chosen at random; a variant that
repeats its source or an earlier variant is dropped (as the reference data_augmentation.py
does), so a sentence yields at most N. The paper takes a single-piece word's candidates from
BERT's masked-language-model head and a multi-piece word's from GloVe. all-MiniLM-L6-v2 is a
sentence encoder with no such head, and no GloVe is installed, so here every candidate is a
cosine nearest neighbour in the teacher's input word-embedding matrix
(`*word_embeddings.weight`, read with safetensors): "king" gives kings, queen, monarch,
prince; "good" gives excellent, bad, great. Related words, not always synonyms (the paper's
candidates are not either): a variant need not keep its source's meaning, since the teacher
labels it, not the source's label.

Which words: single-piece whole words only, i.e. vocabulary entries of two or more
lower-case letters (21.7k of MiniLM's 30,522 entries; '##' pieces, digits, punctuation and
[special] tokens are not), matched case-insensitively against a word stripped of the
punctuation around it. A word the tokenizer cuts into pieces has no row of its own and is
kept. English function words (`corpora.FUNCTION_WORDS`) are neither replaced nor used as
replacements: their neighbours are other function words ("the" -> "a", "of" -> "in"),
which breaks the grammar and adds nothing to learn; the reference code skips its stop-word
list too.

What a variant keeps: the number of words (one word for one word, its punctuation and its
capitalisation kept) and, with an uncased tokenizer such as MiniLM's, the number of tokens
(a single piece for a single piece). With a cased tokenizer a capitalised replacement may
be cut into more pieces.

Cost: the neighbours are computed once, by one matrix product of the unit rows of the words
the sentences contain (Q, D) against all whole-word rows (W, D), in chunks of CHUNK rows so
that the (chunk, W) scores stay small, keeping the top k of each row (3 to 6 s for the 14.5k
distinct words of the recipe's sentences on 2 busy cores). The draws are plain Python, ~3 s
for 19k sentences; tokenizing the variants afterwards costs more than both.

Determinism: a sentence's variants come from `random.Random` seeded with (seed, sentence),
a SHA-512 of the two, not Python's salted hash: the same seed gives the same variants,
whatever the other sentences, their order or the process.

The directory the embeddings come from is handed in by the caller (data/sentences.py passes
the tokenizer's, which data.kwargs.tokenizer names and the layer above resolves; for the
recipe that is the packaged teacher), so this layer asks no other where a model lives.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scaletrain.data.corpora import FUNCTION_WORDS, sentence_key
from scaletrain.errors import ConfigError

CHUNK = 2048  # query rows per matrix product: (2048, 21.7k) float32 scores, 180 MB
LIMITS = {"n": (1, 64), "p": (0.0, 1.0), "k": (1, 100)}  # inclusive ranges of each key
_WHOLE_WORD = re.compile(r"[a-z]{2,}")
_TOKEN = re.compile(r"(\W*)([A-Za-z]+)(\W*)")  # punctuation, a plain word, punctuation
Slot = tuple[int, str, str, str, tuple[str, ...]]  # position, before, word, after, candidates


@dataclass(frozen=True)
class Augment:
    """data.kwargs.augment: n variants tried per sentence, each word replaced with
    probability p by one of its k nearest neighbours."""

    n: int = 4
    p: float = 0.4
    k: int = 15


def parse_augment(value: Any) -> Augment | None:
    """data.kwargs.augment checked: None when absent, else an `Augment` with the defaults
    for the keys not given.

    Raises:
        ConfigError: naming the key, the value and what is allowed.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(
            f"data.kwargs.augment = {value!r}: expected a table such as "
            "{ n = 4, p = 0.4, k = 15 } (keys n, p, k)"
        )
    unknown = sorted(set(value) - set(LIMITS))
    if unknown:
        raise ConfigError(
            f"data.kwargs.augment has {unknown}: allowed keys are n (variants per sentence), "
            "p (probability a word is replaced), k (nearest neighbours to choose from)"
        )
    for key, (low, high) in LIMITS.items():
        v = value.get(key, getattr(Augment, key))
        types, what = ((int, float), "a number") if key == "p" else (int, "an integer")
        # bool is an int to Python; `n = true` is a mistake, not 1.
        if not isinstance(v, types) or isinstance(v, bool) or not low <= v <= high:
            raise ConfigError(
                f"data.kwargs.augment.{key} = {v!r}: allowed {what} from {low} to {high}"
            )
    return Augment(**{k: value[k] for k in LIMITS if k in value})


# ---------------------------------------------------------------------------- neighbours


def _vocabulary(model_dir: Path) -> list[str]:
    """The tokenizer's entries in id order, from vocab.txt or tokenizer.json."""
    if (model_dir / "vocab.txt").is_file():
        return (model_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    vocab = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    return [w for w, _ in sorted(vocab.items(), key=lambda item: item[1])]


def _word_embeddings(model_dir: Path) -> torch.Tensor:
    """The input word-embedding matrix (V, D) of the first safetensors file that has one."""
    from safetensors import safe_open

    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith("word_embeddings.weight"):
                    return f.get_tensor(name).float()
    raise ConfigError(
        f"data.kwargs.augment needs the teacher's word embeddings, but the tokenizer directory "
        f"{str(model_dir)!r} has no *.safetensors with a '*word_embeddings.weight' tensor: "
        "set data.kwargs.tokenizer to a model directory (or 'all-MiniLM-L6-v2')"
    )


@functools.lru_cache(maxsize=2)
def _whole_words(model_dir: str) -> tuple[tuple[str, ...], torch.Tensor]:
    """The replaceable whole words and their unit embedding rows (W, D), read once."""
    path = Path(model_dir)
    if not (path / "vocab.txt").is_file() and not (path / "tokenizer.json").is_file():
        raise ConfigError(
            f"data.kwargs.augment: {model_dir!r} has no vocab.txt or tokenizer.json to find "
            "the whole words in"
        )
    vocab = _vocabulary(path)
    ids = [i for i, w in enumerate(vocab) if _WHOLE_WORD.fullmatch(w) and w not in FUNCTION_WORDS]
    embeddings = _word_embeddings(path)  # (V, D)
    if len(ids) < 2 or embeddings.shape[0] < len(vocab):
        raise ConfigError(
            f"data.kwargs.augment: {model_dir!r} has {len(ids)} whole words of 2+ lower-case "
            f"letters in a vocabulary of {len(vocab)} and {embeddings.shape[0]} embedding rows: "
            "a WordPiece vocabulary (BERT's) with a row per entry is needed"
        )
    rows = embeddings[ids]  # (W, D)
    return tuple(vocab[i] for i in ids), torch.nn.functional.normalize(rows, dim=1)


def nearest_neighbours(
    words: Iterable[str], *, model_dir: str | Path, k: int
) -> dict[str, tuple[str, ...]]:
    """Each of `words` that is a replaceable whole word -> its k nearest whole words by
    cosine, nearest first, itself excluded. Other words are left out of the result.

    Args:
        words: lower-case words (those the sentences contain).
        model_dir: a directory with the tokenizer's vocabulary and the model's safetensors.
        k: neighbours per word.
    """
    table, unit = _whole_words(str(model_dir))
    row = {w: i for i, w in enumerate(table)}
    queries = sorted({w for w in words if w in row})
    q_rows = torch.tensor([row[w] for w in queries], dtype=torch.int64)  # (Q,)
    found = []
    for start in range(0, len(queries), CHUNK):
        chunk = q_rows[start : start + CHUNK]  # (C,)
        scores = unit[chunk] @ unit.T  # (C, W) cosines
        scores[torch.arange(len(chunk)), chunk] = -2.0  # a word is not its own neighbour
        found.append(scores.topk(min(k, len(table) - 1), dim=1).indices)  # (C, k)
    top = torch.cat(found).tolist() if found else []
    return {w: tuple(table[j] for j in top[i]) for i, w in enumerate(queries)}


# ---------------------------------------------------------------------------- variants


def _recase(word: str, like: str) -> str:
    """`word` (lower case) in the capitalisation of `like`: Title, UPPER or lower."""
    if like.isupper() and len(like) > 1:
        return word.upper()
    return word.capitalize() if like[0].isupper() else word


def _slots(tokens: list[str], neighbours: dict[str, tuple[str, ...]]) -> list[Slot]:
    """The replaceable words of a sentence's tokens, with the punctuation around each."""
    out = []
    for i, token in enumerate(tokens):
        m = _TOKEN.fullmatch(token)
        if m is None:
            continue
        word = m.group(2)
        # Mixed case ("McDonald", "iPhone") is no plain word: its case could not be kept.
        if not (word.islower() or word.istitle() or word.isupper()):
            continue
        candidates = neighbours.get(word.lower())
        if candidates:
            out.append((i, m.group(1), word, m.group(3), candidates))
    return out


def _variant(tokens: list[str], slots: list[Slot], *, p: float, rng: random.Random) -> str:
    """One draw: each slot, with probability p, gets one of its candidates (uniformly)."""
    out = list(tokens)
    for i, before, word, after, candidates in slots:
        if rng.random() < p:
            out[i] = before + _recase(rng.choice(candidates), word) + after
    return " ".join(out)


def augment_sentence(
    sentence: str, *, neighbours: dict[str, tuple[str, ...]], p: float, rng: random.Random
) -> str:
    """One variant: each replaceable word, with probability p, swapped for one of its
    neighbours chosen uniformly; the punctuation around it and its case kept.

    Args:
        sentence: words separated by single spaces (normalised).
        neighbours: a word's candidates (`nearest_neighbours`); a word not in it is kept.
        p: probability that a replaceable word is replaced (0 gives the sentence back).
        rng: the source of randomness (seeded by the caller).
    """
    tokens = sentence.split(" ")
    return _variant(tokens, _slots(tokens, neighbours), p=p, rng=rng)


def variants_of(
    sentence: str, *, neighbours: dict[str, tuple[str, ...]], n: int, p: float, seed: int
) -> list[str]:
    """Up to n distinct variants of one sentence, none equal to it (by `sentence_key`): n
    draws, repeats dropped.

    Args:
        sentence: words separated by single spaces (normalised).
        neighbours: the candidates of each replaceable word (`nearest_neighbours`).
        n: draws.
        p: probability that a replaceable word is replaced.
        seed: the run's seed; with the sentence, it decides the draws.
    """
    tokens = sentence.split(" ")
    slots = _slots(tokens, neighbours)  # parsed once for the n draws
    if not slots:
        return []
    rng = random.Random(f"{seed}\n{sentence}")  # str seeds go through SHA-512: stable
    seen = {sentence_key(sentence)}
    out = []
    for _ in range(n):
        variant = _variant(tokens, slots, p=p, rng=rng)
        if sentence_key(variant) not in seen:
            seen.add(sentence_key(variant))
            out.append(variant)
    return out


def augment(
    sentences: Iterable[str], *, options: Augment, seed: int, model_dir: str | Path
) -> list[str]:
    """The variants of every sentence (`variants_of`), in sentence order, less those equal
    to a sentence given or to an earlier variant (compared by `sentence_key`).

    Args:
        sentences: the training sentences (normalised), never the held-out ones.
        options: n, p, k.
        seed: the run's seed; with the same seed, a sentence gets the same variants.
        model_dir: where the teacher's vocabulary and word embeddings are.
    """
    sentences = list(sentences)
    words = {m.group(2).lower() for s in sentences for m in map(_TOKEN.fullmatch, s.split()) if m}
    neighbours = nearest_neighbours(words, model_dir=model_dir, k=options.k)
    seen = {sentence_key(s) for s in sentences}
    out = []
    for sentence in sentences:
        for variant in variants_of(
            sentence, neighbours=neighbours, n=options.n, p=options.p, seed=seed
        ):
            if sentence_key(variant) not in seen:
                seen.add(sentence_key(variant))
                out.append(variant)
    return out
