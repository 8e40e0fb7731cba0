"""[distill] mistakes from the command line: each is refused before any worker starts.

The contract of tests/test_cli_errors.py: `scaletrain train ...` (or `distill-cache`) exits
2 with one `scaletrain: error: ...` line on stderr naming the key, no traceback, and writes
nothing. `scaletrain.cli.main` runs in-process with the launcher and the worker replaced by
functions that fail the test (harness.forbid_starting). Refusals that need the built data or
teacher (a cache for other data, a teacher whose weights have another SHA-256) happen in the
launcher's `check_user_code`, which runs for multi-process jobs: those rows use --nproc 2.

A module fixture writes what the rows refer to: a teacher run directory (config.toml +
model.safetensors of a tiny MLP, as `scaletrain train` leaves them) and two real caches
written with `scaletrain distill-cache`: two over digits (all logits, and the top 3), one over
64 synthetic images.
"""

from __future__ import annotations

import io
import os
import shlex
import sys
from pathlib import Path

import pytest
import torch

import scaletrain.cli
import scaletrain.commands.train

from harness import cli_main, file_tree, forbid_starting, refuse_start

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# A valid, tiny job: 2 steps of 8 digits, data parallel over the processes.
GOOD_TOML = """\
name = "distill-config-test"

[model]
name = "mlp"
size = "tiny"

[data]
source = "digits"

[train]
steps = 2
global_batch = 8
micro_batch = 4
"""

SYNTHETIC_TOML = GOOD_TOML.replace(
    'source = "digits"', 'source = "synthetic-images"\nsynthetic_examples = 64'
)
SENTENCES_TOML = GOOD_TOML.replace('source = "digits"', 'source = "sentences"')
# A BERT student on sentences: the relation and contrastive terms' own case.
BERT_SENTENCES_TOML = SENTENCES_TOML.replace(
    'name = "mlp"\nsize = "tiny"',
    'name = "hf"\nhf_config = "BertConfig"\nkwargs = { hidden_size = 32, '
    "num_hidden_layers = 2, num_attention_heads = 2, intermediate_size = 37 }",
)
# A cache written for the hidden-state and pooled-cosine terms (cache.json alone: the
# launcher reads it before any Parquet file).
POOLED_CACHE_JSON = (
    '{"teacher_sha256": "' + "ab" * 32 + '", "teacher_dtype": "float32", '
    '"outputs": ["pooled", "hidden.0"], "splits": {}}'
)


def _write_teacher(run: Path, *, source: str, seed: int, input_shape: tuple[int, ...]) -> Path:
    """A finished run's directory, by hand: its config.toml and its model.safetensors."""
    from safetensors.torch import save_file

    from scaletrain.config import Config, config_to_toml
    from scaletrain.data.sources import TaskSpec
    from scaletrain.models import build_model

    config = Config.model_validate(
        {"model": {"name": "mlp", "size": "tiny"}, "data": {"source": source}}
    )
    model = build_model(
        "mlp", size="tiny", task=TaskSpec("classification", input_shape, 10), seed=seed
    )
    run.mkdir(parents=True)
    (run / "config.toml").write_text(config_to_toml(config))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(run / "model.safetensors")
    )
    return run


def _distill_cache(toml: str, out: Path, teacher: Path, work: Path, *overrides: str) -> None:
    """`scaletrain distill-cache CONFIG OUT teacher=...`, in this process (it starts no worker)."""
    cfg = work / f"{out.name}.toml"
    cfg.write_text(toml)
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    try:
        code = cli_main(
            ["distill-cache", str(cfg), str(out), f"distill.teacher={teacher}", *overrides]
        )
    finally:  # distill-cache takes every core for its one process; give the rest back
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    assert code == 0 and (out / "cache.json").is_file(), f"distill-cache failed ({code})"


@pytest.fixture(scope="module")
def kd(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    """Teachers and caches the rows name as {teacher}, {teacher2}, {cache}, {cache_top_k}, ..."""
    from scaletrain.distill.teacher import weights_sha256

    root = tmp_path_factory.mktemp("kd")
    paths = {
        "teacher": _write_teacher(root / "teacher", source="digits", seed=1, input_shape=(1, 8, 8)),
        "teacher2": _write_teacher(
            root / "teacher2", source="digits", seed=2, input_shape=(1, 8, 8)
        ),
        "teacher_synthetic": _write_teacher(
            root / "teacher-synthetic", source="synthetic-images", seed=1, input_shape=(1, 28, 28)
        ),
    }
    paths["teacher_sha16"] = weights_sha256([paths["teacher"] / "model.safetensors"])[:16]
    paths["cache"] = root / "cache"
    _distill_cache(GOOD_TOML, paths["cache"], paths["teacher"], root)
    paths["cache_top_k"] = root / "cache-top-k"
    _distill_cache(GOOD_TOML, paths["cache_top_k"], paths["teacher"], root, "distill.top_k=3")
    paths["cache_synthetic"] = root / "cache-synthetic"
    _distill_cache(SYNTHETIC_TOML, paths["cache_synthetic"], paths["teacher_synthetic"], root)
    return paths


def case(
    id: str, argv: str, *expect: str, toml: str = GOOD_TOML, files: dict[str, str] | None = None
):
    """One refusal: `argv` ({cfg}, {tmp} and the fixture's names are filled in), the
    substrings its one message line must hold, the config body, files to create first."""
    return pytest.param(argv, expect, toml, files or {}, id=id)


SHA_ZERO = "0" * 64

CASES = [
    # [distill] keys do nothing without a teacher or a cache
    case(
        "distill-key-without-teacher",
        "train {cfg} distill.temperature=4.0",
        "distill.temperature = 4.0",
        "distill.teacher",
        "distill.cache",
    ),
    case(
        "distill-section-without-teacher",
        "train {cfg}",
        "distill.alpha = 0.9",
        "distill.teacher",
        toml=GOOD_TOML + "\n[distill]\nalpha = 0.9\n",
    ),
    case("top-k-without-teacher", "train {cfg} distill.top_k=3", "distill.top_k = 3"),
    case(
        "sentences-without-teacher",
        "train {cfg}",
        "data.source = 'sentences'",
        "distill.teacher",
        toml=SENTENCES_TOML,
    ),
    # sentences: an encoder has no logits, so alpha (the defaults) alone gives a zero loss
    case(
        "sentences-with-the-default-weights",
        "train {cfg} distill.teacher=all-MiniLM-L6-v2",
        "distill.hidden_weight = 0.0",
        "distill.cosine_weight = 0.0",
        "no gradient",
        toml=SENTENCES_TOML,
    ),
    case(
        "sentences-cosine-on-logits",
        "train {cfg} distill.teacher=all-MiniLM-L6-v2 "
        "distill.cosine_weight=1.0 distill.cosine_on=logits",
        "distill.cosine_on = 'logits'",
        "distill.cosine_on = 'pooled'",
        toml=SENTENCES_TOML,
    ),
    case(
        "sentences-tokenizer-not-a-directory",
        "train {cfg} distill.teacher=all-MiniLM-L6-v2 "
        "distill.cosine_weight=1.0 data.kwargs.tokenizer={tmp}/nowhere",
        "data.kwargs.tokenizer = '{tmp}/nowhere'",
        "not a tokenizer directory",
        toml=SENTENCES_TOML,
    ),
    # the teacher itself
    case(
        "teacher-missing",
        "train {cfg} distill.teacher={tmp}/nowhere",
        "distill.teacher = '{tmp}/nowhere'",
        "no such directory",
    ),
    case(
        "teacher-not-a-teacher",
        "train {cfg} distill.teacher={tmp}/notes",
        "distill.teacher = '{tmp}/notes'",
        "is not a teacher",
        "config.toml",
        files={"notes/readme.txt": "not a model"},
    ),
    case(
        "teacher-sha256-not-hex",
        "train {cfg} distill.teacher={teacher} distill.teacher_sha256=abc123",
        "distill.teacher_sha256 = 'abc123'",
        "64 hexadecimal digits",
    ),
    case(
        "teacher-sha256-bad-digit",
        f"train {{cfg}} distill.teacher={{teacher}} distill.teacher_sha256={'g' * 64}",
        "distill.teacher_sha256 = 'ggg",
        "64 hexadecimal digits",
    ),
    case(
        "teacher-sha256-mismatch",
        f"train {{cfg}} --nproc 2 distill.teacher={{teacher}} distill.teacher_sha256={SHA_ZERO}",
        "distill.teacher = '{teacher}'",
        "{teacher_sha16}",
        "0000000000000000",
        "refusing",
    ),
    case(
        "packaged-teacher-sha256-mismatch",
        "train {cfg} --nproc 2 "
        f"distill.teacher=all-MiniLM-L6-v2 distill.teacher_sha256={SHA_ZERO}",
        "distill.teacher = 'all-MiniLM-L6-v2'",
        "53aa51172d142c89",
        "0000000000000000",
        "refusing",
    ),
    # layouts distillation does not run under
    case(
        "tp-with-teacher",
        "train {cfg} --nproc 2 parallel.tp=2 distill.teacher={teacher}",
        "parallel.tp = 2",
        "distillation",
        "dp",
    ),
    case(
        "pp-with-teacher",
        "train {cfg} --nproc 2 parallel.pp=2 distill.teacher={teacher}",
        "parallel.pp = 2",
        "distillation",
    ),
    case(
        "ps-with-teacher",
        "train {cfg} --nproc 3 parallel.strategy=ps parallel.dp=2 distill.teacher={teacher}",
        "parallel.strategy = 'collective'",
        "parameter-server",
    ),
    # what a logits-only student cannot be compared on
    case(
        "cosine-pooled-with-builtin-model",
        "train {cfg} distill.teacher={teacher} distill.cosine_weight=1.0",
        "distill.cosine_on = 'pooled'",
        "model.name = 'mlp'",
        "distill.cosine_on = 'logits'",
    ),
    case(
        "cosine-logits-with-top-k-cache",
        "train {cfg} --nproc 2 distill.cache={cache_top_k} "
        "distill.cosine_weight=1.0 distill.cosine_on=logits",
        "distill.cosine_on = 'logits'",
        "distill.top_k",
    ),
    # hidden states and attention maps need a Hugging Face student
    case(
        "hidden-weight-with-builtin-model",
        "train {cfg} distill.teacher={teacher} distill.hidden_weight=1.0",
        "distill.hidden_weight",
        "model.name = 'mlp'",
    ),
    case(
        "attention-weight-with-builtin-model",
        "train {cfg} distill.teacher={teacher} distill.attention_weight=0.5",
        "attention_weight",
        "model.name = 'mlp'",
    ),
    # MiniLM's relations and the contrastive term: a Hugging Face encoder on sentences
    case(
        "relation-weight-with-builtin-model",
        "train {cfg} distill.teacher={teacher} distill.relation_weight=1.0",
        "distill.relation_weight = 1.0",
        "model.name = 'mlp'",
        "model.name = 'hf'",
    ),
    case(
        "contrastive-weight-with-builtin-model",
        "train {cfg} distill.teacher={teacher} distill.contrastive_weight=0.5",
        "distill.contrastive_weight = 0.5",
        "model.name = 'mlp'",
    ),
    case(
        "relation-weight-on-text-data",
        "train {cfg} distill.teacher=all-MiniLM-L6-v2 distill.relation_weight=1.0 "
        "distill.cosine_weight=1.0 data.source=synthetic-text",
        "distill.relation_weight = 1.0",
        "data.source = 'synthetic-text'",
        "'sentences'",
        toml=BERT_SENTENCES_TOML,
    ),
    case(
        "relation-weight-with-an-mlp-teacher",
        "train {cfg} distill.teacher={teacher} distill.relation_weight=1.0 "
        "distill.cosine_weight=1.0",
        "distill.relation_weight = 1.0",
        "distill.teacher = '{teacher}'",
        "model.name = 'mlp'",
        "Hugging Face encoder",
        toml=BERT_SENTENCES_TOML,
    ),
    case(
        "relation-weight-alone",
        "train {cfg} distill.teacher=all-MiniLM-L6-v2 distill.relation_weight=1.0",
        "distill.relation_weight = 1.0",
        "no gradient",
        "distill.cosine_weight = 1.0",
        toml=BERT_SENTENCES_TOML,
    ),
    case(
        "contrastive-weight-with-one-example-per-micro-batch",
        "train {cfg} distill.teacher=all-MiniLM-L6-v2 distill.contrastive_weight=1.0 "
        "train.micro_batch=1",
        "distill.contrastive_weight = 1.0",
        "train.micro_batch = 1",
        "2 or more",
        toml=BERT_SENTENCES_TOML,
    ),
    case(
        "relation-weight-with-a-cache-without-its-outputs",
        "train {cfg} distill.cache={tmp}/cache distill.relation_weight=1.0 "
        "distill.hidden_weight=1.0",
        "distill.relation_weight = 1.0",
        "['query.last', 'key.last', 'value.last']",
        "distill.cache = '{tmp}/cache'",
        "scaletrain distill-cache",
        toml=BERT_SENTENCES_TOML,
        files={"cache/cache.json": POOLED_CACHE_JSON},
    ),
    case(
        "contrastive-temperature-zero",
        "train {cfg} distill.teacher={teacher} distill.contrastive_temperature=0.0",
        "distill.contrastive_temperature = 0.0",
        "greater than 0",
    ),
    case(
        "relation-weight-negative",
        "train {cfg} distill.teacher={teacher} distill.relation_weight=-1.0",
        "distill.relation_weight = -1.0",
        "greater than or equal to 0",
    ),
    # the cache
    case(
        "init-layers-with-cache-no-teacher",
        "train {cfg} distill.cache={cache} distill.init_layers=[0]",
        "distill.init_layers = [0]",
        "distill.teacher",
    ),
    case(
        "cache-without-cache-json",
        "train {cfg} distill.cache={tmp}/outputs",
        "distill.cache = '{tmp}/outputs'",
        "no cache.json",
        "scaletrain distill-cache",
        files={"outputs/train/part-00000.parquet": "not parquet"},
    ),
    case(
        "cache-missing",
        "train {cfg} distill.cache={tmp}/nowhere",
        "distill.cache = '{tmp}/nowhere'",
        "no cache.json",
    ),
    case(
        "cache-for-other-data",
        "train {cfg} --nproc 2 distill.cache={cache} data.source=mnist",
        "distill.cache = '{cache}'",
        "other train data",
        "1438 rows",
        "60000 rows",
        "the data changed",
    ),
    case(
        "cache-for-other-seed",
        "train {cfg} --nproc 2 distill.cache={cache_synthetic} train.seed=1",
        "distill.cache = '{cache_synthetic}'",
        "the data changed",
        toml=SYNTHETIC_TOML,
    ),
    case(
        "cache-of-another-teacher",
        "train {cfg} --nproc 2 distill.cache={cache} distill.teacher={teacher2}",
        "distill.cache = '{cache}'",
        "another teacher",
    ),
    # distill.teacher_sha256 is the cache's teacher when only the cache is given
    case(
        "cache-of-another-teacher-sha256",
        f"train {{cfg}} distill.cache={{cache}} distill.teacher_sha256={SHA_ZERO}",
        "distill.cache = '{cache}'",
        "another teacher",
        "distill.teacher_sha256 gives 000000000000",
    ),
    # ... and the teacher's when both are: checked although the cache replaces the teacher
    case(
        "cache-with-a-teacher-of-another-sha256",
        "train {cfg} --nproc 2 distill.cache={cache} "
        f"distill.teacher={{teacher}} distill.teacher_sha256={SHA_ZERO}",
        "distill.teacher = '{teacher}'",
        "{teacher_sha16}",
        "0000000000000000",
        "refusing",
    ),
    case(
        "cache-of-another-teacher-dtype",
        "train {cfg} --nproc 2 distill.cache={cache} distill.teacher_precision=fp64",
        "distill.cache = '{cache}'",
        "float32",
        "float64",
    ),
    # scaletrain distill-cache
    case(
        "distill-cache-into-an-existing-cache",
        "distill-cache {cfg} {cache} distill.teacher={teacher}",
        "'{cache}'",
        "already holds a cache",
    ),
    case(
        "distill-cache-without-teacher",
        "distill-cache {cfg} {tmp}/out",
        "distill-cache",
        "distill.teacher",
    ),
]


def _fill(text: str, *, cfg: Path, tmp: Path, kd: dict[str, Path | str]) -> str:
    for name in sorted(kd, key=len, reverse=True):  # {cache_synthetic} before {cache}
        text = text.replace(f"{{{name}}}", str(kd[name]))
    return text.replace("{cfg}", str(cfg)).replace("{tmp}", str(tmp))


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    message = [line for line in err.splitlines() if line.startswith("scaletrain: error: ")]
    assert len(message) == 1, f"want one 'scaletrain: error:' line, stderr:\n{err}"
    return message[0]


@pytest.mark.parametrize("argv, expect, toml, files", CASES)
def test_distill_mistake_is_refused_before_anything_starts(
    argv: str,
    expect: tuple[str, ...],
    toml: str,
    files: dict[str, str],
    kd: dict[str, Path | str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    forbid_starting(monkeypatch, tmp_path)
    cfg = tmp_path / "config.toml"
    cfg.write_text(toml)
    for rel, body in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(body)
    before, caches = file_tree(tmp_path), file_tree(kd["cache"])
    args = [_fill(a, cfg=cfg, tmp=tmp_path, kd=kd) for a in shlex.split(argv)]
    if args[0] == "train":
        args += ["--run-dir", str(tmp_path / "run")]

    code = cli_main(args)

    err = capsys.readouterr().err
    assert code == 2, f"exit status {code}, stderr:\n{err}"
    message = _one_error_line(err)
    for want in expect:
        want = _fill(want, cfg=cfg, tmp=tmp_path, kd=kd)
        assert want in message, f"{want!r} not in: {message}"
    assert file_tree(tmp_path) == before, "a refused command wrote or changed files"
    assert file_tree(kd["cache"]) == caches, "a refused command changed the cache"


def test_table_ids_are_unique() -> None:
    assert len({p.id for p in CASES}) == len(CASES)


@pytest.mark.parametrize(
    "argv",
    [
        "train {cfg} --nproc 2 distill.teacher={teacher} distill.temperature=4.0",
        "train {cfg} --nproc 2 distill.teacher={teacher} distill.teacher_sha256={sha}",
        "train {cfg} --nproc 2 distill.cache={cache} distill.alpha=1.0",
        "train {cfg} --nproc 2 distill.cache={cache} distill.teacher={teacher}",
    ],
)
def test_good_distill_configs_reach_the_launcher(
    argv: str,
    kd: dict[str, Path | str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The table cannot pass by refusing everything: these pass every check and launch."""
    from scaletrain.distill.teacher import weights_sha256

    launched = []
    monkeypatch.setattr(
        scaletrain.commands.train, "launch", lambda spec, args, **kw: launched.append(spec) or 0
    )
    monkeypatch.setattr(scaletrain.commands.train, "run_worker", refuse_start)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "config.toml"
    cfg.write_text(GOOD_TOML)
    sha = weights_sha256([kd["teacher"] / "model.safetensors"])
    args = [_fill(a, cfg=cfg, tmp=tmp_path, kd=kd).replace("{sha}", sha) for a in shlex.split(argv)]

    code = cli_main([*args, "--run-dir", str(tmp_path / "run")])

    err = capsys.readouterr().err
    assert code == 0 and "scaletrain: error" not in err, err
    assert len(launched) == 1


def test_the_cache_holds_what_distill_cache_reported(kd: dict[str, Path | str]) -> None:
    """The fixture's cache is a real one: both splits of digits, the teacher's SHA-256."""
    import json

    from scaletrain.distill.teacher import weights_sha256

    info = json.loads((kd["cache"] / "cache.json").read_text())
    assert info["teacher_sha256"] == weights_sha256([kd["teacher"] / "model.safetensors"])
    assert {s: info["splits"][s]["rows"] for s in ("train", "eval")} == {"train": 1438, "eval": 359}
    assert info["splits"]["train"]["shapes"]["logits"]["shape"] == [10]


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal, quiet", [(True, False), (False, False), (True, True)])
def test_distill_cache_shows_a_progress_bar_on_a_terminal(
    terminal: bool,
    quiet: bool,
    kd: dict[str, Path | str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`scaletrain distill-cache` ran minutes silent: a rows bar on stderr on a terminal; in
    a log (stderr not a tty) or with log.quiet no bar, a line per split and one at the start."""
    err = _Terminal()
    if terminal:
        monkeypatch.setattr(sys, "stderr", err)
    toml = GOOD_TOML + ("\n[log]\nquiet = true\n" if quiet else "")
    _distill_cache(toml, tmp_path / "cache", kd["teacher"], tmp_path)

    out = capsys.readouterr()
    bar = err.getvalue() + out.err
    assert ("1797/1797" in bar) == (terminal and not quiet), bar  # 1438 train + 359 eval rows
    lines = out.out.splitlines()
    assert lines[0].startswith("scaletrain: distill-cache: teacher") and "1797 rows" in lines[0]
    assert [line.split(" rows")[0] for line in lines[1:3]] == [
        "scaletrain: cached 1438 train",
        "scaletrain: cached 359 eval",
    ], lines


def test_packaged_teacher_is_pinned_without_teacher_sha256(
    kd: dict[str, Path | str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With no distill.teacher_sha256 the packaged teacher's published SHA-256 is checked all
    the same: here the pin is changed, as a corrupted or swapped file would change the hash."""
    import scaletrain.distill.teacher as teacher

    forbid_starting(monkeypatch, tmp_path)
    monkeypatch.setattr(teacher, "MINILM_SHA256", "f" * 64)
    cfg = tmp_path / "config.toml"
    cfg.write_text(GOOD_TOML)

    code = cli_main(
        [
            "train",
            str(cfg),
            "--nproc",
            "2",
            "distill.teacher=all-MiniLM-L6-v2",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )

    err = capsys.readouterr().err
    assert code == 2, err
    message = _one_error_line(err)
    assert "53aa51172d142c89" in message and "ffffffffffffffff" in message, message
    assert not (tmp_path / "run").exists()
