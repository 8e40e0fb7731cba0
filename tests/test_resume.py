"""Exact resume: a run stopped after step k continues on another world size with the same
losses (1e-6); a worker killed with SIGKILL is restarted by the elastic agent and the run
ends bit-identical to an uninterrupted one; a corrupted newest checkpoint is skipped; a
checkpoint never runs pickled code; export writes the checkpoint's weights.

Speed: the runs that are not what a test is about go through the session's pools of ranks
(conftest's `trained`, harness.run_job with keep=True), through the workers' own entry
(`commands/worker.run_worker`, as `scaletrain train` under torchrun runs it), without a process of
their own: the references, the stops and the resumes on another world size (a stop in a
job of one world size, its resume a case of the same name in a job of the other, both jobs
in the test's own root so the resume finds the stop's run directory), and the run that is
exported. Before, they were worker processes started for each run (`run_workers`, the same
entry) or the launcher's. What stays a real process is the point of its test: the run whose
worker is killed with SIGKILL goes through `scaletrain train` (launcher, torchrun's elastic
agent, its restart). `scaletrain export` is cli.main in this process (as a command in a
process of its own it is run by test_e2e and test_distill_cache).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scaletrain.checkpoint import Checkpointer, TrainState, load
from scaletrain.checkpoint.files import CheckpointError, latest_valid, list_checkpoints
from scaletrain.data.sources import TaskSpec
from scaletrain.models import build_model
from scaletrain.precision import make_precision
from scaletrain.training.optim import build_optimizer, build_scheduler

from harness import (
    Case,
    cli_main,
    config_toml,
    load_weights,
    records,
    run_job,
    start_cli,
    worker_pids,
)


def mlp_config(*, steps: int = 10, quiet: bool = True) -> str:
    """This file's job: a small MLP on digits, 10 AdamW steps of 64 examples."""
    return config_toml(
        model={"size": "small"},
        optim={"lr": 3e-3, "warmup_steps": 2},
        train={"steps": steps, "global_batch": 64, "micro_batch": 16, "eval_examples": 64},
        log={"every": 1, "quiet": quiet},
    )


CONFIG = mlp_config()


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir)}  # the last record of each step


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_stop_and_resume_on_another_world_size(
    trained, tmp_path: Path, before: int, after: int
) -> None:
    """Stopped after step 4 on `before` ranks (a job in that world size's pool), resumed
    on `after` ranks (a job in the other pool, the same run directory): steps 5..10 log
    the losses of an uninterrupted run on `before` ranks."""
    reference = trained({"reference": Case.of(CONFIG, f"parallel.dp={before}")}, world_size=before)
    ref = _losses(reference["reference"].run_dir)
    # Both jobs in this test's root: the resume's run directory is the stop's.
    stop = Case.of(CONFIG, f"parallel.dp={before}", "train.stop_after=4")
    stopped = run_job({"resumed": stop}, world_size=before, root=tmp_path, keep=True)
    run_dir = stopped["resumed"].run_dir
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-00000004"]
    assert not (run_dir / "summary.json").exists()
    resume = Case.of(CONFIG, f"parallel.dp={after}")
    resumed = run_job({"resumed": resume}, world_size=after, root=tmp_path, keep=True)
    assert resumed["resumed"].run_dir == run_dir
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, 11))
    for step in range(5, 11):
        assert got[step] == pytest.approx(ref[step], abs=1e-6), step
    # Not vacuous: the loss moved well beyond the tolerance over these steps.
    assert abs(ref[5] - ref[10]) > 1e-2


KILL_CONFIG = """
[model]
name = "gpt"
size = "tiny"
[data]
source = "wikitext"
seq_len = 64
[train]
steps = 100           # the kill follows the step-50 checkpoint: 50 steps still to run
global_batch = 16
micro_batch = 8
eval_examples = 32
[parallel]
dp = 2
[checkpoint]
every = 25
[log]
every = 25
quiet = true
[precision]
# fp64: the clean run and the killed one each choose their attention kernel and precision
# by timing them (fp32 or bf16, math or flash: 3.6 against 3.8 ms once picked apart), and a
# choice is the same for both runs only where there is none to make
mode = "fp64"
"""


@pytest.mark.slow
@pytest.mark.timeout(600)  # its two waits below; seen at 120 s with two suites on 2 cores
def test_killed_worker_restarts_and_ends_bit_identical(trained, tmp_path: Path) -> None:
    """The killed run goes through `scaletrain train` (launcher, elastic agent, restart);
    the uninterrupted run it must equal bit for bit is the same config in the 2-rank pool:
    the same worker entry, with the threads per rank the launcher gives (cores / 2)."""
    clean = trained({"clean": Case.of(KILL_CONFIG)}, world_size=2)["clean"].run_dir
    config = tmp_path / "cfg.toml"
    config.write_text(KILL_CONFIG)

    run_dir = tmp_path / "killed"
    launcher = start_cli(
        ["train", str(config), "--run-dir", str(run_dir), "--max-restarts", "1", "log.quiet=false"]
    )
    try:
        deadline = time.monotonic() + 240  # start-up and 50 steps on a loaded machine
        while not (run_dir / "checkpoints" / "step-00000050").exists():
            assert time.monotonic() < deadline and launcher.poll() is None, "no checkpoint"
            time.sleep(0.05)
        pids = worker_pids(launcher.pid)
        os.kill(pids[1], signal.SIGKILL)
        out, err = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    assert "resumed from" in out + err and "step-00000050" in out + err
    a, b = load_weights(clean), load_weights(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a), "restarted run differs from the clean run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 100


# ---------------------------------------------------------------------------- in-process


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = build_model("mlp", size="tiny", task=TaskSpec("classification", (1, 8, 8), 10))
    opt = build_optimizer(
        model, name="adamw", lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), momentum=0.0
    )
    sched = build_scheduler(
        opt, warmup_steps=2, total_steps=10, schedule="cosine", min_lr_ratio=0.1
    )
    return TrainState(model, opt, sched, make_precision("fp16-mixed", device_type="cpu"))


def _advance(state: TrainState) -> None:
    state.model(torch.randn(4, 1, 8, 8)).square().sum().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.scheduler.step()
    state.step += 1


def test_round_trip_restores_every_piece(tmp_path: Path) -> None:
    state = _state()
    _advance(state)
    state.precision.attention = "MATH"  # the kernel the run measured fastest
    Checkpointer(tmp_path, keep=2, async_save=False, config_toml="").save(state)
    expected_draw = torch.rand(3)
    other = _state(seed=1)
    other.precision.attention = "FLASH_ATTENTION"  # what a resumed run's probe may say
    load(latest_valid(tmp_path), other)
    assert other.precision.attention == "MATH"  # it runs the kernel its run started with
    assert torch.equal(torch.rand(3), expected_draw)  # RNG restored
    for (k, a), b in zip(state.model.state_dict().items(), other.model.state_dict().values()):
        assert torch.equal(a, b), k
    sa, sb = state.optimizer.state_dict()["state"], other.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    assert other.scheduler.last_epoch == 1 and other.step == 1
    assert other.optimizer.param_groups[0]["lr"] == state.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, damage: str) -> None:
    state = _state()
    saver = Checkpointer(tmp_path, keep=3, async_save=False, config_toml="")
    for _ in range(2):
        _advance(state)
        saver.save(state)
    newest = list_checkpoints(tmp_path)[-1]
    data = next(newest.glob("*.distcp"))
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "delete":
        data.unlink()
    else:
        (newest / "manifest.json").unlink()
    messages = []
    assert latest_valid(tmp_path, report=messages.append).name == "step-00000001"
    assert newest.name in messages[0]


def test_keep_last_k_and_async_save(tmp_path: Path) -> None:
    state = _state()
    saver = Checkpointer(tmp_path, keep=2, async_save=True, config_toml="")
    for _ in range(4):
        _advance(state)
        saver.save(state)
    saver.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    other = _state(seed=1)
    load(latest_valid(tmp_path), other)
    assert other.step == 4
    assert all(
        torch.equal(a, b) for a, b in zip(state.model.parameters(), other.model.parameters())
    )


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_pickled_code_in_a_checkpoint_is_refused(tmp_path: Path) -> None:
    state = _state()
    Checkpointer(tmp_path, keep=1, async_save=False, config_toml="").save(state)
    checkpoint = list_checkpoints(tmp_path)[-1]
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        load(checkpoint, _state())


@pytest.mark.slow
def test_export_writes_the_checkpoint_weights(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`scaletrain export RUN_DIR OUT` (cli.main, in this process) writes the newest
    checkpoint's weights: those of the run's final model.safetensors."""
    run_dir = trained(
        {"run": Case.of(CONFIG, "parallel.dp=1", "checkpoint.every=10")}, world_size=1
    )["run"].run_dir
    out = tmp_path / "exported.safetensors"
    assert cli_main(["export", str(run_dir), str(out)]) == 0, capsys.readouterr().err
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    assert f"the model weights of {newest.name}" in capsys.readouterr().out  # which one
    exported, final = load_file(str(out)), load_weights(run_dir)
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)


def _file_tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One finished 2-step run through `scaletrain train` in this process (one rank), with
    what it printed and how long the call took; shared by the tests below."""
    import contextlib
    import io

    import scaletrain.records.report

    from harness import cli_main

    tmp = tmp_path_factory.mktemp("finished")
    cfg, run_dir = tmp / "config.toml", tmp / "run"
    cfg.write_text(mlp_config(steps=2, quiet=False))
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        # The PNG is not the point here (matplotlib costs seconds): a stub file stands in.
        mp.setattr(
            scaletrain.records.report,
            "write_report",
            lambda runs, out: Path(out).write_bytes(b"png") and out,
        )
        started = time.perf_counter()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(["train", str(cfg), "checkpoint.every=2", "--run-dir", str(run_dir)])
        took = time.perf_counter() - started
    assert code == 0, err.getvalue()
    return {
        "cfg": cfg,
        "run_dir": run_dir,
        "out": out.getvalue(),
        "err": err.getvalue(),
        "took": took,
    }


def test_start_up_is_shown_and_done_reports_the_wall_time_waited(finished: dict) -> None:
    """Rank 0 says what it is doing before the first step (processes, data, model, ready),
    and "done in" is the wall time the user waited, at least this call's own duration (it
    used to be the loop's time alone: "done in 0.2 s" after ten silent seconds)."""
    import re

    err, out = finished["err"], finished["out"]
    phases = [
        re.search(pattern, err)
        for pattern in (
            r"scaletrain: 1 process\(es\) up, \d+ thread\(s\) each \(\d+\.\d s\)",
            r"scaletrain: data: 1438 training and \d+ evaluation examples .*\(\d+\.\d s\)",
            r"scaletrain: model: [\d,]+ parameters on this rank .*\(\d+\.\d s\)",
            r"scaletrain: ready: step 1 of 2 starting .*\(\d+\.\d s\)",
        )
    ]
    assert all(phases), err
    assert [m.start() for m in phases] == sorted(m.start() for m in phases), err
    done = re.search(
        r"scaletrain: done in (\d+\.\d) s \((\d+\.\d) s training, (\d+\.\d) s evaluating", out
    )
    assert done, out
    assert float(done.group(1)) >= finished["took"] - 0.05, (done.group(0), finished["took"])
    assert float(done.group(2)) + float(done.group(3)) <= float(done.group(1))


def test_resume_of_a_finished_run_says_so_and_touches_nothing(
    finished: dict, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--resume` of a run that has finished (summary.json, and train.steps already done)
    says the run is complete and exits 0 without starting anything: summary.json, the
    metrics, the weights and config.toml stay byte for byte (it used to rewrite summary.json
    with NaN, world size 1 and 0 examples/s). One process, in this process."""
    from harness import cli_main

    cfg, run_dir = finished["cfg"], finished["run_dir"]
    monkeypatch.chdir(cfg.parent)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["final_loss"] > 0
    before = _file_tree(run_dir)

    code = cli_main(
        ["train", str(cfg), "checkpoint.every=2", "--run-dir", str(run_dir), "--resume"]
    )

    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"run {run_dir} is complete" in out + err and "step 2 of 2" in out + err, out + err
    assert "final loss nan" not in out + err
    assert _file_tree(run_dir) == before, "a resume of a finished run changed its files"


def test_summary_is_valid_json_when_the_loss_is_not_finite(tmp_path: Path) -> None:
    """A NaN (or infinite) value is written as null: summary.json stays valid JSON."""
    from scaletrain.launch.rundir import json_safe, write_summary

    path = write_summary(
        tmp_path,
        {"final_loss": float("nan"), "eval": {"loss": float("inf"), "accuracy": 0.5}, "steps": 3},
    )
    assert json.loads(path.read_text(), parse_constant=pytest.fail) == {
        "final_loss": None,
        "eval": {"loss": None, "accuracy": 0.5},
        "steps": 3,
    }
    assert json_safe([1.0, float("-inf")]) == [1.0, None]


def test_the_checkpointer_owns_its_schedule(tmp_path: Path) -> None:
    saver = Checkpointer(tmp_path, keep=2, async_save=False, config_toml="", every=3)
    assert [s for s in range(1, 10) if saver.due(s)] == [3, 6, 9]
    assert saver.due(4, stop=True)  # a planned stop or a SIGTERM saves whatever the step
    never = Checkpointer(tmp_path, keep=2, async_save=False, config_toml="")
    assert not any(never.due(s) for s in range(1, 10)) and never.due(7, stop=True)
