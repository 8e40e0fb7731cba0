"""One rank of the pipeline-bubble benchmark (bench/layouts.py --bubble starts 2 of them
with torchrun): a GPT split in 2 stages, each schedule at several chunk counts, the idle
fraction of one step measured by parallel/pipeline.py's `measure_idle` (median of 3) next
to the theory (p-1)/(m+p-1). The theory's premises are equal-work stages (the blocks are
balanced by parameters; the embeddings and the 256-token head are small) and chunks whose
compute dwarfs the cost of sending them: every chunk is ROWS_PER_CHUNK sequences, so a
step with more chunks is a bigger step, not a finer split of the same one."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from scaletrain.loss import cross_entropy
from scaletrain.models.gpt import GPT, GPTShape
from scaletrain.models.protocol import model_spec
from scaletrain.parallel.pipeline import (
    build_pipeline,
    idle_fraction_theory,
    measure_idle,
    split_model,
    stage_ids,
)

SEQ, ROWS_PER_CHUNK = 64, 4


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=SEQ, shape=GPTShape(n_layer=8, n_head=8, n_embd=256))
    spec = model_spec(model)
    lines = []
    for schedule in ("gpipe", "1f1b"):
        for m in (2, 4, 8, 16):
            x = torch.randint(0, 256, (ROWS_PER_CHUNK * m, SEQ))
            y = torch.randint(0, 256, (ROWS_PER_CHUNK * m, SEQ))
            ids = stage_ids(pp_rank=rank, pp=pp, stages_per_rank=1, schedule=schedule)
            parts = split_model(model, spec, stage_ids=ids, num_stages=pp)
            pipe = build_pipeline(
                parts,
                stage_ids=ids,
                num_stages=pp,
                group=dist.group.WORLD,
                device=torch.device("cpu"),
                schedule=schedule,
                microbatches=m,
                loss_fn=cross_entropy,
            )
            idle = statistics.median(
                measure_idle(pipe, x, y, loss_weight=1.0 / y.numel(), warmup=i == 0)
                for i in range(3)
            )
            theory = idle_fraction_theory(schedule, pp=pp, microbatches=m, stages_per_rank=1)
            lines.append(
                f"{schedule:6} p={pp} m={m:2}  measured idle {idle:6.1%}   theory "
                f"(p-1)/(m+p-1) {theory:6.1%}   measured/theory {idle / theory:5.2f}"
            )
    if rank == 0:
        print(
            f"pipeline bubble: GPT 8 x 256, chunks of {ROWS_PER_CHUNK} rows x {SEQ} tokens, "
            "2 ranks x 1 thread, gloo"
        )
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
