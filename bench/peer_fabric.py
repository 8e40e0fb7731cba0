"""The contender written the way Lightning Fabric's docs write a training loop.

`Fabric(accelerator="cpu", devices=N, strategy="ddp", precision=...)`, `fabric.launch()`
(re-runs this script once per extra rank), `fabric.setup` (DDP with Fabric's default
kwargs), `fabric.no_backward_sync(model, enabled=accumulating)` (DDP `no_sync` on all but
the k-th micro-batch), `fabric.backward`, `fabric.clip_gradients`. AdamW as the docs
construct it. Data, model, examples and the mean loss (`job_loss`) come from the shared
job (bench/common.py). Run with plain python (`fabric run` refuses a script that calls `launch()`):

    python bench/peer_fabric.py --out r.json

Writes one JSON object (rank 0), as every contender does (see bench/common.py).
"""

import os

import torch
from common import (
    FABRIC_PRECISION,
    WallClock,
    build_job,
    docs_adamw,
    job_loss,
    worker_args,
    write_peer_result,
)
from lightning_fabric import Fabric


def main() -> None:
    a = worker_args(__doc__)
    fabric = Fabric(
        accelerator="cpu", devices=a.procs, strategy="ddp", precision=FABRIC_PRECISION[a.precision]
    )
    fabric.launch()
    torch.set_num_threads(a.threads)
    assert fabric.world_size == a.procs, (
        f"expected {a.procs} processes, Fabric runs {fabric.world_size}"
    )
    accum = a.global_batch // (a.micro_batch * fabric.world_size)
    fabric.seed_everything(a.seed)
    data, model, sampler = build_job(a, rank=fabric.global_rank, world=fabric.world_size)
    model, optimizer = fabric.setup(model, docs_adamw(model, a))

    clock, logged, window_loss = WallClock(warmup=a.warmup, steps=a.steps), {}, torch.zeros(())
    for step in range(clock.total_steps):
        clock.tick(step)
        for i, idx in enumerate(sampler.micro_batches(step)):
            batch = data.get(idx)
            with fabric.no_backward_sync(model, enabled=i < accum - 1):  # sync on the k-th only
                output = model(batch.inputs)  # autocast inside the wrapped forward; fp32 out
                loss = job_loss(output, batch.targets)  # mean
                fabric.backward(loss / accum)  # Fabric leaves the 1/k to the user
            window_loss += loss.detach()
        if a.grad_clip:
            fabric.clip_gradients(model, optimizer, max_norm=a.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % a.log_every == 0:  # the usual Fabric logging: a mean over ranks
            mean = fabric.all_reduce(window_loss / (a.log_every * accum), reduce_op="mean")
            logged[step + 1], window_loss = float(mean), torch.zeros(())

    if fabric.is_global_zero:
        write_peer_result(
            a,
            clock,
            logged,
            library="fabric",
            model=model,
            optimizer=optimizer,
            world_size=fabric.world_size,
        )
    fabric.barrier()
    torch.distributed.destroy_process_group()
    for child in getattr(fabric.strategy.launcher, "procs", []):  # rank 0 started the others:
        child.wait()  # return only when the whole job is over (the next run must not overlap)
    os._exit(0)  # skip gloo's intermittent abort at interpreter shutdown (PLATFORM-NOTES)


if __name__ == "__main__":
    main()
