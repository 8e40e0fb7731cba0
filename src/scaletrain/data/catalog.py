"""The corpora `data.kwargs.corpora` may name, and those it may no longer name.

Each corpus is a function returning its sentences in text order (data/corpora.py: narrative
text from gensim's test data and pydoc; data/kinds.py: questions, instructions, headlines
and technical prose from the packages' documentation). "words" (the Wikipedia excerpt's
most frequent words, `corpora.frequent_words`) takes a size and is mixed in by
data/sentences.py.

`held_out_sentences(names)` is each corpus's held-out part (1 in 20 by `corpora.held_out`),
what `scaletrain eval` scores per kind of text; data/leakage.py keeps every one of them out
of every training mix.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from scaletrain.data.corpora import (
    article_sentences,
    dedup,
    held_out,
    news_sentences,
    python_doc_sentences,
    wikipedia_sentences,
)
from scaletrain.data.kinds import KINDS, kind_sentences

READERS: dict[str, Callable[[], tuple[str, ...]]] = {
    "wikipedia": wikipedia_sentences,
    "news": news_sentences,
    "python-docs": python_doc_sentences,
    "articles": article_sentences,
    **{kind: functools.partial(kind_sentences, kind) for kind in KINDS},
}
# Corpora taken out, and why: the ConfigError a recipe naming one gets.
REMOVED = {
    "reviews": (
        "it read gensim's alldata-id-10.txt, 10 IMDB movie reviews: the data of an "
        "evaluation set (MTEB's IMDB classification), which no corpus may train on, so that "
        "evaluation stays unseen"
    ),
}


def held_out_sentences(corpora: Iterable[str] = tuple(READERS)) -> list[str]:
    """The held-out sentences of the named corpora (`corpora.held_out`), deduplicated, in
    order: text evaluation may score and training never reads.

    Args:
        corpora: names in READERS.
    """
    return [s for s in dedup(s for name in corpora for s in READERS[name]()) if held_out(s)]
