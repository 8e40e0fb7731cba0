"""What the benchmarks in bench/ share: the job, the clock, the launch, the tables.

Two halves in one module:

- Inside every rank (imported by the contender scripts `peer_*.py`): the job's flags
  (`add_job_args`), its data, model and sampler (`build_job`), the peers' loss
  (`job_loss`), AdamW as the docs write it (`docs_adamw`), the wall clock every contender
  is timed with (`WallClock`), what a library chose by default (`describe_defaults`) and
  the result file (`write_result`).
- In the driver (imported by the comparison scripts): how each contender is launched on N
  processes (`run_contender`), runs measured against other processes' load (`measured`),
  interleaved repetitions (`interleave`), the ratio table (`print_ratio_table`) and the
  table of differences in defaults (`print_defaults`).

The clock, identical for every contender: each rank runs warmup + steps + 1 optimizer
steps; at the top of step `warmup` and again at the top of step `warmup + steps` every rank
waits in a barrier, then reads `time.perf_counter()`; rank 0's difference is the time of
`steps` whole iterations (fetch, forward, backward, all-reduce, optimizer, loss logging).
Start-up, data loading, the extra step and scaletrain's final evaluation lie outside. For
scaletrain "the top of a step" is the trainer's call of `train_step` (the batch was fetched
just before), so its span is shifted by one fetch but holds `steps` of every part too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
BIN = Path(sys.executable).parent  # the venv's console scripts: scaletrain, accelerate

# --------------------------------------------------------------------------- the job

# Every flag of the job: the driver parses them and hands them on, unchanged, to each
# contender's processes. Defaults: the headline job of bench/peers.py.
JOB = {
    "model": ("mlp", "model name in scaletrain's registry, or a preset of JOB_MODELS (hf-llama)"),
    "size": ("base", "model size (mlp base: 784-1024-1024-10)"),
    "source": ("mnist", "scaletrain data source, train split"),
    "synthetic_examples": (4096, "examples of a synthetic source"),
    "seq_len": (128, "tokens per example of a text source (scaletrain's data.seq_len)"),
    "global_batch": (256, "examples per optimizer step over all ranks"),
    "micro_batch": (128, "examples per forward/backward on one rank"),
    "lr": (1e-3, "AdamW learning rate (constant)"),
    "weight_decay": (0.0, "AdamW weight decay (torch's default is 0.01: set for all)"),
    "grad_clip": (1.0, "global gradient-norm clip; 0: none"),
    "steps": (150, "timed optimizer steps"),
    "warmup": (10, "untimed optimizer steps first"),
    "log_every": (10, "one loss all-reduce every N steps (every contender)"),
    "seed": (0, "seed of the weights and the data order"),
    "procs": (2, "processes (ranks)"),
    "threads": (1, "torch threads per process; 0: scaletrain decides (cores / processes)"),
    "precision": ("fp32", "scaletrain's name; the peers know fp32 and bf16-mixed"),
}
# scaletrain's precision name -> what Accelerate and Fabric call it
ACCELERATE_PRECISION = {"fp32": "no", "bf16-mixed": "bf16"}
FABRIC_PRECISION = {"fp32": "32-true", "bf16-mixed": "bf16-mixed"}


# The one Llama of the "hf-llama" job (the sizes of configs/hf-llama.toml, 791,680
# parameters): every contender builds it from these kwargs, scaletrain through its
# overrides `model.kwargs.<k>=<v>`, the peers through `build_model("hf", kwargs=...)`.
HF_LLAMA_KWARGS = {
    "vocab_size": 256,  # byte-level text: the token ids are the bytes
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
# Job model names that are no registry name: the registry's arguments that build them.
JOB_MODELS = {
    "hf-llama": {"name": "hf", "hf_config": "LlamaConfig", "kwargs": HF_LLAMA_KWARGS},
}


def registry_model(a: argparse.Namespace) -> dict:
    """`build_model`'s name, hf_config and kwargs for the job's --model."""
    return {"name": a.model, "hf_config": "", "kwargs": {}, **JOB_MODELS.get(a.model, {})}


def add_job_args(p: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    """Add the job's flags to `p`, with `defaults` replacing the headline job's values."""
    unknown = set(defaults) - set(JOB)
    assert not unknown, f"not job flags: {unknown}"
    for key, (value, help_text) in JOB.items():
        value = defaults.get(key, value)
        p.add_argument(
            "--" + key.replace("_", "-"),
            type=type(value),
            default=value,
            help=f"{help_text} (default {value})",
        )
    return p


def check_job(p: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.Namespace:
    """Refuse a job whose timed window does not end on a loss-logging step."""
    if a.steps % a.log_every or a.warmup % a.log_every:
        p.error(
            f"--steps ({a.steps}) and --warmup ({a.warmup}) must be multiples of "
            f"--log-every ({a.log_every}): the final loss is the window ending the timing"
        )
    if a.global_batch % (a.micro_batch * a.procs):
        p.error("--global-batch must be a multiple of --micro-batch x --procs")
    return a


def job_argv(a: argparse.Namespace) -> list[str]:
    """The job's flags as a command line, to hand on to each contender's processes."""
    return [f"--{key.replace('_', '-')}={getattr(a, key)}" for key in JOB]


def worker_args(doc: str) -> argparse.Namespace:
    """A contender script's command line: the job's flags, --out and two per-contender flags."""
    p = add_job_args(argparse.ArgumentParser(description=doc.split("\n")[0]))
    p.add_argument("--out", required=True, help="result JSON, written by rank 0")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="scaletrain only: one more config override",
    )
    p.add_argument(
        "--match-scaletrain",
        action="store_true",
        help="hand-written loop only: over the DDP wrapper and optimizer scaletrain builds",
    )
    return check_job(p, p.parse_args())


def scaletrain_overrides(a: argparse.Namespace) -> list[str]:
    """The job as scaletrain config overrides; everything not named is scaletrain's default."""
    m = registry_model(a)
    model = [f"model.name={m['name']}", f"model.size={a.size}"]
    if m["hf_config"]:
        model.append(f"model.hf_config={m['hf_config']}")
    model += [f"model.kwargs.{k}={v}" for k, v in m["kwargs"].items()]
    return [
        f"name=bench-{a.model}-{a.size}",
        *model,
        f"data.source={a.source}",
        f"data.synthetic_examples={a.synthetic_examples}",
        f"data.seq_len={a.seq_len}",
        "optim.name=adamw",
        f"optim.lr={a.lr}",
        f"optim.weight_decay={float(a.weight_decay)}",
        "optim.schedule=constant",
        f"optim.grad_clip={float(a.grad_clip)}",
        f"train.steps={a.warmup + a.steps + 1}",
        f"train.global_batch={a.global_batch}",
        f"train.micro_batch={a.micro_batch}",
        f"train.seed={a.seed}",
        f"train.threads={a.threads}",
        f"train.eval_examples={a.micro_batch * a.procs}",
        f"parallel.dp={a.procs}",
        f"precision.mode={a.precision}",
        f"log.every={a.log_every}",
        "log.quiet=true",
    ]


def build_job(a: argparse.Namespace, *, rank: int, world: int):
    """(data, model, sampler) for this rank: scaletrain's data source, model and sampler.

    Seed the RNGs first (each library its own way); the model's weights are drawn after
    the data are loaded, as in scaletrain's trainer, so every contender starts from the
    same weights and sees the same examples in every step.
    """
    from scaletrain.data.loader import load_dataset
    from scaletrain.data.sampler import GlobalBatchSampler
    from scaletrain.models import build_model

    data = load_dataset(
        a.source,
        split="train",
        synthetic_examples=a.synthetic_examples,
        seq_len=a.seq_len,
        seed=a.seed,
    )
    m = registry_model(a)
    model = build_model(
        m["name"], size=a.size, task=data.spec, hf_config=m["hf_config"], kwargs=m["kwargs"]
    )
    sampler = GlobalBatchSampler(
        len(data),
        global_batch=a.global_batch,
        micro_batch=a.micro_batch,
        dp_rank=rank,
        dp_size=world,
        seed=a.seed,
        shard_rows=data.shard_rows,
    )
    return data, model, sampler


def job_loss(output, targets):
    """The peers' loss: mean cross-entropy over every target (examples or tokens).

    `output` is logits, (B, C) or (B, T, V), or a Hugging Face output holding them in
    `.logits`; `targets` is (B,) or (B, T), -100 = no loss. On the MLP job this is
    exactly `F.cross_entropy(model(x), y)` (flattening (B, C) changes nothing).

    The peers do not pass `labels=` to a Hugging Face model: scaletrain's text sources
    already shift the targets (targets[:, t] is the token after inputs[:, t]), and HF's
    `labels=` would shift once more (logits[:, :-1] against labels[:, 1:]). Calling
    `model(input_ids)` and this loss on the shifted targets is the same mean token
    cross-entropy that scaletrain's summed loss / token count computes.
    """
    import torch.nn.functional as F

    logits = getattr(output, "logits", output)  # (B, C) or (B, T, V)
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-100)


def docs_adamw(model, a: argparse.Namespace):
    """`torch.optim.AdamW` as PyTorch's, Accelerate's and Fabric's docs construct it.

    The job's hyperparameters only; no `foreach=` / `fused=`: torch picks the kernels (on
    CPU, the single-tensor for-loop).
    """
    import torch

    return torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)


def all_reduce_mean(value):
    """A hand-written mean over ranks (gloo has no AVG): sum, then divide."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value = value / dist.get_world_size()
    return value


class WallClock:
    """The one timer of every contender: barrier, then perf_counter, at two step boundaries.

    Call `tick(step)` at the top of every step, 0 to `total_steps - 1`.
    """

    def __init__(self, *, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.start: float | None = None
        self.seconds: float | None = None

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps + 1  # the last one only ends the timed span

    @property
    def end(self) -> int:
        """Steps completed when the timing stops (the final loss is that window's)."""
        return self.warmup + self.steps

    def tick(self, step: int) -> None:
        if step not in (self.warmup, self.end):
            return
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        now = time.perf_counter()
        if step == self.warmup:
            self.start = now
        else:
            self.seconds = now - self.start


def describe_defaults(model, optimizer) -> dict[str, str]:
    """What this contender runs with, as found on its live objects (call on every rank)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    facts = {"model wrapper": _chain(model, "_forward_module", "module")}
    ddp = next((m for m in model.modules() if isinstance(m, DistributedDataParallel)), None)
    if ddp is not None:
        facts.update(
            {
                "DDP gradient_as_bucket_view": str(ddp.gradient_as_bucket_view),
                "DDP bucket_cap_mb": f"{ddp.bucket_bytes_cap / 2**20:g}",
                "DDP static_graph": str(ddp.static_graph),
                "DDP find_unused_parameters": str(ddp.find_unused_parameters),
                "DDP forward_sync_buffers": str(getattr(ddp, "forward_sync_buffers", "?")),
            }
        )
    facts["optimizer"] = _chain(optimizer, "optimizer")
    inner = optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    facts["optimizer kernels"] = _optimizer_kernels(inner)
    facts["allocator"] = _allocator()
    facts["heap policy (mallopt)"] = "none set"  # scaletrain's worker records its own
    facts["torch threads"] = str(torch.get_num_threads())
    return facts


def _chain(obj, *attrs: str) -> str:
    """Wrapper classes down to the wrapped object: 'AcceleratedOptimizer > AdamW'."""
    names = [type(obj).__name__]
    while any(hasattr(obj, a) for a in attrs):
        obj = getattr(obj, next(a for a in attrs if hasattr(obj, a)))
        names.append(type(obj).__name__)
    return " > ".join(names)


def _optimizer_kernels(opt) -> str:
    fused, foreach = opt.defaults.get("fused"), opt.defaults.get("foreach")
    if fused:
        return "fused"
    if foreach:
        return "foreach"
    if fused is None and foreach is None:  # torch decides per device
        from torch.optim.optimizer import _default_to_fused_or_foreach

        params = [p for g in opt.param_groups for p in g["params"]]
        fused, foreach = _default_to_fused_or_foreach(params, False, False)
        return ("fused" if fused else "foreach" if foreach else "for-loop") + " (torch's choice)"
    return "for-loop"


def _allocator() -> str:
    """The malloc in this process (a preloaded one shows in its maps) and its tuning env."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    lib = next((n for n in ("jemalloc", "tcmalloc", "mimalloc") if n in maps), "glibc malloc")
    tuning = sorted(
        f"{k}={v}"
        for k, v in os.environ.items()
        if k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))
    )
    return " ".join([lib, *tuning])


def write_result(path: str, **fields) -> None:
    Path(path).write_text(json.dumps(fields, indent=1) + "\n")


def write_peer_result(
    a: argparse.Namespace,
    clock: WallClock,
    logged: dict[int, float],
    *,
    library: str,
    world_size: int,
    model,
    optimizer,
    **extra,
) -> None:
    """Rank 0's result of a hand-built contender: the timing, the loss of the window that
    ends it (`logged`: {steps done: mean loss}), who ran and the defaults it ran with."""
    import torch

    write_result(
        a.out,
        library=library,
        seconds=clock.seconds,
        steps=a.steps,
        final_loss=logged[clock.end],
        world_size=world_size,
        threads=torch.get_num_threads(),
        precision=a.precision,
        defaults={**describe_defaults(model, optimizer), **extra.pop("defaults", {})},
        **extra,
    )


# --------------------------------------------------------------------------- launching


def torchrun(script: str, nproc: int) -> list[str]:
    # A fixed-size job need not wait for late joiners: last_call_timeout 1 s, not 30 s.
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--rdzv-conf=last_call_timeout=1",
        str(BENCH / script),
    ]


def _launch(library: str, a: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command line that starts `library`'s N processes, and its extra environment."""
    match library:
        case "scaletrain":
            # Its workers get what scaletrain's own launcher gives them (launch/agent.py).
            from scaletrain.launch.agent import SUBPROCESS_ENV

            return torchrun("peer_scaletrain.py", a.procs), dict(SUBPROCESS_ENV)
        case "torch":
            return torchrun("peer_torch.py", a.procs), {}
        case "torch-matched":
            return torchrun("peer_torch.py", a.procs) + ["--match-scaletrain"], {}
        case "accelerate":
            # Not `--cpu`: with it `accelerate launch` silently starts ONE process (PLATFORM-NOTES).
            return [
                str(BIN / "accelerate"),
                "launch",
                "--multi_gpu",
                "--num_processes",
                str(a.procs),
                "--num_machines",
                "1",
                "--mixed_precision",
                ACCELERATE_PRECISION[a.precision],
                "--dynamo_backend",
                "no",
                str(BENCH / "peer_accelerate.py"),
            ], {}
        case "fabric":  # it calls fabric.launch(), which starts the other ranks
            return [sys.executable, str(BENCH / "peer_fabric.py")], {}
    raise ValueError(f"unknown contender {library!r}")


def run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    """Run a command; on failure exit with its output's tail. Returns its stdout."""
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    if proc.returncode != 0:
        sys.exit(
            f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}"
            f"\n{proc.stderr[-8000:]}"
        )  # torchrun's own traceback comes last: keep more
    return proc.stdout


def run_contender(
    library: str, a: argparse.Namespace, *, out_dir: Path, tag: str, extra: list[str] = ()
) -> dict:
    """One run of `library` on the job `a`; its result, checked for processes and threads."""
    out = Path(out_dir) / f"{tag}-{time.monotonic_ns()}.json"  # fresh per retry
    cmd, env = _launch(library, a)
    if a.threads:  # OpenMP's threads too (each script also sets torch's and reports them)
        env["OMP_NUM_THREADS"] = str(a.threads)
    run([*cmd, *job_argv(a), f"--out={out}", *extra], env=env)
    r = json.loads(out.read_text())
    assert r["world_size"] == a.procs, f"{tag} ran {r['world_size']} process(es), not {a.procs}"
    if a.threads:
        assert r["threads"] == a.threads, f"{tag} ran {r['threads']} threads per process"
    r["examples_per_s"] = a.steps * a.global_batch / r["seconds"]
    r["steps_per_s"] = a.steps / r["seconds"]
    r["ms_per_step"] = r["seconds"] / a.steps * 1e3
    return r


# ------------------------------------------------------------- noise from other processes
# The bench machine may be shared: a test suite or a JVM of someone else's job on the same
# cores halves a run's speed. Each run is measured for foreign load (scaletrain.runtime.load:
# CPU time taken on our CPUs outside this benchmark's process tree, per second of the run;
# so a run may be subprocesses or work in this process, as in bench/own_data.py), steal
# added: a run another VM slowed is as disturbed, though no waiting clears it. A run with
# more than NOISY_CORES is retried after the machine is quiet again, up to --retries times;
# the cleanest attempt is kept and the tables mark any that stayed noisy. The load module is
# imported where used: the ranks import this file too, and runtime/__init__ brings torch.
NOISY_CORES = 0.10  # runtime/load.py's NOISY_CORES, and its reasoning


def wait_for_quiet(*, limit_s: float = 180.0) -> float:
    """Sleep until 1 s has little foreign load (or `limit_s` passes); returns seconds waited
    before that quiet second."""
    from scaletrain.runtime.load import wait_quiet

    start = time.perf_counter()
    wait_quiet(limit_s=limit_s, threshold=NOISY_CORES)
    return max(0.0, time.perf_counter() - start - 1.0)


def measured(fn, *, retries: int) -> tuple[dict, float, str]:
    """Run `fn()` (subprocesses, or work in this process) until one attempt has little
    foreign load.

    Returns (result, foreign cores, note): the attempt with the least foreign load (steal
    included), and a note saying which attempt that was when there was more than one.
    """
    from scaletrain.runtime.load import Meter

    best, attempt = None, 0
    for attempt in range(1, retries + 2):
        wait_for_quiet()
        with Meter() as meter:
            result = fn()
        foreign = meter.load.foreign_cores + meter.load.steal_cores
        if best is None or foreign < best[1]:
            best = (result, foreign, attempt)
        if foreign <= NOISY_CORES:
            break
    result, foreign, chosen = best
    note = f"  (attempt {chosen} of {attempt})" if attempt > 1 else ""
    return result, foreign, note


def interleave(jobs: dict, *, reps: int, retries: int, line) -> dict[str, list[dict]]:
    """Run every job once per rep, the order rotated each rep so drift hits all alike.

    Args:
        jobs: {name: callable returning a result dict}.
        reps: repetitions.
        retries: re-runs of a run disturbed by other processes (`measured`).
        line: (rep, name, result) -> the text printed after each run.
    """
    names = list(jobs)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            r, foreign, note = measured(jobs[name], retries=retries)
            r["foreign"], r["noisy"] = foreign, foreign > NOISY_CORES
            results[name].append(r)
            print(
                f"  rep {rep} {line(rep, name, r)}  foreign load {foreign:.2f} cores{note}",
                flush=True,
            )
    return results


def base_parser(doc: str, *, reps: int = 3) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--reps", type=int, default=reps, help="interleaved repetitions")
    p.add_argument(
        "--retries", type=int, default=2, help="re-runs of a run disturbed by other processes"
    )
    return p


# --------------------------------------------------------------------------- tables


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def per_rep(runs: list[dict], key: str, fmt: str) -> str:
    """Each rep's value; '~' marks a run that stayed noisy after the retries."""
    return " ".join(format(r[key], fmt) + ("~" if r["noisy"] else "") for r in runs)


def print_ratio_table(
    results: dict[str, list[dict]],
    *,
    reference: str,
    targets: dict[str, float],
    key: str = "examples_per_s",
) -> None:
    """Median `key` per contender, each rep, reference / contender, final loss; verdicts."""
    reps = max(len(runs) for runs in results.values())
    width = max(24, 9 * reps)
    ours = median(results[reference], key)
    print(
        f"{'contender':<14} {key:>14}  {'per rep':<{width}} {reference + ' / it':>15} "
        f"{'final loss':>11} {'procs':>5} {'threads':>7}"
    )
    for name, runs in results.items():
        speed = median(runs, key)
        losses = {round(r["final_loss"], 6) for r in runs}  # deterministic: one value
        loss = f"{runs[0]['final_loss']:.5f}" + ("" if len(losses) == 1 else "*")
        print(
            f"{name:<14} {speed:>14.1f}  {per_rep(runs, key, '.1f'):<{width}} "
            f"{ours / speed:>15.3f} {loss:>11} {runs[0]['world_size']:>5} "
            f"{runs[0]['threads']:>7}"
        )
    print(
        f"~ : still had > {NOISY_CORES} cores of foreign load after the retries;"
        " * : the final loss differed between reps"
    )
    for name, target in targets.items():
        ratio = ours / median(results[name], key)
        state = (
            "ok" if ratio >= target else "within noise (2%)" if ratio >= target - 0.02 else "BELOW"
        )
        print(f"{reference} / {name:<13}: {ratio:.3f}  {state} (target >= {target:g})")


def print_defaults(results: dict[str, list[dict]]) -> None:
    """Each contender's settings as found on its live objects; '*' marks a difference.

    Rows only some contenders have (scaletrain's config keys) show '-' for the others.
    """
    facts = {name: runs[0]["defaults"] for name, runs in results.items()}
    keys = list(dict.fromkeys(k for f in facts.values() for k in f))
    width = {name: max(len(name), *(len(f.get(k, "-")) for k in keys)) for name, f in facts.items()}
    print(f"  {'setting (* = differs)':<30} " + " | ".join(f"{n:<{width[n]}}" for n in facts))
    for k in keys:
        values = [facts[n].get(k, "-") for n in facts]
        mark = "*" if len(set(values) - {"-"}) > 1 else " "  # '-': not that library's setting
        print(f"{mark} {k:<30} " + " | ".join(f"{v:<{width[n]}}" for n, v in zip(facts, values)))
