"""A minimal hand-written PyTorch DDP loop: the baseline `bench/overhead.py` compares against.

Same model (scaletrain's model definitions), same data arrays, same global batch, same AdamW
and clipping; nothing else: no config, no metrics, no evaluation. Run under torchrun.
Prints one JSON line: {"steps": N, "seconds": S} for the timed steps.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from scaletrain.data.sources import load_source
from scaletrain.models import build_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="cnn")
    p.add_argument("--size", default="small")
    p.add_argument("--source", default="mnist")
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = load_source(a.source, split="train")
    model = DDP(build_model(a.model, size=a.size, task=data.spec))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    per_rank = a.global_batch // world
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(data), generator=g)
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            start = time.perf_counter()
        i = (step * a.global_batch) % (len(data) - a.global_batch)
        batch = data.get(order[i + rank * per_rank : i + (rank + 1) * per_rank])
        loss = F.cross_entropy(model(batch.inputs), batch.targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"steps": a.steps, "seconds": seconds}, f)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
