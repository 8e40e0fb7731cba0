"""Overhead: `scaletrain`'s trainer vs the same training in a hand-written DDP loop.

The hand-written side (bench/peer_torch.py --match-scaletrain) runs its loop over exactly
what scaletrain's trainer builds for the job (`training.build.build`: the DDP wrapper with
scaletrain's settings, its optimizer and kernels, its data and sampler), so only the loop
differs: the trainer's metrics, checks and bookkeeping against a plain loop. (For each
library at its own defaults, see bench/peers.py.) Default job: scaletrain's CNN `small` on
MNIST, global batch 128 = 2 ranks x 64, AdamW, clip 1.0, 2 processes x 1 thread, fp32.
Both are timed by the same wall clock (bench/common.py) over the same steps after the same
warm-up; runs interleaved. Target: scaletrain / hand-written >= 0.98.

    .venv/bin/python bench/overhead.py [--reps 3] [--steps 200]
"""

from common import add_job_args, base_parser, check_job
from peers import compare


def main() -> None:
    p = add_job_args(
        base_parser(__doc__), model="cnn", size="small", global_batch=128, micro_batch=64, steps=200
    )
    p.add_argument("--precisions", default="fp32", help="comma-separated: fp32,bf16-mixed")
    a = check_job(p, p.parse_args())
    compare(
        a,
        libraries=("scaletrain", "torch-matched"),
        targets={"torch-matched": 0.98},
        title="overhead, scaletrain vs the same parts in a hand-written loop",
    )


if __name__ == "__main__":
    main()
