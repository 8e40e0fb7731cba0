"""TinyBERT's data augmentation (data/augment.py) and how the sentences source uses it.

The issue's must-show: variants differ from their source, keep its length, and the same seed
gives the same variants. Around it: another seed gives other variants, p = 0 gives the source
back, only whole words the teacher has a row for are replaced and by their neighbours, the
option is checked naming the key, and no training item (variants included) is text
evaluation reads. Quick: ~300 news sentences, the packaged teacher's embeddings read once.
"""

from __future__ import annotations

import random

import pytest

from scaletrain.data.augment import (
    _TOKEN,
    Augment,
    augment,
    augment_sentence,
    nearest_neighbours,
    parse_augment,
    variants_of,
)
from scaletrain.data.catalog import held_out_sentences
from scaletrain.data.corpora import FUNCTION_WORDS, held_out, sentence_key
from scaletrain.data.leakage import is_evaluated
from scaletrain.data.sentences import items_of, load_tokenizer, split_items, split_texts
from scaletrain.distill.teacher import packaged_minilm_dir
from scaletrain.errors import ConfigError

OPTIONS = Augment(n=4, p=0.4, k=15)  # the config example


@pytest.fixture(scope="module")
def teacher_dir():
    return packaged_minilm_dir()


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    train = split_items(items_of(["news"], words=0), split="train")
    return train[:300]


@pytest.fixture(scope="module")
def neighbours(teacher_dir, sentences) -> dict[str, tuple[str, ...]]:
    words = {w.strip(".,;:!?()\"'").lower() for s in sentences for w in s.split()}
    return nearest_neighbours(words, model_dir=teacher_dir, k=OPTIONS.k)


def _variants(sentences, neighbours, *, seed: int, p: float = OPTIONS.p) -> dict[str, list[str]]:
    return {
        s: variants_of(s, neighbours=neighbours, n=OPTIONS.n, p=p, seed=seed) for s in sentences
    }


def test_variants_differ_from_their_source_keep_its_length_and_follow_the_seed(
    sentences, neighbours, teacher_dir
):
    tok = load_tokenizer(str(teacher_dir))
    first = _variants(sentences, neighbours, seed=0)
    assert first == _variants(sentences, neighbours, seed=0)  # same seed, same variants
    assert sum(map(len, first.values())) > 3 * len(sentences)  # most sentences get ~4
    for source, variants in first.items():
        assert len({sentence_key(v) for v in variants}) == len(variants)  # no repeats
        for v in variants:
            assert sentence_key(v) != sentence_key(source)
            assert len(v.split()) == len(source.split())  # one word for one word
            # The token count is kept too, with this (uncased) tokenizer: a single-piece
            # whole word is replaced by a single-piece whole word, punctuation kept. A cased
            # tokenizer could cut a capitalised replacement into more pieces.
            assert len(tok(v)["input_ids"]) == len(tok(source)["input_ids"]), (source, v)


def test_another_seed_gives_other_variants(sentences, neighbours):
    a = _variants(sentences, neighbours, seed=0)
    b = _variants(sentences, neighbours, seed=1)
    differing = sum(a[s] != b[s] for s in sentences if a[s] or b[s])
    assert differing > 0.9 * len(sentences)


def test_p_zero_gives_the_source_back(sentences, neighbours):
    rng = random.Random(0)
    for s in sentences:
        assert augment_sentence(s, neighbours=neighbours, p=0.0, rng=rng) == s
    assert not any(_variants(sentences, neighbours, seed=0, p=0.0).values())


def test_only_whole_words_are_replaced_and_by_their_neighbours(sentences, neighbours):
    """p = 1: every replaceable word changes, to one of its k neighbours in its own case,
    its punctuation kept; function words, numbers and pieces of words never change."""
    rng = random.Random(0)
    replaced = 0
    for s in sentences[:100]:
        v = augment_sentence(s, neighbours=neighbours, p=1.0, rng=rng)
        for old, new in zip(s.split(" "), v.split(" ")):
            m = _TOKEN.fullmatch(old)
            word = m.group(2) if m else None
            plain = word and (word.islower() or word.istitle() or word.isupper())
            if not (plain and word.lower() in neighbours):
                assert new == old
                continue
            replaced += 1
            n = _TOKEN.fullmatch(new)
            assert (n.group(1), n.group(3)) == (m.group(1), m.group(3))  # punctuation kept
            assert n.group(2).lower() in neighbours[word.lower()]
            assert n.group(2)[0].isupper() == word[0].isupper()  # "Sydney" -> "Melbourne"
    assert replaced > 500
    assert not FUNCTION_WORDS & set(neighbours)
    assert not any(FUNCTION_WORDS & set(c) for c in neighbours.values())


def test_nearest_neighbours_are_the_teachers_related_words(teacher_dir):
    found = nearest_neighbours(["king", "good", "the", "xqzw", "river"], model_dir=teacher_dir, k=5)
    assert set(found) == {"king", "good", "river"}  # a function word and a non-word: none
    assert "queen" in found["king"] and "king" not in found["king"]
    assert all(len(c) == 5 for c in found.values())


def test_augment_drops_variants_equal_to_any_sentence(sentences, teacher_dir):
    out = augment(sentences[:50], options=OPTIONS, seed=0, model_dir=teacher_dir)
    assert out == augment(sentences[:50], options=OPTIONS, seed=0, model_dir=teacher_dir)
    keys = [sentence_key(v) for v in out]
    assert len(set(keys)) == len(keys) and not set(keys) & {sentence_key(s) for s in sentences}
    assert 150 < len(out) <= 200


def test_no_training_item_is_held_out_or_scored_variants_included(teacher_dir):
    kwargs = {"corpora": ["news", "questions", "python-docs"], "augment": {"n": 4}}
    train = split_texts(kwargs, split="train", seed=0, tokenizer_dir=teacher_dir)
    no_aug = split_texts({"corpora": kwargs["corpora"]}, split="train", seed=0, tokenizer_dir=None)
    assert len(train) > 4 * len(no_aug)  # the variants are there
    keys = {sentence_key(t) for t in train}
    assert not any(held_out(t) for t in train)
    assert not any(map(is_evaluated, train))
    assert not keys & {sentence_key(t) for t in held_out_sentences(kwargs["corpora"])}
    # the eval split gets no variants
    eval_split = split_texts(kwargs, split="eval", seed=0, tokenizer_dir=teacher_dir)
    assert eval_split == split_texts(
        {"corpora": kwargs["corpora"]}, split="eval", seed=0, tokenizer_dir=None
    )


def test_the_run_seed_reaches_the_variants_through_the_loader(teacher_dir):
    from scaletrain.data.loader import load_dataset

    def rows(seed: int):
        return load_dataset(
            "sentences",
            split="train",
            seq_len=32,
            seed=seed,
            kwargs={"corpora": ["headlines"], "augment": {"n": 2}},
            tokenizer_dir=teacher_dir,
        ).input_ids

    a, b = rows(0), rows(1)
    assert a.equal(rows(0)) and not a.equal(b)


@pytest.mark.parametrize(
    ("value", "expect"),
    [
        ({"n": 0}, "data.kwargs.augment.n = 0: allowed an integer from 1 to 64"),
        ({"p": 1.5}, "data.kwargs.augment.p = 1.5: allowed a number from 0.0 to 1.0"),
        ({"k": "15"}, "data.kwargs.augment.k = '15': allowed an integer from 1 to 100"),
        ({"n": True}, "data.kwargs.augment.n = True"),
        ({"m": 3}, r"data.kwargs.augment has \['m'\]: allowed keys are n"),
        (4, "data.kwargs.augment = 4: expected a table"),
    ],
)
def test_a_bad_augment_option_is_refused_naming_the_key_and_value(value, expect):
    with pytest.raises(ConfigError, match=expect):
        parse_augment(value)


def test_augment_options_take_the_defaults_for_keys_not_given():
    assert parse_augment(None) is None
    assert parse_augment({}) == Augment(n=4, p=0.4, k=15)
    assert parse_augment({"n": 8, "p": 0}) == Augment(n=8, p=0, k=15)


def test_a_tokenizer_directory_without_embeddings_is_refused(tmp_path, teacher_dir):
    (tmp_path / "vocab.txt").write_text((teacher_dir / "vocab.txt").read_text())
    with pytest.raises(
        ConfigError, match="data.kwargs.augment needs the teacher's word embeddings"
    ):
        nearest_neighbours(["king"], model_dir=tmp_path, k=3)
