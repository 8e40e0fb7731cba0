"""A user's map-style dataset behind the Dataset protocol (data/user_source.py): item forms,
the checks that name the item, torch's batched __getitems__, and the sampler on top."""

from __future__ import annotations

import pytest
import torch

from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.data.sources import TaskSpec
from scaletrain.data.user_source import MapSource, load_user_dataset
from scaletrain.user_code import UserCodeError

TABLE = TaskSpec("classification", (3,), 4)


class Items(torch.utils.data.Dataset):
    def __init__(self, make, n=10):
        self.make, self.n, self.reads = make, n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        return self.make(i)


def test_tuple_and_dict_items_stack_in_the_samplers_order() -> None:
    tuples = MapSource(Items(lambda i: (torch.full((3,), float(i)), i % 4)), TABLE, label="t")
    batch = tuples.get(torch.tensor([7, 2, 5]))
    assert batch.inputs[:, 0].tolist() == [7.0, 2.0, 5.0] and batch.targets.tolist() == [3, 2, 1]
    assert batch.inputs.dtype == torch.float32 and batch.count == 3 and batch.tokens == 0
    dicts = MapSource(
        Items(lambda i: {"inputs": [1, 2, 3], "targets": 1, "mask": [i, i]}), TABLE, label="d"
    )
    batch = dicts.get(torch.tensor([4, 6]))
    assert batch.inputs.dtype == torch.float32  # integers for a float task are converted
    assert batch.extras["mask"].tolist() == [[4, 4], [6, 6]]  # passed to the model's forward
    assert tuples.shard_rows == (10,) and len(tuples) == 10


def test_batched_getitems_is_one_call_per_batch() -> None:
    class Batched(Items):
        calls = 0

        def __getitems__(self, ids):
            Batched.calls += 1
            return [self.make(i) for i in ids]

    data = Batched(lambda i: (torch.zeros(3), 0))
    source = MapSource(data, TABLE, label="b")
    before = data.reads
    source.get(torch.arange(8))
    assert data.reads == before and Batched.calls >= 1


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda i: (torch.zeros(4), 0), r"item 0 has inputs of shape \(4,\).*input_shape = \(3,\)"),
        (lambda i: (torch.zeros(3), 9), r"item 0 has target 9.*0..3"),
        (lambda i: torch.zeros(3), r"item 0 is a Tensor"),
        (lambda i: {"inputs": torch.zeros(3)}, r"missing \['targets'\]"),
        (lambda i: (torch.zeros(3), 1.5), r"item 0's targets are torch.float32"),
    ],
)
def test_items_that_do_not_fit_the_task_are_refused_naming_the_item(make, message) -> None:
    with pytest.raises(UserCodeError, match=message):
        MapSource(Items(make), TABLE, label="data.source = 'pkg:fn'")


def test_an_item_of_another_shape_fails_the_batch_naming_both_items() -> None:
    source = MapSource(Items(lambda i: (torch.zeros(3 if i != 4 else 2), 0)), TABLE, label="s")
    with pytest.raises(UserCodeError, match=r"item 4's inputs have shape \(2,\), item 1's \(3,\)"):
        source.get(torch.tensor([1, 4]))
    failing = MapSource(Items(lambda i: (torch.zeros(3), 0) if i != 3 else 1 / 0), TABLE, label="f")
    with pytest.raises(UserCodeError, match="ZeroDivisionError"):
        failing.get(torch.tensor([3]))


def test_text_tasks_count_tokens_and_always_all_reduce_the_count() -> None:
    def text(split):
        def item(i):
            ids = torch.arange(5) + i
            targets = ids + 1
            targets[3:] = -100 if i % 2 else targets[3:]
            return ids, targets

        return Items(item), {"kind": "lm", "input_shape": [5], "num_classes": 64}

    source = load_user_dataset("pkg:text", split="train", kwargs={}, fn=text)
    assert source.spec.ragged  # padding may differ between ranks: the step all-reduces counts
    batch = source.get(torch.tensor([0, 1]))
    assert batch.count == 5 + 3 and batch.tokens == 10


def test_a_data_function_must_return_a_dataset_and_a_task() -> None:
    with pytest.raises(UserCodeError, match="returns \\(dataset, task\\)"):
        load_user_dataset("pkg:fn", split="train", kwargs={}, fn=lambda split: Items(None))
    with pytest.raises(UserCodeError, match="lacks 'num_classes'"):
        load_user_dataset(
            "pkg:fn",
            split="train",
            kwargs={},
            fn=lambda split: (Items(None), {"kind": "lm", "input_shape": [2]}),
        )
    with pytest.raises(UserCodeError, match="empty dataset"):
        load_user_dataset(
            "pkg:fn", split="eval", kwargs={}, fn=lambda split: (Items(None, 0), TABLE)
        )


def test_the_global_sampler_reads_a_user_dataset_like_any_other() -> None:
    source = MapSource(Items(lambda i: (torch.full((3,), float(i)), i % 4), n=64), TABLE, label="s")
    one = GlobalBatchSampler(
        len(source),
        global_batch=16,
        micro_batch=16,
        dp_rank=0,
        dp_size=1,
        seed=3,
        shard_rows=source.shard_rows,
    )
    two = [
        GlobalBatchSampler(
            len(source),
            global_batch=16,
            micro_batch=4,
            dp_rank=r,
            dp_size=2,
            seed=3,
            shard_rows=source.shard_rows,
        )
        for r in (0, 1)
    ]
    whole = source.get(one.micro_batches(5)[0]).inputs[:, 0]
    parts = torch.cat([source.get(i).inputs[:, 0] for s in two for i in s.micro_batches(5)])
    assert torch.equal(whole, parts)
