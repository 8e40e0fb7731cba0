"""The `bench/peers.py` job written the way Lightning Fabric's docs write a training loop.

`Fabric(accelerator="cpu", devices=2, strategy="ddp", precision=...)`, `fabric.launch()`
(re-runs this script once per extra rank), `fabric.setup`, `fabric.no_backward_sync(model,
enabled=accumulating)` (DDP `no_sync` on all but the k-th micro-batch), `fabric.backward`,
`fabric.clip_gradients`. The model comes from scaletrain's registry and the micro-batches
from scaletrain's sampler, so every library sees the same network, initial weights and
examples. Run with plain python (`fabric run` refuses a script that calls `launch()`):

    python bench/peer_fabric.py --precision bf16-mixed --out r.json

Writes one JSON object (rank 0): steps_per_s over the timed steps, final_loss (see below),
world_size, threads, precision.
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from lightning_fabric import Fabric

from peer_job import add_job_args, build_job  # bench/ is on sys.path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_job_args(p, steps=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--world-size", type=int, default=2, help="processes to launch (asserted)")
    p.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    p.add_argument("--out", required=True)
    return p.parse_args()


def main() -> None:
    a = parse_args()
    fabric = Fabric(accelerator="cpu", devices=a.world_size, strategy="ddp", precision=a.precision)
    fabric.launch()
    torch.set_num_threads(a.threads)
    assert fabric.world_size == a.world_size, (
        f"expected {a.world_size} processes, Fabric runs {fabric.world_size}")
    accum = a.global_batch // (a.micro_batch * fabric.world_size)
    fabric.seed_everything(a.seed)
    data, model, optimizer, sampler = build_job(a, rank=fabric.global_rank, world=fabric.world_size)
    model, optimizer = fabric.setup(model, optimizer)

    window_loss, final_loss = torch.zeros(()), float("nan")
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            start = time.perf_counter()
        for i, idx in enumerate(sampler.micro_batches(step)):
            batch = data.get(idx)
            accumulating = i < accum - 1
            with fabric.no_backward_sync(model, enabled=accumulating):  # sync on the k-th only
                logits = model(batch.inputs)  # autocast inside the wrapped forward; fp32 out
                loss = F.cross_entropy(logits.flatten(0, -2), batch.targets.flatten())  # mean
                fabric.backward(loss / accum)  # Fabric leaves the 1/k to the user
            window_loss += loss.detach()
        fabric.clip_gradients(model, optimizer, max_norm=a.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % a.log_every == 0:
            # The usual Fabric logging: all-reduce the mean over ranks. A mean of per-micro-batch
            # means equals the global mean here (equal micro-batches); with ragged token counts
            # it would not.
            mean = fabric.all_reduce(window_loss / (a.log_every * accum), reduce_op="mean")
            final_loss, window_loss = float(mean), torch.zeros(())
    seconds = time.perf_counter() - start

    if fabric.is_global_zero:
        with open(a.out, "w") as f:
            json.dump({"library": "fabric", "precision": a.precision,
                       "world_size": fabric.world_size, "threads": torch.get_num_threads(),
                       "accumulation": accum, "steps": a.steps, "seconds": seconds,
                       "steps_per_s": a.steps / seconds, "final_loss": final_loss}, f)
    fabric.barrier()
    torch.distributed.destroy_process_group()
    for child in getattr(fabric.strategy.launcher, "procs", []):  # rank 0 started the others:
        child.wait()  # return only when the whole job is over (the next run must not overlap)
    os._exit(0)  # skip gloo's intermittent abort at interpreter shutdown (PLATFORM-NOTES)


if __name__ == "__main__":
    main()
