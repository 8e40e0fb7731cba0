"""Every optimizer the README names trains the same under dp=2, dp_shard=2 and tp=2 as in
one process, and its state resumes across layouts.

The reference is written by hand, independently of training/optim.py: torch's optimizer
constructed with the arguments `[optim]` stands for (kwargs included; for muon torch's Muon
on the blocks' 2-D weights and AdamW on the rest), a plain loop of forward, summed loss over
the count, backward, torch's clip_grad_norm_ and the step, with the learning rate set from
the schedule. scaletrain's own build (`from_section`, `layout_impl`, `hidden_matrices`, as
training/build.py calls them) and train step (`train_step`) run the same 4 steps in one
process, under DDP (dp=2), FSDP2 (dp_shard=2) and tensor parallelism with sequence
parallelism (tp=2; parallel/compose.parallelize): each logged loss and every final weight within 1e-9
of the reference in float64. Each case passes a keyword argument through optim.kwargs that
changes the weights by 100 x the tolerance or more (test_the_kwargs_matter), so a dropped
kwarg, or Muon's two halves swapped, fails the comparison.

Resume: Adafactor (factored moments kept whole, the vector moments sharded) and Muon (its
momentum sharded, its AdamW half's moments) save a checkpoint after step 2 under
dp_shard=2, Adagrad under DDP (dp=2, its fused kernel) - checkpoint.Checkpointer, the
trainer's TrainState. Resumed under the same layout, the run ends bit-identical to the
uninterrupted one; resumed under the other layouts, and in one process, within 1e-9 of the
reference.

Speed: one gloo process group of 2 ranks for every case (this file run as a script, one
interpreter that imports once and forks rank 1); a tiny GPT, 4 steps. The one-process runs
and the reference run in the test's own process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from harness import free_port, rank_env

TOL = 1e-9
STEPS = 4
STOP = 2  # the resume cases' checkpoint: after this many steps
GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 256
LR, WD, BETAS, MOMENTUM = 3e-3, 0.5, (0.9, 0.95), 0.9
WARMUP, MIN_LR_RATIO = 1, 0.1
JOB_TIMEOUT = 300.0  # 36 runs of 4 steps on 2 ranks; generous, as the machine is shared


def _muon_reference(named: dict, kwargs: dict) -> list[torch.optim.Optimizer]:
    hidden = {n for n, p in named.items() if n.startswith("blocks.") and p.ndim == 2}
    return [
        torch.optim.Muon(
            [named[n] for n in hidden],
            lr=LR,
            weight_decay=WD,
            momentum=MOMENTUM,
            adjust_lr_fn="match_rms_adamw",
            **kwargs,
        ),
        torch.optim.AdamW(
            [p for n, p in named.items() if n not in hidden], lr=LR, betas=BETAS, weight_decay=WD
        ),
    ]


def _one(cls, **shared):
    """A reference builder: torch's `cls` over every parameter, [optim]'s `shared` values
    and the case's kwargs."""
    return lambda named, kwargs: [cls(named.values(), lr=LR, **shared, **kwargs)]


# The attention's key bias has no gradient in exact arithmetic (softmax ignores a constant
# added to every key's score), only rounding noise, which each layout sums differently.
# Dividing by the root of its square (Adam's family, Adafactor) would turn that noise into
# updates of their own: an L2 decay (Adam, NAdam, RMSprop, Adagrad) feeds the bias back
# into its gradient, and Adafactor's default eps1 (the dtype's epsilon) lets the noise
# through whole. Those cases run without the L2 decay, Adafactor with eps1 = 1e-10 and
# Adagrad with eps = 1e-8 (for its 1e-10).
NO_L2 = ("adam", "nadam", "rmsprop", "adagrad")
ADAM = {"betas": BETAS}
# optim.name -> (optim.kwargs, (parameters by name, kwargs) -> the reference's optimizers)
OPTIMIZERS = {
    "adamw": ({"eps": 1e-6}, _one(torch.optim.AdamW, **ADAM, weight_decay=WD)),
    "adam": ({"amsgrad": True}, _one(torch.optim.Adam, **ADAM, weight_decay=0.0)),
    "sgd": ({"nesterov": True}, _one(torch.optim.SGD, momentum=MOMENTUM, weight_decay=WD)),
    "nadam": ({"momentum_decay": 0.02}, _one(torch.optim.NAdam, **ADAM, weight_decay=0.0)),
    "radam": (
        {"decoupled_weight_decay": True},
        _one(torch.optim.RAdam, **ADAM, weight_decay=WD),
    ),
    "adafactor": (
        {"beta2_decay": -0.6, "eps": [1e-10, 1e-3]},
        _one(torch.optim.Adafactor, weight_decay=WD),
    ),
    "muon": ({"ns_steps": 4}, _muon_reference),
    "rmsprop": (
        {"centered": True},
        _one(torch.optim.RMSprop, momentum=MOMENTUM, weight_decay=0.0),
    ),
    "adagrad": ({"lr_decay": 0.05, "eps": 1e-8}, _one(torch.optim.Adagrad, weight_decay=0.0)),
}
LAYOUTS = {"dp2": {"dp_replicate": 2}, "dp_shard2": {"dp_shard": 2}, "tp2": {"tp": 2}}
# name -> the layout its checkpoint is saved under; resumed under every layout and 1 process.
# Adagrad: DDP runs its fused kernel, FSDP its foreach one (no DTensor rule for the fused).
RESUMED = {"adafactor": "dp_shard2", "muon": "dp_shard2", "adagrad": "dp2"}


# --------------------------------------------------------------------------- one run


def _optim(name: str, *, kwargs: bool = True):
    from scaletrain.config import OptimConfig

    return OptimConfig(
        name=name,
        lr=LR,
        weight_decay=0.0 if name in NO_L2 else WD,
        betas=BETAS,
        momentum=MOMENTUM,
        warmup_steps=WARMUP,
        min_lr_ratio=MIN_LR_RATIO,
        kwargs=OPTIMIZERS[name][0] if kwargs else {},
    )


def _fresh_model() -> torch.nn.Module:
    from scaletrain.models.gpt import GPT, GPT_SHAPES

    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=SEQ, shape=GPT_SHAPES["tiny"]).double()


def _batches():
    """STEPS global batches of (GLOBAL_BATCH, SEQ) token ids and their next tokens."""
    from scaletrain.data.sources import Batch

    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=generator)
    return [
        Batch(inputs=t[:, :-1], targets=t[:, 1:], count=t[:, 1:].numel(), tokens=t.numel())
        for t in tokens
    ]


def _share(batch, *, dp_rank: int, dp: int):
    from scaletrain.data.sources import Batch

    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    x, y = batch.inputs[rows], batch.targets[rows]
    return Batch(inputs=x, targets=y, count=y.numel(), tokens=x.numel())


def train(
    name: str,
    degrees: dict[str, int],
    *,
    rank: int = 0,
    kwargs: bool = True,
    save: Path | None = None,
    resume: Path | None = None,
) -> dict:
    """scaletrain's build and step for `name` under `degrees`: {"losses": [one per step
    run], "weights": {plain name: whole tensor}}. `save`: checkpoint after STOP steps into
    that directory; `resume`: start from that checkpoint."""
    import torch.distributed as dist

    from scaletrain.checkpoint import Checkpointer, TrainState, load
    from scaletrain.config import ParallelConfig
    from scaletrain.models.protocol import model_spec
    from scaletrain.parallel.compose import parallelize
    from scaletrain.parallel.layout import ParallelLayout
    from scaletrain.precision import make_precision
    from scaletrain.records.memory import held_bytes
    from scaletrain.training.optim import from_section, layout_impl
    from scaletrain.training.optimizers import hidden_matrices, plain_name
    from scaletrain.training.step import train_step

    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = ParallelLayout(**degrees).resolve(world)
    optim = _optim(name, kwargs=kwargs)
    precision = make_precision("fp64", device_type="cpu", sharded=layout.splits_gradients)
    model = _fresh_model()
    hidden = hidden_matrices(model)  # as training/build.py: on the bare, whole model
    par = parallelize(
        model,
        spec=model_spec(model),
        layout=layout,
        rank=rank,
        device=torch.device("cpu"),
        parallel=ParallelConfig(),
        pipeline=None,
        precision=precision,
    )
    impl = layout_impl(optim, splits_gradients=layout.splits_gradients, loss_scaled=False)
    optimizer, scheduler = from_section(
        par.model, optim, total_steps=STEPS, impl=impl, hidden=hidden
    )
    state = TrainState(par.model, optimizer, scheduler, precision)
    if resume is not None:
        load(resume, state)
    dp_group = layout.dp_group(par.mesh)
    losses = []
    for step, batch in enumerate(_batches()):
        if step < state.step:
            continue
        micro = [_share(batch, dp_rank=layout.dp_rank(rank), dp=layout.dp)]
        result = train_step(
            par.model,
            micro,
            optimizer=optimizer,
            scheduler=scheduler,
            precision=precision,
            grad_clip=1.0,
            dp_size=layout.dp,
            ragged_counts=False,
            dp_group=dp_group,
        )
        loss_sum = result.loss_sum.clone()
        if dp_group is not None:  # tensor-parallel peers hold the same loss: dp only
            dist.all_reduce(loss_sum, group=dp_group)
        losses.append(float(loss_sum) / result.count)
        state.step = step + 1
        if save is not None and state.step == STOP:
            Checkpointer(save, keep=1, async_save=False, config_toml="").save(state)
    weights = {
        plain_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in par.model.named_parameters()
    }
    return {"losses": losses, "weights": weights, "held": held_bytes(par.model, optimizer)}


def reference(name: str, *, kwargs: bool = True) -> dict:
    """The hand-written run: torch's optimizer(s) for `name` in a plain loop (module doc)."""
    from scaletrain.training.optim import lr_multiplier

    model = _fresh_model()
    named = dict(model.named_parameters())
    case_kwargs, build = OPTIMIZERS[name]
    optimizers = build(named, case_kwargs if kwargs else {})
    losses = []
    for step, batch in enumerate(_batches()):
        lr = LR * lr_multiplier(
            step,
            warmup_steps=WARMUP,
            total_steps=STEPS,
            schedule="cosine",
            min_lr_ratio=MIN_LR_RATIO,
        )
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        logits = model(batch.inputs)  # (B, T, V)
        loss = (
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch.targets.flatten(), reduction="sum"
            )
            / batch.count
        )
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in named.items()}}


# --------------------------------------------------------------------------- the job


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every 2-rank run, in one process group (this file as a script): (name, layout) ->
    result, plus "<name>-resumed-<layout>" runs of RESUMED from their checkpoints."""
    root = tmp_path_factory.mktemp("optim-parity")
    proc = subprocess.Popen(
        [sys.executable, __file__, str(root)],
        env=rank_env(0, world_size=2, port=free_port()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # both ranks in one process group: killed together
    )
    try:
        out = proc.communicate(timeout=JOB_TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        out = f"(the job did not finish within {JOB_TIMEOUT} s)"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    results = root / "results.pt"
    logs = [
        f"--- rank {r}:\n{(root / f'rank{r}.log').read_text()[-4000:]}"
        for r in range(2)
        if (root / f"rank{r}.log").exists()
    ]
    assert results.exists(), f"the 2-rank job failed: {out[-2000:]}\n" + "\n".join(logs)
    return {"root": root, **torch.load(results, weights_only=True)}


@pytest.fixture(scope="module")
def references() -> dict:
    return {}


def _reference(references: dict, name: str) -> dict:
    if name not in references:
        references[name] = reference(name)
    return references[name]


def assert_close(got: dict, ref: dict, label: str, *, steps=slice(None)) -> None:
    assert "error" not in got, f"{label} failed:\n{got.get('error')}"
    loss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"][steps], strict=True))
    assert got["weights"].keys() == ref["weights"].keys(), label
    weights = max(
        float((got["weights"][k] - ref["weights"][k]).abs().max()) for k in ref["weights"]
    )
    print(f"{label}: max |difference| loss {loss:.3g}, weights {weights:.3g}")
    assert loss < TOL, f"{label}: losses differ from the reference by {loss:.3g}"
    assert weights < TOL, f"{label}: weights differ from the reference by {weights:.3g}"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_one_process_matches_the_reference(references: dict, name: str) -> None:
    assert_close(train(name, {}), _reference(references, name), f"{name} (1 process)")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_layout_matches_the_reference(job: dict, references: dict, name: str, layout: str) -> None:
    assert_close(job[f"{name}-{layout}"], _reference(references, name), f"{name} ({layout})")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_kwargs_matter(references: dict, name: str) -> None:
    """The comparison is sharp: leaving the case's kwargs out moves the weights by 100 x TOL
    or more, so a build that dropped them would fail the tests above."""
    ref, plain = _reference(references, name), reference(name, kwargs=False)
    moved = max(
        float((ref["weights"][k] - plain["weights"][k]).abs().max()) for k in plain["weights"]
    )
    assert moved > 100 * TOL, (name, moved)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_under_the_same_layout_is_bit_identical(job: dict, name: str) -> None:
    saved = RESUMED[name]
    whole, resumed = job[f"{name}-{saved}"], job[f"{name}-resumed-{saved}"]
    assert "error" not in whole and "error" not in resumed, (whole, resumed)
    assert resumed["losses"] == whole["losses"][STOP:]
    different = [
        k for k in whole["weights"] if not torch.equal(whole["weights"][k], resumed["weights"][k])
    ]
    assert not different, f"{name}: the resumed run differs in {different}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_under_another_layout_matches_the_reference(
    job: dict, references: dict, name: str
) -> None:
    ref, saved, after = _reference(references, name), RESUMED[name], slice(STOP, None)
    for layout in LAYOUTS:
        if layout != saved:
            label = f"{name} {saved} -> {layout}"
            assert_close(job[f"{name}-resumed-{layout}"], ref, label, steps=after)
    checkpoint = job["root"] / f"ckpt-{name}" / f"step-{STOP:08d}"
    one = train(name, {}, resume=checkpoint)  # this process: no process group
    assert_close(one, ref, f"{name} {saved} -> 1 process", steps=after)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_the_planner_predicts_the_bytes_held(job: dict, name: str, layout: str) -> None:
    """planner/trace.py (the model on meta in a fake process group) predicts rank 0's
    parameter and optimizer-state bytes to the byte: Muon's momentum sharded, Adafactor's
    factored moments whole."""
    from scaletrain.config import load_config
    from scaletrain.launch.resolve import resolve
    from scaletrain.planner.trace import held_on_rank
    from scaletrain.training.assemble import build_data

    config = load_config(
        None,
        [
            "model.name=gpt",
            "model.size=tiny",
            "data.source=synthetic-text",
            f"data.seq_len={SEQ}",
            "precision.mode=fp64",
            f"optim.name={name}",
            *(f"parallel.{k}={v}" for k, v in LAYOUTS[layout].items()),
            f"train.global_batch={GLOBAL_BATCH}",
            "train.micro_batch=4",
        ],
    )
    dataset = build_data(config, split="train")
    held = held_on_rank(config, resolve(config, world_size=2), dataset=dataset)
    logged = job[f"{name}-{layout}"]["held"]
    assert (held.params, held.optim) == (logged["param_bytes"], logged["optim_state_bytes"])


# ------------------------------------------------ the 2-rank job (this file run as a script)


def _rank(root: Path, rank: int) -> int:
    """One rank: join the group once, run every case, rank 0 writes results.pt."""
    from datetime import timedelta

    import torch.distributed as dist

    log = os.open(root / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results = {}

    def run(key: str, name: str, degrees: dict, **kwargs) -> None:
        try:
            results[key] = train(name, degrees, rank=rank, **kwargs)
        except Exception:  # noqa: BLE001 - the case's test shows it; the next case runs
            results[key] = {"error": traceback.format_exc()}
            print(results[key]["error"], flush=True)

    for name in OPTIMIZERS:
        for layout, degrees in LAYOUTS.items():
            save = root / f"ckpt-{name}" if RESUMED.get(name) == layout else None
            run(f"{name}-{layout}", name, degrees, save=save)
    for name in RESUMED:
        checkpoint = root / f"ckpt-{name}" / f"step-{STOP:08d}"
        for layout, degrees in LAYOUTS.items():
            run(f"{name}-resumed-{layout}", name, degrees, resume=checkpoint)
    if rank == 0:
        torch.save(results, root / "results.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _main(root: Path) -> None:
    """Rank 0 imports what both ranks need, then forks rank 1 (no thread, no process group
    yet), as test_model_parallel_parity's 4-rank job does; ends with the first failure."""
    import importlib

    for module in (
        "torch.distributed.checkpoint",
        "torch.distributed.fsdp",
        "torch.distributed.tensor.parallel",
        "scaletrain.checkpoint",
        "scaletrain.models.gpt",
        "scaletrain.parallel.compose",
        "scaletrain.training.optim",
        "scaletrain.training.step",
    ):
        importlib.import_module(module)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os._exit(_rank_status(root, 1))  # os._exit: no gloo shutdown abort
    codes = [_rank_status(root, 0), os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])]
    os._exit(next((c for c in codes if c != 0), 0))


def _rank_status(root: Path, rank: int) -> int:
    try:
        return _rank(root, rank)
    except BaseException:  # noqa: BLE001 - into the rank's log, then the job ends
        traceback.print_exc()
        sys.stderr.flush()
        return 1


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
