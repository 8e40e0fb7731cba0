"""Run scaletrain's real worker path in N processes on gloo, with a timeout on every process.

`run_workers` starts N `python -m scaletrain train ...` processes with the environment
torchrun would give them (RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID), without
the elastic agent's start-up cost. A process still running at the deadline is killed and the
test fails with every rank's output, so a hang cannot stall CI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a scaletrain subprocess: no torchrun or SLURM variables leak in."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_", "RANK", "WORLD_SIZE",
                                "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"))}
    env.update(extra)
    return env


def run_workers(config: Path, overrides: list[str], *, world_size: int, run_dir: Path,
                timeout: float = 120.0, expect_ok: bool = True,
                cwd: Path | None = None) -> list[subprocess.CompletedProcess]:
    """Start `world_size` ranks of `scaletrain train CONFIG overrides --run-dir RUN_DIR`
    (in `cwd`, where a user's own package would be imported from)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        # OMP_NUM_THREADS as the launcher sets it: some kernels (stock PowerSGD's QR) pick
        # their thread count at start-up from it and are not reproducible without it.
        threads = str(max(1, len(os.sched_getaffinity(0)) // world_size))
        env = cli_env(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="test",
                      OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads))
        cmd = [sys.executable, "-m", "scaletrain", "train", str(config), *overrides,
               "--run-dir", str(run_dir)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=cwd))
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a rank did not finish within {timeout} s") from None
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    if expect_ok:
        for rank, r in enumerate(results):
            assert r.returncode == 0, f"rank {rank} failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return results


def run_cli(args: list[str], *, timeout: float = 180.0, cwd: Path | None = None,
            **env: str) -> subprocess.CompletedProcess:
    """`scaletrain ARGS` as a user runs it (launcher included), with a timeout, in `cwd`."""
    try:
        return subprocess.run([sys.executable, "-m", "scaletrain", *args], env=cli_env(**env),
                              capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"scaletrain {' '.join(args)} did not finish in {timeout} s:\n"
                             f"{(e.stderr or b'')[-3000:]}") from None


def records(run_dir: Path, kind: str = "train") -> list[dict]:
    """The run's metrics.jsonl records of one kind ("train" or "eval"), in file order."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == kind]


def losses(run_dir: Path) -> list[float]:
    """The logged training losses, in order."""
    return [r["loss"] for r in records(run_dir)]


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of a launcher's worker children, read from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        rank = [e for e in env if e.startswith(b"RANK=")]
        if ppid == launcher_pid and rank:
            found[int(rank[0][5:])] = int(entry.name)
    return found


def load_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model.safetensors"))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"parameter names differ: {sorted(a.keys() ^ b.keys())}"
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def refuse_start(*args, **kwargs):
    import pytest

    pytest.fail("a worker or the launcher was started for a command that should be refused")


def forbid_starting(monkeypatch, tmp_path: Path) -> None:
    """For in-process refusal tests: no launcher, no worker (collective or ps), no torchrun
    or SLURM environment; cwd is the test's directory, so a stray default run directory
    would land there and be seen."""
    import scaletrain.cli
    import scaletrain.launch

    monkeypatch.setattr(scaletrain.launch, "launch", refuse_start)
    monkeypatch.setattr(scaletrain.cli, "launch", refuse_start)
    monkeypatch.setattr(scaletrain.cli, "_run_worker", refuse_start)
    monkeypatch.setattr(scaletrain.cli, "_run_ps_rank", refuse_start)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def cli_main(argv: list[str]) -> int:
    """cli.main's status, in this process; argparse's own errors leave through SystemExit."""
    import scaletrain.cli

    try:
        return scaletrain.cli.main(argv)
    except SystemExit as e:
        return e.code


def file_tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its bytes (None for a directory): to see nothing changed."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}
