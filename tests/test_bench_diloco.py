"""bench/diloco.py, the two-node slow-link benchmark, and bench/slow_link.py, its link: its table and ratios, the command each
node runs, the link it builds and always removes, and the one line it prints where the
machine cannot build one. These need no root: the link's commands go to a recorder. One
slow test, as root with iproute2 only, builds the real link and trains 2 DDP steps across
it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import diloco  # noqa: E402
import slow_link  # noqa: E402


def _result(name: str, **numbers: float) -> diloco.Result:
    return diloco.Result(name, **{"steps": 100, "wall_s": 1.0, **numbers})


def sent(per_step: float) -> dict[str, float]:
    return {"logged_bytes_per_step": per_step}


def test_table_gives_each_contender_its_ratios_to_ddp() -> None:
    results = [
        _result("ddp", train_s=100.0, link_bytes=1_000_000_000, eval_loss=2.0, **sent(1e6)),
        _result("diloco", train_s=40.0, link_bytes=20_000_000, eval_loss=2.04, **sent(2e4)),
        diloco.Result("streaming", error="exit codes [1, 1]"),
    ]
    rows = {row[0]: row for row in diloco.ratio_rows(results)}
    # name, train s, x ddp, speed-up, wall s, bytes, x ddp, B/step, logged, loss, vs ddp, foreign
    assert rows["ddp"][2:4] == ["1.000", "1.000"]
    assert rows["diloco"][1:4] == ["40.0", "0.400", "2.500"]
    assert rows["diloco"][5:8] == ["20.00 MB", "0.020", "200.00 kB"]
    assert rows["diloco"][9:11] == ["2.0400", "+2.00%"]
    assert rows["streaming"][1] == "failed"
    lines = diloco.table(results).splitlines()
    assert lines[0].split()[:3] == ["contender", "train", "s"] and len(lines) == 4
    assert diloco.verdicts(results, sync_every=50) == [
        "diloco train time / ddp's: 0.400 (goal <= 0.4) ok",
        "diloco logged bytes per step / ddp's: 1/50.00 (goal <= 1/H = 1/50; over the link, "
        "all traffic: 1/50.00) ok",
        "diloco eval loss vs ddp's: 2.00% apart (goal within 3%) ok",
    ]
    slow = [
        results[0],
        _result("diloco", train_s=50.0, link_bytes=30_000_000, eval_loss=2.1, **sent(30_000)),
    ]
    assert all(v.endswith("NOT MET") for v in diloco.verdicts(slow, sync_every=50))


def test_each_node_runs_scaletrain_in_its_namespace_under_its_own_host_name() -> None:
    node = slow_link.NODES[1]
    cmd = slow_link.node_command(
        node,
        config=Path("c.toml"),
        overrides=["parallel.dp_replicate=2"],
        nproc=1,
        endpoint="10.50.0.1:29411",
        rdzv_id="job",
        run_dir=Path("/runs/ddp"),
    )
    assert cmd[:6] == ["ip", "netns", "exec", "stbench1", "unshare", "--uts"]
    assert cmd[6:10] == ["sh", "-c", 'hostname "$0" && exec "$@"', "stbench-node1"]
    tail = cmd[cmd.index("scaletrain") - 2 :]
    assert tail == [
        *[sys.executable, "-m", "scaletrain", "train", "c.toml", "parallel.dp_replicate=2"],
        *["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", "10.50.0.1:29411"],
        *["--rdzv-id", "job", "--run-dir", "/runs/ddp"],
    ]
    env = slow_link.node_env(
        node, {"MASTER_ADDR": "x", "RANK": "3", "PYTHONPATH": "/p", "HOME": "/h"}
    )
    assert env["GLOO_SOCKET_IFNAME"] == "stbench1-veth"
    assert env["PYTHONPATH"] == f"{slow_link.SRC}:/p" and env["HOME"] == "/h"
    assert "MASTER_ADDR" not in env and "RANK" not in env


def test_contenders_share_the_layout_and_one_that_does_not_validate_is_named(
    tmp_path: Path,
) -> None:
    a = diloco.parse(["--quick", "--quantize", "int8"])
    assert (a.size, a.steps, a.sync_every) == ("tiny", 20, 4)
    every = diloco.contenders(a)
    assert list(every) == ["ddp", "diloco", "streaming", "streaming-int8"]
    assert every["streaming-int8"] == [
        "parallel.strategy=diloco",
        "diloco.sync_every=4",
        "diloco.fragments=2",
        "diloco.overlap_steps=1",
        "diloco.quantize=int8",
    ]
    config = tmp_path / "c.toml"
    config.write_text(diloco.CONFIG.format(**vars(a)))
    assert diloco.invalid(config, diloco.layout(1)) is None
    why = diloco.invalid(config, [*diloco.layout(1), "parallel.strategy=bogus"])
    assert "parallel.strategy" in why and "bogus" in why
    assert diloco.parse(["--quick", "--steps", "40"]).steps == 40  # a flag beats --quick
    with pytest.raises(SystemExit):
        diloco.parse(["--steps", "120", "--sync-every", "50"])


@pytest.mark.parametrize(
    "root, absent, said",
    [
        (1000, "", "needs root"),
        (0, "ip", "needs `ip` (iproute2)"),
        (0, "tc", "needs `tc` (iproute2)"),
        (0, "unshare", "needs `unshare` (util-linux)"),
    ],
)
def test_one_line_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    root: int,
    absent: str,
    said: str,
) -> None:
    monkeypatch.setattr(slow_link.os, "geteuid", lambda: root)
    monkeypatch.setattr(slow_link.shutil, "which", lambda tool: None if tool == absent else tool)
    monkeypatch.setattr(diloco, "Link", None)  # nothing may be built
    assert diloco.main(["--quick"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("bench/diloco.py: skipped: " + said)


class Recorder:
    """Stands in for `sh`: records each command; tc refuses netem, as a kernel without it."""

    def __init__(self) -> None:
        self.cmds: list[list[str]] = []

    def __call__(self, cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
        self.cmds.append(cmd)
        refused = "netem" in cmd
        if refused and check:
            raise AssertionError("netem must be tried with check=False")
        err = "Error: Specified qdisc kind is unknown." if refused else ""
        return subprocess.CompletedProcess(cmd, int(refused), stdout="7\n", stderr=err)


def test_the_link_falls_back_to_tbf_and_is_removed_even_on_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(slow_link, "ETC_NETNS", tmp_path / "netns")
    rec = Recorder()
    with pytest.raises(RuntimeError, match="boom"):
        with slow_link.Link(rate_mbit=100, delay_ms=20, run=rec) as link:
            hosts = (tmp_path / "netns" / "stbench0" / "hosts").read_text()
            assert "10.50.0.1 stbench-node0\n10.50.0.2 stbench-node1\n" in hosts
            assert link.tx_bytes() == {"stbench0": 7, "stbench1": 7}
            raise RuntimeError("boom")
    dels = [c for c in rec.cmds if c[:3] == ["ip", "netns", "del"]]
    assert dels == [["ip", "netns", "del", "stbench0"], ["ip", "netns", "del", "stbench1"]] * 2
    first_add = rec.cmds.index(["ip", "netns", "add", "stbench0"])
    assert rec.cmds.index(dels[1]) < first_add  # an earlier run's leftovers go first
    assert not (tmp_path / "netns").exists()
    tc = [c[c.index("root") + 1 :] for c in rec.cmds if "tc" in c]
    assert tc[0][:3] == ["netem", "delay", "20ms"]  # tried once, refused
    assert tc[1:] == [["tbf", "rate", "100mbit", "burst", "50000", "latency", "400ms"]] * 2
    assert link.shaper == "tbf" and "no added delay (asked 20 ms)" in link.note
    assert link.describe() == "100 Mbit/s and no added delay each way (tbf on both ends)"
    assert slow_link.qdisc(rate_mbit=100, delay_ms=20, netem=True) == [
        *["netem", "delay", "20ms", "rate", "100mbit"]
    ]


@pytest.mark.slow
def test_two_nodes_train_ddp_across_a_real_link(tmp_path: Path) -> None:
    """As root with iproute2: the link is built, 2 DDP steps of GPT tiny cross it, and no
    namespace is left behind (its own names, so a running benchmark is not disturbed)."""
    if slow_link.missing():
        pytest.skip(slow_link.missing())
    nodes = (
        slow_link.Node("stbtest0", "stbtest0-veth", "10.51.0.1", "stbtest-node0"),
        slow_link.Node("stbtest1", "stbtest1-veth", "10.51.0.2", "stbtest-node1"),
    )
    a = diloco.parse(["--quick", "--steps", "2", "--sync-every", "1", "--log-every", "1"])
    a.timeout, a.eval_examples = 120, 16
    config = tmp_path / "c.toml"
    config.write_text(diloco.CONFIG.format(**vars(a)))
    with slow_link.Link(rate_mbit=1000, delay_ms=0, nodes=nodes) as link:
        r = diloco.train("ddp", [], a=a, link=link, config=config, root=tmp_path, port=29461)
    assert not r.error, r.error
    assert r.steps == 2 and r.eval_loss > 0
    # GPT tiny's gradients cross the link once per step: more than its parameters' bytes
    assert r.logged_bytes_per_step > 0 and r.link_bytes > 2 * r.logged_bytes_per_step
    assert set(r.sent) == {"stbtest0", "stbtest1"} and min(r.sent.values()) > 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "stbtest" not in listed
