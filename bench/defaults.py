"""scaletrain's speed defaults, each switched off in turn: what each one is worth.

The peers' headline job (bench/peers.py: MLP-base on MNIST, global batch 256, AdamW, 2 ranks
x 1 thread, fp32), run by scaletrain at its defaults and with one default changed:
`optim.impl=foreach` (instead of fused), `train.allocator=system` (glibc's defaults instead of
retain), and `train.compile=true` (off by default: this measures what turning it on gives).
Interleaved, the order rotated every rep, the same WallClock as every benchmark.

    .venv/bin/python bench/defaults.py [--reps 3] [--steps 150]

compile's first steps pay inductor's compile time; they fall in the warm-up, outside the
timing (`--warmup`, 10 steps by default), so this is the steady-state speed.
"""

import tempfile
from functools import partial

from common import (
    add_job_args,
    base_parser,
    check_job,
    interleave,
    print_ratio_table,
    run_contender,
)

VARIANTS = {  # name -> extra config overrides for the scaletrain worker
    "defaults": [],
    "foreach-adamw": ["optim.impl=foreach"],
    "system-heap": ["train.allocator=system"],
    "compiled": ["train.compile=true"],
}


def main() -> None:
    p = add_job_args(base_parser(__doc__))
    a = check_job(p, p.parse_args())
    print(
        f"scaletrain's defaults: {a.model}-{a.size} on {a.source}, global batch {a.global_batch}, "
        f"{a.procs} processes x {a.threads} thread(s), {a.precision}; {a.steps} timed steps "
        f"after {a.warmup}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {
            name: partial(
                run_contender,
                "scaletrain",
                a,
                out_dir=tmp,
                tag=name,
                extra=[arg for o in overrides for arg in ("--set", o)],
            )
            for name, overrides in VARIANTS.items()
        }
        results = interleave(
            jobs,
            reps=a.reps,
            retries=a.retries,
            line=lambda rep, name, r: (
                f"{name:<14} {r['examples_per_s']:8.1f} examples/s loss {r['final_loss']:.5f}"
            ),
        )
        print()
        print_ratio_table(results, reference="defaults", targets={})


if __name__ == "__main__":
    main()
