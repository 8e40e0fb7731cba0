"""Sentences of other kinds than narrative prose, from the packages' documentation.

The first corpora (data/corpora.py) are narrative: Wikipedia, news, the language
reference. A general-purpose encoder is also asked questions, given instructions and shown
titles, so these corpora sort the sentences of the installed packages' own documentation
(data/package_text.py reads it) into kinds, each a name of `data.kwargs.corpora`:

- "questions": a sentence ending in '?' (or a heading that is one), 3 to 64 words;
- "instructions": an imperative sentence, 3 to 64 words: its first word a base-form verb
  of IMPERATIVE_VERBS ("Return the sum.", "Install the package.") or "Please", "Do not",
  "Don't", and no "is", "are", "of", ... among the next two words ("Return values are",
  "Type of": a noun, not an order). A heuristic without a part-of-speech tagger: a few
  nouns pass ("Set containing the letters");
- "headlines": a heading or title of 3 to 16 words, no final full stop: README headings,
  each distribution's Summary line, IDLE's headings, the section headings of gensim's two
  English Wikipedia dumps (fewer words is a label: "Installation", "See also");
- "package-docs": every other sentence of the same text, 5 to 64 words: declarative
  technical prose ("Compute ..." is an instruction, "Computes ..." a statement).

Each sentence is cut by `corpora.split_sentences`, normalised and passes
`corpora.looks_english` (headlines without its function-word share: titles have few); a
kind is deduplicated on the case-folded text. `corpora.held_out` holds out 1 in 20 of each
kind by the hash of its text: the held-out sentences `scaletrain eval` scores per kind.

What is read, all of it files of distributions pinned in requirements-dev.txt (a fixed
list, so installing another package changes nothing; `source_versions()` gives the
versions; one not installed is skipped), plus one file of the interpreter:

- READMEs: the METADATA of README_DISTRIBUTIONS;
- docstrings: DOCSTRING_DISTRIBUTIONS, every kind; QUESTION_DISTRIBUTIONS, questions alone,
  from docstrings and comments (developers ask in comments, rarely in docs; reading every
  kind of torch's and transformers' 100 MB of docstrings would double the corpus);
- idlelib/help.html: IDLE's chapter of Python's documentation, the one part of Python's
  manual the interpreter ships besides pydoc's topics (the "python-docs" corpus); like
  that corpus it follows the interpreter's version;
- the headings of gensim's enwiki dumps (the "wikipedia" and "articles" text).

No pinned package ships dialogue or short reviews: the chat examples in docstrings are a
few lines of code, and the only reviews are evaluation data (Pang and Lee's sentences, the
sentiment probe) or an evaluation set's (gensim's alldata-id-10.txt, IMDB reviews: MTEB's
IMDB classification). Neither is a corpus here.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Iterable, Iterator

from scaletrain.data import package_text as text
from scaletrain.data.corpora import dedup, looks_english, normalise, split_sentences
from scaletrain.data.sources import WIKI_FILE

KINDS = ("questions", "instructions", "headlines", "package-docs")
# Libraries whose docstrings are user-facing English prose; every kind is read from them.
DOCSTRING_DISTRIBUTIONS = (
    "scikit-learn",
    "numpy",
    "networkx",
    "gensim",
    "huggingface_hub",
    "sentence-transformers",
    "rich",
    "click",
    "typer",
    "tqdm",
    "Jinja2",
    "joblib",
    "fsspec",
    "Werkzeug",
    "Markdown",
)
# Questions alone, from docstrings and comments: where the most of them are.
QUESTION_DISTRIBUTIONS = (
    "torch",
    "sympy",
    "scipy",
    "matplotlib",
    "transformers",
    "pydantic",
    "PyYAML",
    "fonttools",
    "regex",
    "mpmath",
    "tensorboard",
    "Pygments",
    "zarr",
    "pillow",
    "pyspark",
)
README_DISTRIBUTIONS = (
    *DOCSTRING_DISTRIBUTIONS,
    *QUESTION_DISTRIBUTIONS,
    *"""tokenizers safetensors pyarrow pytest pytest-timeout pytest-xdist pluggy packaging
    python-dateutil smart_open threadpoolctl narwhals annotated-types cloudpickle wrapt
    ruff httpx2 h11 anyio idna truststore shellingham pyparsing tomli_w markdown-it-py
    mkdocs mkdocs-material""".split(),
)
WIKI_DUMPS = (WIKI_FILE, "enwiki-table-markup.xml.bz2")
TITLE_WORDS = (3, 16)  # fewer is a label ("Installation"), more a sentence
SHORT_WORDS = 3  # questions and instructions are short: "Are we done?", "Install the package."

IMPERATIVE_VERBS = frozenset(
    """add adjust allow apply assign avoid build calculate call change check choose clear
    click clone close collect combine compare compute configure consider construct convert
    copy count create declare decode define delete describe detect determine disable
    download draw drop enable encode ensure enter estimate evaluate execute exit expand
    export extend extract fetch fill find fit fix follow format generate get give go
    handle ignore import include increase initialize initialise insert inspect install
    iterate join keep let load look make mark merge modify move note open override parse
    pass perform pick place plot press print provide put raise read recompute reduce
    refer register reload remember remove rename render repeat replace request reset
    resize restart restore retrieve return reuse run save search see select send set
    show skip sort specify split start stop store submit subtract switch take tell test
    transform try turn type update upgrade upload use validate verify visit wait wrap
    write""".split()
)
# After the opener, these say it was a noun ("Return values are", "Type of the data").
_NOT_IMPERATIVE = frozenset("is are was were has have had can will may must does of".split())


# ---------------------------------------------------------------------------- the rules


def is_instruction(sentence: str) -> bool:
    """An imperative sentence (module docstring): a verb of IMPERATIVE_VERBS, "Please",
    "Do not" or "Don't" first, and no "is", "are", "of", ... among the next two words."""
    words = [w.strip(".,;:!?()\"'").lower() for w in sentence.split()]
    opener = words[:1] and (
        words[0] in IMPERATIVE_VERBS
        or words[0] in ("please", "don't")
        or words[:2] == ["do", "not"]
    )
    return bool(opener) and not _NOT_IMPERATIVE.intersection(words[1:3])


def classify(sentence: str) -> str | None:
    """The kind of a normalised sentence of running text ("questions", "instructions" or
    "package-docs"), or None when it is no English of that kind (too short, code, ...)."""
    if sentence.endswith("?"):
        return "questions" if looks_english(sentence, min_words=SHORT_WORDS) else None
    if is_instruction(sentence):
        return "instructions" if looks_english(sentence, min_words=SHORT_WORDS) else None
    return "package-docs" if looks_english(sentence) else None


def is_title(line: str) -> bool:
    """A heading that makes a headline: TITLE_WORDS words, a capital first, no final full
    stop, and `looks_english` but for its function-word share (titles have few)."""
    low, high = TITLE_WORDS
    return (
        low <= len(line.split()) <= high
        and line[:1].isupper()
        and not line.endswith(".")
        and looks_english(line, min_words=low, function_share=0.0)
    )


def source_versions() -> dict[str, str | None]:
    """The installed version of each distribution read (None: not installed, skipped): the
    corpora depend on these."""
    names = dict.fromkeys((*README_DISTRIBUTIONS, *QUESTION_DISTRIBUTIONS))
    return {name: _version(name) for name in names}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _installed(names: Iterable[str]) -> list[str]:
    """The names that are installed, in order: one that is not (an install without the
    development pins, say) is skipped, its text missing from the corpora, not an error."""
    return [name for name in names if _version(name) is not None]


# ---------------------------------------------------------------------------- corpora


def _sort(kinds: dict[str, list[str]], block: text.Block, *, questions_only: bool) -> None:
    """Add a block's sentences to their kinds: a heading is a headline or a question."""
    body, heading = block
    sentences = [normalise(body).rstrip(":")] if heading else map(normalise, split_sentences(body))
    for sentence in sentences:
        kind = classify(sentence) if not heading or sentence.endswith("?") else "headlines"
        if kind == "headlines" and not is_title(sentence):
            continue
        if kind and (kind == "questions" or not questions_only):
            kinds[kind].append(sentence)


@functools.cache
def _kinds() -> dict[str, tuple[str, ...]]:
    """kind -> its sentences, each the first of its text, in source order."""
    kinds: dict[str, list[str]] = {kind: [] for kind in KINDS}
    for block, questions_only in _sourced_blocks():
        _sort(kinds, block, questions_only=questions_only)
    return {kind: tuple(dedup(items)) for kind, items in kinds.items()}


def _sourced_blocks() -> Iterator[tuple[text.Block, bool]]:
    """(block, questions_only) of every source, in a fixed order (module docstring)."""
    for name in _installed(README_DISTRIBUTIONS):
        yield from ((b, False) for b in text.readme(name))
    yield from ((b, False) for b in text.idle_help())
    for dump in WIKI_DUMPS:
        yield from ((b, False) for b in text.wiki_headings(dump))
    for name in _installed((*DOCSTRING_DISTRIBUTIONS, *QUESTION_DISTRIBUTIONS)):
        only = name not in DOCSTRING_DISTRIBUTIONS
        for path in text.python_files(name):
            docs, questions = text.module_text(path)
            # Questions alone: a docstring without '?' is skipped unread (most of torch's).
            prose = (p for doc in docs if not only or "?" in doc for p in text.docstring_prose(doc))
            yield from (((p, False), only) for p in (*prose, *questions))


def kind_sentences(kind: str) -> tuple[str, ...]:
    """The sentences of one kind (KINDS), deduplicated, in source order."""
    return _kinds()[kind]
