"""parallel.strategy = "ps" from the command line: every mistake is refused before anything
starts, `explain` describes the roles, and with `ps.interface` set the servers' own gloo group
listens there too. (That a job listens on loopback only by default is shown in
tests/test_ps_faults.py, on its run of 2 servers and 4 workers.)

The refusals follow tests/test_cli_errors.py's contract: `scaletrain train ...` exits 2 with
one `scaletrain: error: ...` line on stderr naming the key, no traceback, and writes nothing.
The table runs `scaletrain.cli.main` in-process with the launcher and the worker replaced
by functions that fail the test (and checks that nothing is printed on stdout); two rows
run again as a real `python -m scaletrain` process (harness.run_cli) to show that the
launcher's own process refuses them too: one the launcher refuses only after building the
model (more servers than parameter tensors), one from the launcher's flags (loopback
across nodes). The other rows are not repeated as processes: the in-process table is the
same `main`.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import time
from pathlib import Path

import pytest

import scaletrain.cli
import scaletrain.commands.train
import scaletrain.launch.agent

from harness import (
    cli_main,
    decode_address,
    file_tree,
    forbid_starting,
    free_port,
    listening,
    records,
    refuse_start,
    run_cli,
    spawn_ranks,
)

# 1 server + 2 workers, 4 steps: a valid job (and the digits MLP has 4 parameter tensors).
PS_TOML = """\
name = "ps-config-test"

[model]
name = "mlp"
size = "tiny"

[data]
source = "digits"

[train]
steps = 4
global_batch = 64
micro_batch = 16

[parallel]
strategy = "ps"
dp = 2

[ps]
mode = "async"
"""

# The same job under the collective strategy: no [ps] section.
COLLECTIVE_TOML = PS_TOML.split("[parallel]")[0] + "[parallel]\ndp = 2\n"


def case(id: str, argv: str, *expect: str, toml: str = PS_TOML):
    """One refusal: `argv` ({cfg} is the written config), the substrings its message holds."""
    return pytest.param(argv, expect, toml, id=id)


CASES = [
    # [ps] keys are read only under parallel.strategy = "ps" (but for the straggler knob)
    case(
        "ps-key-override-with-collective",
        "train {cfg} ps.mode=sync",
        "ps.mode",
        "parallel.strategy = 'ps'",
        "'collective'",
        toml=COLLECTIVE_TOML,
    ),
    case(
        "ps-section-in-toml-with-collective",
        "train {cfg}",
        "ps.servers",
        "'collective'",
        toml=COLLECTIVE_TOML + "\n[ps]\nservers = 2\n",
    ),
    case(
        "ps-staleness-with-collective",
        "train {cfg} ps.staleness=0",
        "ps.staleness",
        toml=COLLECTIVE_TOML,
    ),
    case(
        "retired-straggler-key",
        "train {cfg} ps.slow_worker=1",
        "ps.slow_worker = 1",
        "no longer a key",
        "bench/straggler.py",
        toml=COLLECTIVE_TOML,
    ),
    # the world against the servers
    case(
        "world-not-above-servers",
        "train {cfg} --nproc 1",
        "ps.servers = 1",
        "at least 2 processes",
        "world has 1",
    ),
    case(
        "servers-fill-the-world",
        "train {cfg} ps.servers=2 --nproc 2",
        "ps.servers = 2",
        "at least 3 processes",
        "world has 2",
    ),
    case(
        "dp-not-world-minus-servers",
        "train {cfg} --nproc 2",
        "parallel.dp = 2",
        "number of workers",
        "leaves 1",
        "--nproc 3",
    ),
    case(
        "dp-replicate-not-world-minus-servers",
        "train {cfg} parallel.dp=-1 parallel.dp_replicate=3 --nproc 3",
        "parallel.dp_replicate = 3",
        "leaves 2",
    ),
    # a lease the collectives' timeout cannot outwait
    case(
        "lease-not-below-the-timeout",
        "train {cfg} ps.worker_timeout_s=60 parallel.timeout_s=60",
        "ps.worker_timeout_s = 60",
        "parallel.timeout_s = 60",
    ),
    # degrees and features of the collective strategy
    case(
        "dp-shard",
        "train {cfg} parallel.dp_shard=2",
        "parallel.dp_shard = 2",
        "does not compose",
        "parallel.strategy",
    ),
    case(
        "dp-shard-inferred",
        "train {cfg} parallel.dp_shard=-1",
        "parallel.dp_shard = -1",
        "does not compose",
    ),
    case("tp", "train {cfg} parallel.tp=2", "parallel.tp = 2", "does not compose"),
    case("pp", "train {cfg} parallel.pp=2", "parallel.pp = 2", "does not compose"),
    case(
        "comm-hook",
        "train {cfg} parallel.comm_hook=powersgd",
        "parallel.comm_hook = 'powersgd'",
        "comm_hook='none'",
    ),
    case("compile", "train {cfg} train.compile=true", "train.compile", "parallel.strategy"),
    case(
        "fp16-mixed",
        "train {cfg} precision.mode=fp16-mixed",
        "precision.mode = 'fp16-mixed'",
        "parallel.strategy",
        "'bf16-mixed'",
    ),
    # roles
    case(
        "more-servers-than-tensors",
        "train {cfg} ps.servers=5 parallel.dp=1",
        "ps.servers = 5",
        "only 4 parameter tensors",
        "ps.servers <= 4",
        "model.name = 'mlp'",
    ),
    case(
        "loopback-across-nodes",
        "train {cfg} parallel.dp=-1 --nproc 1 --nnodes 2 --rdzv-endpoint node1:29500",
        "ps.interface = 'lo'",
        "--nnodes 2",
        "ps.interface=eth0",
    ),
    # the [ps] values themselves
    case(
        "mode-unknown",
        "train {cfg} ps.mode=hogwild",
        "ps.mode = 'hogwild'",
        "'async'",
        "'ssp'",
        "'sync'",
    ),
    case("staleness-negative", "train {cfg} ps.staleness=-1", "ps.staleness = -1"),
    case(
        "staleness-lr-unknown",
        "train {cfg} ps.staleness_lr=sqrt",
        "ps.staleness_lr = 'sqrt'",
        "'inverse'",
    ),
    case("servers-zero", "train {cfg} ps.servers=0", "ps.servers = 0"),
    case("worker-timeout-zero", "train {cfg} ps.worker_timeout_s=0", "ps.worker_timeout_s = 0"),
    case(
        "retired-slow-factor", "train {cfg} ps.slow_factor=0.5", "ps.slow_factor = 0.5", "no longer"
    ),
    case(
        "strategy-unknown",
        "train {cfg} parallel.strategy=gossip",
        "parallel.strategy = 'gossip'",
        "'collective'",
        "'ps'",
    ),
]


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    forbid_starting(monkeypatch, tmp_path)


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    message = [line for line in err.splitlines() if line.startswith("scaletrain: error: ")]
    assert len(message) == 1, f"want one 'scaletrain: error:' line, stderr:\n{err}"
    return message[0]


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize("argv, expect, toml", CASES)
def test_ps_mistake_is_refused_before_anything_starts(
    argv: str,
    expect: tuple[str, ...],
    toml: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(toml)
    before = file_tree(tmp_path)
    args = [a.replace("{cfg}", str(cfg)) for a in shlex.split(argv)]
    args += ["--run-dir", str(tmp_path / "run")]

    code = cli_main(args)

    out, err = capsys.readouterr()
    assert code == 2, f"exit status {code}, stderr:\n{err}"
    message = _one_error_line(err)
    for want in expect:
        assert want in message, f"{want!r} not in: {message}"
    assert out == ""
    assert file_tree(tmp_path) == before, "a refused command wrote or changed files"


def test_table_ids_are_unique() -> None:
    assert len({p.id for p in CASES}) == len(CASES)


@pytest.mark.parametrize(
    "argv",
    [
        # the good ps config, its roles inferred: 1 server + parallel.dp = 2 workers
        "train {cfg}",
        "train {cfg} ps.mode=ssp ps.staleness=0 ps.staleness_lr=inverse --nproc 3",
        "train {cfg} ps.servers=2 parallel.dp=-1 --nproc 4",
        "train {cfg} ps.servers=4 parallel.dp=1",  # as many servers as parameter tensors
        "train {cfg} ps.interface=eth0 parallel.dp=-1 --nproc 1 --nnodes 2 --rdzv-endpoint n1:29500",
        # an older run's config.toml writes the retired keys at their defaults
        "train {cfg} ps.slow_worker=-1 ps.slow_factor=1.0",
    ],
)
def test_good_ps_configs_reach_the_launcher(
    argv: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table cannot pass by refusing everything: these get as far as launching."""
    launched = []
    monkeypatch.setattr(
        scaletrain.commands.train, "launch", lambda spec, args, **kw: launched.append(spec) or 0
    )
    monkeypatch.setattr(scaletrain.commands.train, "run_worker", refuse_start)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "config.toml"
    cfg.write_text(PS_TOML)
    args = [a.replace("{cfg}", str(cfg)) for a in shlex.split(argv)]

    code = cli_main([*args, "--run-dir", str(tmp_path / "run")])

    err = capsys.readouterr().err
    assert code == 0 and "scaletrain: error" not in err, err
    assert len(launched) == 1
    if argv == "train {cfg}":
        assert launched[0].nproc == 3  # servers + parallel.dp


@pytest.mark.usefixtures("nothing_starts")
def test_explain_describes_a_ps_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(PS_TOML)
    before = file_tree(tmp_path)

    code = cli_main(["explain", str(cfg), "--all"])  # the key listing holds "[ps]"

    out, err = capsys.readouterr()
    assert code == 0, err
    assert "scaletrain: error" not in err
    assert "3 (3 process(es) x 1 node(s))" in out  # 1 server + 2 workers, inferred
    assert re.search(r"servers\s+│\s+1 \(ranks 0\.\.0", out), out
    assert re.search(r"workers\s+│\s+2 \(ranks 1\.\.2\)", out), out
    assert "parameter servers (async" in out
    assert "interface 'lo' only" in out
    assert "[ps]" in out  # parallel.strategy's meaning, not eaten as rich markup
    assert file_tree(tmp_path) == before

    code = cli_main(
        ["explain", str(cfg), "ps.servers=2", "ps.mode=sync", "parallel.dp=-1", "--nproc", "6"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "6 (6 process(es) x 1 node(s))" in out
    assert re.search(r"servers\s+│\s+2 \(ranks 0\.\.1", out), out
    assert re.search(r"workers\s+│\s+4 \(ranks 2\.\.5\)", out), out
    assert "parameter servers (sync" in out


@pytest.mark.parametrize(
    "argv, want",
    [
        ("train {cfg} ps.servers=5 parallel.dp=1", "ps.servers = 5"),
        (
            "train {cfg} parallel.dp=-1 --nproc 1 --nnodes 2 --rdzv-endpoint node1:29500",
            "ps.interface = 'lo'",
        ),
    ],
)
def test_refusal_as_a_real_process(argv: str, want: str, tmp_path: Path) -> None:
    """Two of the table's refusals from `python -m scaletrain` itself, a real process on
    purpose (what a user's shell sees: the interpreter's start, torch's import, its output):
    status 2, one line, no run. The table's rows more-servers-than-tensors and
    loopback-across-nodes, in-process, check the full messages."""
    (tmp_path / "ps.toml").write_text(PS_TOML)
    files = {"{cfg}": str(tmp_path / "ps.toml")}
    args = [files.get(a, a) for a in shlex.split(argv)]
    before = file_tree(tmp_path)

    r = run_cli([*args, "--run-dir", str(tmp_path / "run")], timeout=120, cwd=tmp_path)

    assert r.returncode == 2, r.stderr
    assert want in _one_error_line(r.stderr)
    assert r.stdout == ""
    assert file_tree(tmp_path) == before, "a refused command wrote files (a run directory?)"


# ---------------------------------------------------------------------- loopback only


def test_decode_proc_net_addresses() -> None:
    assert decode_address("0100007F") == "127.0.0.1"
    assert decode_address("00000000") == "0.0.0.0"
    assert decode_address("00000000000000000000000000000000") == "::"
    assert decode_address("0000000000000000FFFF00000100007F") == "127.0.0.1"
    assert decode_address("00000000000000000000000001000000") == "::1"


ROLE_LINE = re.compile(
    r"^# scaletrain worker: rank \d+ is ps (?P<role>server|worker) (?P<index>\d+), "
    r"pid (?P<pid>\d+)$",
    re.M,
)


def _other_interface() -> tuple[str, str] | None:
    """A non-loopback interface with an IPv4 address on this machine: (name, address)."""
    import socket

    from scaletrain.config import ConfigError
    from scaletrain.ps.connect import interface_address

    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        try:
            address = interface_address(name)
        except ConfigError:
            continue
        if not address.startswith("127."):
            return name, address
    return None


@pytest.mark.slow
def test_ps_interface_other_than_lo_holds_the_servers_gloo_group_too(tmp_path: Path) -> None:
    """ps.interface = eth0 (say): the servers' gloo group (checkpoints, sync's clipping norm)
    listens there as TensorPipe and the store do, not where gloo would pick from the host
    name (here: loopback). Ranks started as torchrun would (harness.run_workers' env, forked
    from the session's zygote), with MASTER_ADDR on that interface."""
    found = _other_interface()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    name, address = found

    cfg = tmp_path / "ps.toml"
    cfg.write_text(PS_TOML)
    run_dir, port, world = tmp_path / "run", free_port(), 3  # 2 servers + 1 worker
    args = [
        "train",
        str(cfg),
        "ps.servers=2",
        "parallel.dp=1",
        f"ps.interface={name}",
        "train.steps=100000",
        "log.every=1",
        "log.quiet=true",
        "checkpoint.every=0",
        "--run-dir",
        str(run_dir),
    ]
    # Each rank is `scaletrain train ARGS` forked from the session's zygote (harness.py):
    # the worker's own entry and environment, without an interpreter's start each.
    zygote, ranks = spawn_ranks(
        args, world_size=world, port=port, cwd=tmp_path, outputs=tmp_path, MASTER_ADDR=address
    )
    servers: dict[int, int] = {}  # pid -> index
    children: set[int] = set()  # every role's pid, killed at the end if still there
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(zygote.exited(r) for r in ranks):
            for log in sorted(tmp_path.glob("rank-*.err")):
                for m in ROLE_LINE.finditer(log.read_text()):
                    children.add(int(m["pid"]))
                    if m["role"] == "server":
                        servers[int(m["pid"])] = int(m["index"])
            if len(servers) == 2 and (run_dir / "metrics.jsonl").exists() and records(run_dir):
                break  # both servers up, their group formed, gradients applied
            time.sleep(0.5)
        assert not any(zygote.exited(r) for r in ranks), "a rank ended early:\n" + "\n".join(
            log.read_text()[-2000:] for log in sorted(tmp_path.glob("rank-*.err"))
        )
        assert len(servers) == 2, servers
        for pid, index in sorted(servers.items()):
            seen = set(listening(pid))
            assert seen, f"server {index} (pid {pid}) listens on nothing: wrong pid?"
            elsewhere = sorted(s for s in seen if s[0] != address)
            assert not elsewhere, (
                f"server {index} (pid {pid}) listens beyond "
                f"ps.interface = {name} ({address}): {elsewhere}"
            )
    finally:
        for r in ranks:
            if not zygote.exited(r):
                os.kill(r, signal.SIGTERM)
        for r in ranks:
            if zygote.wait(r, timeout=60) is None:
                zygote.kill(r)
                zygote.wait(r, timeout=30)
        for pid in children:  # a role child its supervisor left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
