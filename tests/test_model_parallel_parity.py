"""Model parallelism reproduces one process: FSDP2 (dp_shard), tensor parallelism (tp),
pipeline parallelism (pp, all four schedules), HSDP and their 2-D compositions end 5 AdamW
steps of the GPT with the losses, gradient norms and final weights of a single process on
the whole global batch, with and without gradient accumulation and activation
checkpointing.

Every run is compared with ONE single-process reference (module-scoped fixture, one
micro-batch of 16). Float64 (precision.mode = "fp64") and a tolerance of 1e-9, as in
test_dp_parity: fp32 results move with the CPU's kernels and the summation order, which
every layout changes. Gradient clipping (optim.grad_clip = 1.0, the default) is active in
the first steps (grad norms 6.2, 4.4, 2.4), so a wrong gradient scale shows in the weights
as well as in the logged norm, although Adam itself is blind to the scale.

The final weights (RUN_DIR/model.safetensors) are gathered full tensors with plain names
under every layout, so they compare name by name and shape by shape with the reference.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from harness import load_weights, max_abs_diff, records, run_workers

TOL = 1e-9
STEPS = 5
GLOBAL_BATCH = 16
TIMEOUT = 240.0  # per run: the machine is shared with other multi-process tests

# The reference plus at most two runs of four ranks per test, each bounded by TIMEOUT.
pytestmark = pytest.mark.timeout(3 * TIMEOUT)

CONFIG = f"""
[model]
name = "gpt"
size = "small"        # 4 blocks, 4 heads: tp=2 splits heads, pp=2 x 2 stages get a block each
[data]
source = "wikitext"
seq_len = 32
[optim]
lr = 3e-3
warmup_steps = 2
[train]
steps = {STEPS}
seed = 7
global_batch = {GLOBAL_BATCH}
micro_batch = 8
eval_examples = 64
[log]
every = 1
quiet = true
[precision]
mode = "fp64"
"""


@dataclass(frozen=True)
class Reference:
    run_dir: Path
    records: list[dict]
    weights: dict[str, torch.Tensor]


def _run(root: Path, name: str, overrides: list[str], *, world_size: int) -> Path:
    config = root / "cfg.toml"
    if not config.exists():
        config.write_text(CONFIG)
    run_dir = root / name
    run_workers(config, overrides, world_size=world_size, run_dir=run_dir, timeout=TIMEOUT)
    return run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """One process, the whole global batch in one micro-batch (no accumulation)."""
    root = tmp_path_factory.mktemp("reference")
    run_dir = _run(root, "one-process", [f"train.micro_batch={GLOBAL_BATCH}"], world_size=1)
    ref = Reference(run_dir, records(run_dir), load_weights(run_dir))
    assert [r["step"] for r in ref.records] == list(range(1, STEPS + 1))
    assert all(w.dtype == torch.float64 for w in ref.weights.values())
    return ref


def _accumulation(run_dir: Path, world_size: int) -> int:
    """Micro-batches per rank and step, from the resolved config the run stored."""
    cfg = tomllib.loads((run_dir / "config.toml").read_text())
    t, p = cfg["train"], cfg["parallel"]
    dp = world_size // (p["tp"] * p["pp"])  # tensor and pipeline peers read the same examples
    return t["global_batch"] // (dp * t["micro_batch"])


def assert_matches_reference(run_dir: Path, ref: Reference, label: str) -> None:
    """Losses and grad norms of every step, and every final weight, within TOL of `ref`;
    prints the largest differences (visible with pytest -s)."""
    got = records(run_dir)
    assert [r["step"] for r in got] == [r["step"] for r in ref.records], label
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, ref.records))
    norm_diff = max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(got, ref.records))
    weights = load_weights(run_dir)
    # max_abs_diff broadcasts; a shard saved in place of a full tensor must not slip through.
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    assert shapes == {k: tuple(v.shape) for k, v in ref.weights.items()}, label
    assert all(w.dtype == torch.float64 for w in weights.values()), label
    weight_diff = max_abs_diff(weights, ref.weights)
    print(f"{label}: max |difference| loss {loss_diff:.3g}, grad_norm {norm_diff:.3g}, "
          f"weights {weight_diff:.3g}")
    assert loss_diff < TOL, f"{label}: losses differ from 1 process by {loss_diff:.3g}"
    assert norm_diff < TOL, f"{label}: grad norms differ from 1 process by {norm_diff:.3g}"
    assert weight_diff < TOL, f"{label}: weights differ from 1 process by {weight_diff:.3g}"


# name -> (world size, overrides, micro-batches per rank and step)
TWO_RANKS = {
    # With accumulation: every rank runs 2 micro-batches per step.
    "dp_shard2-accum2": (2, ["parallel.dp_shard=2", "train.micro_batch=4"], 2),
    # tp runs with sequence parallelism (parallel.sequence_parallel, on by default) unless
    # switched off: plain Megatron TP once.
    "tp2-accum2": (2, ["parallel.tp=2", "train.micro_batch=8"], 2),
    "tp2-no_sp-accum2": (2, ["parallel.tp=2", "parallel.sequence_parallel=false",
                             "train.micro_batch=8"], 2),
    # pp_microbatches defaults to pp x stages per rank: 2 chunks (gpipe, 1f1b), 4 chunks
    # over 2 x 2 stages (interleaved-1f1b, zero-bubble); 8 divides by both.
    **{f"pp2-{s}-accum2": (2, ["parallel.pp=2", f"parallel.pp_schedule={s}",
                               "train.micro_batch=8"], 2)
       for s in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")},
    # Without accumulation: one micro-batch per rank and step.
    "dp_shard2-accum1": (2, ["parallel.dp_shard=2", "train.micro_batch=8"], 1),
    "tp2-accum1": (2, ["parallel.tp=2", "train.micro_batch=16"], 1),
    "pp2-1f1b-accum1": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b",
                            "train.micro_batch=16"], 1),
    # Activation checkpointing: recomputation in backward changes no number.
    "dp_shard2-ac_full": (2, ["parallel.dp_shard=2", "parallel.activation_checkpointing=full",
                              "train.micro_batch=4"], 2),
    "tp2-ac_selective": (2, ["parallel.tp=2", "parallel.activation_checkpointing=selective",
                             "train.micro_batch=8"], 2),
    "pp2-1f1b-ac_full": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b",
                             "parallel.activation_checkpointing=full", "train.micro_batch=8"], 2),
}

FOUR_RANKS = {
    # 2-D: FSDP shards the TP DTensors over dp_shard; 8 examples per dp rank, 2 micro-batches.
    "dp_shard2xtp2": (4, ["parallel.dp_shard=2", "parallel.tp=2", "train.micro_batch=4"], 2),
    # FSDP per pipeline stage; each micro-batch of 4 goes through 1f1b in 2 chunks.
    "pp2xdp_shard2": (4, ["parallel.pp=2", "parallel.dp_shard=2", "train.micro_batch=4"], 2),
    # Two stages per rank (one skeleton module holds both for the optimizer and checkpoints),
    # each stage FSDP-sharded; 4 chunks of 1 example.
    "pp2-interleaved-xdp_shard2": (4, ["parallel.pp=2", "parallel.dp_shard=2",
                                       "parallel.pp_schedule=interleaved-1f1b",
                                       "train.micro_batch=4"], 2),
    # Pipeline x tensor parallel: each stage's blocks split over tp, with sequence parallel
    # (a stage boundary carries each TP rank's share of the positions).
    "pp2xtp2": (4, ["parallel.pp=2", "parallel.tp=2", "train.micro_batch=8"], 2),
    # HSDP: sharded within pairs, replicated across them; 4 examples per rank.
    "dp_replicate2xdp_shard2": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2",
                                    "train.micro_batch=4"], 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", [*TWO_RANKS, *FOUR_RANKS])
def test_layout_matches_one_process(tmp_path: Path, reference: Reference, name: str) -> None:
    world_size, overrides, accumulation = {**TWO_RANKS, **FOUR_RANKS}[name]
    run_dir = _run(tmp_path, name, overrides, world_size=world_size)
    assert _accumulation(run_dir, world_size) == accumulation, name
    assert_matches_reference(run_dir, reference, name)


@pytest.mark.slow
def test_comparison_can_fail(tmp_path: Path, reference: Reference) -> None:
    """The check is sharp: one process stopped after the first step (whose loss and grad
    norm are the reference's own) misses the reference's weights by far more than TOL."""
    short = _run(tmp_path, "one-process-1-step",
                 [f"train.micro_batch={GLOBAL_BATCH}", "train.steps=1"], world_size=1)
    assert max_abs_diff(load_weights(short), reference.weights) > 1e4 * TOL
    first_step = Reference(reference.run_dir, reference.records[:1], reference.weights)
    with pytest.raises(AssertionError, match="weights differ"):
        assert_matches_reference(short, first_step, "1 step vs 5")
