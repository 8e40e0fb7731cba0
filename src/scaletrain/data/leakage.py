"""The one rule that keeps evaluated text out of training.

Evaluated text (`evaluated_texts`) is every item any evaluation scores: the WordSim353 and
SimLex-999 words, Lee's documents and their sentences, the sentiment probe's sentences, the
topic probe's posts (data/benchmarks.py), the held-out news `scaletrain eval` has always
scored (`corpora.evaluation_news`) and the held-out sentences of every corpus
(`catalog.held_out_sentences`), whatever mix a run trains on.

The rule (`is_evaluated`), on the words of the case-folded, normalised text (its runs of
letters and digits, `sentence_key` then `\\w+`): a training item is excluded when

- its words equal an evaluated item's words ("Exit." is the topic probe's "exit"), or
- an evaluated item of two or more words (a sentence, a document, a title) appears in its
  words as a contiguous run: the training item contains it, on word boundaries.

A single evaluated word is matched as a whole item only (a training item that IS that
word): the word benchmarks encode each word alone, and "contains" would exclude nearly
every sentence (every one with "the", "money" or "king"). Matching words rather than
characters makes the rule blind to punctuation and spacing, so "hello, world" cannot slip
past "hello world"; it excludes at least what a substring match on word boundaries would.

data/sentences.py applies it to every item of every training mix, TinyBERT's variants
included (they are drawn after the split), with `corpora.held_out` (the split's own rule).
It is a pure function of the text: no corpus, order or process changes what it excludes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from scaletrain.data.benchmarks import benchmark_texts
from scaletrain.data.catalog import held_out_sentences
from scaletrain.data.corpora import evaluation_news, sentence_key

_WORD = re.compile(r"\w+")
Words = tuple[str, ...]


def words_of(text: str) -> Words:
    """The words the rule compares: runs of letters and digits of the case-folded key."""
    return tuple(_WORD.findall(sentence_key(text)))


class EvaluatedIndex:
    """Evaluated items indexed for `excludes`: single words in a set, longer items by their
    first two words, so that a training item of n words costs n - 1 look-ups."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.singles: set[str] = set()
        self.runs: dict[Words, list[Words]] = {}
        for text in texts:
            words = words_of(text)
            if len(words) == 1:
                self.singles.add(words[0])
            elif words:
                self.runs.setdefault(words[:2], []).append(words)

    def excludes(self, item: str) -> bool:
        """The rule (module docstring): equal to a single evaluated word, or containing an
        evaluated item of two or more words as a run of its own words."""
        words = words_of(item)
        if len(words) == 1:
            return words[0] in self.singles
        for i in range(len(words) - 1):
            for run in self.runs.get(words[i : i + 2], ()):
                if words[i : i + len(run)] == run:
                    return True
        return False


@functools.cache
def evaluated_texts() -> tuple[str, ...]:
    """Every item any evaluation scores (module docstring)."""
    return (*benchmark_texts(), *evaluation_news(), *held_out_sentences())


@functools.cache
def _index() -> EvaluatedIndex:
    return EvaluatedIndex(evaluated_texts())


def is_evaluated(item: str) -> bool:
    """Whether a would-be training item equals or contains evaluated text (the rule)."""
    return _index().excludes(item)
