"""scaletrain as a contender: its trainer at its defaults, timed by the benchmarks' WallClock.

Each rank runs `scaletrain.training.trainer.train(config, run_dir=...)`, as a worker of
`torchrun -m scaletrain train` would (bench/common.py gives it scaletrain's launcher
environment). The config is the job's flags as scaletrain overrides
(`common.scaletrain_overrides`) plus any `--set KEY=VALUE`; everything else (DDP settings,
optimizer kernels, allocator, ...) is scaletrain's default, whatever that is today. The
trainer's `train_step` is wrapped so that the shared `WallClock` ticks at the top of every
step: the same barrier + perf_counter as in every peer, not scaletrain's own step timer.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/peer_scaletrain.py --out r.json

Writes one JSON object (rank 0): seconds of the timed steps, final loss (the logged window
that ends the timing), peak memory, world size, threads, precision and the defaults found
on the model and optimizer the trainer built.
"""

import itertools
import tomllib
from pathlib import Path

import torch
from common import WallClock, describe_defaults, scaletrain_overrides, worker_args, write_result


def main() -> None:
    a = worker_args(__doc__)
    from scaletrain.config import flatten_config, load_config
    from scaletrain.records.metrics import read_metrics
    from scaletrain.runtime import exit_worker, read_env
    from scaletrain.training import trainer

    config = load_config(None, [*scaletrain_overrides(a), *a.set])
    clock, calls = WallClock(warmup=a.warmup, steps=a.steps), itertools.count()
    found, heap = {}, {}  # what describe_defaults sees on the built objects; the heap policy
    assert config.train.steps == clock.total_steps
    inner = trainer.train_step

    def timed_train_step(model, micro_batches, **kwargs):
        step = next(calls)  # a fresh run starts at step 0
        if step == 0:
            found.update(describe_defaults(model, kwargs["optimizer"]), **heap)
        clock.tick(step)
        return inner(model, micro_batches, **kwargs)

    trainer.train_step = timed_train_step  # the loop looks the name up in its module
    configure = trainer.configure_allocator  # the heap policy train() sets: record it

    def recorded_configure(*args, **kwargs):
        heap["heap policy (mallopt)"] = policy = configure(*args, **kwargs)
        return policy

    trainer.configure_allocator = recorded_configure
    run_dir = Path(a.out).with_suffix(".run")
    summary = trainer.train(config, run_dir=run_dir)
    assert clock.seconds is not None, (
        "the trainer no longer calls trainer.train_step: fix the clock"
    )
    if read_env().is_main:
        train = [r for r in read_metrics(run_dir) if r.get("kind") == "train"]
        resolved = (run_dir / "config.toml").read_text()
        for key, value in flatten_config(tomllib.loads(resolved)).items():  # e.g. optim.impl
            if any(word in key for word in ("impl", "alloc", "fused", "foreach")):
                found[f"config {key}"] = str(value)
        write_result(
            a.out,
            library="scaletrain",
            seconds=clock.seconds,
            steps=a.steps,
            final_loss=next(r["loss"] for r in train if r["step"] == clock.end),
            peak_mem_bytes=max(r["peak_mem_bytes"] for r in train),
            world_size=summary["world_size"],
            threads=torch.get_num_threads(),
            precision=summary["precision"],
            defaults=found,
            config_toml=resolved,
        )
    exit_worker(0)  # destroy the group, skip gloo's abort at interpreter shutdown


if __name__ == "__main__":
    main()
