"""Model-parallel layouts side by side: memory per rank, step time, pipeline bubble.

Every layout trains the same job with scaletrain's launcher on 2 processes x 1 thread (a
GPT of ~20M parameters from bench/layout_model.py, wikitext, fp32 AdamW, the same global
batch and micro-batch), one after the other in this invocation, each timed by the trainer's
own step clock (median `step_time_s` of the records after the warm-up steps). Memory is
rank 0's: the bytes of the parameter, gradient and optimizer-state tensors it holds
(`param_bytes`, `grad_bytes`, `optim_state_bytes`: local shards, not global shapes) and the
peak RSS within the timed steps (`window_peak_mem_bytes`: the kernel's high-water mark,
reset at each record, so the whole model built before it is split does not count). Ratios are against DDP (dp_replicate=2), the layout everyone starts from.

The pipeline bubble is measured separately (`--bubble`, bench/bubble_worker.py): each
stage's compute is timed inside one schedule step, idle = 1 - busy / wall, next to the
theory (p-1)/(m+p-1).

    .venv/bin/python bench/layouts.py [--steps 8] [--warmup 3] [--layouts ddp,zero3,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import wait_for_quiet

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {  # name: (overrides, what it is)
    "ddp": (["parallel.dp_replicate=2"], "DDP: whole replicas, gradient all-reduce"),
    "zero3": (["parallel.dp_shard=2"], "FSDP2, reshard after forward (ZeRO-3)"),
    "zero2": (
        ["parallel.dp_shard=2", "parallel.reshard_after_forward=false"],
        "FSDP2, parameters kept gathered until backward (ZeRO-2)",
    ),
    "zero3-ac": (
        ["parallel.dp_shard=2", "parallel.activation_checkpointing=full"],
        "ZeRO-3 + full activation checkpointing",
    ),
    "zero3-ac-op": (
        ["parallel.dp_shard=2", "parallel.activation_checkpointing=op"],
        "ZeRO-3 + per-op checkpointing (every other matmul kept)",
    ),
    "tp": (["parallel.tp=2"], "tensor parallel (Megatron plan)"),
    "pp-gpipe": (["parallel.pp=2", "parallel.pp_schedule=gpipe"], "pipeline, GPipe"),
    "pp-1f1b": (["parallel.pp=2", "parallel.pp_schedule=1f1b"], "pipeline, 1F1B"),
}
CONFIG = """
name = "bench-layouts"
[model]
name = "layout_model:gpt"
[model.kwargs]
n_layer = {n_layer}
n_head = 8
n_embd = {n_embd}
[data]
source = "wikitext"
seq_len = {seq_len}
[optim]
lr = 3e-4
[train]
steps = {steps}
global_batch = {global_batch}
micro_batch = {micro_batch}
eval_examples = 16
threads = 1
allocator = "{allocator}"
[log]
every = 1
quiet = true
"""


def run_layout(name: str, a: argparse.Namespace, tmp: Path) -> dict:
    config = tmp / "layouts.toml"
    config.write_text(CONFIG.format(**vars(a)))
    run_dir = tmp / name
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "scaletrain",
        "train",
        str(config),
        "--nproc",
        "2",
        *LAYOUTS[name][0],
        "--run-dir",
        str(run_dir),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{name}: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "grad_norm" in r][a.warmup :]
    last = steps[-1]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in steps),
        "param": last["param_bytes"],
        "grad": last["grad_bytes"],
        "optim": last["optim_state_bytes"],
        "step_peak": max(r["window_peak_mem_bytes"] for r in steps),
        "loss": last["loss"],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=", ".join(LAYOUTS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=448)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument(
        "--allocator",
        default="auto",
        choices=("auto", "system", "retain"),
        help="train.allocator: 'system' returns freed memory to the OS, so the "
        "peak RSS follows what is live; auto (retain) keeps it mapped",
    )
    p.add_argument("--bubble", action="store_true", help="also measure the pipeline bubble")
    a = p.parse_args()
    params = 12 * a.n_layer * a.n_embd**2 + 2 * 256 * a.n_embd + a.seq_len * a.n_embd
    print(
        f"GPT {a.n_layer} layers x {a.n_embd} (~{params / 1e6:.0f}M parameters), wikitext "
        f"seq_len {a.seq_len}, global batch {a.global_batch}, micro-batch {a.micro_batch}, "
        f"fp32 AdamW, 2 processes x 1 thread, {a.steps} steps ({a.warmup} warm-up), "
        f"train.allocator={a.allocator}"
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.layouts.split(","):
            waited = wait_for_quiet()
            results[name] = run_layout(name, a, Path(tmp))
            print(f"  ran {name} (waited {waited:.0f} s for a quiet machine)", flush=True)
    ref = results.get("ddp")
    mib = 2**20
    print(
        f"\n{'layout':10} {'params MiB':>10} {'grads':>7} {'optim':>7} {'state/DDP':>9} "
        f"{'peak RSS':>9} {'step s':>7} {'time/DDP':>8}  what"
    )
    for name, r in results.items():
        state = r["param"] + r["grad"] + r["optim"]
        ratio = state / (ref["param"] + ref["grad"] + ref["optim"]) if ref else float("nan")
        t = r["step_s"] / ref["step_s"] if ref else float("nan")
        print(
            f"{name:10} {r['param'] / mib:10.1f} {r['grad'] / mib:7.1f} {r['optim'] / mib:7.1f} "
            f"{ratio:9.2f} {r['step_peak'] / mib:8.0f}M {r['step_s']:7.2f} {t:8.2f}  "
            f"{LAYOUTS[name][1]}"
        )
    if a.bubble:
        bubble(a)


def bubble(a: argparse.Namespace) -> None:
    """Idle fraction of each schedule, measured by bench/bubble_worker.py on 2 ranks."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29517",
        str(ROOT / "bench" / "bubble_worker.py"),
    ]
    wait_for_quiet()
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if done.returncode != 0:
        raise SystemExit(f"bubble worker failed:\n{done.stderr[-2000:]}")
    print("\n" + done.stdout.strip())


if __name__ == "__main__":
    main()
