"""Every user mistake is refused before any worker starts: one line, status 2, no traceback.

The contract (cli.py, STYLE.md principle 7): a bad config, override, launcher flag or path
is printed to stderr as `scaletrain: error: <message>`, the message names the key or flag,
the value given and what is allowed, the exit status is 2, and nothing runs. Each case below
calls `scaletrain.cli.main(argv)` in-process with the launcher and the worker replaced by
functions that fail the test, and checks that the refused command wrote nothing at all.

A case whose message falls short of the contract, or a mistake that src does not catch yet,
is marked `xfail(strict=True)` with the reason: when src is fixed the case passes, strict
turns that into a failure, and the mark is removed.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from harness import cli_main, file_tree, forbid_starting

# A valid, tiny job: one process, 2 micro-batches of 4 per step.
GOOD_TOML = """\
name = "errors-test"

[model]
name = "mlp"

[data]
source = "digits"

[train]
steps = 2
global_batch = 8
micro_batch = 4
"""

RUN = '{"step": 1, "loss": 2.3}\n'  # the body of an existing run's metrics.jsonl


def case(
    id: str,
    argv: str,
    *expect: str | tuple[str, ...],
    toml: str = GOOD_TOML,
    files: dict[str, str] | None = None,
    absent: tuple[str, ...] = (),
    xfail: str | None = None,
):
    """One table row.

    Args:
        id: the test id.
        argv: the command line, split with shlex; `{cfg}` is the written config file and
            `{tmp}` the test's directory.
        expect: substrings the message must contain; a tuple means any one of them.
        toml: the body of `{cfg}`.
        files: paths under `{tmp}` to create first; they must be unchanged afterwards.
        absent: substrings the message must not contain.
        xfail: why src does not meet the contract here yet.
    """
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(argv, expect, toml, files or {}, absent, id=id, marks=marks)


CASES = [
    case(
        "allow-config-change-without-resume",
        "train {cfg} --allow-config-change",
        "--allow-config-change only applies with --resume",
    ),
    case(
        "compile-with-tiny-ddp-buckets",
        "train {cfg} --nproc 2 train.compile=true parallel.bucket_cap_mb=0.5",
        "parallel.bucket_cap_mb = 0.5",
        "at least 1 MiB",
    ),
    # --- unknown keys and sections, from overrides and from the file
    case(
        "override-unknown-key-did-you-mean",
        "train {cfg} train.stpes=3",
        "'train.stpes'",
        "did you mean 'train.steps'",
        "allowed: steps",
    ),
    case(
        "override-unknown-section-did-you-mean",
        "train {cfg} trian.steps=3",
        "'trian'",
        "did you mean 'train'",
        "allowed: name, model",
    ),
    case("override-unknown-section", "explain {cfg} zzz.lr=1", "'zzz'", "allowed: name, model"),
    case(
        "override-unknown-nested-key", "train {cfg} train.sub.x=3", "'train.sub'", "allowed: steps"
    ),
    case(
        "toml-unknown-top-level-key",
        "train {cfg}",
        "'epochs'",
        "top level",
        "allowed: name",
        toml=GOOD_TOML.replace('name = "errors-test"', 'name = "errors-test"\nepochs = 3'),
    ),
    case(
        "toml-unknown-key-in-section",
        "train {cfg}",
        "'optim.learning_rate'",
        "allowed: name, lr",
        toml=GOOD_TOML + "\n[optim]\nlearning_rate = 0.1\n",
    ),
    # --- wrong types
    case("int-given-word", "train {cfg} train.steps=abc", "train.steps", "'abc'", "integer"),
    case("int-given-fraction", "train {cfg} train.steps=1.5", "train.steps", "1.5", "integer"),
    case(
        "toml-int-given-string",
        "train {cfg}",
        "train.global_batch",
        "'lots'",
        "integer",
        toml=GOOD_TOML.replace("global_batch = 8", 'global_batch = "lots"'),
    ),
    case(
        "bool-given-word",
        "train {cfg} parallel.gradient_as_bucket_view=maybe",
        "parallel.gradient_as_bucket_view",
        "'maybe'",
        "boolean",
    ),
    case("str-given-int", "train {cfg} name=3", "name", "3", "string"),
    case("tuple-given-word", "train {cfg} optim.betas=abc", "optim.betas", "'abc'", "tuple"),
    case(
        "tuple-too-long",
        "train {cfg} optim.betas=[0.9,0.95,0.99]",
        "optim.betas",
        "[0.9, 0.95, 0.99]",
        "at most 2 items",
    ),
    case(
        "tuple-too-short",
        "train {cfg} optim.betas=[0.9]",
        "optim.betas = [0.9]",
        ("2 values", "two", "pair"),
    ),
    case("int-given-bool", "train {cfg} train.steps=true", "train.steps", "True", "integer"),
    case("float-given-bool", "train {cfg} optim.lr=true", "optim.lr", "True", "number"),
    # --- values out of range
    case(
        "steps-negative",
        "train {cfg} train.steps=-1",
        "train.steps = -1",
        "greater than or equal to 0",
    ),
    case("lr-negative", "train {cfg} optim.lr=-1", "optim.lr = -1", "greater than 0"),
    case("lr-too-large", "train {cfg} optim.lr=20", "optim.lr = 20", "less than or equal to 10"),
    case(
        "lr-nan",
        "train {cfg} optim.lr=nan",
        "optim.lr = nan",
        "NaN is not allowed",
        "finite number",
    ),
    case(
        "dropout-above-one", "train {cfg} model.dropout=1.5", "model.dropout = 1.5", "less than 1"
    ),
    case(
        "grad-clip-negative",
        "train {cfg} optim.grad_clip=-1",
        "optim.grad_clip = -1",
        "greater than or equal to 0",
    ),
    case(
        "seq-len-too-short",
        "train {cfg} data.seq_len=4",
        "data.seq_len = 4",
        "greater than or equal to 8",
    ),
    case("dp-zero", "train {cfg} parallel.dp=0", "parallel.dp = 0", "-1", ">= 1"),
    case(
        "toml-log-every-zero",
        "train {cfg}",
        "log.every = 0",
        "greater than or equal to 1",
        toml=GOOD_TOML + "\n[log]\nevery = 0\n",
    ),
    case(
        "beta-above-one",
        "train {cfg} optim.betas=[0.9,2]",
        "optim.betas",
        ("less than 1", "< 1", "[0, 1)"),
    ),
    # --- values outside a fixed set
    case(
        "model-name-unknown",
        "train {cfg} model.name=resnet",
        "model.name = 'resnet'",
        "'mlp'",
        "'cnn'",
        "'gpt'",
    ),
    case("model-name-empty", "train {cfg} model.name=", "model.name = ''", "'mlp'"),
    case(
        "data-source-unknown",
        "train {cfg} data.source=imagenet",
        "data.source = 'imagenet'",
        "'mnist'",
        "'synthetic-text'",
    ),
    case(
        "precision-unknown",
        "train {cfg} precision.mode=fp8",
        "precision.mode = 'fp8'",
        "'bf16-mixed'",
        "'fp32'",
    ),
    case(
        "optimizer-unknown",
        "train {cfg} optim.name=lamb",
        "optim.name = 'lamb'",
        "'adamw'",
        "'sgd'",
    ),
    case(
        "backend-unknown",
        "train {cfg} parallel.backend=mpi",
        "parallel.backend = 'mpi'",
        "'gloo'",
        "'nccl'",
    ),
    case(
        "toml-model-size-unknown",
        "train {cfg}",
        "model.size = 'huge'",
        "'tiny'",
        "'base'",
        toml=GOOD_TOML.replace('name = "mlp"', 'name = "mlp"\nsize = "huge"'),
    ),
    case("run-name-with-space", "train {cfg} 'name=a b'", "name", "'a b'", "letters, digits"),
    case(
        "toml-run-name-with-slash",
        "train {cfg}",
        "name",
        "'a/b'",
        "letters, digits",
        toml=GOOD_TOML.replace('"errors-test"', '"a/b"'),
    ),
    # --- combinations that do not fit together
    case(
        "batch-not-divisible",
        "train {cfg} train.global_batch=10",
        "train.global_batch = 10",
        "divisible",
        "train.micro_batch",
        "4 x 1 = 4",
    ),
    case(
        "batch-not-divisible-by-nproc",
        "train {cfg} --nproc 3",
        "train.global_batch = 8",
        "divisible",
        "4 x 3 = 12",
    ),
    case(
        "explain-batch-not-divisible",
        "explain {cfg} train.micro_batch=16",
        "train.global_batch = 8",
        "16 x 1 = 16",
    ),
    case(
        "dp-not-nproc",
        "train {cfg} parallel.dp=2 --nproc 4",
        "parallel.dp = 2",
        "world size 4",
        "--nproc 2",
    ),
    case(
        "toml-dp-not-nproc",
        "train {cfg} --nproc 2",
        "parallel.dp = 4",
        "world size 2",
        toml=GOOD_TOML + "\n[parallel]\ndp = 4\n",
    ),
    case(
        "gpt-with-image-source",
        "train {cfg} model.name=gpt",
        "model.name = 'gpt'",
        "data.source = 'digits'",
        "'wikitext'",
        "'synthetic-text'",
    ),
    case(
        "cnn-with-text-source",
        "train {cfg} model.name=cnn data.source=synthetic-text",
        "model.name = 'cnn'",
        "data.source = 'synthetic-text'",
        "gpt",
    ),
    # --- the shape of overrides and of the file
    case(
        "override-without-equals", "train {cfg} train.steps", "'train.steps'", "section.key=value"
    ),
    case("override-without-key", "train {cfg} =3", "'=3'", "section.key=value"),
    case("override-value-for-section", "train {cfg} train=3", "train", "section", "3"),
    case(
        "override-key-under-value",
        "train {cfg} train.steps.x=3",
        "train.steps.x",
        "train.steps is a value",
    ),
    case(
        "toml-scalar-for-section",
        "train {cfg}",
        "train is a section",
        "5",
        toml='name = "errors-test"\ntrain = 5\n',
    ),
    case(
        "toml-string-for-section",
        "train {cfg}",
        "model is a section",
        "'gpt'",
        toml='model = "gpt"\n',
    ),
    case("config-file-missing", "train {tmp}/missing.toml", "missing.toml", "does not exist"),
    case(
        "config-file-is-a-directory",
        "explain {tmp}",
        "is a directory",
        "TOML file",
        absent=("does not exist",),
    ),
    case(
        "config-invalid-toml",
        "train {cfg}",
        "config.toml",
        "not valid TOML",
        "line 1",
        toml="[train\nsteps = 3\n",
    ),
    case(
        "config-duplicate-key",
        "train {cfg}",
        "config.toml",
        "not valid TOML",
        toml=GOOD_TOML + "steps = 3\n",
    ),
    # --- launcher flags
    case("nproc-zero", "train {cfg} --nproc 0", "--nproc = 0", ">= 1"),
    case("nproc-negative", "train {cfg} --nproc -2", "--nproc = -2", ">= 1"),
    case("nproc-not-int", "train {cfg} --nproc two", "--nproc", "'two'", "int"),
    case("explain-nproc-zero", "explain {cfg} --nproc 0", "--nproc = 0", ">= 1"),
    case("nnodes-zero", "train {cfg} --nnodes 0", "--nnodes = '0'", "N or MIN:MAX", "N >= 1"),
    case(
        "nnodes-zero-with-dp",
        "train {cfg} parallel.dp=2 --nnodes 0",
        "--nnodes = '0'",
        "N or MIN:MAX",
    ),
    case(
        "nnodes-min-above-max", "train {cfg} --nnodes 3:2", "--nnodes = '3:2'", "MIN must be <= MAX"
    ),
    case("nnodes-word", "train {cfg} --nnodes abc", "--nnodes = 'abc'", "N or MIN:MAX"),
    case(
        "nnodes-without-endpoint",
        "train {cfg} --nnodes 2",
        "--nnodes = 2",
        "--rdzv-endpoint HOST:PORT",
    ),
    case(
        "endpoint-without-port",
        "train {cfg} --nnodes 2 --rdzv-endpoint node1",
        "--rdzv-endpoint = 'node1'",
        "HOST:PORT",
    ),
    case(
        "endpoint-without-host",
        "train {cfg} --nnodes 2 --rdzv-endpoint :29500",
        "--rdzv-endpoint = ':29500'",
        "HOST:PORT",
    ),
    case(
        "endpoint-port-too-large",
        "train {cfg} --nnodes 2 --rdzv-endpoint node1:99999",
        "--rdzv-endpoint",
        "99999",
        "65535",
    ),
    case(
        "rdzv-backend-unknown",
        "train {cfg} --rdzv-backend zk",
        "--rdzv-backend = 'zk'",
        "c10d",
        "etcd",
    ),
    case("max-restarts-negative", "train {cfg} --max-restarts -1", "--max-restarts = -1", ">= 0"),
    case("node-rank-single-node", "train {cfg} --node-rank 1", "--node-rank = 1", "0..0"),
    case(
        "node-rank-past-nnodes",
        "train {cfg} --nnodes 2 --rdzv-endpoint node1:29500 --node-rank 2",
        "--node-rank = 2",
        "0..1",
    ),
    case("node-rank-negative", "train {cfg} --node-rank -1", "--node-rank = -1", "0..0"),
    # --- the run directory
    case(
        "run-dir-holds-metrics",
        "train {cfg} --run-dir {tmp}/old",
        "--run-dir",
        "old",
        "already holds a run",
        "metrics.jsonl",
        "another --run-dir",
        files={"old/metrics.jsonl": RUN},
    ),
    case(
        "run-dir-holds-summary",
        "train {cfg} --run-dir {tmp}/old",
        "already holds a run",
        "summary.json",
        files={"old/summary.json": "{}\n"},
    ),
    case(
        "run-dir-is-a-file",
        "train {cfg} --run-dir {tmp}/afile",
        "--run-dir",
        "afile",
        "not a directory",
        files={"afile": "x\n"},
    ),
    case(
        "bad-config-before-run-dir",
        "train {cfg} train.steps=-1 --run-dir {tmp}/old",
        "train.steps = -1",
        files={"old/metrics.jsonl": RUN},
    ),
    # --- data that is not there (checked before any process starts)
    case(
        "data-path-missing",
        "train {cfg} data.source=shards data.path={tmp}/nowhere",
        "data.path",
        "nowhere",
        "does not exist",
        "scaletrain shard",
    ),
    case(
        "explain-data-path-missing",
        "explain {cfg} data.source=shards data.path={tmp}/nowhere",
        "data.path",
        "does not exist",
    ),
    case(
        "data-path-is-a-file",
        "train {cfg} data.source=shards data.path={tmp}/afile",
        "data.path",
        "afile",
        "is a file",
        files={"afile": "x\n"},
    ),
    # --- resume
    case(
        "resume-missing-run-dir",
        "train {cfg} --run-dir {tmp}/nowhere --resume",
        "--resume: run directory",
        "nowhere",
        "does not exist",
        absent=("no valid checkpoint",),
    ),
    case(
        "resume-run-dir-is-a-file",
        "train {cfg} --run-dir {tmp}/afile --resume",
        "afile",
        "is not a directory",
        files={"afile": "x\n"},
    ),
    # --- export
    case(
        "export-run-without-checkpoints",
        "export {tmp}/run {tmp}/out.safetensors",
        "run",
        "has no checkpoints",
        "checkpoint.every = 0",
        "run/model.safetensors",
        absent=("incomplete save",),
        files={"run/metrics.jsonl": RUN, "run/model.safetensors": "weights"},
    ),
    case(
        "export-neither-checkpoint-nor-run",
        "export {tmp}/other {tmp}/out.safetensors",
        "other",
        "neither a checkpoint",
        "nor a run directory",
        files={"other/notes.txt": "x"},
    ),
    case(
        "export-missing", "export {tmp}/nowhere {tmp}/out.safetensors", "nowhere", "not a directory"
    ),
    # --- report
    case(
        "report-dir-without-metrics",
        "report {tmp}/empty",
        "empty",
        "not a run directory",
        "metrics.jsonl",
        files={"empty/summary.json": "{}\n"},
    ),
    case("report-dir-missing", "report {tmp}/nowhere", "nowhere", "not a run directory"),
    case(
        "report-second-dir-bad",
        "report {tmp}/good {tmp}/bad",
        "bad",
        "not a run directory",
        files={"good/metrics.jsonl": RUN},
    ),
    # --- the command line itself
    case("unknown-subcommand", "frobnicate", "invalid choice", "'frobnicate'", "'train'"),
    case("no-subcommand", "", "required", "command"),
    case("train-without-config", "train", "required", "CONFIG.toml", absent=("section.key=value",)),
    case("unknown-flag", "train {cfg} --nprocs 2", "unrecognized arguments", "--nprocs"),
]


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    forbid_starting(monkeypatch, tmp_path)


@pytest.mark.parametrize("argv, expect, toml, files, absent", CASES)
def test_mistake_is_refused_before_anything_starts(
    argv: str,
    expect: tuple,
    toml: str,
    files: dict[str, str],
    absent: tuple[str, ...],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(toml)
    for rel, body in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(body)
    before = file_tree(tmp_path)
    args = [a.replace("{cfg}", str(cfg)).replace("{tmp}", str(tmp_path)) for a in shlex.split(argv)]

    code = cli_main(args)

    err = capsys.readouterr().err
    assert code == 2, f"exit status {code}, stderr:\n{err}"
    assert "Traceback" not in err
    message = [line for line in err.splitlines() if line.startswith("scaletrain: error: ")]
    assert len(message) == 1, f"want one 'scaletrain: error:' line, stderr:\n{err}"
    for want in expect:
        options = want if isinstance(want, tuple) else (want,)
        assert any(o in message[0] for o in options), f"{want!r} not in: {message[0]}"
    for unwanted in absent:
        assert unwanted not in message[0], f"{unwanted!r} in: {message[0]}"
    assert file_tree(tmp_path) == before, "a refused command wrote or changed files"


def test_table_is_large_enough() -> None:
    assert len(CASES) >= 24
    assert len({p.id for p in CASES}) == len(CASES), "ids must be unique"


def test_good_config_passes_validation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same config with no mistake is accepted, so the table cannot pass by refusing all."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(GOOD_TOML)

    code = cli_main(["explain", str(cfg), "optim.betas=[0.9,0.95]", "--nproc", "2"])

    out, err = capsys.readouterr()
    assert code == 0, err
    assert "scaletrain: error" not in err
    assert "accumulation steps" in out
    # global 8 = micro 4 x dp 2 x 1 accumulation step
    assert re.search(r"accumulation steps\W+1\W*$", out, re.MULTILINE), out
    assert "2 process(es) x 1 node(s)" in out
    # digits has 1438 training rows: 2 steps x 8 examples = 0.0111 epochs
    assert re.search(r"epochs\W+0\.0111 \(2 steps x 8 / 1438 rows\)", out), out


def test_explain_counts_a_sentence_recipes_epochs(capsys: pytest.CaptureFixture[str]) -> None:
    """The sentences source's rows are counted for explain (they were 'unknown'): the MiniLM
    recipe's corpora without augmentation, 47,070 training items (the config's comment)."""
    config = Path(__file__).parents[1] / "configs" / "distill-minilm.toml"
    code = cli_main(
        [
            "explain",
            str(config),
            'data.kwargs={tokenizer="all-MiniLM-L6-v2",corpora=["wikipedia","words","news",'
            '"python-docs","articles","questions","instructions","headlines","package-docs"]}',
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert re.search(r"epochs\W+4\.08 \(3000 steps x 64 / 47070 rows\)", out), out


@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_model_that_does_not_fit_the_shards_is_refused_before_launch(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from scaletrain.data.shard_writer import write_shards

    shards = tmp_path / "shards"
    write_shards(
        "synthetic-text" if model == "cnn" else "digits",
        shards,
        rows_per_shard=512,
        seq_len=16,
        synthetic_examples=64,
    )
    cfg = tmp_path / "config.toml"
    cfg.write_text(GOOD_TOML)
    before = file_tree(tmp_path)

    code = cli_main(
        [
            "train",
            str(cfg),
            "data.source=shards",
            f"data.path={shards}",
            f"model.name={model}",
            "data.seq_len=16",
        ]
    )

    err = capsys.readouterr().err
    assert code == 2, err
    message = [line for line in err.splitlines() if line.startswith("scaletrain: error: ")]
    assert len(message) == 1 and "Traceback" not in err, err
    assert f"model.name = {model!r} needs" in message[0] and str(shards) in message[0]
    assert file_tree(tmp_path) == before


def test_explain_warns_about_oversubscribed_cores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(GOOD_TOML.replace("global_batch = 8", "global_batch = 256"))
    cores = len(os.sched_getaffinity(0))

    code = cli_main(["explain", str(cfg), "--nproc", str(4 * cores)])

    out, err = capsys.readouterr()
    assert code == 0, err
    warning = [line for line in err.splitlines() if "oversubscribed" in line]
    assert len(warning) == 1 and warning[0].startswith("scaletrain: warning: "), err
    assert f"{4 * cores} process(es) x 1 thread(s)" in warning[0]
    assert f"on {cores} core(s)" in warning[0] and f"--nproc <= {cores}" in warning[0]

    code = cli_main(["explain", str(cfg), "--nproc", "1"])
    assert code == 0 and "oversubscribed" not in capsys.readouterr().err


def test_empty_config_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "empty.toml"
    cfg.write_text("# nothing here yet\n")

    code = cli_main(["explain", str(cfg), "train.steps=5"])

    err = capsys.readouterr().err
    assert code == 0, err
    assert f"scaletrain: warning: config file {str(cfg)!r} sets nothing" in err
    assert "model.name = 'cnn'" in err and "train.steps = 5" in err
    cfg.write_text(GOOD_TOML)
    assert cli_main(["explain", str(cfg)]) == 0 and "sets nothing" not in capsys.readouterr().err


def _our_bug(*args, **kwargs):
    raise ValueError("an internal bug of scaletrain's, not the user's mistake")


@pytest.mark.parametrize("command", ["explain", "train"])
def test_a_value_error_of_ours_shows_a_traceback(
    command: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A ValueError raised inside scaletrain's own pre-launch checks is a bug: it leaves
    `main` as itself (`python -m scaletrain` then prints its traceback, exit status 1), it
    is not turned into a user's one-line mistake with status 2."""
    import scaletrain.commands.prelaunch

    # Where the pre-launch check looks it up (prelaunch imports it by name).
    monkeypatch.setattr(scaletrain.commands.prelaunch, "check_model_fits", _our_bug)
    cfg = tmp_path / "config.toml"
    cfg.write_text(GOOD_TOML)

    with pytest.raises(ValueError, match="internal bug"):
        cli_main([command, str(cfg), "parallel.tp=2", "--nproc", "2"])
    assert "scaletrain: error" not in capsys.readouterr().err


def test_a_user_mistake_from_the_same_check_is_still_one_paragraph(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from scaletrain.parallel.tensor import TensorParallelError

    def refuse(*args, **kwargs):
        raise TensorParallelError("parallel.tp = 2: 'fc1' has 7 features, not divisible by 2")

    import scaletrain.commands.prelaunch

    # Where the pre-launch check looks it up (prelaunch imports it by name).
    monkeypatch.setattr(scaletrain.commands.prelaunch, "check_model_fits", refuse)
    cfg = tmp_path / "config.toml"
    cfg.write_text(GOOD_TOML)

    code = cli_main(["train", str(cfg), "parallel.tp=2", "--nproc", "2"])

    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.count("scaletrain: error: parallel.tp = 2: 'fc1' has 7 features") == 1, err


def test_explain_runs_the_user_code_checks_train_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A factory typo used to pass `explain` and fail `train`: explain builds the user's
    code as train does, so it refuses it the same way (one paragraph, status 2)."""
    (tmp_path / "mymodels.py").write_text(
        "import torch\n\ndef build(task, **kwargs):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(task.num_classes))\n"
    )
    cfg = tmp_path / "config.toml"
    cfg.write_text(GOOD_TOML.replace('name = "mlp"', 'name = "mymodels:biuld"'))

    code = cli_main(["explain", str(cfg)])

    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    message = [line for line in err.splitlines() if line.startswith("scaletrain: error: ")]
    assert len(message) == 1 and "'mymodels:biuld'" in message[0], err
    assert "has no attribute 'biuld'" in message[0] and "build" in message[0], err
    cfg.write_text(GOOD_TOML.replace('name = "mlp"', 'name = "mymodels:build"'))
    assert cli_main(["explain", str(cfg)]) == 0, capsys.readouterr().err


def test_explain_shows_what_the_config_derives_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The derived values come first, in a screen; the key-by-key listing (hundreds of
    lines) only with --all, after them."""
    monkeypatch.setenv("COLUMNS", "200")
    cfg = tmp_path / "config.toml"
    cfg.write_text(GOOD_TOML)

    assert cli_main(["explain", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "accumulation steps" in out and "optim.lr" not in out, out
    assert "--all" in out
    assert len(out.splitlines()) < 60, len(out.splitlines())

    assert cli_main(["explain", str(cfg), "--all"]) == 0
    out = capsys.readouterr().out
    assert out.index("accumulation steps") < out.index("optim.lr"), out


def test_nproc_help_names_the_default_it_uses() -> None:
    from scaletrain.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    nproc = next(a for a in sub.choices["train"]._actions if a.dest == "nproc")
    assert "parallel.dp / nodes" not in nproc.help
    assert "product of the [parallel] degrees" in nproc.help, nproc.help


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from scaletrain import __version__

    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"scaletrain {__version__}"
