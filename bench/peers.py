"""Peers: one job under scaletrain, a hand-written DDP loop, HF Accelerate and Lightning
Fabric, side by side in one invocation, each library at its own defaults.

The headline job (the defaults): scaletrain's MLP `base` (784-1024-1024-10, ReLU, 1.86M
parameters; the registry's `build_model("mlp", size="base")`, which every contender uses)
on MNIST from scaletrain's own source (`scaletrain.data.loader.load_dataset("mnist",
split="train")`), global batch 256 = 2 ranks x 128 (no accumulation), AdamW at a constant
lr 1e-3 (weight decay 0 for all), clipping at 1.0, fp32, 2 processes x 1 thread on CPU
(gloo, DDP), the same seed (so the same initial weights) and the same examples in every
step (scaletrain's sampler feeds every contender). Runs are interleaved, the contender
order rotated every rep, so drift and position hit every library alike.

- scaletrain: its trainer at its defaults (bench/peer_scaletrain.py, under torchrun).
- torch: a DDP loop as PyTorch's docs write it (bench/peer_torch.py, under torchrun).
- accelerate: `accelerate launch --multi_gpu --num_processes 2 ...` bench/peer_accelerate.py.
- fabric: `python bench/peer_fabric.py` (it calls `fabric.launch()`).

Every contender is timed by the same clock (bench/common.py, `WallClock`): a barrier and
perf_counter at the top of step `--warmup` and of step `--warmup + --steps`, rank 0's
difference. Each includes its own loss logging (one all-reduce every `--log-every` steps);
start-up, data loading and scaletrain's final evaluation are outside. The final loss is
the mean training loss of the window that ends the timing (all ranks); it should agree
between contenders to rounding (scaletrain normalises by the global count, the peers
average micro-batch means: equal here, every micro-batch has the same size).

Only the job is set; the libraries keep their defaults, and the script prints each
difference it finds on the live objects (DDP's gradient_as_bucket_view and buckets, the
optimizer's kernels and wrapper, the heap policy, threads).

A second job, `--preset hf-llama`: a Hugging Face Llama (`model.name = "hf"`,
`LlamaConfig` with `common.HF_LLAMA_KWARGS`, 791,680 parameters), built by every contender
through scaletrain's registry (`build_model("hf", hf_config="LlamaConfig", kwargs=...)`),
on the Wikipedia bytes (`wikitext`, 128 tokens per example), global batch 32 = 2 ranks x
16. The peers call `model(input_ids)` and `common.job_loss` on `.logits` (B, T, V)
against the already shifted targets (B, T): the mean token cross-entropy, as scaletrain's.

    .venv/bin/python bench/peers.py [--reps 3] [--steps 150] [--precisions fp32,bf16-mixed]
    .venv/bin/python bench/peers.py --model cnn --size small --global-batch 128 --micro-batch 32
    .venv/bin/python bench/peers.py --preset hf-llama     # --steps 30 --warmup 10 --log-every 10
"""

import argparse
import tempfile
from functools import partial

from common import (
    ACCELERATE_PRECISION,
    add_job_args,
    base_parser,
    check_job,
    interleave,
    print_defaults,
    print_ratio_table,
    run_contender,
)

LIBRARIES = ("scaletrain", "torch", "accelerate", "fabric")
TARGETS = {"torch": 1.10, "accelerate": 1.15, "fabric": 1.15}  # scaletrain / it, examples/s
# Named jobs besides the headline one: the job flags they change (explicit flags win).
PRESETS = {
    "hf-llama": {
        "model": "hf-llama",
        "size": "small",
        "source": "wikitext",
        "seq_len": 128,
        "global_batch": 32,
        "micro_batch": 16,
        "steps": 30,
        "warmup": 10,
        "log_every": 10,
    },  # ~0.33 s a step, ~20 s start-up: 3 reps in 8-12 min
}
TEXT_SOURCES = ("wikitext", "wikitext-paragraphs", "synthetic-text")


def compare(a, *, libraries, targets: dict[str, float], title: str) -> None:
    """Interleave `libraries` on the job `a` for each precision; print ratios and defaults."""
    tokens = f" ({a.seq_len} tokens an example)" if a.source in TEXT_SOURCES else ""
    print(
        f"{title}: {a.model}-{a.size} on {a.source}{tokens}, global batch {a.global_batch} = "
        f"{a.procs} ranks x {a.global_batch // a.procs} (micro-batch {a.micro_batch}), AdamW "
        f"lr {a.lr} wd {a.weight_decay}, clip {a.grad_clip}, {a.procs} processes x "
        f"{a.threads} thread(s); {a.steps} timed steps after {a.warmup}, seed {a.seed}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for precision in a.precisions.split(","):
            job = argparse.Namespace(**{**vars(a), "precision": precision})
            print(f"\n[{precision}]")
            results = interleave(
                {
                    lib: partial(run_contender, lib, job, out_dir=tmp, tag=f"{lib}-{precision}")
                    for lib in libraries
                },
                reps=a.reps,
                retries=a.retries,
                line=lambda rep, name, r: (
                    f"{name:<13} {r['examples_per_s']:8.1f} examples/s loss {r['final_loss']:.5f}"
                ),
            )
            print()
            print_ratio_table(
                results,
                reference=libraries[0],
                targets={k: v for k, v in targets.items() if k in libraries},
            )
            print("\ndifferences in defaults (as found on each contender's model and optimizer):")
            print_defaults(results)


def main() -> None:
    preset = argparse.ArgumentParser(add_help=False)
    preset.add_argument("--preset", choices=sorted(PRESETS))
    job = PRESETS.get(preset.parse_known_args()[0].preset, {})
    p = add_job_args(base_parser(__doc__), **job)
    flags = {
        name: " ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())
        for name, values in PRESETS.items()
    }
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a named job, whose flags become the defaults: "
        + "; ".join(f"{name} = {f}" for name, f in flags.items()),
    )
    p.add_argument("--precisions", default="fp32", help="comma-separated: fp32,bf16-mixed")
    p.add_argument(
        "--libraries",
        default=",".join(LIBRARIES),
        help="comma-separated contenders; the first is the reference",
    )
    a = check_job(p, p.parse_args())
    for precision in a.precisions.split(","):
        if precision not in ACCELERATE_PRECISION:
            p.error(f"--precisions: {precision!r} is not one of {', '.join(ACCELERATE_PRECISION)}")
    compare(
        a, libraries=a.libraries.split(","), targets=TARGETS, title="peers, each at its defaults"
    )


if __name__ == "__main__":
    main()
