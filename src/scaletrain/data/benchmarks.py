"""The text of the evaluation sets, read from gensim's bundled test data (nothing downloaded).

distill/evaluate.py scores an encoder on these; data/leakage.py keeps every text here out of
training. Read in one place, so that what is scored and what is excluded cannot drift apart.

- `word_pairs`: WordSim-353 (`wordsim353.tsv`) and SimLex-999 (`simlex999.txt`): rated
  word pairs; evaluation encodes each word alone.
- `lee_corpus`: Lee, Pincombe and Welsh's 50 news documents (`lee.cor`) and the human
  similarity of each pair (`similarities0-1.txt`).
- `polarity_data`: Pang and Lee's 200 movie-review sentences (`pang_lee_polarity.cor`),
  the sentiment probe.
- `topic_data`: 200 Usenet posts of 20 Newsgroups' alt.atheism and sci.space
  (`mini_newsgroup`), the topic probe. The file is a pickle of a scikit-learn ``Bunch``;
  it is never unpickled (that can run code): its strings are read off the pickle's opcodes
  (``pickletools.genops``), which executes nothing. Headers, quoted lines and signatures
  are removed as scikit-learn's ``remove=("headers", "footers", "quotes")`` does.
"""

from __future__ import annotations

import functools
import pickletools
import re
import zlib

import numpy as np

from scaletrain.data.corpora import _gensim_text, split_sentences
from scaletrain.data.sources import _package_file

WORD_SETS = ("wordsim353.tsv", "simlex999.txt")
_QUOTE = re.compile(r"(writes in|writes:|wrote:|says:|said:|^In article|^Quoted from|^\||^>)")


def _test_data(name: str) -> str:
    return _package_file("gensim", "test", "test_data", name)


@functools.cache
def word_pairs(name: str) -> tuple[tuple[str, str, float], ...]:
    """Rated word pairs ``(word1, word2, score)`` from a gensim file (``wordsim353.tsv``,
    ``simlex999.txt``).

    Args:
        name: file name under gensim's test data. Lines starting with ``#`` and blank lines
            are skipped; fields are split on tabs, or on whitespace when a line has no tab.
    """
    pairs = []
    for line in _gensim_text(name).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split("\t") if "\t" in line else line.split()
        if len(fields) < 3:
            raise ValueError(f"{name}: expected 'word1<TAB>word2<TAB>score', got {line!r}")
        pairs.append((fields[0].strip(), fields[1].strip(), float(fields[2])))
    return tuple(pairs)


@functools.cache
def lee_corpus() -> tuple[tuple[str, ...], np.ndarray]:
    """Lee's 50 documents and the human similarity of each pair ``i < j``, shape
    ``(1225,)``, row-major."""
    docs = tuple(d.strip() for d in _gensim_text("lee.cor").splitlines() if d.strip())
    sim = np.loadtxt(_test_data("similarities0-1.txt"))  # (50, 50), upper triangle filled
    if sim.shape != (len(docs), len(docs)):
        raise ValueError(f"lee: {len(docs)} documents but a {sim.shape} similarity matrix")
    i, j = np.triu_indices(len(docs), k=1)
    human = sim[i, j]
    human.setflags(write=False)  # cached: callers must not change it
    return docs, human


@functools.cache
def polarity_data() -> tuple[tuple[str, ...], np.ndarray]:
    """The 200 sentences of ``pang_lee_polarity.cor`` and their labels (1 = positive),
    shape ``(200,)``."""
    texts, labels = [], []
    for line in _gensim_text("pang_lee_polarity.cor").splitlines():
        if not line.strip():
            continue
        label, text = line.split(None, 1)
        if label not in ("__label__pos", "__label__neg"):
            raise ValueError(f"pang_lee_polarity.cor: unknown label {label!r}")
        texts.append(text.strip())
        labels.append(int(label == "__label__pos"))
    y = np.array(labels)
    y.setflags(write=False)
    return tuple(texts), y


@functools.cache
def topic_data() -> tuple[tuple[str, ...], np.ndarray]:
    """The posts of gensim's ``mini_newsgroup`` without headers, quotes and signatures, and
    their labels (1 = sci.space, 0 = alt.atheism), read from the pickle's opcodes without
    unpickling it (module docstring). Posts left empty are dropped."""
    with open(_test_data("mini_newsgroup"), "rb") as f:
        raw = zlib.decompress(f.read())
    texts, labels = [], []
    for op, arg, _ in pickletools.genops(raw):  # reads the opcodes; executes nothing
        if "UNICODE" not in op.name or not isinstance(arg, str):
            continue
        head, _, body = arg.partition("\n\n")
        groups = re.search(r"^Newsgroups:\s*(\S+)", head, re.M)
        if groups is None:
            continue  # a field name or a file name, not a post
        names = groups.group(1).split(",")
        space, atheism = "sci.space" in names, "alt.atheism" in names
        if space == atheism:
            raise ValueError(f"mini_newsgroup: a post in {names}, expected one of the two groups")
        text = post_body(body)
        if text:
            texts.append(text)
            labels.append(int(space))
    y = np.array(labels)
    y.setflags(write=False)
    return tuple(texts), y


def post_body(body: str) -> str:
    """A post's text as scikit-learn's remove=("footers", "quotes") leaves it, on one line:
    nothing from the last line that starts with "--" (a signature), no quoted line (">",
    "|") and no attribution ("In article ...", "... writes:")."""
    lines = body.splitlines()
    cut = [k for k, line in enumerate(lines) if line.startswith("--")]
    kept = [line for line in lines[: cut[-1] if cut else None] if not _QUOTE.search(line)]
    return " ".join(" ".join(kept).split())


@functools.cache
def benchmark_texts() -> tuple[str, ...]:
    """Every text the benchmarks and probes encode: each word of the word sets, Lee's
    documents and each of their sentences (a sentence is scored inside its document), the
    sentiment probe's sentences, the topic probe's posts."""
    words = dict.fromkeys(w for name in WORD_SETS for a, b, _ in word_pairs(name) for w in (a, b))
    docs = lee_corpus()[0]
    lee = (*docs, *(s for d in docs for s in split_sentences(d)))
    return (*words, *lee, *polarity_data()[0], *topic_data()[0])
