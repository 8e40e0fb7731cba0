"""The CPU heap policy: glibc defaults vs `retain` (train.allocator), interleaved.

The train step of the MLP-base (784-1024-1024-10, 1.86M parameters) at batch 512 on one
thread: fused AdamW, forward, backward. Prints page faults per step, ms per step and peak
RSS for each policy, each in a fresh process: mallopt applies to the whole process and
cannot be undone, so the two policies never share one.

The network is a plain `nn.Sequential`, not scaletrain's registry MLP (which adds Flatten
and Dropout(0) layers): BENCHMARKS.md ("Allocator") reports this network.

    .venv/bin/python bench/allocator.py [system|retain]   # one process; no argument: all, 3 reps
"""

import resource
import subprocess
import sys
import time

import torch

from scaletrain.runtime.allocator import configure_allocator

REPS = 3
POLICIES = ("system", "retain")
BATCH = 512
WARMUP, TIMED = 3, 20  # steps


def measure(policy: str) -> str:
    """Set `policy` in this process, then time the train step; one line of results."""
    mode = configure_allocator(policy, device_type="cpu")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x, y = torch.randn(BATCH, 784), torch.randint(0, 10, (BATCH,))

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(WARMUP):
        step()
    faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    for _ in range(TIMED):
        step()
    ms = (time.perf_counter() - start) / TIMED * 1000
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (
        f"{mode} {(usage.ru_minflt - faults) // TIMED} faults/step {ms:.1f} ms/step "
        f"{usage.ru_maxrss // 1024} MiB"
    )


def main() -> None:
    if len(sys.argv) > 1:  # one policy, in this process
        print(measure(sys.argv[1]))
        return
    for _ in range(REPS):  # the driver: a fresh process per policy, interleaved
        for policy in POLICIES:
            subprocess.run([sys.executable, __file__, policy], check=True)


if __name__ == "__main__":
    main()
