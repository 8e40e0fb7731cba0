"""`scaletrain plan --why` (issue 48): a layout's predicted step is a function of named
terms (planner/predict.py's `Terms`), and the terms it prints add up to the step the
table shows. Pure planning on meta, no process group: each test takes seconds."""

from __future__ import annotations

import math
import re

import pytest

from scaletrain.config import validate_config
from scaletrain.planner import predict_configured
from scaletrain.runtime.hardware import BUILTIN, Link, Profile

from harness import cli_main, config_toml

GPT = {
    "model": {"name": "gpt", "size": "tiny"},
    "data": {"source": "synthetic-text", "seq_len": 16},
    "train": {"micro_batch": 4, "global_batch": 16},
}


def _cpu(cores: int) -> Profile:
    """A CPU profile with every cost the step pays: per op and byte, per call of FSDP2 and
    DTensor, and once a step."""
    link = Link(bus_bw=1e9, latency_s=1e-4, fsdp_call_s=2e-3, tp_call_s=3e-3)
    return Profile(
        name="cpu",
        flops={"fp32": 1e10, "bf16": 1e10, "fp64": 5e9},
        memory_bytes=2**34,
        memory_bw=1e10,
        intra={2: link, 4: link},
        cores=cores,
        op_s=1e-5,
        byte_s=1e-10,
        fsdp_step_s=0.02,
        tp_step_s=0.03,
    )


H100 = BUILTIN["h100"]
LAYOUTS = {
    "dp": ({"dp_replicate": 2}, 2, _cpu(2)),
    "dp_shard": ({"dp_shard": 2, "activation_checkpointing": "full"}, 2, _cpu(2)),
    "tp": ({"tp": 2}, 2, _cpu(2)),
    "pp": ({"pp": 2}, 2, _cpu(2)),
    "pp x dp_shard, ranks taking turns": ({"pp": 2, "dp_shard": 2}, 4, _cpu(2)),
    "dp_shard, a GPU's overlap": ({"dp_shard": 2}, 2, H100),
    "pp x tp, a GPU's bubble": ({"pp": 2, "tp": 2}, 4, H100),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_terms_add_up_to_the_predicted_step(name):
    """Every term the step pays is a part of `Terms.parts()`: dispatch, bytes and the
    recomputed forward, each collective, the sharded cost per step, the overlap, the bubble
    (hidden in the turns where ranks outnumber cores) and the optimizer."""
    parallel, world, profile = LAYOUTS[name]
    config = validate_config({**GPT, "parallel": parallel})
    pred = predict_configured(config, world_size=world, profile=profile)
    terms = pred.terms
    assert "configured" in pred.notes and terms.collectives
    total = math.fsum(seconds for _, seconds, _ in terms.parts())
    assert total == pytest.approx(pred.step_time_s, rel=1e-12)
    assert pred.step_time_s == terms.step_s
    assert pred.as_json()["terms"]["parts"] == {n: s for n, s, _ in terms.parts()}
    parts = {part: seconds for part, seconds, _ in terms.parts()}
    if "overlap" in name:
        assert parts["overlap"] < 0  # FSDP's collectives hide behind compute
    if "GPU's bubble" in name:
        assert parts["bubble"] == pytest.approx(terms.bubble * terms.busy_s, rel=1e-12)
    if "turns" in name:
        assert terms.turns == 2 and parts["sharded per step"] > 0


def _plan(tmp_path, *args):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(config_toml())  # the tiny MLP: few layouts, planned in seconds
    return cli_main(["plan", str(cfg), "--world", "2", "--hardware", "h100", *args])


def _why(tmp_path, capsys, row: str) -> tuple[str, dict[str, float]]:
    """`plan --why ROW`'s first line and each term's milliseconds, by name."""
    assert _plan(tmp_path, "--why", row) == 0
    _, head, *lines = capsys.readouterr().out.splitlines()
    values = {}
    for line in lines:
        match = re.match(r"  (\S.*?)\s+(-?[\d.]+) ms", line)
        assert match, line
        values[match[1]] = float(match[2])
    return head, values


def test_plan_why_prints_a_rows_terms_and_their_sum_the_tables_step(tmp_path, capsys):
    """`--why N` prints row N's layout, every term in ms and their sum: the table's step."""
    assert _plan(tmp_path) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line[:3].strip().isdigit()]
    replicated = next(line for line in table if " rep2 " in line)  # a row with a collective
    for row in (table[0], replicated):
        number, layout, step_ms = row.split()[0], row[5:49].strip(), row.rstrip(" *").split()[-2]
        head, values = _why(tmp_path, capsys, number)
        assert head.startswith(f"#{number}  {layout}: ")
        names = {"matmul", "dispatch", "memory", "recompute", "sharded per step", "overlap"}
        assert names | {"bubble", "optimizer"} <= values.keys()
        assert values.pop("= step") == float(step_ms)
        # each printed to 4 figures: their sum within half a unit of the 4th of each
        rounding = 5e-4 * (sum(abs(v) for v in values.values()) + float(step_ms))
        assert abs(sum(values.values()) - float(step_ms)) <= rounding
    assert "all_reduce dp_replicate" in values


def test_plan_why_a_row_the_table_lacks_is_refused_with_the_rows_it_has(tmp_path, capsys):
    """A row out of the table's range is a usage error naming the range, not a traceback."""
    assert _plan(tmp_path, "--why", "99") == 2
    captured = capsys.readouterr()
    rows = re.search(r"--why 99: a row of the table, from 1 to (\d+)", captured.err)
    assert rows and int(rows[1]) < 99, captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert _plan(tmp_path, "--why", "0") == 2
    assert "--why 0: a row of the table, from 1 to" in capsys.readouterr().err
