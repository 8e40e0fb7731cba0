"""Run scaletrain's real worker path in N processes on gloo, with a timeout on every process.

An interpreter that imports torch costs about 3 s of CPU, more than a small run's training
on 2 cores, so the harness starts as few as it can.

`run_workers` starts N ranks of `scaletrain train ...` with the environment torchrun would
give them (RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID), without the elastic
agent's start-up cost, each forked from the session's `Zygote` (an interpreter that has
imported scaletrain once): `python -m scaletrain` without the interpreter's start. A rank
still running at the deadline is killed and the test fails, so a hang cannot stall CI.
`run_cli` is a real `python -m scaletrain` process: what a user runs, start-up included.

`run_job` is the cheap way to run many trainings: N processes join one process group once
and train case after case in it (a `JobPool`: `python harness.py POOL_DIR`, the `__main__`
below), each case through the worker's own entry (`commands/worker.run_worker`, as `scaletrain train`
under an agent runs it), writing its usual run directory. Interpreter start-up, imports and
rendezvous are paid once per world size for the whole session (`keep=True`) instead of once
per rank per run. `conftest.py`'s session fixture `trained` caches the runs, so files asking
for the same run (a single-process reference) share it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w
import torch
from safetensors.torch import load_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a scaletrain subprocess: no torchrun or SLURM variables leak in."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            (
                "SLURM_",
                "TORCHELASTIC_",
                "MASTER_",
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
            )
        )
    }
    env.update(extra)
    return env


def rank_env(rank: int, *, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives one rank of a `world_size` job on this machine."""
    # OMP_NUM_THREADS as the launcher sets it: some kernels (stock PowerSGD's QR) pick
    # their thread count at start-up from it and are not reproducible without it.
    threads = str(max(1, len(os.sched_getaffinity(0)) // world_size))
    return cli_env(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="test",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads),
    )


def run_workers(
    config: Path,
    overrides: list[str],
    *,
    world_size: int,
    run_dir: Path,
    timeout: float = 120.0,
    expect_ok: bool = True,
    cwd: Path | None = None,
) -> list[subprocess.CompletedProcess]:
    """Start `world_size` ranks of `scaletrain train CONFIG overrides --run-dir RUN_DIR`
    (in `cwd`, where a user's own package would be imported from), each forked from the
    session's `Zygote`: `python -m scaletrain` without the interpreter's start."""
    args = ["train", str(config), *overrides, "--run-dir", str(run_dir)]
    outputs = Path(tempfile.mkdtemp(prefix="ranks-"))
    zygote, pids = spawn_ranks(
        args, world_size=world_size, port=free_port(), cwd=cwd or Path.cwd(), outputs=outputs
    )
    deadline = time.monotonic() + timeout
    codes = [zygote.wait(pid, timeout=max(0.1, deadline - time.monotonic())) for pid in pids]
    if None in codes:
        for pid in pids:
            zygote.kill(pid)
        raise AssertionError(f"a rank did not finish within {timeout} s")
    results = [
        subprocess.CompletedProcess(
            ["scaletrain", *args],
            code,
            (outputs / f"rank-{rank}.out").read_text(),
            (outputs / f"rank-{rank}.err").read_text(),
        )
        for rank, code in enumerate(codes)
    ]
    if expect_ok:
        for rank, r in enumerate(results):
            assert r.returncode == 0, f"rank {rank} failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return results


def spawn_ranks(
    args: list[str], *, world_size: int, port: int, cwd: Path, outputs: Path, **env: str
) -> tuple[Zygote, list[int]]:
    """`world_size` ranks of `scaletrain ARGS` forked from the session's zygote, each with
    the environment torchrun gives it (and `env` on top), in `cwd`; rank N's stdout and
    stderr in outputs/rank-N.out and .err. Returns the zygote (to wait on or kill them)
    and their pids, rank order."""
    zygote = zygote_for(world_size)
    pids = [
        zygote.spawn(
            args,
            env={**rank_env(rank, world_size=world_size, port=port), **env},
            cwd=cwd,
            out=outputs / f"rank-{rank}.out",
            err=outputs / f"rank-{rank}.err",
        )
        for rank in range(world_size)
    ]
    return zygote, pids


class Zygote:
    """A Python process that has imported scaletrain (torch, DDP's dynamo, RPC and DCP
    included) and nothing else, and forks a child per request that runs `scaletrain ARGS`
    as `python -m scaletrain ARGS` would (its own environment, working directory, stdout,
    stderr, sys.path[0], exit status): a rank starts in milliseconds, not seconds of
    imports. Forking after torch's import is what DataLoader workers do; the zygote starts
    no thread of its own and joins no group. One per OMP_NUM_THREADS value (OpenMP reads it
    when torch loads). It dies with the pytest process, and its children with it.
    """

    def __init__(self, threads: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--zygote"],
            env=cli_env(OMP_NUM_THREADS=threads),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.cond = threading.Condition()
        self.started: list[int] = []
        self.exits: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # "started PID" | "exit PID CODE"
            kind, *numbers = line.split()
            if kind not in ("started", "exit"):
                continue
            with self.cond:
                if kind == "started":
                    self.started.append(int(numbers[0]))
                else:
                    self.exits[int(numbers[0])] = int(numbers[1])
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def spawn(
        self, args: list[str], *, env: dict, cwd: Path, out: Path, err: Path, entry: str = "cli"
    ) -> int:
        """Fork a child running `scaletrain ARGS` (entry "cli"), or a JobPool rank for the
        directory ARGS[0] (entry "pool"); its pid. `out` may be `err`: one file for both."""
        request = {
            "args": args,
            "env": env,
            "cwd": str(cwd),
            "out": str(out),
            "err": str(err),
            "entry": entry,
        }
        with self.cond:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            if not self.cond.wait_for(lambda: self.started or self.proc.poll() is not None, 60):
                raise AssertionError("the zygote did not fork a child within 60 s")
            assert self.started, f"the zygote died ({self.proc.returncode})"
            return self.started.pop(0)

    def exited(self, pid: int) -> bool:
        with self.cond:
            return pid in self.exits or self.proc.poll() is not None

    def wait(self, pid: int, *, timeout: float) -> int | None:
        """The child's exit status (negative: the signal), or None at the timeout."""
        with self.cond:
            self.cond.wait_for(lambda: pid in self.exits, timeout)
            return self.exits.get(pid)

    def kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        self.proc.stdin.close()  # its end of input: the zygote leaves
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_ZYGOTES: dict[str, Zygote] = {}


def zygote_for(world_size: int) -> Zygote:
    """The session's zygote for ranks of a `world_size` job (their OMP_NUM_THREADS)."""
    threads = rank_env(0, world_size=world_size, port=0)["OMP_NUM_THREADS"]
    zygote = _ZYGOTES.get(threads)
    if zygote is None or zygote.proc.poll() is not None:
        zygote = _ZYGOTES[threads] = Zygote(threads)
    return zygote


def _zygote_main() -> None:
    """The zygote: import, then fork a child per request line on stdin until stdin ends."""
    import gc
    import selectors

    # The control channel moves off fds 0 and 1: whatever an import prints goes to stderr.
    control_in, control_out = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    import torch._dynamo  # noqa: F401  DDP imports it in every worker
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.rpc  # noqa: F401

    import scaletrain.cli
    import scaletrain.ps.run  # noqa: F401
    import scaletrain.training.trainer  # noqa: F401

    _die_with_parent()
    gc.freeze()
    selector = selectors.DefaultSelector()
    selector.register(control_in, selectors.EVENT_READ)
    pending, children = b"", set()
    while True:
        for _ in selector.select(timeout=0.05):
            chunk = os.read(control_in, 1 << 16)
            if not chunk:  # the harness is done: leave (children die with us)
                os._exit(0)
            pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                selector.close()
                _zygote_child(request, control_in, control_out, scaletrain.cli.main)
            children.add(pid)
            os.write(control_out, f"started {pid}\n".encode())
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                os.write(control_out, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _zygote_child(request: dict, control_in: int, control_out: int, main) -> None:
    """In the forked child: become `python -m scaletrain ARGS` and never return."""
    code = 1
    try:
        _die_with_parent()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = (
            out
            if request["err"] == request["out"]
            else os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        )
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {null, out, err, control_in, control_out}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.argv[0], *request["args"]]
        try:
            if request["entry"] == "pool":  # sys.path[0] stays tests/: a job's checks import
                _pool_main(Path(request["args"][0]))  # leaves through exit_worker
            sys.path[0] = request["cwd"]  # `python -m` puts the working directory first
            code = main(request["args"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001  as the interpreter would: the traceback, status 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _die_with_parent() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGKILL): a killed pytest leaves no zygote or rank behind."""
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)


def run_cli(
    args: list[str], *, timeout: float = 180.0, cwd: Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    """`scaletrain ARGS` as a user runs it (launcher included), with a timeout, in `cwd`."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "scaletrain", *args],
            env=cli_env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"scaletrain {' '.join(args)} did not finish in {timeout} s:\n"
            f"{(e.stderr or b'')[-3000:]}"
        ) from None


def start_cli(args: list[str], *, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """`scaletrain ARGS` started as a user starts it, in the background, its output captured
    (text): for a test that acts on a run while it goes (signals, kills, sockets)."""
    return subprocess.Popen(
        [sys.executable, "-m", "scaletrain", *args],
        env=env if env is not None else cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def wait_until(ready, *, launcher: subprocess.Popen, what: str, timeout: float):
    """Poll `ready()` until it returns something truthy, and return that; fail naming `what`,
    with the launcher's output, if the launcher ends first or `timeout` seconds pass (the
    launcher is then killed)."""
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            out, err = launcher.communicate()
            raise AssertionError(
                f"never saw {what} (launcher exit {launcher.returncode}):\n{(out + err)[-3000:]}"
            )
        time.sleep(0.05)
    return found


def records(run_dir: Path, kind: str = "train") -> list[dict]:
    """The run's metrics.jsonl records of one kind ("train" or "eval"), in file order."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == kind]


def assert_planner_bytes_match(run_dir: Path, *, world_size: int) -> None:
    """The planner's bytes (planner/trace.py) for the run's stored config and world equal the
    param_bytes, grad_bytes and optim_state_bytes its rank 0 logged, to the byte."""
    from scaletrain.config import load_config
    from scaletrain.launch.resolve import resolve
    from scaletrain.planner.trace import held_on_rank
    from scaletrain.training.assemble import build_data

    config = load_config(run_dir / "config.toml")
    derived = resolve(config, world_size=world_size)
    held = held_on_rank(config, derived, dataset=build_data(config, split="train"))
    logged = records(run_dir)[-1]
    predicted = {
        "param_bytes": held.params,
        "grad_bytes": held.grads,
        "optim_state_bytes": held.optim,
    }
    assert predicted == {k: logged[k] for k in predicted}, run_dir


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


def listening_addresses(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket the processes listen on, read from /proc:
    each process's socket inodes (/proc/PID/fd) looked up in its /proc/PID/net/tcp{,6}."""
    import ipaddress

    found = []
    for pid in pids:
        inodes = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        for table in ("tcp", "tcp6"):
            for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                hex_address, hex_port = fields[1].split(":")
                # each 32-bit word of the address is written in host (little-endian) order
                raw = b"".join(
                    bytes.fromhex(hex_address[i : i + 8])[::-1]
                    for i in range(0, len(hex_address), 8)
                )
                found.append((pid, str(ipaddress.ip_address(raw)), int(hex_port, 16)))
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
    import scaletrain.commands.train
    import scaletrain.launch.agent

    monkeypatch.setattr(scaletrain.launch.agent, "launch", refuse_start)
    monkeypatch.setattr(scaletrain.commands.train, "launch", refuse_start)
    monkeypatch.setattr(scaletrain.commands.train, "run_worker", refuse_start)
    monkeypatch.setattr(scaletrain.commands.train, "run_ps_rank", refuse_start)
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
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


# ------------------------------------------------ many runs in one process group per world size

# The parity matrix's runs, shared by test_dp_parity and test_accumulation (and open to
# the model-parallel file): the same text and overrides make the same cached run, so the
# single-process reference of each model is trained once per session.
PARITY_COMMON = """
[optim]
name = "adamw"
lr = 3e-3
warmup_steps = 2
grad_clip = 1.0
[train]
steps = 5
seed = 7
eval_examples = 64
[log]
every = 1
quiet = true
"""
_MLP = '[model]\nname = "mlp"\nsize = "small"\n[data]\nsource = "digits"\n'
PARITY_MODELS = {  # name -> (model and data, global batch, extra overrides)
    "mlp": (_MLP, 64, ()),
    # Adam and clipping are blind to the gradient's scale; plain SGD shows a wrong normaliser.
    "mlp-sgd": (_MLP, 64, ("optim.name=sgd", "optim.grad_clip=0", "optim.lr=0.5")),
    "gpt": (
        '[model]\nname = "gpt"\nsize = "tiny"\n[data]\nsource = "wikitext"\nseq_len = 32\n',
        16,
        (),
    ),
    # Padded paragraphs: target counts differ between micro-batches and ranks.
    "gpt-ragged": (
        '[model]\nname = "gpt"\nsize = "tiny"\n[data]\n'
        'source = "wikitext-paragraphs"\nseq_len = 64\n',
        16,
        (),
    ),
}


# What a test's job is unless it says otherwise: the smallest model on the packaged digits.
BASE_JOB = {"model": {"name": "mlp", "size": "tiny"}, "data": {"source": "digits"}}


def config_toml(name: str = "", **sections: dict) -> str:
    """A test job's config as TOML: BASE_JOB with each given section's keys laid over it
    (`model={"size": "small"}` keeps `name = "mlp"`), and `name` at the top if given.

        config_toml(optim={"lr": 3e-3}, train={"steps": 10}, precision={"mode": "fp64"})
    """
    data: dict = {"name": name} if name else {}
    for section in dict.fromkeys([*BASE_JOB, *sections]):
        data[section] = {**BASE_JOB.get(section, {}), **sections.get(section, {})}
    return tomli_w.dumps(data)


def parity_case(
    model: str,
    *,
    dp: int = 1,
    acc: int = 1,
    precision: str = "fp64",
    steps: int = 5,
    extra: tuple[str, ...] = (),
) -> Case:
    """PARITY_MODELS[model] on dp ranks with `acc` micro-batches per rank per step."""
    body, batch, model_extra = PARITY_MODELS[model]
    return Case.of(
        body + PARITY_COMMON,
        f"train.global_batch={batch}",
        f"train.micro_batch={batch // (dp * acc)}",
        f"parallel.dp={dp}",
        f"precision.mode={precision}",
        f"train.steps={steps}",
        *model_extra,
        *extra,
    )


@dataclass(frozen=True)
class Case:
    """One training run of a job: `config` (TOML text) with each leg's overrides run in turn
    on the same run directory (a stopped run and its resume are two legs). A leg that is a
    string "module:function" is called instead, on rank 0, with the run directory (e.g. to
    damage a checkpoint between legs); every rank waits for it."""

    config: str
    legs: tuple[tuple[str, ...] | str, ...] = ((),)
    expect_ok: bool = True  # every training leg must end with status 0

    @staticmethod
    def of(config: str, *overrides: str, expect_ok: bool = True) -> Case:
        """A one-leg case."""
        return Case(config, (tuple(overrides),), expect_ok)


@dataclass
class CaseResult:
    """What a case left: its run directory and, per leg, rank 0's status and output."""

    run_dir: Path
    codes: list[int] = field(default_factory=list)
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


class JobPool:
    """`world_size` ranks that joined one gloo process group and run job after job.

    A job is a spec file the ranks find in the pool's directory (`job-K.json`, K = 0, 1,
    ...); they run its cases and rank 0 writes `job-K.done`. A `stop` file ends them. The
    ranks are forked from the zygote (no interpreter start, no imports); their process group
    is joined once per pool, not once per job. A pool whose rank failed or timed out is
    killed (a job's caller starts another).
    """

    def __init__(self, world_size: int, directory: Path, *, fresh: bool = False) -> None:
        """`fresh`: each rank a new interpreter (`python harness.py --pool DIR`), which reads
        the environment at start-up (PYTHONPATH's sitecustomize); else forked from the
        session's zygote, its imports already paid (4.5 s of CPU a rank)."""
        self.world_size, self.dir, self.jobs = world_size, directory, 0
        directory.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.zygote = None if fresh else zygote_for(world_size)
        self.procs: list[subprocess.Popen] = []
        self.pids: list[int] = []
        for rank in range(world_size):
            env = rank_env(rank, world_size=world_size, port=port)
            log = directory / f"rank{rank}.log"  # the rank's whole output
            if self.zygote is not None:
                self.pids.append(
                    self.zygote.spawn(
                        [str(directory)], env=env, cwd=directory, out=log, err=log, entry="pool"
                    )
                )
                continue
            with log.open("w") as out:  # a file: never blocks
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "--pool", str(directory)],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=directory,
                    )
                )

    def alive(self) -> bool:
        if self.zygote is None:
            return all(p.poll() is None for p in self.procs)
        return not any(self.zygote.exited(pid) for pid in self.pids)

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        for pid in self.pids:
            self.zygote.kill(pid)
            self.zygote.wait(pid, timeout=30)

    def stop(self) -> None:
        """Let the ranks leave by themselves (their group destroyed); kill what does not."""
        (self.dir / "stop").touch()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in self.pids:
            if self.zygote.wait(pid, timeout=30) is None:
                self.zygote.kill(pid)
                self.zygote.wait(pid, timeout=30)

    def run(self, spec: dict, *, timeout: float) -> list[dict]:
        """Run one job; rank 0's record of every leg. A job that finishes no leg within
        `timeout` seconds (a fresh pool's start-up included) kills the pool and fails."""
        job = self.dir / f"job-{self.jobs}"
        self.jobs += 1
        progress = job.with_suffix(".jsonl")
        job.with_suffix(".tmp").write_text(json.dumps(spec))
        job.with_suffix(".tmp").rename(job.with_suffix(".json"))  # whole, or not there
        done_legs, deadline = -1, 0.0
        while not job.with_suffix(".done").exists():
            if not self.alive():
                self.kill()  # a rank failed: the others would wait for it in a collective
                logs = [
                    (self.dir / f"rank{r}.log").read_text()[-5000:] for r in range(self.world_size)
                ]
                raise AssertionError(
                    f"a rank of the {self.world_size}-rank job failed:\n" + "\n".join(logs)
                )
            legs = len(progress.read_text().splitlines()) if progress.exists() else 0
            if legs != done_legs:  # a leg ended: the next one gets its own `timeout`
                done_legs, deadline = legs, time.monotonic() + timeout
            if time.monotonic() > deadline:
                self.kill()
                tails = [
                    (self.dir / f"rank{r}.log").read_text()[-2000:] for r in range(self.world_size)
                ]
                raise AssertionError(
                    f"the {self.world_size}-rank job finished no leg of its cases within "
                    f"{timeout} s ({done_legs} done):\n" + "\n".join(tails)
                )
            time.sleep(0.05)
        return [json.loads(line) for line in progress.read_text().splitlines()]


# world size -> the pool kept for the whole session (run_job(..., keep=True))
_POOLS: dict[int, JobPool] = {}


def stop_pools() -> None:
    """End the kept pools and the zygotes (conftest calls this at the session's end)."""
    while _POOLS:
        _POOLS.popitem()[1].stop()
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].stop()


def run_job(
    cases: dict[str, Case],
    *,
    world_size: int,
    root: Path,
    timeout: float = 300.0,
    cwd: Path | None = None,
    keep: bool = False,
    fresh: bool = False,
) -> dict[str, CaseResult]:
    """Train every case on `world_size` gloo ranks of one job; run directories root/<name>.

    keep: run it in the session's pool of `world_size` ranks, started on first use and
    kept for the next job (conftest's `trained` does). Without it the ranks are started for
    this job alone: a test that reads a process's lifetime peak memory needs its own.
    fresh: (without keep) each rank a new interpreter, for a test whose ranks must read the
    environment at start-up (a sitecustomize on PYTHONPATH); else forked from the zygote.

    A job that finishes no leg within `timeout` seconds (start-up included) is killed and
    the test fails with every rank's output: a hang cannot stall CI, and a job of many
    cases is not held to one deadline for all of them.

    Cases run in the order given; a case whose training leg fails unexpectedly (expect_ok)
    fails the test with that leg's output. A bug (an exception `run_worker` re-raises)
    ends the job: its traceback is in the failure message.
    """
    root.mkdir(parents=True, exist_ok=True)
    spec = {
        "cases": {
            name: {
                "config": c.config,
                "legs": [list(leg) if not isinstance(leg, str) else leg for leg in c.legs],
            }
            for name, c in cases.items()
        },
        "root": str(root),
        "cwd": str(cwd or root),
    }
    pool = _POOLS.pop(world_size, None) if keep else None
    if pool is None or not pool.alive():
        pool = JobPool(world_size, root / f"pool-{time.monotonic_ns()}", fresh=fresh)
    try:
        done = pool.run(spec, timeout=timeout)
    except BaseException:  # a failed rank, a timeout, pytest-timeout or Ctrl-C in the test
        pool.kill()
        raise
    if keep:
        _POOLS[world_size] = pool
    else:
        pool.stop()
    results = {name: CaseResult(run_dir=root / name) for name in cases}
    for row in done:
        r = results[row["case"]]
        r.codes.append(row["code"])
        r.stdout.append(row["stdout"])
        r.stderr.append(row["stderr"])
    for name, case in cases.items():
        for leg, code in enumerate(results[name].codes):  # a call between legs must pass
            if case.expect_ok or isinstance(case.legs[leg], str):
                assert code == 0, (
                    f"case {name!r}, leg {leg} {case.legs[leg]}: status {code}:"
                    f"\n{results[name].stderr[leg][-3000:]}"
                )
    return results


def _pool_main(directory: Path) -> None:
    """One rank of a pool (a child of the zygote): join the group once, then run each job
    that appears, until the stop file (or the end of the zygote that forked it)."""
    import gc
    from datetime import timedelta

    import torch.distributed as dist

    import scaletrain.cli  # noqa: F401  the workers' imports, then frozen (below)

    print(f"job rank {os.environ['RANK']}: started after imports", flush=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:  # the trainer joins no group when one exists: every case uses this one
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    # What is imported lives as long as the pool: out of the collector's sight, the
    # gc.collect() after every leg costs 0.02 s instead of 0.15 s.
    gc.freeze()
    pytest_pid = os.getppid()
    for k in itertools.count():
        job = directory / f"job-{k}.json"
        while not job.exists():  # between jobs no rank waits in a collective
            if (directory / "stop").exists() or os.getppid() != pytest_pid:  # or orphaned
                from scaletrain.runtime import exit_worker

                exit_worker(0)  # destroy the group and leave without gloo's shutdown abort
            time.sleep(0.05)
        _run_cases(json.loads(job.read_text()), job, rank=rank, world=world)
        if world > 1:
            dist.barrier()  # every rank is done with the job
        if rank == 0:
            job.with_suffix(".done").touch()


def _run_cases(spec: dict, job: Path, *, rank: int, world: int) -> None:
    """One job's cases, in its working directory (a user's package is imported from there,
    as the CLI imports it; it is forgotten afterwards, so the next job's package of the same
    name is its own); rank 0 records each leg's outcome in job-K.jsonl."""
    import contextlib
    import gc
    import importlib
    import io
    import traceback

    import torch.distributed as dist

    from scaletrain.commands.worker import run_worker as _run_worker
    from scaletrain.config import load_config

    cwd = os.path.realpath(spec["cwd"])
    os.chdir(cwd)
    sys.path.insert(0, cwd)
    importlib.invalidate_caches()
    before = set(sys.modules)
    out = job.with_suffix(".jsonl").open("w") if rank == 0 else io.StringIO()
    root = Path(spec["root"])
    for name, case in spec["cases"].items():
        run_dir = root / name
        config_path = root / f"{name}.toml"
        if rank == 0:
            config_path.write_text(case["config"])
        for leg in case["legs"]:
            if world > 1:
                dist.barrier()  # the config is written; the last leg is over on every rank
            started = time.monotonic()
            if isinstance(leg, str):
                code, stdout, stderr = 0, "", ""
                if rank == 0:
                    module, function = leg.split(":")
                    try:
                        getattr(importlib.import_module(module), function)(run_dir)
                    except Exception:  # a failed check between legs: that case fails
                        code, stderr = 1, traceback.format_exc()
            else:
                stdout, stderr = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                    try:
                        code = _run_worker(
                            load_config(config_path, list(leg)), run_dir, exit_process=False
                        )
                    except BaseException:  # a bug: show it and end the pool
                        print(f"case {name}, overrides {leg}:", file=sys.__stderr__)
                        traceback.print_exc(file=sys.__stderr__)
                        sys.__stderr__.write(stderr.getvalue()[-3000:])
                        os._exit(1)
                stdout, stderr = stdout.getvalue(), stderr.getvalue()
                gc.collect()  # the last run's model and data go before the next is built
            out.write(
                json.dumps(
                    {
                        "case": name,
                        "code": code,
                        "stdout": stdout,
                        "stderr": stderr,
                        "seconds": round(time.monotonic() - started, 2),
                    }
                )
                + "\n"
            )
            out.flush()
    out.close()
    sys.path.remove(cwd)
    for module in set(sys.modules) - before:  # the job's own packages, not the libraries
        file = getattr(sys.modules[module], "__file__", None) or ""
        if os.path.realpath(file).startswith(cwd + os.sep) and not module.startswith("scaletrain"):
            del sys.modules[module]


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        _zygote_main()
    else:  # --pool DIR: a fresh pool's rank
        _pool_main(Path(sys.argv[2]))


# ------------------------------------------------ who listens where (/proc/net)


def decode_address(hex_addr: str) -> str:
    """/proc/net/tcp{,6}'s local address (host byte order, hex) as text."""
    if len(hex_addr) == 8:
        return ".".join(str(int(hex_addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
    words = [hex_addr[i : i + 8] for i in range(0, 32, 8)]
    raw = b"".join(bytes.fromhex(w)[::-1] for w in words)
    if raw[:12] == b"\0" * 10 + b"\xff\xff":  # IPv4-mapped
        return ".".join(map(str, raw[12:]))
    import ipaddress

    return str(ipaddress.IPv6Address(raw))


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` LISTENs on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        m = re.fullmatch(r"socket:\[(\d+)\]", target)
        if m:
            inodes.add(m[1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: TCP_LISTEN
                addr, port = cols[1].split(":")
                found.append((decode_address(addr), int(port, 16)))
    return found


def env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)
