"""The contender written the way HF Accelerate's docs write a training loop.

`Accelerator(cpu=True, mixed_precision=..., gradient_accumulation_steps=k)`, `prepare`
(DDP with Accelerate's default kwargs), `accumulate(model)` (DDP `no_sync` on all but the
k-th micro-batch), `accelerator.backward` (divides the loss by k), `clip_grad_norm_` on
the sync micro-batch, and the wrapped optimizer, which only steps when gradients were
synced. AdamW as the docs construct it. Data, model, examples and the mean loss
(`job_loss`: logits or an HF output's `.logits`) come from the shared job (bench/common.py).
Launch (PLATFORM-NOTES: `--cpu` runs ONE process):

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision no --dynamo_backend no bench/peer_accelerate.py --out r.json

Writes one JSON object (rank 0), as every contender does (see bench/common.py).
"""

import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import (
    ACCELERATE_PRECISION,
    WallClock,
    build_job,
    docs_adamw,
    job_loss,
    worker_args,
    write_peer_result,
)


def main() -> None:
    a = worker_args(__doc__)
    torch.set_num_threads(a.threads)
    accum = a.global_batch // (a.micro_batch * a.procs)
    accelerator = Accelerator(
        cpu=True,
        mixed_precision=ACCELERATE_PRECISION[a.precision],
        gradient_accumulation_steps=accum,
    )
    assert accelerator.num_processes == a.procs, (
        f"expected {a.procs} processes, Accelerate runs {accelerator.num_processes} "
        f"({accelerator.distributed_type})"
    )
    set_seed(a.seed)
    data, model, sampler = build_job(
        a, rank=accelerator.process_index, world=accelerator.num_processes
    )
    model, optimizer = accelerator.prepare(model, docs_adamw(model, a))

    clock, logged, window_loss = WallClock(warmup=a.warmup, steps=a.steps), {}, torch.zeros(())
    for step in range(clock.total_steps):
        clock.tick(step)
        for idx in sampler.micro_batches(step):
            batch = data.get(idx)
            with accelerator.accumulate(model):  # no_sync unless this is the k-th micro-batch
                output = model(batch.inputs)  # autocast inside the wrapped forward; fp32 out
                loss = job_loss(output, batch.targets)  # mean
                accelerator.backward(loss)  # loss / k
                if accelerator.sync_gradients and a.grad_clip:
                    accelerator.clip_grad_norm_(model.parameters(), a.grad_clip)
                optimizer.step()  # a no-op until gradients are synced
                optimizer.zero_grad()
            window_loss += loss.detach()
        if (step + 1) % a.log_every == 0:  # the usual Accelerate logging: a mean over ranks
            mean = accelerator.reduce(window_loss / (a.log_every * accum), reduction="mean")
            logged[step + 1], window_loss = float(mean), torch.zeros(())

    if accelerator.is_main_process:
        write_peer_result(
            a,
            clock,
            logged,
            library="accelerate",
            model=model,
            optimizer=optimizer,
            world_size=accelerator.num_processes,
            distributed_type=str(accelerator.distributed_type),
        )
    accelerator.end_training()  # destroys the process group
    os._exit(0)  # skip gloo's intermittent abort at interpreter shutdown (PLATFORM-NOTES)


if __name__ == "__main__":
    main()
