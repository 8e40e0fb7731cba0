"""The `bench/peers.py` job written the way HF Accelerate's docs write a training loop.

`Accelerator(cpu=True, mixed_precision=..., gradient_accumulation_steps=k)`, `prepare`,
`accumulate(model)` (DDP `no_sync` on all but the k-th micro-batch), `accelerator.backward`
(divides the loss by k), `clip_grad_norm_` on the sync micro-batch, and the wrapped
optimizer, which only steps when gradients were synced. The model comes from scaletrain's
registry and the micro-batches from scaletrain's sampler, so every library sees the same
network, initial weights and examples. Launch (PLATFORM-NOTES: `--cpu` runs ONE process):

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision bf16 --dynamo_backend no bench/peer_accelerate.py --out r.json

Writes one JSON object (rank 0): steps_per_s over the timed steps, final_loss (see below),
world_size, threads, precision.
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed

from peer_job import add_job_args, build_job  # bench/ is on sys.path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_job_args(p, steps=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--world-size", type=int, default=2, help="expected processes (asserted)")
    p.add_argument("--precision", choices=("no", "bf16"), default="no")
    p.add_argument("--out", required=True)
    return p.parse_args()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    world = a.world_size
    accum = a.global_batch // (a.micro_batch * world)
    accelerator = Accelerator(cpu=True, mixed_precision=a.precision,
                              gradient_accumulation_steps=accum)
    assert accelerator.num_processes == world, (
        f"expected {world} processes, Accelerate runs {accelerator.num_processes} "
        f"({accelerator.distributed_type})")
    set_seed(a.seed)
    data, model, optimizer, sampler = build_job(a, rank=accelerator.process_index, world=world)
    model, optimizer = accelerator.prepare(model, optimizer)

    window_loss, final_loss = torch.zeros(()), float("nan")
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            start = time.perf_counter()
        for idx in sampler.micro_batches(step):
            batch = data.get(idx)
            with accelerator.accumulate(model):  # no_sync unless this is the k-th micro-batch
                logits = model(batch.inputs)  # autocast inside the wrapped forward; fp32 out
                loss = F.cross_entropy(logits.flatten(0, -2), batch.targets.flatten())  # mean
                accelerator.backward(loss)  # loss / k
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), a.grad_clip)
                optimizer.step()  # a no-op until gradients are synced
                optimizer.zero_grad()
            window_loss += loss.detach()
        if (step + 1) % a.log_every == 0:
            # The usual Accelerate logging: reduce the mean over ranks. A mean of per-micro-batch
            # means equals the global mean here (equal micro-batches); with ragged token counts
            # it would not.
            mean = accelerator.reduce(window_loss / (a.log_every * accum), reduction="mean")
            final_loss, window_loss = float(mean), torch.zeros(())
    seconds = time.perf_counter() - start

    if accelerator.is_main_process:
        with open(a.out, "w") as f:
            json.dump({"library": "accelerate", "precision": a.precision,
                       "world_size": accelerator.num_processes,
                       "distributed_type": str(accelerator.distributed_type),
                       "threads": torch.get_num_threads(), "accumulation": accum,
                       "steps": a.steps, "seconds": seconds, "steps_per_s": a.steps / seconds,
                       "final_loss": final_loss}, f)
    accelerator.end_training()  # destroys the process group
    os._exit(0)  # skip gloo's intermittent abort at interpreter shutdown (PLATFORM-NOTES)


if __name__ == "__main__":
    main()
