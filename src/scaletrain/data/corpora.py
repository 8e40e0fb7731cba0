"""English sentences from the installed packages, cleaned, deduplicated and split by a hash.

Everything here is read from files that installed packages ship; nothing is downloaded.
Each corpus is one function returning its sentences in text order (data/catalog.py maps
the names of `data.kwargs.corpora` to them; data/kinds.py adds the questions,
instructions, headlines and technical prose of the packages' documentation):

- "wikipedia" (`wikipedia_sentences`): gensim's shortened English Wikipedia dump, 106
  articles with markup stripped (the `wikitext` source's text), ~20k sentences.
- "news" (`news_sentences`): lee_background.cor, 300 ABC news stories (Lee, Pincombe and
  Welsh 2005's background corpus: the unlabelled text their benchmark's authors gave for
  training, not its 50 scored documents, lee.cor), less the 300 sentences evaluation
  scores (below).
- "python-docs" (`python_doc_sentences`): the running interpreter's
  pydoc_data/topics.py, the language reference's topics as plain text; its prose only.
- "articles" (`article_sentences`): the English Wikipedia gensim ships beside the excerpt:
  enwiki-table-markup.xml.bz2 (5 more articles) and para2para_text1/2.txt (New York,
  Berlin).
- "words" (`frequent_words`): not sentences but the excerpt's most frequent words, items
  of their own (word-similarity benchmarks encode single words, so the student learns what
  the teacher does with a word alone; the benchmarks' own words are excluded, below).

What evaluation reads is never training text. distill/evaluate.py scores lee.cor (Lee's 50
documents), pang_lee_polarity.cor (the sentiment probe), mini_newsgroup (the topic probe),
the word-pair files (data/benchmarks.py reads them all), the news sentences reserved here
(`evaluation_news`) and the held-out part of every corpus; none of those files is a
corpus, and data/leakage.py drops any training item that equals or contains one of their
items however it arrived (the same sentence in two files, a benchmark word among the
frequent words). No corpus reads the data of a well-known evaluation set either, even one
a package ships: alldata-id-10.txt (10 IMDB reviews: MTEB's IMDB classification) was the
"reviews" corpus and is no longer read. Files left out on purpose:
varembed_lee_subcorpus.cor (4 of lee.cor's documents: evaluation text),
head500.noblanks.cor (Wikipedia stemmed with stop words removed, "anarch greek rule stem
archon": not sentences), toy-data.txt (text8: no punctuation, no sentence ends),
questions-words.txt (the word-analogy benchmark), mini_newsgroup and pang_lee_polarity.cor
(the probes), crime-and-punishment.txt and bgwiki (Russian, Bulgarian), the word lists
and toy corpora.

Cleaning, for the new corpora: split into sentences after '.', '!' or '?' (not after
'Dr.' or 'U.S.'), whitespace normalised (NFC, single spaces), 5 to 64 words, and
`looks_english`: no code or markup characters, mostly alphabetic words, and enough English
function words (code, tables, reference lists and non-English text have few). "wikipedia"
keeps the reader it has always had (5 to 64 words, split before a capital) so that the
distillation recipe trains on the same sentences as before. A mix of corpora is
deduplicated (`dedup`) on the case-folded text: the teacher's tokenizer is uncased, so
"The war" and "the war" are one item to it.

Held out: `held_out(sentence)` is true for 1 sentence in 20, decided by a BLAKE2 hash of
that same case-folded key. A pure function of the text, so a sentence is on the same side
whichever corpora are mixed, in whatever order, and copies of it in two corpora cannot
straddle the split. The held-out sentences are the eval split of `data.source =
"sentences"` and the text evaluation may use (`catalog.held_out_sentences`); training
never sees them. News also reserves RESERVED_NEWS sentences, the first of each story
(round-robin over the stories; a few stories repeat): the set `scaletrain eval` has always
scored as "held-out news" (BENCHMARKS.md), kept so that its numbers stay comparable;
`evaluation_news` gives those, then the news the hash holds out.
"""

from __future__ import annotations

import bz2
import collections
import functools
import hashlib
import io
import re
import unicodedata
import xml.etree.ElementTree as ET
from collections.abc import Iterable

from scaletrain.data.sources import _package_file, _strip_wiki_markup, _wikitext_bytes

HELD_OUT_ONE_IN = 20
MIN_WORDS, MAX_WORDS = 5, 64  # a word alone is the "words" corpus; 64 words pass seq_len 64
RESERVED_NEWS = 300  # news sentences evaluation has always scored (evaluate.held_out_sentences)

# English closed-class words: articles, pronouns, prepositions, conjunctions, auxiliaries.
# Prose is ~40% these; code, tables, reference lists, stemmed text and other languages have
# few. data/augment.py never replaces them (a neighbour of "the" makes broken grammar).
FUNCTION_WORDS = frozenset(
    """a an the this that these those some any each every no none all both either neither
    another other such i me my mine myself we us our ours ourselves you your yours yourself
    he him his himself she her hers herself it its itself they them their theirs themselves
    one who whom whose which what whatever whoever where when why how
    is are was were be been being am do does did done doing has have had having
    will would shall should can could may might must ought
    of in on at by for with from to into onto upon about above below over under between
    among through during before after since until till against without within along across
    behind beyond near toward towards via per around throughout despite except like unlike
    and or but nor so yet if then than because although though while whereas unless whether
    as also only very too more most less least much many few not there here out up down off
    again once just even still ever never always often now""".split()
)
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr st jr sr gen col lt sen rep prof gov sgt capt no vs mt".split()
)
_MARKUP = re.compile(r"[=_{}\[\]<>|\\`~^#@*]|::|\(\)|->|\w\.[a-z_]{2,}")  # code, markup
_ASCII_LETTERS = re.compile(r"[A-Za-z]")
_WORD = re.compile(r"[a-z]{3,}")
_WIKI_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_CITATION = re.compile(r"\[\d+\]")
_UNDERLINE = re.compile(r"\s*([*=\-~^])\1+\s*")  # a reST heading's underline


# ---------------------------------------------------------------------------- the rules


def sentence_key(sentence: str) -> str:
    """What two items must share to be one: case-folded text with single spaces."""
    return " ".join(sentence.casefold().split())


def held_out(sentence: str) -> bool:
    """True for 1 sentence in HELD_OUT_ONE_IN, by a hash of its key: stable whatever the
    corpora, their order or the process (Python's own hash() is salted per process)."""
    digest = hashlib.blake2b(sentence_key(sentence).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELD_OUT_ONE_IN == 0


def normalise(sentence: str) -> str:
    """NFC, whitespace runs collapsed to one space, no leading or trailing space."""
    return " ".join(unicodedata.normalize("NFC", sentence).split())


def split_sentences(text: str) -> list[str]:
    """Split after '.', '!' or '?' and whitespace before a capital, digit or quote; rejoin
    after an abbreviation ('Dr. Ahmad', 'U.S. State'), where the split was no sentence end."""
    pieces = re.split(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(“‘])", text.strip())
    sentences: list[str] = []
    for piece in pieces:
        last = sentences[-1].split()[-1] if sentences else ""
        stem = last.rstrip(".").lower()
        if sentences and (stem in _ABBREVIATIONS or re.fullmatch(r"(?:[A-Za-z]\.)+", last)):
            sentences[-1] += " " + piece
        else:
            sentences.append(piece)
    return sentences


def looks_english(
    sentence: str, *, min_words: int = MIN_WORDS, function_share: float = 1 / 6
) -> bool:
    """English prose of MIN_WORDS to MAX_WORDS words: no code or markup characters, at least
    3 words in 4 alphabetic (hyphens and apostrophes allowed), at least 1 in 6 an English
    function word, and letters mostly ASCII (a few accented names pass, other scripts not).

    Args:
        sentence: normalised text.
        min_words: fewer words is no sentence (questions and instructions allow 3).
        function_share: the least share of function words (titles have few: 0).
    """
    tokens = sentence.split()
    if not min_words <= len(tokens) <= MAX_WORDS or _MARKUP.search(sentence):
        return False
    words = [t.strip(".,;:!?()\"'“”‘’") for t in tokens]
    alphabetic = sum(w.replace("-", "").replace("'", "").isalpha() for w in words)
    function = sum(w.lower() in FUNCTION_WORDS for w in words)
    letters = sum(c.isalpha() for c in sentence)
    ascii_letters = len(_ASCII_LETTERS.findall(sentence))
    return (
        alphabetic >= 0.75 * len(tokens)
        and function >= function_share * len(tokens)
        and ascii_letters >= 0.95 * letters
    )


def clean(sentences: Iterable[str]) -> list[str]:
    """Normalised sentences that `looks_english` accepts, the first of each text, in order
    (lee_background.cor repeats some stories)."""
    return dedup(s for s in map(normalise, sentences) if looks_english(s))


def dedup(items: Iterable[str]) -> list[str]:
    """The first item of each `sentence_key`, in order."""
    seen: set[str] = set()
    out = []
    for item in items:
        key = sentence_key(item)
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


# ---------------------------------------------------------------------------- corpora


def _gensim_text(name: str) -> str:
    """A gensim test-data file as text (lee.cor and pang_lee_polarity.cor are cp1252), read
    without importing gensim (~0.8 s)."""
    with open(_package_file("gensim", "test", "test_data", name), "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252")


@functools.cache
def wikipedia_sentences() -> tuple[str, ...]:
    """Sentences of 5 to 64 words from gensim's Wikipedia excerpt, in text order (~20k).

    The reader the sentences source has always had (split before a capital, no English
    filter), so that recipes written for it keep their sentences."""
    out = []
    for paragraph in _wikitext_bytes().decode("utf-8").split("\n\n"):
        for s in _WIKI_END.split(paragraph.replace("\n", " ")):
            if MIN_WORDS <= len(s.split()) <= MAX_WORDS:
                out.append(s.strip())
    return tuple(out)


@functools.cache
def frequent_words(n: int) -> tuple[str, ...]:
    """The n most frequent lower-case words (3+ letters) of the Wikipedia excerpt, most
    frequent first."""
    counts = collections.Counter(_WORD.findall(_wikitext_bytes().decode("utf-8").lower()))
    return tuple(w for w, _ in counts.most_common(n))


@functools.cache
def _news_by_story() -> tuple[tuple[str, ...], ...]:
    """lee_background.cor's stories, each as its sentences of 5+ words, raw."""
    return tuple(
        tuple(s for s in split_sentences(d) if len(s.split()) >= MIN_WORDS)
        for d in _gensim_text("lee_background.cor").splitlines()
        if d.strip()
    )


@functools.cache
def _news_round_robin() -> tuple[str, ...]:
    """The distinct news sentences, round-robin over the stories (every story's first, then
    every second, ...), so that a prefix covers many stories: the order evaluation reads."""
    stories = _news_by_story()
    seen: dict[str, None] = {}
    for k in range(max(map(len, stories))):
        for story in stories:
            if k < len(story):
                seen.setdefault(story[k], None)
    return tuple(seen)


@functools.cache
def news_sentences() -> tuple[str, ...]:
    """Sentences of lee_background.cor's 300 news stories, in text order, less the
    RESERVED_NEWS that evaluation scores (`evaluation_news`), cleaned."""
    reserved = set(_news_round_robin()[:RESERVED_NEWS])
    kept = (s for story in _news_by_story() for s in story if s not in reserved)
    # "[were]", "<i>Diplomacy</i>": an editor's insertion and a title's tags, around English.
    return tuple(clean(re.sub(r"</?\w+>|[\[\]]", "", s) for s in kept))


def _doc_block_text(block: str) -> str:
    """One block of pydoc's text as one line: heading underlines dropped, a word broken at a
    line end ("User-\\ndefined") rejoined, a bullet mark and *emphasis* marks removed."""
    lines = [ln.strip() for ln in block.splitlines() if not _UNDERLINE.fullmatch(ln)]
    text = re.sub(r"(?<=\w-)\n", "", "\n".join(lines)).replace("\n", " ")
    text = re.sub(r"^(?:[*\-]|\d+\.)\s+", "", text)
    return re.sub(r"\*(\w[^*]*?)\*", r"\1", text)


@functools.cache
def python_doc_sentences() -> tuple[str, ...]:
    """The prose of the interpreter's own language reference (pydoc_data/topics.py, the
    text `help("assignment")` shows), block by block; code falls to `looks_english`."""
    from pydoc_data.topics import topics  # stdlib; a dict literal, imported in ~20 ms

    blocks = (b for text in topics.values() for b in re.split(r"\n\s*\n", text))
    return tuple(clean(s for b in blocks for s in split_sentences(_doc_block_text(b))))


@functools.cache
def article_sentences() -> tuple[str, ...]:
    """Sentences of the English Wikipedia gensim ships beside the excerpt: the 5 articles of
    enwiki-table-markup.xml.bz2 (markup stripped as for the excerpt) and
    para2para_text1/2.txt (New York, Berlin; '[1]' citation marks removed)."""
    path = _package_file("gensim", "test", "test_data", "enwiki-table-markup.xml.bz2")
    with open(path, "rb") as f:
        xml = bz2.decompress(f.read())
    texts = []
    for _, element in ET.iterparse(io.BytesIO(xml), events=("end",)):
        if element.tag.endswith("}page") and element.findtext("{*}ns") == "0":
            texts.append(_strip_wiki_markup(element.findtext("{*}revision/{*}text") or ""))
            element.clear()
    texts += [_gensim_text(f"para2para_text{i}.txt") for i in (1, 2)]
    out = []
    for text in texts:
        for paragraph in re.split(r"\n\s*\n", _CITATION.sub("", text)):
            out += split_sentences(paragraph.replace("\n", " "))
    return tuple(clean(out))


# ---------------------------------------------------------------------------- evaluation


@functools.cache
def evaluation_news() -> tuple[str, ...]:
    """News evaluation may read, raw, in round-robin order over the stories: the first
    RESERVED_NEWS (each story's first sentence, a few second ones where stories repeat:
    what `scaletrain eval` has always scored), then those of the rest `held_out` holds back.
    Training reads none of them."""
    pool = _news_round_robin()
    return pool[:RESERVED_NEWS] + tuple(s for s in pool[RESERVED_NEWS:] if held_out(s))
