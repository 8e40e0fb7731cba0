"""The text of installed packages' own documentation, as paragraphs and headings.

Readers for data/kinds.py, each giving (text, is_heading) blocks in a fixed order, one line
per block, markup removed; the sentences are cut and sorted into kinds there. Every reader
takes a distribution's name and reads only the files its RECORD lists (or, for IDLE's
help, a file of the interpreter), as text: nothing is imported or executed.

- `readme(name)`: the Summary line (a heading) and the long description (the README) of
  the distribution's *.dist-info/METADATA, Markdown or reST: fenced and indented code
  blocks, directives and tables removed (a break, so no sentence spans them); images,
  badges, HTML tags, link targets and emphasis marks stripped, the link text kept; headings
  (`#`, or a line over an underline) marked.
- `docstring_prose(doc)` on `module_text(path)`'s docstrings: the summary, description and
  Notes of a docstring; not its structured sections (Parameters, Returns, Examples, ...),
  doctests, indented blocks or reST directives.
- `module_text(path)`: a source file's docstrings, found by a regular expression rather
  than `ast` (parsing is the slow part on 150 MB of source): a triple-quoted string that
  opens its line, which is a docstring of a module, class or function, or the docs numpy
  and torch attach with add_newdoc / _add_docstr; and the sentences ending in '?' of its
  comments (consecutive comment lines joined, a TODO/XXX tag removed).
- `idle_help()`: IDLE's chapter of Python's documentation (idlelib/help.html): its h1-h3
  headings and its p, li, dd and dt elements, those that hold inline code dropped.
- `wiki_headings(file)`: the section headings of a gensim English Wikipedia dump.
"""

from __future__ import annotations

import bz2
import html.parser
import importlib.metadata
import inspect
import re
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from scaletrain.data.corpora import split_sentences
from scaletrain.data.sources import _package_file, _strip_wiki_markup

Block = tuple[str, bool]  # (a paragraph or heading on one line, is_heading)

# Structured sections of a docstring: lists of names, not prose (Notes and Warnings are).
_SECTION = re.compile(
    r"(?:args|arguments|parameters|params|returns?|yields?|raises|examples?|attributes|"
    r"see also|references|keyword args|other parameters|methods|warns|receives)\s*:?",
    re.I,
)
_UNDERLINE = re.compile(r"\s*([-=~^\"'`#*+])\1{2,}\s*")
_GOOGLE_SECTION = re.compile(r"[A-Z][\w ]*:")
_QUESTION_COMMENT = re.compile(r"#[^\n?]*\?")  # a comment line that asks
_COMMENT_TAG = re.compile(r"^(?:TODO|XXX|FIXME|NOTE|HACK|BUG)\b(?:\([^)]*\))?:?\s*")
_TRIPLE_QUOTED = re.compile(r"(\"\"\"|''')(.*?)\1", re.S)
_LIST_ITEM = re.compile(r"^\s*(?:[*\-+\u2022]|\d+\.)\s+")
_WIKI_HEADING = re.compile(r"^={2,}\s*(.+?)\s*={2,}\s*$", re.M)
_INLINE = (  # (pattern, replacement), in order, on a README line
    (re.compile(r"!\[[^\]]*\]\([^)]*\)"), ""),  # an image
    (re.compile(r"\[([^\]]*)\]\([^)]*\)"), r"\1"),  # a link: its text (none for a badge)
    (re.compile(r"\[([^\]]+)\]\[[^\]]*\]"), r"\1"),  # a reference link
    (re.compile(r"`([^`<]+?)\s*<[^>]+>`__?"), r"\1"),  # a reST link
    (re.compile(r"\|[\w\- ]+\|"), ""),  # a reST substitution (a badge)
    (re.compile(r"<[^>]+>"), ""),  # an HTML tag
    (re.compile(r"(\*\*|__)(\S.*?\S|\S)\1"), r"\2"),  # bold
    (re.compile(r"(?<!\w)([*_])(\S.*?\S|\S)\1(?!\w)"), r"\2"),  # emphasis
)


def python_files(name: str) -> list[Path]:
    """The .py files a distribution's RECORD lists, tests excluded, in path order."""
    files = importlib.metadata.files(name) or []
    keep = [
        f for f in files if f.suffix == ".py" and not {"tests", "test", "testing"} & set(f.parts)
    ]
    return [Path(f.locate()) for f in sorted(keep, key=str)]


# ---------------------------------------------------------------------------- source code


def module_text(path: Path) -> tuple[list[str], list[str]]:
    """(docstrings, questions of the comments) of one source file (module docstring)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    docs = [m.group(2) for m in _TRIPLE_QUOTED.finditer(text) if _opens_line(text, m.start())]
    return docs, list(_comment_questions(text))


def _opens_line(text: str, at: int) -> bool:
    """Whether only spaces and a string prefix (r, u) stand before `at` on its line."""
    return not text[text.rfind("\n", 0, at) + 1 : at].strip(" \trRuU")


def _comment_questions(text: str) -> Iterator[str]:
    """Questions of the comment blocks (consecutive '#' lines) that hold a '?'; a file
    with no comment that asks is not split into lines at all (most files)."""
    if not _QUESTION_COMMENT.search(text):
        return
    block: list[str] = []
    for line in (*text.splitlines(), ""):
        if line.lstrip().startswith("#"):
            block.append(_COMMENT_TAG.sub("", line.strip().lstrip("#").strip()))
        elif block:
            if any("?" in ln for ln in block):
                yield from (s for s in split_sentences(" ".join(block)) if s.endswith("?"))
            block = []


def docstring_prose(doc: str) -> Iterator[str]:
    """The prose paragraphs of a docstring, each on one line (module docstring)."""
    lines, keep, prose = inspect.cleandoc(doc).splitlines(), True, []
    for i, line in enumerate(lines):
        after = lines[i + 1] if i + 1 < len(lines) else ""
        if _UNDERLINE.fullmatch(line):
            continue
        if _UNDERLINE.fullmatch(after) or _GOOGLE_SECTION.fullmatch(line.strip()):
            keep = not _SECTION.fullmatch(line.strip())  # a section: is it prose?
            prose.append("")
        elif keep and not line.startswith(":"):  # ":param x:" fields are not prose
            prose.append(line)
    for paragraph in re.split(r"\n\s*\n", "\n".join(prose)):
        if ">>>" in paragraph or paragraph[:1].isspace() or paragraph.startswith(".."):
            continue
        if text := " ".join(paragraph.split()).removesuffix(":"):
            yield text


# ---------------------------------------------------------------------------- READMEs


def readme(name: str) -> list[Block]:
    """A distribution's Summary (a heading) and README blocks (module docstring)."""
    meta = importlib.metadata.metadata(name)
    description = meta.get_payload() or meta.get("Description") or ""
    return [(meta.get("Summary") or "", True), *_paragraphs(_readme_lines(description))]


def _readme_lines(text: str) -> Iterator[Block]:
    """(line, is_heading), inline markup stripped; code, tables, directives: blank."""
    lines, fenced = text.splitlines(), False
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        after = lines[i + 1] if i + 1 < len(lines) else ""
        if fenced or line.startswith(("    ", "\t", "..", "|", "+-", "===")):
            yield "", False
        elif not _UNDERLINE.fullmatch(line):
            heading = line.startswith("#") or bool(line.strip() and _UNDERLINE.fullmatch(after))
            yield _strip_inline(line.lstrip("#").strip() if heading else line), heading


def _strip_inline(line: str) -> str:
    for pattern, replacement in _INLINE:
        line = pattern.sub(replacement, line)
    return line


def _paragraphs(lines: Iterable[Block]) -> Iterator[Block]:
    """Lines joined into blocks: a heading alone; a blank line or a list item a break."""
    block: list[str] = []
    for line, heading in (*lines, ("", False)):
        if block and (heading or not line.strip() or _LIST_ITEM.match(line)):
            yield " ".join(" ".join(block).split()), False
            block = []
        if heading:
            yield line, True
        elif line.strip():
            block.append(_LIST_ITEM.sub("", line, count=1))


# ---------------------------------------------------------------------------- other files


class _HelpHTML(html.parser.HTMLParser):
    """Blocks of Sphinx HTML: h1-h3 (headings) and p, li, dd, dt; "\\x00" marks code."""

    BLOCKS = frozenset({"p", "li", "dd", "dt", "h1", "h2", "h3"})

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[Block] = []
        self.open: str | None = None
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in ("pre", "code"):
            self.text.append("\x00")
        elif tag in self.BLOCKS:
            self._close()
            self.open, self.text = tag, []

    def handle_endtag(self, tag: str) -> None:
        if tag == self.open:
            self._close()

    def handle_data(self, data: str) -> None:
        if self.open:
            self.text.append(data)

    def _close(self) -> None:
        if self.open:
            text = " ".join("".join(self.text).replace("¶", "").split())
            self.blocks.append((text, self.open.startswith("h")))
        self.open, self.text = None, []


def idle_help() -> list[Block]:
    """IDLE's chapter of Python's documentation (module docstring); none without IDLE."""
    path = Path(sysconfig.get_paths()["stdlib"], "idlelib", "help.html")
    if not path.is_file():
        return []
    parser = _HelpHTML()
    parser.feed(path.read_text(encoding="utf-8"))
    # A sentence around inline code would read with a hole in it: dropped.
    return [(text, heading) for text, heading in parser.blocks if "\x00" not in text]


def wiki_headings(file: str) -> list[Block]:
    """The section headings ("== Early life ==") of a gensim Wikipedia dump, markup
    stripped, in dump order."""
    with open(_package_file("gensim", "test", "test_data", file), "rb") as f:
        xml = bz2.decompress(f.read()).decode("utf-8")
    return [(_strip_wiki_markup(m.group(1)), True) for m in _WIKI_HEADING.finditer(xml)]
