"""Where a training step goes: scaletrain's step against a plain PyTorch loop, op by op.

For each model (GPT small and base, the HF Llama of configs/hf-llama.toml) and precision
(fp32, bf16-mixed), one process with --threads threads trains micro-batches of --batch
sequences of --seq-len bytes:

- plain: the model, `torch.autocast` (bf16-mixed), cross-entropy summed over the tokens and
  divided by their count, backward, fused AdamW, zero_grad: nothing else;
- scaletrain: what `scaletrain train` builds for the same job in one process
  (`training.build.build`: its precision policy, attention kernel, optimizer, loss), each step
  through `training.step.train_step` as the trainer calls it;
- compiled (--compile): the same with `train.compile = true`, its first step (the compile)
  timed apart.

Each contender runs --warmup steps, then --steps timed ones (the median is printed), then
one more under `torch.profiler`, whose self CPU time is shared out into categories by op
name (CATEGORIES): matmul, attention, element-wise, norm, cast, optimizer, and the rest
(framework: views, allocation, autograd's bookkeeping). The table prints each row's step,
MFU against the profile's peak for that precision (when a profile exists), the shares,
and scaletrain's step over the plain loop's (>1: slower).

    .venv/bin/python bench/step_anatomy.py                       # all six jobs, ~1 min
    .venv/bin/python bench/step_anatomy.py --models gpt-base --precisions bf16-mixed --top 15
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import HF_LLAMA_KWARGS
from torch.profiler import ProfilerActivity, profile

MODELS = {  # name -> scaletrain overrides of the model section
    "gpt-small": ["model.name=gpt", "model.size=small"],
    "gpt-base": ["model.name=gpt", "model.size=base"],
    "hf-llama": [
        "model.name=hf",
        "model.hf_config=LlamaConfig",
        *(f"model.kwargs.{k}={v}" for k, v in HF_LLAMA_KWARGS.items()),
    ],
}
# An op's category: the first whose words appear in its name (lower case), in this order.
CATEGORIES = (
    ("attention", ("scaled_dot_product", "flash_attention", "softmax", "_efficient_attention")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")),
    ("norm", ("layer_norm", "rms_norm", "aten::rsqrt", "aten::pow")),
    ("cast", ("aten::copy_", "aten::_to_copy", "aten::to")),
    ("optimizer", ("adam", "optimizer", "aten::_foreach", "aten::lerp", "aten::addcmul")),
    (
        "element-wise",
        (
            "gelu",
            "silu",
            "aten::add",
            "aten::mul",
            "aten::div",
            "aten::sub",
            "aten::neg",
            "aten::where",
            "aten::cat",
            "aten::sum",
            "aten::mean",
            "nll_loss",
            "log_softmax",
            "aten::fill_",
            "aten::zero_",
            "aten::embedding",
            "aten::all",
            "aten::masked_fill",
            "aten::clamp",
        ),
    ),
)


def category(op: str) -> str:
    name = op.lower()
    for cat, words in CATEGORIES:
        if any(w in name for w in words):
            return cat
    return "framework"


def compiled_job(model: str, precision: str, a: argparse.Namespace):
    """scaletrain's step with train.compile = true (torch.compile, inductor)."""
    return scaletrain_job(model, precision, a, extra=("train.compile=true",))


def scaletrain_job(model: str, precision: str, a: argparse.Namespace, extra: tuple = ()):
    """(step function, model, tokens per step, model FLOPs per step, peak) for scaletrain's
    own step in this process."""
    from scaletrain.config import load_config
    from scaletrain.launch.resolve import resolve
    from scaletrain.runtime import ProcessEnv, seed_everything
    from scaletrain.training.build import build
    from scaletrain.training.step import train_step

    overrides = [
        *MODELS[model],
        "data.source=wikitext",
        f"data.seq_len={a.seq_len}",
        f"train.micro_batch={a.batch}",
        f"train.global_batch={a.batch}",
        f"train.steps={a.warmup + a.steps + 2}",
        f"precision.mode={precision}",
        "optim.warmup_steps=0",
        "log.quiet=true",
        *extra,
    ]
    config = load_config(None, overrides)
    derived = resolve(config, world_size=1, nproc_per_node=1)
    seed_everything(0)
    run_dir = Path(tempfile.mkdtemp(prefix="anatomy-"))
    parts = build(config, derived, ProcessEnv(), device=torch.device("cpu"), run_dir=run_dir)
    state = parts.state
    counter = iter(range(10**9))

    def step() -> None:
        s = next(counter)
        micro = [parts.train_ds.get(i) for i in parts.sampler.micro_batches(s)]
        train_step(
            state.model,
            micro,
            optimizer=state.optimizer,
            scheduler=state.scheduler,
            precision=state.precision,
            grad_clip=config.optim.grad_clip,
            dp_size=1,
            ragged_counts=parts.train_ds.spec.ragged,
            loss_fn=parts.loss_fn,
        )

    return step, state.model, state.precision


def plain_job(model: str, precision: str, a: argparse.Namespace):
    """The same model and batch in the loop a PyTorch user writes."""
    from scaletrain.data.sources import TaskSpec
    from scaletrain.models import build_model

    torch.manual_seed(0)
    task = TaskSpec("lm", (a.seq_len,), 256)
    if model == "hf-llama":
        net = build_model("hf", size="", task=task, hf_config="LlamaConfig", kwargs=HF_LLAMA_KWARGS)
    else:
        net = build_model("gpt", size=model.removeprefix("gpt-"), task=task)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, 256, (a.batch, a.seq_len))
    y = torch.randint(0, 256, (a.batch, a.seq_len))
    bf16 = precision == "bf16-mixed"

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = net(x)
            logits = out.logits if hasattr(out, "logits") else out
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, net, None


def timed(step, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        out.append(time.perf_counter() - started)
    return out


def anatomy(step, a: argparse.Namespace) -> tuple[dict[str, float], list]:
    """The profiled step's share of each category, and its top ops."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    shares: dict[str, float] = {}
    for e in events:
        shares[category(e.key)] = shares.get(category(e.key), 0.0) + e.self_cpu_time_total / total
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[: a.top]
    return shares, [(e.key, e.self_cpu_time_total / total) for e in top]


def model_flops(net, a: argparse.Namespace) -> float:
    from scaletrain.models.flops import train_flops

    with contextlib.suppress(Exception):
        return float(train_flops(net, torch.randint(0, 256, (1, a.seq_len)))) * a.batch
    return float("nan")


def peaks() -> dict[str, float]:
    """Matmul FLOP/s of one process: the calibrated profile's, else measured here on 2048^3
    products (planner/calibrate.matmul_rate) with this process's threads."""
    from scaletrain.planner.calibrate import matmul_rate
    from scaletrain.runtime.hardware import default_profile

    profile = default_profile("cpu")
    if profile is not None:
        return {k: profile.peak(k) for k in ("fp32", "bf16")}
    shapes = [(2048, 2048, 2048)]
    return {"fp32": matmul_rate(torch.float32, shapes), "bf16": matmul_rate(torch.bfloat16, shapes)}


def main() -> None:
    from scaletrain.precision import matmul_dtype

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--precisions", default="fp32,bf16-mixed")
    p.add_argument("--batch", type=int, default=16, help="sequences a step (one micro-batch)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps a repetition")
    p.add_argument("--reps", type=int, default=3, help="repetitions, the contenders in turn")
    p.add_argument("--top", type=int, default=0, help="also print each job's N heaviest ops")
    p.add_argument(
        "--compile", action="store_true", help="also scaletrain with train.compile = true"
    )
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cats = ["matmul", "attention", "element-wise", "norm", "cast", "optimizer", "framework"]
    rates = peaks()
    print(
        f"step anatomy: {a.batch} x {a.seq_len} tokens a step, 1 process x {a.threads} "
        f"threads, torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; matmul peak fp32 "
        f"{rates['fp32'] / 1e9:.0f}, bf16 {rates['bf16'] / 1e9:.0f} GFLOP/s; median of "
        f"{a.reps} x {a.steps} steps, the contenders interleaved"
    )
    header = f"{'job':<30}{'step ms':>9}{'MFU':>7}  " + "".join(f"{c[:9]:>10}" for c in cats)
    print(header + f"{'vs plain':>10}")
    for model in a.models.split(","):
        for precision in a.precisions.split(","):
            contenders = [("plain", plain_job), ("scaletrain", scaletrain_job)]
            contenders += [("compiled", compiled_job)] if a.compile else []
            jobs = {who: job(model, precision, a) for who, job in contenders}
            times: dict[str, list[float]] = {who: [] for who in jobs}
            first: dict[str, float] = {}
            for who, (step, _, _) in jobs.items():
                first[who] = timed(step, a.warmup)[0]
            for _ in range(a.reps):
                for who, (step, _, _) in jobs.items():
                    times[who] += timed(step, a.steps)
            for who, (step, net, _) in jobs.items():
                seconds = statistics.median(times[who])
                shares, top = anatomy(step, a)
                flops = model_flops(net, a)
                mfu = flops / seconds / rates[matmul_dtype(precision)]
                ratio = (
                    f"{seconds / statistics.median(times['plain']):>9.2f}x"
                    if who != "plain"
                    else ""
                )
                if who == "compiled":
                    ratio += f"  (first step {first[who]:.1f} s)"
                row = f"{model + ' ' + precision + ' ' + who:<30}{seconds * 1e3:>9.1f} {mfu:6.1%} "
                print(row + "".join(f"{shares.get(c, 0.0):>10.1%}" for c in cats) + ratio)
                for name, share in top:
                    print(f"      {share:6.1%}  {name}")


if __name__ == "__main__":
    main()
