"""Distillation keeps data parallelism's guarantee: dp=2 with 2 accumulation micro-batches per
rank ends with the weights and per-step losses of one process, in float64 within 1e-9.

- A digits MLP student learns from a trained MLP teacher (logits KL at T = 3 plus the hard
  cross-entropy, alpha = 0.7).
- A 2-layer BERT student on sentences learns from a 4-layer BERT teacher through every
  term at once (hidden-state MSE through the projections, attention MSE, pooled cosine),
  initialised from teacher blocks [1, 3] with layer map [0, 2, 4]. The items are words of
  different token lengths, so padding differs between rows: a loss normalised per batch
  rather than per example gives another gradient once the micro-batches change.
- The check can fail: with the KL averaged per micro-batch (injected into the workers by a
  sitecustomize on PYTHONPATH) dp=2 no longer matches one process.
- Distilling changes the student (alpha 0.7 vs 0), alpha = 0 is the run without [distill],
  the teacher's files are untouched, and the run's model.safetensors holds the student's
  own names (no wrapper prefix, no projections).

Plain SGD with momentum and no clipping: Adam and clipping are blind to the gradient's
scale, SGD shows a wrong normaliser.

Speed: the trainings are the session's `trained` runs (harness.run_job: the workers' own
entry, one process group per world size, many runs in it): the MLP teacher (shared with
test_distill_cache), then the one-process students in one job and the dp=2 ones in another.
The negative control's two runs are jobs of their own (run_job, not cached): their workers
start with the defect on PYTHONPATH.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tomli_w
import torch
from safetensors.torch import load_file

from harness import (
    Case,
    config_toml,
    file_tree,
    load_weights,
    losses,
    max_abs_diff,
    records,
    run_job,
)

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TOL = 1e-9

# What every student shares: 4 steps of SGD with momentum in float64 (BERT's at 10x the lr).
COMMON = {
    "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "warmup_steps": 0, "grad_clip": 0.0},
    "train": {"steps": 4, "seed": 7, "eval_examples": 16},
    "precision": {"mode": "fp64"},
    "log": {"every": 1, "quiet": True},
}

TEACHER = config_toml(
    model={"size": "small"},
    optim={"lr": 3e-3, "warmup_steps": 2},
    train={"steps": 40, "global_batch": 32, "micro_batch": 32, "seed": 3, "eval_examples": 32},
    precision={"mode": "fp64"},
    log={"every": 10, "quiet": True},
)

MLP_STUDENT = config_toml(distill={"alpha": 0.7, "temperature": 3.0}, **COMMON)
PLAIN_STUDENT = config_toml(**COMMON)  # MLP_STUDENT without [distill]

BERT_WIDTHS = dict(
    hidden_size=32,
    num_attention_heads=2,
    intermediate_size=37,
    vocab_size=30522,
    max_position_embeddings=64,
)

BERT_STUDENT = """
[model]
name = "hf"
hf_config = "BertConfig"
[model.kwargs]
vocab_size = 30522
hidden_size = 32
num_hidden_layers = 2
num_attention_heads = 2
intermediate_size = 37
max_position_embeddings = 64
hidden_dropout_prob = 0.0
attention_probs_dropout_prob = 0.0
[data]
source = "sentences"
seq_len = 16
kwargs = { corpora = ["words"], words = 2000 }
[distill]
hidden_weight = 1.0
attention_weight = 1.0
cosine_weight = 1.0
init_layers = [1, 3]
layer_map = [0, 2, 4]
""" + tomli_w.dumps({**COMMON, "optim": {**COMMON["optim"], "lr": 0.5}})

# Defect for the negative control: the KL averaged over the micro-batch, not summed.
MEAN_KL = """
import scaletrain.distill.losses as losses
import scaletrain.distill.objective as objective

_sum_kl = losses.soft_target_kl


def mean_kl(student_logits, teacher_logits, **kwargs):
    return _sum_kl(student_logits, teacher_logits, **kwargs) / student_logits.shape[0]


objective.soft_target_kl = mean_kl
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("distill-parity")


# The teacher's checkpoints at steps 20 and 40 are teachers too (test_distill_cache).
MLP_TEACHER = Case.of(TEACHER, "checkpoint.every=20")


def mlp_teacher_run(trained) -> Path:
    """A digits MLP trained in one process: a scaletrain run directory as a teacher (the
    session's one: a cached run, which tests read and never write into)."""
    return trained({"mlp-teacher": MLP_TEACHER}, world_size=1)["mlp-teacher"].run_dir


def save_bert_teacher(out: Path) -> Path:
    """A random 4-layer BERT saved as a Hugging Face directory (config.json + safetensors)."""
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=4, **BERT_WIDTHS))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def mlp_teacher(trained) -> Path:
    return mlp_teacher_run(trained)


@pytest.fixture(scope="module")
def bert_teacher(work: Path) -> Path:
    return save_bert_teacher(work / "bert-teacher")


def student_case(body: str, *, dp: int, global_batch: int, overrides: list[str] = ()) -> Case:
    """A student run with `dp` ranks, 2 micro-batches per rank (global = 2 x micro x dp)."""
    return Case.of(
        body,
        f"parallel.dp={dp}",
        f"train.global_batch={global_batch}",
        f"train.micro_batch={global_batch // (2 * dp)}",
        *overrides,
    )


@pytest.fixture(scope="module")
def mlp_teacher_files(mlp_teacher: Path) -> dict:
    """The teacher run directory's bytes before any student ran."""
    return file_tree(mlp_teacher)


@pytest.fixture(scope="module")
def bert_teacher_files(bert_teacher: Path) -> dict:
    """The teacher directory's bytes before any student ran."""
    return file_tree(bert_teacher)


@pytest.fixture(scope="module")
def students(
    trained,
    mlp_teacher: Path,
    mlp_teacher_files: dict,
    bert_teacher: Path,
    bert_teacher_files: dict,
) -> dict[str, Path]:
    """Every student run of this file but the negative control's: name -> run directory;
    one job on 1 rank, one on 2."""
    mlp = [f"distill.teacher={mlp_teacher}"]
    bert = [f"distill.teacher={bert_teacher}"]
    cases = {
        1: {
            "mlp-dp1": student_case(MLP_STUDENT, dp=1, global_batch=32, overrides=mlp),
            "alone": student_case(
                MLP_STUDENT, dp=1, global_batch=32, overrides=[*mlp, "distill.alpha=0.0"]
            ),
            "plain": student_case(PLAIN_STUDENT, dp=1, global_batch=32),
            "bert-dp1": student_case(BERT_STUDENT, dp=1, global_batch=16, overrides=bert),
        },
        2: {
            "mlp-dp2": student_case(MLP_STUDENT, dp=2, global_batch=32, overrides=mlp),
            "bert-dp2": student_case(BERT_STUDENT, dp=2, global_batch=16, overrides=bert),
        },
    }
    return {
        name: result.run_dir
        for world, asked in cases.items()
        for name, result in trained(asked, world_size=world).items()
    }


@pytest.fixture(scope="module")
def mlp_runs(students: dict[str, Path]) -> dict[int, Path]:
    return {dp: students[f"mlp-dp{dp}"] for dp in (1, 2)}


@pytest.fixture(scope="module")
def bert_runs(students: dict[str, Path]) -> dict[int, Path]:
    return {dp: students[f"bert-dp{dp}"] for dp in (1, 2)}


def assert_same_run(a: Path, b: Path, *, steps: int = 4) -> None:
    """Weights within TOL and the same per-step losses."""
    diff = max_abs_diff(load_weights(a), load_weights(b))
    print(f"{b.name} vs {a.name}: max |difference| {diff:.3g}")
    assert diff < TOL, f"{b.name}: weights differ from {a.name} by {diff:.3g}"
    ref = losses(a)
    assert len(ref) == steps
    assert losses(b) == pytest.approx(ref, abs=TOL, rel=TOL)


def assert_same_terms(a: Path, b: Path, weights: dict[str, float]) -> None:
    """Each record of `b` (training and eval) logs the terms of `a`'s, within TOL: summed over
    the data-parallel group and divided by the loss's count, like the loss; and in each the
    loss is the weighted sum of its terms (`weights`: name -> weight)."""
    for kind in ("train", "eval"):
        ref, got = records(a, kind), records(b, kind)
        assert len(ref) == len(got) > 0, kind
        for r, g in zip(ref, got):
            assert sorted(k for k in g if k in weights) == sorted(weights), (kind, g)
            assert {k: g[k] for k in weights} == pytest.approx(
                {k: r[k] for k in weights}, abs=TOL, rel=TOL
            ), (kind, r["step"])
            assert g["loss"] == pytest.approx(
                sum(w * g[k] for k, w in weights.items()), rel=1e-12
            ), (kind, g)


def test_mlp_distillation_dp2_matches_one_process(mlp_runs: dict[int, Path]) -> None:
    weights = load_weights(mlp_runs[1])
    assert all(w.dtype == torch.float64 for w in weights.values())
    assert_same_run(mlp_runs[1], mlp_runs[2])
    # alpha = 0.7: loss = 0.3 x hard_loss + 0.7 x distill/kl (T^2 x KL)
    assert_same_terms(mlp_runs[1], mlp_runs[2], {"hard_loss": 0.3, "distill/kl": 0.7})


def test_bert_distillation_dp2_matches_one_process(
    bert_runs: dict[int, Path], bert_teacher: Path
) -> None:
    assert_same_run(bert_runs[1], bert_runs[2])
    assert_same_terms(
        bert_runs[1],
        bert_runs[2],
        {"distill/hidden": 1.0, "distill/attention": 1.0, "distill/cosine": 1.0},
    )
    # The check can fail: the 4 steps moved the student far beyond the tolerance from where
    # it started, teacher blocks 1 and 3.
    teacher = load_file(str(bert_teacher / "model.safetensors"))
    got = load_weights(bert_runs[1])
    moved = max(
        float(
            (got[f"encoder.layer.{i}.{w}"].double() - teacher[f"encoder.layer.{t}.{w}"].double())
            .abs()
            .max()
        )
        for i, t in enumerate((1, 3))
        for w in ("attention.self.query.weight", "output.dense.weight")
    )
    assert moved > 1e6 * TOL


def test_a_per_batch_mean_kl_breaks_the_parity(
    work: Path, mlp_teacher: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control of the MLP parity: the workers' KL divided by its micro-batch.
    Not the session's cached runs (the same cases, the defect injected): jobs of their own."""
    inject = work / "mean-kl"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(MEAN_KL)
    path = os.pathsep.join(filter(None, [str(inject), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    teacher = [f"distill.teacher={mlp_teacher}"]
    runs = {
        dp: run_job(
            {"mean-kl": student_case(MLP_STUDENT, dp=dp, global_batch=32, overrides=teacher)},
            world_size=dp,
            root=work / f"mean-kl-dp{dp}",
            fresh=True,  # new interpreters: they read the sitecustomize at start-up
        )["mean-kl"].run_dir
        for dp in (1, 2)
    }
    diff = max_abs_diff(load_weights(runs[1]), load_weights(runs[2]))
    print(f"mean KL: dp=2 vs dp=1 max |difference| {diff:.3g}")
    assert diff > 1e-6, f"a per-batch mean KL still matched one process ({diff:.3g})"


def test_distilling_changes_the_student_and_not_the_teacher(
    students: dict[str, Path],
    mlp_teacher: Path,
    mlp_teacher_files: dict,
    mlp_runs: dict[int, Path],
    bert_teacher: Path,
    bert_teacher_files: dict,
    bert_runs: dict[int, Path],
) -> None:
    from scaletrain.data.loader import load_dataset
    from scaletrain.models import build_model

    alone = students["alone"]  # distill.alpha = 0
    assert file_tree(mlp_teacher) == mlp_teacher_files  # frozen: not a byte changed
    distilled = load_weights(mlp_runs[1])
    assert max_abs_diff(distilled, load_weights(alone)) > 1e-4
    # alpha = 0 is the hard loss alone: the run without [distill] (the teacher's load and
    # the wrapper change nothing else).
    plain = students["plain"]  # MLP_STUDENT without [distill]
    assert_same_run(plain, alone)
    # The student's own names, as a run without [distill] writes them.
    task = load_dataset("digits", split="train").spec
    assert sorted(distilled) == sorted(build_model("mlp", size="tiny", task=task).state_dict())
    # The BERT student's file: BertModel's own names (its pooler dropped: no loss reads it),
    # without the projections the hidden-state loss trained.
    bert = load_weights(bert_runs[2])
    config = transformers.BertConfig(num_hidden_layers=2, **BERT_WIDTHS)
    names = set(transformers.BertModel(config, add_pooling_layer=False).state_dict())
    assert set(bert) == names, sorted(set(bert) ^ names)
    assert file_tree(bert_teacher) == bert_teacher_files


def test_the_students_hf_model_is_a_whole_encoder(bert_runs: dict[int, Path]) -> None:
    """RUN_DIR/hf-model/ of a sentences student holds the data's tokenizer and
    sentence-transformers' mean pooling beside the weights: loaded as a user would, with plain
    AutoTokenizer + AutoModel, it has the teacher's vocabulary (not the 5-token tokenizer
    transformers builds from config.json alone, with which the student scored Lee 0.015) and
    gives the embeddings scaletrain computes in process; sentence-transformers loads it too."""
    from scaletrain.data.sentences import tokenize
    from scaletrain.distill.losses import mean_pool
    from scaletrain.distill.teacher import packaged_minilm_dir

    hf_dir, texts = bert_runs[1] / "hf-model", ["hello world", "students learn", "x"]
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    data_tok = transformers.AutoTokenizer.from_pretrained(
        str(packaged_minilm_dir()), local_files_only=True
    )
    assert len(tok) == len(data_tok) == 30522
    model = transformers.AutoModel.from_pretrained(str(hf_dir), local_files_only=True).eval()
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state  # (B, T, D)
    m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    plain = (hidden * m).sum(1) / m.sum(1)  # mean pooling, by hand
    # scaletrain in process: the data's own tokens (seq_len 16), the student from its weights
    ids, mask, _ = tokenize(texts, tokenizer_dir=packaged_minilm_dir(), seq_len=16)
    student = (
        transformers.BertModel(
            transformers.BertConfig(num_hidden_layers=2, **BERT_WIDTHS), add_pooling_layer=False
        )
        .double()
        .eval()
    )
    student.load_state_dict(load_weights(bert_runs[1]))
    with torch.no_grad():
        ours = mean_pool(student(ids, attention_mask=mask).last_hidden_state, mask)
    assert plain.dtype == ours.dtype == torch.float64
    assert float((plain - ours).abs().max()) < TOL
    st = pytest.importorskip("sentence_transformers")
    encoder = st.SentenceTransformer(str(hf_dir), device="cpu")
    got = torch.from_numpy(encoder.encode(texts, convert_to_numpy=True)).double()
    assert float((got - ours).abs().max()) < TOL
