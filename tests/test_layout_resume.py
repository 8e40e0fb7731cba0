"""A checkpoint written under one parallel layout resumes under another and continues the
same run: checkpoints hold parameters and optimizer state by the model's own names
(torch.distributed.checkpoint reshards them), so FSDP shards, tensor-parallel slices and
pipeline stages load into whatever layout the resumed run has.

A GPT is stopped after step 2 of 4 (`train.stop_after`, which checkpoints and exits) under one
layout, then resumed with other [parallel] degrees on another number of ranks. The
launcher's resume check (`rundir.check_resumable`, which `scaletrain train --resume` runs
before any process starts) accepts the new degrees without --allow-config-change (they are
resume-safe keys) and still refuses a key that changes the run. Every step's loss, and the
final weights, are compared with one uninterrupted process. fp32: losses hold to 1e-6
whatever the layout; the weights after four Adam steps carry the layout's summation-order
noise (Adam turns it into parameter differences of ~1e-5, shared/PLATFORM-NOTES.md), so they
are held to WEIGHT_TOL, and exactly to an uninterrupted run of the same layout in the
bit-identical case.

Speed: the runs go through `harness.run_job` (the workers' own entry, one process group per
world size, many runs in it), four jobs in all: the stops on 4 ranks, the stops on 2 ranks,
the resumes on 2 ranks, then the reference and the resume on 1 rank, all in one root, so a
resume finds the run directory its stop wrote. test_resume and test_launch_* keep the CLI's
own path, launcher included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaletrain.checkpoint.files import list_checkpoints

from harness import Case, file_tree, load_weights, max_abs_diff, records, run_job

pytestmark = pytest.mark.slow

STEPS = 4
STOP = 2
CONFIG = f"""\
name = "layout-resume"
[model]
name = "gpt"
size = "small"
[data]
source = "wikitext"
seq_len = 32
[train]
steps = {STEPS}
global_batch = 16
micro_batch = 8
eval_examples = 16
[log]
every = 1
quiet = true
"""

LOSS_TOL = 1e-6
# Measured on a 2-core CPU, max |difference| from the 1-process run after 4 steps:
# dp_shard=2 x tp=2 -> 1 process 6.9e-6 (after 6 steps 1.7e-5, as much as an uninterrupted
# dp_shard=2 x tp=2 run: the layout's noise, not the resume's), pp=2 -> dp_shard=2 3.1e-6,
# dp=2 -> pp=2 2.4e-7.
WEIGHT_TOL = 1e-4
TIMEOUT = 240.0  # per run in a job; 4 ranks on 2 busy cores take ~40 s for 2 steps

SHARDED = ["parallel.dp_shard=2"]
# The bit-for-bit pair in fp64: two runs each time their attention kernel and precision at
# start (fp32 or bf16, math or flash), and agree exactly only where there is no choice
EXACT = [*SHARDED, "precision.mode=fp64"]
# name -> (layout before, ranks before, layout after, ranks after)
CHANGES = {
    "fsdp2xtp2-to-1": (["parallel.dp_shard=2", "parallel.tp=2"], 4, [], 1),
    "pp2-to-fsdp2": (["parallel.pp=2", "parallel.pp_schedule=1f1b"], 2, SHARDED, 2),
    "ddp2-to-pp2": (["parallel.dp=2"], 2, ["parallel.pp=2"], 2),
    "sharded-resumed": (EXACT, 2, EXACT, 2),
}


class Runs:
    """Every run of this file, in one root: name -> run directory; and what was seen
    between a stop and its resume."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stopped: dict[str, dict] = {}  # name -> facts about the stopped run
        self.refusal: tuple[str, dict, dict] | None = None

    def __getitem__(self, name: str) -> Path:
        return self.root / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Stops on 4 and 2 ranks, the launcher's resume checks, resumes on 2 and 1 rank."""
    from scaletrain.config import load_config
    from scaletrain.errors import ConfigError
    from scaletrain.launch.rundir import check_resumable

    runs = Runs(tmp_path_factory.mktemp("layout-resume"))
    config = runs.root / "cfg.toml"  # what `scaletrain train CONFIG ... --resume` reads
    config.write_text(CONFIG)
    stop = f"train.stop_after={STOP}"
    for world in (4, 2):
        cases = {
            name: Case.of(CONFIG, *before, stop)
            for name, (before, n, _, _) in CHANGES.items()
            if n == world
        }
        if world == 2:
            cases["sharded-uninterrupted"] = Case.of(CONFIG, *EXACT)
        run_job(cases, world_size=world, root=runs.root, timeout=TIMEOUT, keep=True)
    for name, (_, _, after, _) in CHANGES.items():
        run_dir = runs[name]
        runs.stopped[name] = {
            "checkpoints": [p.name for p in list_checkpoints(run_dir / "checkpoints")],
            "final_weights": (run_dir / "model.safetensors").exists(),
            "steps": sorted(step_losses(run_dir)),
            # What `scaletrain train ... --resume` checks before it starts the workers.
            "resume_warnings": check_resumable(run_dir, load_config(config, after)),
        }
    # The control for "degrees need no --allow-config-change": a key that changes the run
    # (optim.lr), given with new degrees, is refused by the same check; nothing is written.
    run_dir = runs["sharded-resumed"]
    before = file_tree(run_dir)
    try:
        changed = ["parallel.tp=2", "optim.lr=0.002", "precision.mode=fp64"]
        check_resumable(run_dir, load_config(config, changed))
        message = ""
    except ConfigError as e:
        message = str(e)
    runs.refusal = (message, before, file_tree(run_dir))
    for world in (2, 1):
        cases = {
            name: Case.of(CONFIG, *after)
            for name, (_, _, after, n) in CHANGES.items()
            if n == world
        }
        if world == 1:
            cases["reference"] = Case.of(CONFIG)  # the uninterrupted run in one process
        run_job(cases, world_size=world, root=runs.root, timeout=TIMEOUT, keep=True)
    return runs


def step_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the step records (those with a grad_norm); a re-run step: its last."""
    return {r["step"]: r["loss"] for r in records(run_dir) if "grad_norm" in r}


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_stop_checkpoints_and_the_new_degrees_need_no_allow_config_change(
    runs: Runs, name: str
) -> None:
    seen = runs.stopped[name]
    assert seen["checkpoints"] == [f"step-{STOP:08d}"], seen
    assert not seen["final_weights"], seen
    assert seen["steps"] == list(range(1, STOP + 1)), seen
    assert seen["resume_warnings"] == [], seen  # accepted, and not as an allowed change


@pytest.mark.parametrize("name", [n for n in CHANGES if n != "sharded-resumed"])
def test_resume_under_another_layout_continues_the_run(runs: Runs, name: str) -> None:
    ref, got = step_losses(runs["reference"]), step_losses(runs[name])
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    diffs = {step: abs(got[step] - ref[step]) for step in ref}
    print(f"loss differences by step: {diffs}")
    for step in range(1, STEPS + 1):  # 1-2 under the first layout, 3-4 resumed under the second
        assert got[step] == pytest.approx(ref[step], abs=LOSS_TOL), (step, diffs)
    assert abs(ref[STOP] - ref[STEPS]) > 1e-2  # not vacuous: the loss moved meanwhile
    a, b = load_weights(runs["reference"]), load_weights(runs[name])
    weight_diff = max_abs_diff(a, b)
    print(f"max |weight difference| = {weight_diff:.3g}")
    assert weight_diff <= WEIGHT_TOL


def test_resume_with_sharding_is_bit_identical(runs: Runs) -> None:
    uninterrupted, resumed = runs["sharded-uninterrupted"], runs["sharded-resumed"]
    ref, got = step_losses(uninterrupted), step_losses(resumed)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == ref  # exactly: same layout, same order of every sum
    a, b = load_weights(uninterrupted), load_weights(resumed)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed run differs in {different}"


def test_a_change_that_is_not_a_layout_is_still_refused(runs: Runs) -> None:
    message, before, after = runs.refusal
    assert "optim.lr (0.001 -> 0.002)" in message, message
    assert "parallel.tp" not in message and "parallel.dp_shard" not in message, message
    assert after == before  # the run directory is left as it was
