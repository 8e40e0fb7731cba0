"""The hand-written contender: a DDP training loop as PyTorch's docs write one.

`DDP(model)` with DDP's defaults, `torch.optim.AdamW(model.parameters(), lr=...)` as the
docs show it (no `foreach=` / `fused=`: torch picks), `no_sync()` on all but the last
micro-batch, loss / k, `clip_grad_norm_`, `step`, `zero_grad`, and a loss all-reduce every
`--log-every` steps. Data, model, examples and the mean loss (`job_loss`) come from the
shared job (bench/common.py), so every contender trains the same network on the same batches.

With --match-scaletrain the same loop runs over the DDP wrapper, optimizer, data and
sampler that scaletrain's trainer builds (`training.build.build`) for the same job: only the loop
differs, which is what bench/overhead.py measures.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/peer_torch.py --out r.json

Writes one JSON object (rank 0), as every contender does (see bench/common.py).
"""

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from common import (
    WallClock,
    all_reduce_mean,
    build_job,
    docs_adamw,
    job_loss,
    scaletrain_overrides,
    worker_args,
    write_peer_result,
)
from torch.nn.parallel import DistributedDataParallel as DDP


def scaletrain_parts(a, *, rank: int, world: int):
    """(data, DDP model, optimizer, sampler, heap policy) as scaletrain's trainer builds them."""
    from scaletrain.config import load_config
    from scaletrain.launch.resolve import resolve
    from scaletrain.runtime import read_env, seed_everything
    from scaletrain.runtime.allocator import configure_allocator
    from scaletrain.training.build import build

    config = load_config(None, scaletrain_overrides(a))
    penv = read_env()
    derived = resolve(config, world_size=world, nproc_per_node=penv.local_world_size)
    # The heap policy trainer.train() sets before it builds.
    heap = {"heap policy (mallopt)": configure_allocator(config.train.allocator, device_type="cpu")}
    seed_everything(a.seed)
    parts = build(
        config, derived, penv, device=torch.device("cpu"), run_dir=Path(a.out).with_suffix(".run")
    )
    return parts.train_ds, parts.state.model, parts.state.optimizer, parts.sampler, heap


def main() -> None:
    a = worker_args(__doc__)
    torch.set_num_threads(a.threads or max(1, len(os.sched_getaffinity(0)) // a.procs))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.match_scaletrain:
        data, model, optimizer, sampler, heap = scaletrain_parts(a, rank=rank, world=world)
    else:
        heap = {}
        torch.manual_seed(a.seed)
        data, model, sampler = build_job(a, rank=rank, world=world)
        model = DDP(model)
        optimizer = docs_adamw(model, a)
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if a.precision == "bf16-mixed"
        else contextlib.nullcontext()
    )
    accum = sampler.accumulation

    clock, logged, window_loss = WallClock(warmup=a.warmup, steps=a.steps), {}, torch.zeros(())
    for step in range(clock.total_steps):
        clock.tick(step)
        for i, idx in enumerate(sampler.micro_batches(step)):
            batch = data.get(idx)
            # All-reduce only on the last micro-batch; earlier ones accumulate locally.
            with model.no_sync() if i < accum - 1 else contextlib.nullcontext():
                with autocast:
                    loss = job_loss(model(batch.inputs), batch.targets)  # mean
                (loss / accum).backward()
            window_loss += loss.detach().float()
        if a.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % a.log_every == 0:
            logged[step + 1] = float(all_reduce_mean(window_loss / (a.log_every * accum)))
            window_loss = torch.zeros(())

    if rank == 0:
        write_peer_result(
            a,
            clock,
            logged,
            library="torch-matched" if a.match_scaletrain else "torch",
            model=model,
            optimizer=optimizer,
            world_size=world,
            defaults=heap,
        )
    dist.destroy_process_group()
    os._exit(0)  # skip gloo's intermittent abort at interpreter shutdown (PLATFORM-NOTES)


if __name__ == "__main__":
    main()
