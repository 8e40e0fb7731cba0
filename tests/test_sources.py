"""Unit tests of the data sources: shapes, dtypes, splits, counts, integrity checks, and that
labels still belong to their inputs (a small model learns each real source). No process group."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from scaletrain.data import sources
from scaletrain.data.sources import SOURCE_NAMES, ArrayDataset, Batch, TaskSpec, load_source


def _fit_linear(train: ArrayDataset, *, steps: int = 150) -> torch.nn.Linear:
    """Full-batch Adam on a linear classifier: enough to show labels match inputs."""
    torch.manual_seed(0)
    model = torch.nn.Linear(math.prod(train.spec.input_shape), train.spec.num_classes)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x = train.inputs.flatten(1)  # (N, D)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), train.targets).backward()
        opt.step()
    return model


def _accuracy(model: torch.nn.Linear, data: ArrayDataset) -> float:
    with torch.no_grad():
        return (model(data.inputs.flatten(1)).argmax(1) == data.targets).float().mean().item()


# --- the container ------------------------------------------------------------------------


def test_get_gathers_in_order_and_counts_classification():
    spec = TaskSpec("classification", (2,), 3)
    data = ArrayDataset(torch.arange(10.0).view(5, 2), torch.tensor([0, 1, 2, 0, 1]), spec=spec)
    batch = data.get(torch.tensor([4, 0, 4]))
    assert isinstance(batch, Batch)
    assert batch.inputs.tolist() == [[8.0, 9.0], [0.0, 1.0], [8.0, 9.0]]
    assert batch.targets.tolist() == [1, 0, 1]
    assert (batch.count, batch.tokens) == (3, 0)


def test_get_counts_only_targets_that_are_not_ignored():
    spec = TaskSpec("lm", (4,), 256)
    targets = torch.tensor([[1, 2, -100, -100], [5, 6, 7, 8]])
    data = ArrayDataset(torch.zeros(2, 4, dtype=torch.int64), targets, spec=spec)
    batch = data.get(torch.tensor([0, 1]))
    assert (batch.count, batch.tokens) == (6, 8)
    assert data.get(torch.tensor([0])).count == 2


def test_array_dataset_refuses_mismatched_tensors():
    spec = TaskSpec("classification", (2,), 3)
    with pytest.raises(ValueError, match="examples"):
        ArrayDataset(torch.zeros(5, 2), torch.zeros(4, dtype=torch.int64), spec=spec)
    with pytest.raises(ValueError, match="match"):
        ArrayDataset(torch.zeros(5, 3), torch.zeros(5, dtype=torch.int64), spec=spec)


def test_bad_name_and_split_are_refused():
    with pytest.raises(ValueError) as info:
        load_source("cifar", split="train")
    assert all(name in str(info.value) for name in SOURCE_NAMES)
    with pytest.raises(ValueError, match="eval"):
        load_source("digits", split="test")


# --- digits -------------------------------------------------------------------------------


def test_digits_shapes_split_and_normalisation():
    train, evaluation = load_source("digits", split="train"), load_source("digits", split="eval")
    assert train.spec == evaluation.spec == TaskSpec("classification", (1, 8, 8), 10)
    assert (len(train), len(evaluation)) == (1438, 359)
    assert train.inputs.shape == (1438, 1, 8, 8) and train.inputs.dtype == torch.float32
    assert train.targets.dtype == torch.int64 and set(train.targets.tolist()) == set(range(10))
    assert abs(train.inputs.mean().item()) < 0.01 and abs(train.inputs.std().item() - 1) < 0.01

    # Disjoint and complete: as a multiset, train + eval are the 1797 (image, label) pairs.
    def rows(images, labels):  # (N, 65) pixel values in 0..16 with the label last
        table = np.concatenate([images.reshape(len(labels), 64), labels[:, None]], 1)
        return np.unique(table, axis=0, return_counts=True)

    def pixels(d):
        return np.rint((d.inputs.numpy() * sources.DIGITS_STD + sources.DIGITS_MEAN) * 16)

    labels = torch.cat([train.targets, evaluation.targets]).numpy()
    ours = rows(np.concatenate([pixels(train), pixels(evaluation)]), labels)
    raw = rows(*sources._digits_arrays())
    assert np.array_equal(ours[0], raw[0]) and np.array_equal(ours[1], raw[1])
    assert load_source("digits", split="eval").inputs.equal(evaluation.inputs)  # fixed split


def test_digits_are_what_sklearn_loads():
    load_digits = pytest.importorskip("sklearn.datasets").load_digits
    images, labels = sources._digits_arrays()
    x, y = load_digits(return_X_y=True)
    assert np.array_equal(images.reshape(-1, 64), x) and np.array_equal(labels, y)


def test_digits_labels_belong_to_their_images():
    model = _fit_linear(load_source("digits", split="train"))
    assert _accuracy(model, load_source("digits", split="eval")) > 0.9


# --- MNIST --------------------------------------------------------------------------------


def test_mnist_shapes_labels_and_normalisation():
    train, evaluation = load_source("mnist", split="train"), load_source("mnist", split="eval")
    assert train.spec == evaluation.spec == TaskSpec("classification", (1, 28, 28), 10)
    assert train.inputs.shape == (60000, 1, 28, 28) and evaluation.inputs.shape == (
        10000,
        1,
        28,
        28,
    )
    assert train.inputs.dtype == torch.float32 and train.targets.dtype == torch.int64
    # The canonical files: first labels and the test set's class counts.
    assert train.targets[:5].tolist() == [5, 0, 4, 1, 9]
    assert evaluation.targets[:5].tolist() == [7, 2, 1, 0, 4]
    test_counts = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert torch.bincount(evaluation.targets).tolist() == test_counts
    assert abs(train.inputs.mean().item()) < 1e-3 and abs(train.inputs.std().item() - 1) < 1e-3
    assert train.inputs.min().item() == pytest.approx(-0.1307 / 0.3081, abs=1e-5)


def test_mnist_labels_belong_to_their_images():
    train = load_source("mnist", split="train")
    subset = ArrayDataset(train.inputs[:5000], train.targets[:5000], spec=train.spec)
    model = _fit_linear(subset, steps=60)
    assert _accuracy(model, load_source("mnist", split="eval")) > 0.85


def test_idx_bytes_follow_the_format():
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    data = sources.mnist_idx_bytes(images)
    assert data[:16] == bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4])
    assert data[16:] == bytes(range(24))
    labels = np.array([7, 9], dtype=np.uint8)
    assert sources.mnist_idx_bytes(labels) == bytes([0, 0, 8, 1, 0, 0, 0, 2, 7, 9])


def test_mnist_md5_mismatch_names_the_file_and_both_hashes():
    arrays = sources._mnist_arrays()
    sources.verify_mnist(arrays)  # the real data pass
    wrong = dict(sources.MNIST_IDX_MD5, **{"t10k-labels-idx1-ubyte": "0" * 32})
    with pytest.raises(RuntimeError) as info:
        sources.verify_mnist(arrays, expected=wrong)
    message = str(info.value)
    assert "t10k-labels-idx1-ubyte" in message and "0" * 32 in message
    assert sources.MNIST_IDX_MD5["t10k-labels-idx1-ubyte"] in message  # what it actually got
    corrupted = dict(
        arrays, **{"train-labels-idx1-ubyte": arrays["train-labels-idx1-ubyte"].copy()}
    )
    corrupted["train-labels-idx1-ubyte"][0] ^= 1  # one flipped bit
    with pytest.raises(RuntimeError, match="train-labels-idx1-ubyte"):
        sources.verify_mnist(corrupted)


def test_mnist_loading_runs_the_md5_check(monkeypatch):
    monkeypatch.setitem(sources.MNIST_IDX_MD5, "train-images-idx3-ubyte", "f" * 32)
    sources._mnist_arrays.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="train-images-idx3-ubyte"):
            load_source("mnist", split="eval")
    finally:
        sources._mnist_arrays.cache_clear()  # drop nothing wrong into later tests' cache


# --- wikitext -----------------------------------------------------------------------------


def test_wikitext_windows_split_and_counts():
    T = 128
    train = load_source("wikitext", split="train", seq_len=T)
    evaluation = load_source("wikitext", split="eval", seq_len=T)
    assert train.spec == TaskSpec("lm", (T,), 256)
    assert train.inputs.dtype == train.targets.dtype == torch.int64
    data = np.frombuffer(sources._wikitext_bytes(), dtype=np.uint8)
    cut = int(0.95 * len(data))
    assert len(train) == cut // (T + 1) and len(evaluation) == (len(data) - cut) // (T + 1)
    # Targets are the inputs shifted by one inside each (T + 1)-byte window.
    window = torch.from_numpy(data[: T + 1].astype(np.int64))
    assert train.inputs[0].equal(window[:-1]) and train.targets[0].equal(window[1:])
    assert train.inputs[1, 0].item() == data[T + 1]  # windows don't overlap
    assert evaluation.inputs[0].tolist() == data[cut : cut + T].tolist()  # eval starts at the cut
    batch = train.get(torch.arange(4))
    assert (batch.count, batch.tokens) == (4 * T, 4 * T)


def test_wikitext_is_plain_english_text():
    text = sources._wikitext_bytes().decode("utf-8")  # valid UTF-8
    assert 2_500_000 < len(text) < 3_300_000
    assert text.startswith("Anarchism\n\nAnarchism is a political philosophy")
    for markup in ("{{", "}}", "<ref", "&nbsp;", "'''", "[[Category:"):
        assert markup not in text, markup
    assert text.count(" the ") > 10_000


def test_wikitext_seq_len_sets_the_window():
    data = load_source("wikitext", split="eval", seq_len=16)
    assert data.inputs.shape[1] == 16 and data.spec.input_shape == (16,)


# --- synthetic ----------------------------------------------------------------------------


def test_synthetic_images_are_seeded_and_share_a_teacher():
    def images(split, seed, n=2048):
        return load_source("synthetic-images", split=split, synthetic_examples=n, seed=seed)

    train = images("train", 3)
    assert train.inputs.shape == (2048, 1, 28, 28) and train.inputs.dtype == torch.float32
    assert train.spec == TaskSpec("classification", (1, 28, 28), 10)
    assert train.inputs.equal(images("train", 3).inputs) and train.targets.equal(
        images("train", 3).targets
    )
    assert not train.inputs.equal(images("train", 4).inputs)
    evaluation = images("eval", 3, n=512)
    assert not torch.equal(evaluation.inputs, train.inputs[:512])
    assert torch.bincount(train.targets, minlength=10).min() > 100  # every class present
    # A linear model fit on train transfers to eval (~40% at 2048 examples; chance is 10%)
    # only if both share the teacher.
    model = _fit_linear(train)
    assert _accuracy(model, train) > 0.99 and _accuracy(model, evaluation) > 0.3
    other = images("eval", 4, n=512)
    assert _accuracy(model, other) < 0.2


def test_synthetic_text_is_a_fixed_markov_chain():
    T = 64
    train = load_source("synthetic-text", split="train", seq_len=T, synthetic_examples=1024, seed=1)
    evaluation = load_source(
        "synthetic-text", split="eval", seq_len=T, synthetic_examples=256, seed=1
    )
    assert (
        train.inputs.shape == train.targets.shape == (1024, T) and train.inputs.dtype == torch.int64
    )
    assert train.spec == TaskSpec("lm", (T,), 256)
    assert train.targets[:, :-1].equal(train.inputs[:, 1:])
    assert not torch.equal(evaluation.inputs, train.inputs[:256])

    def successors(data):
        pairs = torch.stack([data.inputs.flatten(), data.targets.flatten()], 1).unique(
            dim=0
        )  # (P, 2)
        return {(a, b) for a, b in pairs.tolist()}

    train_pairs = successors(train)
    assert (
        max(torch.bincount(torch.tensor([a for a, _ in train_pairs]))) <= 4
    )  # <= 4 successors a byte
    assert len(successors(evaluation) - train_pairs) < 0.05 * len(
        successors(evaluation)
    )  # same chain
    assert train.get(torch.arange(8)).count == 8 * T
