"""Precision and gradient accumulation on this machine, each pair side by side.

(a) `precision.mode = "auto"` vs `"fp32"`: step time of a matmul-heavy job (default: `mlp`
    `base` on MNIST, micro-batch = global batch = 1024, so nearly all time is in three
    GEMMs), 1 process x all cores. Prints the speed-up and what `auto` chose.
(b) accumulation k = 8 vs k = 1 at the same global batch (default: `cnn` `small` on MNIST,
    global batch 512 = 8 x 64 or 1 x 512), 1 process x all cores: peak memory
    (`peak_mem_bytes` of metrics.jsonl), throughput and the final loss, which should agree:
    same examples, same gradient up to rounding.

Both run scaletrain's trainer at its defaults (bench/peer_scaletrain.py), timed by the
benchmarks' wall clock over the same steps after the same warm-up (bench/common.py),
interleaved over --reps; runs disturbed by other processes are retried.

    .venv/bin/python bench/precision_accum.py [--reps 3]
"""

import argparse
import tempfile
from functools import partial

from common import JOB, base_parser, interleave, median, per_rep, run_contender

PARTS = {  # part: the job's values that differ from common.JOB
    "a": dict(
        model="mlp",
        size="base",
        source="mnist",
        global_batch=1024,
        micro_batch=1024,
        steps=60,
        warmup=10,
        log_every=10,
        procs=1,
        threads=0,
    ),
    "b": dict(
        model="cnn",
        size="small",
        source="mnist",
        global_batch=512,
        micro_batch=64,
        steps=20,
        warmup=5,
        log_every=5,
        procs=1,
        threads=0,
        precision="fp32",
    ),
}


def run_pair(tmp: str, a, job: dict, variants: dict[str, dict], *, name: str) -> dict:
    """Interleave the variants of `job` over a.reps; returns {variant: [result per rep]}."""
    jobs = {
        v: partial(
            run_contender,
            "scaletrain",
            argparse.Namespace(**{**job, **fields}),
            out_dir=tmp,
            tag=f"{name}-{v.replace('=', '')}",
        )
        for v, fields in variants.items()
    }
    return interleave(
        jobs,
        reps=a.reps,
        retries=a.retries,
        line=lambda rep, v, r: (
            f"{v:>6}: {r['ms_per_step']:8.1f} ms/step {r['examples_per_s']:8.0f} "
            f"examples/s  peak {r['peak_mem_bytes'] / 2**20:6.0f} MiB  loss {r['final_loss']:.5f}"
        ),
    )


def part_a(tmp: str, a, job: dict) -> None:
    from scaletrain.precision import choose_auto

    chosen, why = choose_auto("cpu")
    print(
        f"(a) precision auto vs fp32: {job['model']}-{job['size']} on {job['source']}, "
        f"micro-batch = global batch = {job['global_batch']}, 1 process x all cores, "
        f"{job['steps']} timed steps after {job['warmup']}; auto -> {chosen} ({why})"
    )
    res = run_pair(
        tmp, a, job, {"fp32": {"precision": "fp32"}, "auto": {"precision": "auto"}}, name="prec"
    )
    print(f"    {'mode':<6} {'ran as':<11} {'ms/step':>8}  {'per rep':<24} {'final loss':>10}")
    for mode, runs in res.items():
        print(
            f"    {mode:<6} {runs[0]['precision']:<11} {median(runs, 'ms_per_step'):>8.1f}  "
            f"{per_rep(runs, 'ms_per_step', '.1f'):<24} {runs[0]['final_loss']:>10.5f}"
        )
    print(f"    threads per process: {res['fp32'][0]['threads']}")
    speedup = median(res["fp32"], "ms_per_step") / median(res["auto"], "ms_per_step")
    print(f"    speed-up auto / fp32 (median step time): {speedup:.2f}x (target >= 3x)")


def part_b(tmp: str, a, job: dict) -> None:
    k = job["global_batch"] // job["micro_batch"]
    print(
        f"(b) accumulation k={k} vs k=1: {job['model']}-{job['size']} on {job['source']}, "
        f"global batch {job['global_batch']} ({k} x {job['micro_batch']} vs 1 x "
        f"{job['global_batch']}), {job['precision']}, 1 process x all cores, {job['steps']} "
        f"timed steps after {job['warmup']}"
    )
    res = run_pair(
        tmp, a, job, {"k=1": {"micro_batch": job["global_batch"]}, f"k={k}": {}}, name="accum"
    )
    print(
        f"    {'':<6} {'peak MiB':>8} {'examples/s':>10}  {'examples/s per rep':<24} {'final loss':>10}"
    )
    for variant, runs in res.items():
        print(
            f"    {variant:<6} {median(runs, 'peak_mem_bytes') / 2**20:>8.0f} "
            f"{median(runs, 'examples_per_s'):>10.0f}  "
            f"{per_rep(runs, 'examples_per_s', '.0f'):<24} {runs[0]['final_loss']:>10.5f}"
        )
    one, many = res["k=1"], res[f"k={k}"]
    print(
        f"    peak memory k={k} / k=1: "
        f"{median(many, 'peak_mem_bytes') / median(one, 'peak_mem_bytes'):.3f}; "
        f"throughput k={k} / k=1: "
        f"{median(many, 'examples_per_s') / median(one, 'examples_per_s'):.3f}; "
        f"final loss difference {abs(many[0]['final_loss'] - one[0]['final_loss']):.2e}"
    )


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--parts", default="a,b")
    for part, fields in PARTS.items():  # --a-steps, --b-model, ...
        for key, value in fields.items():
            p.add_argument(f"--{part}-{key.replace('_', '-')}", type=type(value), default=value)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for part, run_part in (("a", part_a), ("b", part_b)):
            if part not in a.parts:
                continue
            job = {key: value for key, (value, _) in JOB.items()}
            job.update({key: getattr(a, f"{part}_{key}") for key in PARTS[part]})
            if job["steps"] % job["log_every"] or job["warmup"] % job["log_every"]:
                p.error(
                    f"--{part}-steps and --{part}-warmup must be multiples of --{part}-log-every"
                )
            run_part(tmp, a, job)


if __name__ == "__main__":
    main()
