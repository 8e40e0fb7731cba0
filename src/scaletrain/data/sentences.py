"""Tokenized sentences for an encoder (`data.source = "sentences"`, task kind "encode").

What a sentence encoder is distilled on: English text from the installed packages, named by
data.kwargs.corpora (data/catalog.py lists them; data/corpora.py and data/kinds.py say
where each comes from, how it is cleaned and what is left out):

- "wikipedia": gensim's Wikipedia excerpt (106 articles), ~20k sentences;
- "words": the excerpt's most frequent words as items of their own, so that the student also
  learns what the teacher does with a word alone (word-similarity benchmarks encode single
  words; their own words are never among them, below);
- "news" (Lee's background news), "python-docs" (the interpreter's language reference),
  "articles" (the other English Wikipedia gensim ships);
- "questions", "instructions", "headlines", "package-docs": the kinds of sentence of the
  packages' own documentation (READMEs, docstrings, IDLE's help).

The default stays ["wikipedia", "words"]. "reviews" (IMDB reviews, an evaluation set's
data) is refused with the reason (`catalog.REMOVED`). The chosen corpora are concatenated
in the order given and deduplicated. The eval split is the items `corpora.held_out` holds
back (1 in 20, by a hash of the text: the same sentence is on the same side whatever the
mix), the train split the rest, less any item that equals or contains text evaluation
scores (`leakage.is_evaluated`, the one rule: the benchmarks' words, Lee's documents, the
probes, the held-out news and the held-out sentences of every corpus), so
distill/evaluate.py never scores text the student trained on.

data.kwargs.augment = { n = 4, p = 0.4, k = 15 } adds TinyBERT's word-replacement variants of
the training sentences of every corpus (data/augment.py), seeded by train.seed, to the
train split only; the variants pass the same rule as the sentences, and the teacher labels
them like any item (online, or once through distill-cache, which iterates the dataset).
The neighbours come from the word embeddings in the tokenizer's directory.

Items are tokenized once with the teacher's WordPiece tokenizer (a directory handed in by
the caller: data.kwargs.tokenizer resolved above this layer, by default the packaged
all-MiniLM-L6-v2's), truncated or padded to data.seq_len, with the attention mask
as the model's `attention_mask` keyword. There are no labels: the targets are zeros, the
count is examples, and the loss comes from the teacher (distill/objective.py).

data.kwargs: tokenizer (directory or 'all-MiniLM-L6-v2'), corpora (["wikipedia", "words"]),
words (how many frequent words, 5000, before the benchmarks' are excluded), augment
(absent: none).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from scaletrain.data.augment import Augment, augment, parse_augment
from scaletrain.data.catalog import READERS, REMOVED
from scaletrain.data.corpora import dedup, frequent_words, held_out
from scaletrain.data.leakage import is_evaluated
from scaletrain.data.sources import Batch, TaskSpec
from scaletrain.errors import ConfigError

CORPORA = ("wikipedia", "words", *(name for name in READERS if name != "wikipedia"))
DEFAULT_CORPORA = ("wikipedia", "words")
KWARGS = ("tokenizer", "corpora", "words", "augment")


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


def check_kwargs(kwargs: dict[str, Any]) -> tuple[list[str], int, Augment | None]:
    """data.kwargs of the sentences source checked: (corpora, words, augment).

    Raises:
        ConfigError: naming the key, the value and what is allowed.
    """
    unknown = sorted(set(kwargs) - set(KWARGS))
    if unknown:
        raise ConfigError(
            f"data.kwargs {unknown} are not read by data.source = 'sentences'; "
            f"allowed: {', '.join(KWARGS)}"
        )
    corpora = list(kwargs.get("corpora", DEFAULT_CORPORA))
    removed = [c for c in corpora if c in REMOVED]
    if removed:
        raise ConfigError(
            f"data.kwargs.corpora = {corpora!r}: {removed[0]!r} was removed: "
            f"{REMOVED[removed[0]]}; allowed: {', '.join(CORPORA)}"
        )
    bad = [c for c in corpora if c not in CORPORA]
    if bad or not corpora:
        raise ConfigError(
            f"data.kwargs.corpora = {corpora!r}: allowed {', '.join(CORPORA)} (at least one)"
        )
    return corpora, int(kwargs.get("words", 5000)), parse_augment(kwargs.get("augment"))


def items_of(corpora: Iterable[str], *, words: int) -> list[str]:
    """Every item of the named corpora, in the order given, deduplicated (both splits)."""
    return dedup(
        item
        for name in corpora
        for item in (frequent_words(words) if name == "words" else READERS[name]())
    )


def split_items(items: Iterable[str], *, split: str) -> list[str]:
    """The items of one split: "eval" the held-out ones; "train" the others, less any that
    equals or contains evaluated text (`leakage.is_evaluated`; for variants too, which
    arrive after the split)."""
    if split == "eval":
        return [t for t in items if held_out(t)]
    return [t for t in items if not held_out(t) and not is_evaluated(t)]


def split_texts(
    kwargs: dict[str, Any], *, split: str, seed: int, tokenizer_dir: str | Path | None
) -> list[str]:
    """The text of one split's items: the split's share of the corpora, and for "train"
    with data.kwargs.augment the variants of its sentences after them.

    Args:
        kwargs: data.kwargs (corpora, words, augment).
        split: "train" or "eval".
        seed: the run's seed, which seeds the augmentation.
        tokenizer_dir: where the word embeddings for the augmentation are.
    """
    corpora, words, options = check_kwargs(kwargs)
    texts = split_items(items_of(corpora, words=words), split=split)
    if options is None or split != "train":
        return texts
    if tokenizer_dir is None:
        raise ConfigError(
            "data.kwargs.augment reads the word embeddings beside the tokenizer, but no "
            "tokenizer directory was given (load_dataset(tokenizer_dir=...))"
        )
    # Sentences only: a single-word item's variant is just another word.
    sentences = [t for t in texts if " " in t]
    variants = augment(sentences, options=options, seed=seed, model_dir=tokenizer_dir)
    return texts + split_items(variants, split="train")  # held-out or scored text: dropped


def load_sentences(
    *,
    split: str,
    seq_len: int,
    kwargs: dict[str, Any],
    tokenizer_dir: str | Path,
    seed: int = 0,
) -> TokenDataset:
    """One split of the sentence mix (see the module docstring).

    Args:
        split: "train" or "eval".
        seq_len: tokens per item (truncated or padded).
        kwargs: data.kwargs (corpora, words, augment; tokenizer is resolved by the caller).
        tokenizer_dir: the tokenizer's directory, decided above the data layer
            (distill/build.sentence_tokenizer_dir: data.kwargs.tokenizer, or the packaged
            teacher's), so that data/ asks no other layer where a tokenizer lives; with
            augment, its safetensors give the word embeddings too.
        seed: the run's seed (train.seed), which seeds the augmentation.
    """
    texts = split_texts(kwargs, split=split, seed=seed, tokenizer_dir=tokenizer_dir)
    ids, mask, vocab = tokenize(texts, tokenizer_dir=tokenizer_dir, seq_len=seq_len)
    return TokenDataset(ids, mask, vocab_size=vocab)
