"""The deterministic distributed sampler: one global order, sliced per rank.

The contract every layout relies on:
- The global order of examples depends only on (seed, epoch), never on the world size:
  the shards are shuffled, their rows concatenated, then rows are shuffled within
  consecutive windows of `shuffle_window` rows (`epoch_order`). An in-memory dataset is one
  shard with a window as large as itself: a full permutation. Only row counts are needed
  to compute the order, so a rank knows which rows (and row groups) it will read before
  reading anything.
- Optimizer step s consumes global batch s: `global_batch` consecutive examples of that
  order (the last partial batch of an epoch is dropped, so every step has the same size).
- Data-parallel rank r takes the r-th contiguous block of the global batch and splits it
  into `accumulation` micro-batches of `micro_batch` examples.

So 1 rank with 4 micro-batches and 4 ranks with 1 micro-batch see exactly the same
examples in each optimizer step, and a run resumed at step s on any world size continues
the same global sequence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GlobalBatchSampler:
    num_examples: int
    global_batch: int
    micro_batch: int
    dp_rank: int
    dp_size: int
    seed: int
    shard_rows: tuple[int, ...] = ()  # rows per shard, in manifest order; () = one shard
    shuffle_window: int = 0  # rows shuffled together; 0 = the whole dataset

    def __post_init__(self) -> None:
        if self.global_batch % (self.micro_batch * self.dp_size):
            raise ValueError("global_batch must be divisible by micro_batch * dp_size")
        if self.shard_rows and sum(self.shard_rows) != self.num_examples:
            raise ValueError("shard_rows must add up to num_examples")
        if self.num_examples < self.global_batch:
            raise ValueError(
                f"the dataset has {self.num_examples} examples, fewer than one global batch "
                f"({self.global_batch})"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.global_batch

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """(num_examples,) permutation of global row ids from (seed, epoch) alone."""
        return epoch_order(
            self.shard_rows or (self.num_examples,),
            seed=self.seed,
            epoch=epoch,
            window=self.shuffle_window or self.num_examples,
        )

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, global batches already consumed in that epoch) before step `step`."""
        return divmod(step, self.steps_per_epoch)

    def global_batch_indices(self, step: int) -> torch.Tensor:
        """(global_batch,) example indices of optimizer step `step` (0-based), all ranks."""
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch
        return self.epoch_order(epoch)[start : start + self.global_batch]

    def micro_batches(self, step: int) -> list[torch.Tensor]:
        """This rank's micro-batches for step `step`: `accumulation` tensors of (micro_batch,)."""
        per_rank = self.global_batch // self.dp_size
        mine = self.global_batch_indices(step)[
            self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank
        ]
        return list(mine.split(self.micro_batch))


@functools.lru_cache(maxsize=2)  # the current epoch (and the next), not recomputed every step
def epoch_order(shard_rows: tuple[int, ...], *, seed: int, epoch: int, window: int) -> torch.Tensor:
    """The epoch's global order of row ids: shuffled shards, then shuffled windows of rows.

    Args:
        shard_rows: rows per shard in manifest order; global row id = offset of its shard
            in that order + its row in the shard.
        seed, epoch: the only inputs of the order (never the world size).
        window: rows shuffled together after the shards are concatenated in shuffled order.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    offsets = torch.tensor((0, *shard_rows[:-1])).cumsum(0)  # (S,) first global id per shard
    shards = torch.randperm(len(shard_rows), generator=g)
    rows = torch.cat([torch.arange(shard_rows[s]) + offsets[s] for s in shards.tolist()])  # (N,)
    for start in range(0, len(rows), window):
        chunk = rows[start : start + window]
        rows[start : start + window] = chunk[torch.randperm(len(chunk), generator=g)]
    return rows


def eval_indices(
    num_examples: int, *, limit: int, dp_rank: int, dp_size: int, batch: int
) -> list[torch.Tensor]:
    """This rank's share of the first `limit` held-out examples (strided), in batches."""
    n = min(num_examples, limit)
    return list(torch.arange(dp_rank, n, dp_size).split(batch))
