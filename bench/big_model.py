"""A model bigger than a rank's share: peak RSS of every rank, read from outside, with meta
init against the whole-model build it replaces, side by side.

    .venv/bin/python bench/big_model.py [--sizes 206m,0.8b] [--nproc 4]

Each run is `scaletrain train` (the launcher, 4 gloo workers, parallel.dp_shard=4) on an HF
LlamaConfig with a byte vocabulary: SGD without momentum, micro-batch 1, 2 steps, a final
eval of 4 examples, the final save. While it runs this script reads /proc/PID/status of
the launcher and of each worker every 0.1 s (VmRSS, and VmHWM, the kernel's high-water
mark of the process's resident memory) and prints, per rank, the peak next to the model's
full fp32 parameter bytes.

train.allocator is the default, auto: for a model of 256 MiB of parameters or more it is
`release` (runtime/allocator.py: fixed mmap and trim thresholds, every freed block of 1 MiB or
more handed back). `--allocator retain` or `system` shows what the others cost: retain
keeps every freed block (206m: 3.8-4.2 GiB a rank), and glibc's defaults let FSDP's
16-32 MiB gathered tensors fragment the heap (0.8b: above the whole model's bytes before
the first step ended).

Contenders, the same run but for one key:
- meta    model.meta_init = true (the default): every rank builds the model on the meta
          device and materialises its shards only (models/init.py);
- whole   model.meta_init = false: every rank builds and initialises the whole model, then
          FSDP shards it (what every run did before meta init).
The weights are the same in both (the module rule draws them either way). `whole` runs at
the smaller size only: at 0.8B four whole copies would not fit this machine's 24 GiB.

Time per phase comes from the rank-0 start-up lines ("model: ... (t s)", "ready: ... (t s)").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scaletrain.records.memory import available_bytes

SIZES = {  # name -> (hidden, layers, intermediate, heads)
    "206m": (1024, 16, 2816, 16),
    "0.8b": (2048, 16, 5632, 16),
}

CONFIG = """
name = "bench-big-model"
[model]
name = "hf"
hf_config = "LlamaConfig"
meta_init = {meta_init}
[model.kwargs]
vocab_size = 256
hidden_size = {hidden}
intermediate_size = {intermediate}
num_hidden_layers = {layers}
num_attention_heads = {heads}
num_key_value_heads = {heads}
max_position_embeddings = 64
tie_word_embeddings = false
[data]
source = "wikitext"
seq_len = 32
[optim]
name = "sgd"
momentum = 0.0
lr = 1e-3
weight_decay = 0.0
[train]
steps = 2
global_batch = {nproc}
micro_batch = 1
eval_examples = {nproc}
allocator = "{allocator}"
[parallel]
dp = 1
dp_shard = {nproc}
[log]
every = 1
"""


def param_bytes(hidden: int, layers: int, intermediate: int) -> int:
    """fp32 bytes of the Llama's parameters (embedding and head untied, kv heads = heads)."""
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return 4 * (layers * per_layer + 2 * 256 * hidden + hidden)


def status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def workers_of(launcher: int) -> dict[int, int]:
    """RANK -> pid of the launcher's worker children (their RANK environment variable)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        rank = [e for e in env if e.startswith(b"RANK=")]
        if ppid == launcher and rank:
            found[int(rank[0][5:])] = int(entry.name)
    return found


LOW_MEMORY = 1.5 * 2**30


def watch(
    launcher: subprocess.Popen, *, nproc: int, peaks: dict[str, int], stop: threading.Event
) -> None:
    """Peak VmHWM of the launcher and of each worker, until `stop`."""
    workers: dict[int, int] = {}
    while not stop.is_set():
        if len(workers) < nproc:  # the workers start after the launcher's checks
            workers |= workers_of(launcher.pid)
        for name, pid in [("launcher", launcher.pid)] + [
            (f"rank {r}", p) for r, p in sorted(workers.items())
        ]:
            hwm = status(pid).get("VmHWM")
            if hwm:
                peaks[name] = max(peaks.get(name, 0), hwm)
        if (
            available_bytes() or float("inf")
        ) < LOW_MEMORY:  # stop before the OOM killer picks a process
            peaks["stopped: memory ran out"] = 1
            launcher.kill()
            for pid in workers.values():
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
            return
        time.sleep(0.1)


def run(size: str, *, meta_init: bool, nproc: int, root: Path, allocator: str) -> dict:
    hidden, layers, intermediate, heads = SIZES[size]
    cfg = root / f"{size}-{'meta' if meta_init else 'whole'}.toml"
    cfg.write_text(
        CONFIG.format(
            meta_init=str(meta_init).lower(),
            hidden=hidden,
            layers=layers,
            intermediate=intermediate,
            heads=heads,
            nproc=nproc,
            allocator=allocator,
        )
    )
    run_dir = root / cfg.stem
    cmd = [sys.executable, "-m", "scaletrain", "train", str(cfg), "--nproc", str(nproc)]
    started = time.perf_counter()
    launcher = subprocess.Popen(
        [*cmd, "--run-dir", str(run_dir)], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    peaks: dict[str, int] = {}
    stop = threading.Event()
    watcher = threading.Thread(
        target=watch,
        args=(launcher,),
        kwargs=dict(nproc=nproc, peaks=peaks, stop=stop),
        daemon=True,
    )
    watcher.start()
    out, err = launcher.communicate(timeout=3600)
    stop.set()
    watcher.join()
    wall = time.perf_counter() - started
    stopped = bool(peaks.pop("stopped: memory ran out", None))
    if launcher.returncode != 0 and not stopped:
        raise SystemExit(f"{cfg.stem}: status {launcher.returncode}\n{err[-3000:]}")
    said = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"scaletrain: (\w+).*\(([\d.]+) s\)", err)
    }
    return {
        "size": size,
        "contender": "meta" if meta_init else "whole",
        "params_bytes": param_bytes(hidden, layers, intermediate),
        "peaks": peaks,
        "check_s": said.get("config"),  # the launcher's pre-launch check
        "model_ready_s": said.get("model"),
        "first_step_s": said.get("ready"),
        "wall_s": wall,
        "stopped": stopped,  # the machine's available memory ran out: peaks so far
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="206m,0.8b")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument(
        "--whole",
        default="206m",
        help="sizes that also run the whole-model build (0.8b: four whole copies, about "
        "18 GiB; the run is stopped if the machine's available memory falls under 1.5 GiB)",
    )
    p.add_argument("--allocator", default="auto", choices=("auto", "release", "retain", "system"))
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="big-model-") as tmp:
        for size in a.sizes.split(","):
            contenders = (True, False) if size in a.whole.split(",") else (True,)
            for meta_init in contenders:
                row = run(
                    size, meta_init=meta_init, nproc=a.nproc, root=Path(tmp), allocator=a.allocator
                )
                rows.append(row)
                print_row(row, nproc=a.nproc)
    print()
    for size in {r["size"] for r in rows}:
        pair = {r["contender"]: r for r in rows if r["size"] == size}
        if len(pair) == 2:
            worst = {
                c: max(v for k, v in r["peaks"].items() if k != "launcher") for c, r in pair.items()
            }
            print(
                f"{size}: worst rank peak, whole / meta = {worst['whole'] / worst['meta']:.2f}x "
                f"({worst['whole'] / 2**30:.2f} / {worst['meta'] / 2**30:.2f} GiB)"
            )


def print_row(row: dict, *, nproc: int) -> None:
    full = row["params_bytes"]
    ranks = [row["peaks"].get(f"rank {r}", 0) for r in range(nproc)]
    gib = 2**30
    print(
        f"{row['size']:>5} {row['contender']:<5}  model {full / gib:.2f} GiB fp32  "
        f"launcher {row['peaks'].get('launcher', 0) / gib:.2f} GiB "
        f"(its check {row['check_s']} s)  ranks "
        + " ".join(f"{b / gib:.2f}" for b in ranks)
        + f" GiB  (worst {max(ranks) / full:.2f}x the model, "
        f"{'below' if max(ranks) < full else 'NOT below'} it)"
        + ("  STOPPED: the machine's memory ran out" if row["stopped"] else "")
        + f"  model built {row['model_ready_s']} s, "
        f"first step {row['first_step_s']} s, wall {row['wall_s']:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
