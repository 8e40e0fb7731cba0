"""The CPU heap policy: glibc defaults vs `retain` (train.allocator), interleaved.

The train step of the MLP-base (784-1024-1024-10, 1.86M parameters) at batch 512 on one
thread: fused AdamW, forward, backward. Prints page faults per step, ms per step and peak
RSS for each policy, each in a fresh process (mallopt applies to the process).

    .venv/bin/python bench/allocator.py [system|retain]   # one process; no argument: all, 3 reps
"""
import subprocess
import resource, sys, time

import torch
from scaletrain.allocator import configure_allocator
if len(sys.argv) == 1:  # the driver: fresh processes, interleaved
    for rep in range(3):
        for policy in ("system", "retain"):
            subprocess.run([sys.executable, __file__, policy], check=True)
    sys.exit(0)
mode = configure_allocator(sys.argv[1], device_type="cpu")
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
opt = torch.optim.AdamW(model.parameters(), fused=True)
x, y = torch.randn(512, 784), torch.randint(0, 10, (512,))
def step():
    torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step(); opt.zero_grad()
for _ in range(3): step()
b = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t = time.perf_counter()
for _ in range(20): step()
print(mode, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - b) // 20, "faults/step", f"{(time.perf_counter()-t)/20*1000:.1f} ms/step", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, "MiB")
