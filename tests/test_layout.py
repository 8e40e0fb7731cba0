"""The parallel layout is one validated value (STYLE.md principle 3), and every layout that
cannot work is refused before a worker starts (principle 7).

Three layers, all without a process group:
- `ParallelLayout` alone: -1 inference, the product check, invalid degrees, the row-major
  rank order over ("pp", "dp_replicate", "dp_shard", "tp") checked by hand on 2x2x2 worlds,
  which ranks read which share of the batch and which report the loss, the mesh sizes.
- The config (`load_config` + `resolve`): combinations of [parallel] keys that cannot work,
  each a ConfigError naming the key and the value.
- The command line: `scaletrain train` refuses a layout the world or the model cannot take
  (exit 2, one line, no traceback, no run directory); `scaletrain explain` prints who holds
  what, the pipeline's arithmetic, and infers --nproc from the degrees. Both run
  `scaletrain.cli.main` in this process (as test_cli_errors.py does), with the launcher and
  the worker replaced by functions that fail the test.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

import scaletrain.cli
import scaletrain.commands.train
import scaletrain.launch.agent
from scaletrain.config import ConfigError, load_config
from scaletrain.launch.resolve import resolve
from scaletrain.parallel.layout import MESH_DIMS, LayoutError, ParallelLayout

from harness import cli_main, file_tree, forbid_starting

# GPT tiny: 2 blocks, 2 heads of 32. micro_batch 4 splits into 1, 2 or 4 pipeline chunks.
GPT_TOML = """\
name = "layout-test"
[model]
name = "gpt"
size = "tiny"
[data]
source = "wikitext"
seq_len = 32
[train]
steps = 2
global_batch = 16
micro_batch = 4
[log]
quiet = true
"""


@pytest.fixture
def gpt_toml(tmp_path: Path) -> Path:
    path = tmp_path / "gpt.toml"
    path.write_text(GPT_TOML)
    return path


# ---------------------------------------------------------------------------- ParallelLayout


@pytest.mark.parametrize(
    "layout, world, expect",
    [
        # dp_replicate's default -1 takes what the other degrees leave over
        (ParallelLayout(), 4, (4, 1, 1, 1)),
        (ParallelLayout(dp_shard=2, pp=2), 8, (2, 2, 1, 2)),
        # ... except next to tp or pp, which DDP does not compose with: dp_shard takes it
        (ParallelLayout(tp=2), 8, (1, 4, 2, 1)),
        (ParallelLayout(pp=2), 4, (1, 2, 1, 2)),
        (ParallelLayout(tp=2), 2, (1, 1, 2, 1)),
        # dp_shard = -1 takes it instead; an unset dp_replicate then means 1 (sharded, not replicated)
        (ParallelLayout(dp_shard=-1), 4, (1, 4, 1, 1)),
        (ParallelLayout(dp_shard=-1, tp=2), 8, (1, 4, 2, 1)),
        (ParallelLayout(dp_replicate=2, dp_shard=-1), 8, (2, 4, 1, 1)),  # HSDP, shard inferred
        (ParallelLayout(dp_replicate=2, dp_shard=2, tp=2), 8, (2, 2, 2, 1)),  # nothing to infer
        (ParallelLayout(), 1, (1, 1, 1, 1)),
    ],
)
def test_resolve_infers_the_minus_one_degree(
    layout: ParallelLayout, world: int, expect: tuple[int, int, int, int]
) -> None:
    got = layout.resolve(world)
    assert (got.dp_replicate, got.dp_shard, got.tp, got.pp) == expect
    assert got.world_size == world
    assert got.dp == got.dp_replicate * got.dp_shard
    assert got.resolve(world) == got  # a resolved layout is a fixed point


def names(message: str, key: str, value: int) -> bool:
    """`message` gives the degree `key` its value: 'pp=2' or 'parallel.pp = 2'."""
    return re.search(rf"(?<![\w.])(parallel\.)?{key} ?= ?{value}(?![\d.])", message) is not None


def says(message: str, expect: tuple) -> None:
    """Each item of `expect` is in `message`: a substring, or a (degree, value) pair."""
    for want in expect:
        found = names(message, *want) if isinstance(want, tuple) else want in message
        assert found, f"{want!r} not in: {message}"


def test_resolve_refuses_degrees_that_do_not_multiply_to_the_world() -> None:
    with pytest.raises(LayoutError) as e:
        ParallelLayout(dp_replicate=1, dp_shard=2, tp=2, pp=2).resolve(4)
    message = str(e.value)
    for key, value in (("pp", 2), ("dp_replicate", 1), ("dp_shard", 2), ("tp", 2)):
        assert names(message, key, value), message
    assert "= 8" in message and "world size 4" in message and "--nproc 8" in message


def test_fsdp_offload_is_refused_on_gpus_with_the_reason(tmp_path: Path) -> None:
    """CPU offload is tested on gloo (test_model_parallel_parity's dp_shard2-offload); on
    NCCL it would need a CPU process group for the offloaded gradients: refused, named."""
    config = tmp_path / "c.toml"
    config.write_text("[parallel]\ndp = 1\ndp_shard = 2\nfsdp_offload = true\n")
    resolve(load_config(config, []), world_size=2, nproc_per_node=2)  # gloo: accepted
    nccl = load_config(config, ["parallel.backend=nccl"])
    with pytest.raises(ConfigError, match="fsdp_offload.*gloo"):
        resolve(nccl, world_size=2, nproc_per_node=2)


def test_resolve_refuses_a_world_the_fixed_degrees_do_not_divide() -> None:
    with pytest.raises(LayoutError) as e:
        ParallelLayout(dp_shard=2, tp=2).resolve(6)  # dp_replicate -1: 6 / 4 is no degree
    message = str(e.value)
    for key, value in (("pp", 1), ("dp_replicate", -1), ("dp_shard", 2), ("tp", 2)):
        assert names(message, key, value), message
    assert "does not divide the world size 6" in message and "multiple of 4" in message


@pytest.mark.parametrize(
    "kwargs, key, value",
    [
        (dict(dp_replicate=0), "dp_replicate", 0),
        (dict(dp_replicate=-2), "dp_replicate", -2),
        (dict(dp_shard=0), "dp_shard", 0),
        (dict(tp=0), "tp", 0),
        (dict(tp=-1), "tp", -1),  # only the data-parallel degrees can be inferred
        (dict(pp=-1), "pp", -1),
    ],
)
def test_resolve_refuses_invalid_degrees(kwargs: dict, key: str, value: int) -> None:
    with pytest.raises(LayoutError, match=re.escape(f"parallel.{key} = {value} is invalid")):
        ParallelLayout(**kwargs).resolve(4)


def test_resolve_refuses_an_empty_world() -> None:
    with pytest.raises(LayoutError, match="world size must be >= 1, got 0"):
        ParallelLayout().resolve(0)


def test_layout_is_a_frozen_value() -> None:
    layout = ParallelLayout(dp_shard=2).resolve(2)
    with pytest.raises(AttributeError):
        layout.tp = 2  # type: ignore[misc]
    assert layout == ParallelLayout(dp_replicate=1, dp_shard=2)


# rank -> (pp, dp_shard, tp), written out by hand: tp varies fastest, pp slowest.
BY_HAND_PP_SHARD_TP = {
    0: (0, 0, 0),
    1: (0, 0, 1),
    2: (0, 1, 0),
    3: (0, 1, 1),
    4: (1, 0, 0),
    5: (1, 0, 1),
    6: (1, 1, 0),
    7: (1, 1, 1),
}


def test_coords_are_row_major_pp_dp_shard_tp_by_hand() -> None:
    layout = ParallelLayout(pp=2, dp_shard=2, tp=2).resolve(8)
    assert layout.dp_replicate == 1
    for rank, (pp, shard, tp) in BY_HAND_PP_SHARD_TP.items():
        assert layout.coords(rank) == {"pp": pp, "dp_replicate": 0, "dp_shard": shard, "tp": tp}, (
            rank
        )
    assert list(layout.coords(5)) == list(MESH_DIMS) == ["pp", "dp_replicate", "dp_shard", "tp"]
    # The batch share is the dp_shard coordinate: tp and pp peers read the same examples.
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # Loss: tp rank 0 of the last stage, one per data-parallel share.
    assert [r for r in range(8) if layout.reports_loss(r)] == [4, 6]


def test_coords_of_hsdp_times_tp_by_hand() -> None:
    layout = ParallelLayout(dp_replicate=2, dp_shard=2, tp=2).resolve(8)
    by_hand = {  # rank -> (dp_replicate, dp_shard, tp)
        0: (0, 0, 0),
        1: (0, 0, 1),
        2: (0, 1, 0),
        3: (0, 1, 1),
        4: (1, 0, 0),
        5: (1, 0, 1),
        6: (1, 1, 0),
        7: (1, 1, 1),
    }
    for rank, (rep, shard, tp) in by_hand.items():
        assert layout.coords(rank) == {"pp": 0, "dp_replicate": rep, "dp_shard": shard, "tp": tp}, (
            rank
        )
    # dp_rank = dp_replicate x dp_shard + dp_shard: four shares, each read by a tp pair.
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r for r in range(8) if layout.reports_loss(r)] == [0, 2, 4, 6]  # pp = 1: last stage


def test_coords_enumerate_every_rank_once() -> None:
    for pp, rep, shard, tp in itertools.product((1, 2, 3), repeat=4):
        layout = ParallelLayout(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp)
        world = layout.resolve(pp * rep * shard * tp).world_size
        seen = [tuple(layout.coords(r).values()) for r in range(world)]
        assert seen == list(itertools.product(range(pp), range(rep), range(shard), range(tp)))
        shares = [layout.dp_rank(r) for r in range(world)]
        assert sorted(set(shares)) == list(range(layout.dp))
        assert all(shares.count(s) == pp * tp for s in set(shares))  # pp x tp peers per share


def test_reports_loss_is_tp_rank_0_on_the_last_stage_only() -> None:
    layout = ParallelLayout(pp=2, tp=2).resolve(4)  # ranks: (pp, tp) = 00, 01, 10, 11
    assert [layout.reports_loss(r) for r in range(4)] == [False, False, True, False]
    assert all(ParallelLayout().resolve(3).reports_loss(r) for r in range(3))  # DDP: every rank


def test_sizes_leave_out_size_one_dimensions_outermost_first() -> None:
    assert ParallelLayout().resolve(1).sizes == {}
    assert ParallelLayout().resolve(4).sizes == {"dp_replicate": 4}
    assert ParallelLayout(tp=2, dp_shard=2).resolve(4).sizes == {"dp_shard": 2, "tp": 2}
    sizes = ParallelLayout(tp=2, pp=2, dp_replicate=2, dp_shard=2).resolve(16).sizes
    assert list(sizes.items()) == [("pp", 2), ("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)]


def test_describe() -> None:
    assert ParallelLayout().resolve(1).describe() == "1 process"
    assert ParallelLayout().resolve(2).describe() == "dp_replicate=2 (2 ranks)"
    assert ParallelLayout(pp=2, dp_shard=2).resolve(4).describe() == "pp=2 x dp_shard=2 (4 ranks)"
    assert (
        ParallelLayout(dp_shard=2, tp=2, pp=2).resolve(8).describe()
        == "pp=2 x dp_shard=2 x tp=2 (8 ranks)"
    )


def test_one_process_builds_no_mesh() -> None:
    assert ParallelLayout().resolve(1).build_mesh("cpu") is None  # nothing to communicate


class _NamedMesh:
    """Stands in for a DeviceMesh: mesh[name].get_group() gives the name it was asked for,
    and mesh[names]._flatten(name).get_group() the flattened one's."""

    def __getitem__(self, name: str | tuple[str, ...]):
        return type(
            "Sub", (), {"get_group": lambda _self: name, "_flatten": lambda _self, n: self[n]}
        )()


@pytest.mark.parametrize(
    "layout, world, group",
    [
        (ParallelLayout(), 2, "dp_replicate"),  # DDP: the whole world
        (ParallelLayout(dp_shard=2), 2, "dp_shard"),
        (ParallelLayout(dp_shard=2, tp=2), 4, "dp_shard"),  # not the world: tp peers share data
        (ParallelLayout(dp_shard=2, pp=2), 4, "dp_shard"),
        (ParallelLayout(dp_replicate=2, dp_shard=2, tp=2), 8, "dp"),  # HSDP: the flattened pair
        (ParallelLayout(tp=2), 2, None),  # one data-parallel share: nothing to sum over
        (ParallelLayout(pp=2, tp=2), 4, None),
    ],
)
def test_dp_group_is_the_data_parallel_ranks_only(
    layout: ParallelLayout, world: int, group: str | None
) -> None:
    assert layout.resolve(world).dp_group(_NamedMesh()) == group
    assert ParallelLayout().resolve(1).dp_group(None) is None


@pytest.mark.parametrize("rank", [0, 5])
def test_hsdp_dp_group_is_the_flattened_pair_of_a_real_mesh_and_warns_nothing(rank: int) -> None:
    """On a real DeviceMesh (a fake world of 8: dp_replicate 2 x dp_shard 2 x tp 2), HSDP's
    data-parallel group is the 4 ranks of this rank's tp index, taken from the "dp" that
    build_mesh flattened without slicing it from the root (which torch warns is
    deprecated: each rank printed it, and calibrate's terminal showed it)."""
    import warnings

    import torch.distributed as dist

    from scaletrain.planner.trace import fake_world

    layout = ParallelLayout(dp_replicate=2, dp_shard=2, tp=2).resolve(8)
    with fake_world(8, rank):
        mesh = layout.build_mesh("cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            group = layout.dp_group(mesh)
        ranks = dist.get_process_group_ranks(group)
    assert ranks == [r for r in range(8) if r % 2 == rank % 2]


# ---------------------------------------------------------------------------- config refusals


def _resolve(path: Path, overrides: list[str], world: int):
    return resolve(load_config(path, overrides), world_size=world)


@pytest.mark.parametrize(
    "overrides, world, expect",
    [
        pytest.param(
            ["parallel.dp=2", "parallel.dp_replicate=4"],
            4,
            ("parallel.dp = 2", "parallel.dp_replicate = 4", "disagree"),
            id="dp-vs-dp_replicate",
        ),
        pytest.param(
            ["parallel.dp_replicate=2", "parallel.tp=2"],
            4,
            (("dp_replicate", 2), ("tp", 2), "DDP", ("dp_shard", 2)),
            id="ddp-with-tp",
        ),
        pytest.param(
            ["parallel.dp=2", "parallel.pp=2"],
            4,
            (("dp_replicate", 2), ("pp", 2), "DDP"),
            id="ddp-with-pp",
        ),
        pytest.param(
            ["parallel.dp_shard=2", "parallel.comm_hook=fp16"],
            2,
            ("parallel.comm_hook = 'fp16'", ("dp_shard", 2)),
            id="comm-hook-with-fsdp",
        ),
        pytest.param(
            ["parallel.dp_shard=2", "train.compile=true"],
            2,
            ("train.compile = true", ("dp_shard", 2), "train.compile=false"),
            id="compile-with-fsdp",
        ),
        pytest.param(
            ["parallel.tp=2", "train.compile=true"],
            2,
            ("train.compile = true", ("tp", 2)),
            id="compile-with-tp",
        ),
        pytest.param(
            ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=3"],
            2,
            ("train.micro_batch = 4", "parallel.pp_microbatches = 3", "divisible"),
            id="micro-batch-not-divisible-by-chunks",
        ),
        pytest.param(
            ["parallel.pp=2", "parallel.pp_stages_per_rank=2"],
            2,
            (
                "parallel.pp_schedule = '1f1b'",
                "parallel.pp_stages_per_rank = 2",
                "one stage per rank",
            ),
            id="1f1b-two-stages-per-rank",
        ),
        pytest.param(
            ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.pp_stages_per_rank=2"],
            2,
            ("'gpipe'", "parallel.pp_stages_per_rank = 2", "one stage per rank"),
            id="gpipe-two-stages-per-rank",
        ),
        pytest.param(
            [
                "parallel.pp=2",
                "parallel.pp_schedule=interleaved-1f1b",
                "parallel.pp_stages_per_rank=1",
                "model.size=small",
            ],
            2,
            ("'interleaved-1f1b'", "parallel.pp_stages_per_rank = 1", ">= 2"),
            id="interleaved-one-stage-per-rank",
        ),
        pytest.param(
            ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b"],
            2,
            ("parallel.pp = 2", "parallel.pp_stages_per_rank = 2", "4 stages", "2 blocks"),
            id="interleaved-more-stages-than-blocks",
        ),
        pytest.param(
            ["parallel.pp=4"], 4, ("parallel.pp = 4", "4 stages", "2 blocks"), id="pp-above-blocks"
        ),
        pytest.param(
            ["parallel.pp=2", "parallel.pp_microbatches=1"],
            2,
            (
                "parallel.pp_microbatches = 1",
                "1f1b needs parallel.pp_microbatches >= parallel.pp = 2",
            ),
            id="1f1b-fewer-chunks-than-stages",
        ),
        pytest.param(
            [
                "parallel.pp=2",
                "parallel.pp_schedule=zero-bubble",
                "model.size=small",
                "train.micro_batch=5",
                "train.global_batch=20",
                "parallel.pp_microbatches=5",
            ],
            2,
            (
                "'zero-bubble'",
                "parallel.pp_microbatches = 5",
                "2 rounds",
                "multiple of that",
                "1, 2, 3, 4, 6, 8",
            ),
            id="zero-bubble-chunks-not-rounds",
        ),
        pytest.param(
            [
                "parallel.pp=2",
                "parallel.pp_schedule=interleaved-1f1b",
                "model.size=small",
                "train.micro_batch=5",
                "train.global_batch=20",
                "parallel.pp_microbatches=5",
            ],
            2,
            ("'interleaved-1f1b'", "parallel.pp_microbatches = 5", "2 rounds"),
            id="interleaved-chunks-not-rounds",
        ),
        pytest.param(
            ["parallel.dp_replicate=1", "parallel.dp_shard=2"],
            4,
            (
                ("dp_replicate", 1),
                ("dp_shard", 2),
                ("pp", 1),
                ("tp", 1),
                "= 2 do not match the world size 4",
            ),
            id="product-vs-world",
        ),
        pytest.param(["parallel.tp=0"], 1, ("parallel.tp = 0",), id="tp-zero"),
        pytest.param(
            ["parallel.dp_shard=-2"], 1, ("parallel.dp_shard = -2",), id="dp-shard-below-minus-one"
        ),
    ],
)
def test_config_refuses_layouts_that_cannot_work(
    gpt_toml: Path, overrides: list[str], world: int, expect: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError) as e:
        _resolve(gpt_toml, overrides, world)
    says(str(e.value), expect)


@pytest.mark.parametrize(
    "overrides, world, layout, chunks",
    [
        (["parallel.dp_shard=2", "parallel.tp=2"], 4, (1, 2, 2, 1), None),
        (
            ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2"],
            8,
            (2, 2, 2, 1),
            None,
        ),
        (["parallel.dp=2"], 2, (2, 1, 1, 1), None),
        (["parallel.dp=2", "parallel.dp_replicate=2"], 2, (2, 1, 1, 1), None),  # agreeing: fine
        (["parallel.pp=2"], 2, (1, 1, 1, 2), 2),  # 1f1b: chunks default to pp
        (["parallel.pp=2", "parallel.dp_shard=2"], 4, (1, 2, 1, 2), 2),
        (
            ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=1"],
            2,
            (1, 1, 1, 2),
            1,
        ),  # gpipe takes any number of chunks
        (
            ["parallel.pp=2", "parallel.pp_schedule=zero-bubble", "parallel.pp_stages_per_rank=1"],
            2,
            (1, 1, 1, 2),
            2,
        ),  # ZB-H1: one stage per rank is allowed
        (
            ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "model.size=small"],
            2,
            (1, 1, 1, 2),
            4,
        ),  # 2 stages per rank by default: chunks default to 4
    ],
)
def test_config_accepts_layouts_that_work(
    gpt_toml: Path,
    overrides: list[str],
    world: int,
    layout: tuple[int, int, int, int],
    chunks: int | None,
) -> None:
    d = _resolve(gpt_toml, overrides, world)
    assert (d.layout.dp_replicate, d.layout.dp_shard, d.layout.tp, d.layout.pp) == layout
    assert (d.pipeline.microbatches if d.pipeline else None) == chunks
    assert d.accumulation * 4 * d.layout.dp == 16  # global 16 = micro 4 x dp x accumulation


# ---------------------------------------------------------------------------- the command line


def _assert_refused(code: int, err: str, expect: tuple) -> None:
    assert code == 2, f"exit {code}:\n{err[-3000:]}"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: "), err
    says(lines[0], expect)


@pytest.mark.parametrize(
    "argv, expect",
    [
        pytest.param(
            ["--nproc", "2", "parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.tp=2"],
            (
                ("pp", 1),
                ("dp_replicate", 1),
                ("dp_shard", 2),
                ("tp", 2),
                "= 4 do not match the world size 2",
                "--nproc 4",
            ),
            id="degrees-vs-nproc",
        ),
        pytest.param(
            ["--nproc", "3", "parallel.dp_shard=2"],
            (("dp_shard", 2), "does not divide the world size 3"),
            id="nproc-not-a-multiple",
        ),
        pytest.param(
            ["--nproc", "4", "parallel.tp=4"],
            ("parallel.tp = 4 does not divide the 2 heads", "model.name = 'gpt'"),
            id="tp-vs-heads",
        ),
        pytest.param(
            ["--nproc", "4", "parallel.pp=4"],
            ("parallel.pp = 4", "4 stages", "the model has 2 blocks"),
            id="pp-vs-blocks",
        ),
        pytest.param(
            ["--nproc", "2", "model.name=mlp", "data.source=digits", "parallel.tp=2"],
            ("model.name = 'mlp' declares no tensor-parallel plan", "tp"),
            id="mlp-has-no-tp-plan",
        ),
        pytest.param(
            ["--nproc", "2", "model.name=cnn", "data.source=digits", "parallel.pp=2"],
            ("model.name = 'cnn' declares no pipeline split",),
            id="cnn-has-no-pp-split",
        ),
        pytest.param(
            ["--nproc", "2", "parallel.pp=2", "parallel.pp_microbatches=1"],
            (
                "parallel.pp_microbatches = 1",
                "1f1b needs parallel.pp_microbatches >= parallel.pp = 2",
            ),
            id="1f1b-chunks-below-pp",
        ),
    ],
)
def test_train_refuses_a_layout_before_launch(
    gpt_toml: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    expect: tuple[str, ...],
) -> None:
    """In this process: no launcher or worker may start (harness.forbid_starting)."""
    forbid_starting(monkeypatch, tmp_path)
    before = file_tree(tmp_path)
    run_dir = tmp_path / "run"
    code = cli_main(["train", str(gpt_toml), *argv, "--run-dir", str(run_dir)])
    _assert_refused(code, capsys.readouterr().err, expect)
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))
    assert file_tree(tmp_path) == before  # cwd too: no default run directory either


# explain runs in this process too: the same main(), no start-up cost.


@pytest.fixture
def explain(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path):
    def refuse(*args, **kwargs):
        pytest.fail("explain started a worker or the launcher")

    monkeypatch.setattr(scaletrain.launch.agent, "launch", refuse)
    monkeypatch.setattr(scaletrain.commands.train, "launch", refuse)
    monkeypatch.setenv("COLUMNS", "240")  # rich would squeeze the tables into 80 columns
    for name in ("WORLD_SIZE", "RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)

    def run(*argv: str) -> str:
        code = scaletrain.cli.main(["explain", *argv])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "scaletrain: error" not in err
        return out

    return run


def _table(out: str, title: str) -> list[list[str]]:
    """The rows (header first) of the rich table whose title contains `title`."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if title in line and "│" not in line)
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith(("└", "╰")):
            break
        if "│" in line or "┃" in line:
            rows.append([c.strip() for c in re.split("[│┃]", line)[1:-1]])
    return rows


def _derived(out: str) -> dict[str, str]:
    return {row[0]: row[1] for row in _table(out, "derived")[1:]}


def test_explain_prints_who_holds_what_under_fsdp_times_tp(explain, gpt_toml: Path) -> None:
    out = explain(str(gpt_toml), "--nproc", "4", "parallel.dp_shard=2", "parallel.tp=2")
    derived = _derived(out)
    assert derived["world size"].startswith("4 ")
    assert derived["parallel layout (mesh)"] == "dp_shard=2 x tp=2 (4 ranks)"
    assert derived["data parallel (dp)"] == "2 = dp_replicate 1 x dp_shard 2"
    assert derived["accumulation steps"] == "2"  # 16 = 4 x dp 2 x 2
    rows = _table(out, "ranks (dp_shard=2 x tp=2 (4 ranks))")
    assert rows[0] == ["rank", "dp_shard", "tp", "batch share", "holds"]
    assert rows[1:] == [
        ["0", "0", "0", "1/2", "FSDP shard 1/2; TP slice 1/2"],
        ["1", "0", "1", "1/2", "FSDP shard 1/2; TP slice 2/2"],
        ["2", "1", "0", "2/2", "FSDP shard 2/2; TP slice 1/2"],
        ["3", "1", "1", "2/2", "FSDP shard 2/2; TP slice 2/2"],
    ]


def test_explain_prints_the_pipeline_arithmetic(explain, gpt_toml: Path) -> None:
    out = explain(str(gpt_toml), "--nproc", "2", "parallel.pp=2")
    derived = _derived(out)
    assert derived["parallel layout (mesh)"] == "pp=2 (2 ranks)"
    assert derived["pipeline"] == "1f1b: 2 stages, 1 per rank"
    # micro-batch 4 -> pp = 2 chunks of 2; dp 1: 16 / 4 = 4 micro-batches per step
    assert (
        derived["pipeline chunks"]
        == "each micro-batch of 4 -> 2 chunks of 2 (x 4 micro-batches per step)"
    )
    assert derived["pipeline bubble (theory)"] == "33.3% of each rank's step idle"  # (2-1)/(2+2-1)
    rows = _table(out, "ranks (pp=2 (2 ranks))")
    assert rows == [
        ["rank", "pp", "batch share", "holds"],
        ["0", "0", "1/1", "stage 0"],
        ["1", "1", "1/1", "stage 1"],
    ]


def test_explain_of_an_interleaved_pipeline(explain, gpt_toml: Path) -> None:
    out = explain(
        str(gpt_toml),
        "--nproc",
        "2",
        "parallel.pp=2",
        "model.size=small",
        "parallel.pp_schedule=interleaved-1f1b",
    )
    derived = _derived(out)
    assert derived["pipeline"] == "interleaved-1f1b: 4 stages, 2 per rank"
    assert derived["pipeline chunks"].startswith("each micro-batch of 4 -> 4 chunks of 1 ")
    assert derived["pipeline bubble (theory)"] == f"{1 / 9:.1%} of each rank's step idle"
    holds = [row[-1] for row in _table(out, "ranks (pp=2 (2 ranks))")[1:]]
    assert holds == ["stage 0, 2", "stage 1, 3"]  # loop placement


@pytest.mark.parametrize(
    "overrides, world",
    [
        (["parallel.tp=2"], 2),
        (["parallel.dp_shard=2", "parallel.tp=2"], 4),
        (["parallel.pp=2", "parallel.dp_shard=2"], 4),
        (["parallel.dp_shard=-1"], 1),  # a -1 counts as 1: the smallest world
        ([], 1),
    ],
)
def test_explain_infers_nproc_from_the_degrees(
    explain, gpt_toml: Path, overrides: list[str], world: int
) -> None:
    derived = _derived(explain(str(gpt_toml), *overrides))
    assert derived["world size"] == f"{world} ({world} process(es) x 1 node(s))"


def test_explain_refuses_what_train_refuses(
    gpt_toml: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """explain runs the launcher's model check too, so it cannot bless a layout train refuses."""
    code = scaletrain.cli.main(["explain", str(gpt_toml), "--nproc", "4", "parallel.tp=4"])
    err = capsys.readouterr().err
    assert code == 2 and "parallel.tp = 4 does not divide the 2 heads" in err
