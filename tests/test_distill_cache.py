"""The teacher-output cache (`scaletrain distill-cache`, distill.cache): a run from the cache
is the online run, a cache that does not fit the run is refused, and a cached run resumes
bit-identically.

- A run from the cache ends with the online run's weights and losses, in float64 within
  1e-9 with dp = 2 and dropout on: for the digits MLP teacher (logits) and for a tiny BERT
  teacher (pooled cosine, hidden states through the projections and attention maps, with
  the student initialised from teacher blocks, so the teacher is loaded for its weights
  only). Dropout shows a teacher load that moves the global RNG: the cached run loads none.
- A top-k cache (distill.top_k = 3 of 10 classes) trains, and is another loss than the
  full-logit one.
- Refusals through the real launcher, exit status 2 with one line naming the difference:
  another teacher's cache, a cache of other data (the same rows, tokenized to another
  length), a cache lacking an output the run needs, a cache in another teacher dtype.
- checkpoint.every = 5, train.stop_after = 5 and a resume to step 12 (which the launcher's
  `--resume` check accepts) equals the uninterrupted 12 steps exactly (torch.equal, identical records, the
  distillation terms included), for that BERT student from the cache: its hidden-state
  projections and their optimizer state live in the checkpoint, and dropout is on, so the
  RNG state must be restored too; log.every = 2, so the checkpoint holds an open metrics
  window (its loss and terms sums).
- A checkpoint teacher (checkpoints/step-N) is checked against the cache like any teacher.

Speed: every training is one of the session's `trained` runs (harness.run_job: the workers'
own entry, one process group per world size): the MLP teacher (test_distill_parity's, the
same cached run), then, once the caches are written, every dp = 2 run of this file in one
job, the stopped BERT run and its resume as two legs of one case (the workers resume from
the newest checkpoint by themselves, as `--resume` has them; between the legs, on rank 0,
the launcher's resume check). `scaletrain distill-cache` (one process) and `scaletrain
export` run in this process, through cli.main.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_distill_parity import (
    BERT_STUDENT,
    MLP_STUDENT,
    assert_same_run,
    mlp_teacher_run,
    save_bert_teacher,
)

from harness import (
    Case,
    cli_main,
    file_tree,
    forbid_starting,
    load_weights,
    max_abs_diff,
    records,
)

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The BERT runs here: 12 AdamW steps with dropout, a checkpoint every 5 (to resume from), a
# record every 2 steps (so the checkpoint at step 5 holds an open metrics window).
BERT_RUN = [
    "train.steps=12",
    "checkpoint.every=5",
    "optim.name=adamw",
    "optim.lr=3e-3",
    "model.kwargs.hidden_dropout_prob=0.1",
    "log.every=2",
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("distill-cache")


@pytest.fixture(scope="module")
def configs(work: Path) -> dict[str, Path]:
    out = {}
    for name, body in {"mlp": MLP_STUDENT, "bert": BERT_STUDENT}.items():
        out[name] = work / f"{name}.toml"
        out[name].write_text(body)
    return out


@pytest.fixture(scope="module")
def mlp_teacher(trained) -> Path:
    """With checkpoints at steps 20 and 40: a checkpoint is a teacher too."""
    return mlp_teacher_run(trained)


@pytest.fixture(scope="module")
def bert_teacher(work: Path) -> Path:
    return save_bert_teacher(work / "bert-teacher")


def write_cache(config: Path, out_dir: Path, overrides: list[str]) -> Path:
    """`scaletrain distill-cache CONFIG OUT_DIR overrides` in this process (a one-process
    command); what it sets for its own process (threads, OMP_NUM_THREADS, the torch seed)
    is put back after."""
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    out, err = io.StringIO(), io.StringIO()
    try:
        with torch.random.fork_rng(), contextlib.redirect_stdout(out):
            with contextlib.redirect_stderr(err):
                code = cli_main(["distill-cache", str(config), str(out_dir), *overrides])
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    assert code == 0, (out.getvalue() + err.getvalue())[-3000:]
    assert (out_dir / "cache.json").is_file()
    return out_dir


def student(overrides: list[str], *, global_batch: int, dp: int = 2) -> list[str]:
    """A student run's overrides: dp ranks, 2 micro-batches each."""
    return [
        f"parallel.dp={dp}",
        f"train.global_batch={global_batch}",
        f"train.micro_batch={global_batch // (2 * dp)}",
        *overrides,
    ]


@pytest.fixture(scope="module")
def mlp_cache(work: Path, configs: dict[str, Path], mlp_teacher: Path) -> Path:
    return write_cache(configs["mlp"], work / "mlp-cache", [f"distill.teacher={mlp_teacher}"])


@pytest.fixture(scope="module")
def top3_cache(work: Path, configs: dict[str, Path], mlp_teacher: Path) -> Path:
    return write_cache(
        configs["mlp"], work / "top3-cache", [f"distill.teacher={mlp_teacher}", "distill.top_k=3"]
    )


@pytest.fixture(scope="module")
def bert_cache(work: Path, configs: dict[str, Path], bert_teacher: Path) -> Path:
    return write_cache(configs["bert"], work / "bert-cache", [f"distill.teacher={bert_teacher}"])


def bert_run_overrides(bert_teacher: Path, bert_cache: Path) -> list[str]:
    """The BERT student from the cache (the teacher is read for init_layers only), 12 steps."""
    return student(
        [f"distill.teacher={bert_teacher}", f"distill.cache={bert_cache}", *BERT_RUN],
        global_batch=16,
    )


def between_stop_and_resume(run_dir: Path) -> None:
    """Between the BERT run's stop and its resume (rank 0, in the job): the stop wrote no
    final weights; the projections (trained away from their identity start) and their Adam
    state are in the checkpoint it resumes from; and the launcher's `--resume` check
    (rundir.check_resumable, on the config without the stop) accepts it, with no warning."""
    from torch.distributed.checkpoint import FileSystemReader

    from scaletrain.config import load_config
    from scaletrain.launch.rundir import check_resumable

    assert not (run_dir / "model.safetensors").exists()
    saved = FileSystemReader(str(run_dir / "checkpoints" / "step-00000005")).read_metadata()
    names = set(saved.state_dict_metadata)
    assert {
        "model.proj.0.weight",
        "model.proj.2.bias",
        "optim.state.proj.1.weight.exp_avg",
    } <= names
    resumed = load_config(run_dir / "config.toml", ["train.stop_after=0"])
    assert check_resumable(run_dir, resumed) == []


@pytest.fixture(scope="module")
def runs(
    trained,
    mlp_teacher: Path,
    mlp_cache: Path,
    top3_cache: Path,
    bert_teacher: Path,
    bert_cache: Path,
) -> dict[str, Path]:
    """Every dp = 2 run of this file, in one job: name -> run directory."""
    bert = bert_run_overrides(bert_teacher, bert_cache)
    cases = {
        "mlp-cached": Case.of(
            MLP_STUDENT,
            *student([f"distill.cache={mlp_cache}", "model.dropout=0.1"], global_batch=32),
        ),
        "mlp-online": Case.of(
            MLP_STUDENT,
            *student([f"distill.teacher={mlp_teacher}", "model.dropout=0.1"], global_batch=32),
        ),
        "top3": Case.of(MLP_STUDENT, *student([f"distill.cache={top3_cache}"], global_batch=32)),
        # 12 uninterrupted steps from the cache.
        "bert-cached": Case.of(BERT_STUDENT, *bert),
        "bert-online": Case.of(
            BERT_STUDENT,
            *student(
                [f"distill.teacher={bert_teacher}", *BERT_RUN, "checkpoint.every=0"],
                global_batch=16,
            ),
        ),
        # Stopped after step 5, then resumed to step 12 on the same run directory.
        "bert-resumed": Case(
            BERT_STUDENT,
            (
                (*bert, "train.stop_after=5"),
                "test_distill_cache:between_stop_and_resume",
                tuple(bert),
            ),
        ),
    }
    return {name: r.run_dir for name, r in trained(cases, world_size=2).items()}


def test_mlp_run_from_the_cache_is_the_online_run(mlp_cache: Path, runs: dict[str, Path]) -> None:
    info = json.loads((mlp_cache / "cache.json").read_text())
    assert info["outputs"] == ["logits"] and info["teacher_dtype"] == "float64"
    assert_same_run(runs["mlp-online"], runs["mlp-cached"])


def test_the_cache_is_streamed_a_row_group_at_a_time(
    mlp_cache: Path, configs: dict[str, Path]
) -> None:
    """The digits cache has more than 4 row groups; read in shuffled batches it holds less
    than 2 of them at any time (issue 19: not the whole cache on every rank), and every
    batch carries exactly its rows' outputs. Red with the whole cache held (a
    cache_row_groups as large as the cache)."""
    import pyarrow.parquet as pq

    from scaletrain.config import load_config
    from scaletrain.distill.cache import with_cache
    from scaletrain.training.assemble import build_data

    ds = build_data(load_config(configs["mlp"], []), split="train")
    cached = with_cache(ds, str(mlp_cache), split="train")
    groups = len(cached.groups)
    assert groups > 4, groups
    assert cached.resident_bytes() == 0  # opening reads footers, no output
    whole = pq.read_table(sorted((mlp_cache / "train").glob("part-*.parquet")))
    logits = torch.tensor(whole.column("logits").to_pylist(), dtype=torch.float64)  # (N, 10)
    group_bytes = int(max(cached.starts[1:] - cached.starts[:-1])) * logits[0].nbytes
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))
    for idx in order[:640].split(32):
        got = cached.get(idx).teacher["logits"]
        assert torch.equal(got, logits[idx])
        assert cached.resident_bytes() < 2 * group_bytes
    assert cached.row_groups_read >= groups


def test_bert_run_from_the_cache_is_the_online_run(bert_cache: Path, runs: dict[str, Path]) -> None:
    info = json.loads((bert_cache / "cache.json").read_text())
    # attention_weight > 0 is cached too: each mapped block's (H, T, T) maps.
    assert info["outputs"] == ["pooled", "hidden.0", "hidden.2", "hidden.4", "attn.2", "attn.4"]
    assert info["splits"]["train"]["shapes"]["attn.2"]["shape"] == [2, 16, 16]
    assert_same_run(runs["bert-online"], runs["bert-cached"], steps=6)


def test_a_top_k_cache_trains_another_loss(top3_cache: Path, runs: dict[str, Path]) -> None:
    shapes = json.loads((top3_cache / "cache.json").read_text())["splits"]["train"]["shapes"]
    assert shapes["logits"]["shape"] == [3] and shapes["logits_index"]["dtype"] == "int64"
    top3 = runs["top3"]
    assert max_abs_diff(load_weights(top3), load_weights(runs["mlp-cached"])) > 1e-6


def _perturbed_copy(teacher: Path, out: Path) -> Path:
    """The teacher run directory with one weight changed by 1e-3: another teacher."""
    out.mkdir()
    for f in ("config.toml", "summary.json"):
        (out / f).write_bytes((teacher / f).read_bytes())
    weights = load_file(str(teacher / "model.safetensors"))
    first = sorted(weights)[0]
    weights[first] = weights[first] + 1e-3
    save_file(weights, str(out / "model.safetensors"))
    return out


def _refused(capsys, config: Path, overrides: list[str], run_dir: Path) -> str:
    """`scaletrain train` in this process (no worker may start: forbid_starting): the launcher
    refuses before anything starts, in one line, and writes nothing."""
    code = cli_main(
        [
            "train",
            str(config),
            "--nproc",
            "2",
            "parallel.dp=2",
            *overrides,
            "--run-dir",
            str(run_dir),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: "), err
    assert not run_dir.exists()
    return lines[0]


def test_a_cache_that_does_not_fit_the_run_is_refused(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    work: Path,
    configs: dict[str, Path],
    mlp_teacher: Path,
    mlp_cache: Path,
    bert_teacher: Path,
    bert_cache: Path,
) -> None:
    before = file_tree(work / "mlp-cache"), file_tree(work / "bert-cache")
    forbid_starting(monkeypatch, tmp_path)
    capsys.readouterr()  # what the fixtures printed
    other = _perturbed_copy(mlp_teacher, work / "other-teacher")
    line = _refused(
        capsys,
        configs["mlp"],
        [f"distill.teacher={other}", f"distill.cache={mlp_cache}"],
        work / "refused-teacher",
    )
    assert "another teacher" in line
    # A checkpoint teacher is hashed too (its weights exported): step 20 is not the final
    # weights the cache was written from.
    step20 = mlp_teacher / "checkpoints" / "step-00000020"
    line = _refused(
        capsys,
        configs["mlp"],
        [f"distill.teacher={step20}", f"distill.cache={mlp_cache}"],
        work / "refused-checkpoint",
    )
    assert "another teacher" in line and "distill.teacher gives" in line
    line = _refused(
        capsys,
        configs["mlp"],
        [f"distill.cache={mlp_cache}", "distill.teacher_precision=fp32"],
        work / "refused-dtype",
    )
    assert "float64" in line and "float32" in line
    bert = [f"distill.teacher={bert_teacher}", f"distill.cache={bert_cache}"]
    # The same words, tokenized to 12 tokens instead of 16: as many rows, other data.
    line = _refused(capsys, configs["bert"], [*bert, "data.seq_len=12"], work / "refused-data")
    assert "other train data" in line
    # Teacher state 1 (and block 1's attention) were not cached: layer map [0, 1, 4].
    line = _refused(
        capsys, configs["bert"], [*bert, "distill.layer_map=[0, 1, 4]"], work / "refused-output"
    )
    assert "lacks the teacher outputs" in line and "hidden.1" in line
    assert (file_tree(work / "mlp-cache"), file_tree(work / "bert-cache")) == before


# Every number a step record holds that a resume must reproduce (not times or memory),
# the distillation terms included.
SAME_IN_RECORDS = (
    "loss",
    "lr",
    "grad_norm",
    "examples",
    "tokens",
    "examples_seen",
    "tokens_seen",
    "distill/hidden",
    "distill/attention",
    "distill/cosine",
)


def test_a_cached_bert_run_resumes_bit_identically(
    capsys: pytest.CaptureFixture[str], work: Path, runs: dict[str, Path]
) -> None:
    # The stop and the checks between the legs (between_stop_and_resume) passed in the job.
    bert_cached_run, resumed = runs["bert-cached"], runs["bert-resumed"]
    a, b = load_weights(bert_cached_run), load_weights(resumed)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed run differs in {different}"
    # `scaletrain export` of a checkpoint writes the student's names, as model.safetensors.
    exported = work / "step-10.safetensors"
    capsys.readouterr()
    code = cli_main(["export", str(resumed / "checkpoints" / "step-00000010"), str(exported)])
    assert code == 0, capsys.readouterr().err[-3000:]
    assert sorted(load_file(str(exported))) == sorted(b)
    ref = {r["step"]: r for r in records(bert_cached_run)}
    got = {r["step"]: r for r in records(resumed)}  # a re-run step: its last record
    assert sorted(ref) == sorted(got) == list(range(2, 13, 2))
    # Step 6's record covers steps 5 and 6: step 5's loss and terms came from the checkpoint.
    for step in (6, 8, 10, 12):
        for key in SAME_IN_RECORDS:
            assert got[step].get(key) == ref[step].get(key), (step, key)


def test_a_bf16_teacher_is_cached_as_its_bits(tmp_path: Path) -> None:
    """A bf16 teacher's outputs are stored as bf16 (its 16 bits, half float32's bytes) and read
    back as the same bf16 values: lossless, and the dtype the cache records."""
    from scaletrain.data.sentences import TokenDataset
    from scaletrain.distill.cache import CachedDataset, write_cache

    ids = torch.arange(40).reshape(10, 4)  # (N, T)
    ds = TokenDataset(ids, torch.ones_like(ids), vocab_size=64)
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(10, 4, 6, generator=gen).bfloat16()  # (N, T, D), a teacher's states

    def targets(batch) -> dict[str, torch.Tensor]:
        return {"hidden.1": values[batch.inputs[:, 0] // 4]}

    info = write_cache(
        tmp_path, splits={"train": ds}, targets_fn=targets, info={}, top_k=0, report=str
    )
    assert info["splits"]["train"]["shapes"]["hidden.1"] == {"shape": [4, 6], "dtype": "bfloat16"}
    import pyarrow.parquet as pq

    stored = pq.read_table(next((tmp_path / "train").glob("*.parquet")))
    assert str(stored.schema.field("hidden.1").type.value_type) == "int16"  # 2 bytes a value
    cached = CachedDataset(ds, tmp_path, split="train", shapes=info["splits"]["train"]["shapes"])
    got = cached.get(torch.tensor([7, 2, 9])).teacher["hidden.1"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, values[[7, 2, 9]])


def test_wide_rows_get_a_row_group_each_and_files_open_once(tmp_path: Path, monkeypatch) -> None:
    """A batch draws rows at random, and a read decodes a whole row group: rows as wide as the
    MiniLM recipe's (four 64 x 384 bf16 states, ~200 KB) are written one per row group, narrow
    ones (logits) CHUNK per group; a file's footer is parsed once, not for every row read."""
    import pyarrow as pa

    from scaletrain.data.sentences import TokenDataset
    from scaletrain.distill import cache as cache_mod

    def table(row_bytes: int) -> pa.Table:
        return pa.table({"x": pa.array([b"\0" * row_bytes] * 8)})

    assert cache_mod._group_rows(table(4 * 64 * 384 * 2)) == 1
    assert cache_mod._group_rows(table(40)) == cache_mod.CHUNK
    ids = torch.arange(600).reshape(300, 2)  # (N, T)
    ds = TokenDataset(ids, torch.ones_like(ids), vocab_size=1000)
    monkeypatch.setattr(cache_mod, "ROWS_PER_FILE", 100)  # a file per chunk: 2 files
    info = cache_mod.write_cache(
        tmp_path,
        splits={"train": ds},
        targets_fn=lambda b: {"pooled": b.inputs.double()},
        info={},
        top_k=0,
        report=str,
    )
    opened = []
    real = cache_mod.pq.ParquetFile
    monkeypatch.setattr(
        cache_mod.pq, "ParquetFile", lambda path, **kw: opened.append(path) or real(path, **kw)
    )
    cached = cache_mod.CachedDataset(
        ds, tmp_path, split="train", shapes=info["splits"]["train"]["shapes"]
    )
    opened.clear()  # the footers read at open
    order = torch.randperm(300, generator=torch.Generator().manual_seed(0))
    for idx in order.split(10):
        assert torch.equal(cached.get(idx).teacher["pooled"], ids[idx].double())
    assert len(cached.files) == 2 and len(opened) == len(set(opened)) == 2


def test_the_minilm_recipes_share_one_cache() -> None:
    """The README's claim: the cache written for configs/distill-minilm-3.toml serves
    configs/distill-minilm.toml. Same data (every key that decides the rows: the data
    section, the seed that seeds the augmentation) and teacher, and the 2-layer recipe's
    outputs a subset of the 3-layer's, so check_cache accepts it (it refuses only a
    missing output)."""
    from scaletrain.config import load_config
    from scaletrain.distill.build import weights_of
    from scaletrain.distill.objective import needs_of

    root = Path(__file__).parents[1] / "configs"
    three, two = (
        load_config(root / name, []) for name in ("distill-minilm-3.toml", "distill-minilm.toml")
    )
    assert three.data == two.data and three.train.seed == two.train.seed
    assert three.distill.teacher == two.distill.teacher
    assert (
        three.precision == two.precision
        and three.distill.teacher_precision == two.distill.teacher_precision
    )
    keys = {
        name: needs_of(
            weights_of(c), task_kind="encode", layer_map=list(c.distill.layer_map)
        ).keys()
        for name, c in (("three", three), ("two", two))
    }
    assert keys["three"] == ["pooled", "hidden.0", "hidden.1", "hidden.5", "hidden.6"]
    assert set(keys["two"]) < set(keys["three"])
