"""`precision.mode = "auto"` by measurement: fp32 or bf16-mixed, whichever steps the
configured model faster on this machine.

A CPU's capability flags say whether bf16 is emulated (no avx512_bf16, no AMX: about 100x
slower, precision.py), not whether it pays: on a CPU that has them, bf16 matmuls run 2-9x
fp32's, but casts, the attention kernel and the element-wise work can eat the gain on a
small model. So where bf16 is native, the launcher times the model's own step in both
modes before any worker starts (`probe`: the configured model, data and loss, one
micro-batch a step, the threads each rank will have, each mode with its own measured
attention kernel, the two interleaved), and the faster one is what the workers run
(`resolve_auto` puts it in their config). The result is cached per machine, torch version,
threads and job (`~/.cache/scaletrain/auto-precision.json`), so the probe runs once.

Where nothing is measured, the capability table of `precision.decide_auto` decides: on a
GPU, on a CPU whose bf16 is emulated, for a model too large to build whole in the
launcher, and under [distill] (the teacher's cost would dominate the probe). A resumed run
keeps the mode its run started with (its checkpoint's config), so resume stays exact.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from scaletrain.config import Config
from scaletrain.launch.resolve import Derived
from scaletrain.precision import decide_auto, detect_hardware, make_precision
from scaletrain.runtime.hardware import cpu_name
from scaletrain.training.assemble import (
    NO_CODE,
    UserCode,
    build_data,
    build_net,
    build_objective,
    measure_attention,
    tensor_bytes,
)

CACHE = Path.home() / ".cache" / "scaletrain" / "auto-precision.json"
MODES = ("fp32", "bf16-mixed")
# A model larger than this is not built whole in the launcher to be timed: the table
# decides (the same bound as the trainer's check on meta, training/assemble.py).
PROBE_MAX_BYTES = 256 * 2**20


@dataclass(frozen=True)
class AutoChoice:
    mode: str  # what `auto` runs
    why: str  # one clause for explain and the start-up line
    seconds: dict[str, float] | None = None  # each mode's median step, where measured


def resolve_auto(
    config: Config,
    derived: Derived,
    *,
    code: UserCode = NO_CODE,
    resumed_mode: str | None = None,
    cache: Path = CACHE,
) -> tuple[Config, AutoChoice | None]:
    """`config` with precision.mode "auto" replaced by the mode it resolves to here, and the
    choice (None when the mode was not auto).

    Args:
        config: the validated config.
        derived: its layout on this launch (threads per rank, the backend).
        code: the Python API's callables.
        resumed_mode: the mode the run being resumed started with (its checkpoint's).
        cache: the probe's cache file.
    """
    if config.precision.mode != "auto":
        return config, None
    if resumed_mode == "auto":  # a run from before the probe: its workers used the table
        mode, why = decide_auto(detect_hardware("cuda" if derived.backend == "nccl" else "cpu"))
        return config, AutoChoice(mode, f"{why} (as the resumed run started)")
    if resumed_mode is not None:
        choice = AutoChoice(resumed_mode, "the mode the resumed run started with")
    elif derived.backend == "nccl" or config.distill.teacher or config.distill.cache:
        mode, why = decide_auto(detect_hardware("cuda" if derived.backend == "nccl" else "cpu"))
        choice = AutoChoice(mode, why)
    else:
        choice = probe(config, threads=derived.threads, code=code, cache=cache)
    precision = config.precision.model_copy(update={"mode": choice.mode})
    return config.model_copy(update={"precision": precision}), choice


def probe(
    config: Config, *, threads: int, code: UserCode = NO_CODE, cache: Path = CACHE
) -> AutoChoice:
    """fp32 or bf16-mixed for `config` on this CPU: the table where bf16 is emulated, else
    the faster of the two measured (or cached) steps."""
    hw = detect_hardware("cpu")
    if not (hw.avx512_bf16 or hw.amx):
        mode, why = decide_auto(hw)
        return AutoChoice(mode, f"{why}: bf16 would be emulated, fp32 without measuring")
    key = _cache_key(config, threads=threads)
    known = _read_cache(cache).get(key)
    if known is not None:
        return AutoChoice(
            known["mode"],
            f"measured on this machine before ({_times(known['seconds'])})",
            known["seconds"],
        )
    steps = _steps(config, threads=threads, code=code)
    if steps is None:
        mode, why = decide_auto(hw)
        return AutoChoice(mode, f"{why} (the model is too large to time in the launcher)")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        mode, seconds = faster(steps)
    finally:
        torch.set_num_threads(previous)
    _write_cache(cache, key, {"mode": mode, "seconds": seconds})
    return AutoChoice(mode, f"measured on this machine ({_times(seconds)})", seconds)


def faster(
    steps: dict[str, Callable[[], None]],
    *,
    clock: Callable[[], float] = time.perf_counter,
    warmup: int = 1,
    reps: int = 3,
) -> tuple[str, dict[str, float]]:
    """The mode whose step has the lower median time, and each mode's median: `warmup`
    steps of each first, then `reps` rounds of one step of each in turn, so that a
    machine that slows down for a while slows both."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    for _ in range(reps):
        for mode, step in steps.items():
            started = clock()
            step()
            times[mode].append(clock() - started)
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    return min(medians, key=medians.__getitem__), medians


def _steps(config: Config, *, threads: int, code: UserCode) -> dict[str, Callable[[], None]] | None:
    """One training step of the configured model in each mode (each with its own measured
    attention kernel), on one micro-batch; None when the model is too large to build."""
    from scaletrain.training.optim import from_section
    from scaletrain.training.step import train_step

    torch.manual_seed(config.train.seed)
    dataset = build_data(config, split="train", code=code)
    with torch.device("meta"):
        shapes = build_net(config, dataset, code=code, meta=True)
    if tensor_bytes(shapes) > PROBE_MAX_BYTES:
        return None
    first = torch.arange(config.train.micro_batch) % len(dataset)
    batch = dataset.get(first)
    steps = {}
    for mode in MODES:
        precision = make_precision(mode, device_type="cpu")
        net = build_net(config, dataset, code=code)
        model, loss_fn, _ = build_objective(config, net, dataset, precision=precision, code=code)
        model = precision.convert_module(model)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            precision.attention, _ = measure_attention(
                model, dataset, first, precision=precision, micro_batch=config.train.micro_batch
            )
        finally:
            torch.set_num_threads(previous)
        optimizer, scheduler = from_section(model, config.optim, total_steps=10**6)

        def step(model=model, optimizer=optimizer, scheduler=scheduler, p=precision, f=loss_fn):
            train_step(
                model,
                [batch],
                optimizer=optimizer,
                scheduler=scheduler,
                precision=p,
                grad_clip=config.optim.grad_clip,
                dp_size=1,
                ragged_counts=dataset.spec.ragged,
                loss_fn=f,
            )

        steps[mode] = step
    return steps


def _cache_key(config: Config, *, threads: int) -> str:
    """What decides the two step times: the machine, torch, the threads and the job."""
    job = {
        "cpu": cpu_name(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": threads,
        "model": config.model.model_dump(mode="json"),
        "data": config.data.model_dump(mode="json", include={"source", "seq_len", "kwargs"}),
        "micro_batch": config.train.micro_batch,
        "loss": config.train.loss,
        "optim": config.optim.model_dump(mode="json", include={"name", "impl"}),
    }
    return hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()


def _read_cache(path: Path) -> dict:
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or damaged: measure again
        return {}
    return values if isinstance(values, dict) else {}


def _write_cache(path: Path, key: str, value: dict) -> None:
    from scaletrain.runtime import written_atomically

    values = {**_read_cache(path), key: value}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with written_atomically(path) as tmp:
            tmp.write_text(json.dumps(values, indent=1))
    except OSError:  # a read-only home: the probe runs again next time, nothing else
        pass


def describe_auto(choice: AutoChoice) -> str:
    """One line: what auto chose and why."""
    return f"precision.mode = 'auto' -> {choice.mode}: {choice.why}"


def _times(seconds: dict[str, float]) -> str:
    return ", ".join(f"{mode} {s * 1e3:.0f} ms a step" for mode, s in seconds.items())
