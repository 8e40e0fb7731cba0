"""The one job of bench/peers.py, shared by its three contenders: arguments and set-up.

Every library trains the same network (scaletrain's registry), from the same seed, on the
same examples in the same order (scaletrain's sampler), with the same AdamW; only the
training loop is each library's own.
"""

import argparse

import torch

from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.data.sources import load_source
from scaletrain.models import build_model


def add_job_args(p: argparse.ArgumentParser, *, steps: int) -> None:
    """The job's flags, the same in peers.py and in each peer script."""
    p.add_argument("--model", default="cnn")
    p.add_argument("--size", default="small")
    p.add_argument("--source", default="mnist")
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=steps, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed optimizer steps first")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)


def build_job(a: argparse.Namespace, *, rank: int, world: int):
    """(data, model, AdamW, sampler) for this rank; seed the RNGs before calling."""
    data = load_source(a.source, split="train")
    model = build_model(a.model, size=a.size, task=data.spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, foreach=True)
    sampler = GlobalBatchSampler(len(data), global_batch=a.global_batch,
                                 micro_batch=a.micro_batch, dp_rank=rank, dp_size=world,
                                 seed=a.seed)
    return data, model, optimizer, sampler
