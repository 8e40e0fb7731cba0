"""Pure unit tests (no process group): the sampler contract, the layout value, the schedule."""

from __future__ import annotations

import pytest
import torch

from scaletrain.data.sampler import GlobalBatchSampler, eval_indices
from scaletrain.parallel.layout import LayoutError, ParallelLayout
from scaletrain.training.optim import lr_multiplier


def _sampler(
    dp_rank: int, dp: int, micro: int, *, n: int = 1000, seed: int = 3
) -> GlobalBatchSampler:
    return GlobalBatchSampler(
        n, global_batch=64, micro_batch=micro, dp_rank=dp_rank, dp_size=dp, seed=seed
    )


def test_one_rank_four_micro_batches_equals_four_ranks_one_each() -> None:
    for step in (0, 5, 15, 16, 40):  # 15 steps per epoch: crosses epochs
        single = torch.cat(_sampler(0, 1, 16).micro_batches(step))
        assert len(_sampler(0, 1, 16).micro_batches(step)) == 4
        four = torch.cat([_sampler(r, 4, 16).micro_batches(step)[0] for r in range(4)])
        assert torch.equal(single, four)
        two = torch.cat([torch.cat(_sampler(r, 2, 16).micro_batches(step)) for r in range(2)])
        assert torch.equal(single, two)


def test_order_depends_only_on_seed_and_epoch() -> None:
    a, b = _sampler(0, 1, 64), _sampler(0, 1, 64)
    assert torch.equal(a.epoch_order(2), b.epoch_order(2))
    assert not torch.equal(a.epoch_order(0), a.epoch_order(1))
    assert not torch.equal(a.epoch_order(0), _sampler(0, 1, 64, seed=4).epoch_order(0))


def test_epoch_has_no_duplicates_and_drops_only_the_last_partial_batch() -> None:
    s = _sampler(0, 1, 64)
    seen = torch.cat([s.global_batch_indices(k) for k in range(s.steps_per_epoch)])
    assert len(seen) == len(set(seen.tolist())) == 15 * 64


def test_sampler_refuses_indivisible_batch_and_tiny_dataset() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GlobalBatchSampler(1000, global_batch=64, micro_batch=24, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(10, global_batch=64, micro_batch=64, dp_rank=0, dp_size=1, seed=0)


def test_eval_indices_partition_the_limit() -> None:
    parts = [
        torch.cat(eval_indices(100, limit=50, dp_rank=r, dp_size=3, batch=7)) for r in range(3)
    ]
    assert sorted(torch.cat(parts).tolist()) == list(range(50))


def test_layout_infers_and_checks() -> None:
    assert ParallelLayout(dp_replicate=-1).resolve(4).dp == 4
    assert ParallelLayout(dp_replicate=2).resolve(2).world_size == 2
    assert ParallelLayout(dp_replicate=2, dp_shard=2).resolve(4).dp == 4  # dp = replicate x shard
    with pytest.raises(LayoutError, match="do not match the world size 4"):
        ParallelLayout(dp_replicate=2).resolve(4)
    with pytest.raises(LayoutError, match="invalid"):
        ParallelLayout(dp_replicate=0).resolve(1)


def test_lr_schedule_warmup_then_cosine_to_min() -> None:
    kw = dict(warmup_steps=10, total_steps=110, schedule="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(0, **kw) == pytest.approx(0.1)
    assert lr_multiplier(9, **kw) == pytest.approx(1.0)
    assert lr_multiplier(10, **kw) == pytest.approx(1.0)
    assert lr_multiplier(109, **kw) == pytest.approx(0.1)
    mids = [lr_multiplier(s, **kw) for s in range(10, 110)]
    assert all(x >= y for x, y in zip(mids, mids[1:]))
    assert (
        lr_multiplier(50, warmup_steps=0, total_steps=100, schedule="constant", min_lr_ratio=0.1)
        == 1.0
    )
