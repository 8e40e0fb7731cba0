"""Scaling: scaletrain on 2 processes x 1 thread vs 1 process x 1 thread, same global batch.

Each of the 2 ranks does half the work per step; efficiency = throughput(2) / (2 x
throughput(1)). Both run scaletrain's trainer at its defaults (bench/peer_scaletrain.py),
timed by the benchmarks' wall clock (bench/common.py); runs interleaved. Two models: one
compute-bound, one whose gradient all-reduce is large against its compute.

    .venv/bin/python bench/scaling.py [--reps 3] [--steps 50]
"""

import argparse
import statistics
import tempfile
from functools import partial

from common import add_job_args, base_parser, check_job, interleave, run_contender

MODELS = {  # name: (model, size, source, what it shows)
    "cnn-small": ("cnn", "small", "mnist", "compute-bound: 85k params, conv-heavy"),
    "mlp-base": ("mlp", "base", "synthetic-images", "communication-heavy: 1.9M params"),
}


def main() -> None:
    p = add_job_args(base_parser(__doc__), global_batch=256, steps=50, synthetic_examples=16384)
    p.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS)
    )
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            model, size, source, what = MODELS[name]
            jobs = {}
            for procs in (1, 2):
                job = check_job(
                    p,
                    argparse.Namespace(
                        **{
                            **vars(a),
                            "model": model,
                            "size": size,
                            "source": source,
                            "procs": procs,
                            "micro_batch": a.global_batch // procs,
                        }
                    ),
                )
                jobs[procs] = partial(
                    run_contender, "scaletrain", job, out_dir=tmp, tag=f"{name}-{procs}"
                )
            print(
                f"{name} on {source} ({what}), global batch {a.global_batch}, "
                f"{a.threads} thread(s) per process, {a.steps} timed steps after {a.warmup}"
            )
            res = interleave(
                jobs,
                reps=a.reps,
                retries=a.retries,
                line=lambda rep, procs, r: f"{procs} proc(s) {r['examples_per_s']:8.0f} examples/s",
            )
            print(
                f"{'rep':>3} {'1 proc ex/s':>12} {'2 procs ex/s':>13} {'speed-up':>9} "
                f"{'efficiency':>11}"
            )
            effs = []
            for rep, (one, two) in enumerate(zip(res[1], res[2])):
                one, two = one["examples_per_s"], two["examples_per_s"]
                effs.append(two / (2 * one))
                print(f"{rep:>3} {one:>12.0f} {two:>13.0f} {two / one:>9.2f} {effs[-1]:>11.2f}")
            print(f"median scaling efficiency, 2 processes vs 1: {statistics.median(effs):.2f}\n")


if __name__ == "__main__":
    main()
