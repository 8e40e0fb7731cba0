"""Checkpoint cost: save throughput vs the disk's own write bandwidth (dd, same run), and the
per-step stall of async vs sync saves during training, side by side.

    .venv/bin/python bench/checkpoint.py [--steps 60] [--every 10]

(a) `dd` writes 512 MiB with fdatasync: the disk's sequential write bandwidth.
(b) One checkpoint of a GPT-base training state (parameters + AdamW moments, ~59 MB), saved
    with scaletrain's Checkpointer (DCP + SHA-256 manifest + atomic rename): MB/s and the
    ratio to dd.
(c) How long `save()` blocks the training thread, sync vs async (idle CPU, warm buffers).
(d) The same training run twice, checkpointing every N steps, sync then async: the stall is
    the step time of the steps that include a save minus the median step time. On a machine
    whose cores all train, the background write competes with the step for CPU and the GIL.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CONFIG = """
name = "bench-ckpt"
[model]
name = "gpt"
size = "base"
[data]
source = "wikitext"
seq_len = 64
[train]
steps = {steps}
global_batch = 4
micro_batch = 4
eval_examples = 4
[checkpoint]
every = {every}
keep = 1
async_save = {async_save}
[log]
every = 1
quiet = true
"""


def dd_bandwidth(directory: Path) -> float:
    out = subprocess.run(
        [
            "dd",
            "if=/dev/zero",
            f"of={directory / 'dd.bin'}",
            "bs=1M",
            "count=512",
            "conv=fdatasync",
        ],
        capture_output=True,
        text=True,
    )
    (directory / "dd.bin").unlink()
    seconds = float(out.stderr.strip().splitlines()[-1].split(" s, ")[0].split(", ")[-1])
    return 512 * 2**20 / seconds


def _state():
    from scaletrain.checkpoint import TrainState
    from scaletrain.data.sources import TaskSpec
    from scaletrain.models import build_model
    from scaletrain.precision import make_precision
    from scaletrain.training.optim import build_optimizer, build_scheduler

    model = build_model("gpt", size="base", task=TaskSpec("lm", (64,), 256))
    opt = build_optimizer(
        model, name="adamw", lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99), momentum=0.0
    )
    model(torch.randint(0, 256, (2, 64))).sum().backward()
    opt.step()  # materialise the AdamW moments
    return TrainState(
        model,
        opt,
        build_scheduler(opt, warmup_steps=0, total_steps=10, schedule="constant", min_lr_ratio=1.0),
        make_precision("fp32", device_type="cpu"),
        step=1,
    )


def save_throughput(directory: Path) -> tuple[float, float]:
    from scaletrain.checkpoint import Checkpointer

    state = _state()
    saver = Checkpointer(directory / "ckpt", keep=1, async_save=False, config_toml="")
    start = time.perf_counter()
    saver.save(state)
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in (directory / "ckpt").rglob("*") if p.is_file())
    return size / seconds, size


def blocking(directory: Path, *, async_save: bool, reps: int = 5) -> float:
    """Median time the training thread is blocked in `save()` (warm: buffers allocated)."""
    from scaletrain.checkpoint import Checkpointer

    state = _state()
    saver = Checkpointer(
        directory / f"block-{async_save}", keep=1, async_save=async_save, config_toml=""
    )
    times = []
    for _ in range(reps + 1):
        state.step += 1
        start = time.perf_counter()
        saver.save(state)
        times.append(time.perf_counter() - start)
        saver.wait()
    saver.close()
    return statistics.median(times[1:])


def stall(directory: Path, *, steps: int, every: int, async_save: bool) -> tuple[float, float]:
    cfg = directory / f"cfg-{async_save}.toml"
    cfg.write_text(
        CONFIG.format(steps=steps, every=every, async_save="true" if async_save else "false")
    )
    run_dir = directory / f"run-{async_save}"
    subprocess.run(
        [sys.executable, "-m", "scaletrain", "train", str(cfg), "--run-dir", str(run_dir)],
        check=True,
        capture_output=True,
        timeout=1800,
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["step_time_s"] for r in rows if r["kind"] == "train"}
    # The save after step s is timed in the window of step s + 1.
    saving = [times[s + 1] for s in range(every, steps, every) if s + 1 in times]
    plain = [t for s, t in times.items() if s > 2 and (s - 1) % every != 0]
    median = statistics.median(plain)
    return statistics.mean(saving) - median, median


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        tmp = Path(tmp)
        disk = dd_bandwidth(tmp)
        rate, size = save_throughput(tmp)
        print(f"disk write bandwidth (dd, 512 MiB, fdatasync): {disk / 1e6:8.1f} MB/s")
        print(
            f"checkpoint save ({size / 1e6:.1f} MB, GPT-base + AdamW): {rate / 1e6:8.1f} MB/s"
            f"  ratio to dd: {rate / disk:.2f}"
        )
        for async_save in (False, True):
            print(
                f"{'async' if async_save else 'sync '} save() blocks the training thread "
                f"{blocking(tmp, async_save=async_save) * 1e3:7.1f} ms (median of 5, idle CPU)"
            )
        for async_save in (False, True):
            extra, median = stall(tmp, steps=a.steps, every=a.every, async_save=async_save)
            print(
                f"{'async' if async_save else 'sync '} save every {a.every} steps: stall "
                f"{extra * 1e3:7.1f} ms per saving step (median step {median * 1e3:.1f} ms)"
            )


if __name__ == "__main__":
    main()
