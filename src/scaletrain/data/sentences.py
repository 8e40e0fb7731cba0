"""Tokenized sentences for an encoder (`data.source = "sentences"`, task kind "encode").

What a sentence encoder is distilled on: sentences cut from gensim's Wikipedia excerpt (the
same 106 articles as the `wikitext` source, markup stripped), and, so that the student also
learns what the teacher does with a word alone (word-similarity benchmarks encode single
words), the most frequent words of that text as items of their own. Lee's news documents,
the word-similarity sets and the sentiment sentences are never read here: they are the
evaluation (`distill/evaluate.py`).

Items are tokenized once with the teacher's WordPiece tokenizer (a directory handed in by
the caller: data.kwargs.tokenizer resolved above this layer, by default the packaged
all-MiniLM-L6-v2's), truncated or padded to data.seq_len, with the attention mask
as the model's `attention_mask` keyword. There are no labels: the targets are zeros, the
count is examples, and the loss comes from the teacher (distill/objective.py).

data.kwargs: tokenizer (directory or 'all-MiniLM-L6-v2'), corpora (["wikipedia", "words"]),
words (how many frequent words, 5000). One item in 20 is held out as the eval split, by
position, so the two splits never share an item.
"""

from __future__ import annotations

import collections
import functools
import os
import re
from pathlib import Path
from typing import Any

import torch

from scaletrain.data.sources import Batch, TaskSpec

CORPORA = ("wikipedia", "words")
KWARGS = ("tokenizer", "corpora", "words")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_WORD = re.compile(r"[a-z]{3,}")


def wikipedia_sentences() -> list[str]:
    """Sentences of 5 to 64 words from the Wikipedia excerpt, in text order (~20k)."""
    from scaletrain.data.sources import _wikitext_bytes

    out = []
    for paragraph in _wikitext_bytes().decode("utf-8").split("\n\n"):
        for s in _SENTENCE_END.split(paragraph.replace("\n", " ")):
            if 5 <= len(s.split()) <= 64:
                out.append(s.strip())
    return out


def frequent_words(n: int) -> list[str]:
    """The n most frequent lower-case words (3+ letters) of the excerpt, most frequent first."""
    from scaletrain.data.sources import _wikitext_bytes

    counts = collections.Counter(_WORD.findall(_wikitext_bytes().decode("utf-8").lower()))
    return [w for w, _ in counts.most_common(n)]


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """A fast tokenizer from a local directory (nothing is downloaded)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read once, at the hub's first import
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


class TokenDataset:
    """Token ids (N, T) and their attention mask in memory; one shard; items have no labels."""

    def __init__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, vocab_size: int
    ) -> None:
        self.input_ids, self.attention_mask = input_ids, attention_mask  # (N, T) int64 each
        self.spec = TaskSpec("encode", (input_ids.shape[1],), vocab_size)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def shard_rows(self) -> tuple[int, ...]:
        return (len(self),)

    def prefetch(self, indices: torch.Tensor) -> None:
        """In memory: nothing to read ahead."""

    def __repr__(self) -> str:
        return f"TokenDataset(n={len(self)}, spec={self.spec})"

    def get(self, indices: torch.Tensor) -> Batch:
        ids = self.input_ids.index_select(0, indices)  # (B, T)
        mask = self.attention_mask.index_select(0, indices)  # (B, T)
        return Batch(
            inputs=ids,
            targets=torch.zeros(len(indices), dtype=torch.int64),
            count=len(indices),
            tokens=int(mask.sum()),
            extras={"attention_mask": mask},
        )


def tokenize(
    texts: list[str], *, tokenizer_dir: str | Path, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask) (N, seq_len) int64 and the vocabulary size."""
    tok = load_tokenizer(str(tokenizer_dir))
    enc = tok(texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
    return enc["input_ids"].long(), enc["attention_mask"].long(), len(tok)


def load_sentences(
    *, split: str, seq_len: int, kwargs: dict[str, Any], tokenizer_dir: str | Path
) -> TokenDataset:
    """One split of the sentence mix (see the module docstring).

    Args:
        split: "train" or "eval".
        seq_len: tokens per item (truncated or padded).
        kwargs: data.kwargs (corpora, words; tokenizer is resolved by the caller).
        tokenizer_dir: the tokenizer's directory, decided above the data layer
            (distill/build.sentence_tokenizer_dir: data.kwargs.tokenizer, or the packaged
            teacher's), so that data/ asks no other layer where a tokenizer lives.
    """
    unknown = sorted(set(kwargs) - set(KWARGS))
    if unknown:
        raise ValueError(
            f"data.kwargs {unknown} are not read by data.source = 'sentences'; "
            f"allowed: {', '.join(KWARGS)}"
        )
    corpora = list(kwargs.get("corpora", CORPORA))
    bad = [c for c in corpora if c not in CORPORA]
    if bad or not corpora:
        raise ValueError(
            f"data.kwargs.corpora = {corpora!r}: allowed {', '.join(CORPORA)} (at least one)"
        )
    items: list[str] = []
    if "wikipedia" in corpora:
        items += wikipedia_sentences()
    if "words" in corpora:
        items += frequent_words(int(kwargs.get("words", 5000)))
    # Every 20th item is held out: both kinds of item are in both splits.
    picked = [t for i, t in enumerate(items) if (i % 20 == 19) == (split == "eval")]
    ids, mask, vocab = tokenize(picked, tokenizer_dir=tokenizer_dir, seq_len=seq_len)
    return TokenDataset(ids, mask, vocab_size=vocab)
