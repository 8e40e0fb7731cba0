"""Distillation, measured: the student encoder against its teacher, and the teacher-output cache.

Two comparisons in one invocation, each with its contenders run side by side, timed the
same way, and every difference between them named.

1. Encoder: all-MiniLM-L6-v2 (the teacher, 6 layers) against a 2-layer student of the
   same widths. Without --student the student is a 2-layer BertModel holding copies of the
   teacher layers configs/distill-minilm.toml's distill.init_layers names
   (`scaletrain.distill.student.init_from_teacher`): untrained, so timed, not scored. With
   --student RUN_DIR (a finished run of configs/distill-minilm.toml) its hf-model/ is timed
   and scored. Parameters are counted on the modules as timed, and again without the token
   embeddings: the weights that cost compute per token (the token embedding is a lookup).
   BERT's pooler is dropped from both (mean pooling never reads it; a trained student has
   none): 0.15M of the teacher's published 22.71M. Speed: sentences/s of
   `evaluate.hf_encoder` + `encode_speed` (best of 3 calls; the median over --encoder-reps
   interleaved reps) on `held_out_sentences()` (300 news sentences), the same batch size,
   max_len and tokenizer for both, one thread per core, in fp32 and under bf16 autocast;
   tokenization is inside the timing for both. Quality: `encoder_report`'s ratios (student
   / teacher) of Lee Pearson, WordSim353, SimLex-999 and the polarity probe, and the cosine
   between the two on the held-out sentences. Beside them the published ratios of
   DistilBERT and TinyBERT-4, whose setting differs (printed).

2. The cache's speed-up of a distillation epoch, through the real CLI. MNIST: a teacher
   trained first (configs/distill-mnist-teacher.toml with model mlp base, dropout 0.5 in
   place of its CNN, --mnist-teacher-steps steps; --mnist-teacher-model cnn keeps the CNN,
   ~30x the MLP's forward time; --mnist-teacher RUN_DIR reuses a run), then
   configs/distill-mnist.toml (mlp small) for a fixed number of steps with the teacher
   online, and the same config plus distill.cache (written once by `scaletrain
   distill-cache`, its time reported apart), repetitions interleaved (`common.interleave`,
   each run after the machine is quiet). examples/s is summary.json's (train.steps x
   global_batch over the training loop's wall time); the epoch is 60000 / that; "epochs to
   amortise" = cache write time / (online epoch - cached epoch). The whole command's time is
   printed too: start-up (imports, data, the cache's read and its data-fingerprint check, or
   the teacher's load) lies outside examples/s. MiniLM, the same at small scale:
   configs/distill-minilm.toml with cosine + hidden losses only (attention_weight 0: heads x
   T x T maps per layer would dominate the cache), bf16-mixed, on frequent words alone at a
   short seq_len (the full corpus' hidden states would be gigabytes of cache).

Every heavy step holds /tmp/st-heavy.lock (flock) so other experiments on the machine do
not overlap the timings; one lock per section, not per run, so a section is not split by
someone else's long job.

    .venv/bin/python bench/distill.py                     # ~8 min on 2 cores (+ lock waits)
    .venv/bin/python bench/distill.py --student RUN_DIR   # + the trained student's scores
    .venv/bin/python bench/distill.py --quick             # smoke version, < 2 min
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import BIN, NOISY_CORES, ROOT, interleave, median
from ps import config_differences

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
LOCK = "/tmp/st-heavy.lock"
CONFIGS = ROOT / "configs"
MNIST_TRAIN_ROWS = 60000
# The MNIST teacher's model, over configs/distill-mnist-teacher.toml's [model] (a CNN there).
TEACHER_MODELS = {
    "mlp": ["model.name=mlp", "model.size=base", "model.dropout=0.5"],  # 1024-1024, 1.86M params
    "cnn": [],  # the config's own: cnn base, dropout 0.3, ~30x the MLP's forward time
}
# (name, student params / teacher params, student speed / teacher speed, quality, setting)
PUBLISHED = [
    (
        "DistilBERT (Sanh et al. 2019)",
        0.60,
        1.60,
        "97% of BERT-base's GLUE score",
        "6 layers, 66M, from BERT-base (110M)",
    ),
    (
        "TinyBERT-4 (Jiao et al. 2020)",
        1 / 7.5,
        9.4,
        "96.8% of BERT-base on GLUE",
        "4 layers x 312 wide, 14.5M, from BERT-base",
    ),
]


@contextlib.contextmanager
def heavy_lock(what: str):
    """Hold the machine's heavy-job lock (the same flock(2) lock `flock LOCK cmd` takes)."""
    with open(LOCK, "a") as f:
        started = time.perf_counter()
        fcntl.flock(f, fcntl.LOCK_EX)
        waited = time.perf_counter() - started
        if waited > 1:
            print(f"  ({what}: waited {waited:.0f} s for {LOCK})", flush=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--student",
        type=Path,
        help="a finished run of configs/distill-minilm.toml (its hf-model/ is timed and scored)",
    )
    p.add_argument("--mnist-teacher", type=Path, help="reuse this MNIST teacher run directory")
    p.add_argument(
        "--mnist-teacher-model",
        choices=sorted(TEACHER_MODELS),
        default="mlp",
        help="the teacher trained when --mnist-teacher is not given",
    )
    p.add_argument("--mnist-teacher-steps", type=int, default=600)
    p.add_argument("--mnist-steps", type=int, default=1000, help="student steps per run")
    p.add_argument("--minilm-steps", type=int, default=30, help="MiniLM student steps per run")
    p.add_argument("--minilm-words", type=int, default=2000, help="data.kwargs.words (items)")
    p.add_argument("--minilm-seq-len", type=int, default=16, help="data.seq_len of the MiniLM runs")
    p.add_argument("--sentences", type=int, default=300, help="held-out sentences timed")
    p.add_argument("--batch-size", type=int, default=64, help="hf_encoder batch size")
    p.add_argument("--max-len", type=int, default=128, help="hf_encoder max_len")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions of each run")
    p.add_argument(
        "--encoder-reps",
        type=int,
        default=5,
        help="interleaved repetitions of each encoder timing (each ~1 s)",
    )
    p.add_argument(
        "--retries", type=int, default=1, help="re-runs of a run disturbed by other processes"
    )
    p.add_argument("--sections", default="encoder,mnist,minilm")
    p.add_argument("--quick", action="store_true", help="smoke version (< 2 min)")
    p.add_argument("--keep", type=Path, help="keep the run directories and caches here")
    a = p.parse_args()
    if a.quick:
        a.mnist_teacher_steps, a.mnist_steps, a.minilm_steps = 50, 100, 4
        a.minilm_words, a.sentences, a.reps, a.encoder_reps, a.retries = 300, 100, 1, 1, 0
    return a


# ----------------------------------------------------------------- 1. teacher vs student


def minilm_recipe():
    """configs/distill-minilm.toml's [distill] section (init_layers, layer_map)."""
    from scaletrain.config import load_config

    return load_config(CONFIGS / "distill-minilm.toml").distill


def load_encoders(a: argparse.Namespace):
    """(teacher module, student module, student description), both fp32 and in eval mode."""
    from transformers import AutoModel, BertConfig, BertModel
    from transformers.utils import logging as hf_logging

    from scaletrain.distill.student import init_from_teacher
    from scaletrain.distill.teacher import packaged_minilm_dir

    hf_logging.disable_progress_bar()  # "Loading weights" bars would interleave with the table
    hf_logging.set_verbosity_error()  # the trained student's missing pooler: dropped below
    teacher = AutoModel.from_pretrained(str(packaged_minilm_dir()), local_files_only=True).eval()
    if a.student:
        student = AutoModel.from_pretrained(str(a.student / "hf-model"), local_files_only=True)
        what = f"student {a.student.name} (trained)"
    else:
        layers = minilm_recipe().init_layers
        config = BertConfig(**{**teacher.config.to_dict(), "num_hidden_layers": len(layers)})
        student = BertModel(config)
        init_from_teacher(student, teacher, layers)
        what = f"student: teacher layers {layers} (untrained)"
    # Mean pooling never reads BERT's pooler (a dense layer on the first token); a trained
    # student has none (build_distillation drops it), so neither model keeps one.
    teacher.pooler = student.pooler = None
    n_layers = student.config.num_hidden_layers
    return teacher, student.eval(), f"{what}, {n_layers} layers"


def param_counts(model) -> tuple[int, int]:
    """(all parameters, those without the token embeddings) of a model without its pooler."""
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.get_input_embeddings().weight.numel()


def bf16_autocast(encode):
    """`encode` under CPU bf16 autocast (matmuls in bf16, pooling in fp32 as hf_encoder does)."""
    import torch

    def run(texts):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return encode(texts)

    return run


def speed_job(encode, texts: list[str]):
    """A job for `common.interleave`: encode_speed's best of 3 calls, as a result dict."""
    from scaletrain.distill.evaluate import encode_speed

    return lambda: {"sentences_per_s": encode_speed(encode, texts, repeats=3)}


def encoder_section(a: argparse.Namespace) -> None:
    """Parameters and speed of teacher and student; with --student, their scores."""
    import torch

    from scaletrain.distill.evaluate import encoder_report, held_out_sentences, hf_encoder
    from scaletrain.distill.teacher import packaged_minilm_dir

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    teacher, student, what = load_encoders(a)
    tok = packaged_minilm_dir()
    enc = {
        name: hf_encoder(m, tokenizer_dir=tok, max_len=a.max_len, batch_size=a.batch_size)
        for name, m in (("teacher", teacher), ("student", student))
    }
    texts = held_out_sentences(a.sentences)
    jobs = {
        (name, precision): speed_job(
            enc[name] if precision == "fp32" else bf16_autocast(enc[name]), texts
        )
        for precision in ("fp32", "bf16")
        for name in ("teacher", "student")
    }
    with heavy_lock("encoder speed"):
        runs = interleave(
            jobs,
            reps=a.encoder_reps,
            retries=a.retries,
            line=lambda rep, job, r: f"{job[0]} {job[1]}: {r['sentences_per_s']:.0f} sentences/s",
        )
        report = encoder_report(enc["student"], teacher=enc["teacher"]) if a.student else None
    speed = {
        job: (median(rs, "sentences_per_s"), any(r["noisy"] for r in rs))
        for job, rs in runs.items()
    }
    spread = ", ".join(
        f"{name} {prec} {min(r['sentences_per_s'] for r in rs):.0f}-"
        f"{max(r['sentences_per_s'] for r in rs):.0f}"
        for (name, prec), rs in runs.items()
    )
    print_encoder_table(a, teacher, student, what, speed, cores=cores, spread=spread)
    print_quality(report, max_len=a.max_len)


def print_encoder_table(
    a: argparse.Namespace, teacher, student, what: str, speed: dict, *, cores: int, spread: str
) -> None:
    """Parameters and speeds of both, their ratios, and the published ratios beside them."""
    t_all, t_core = param_counts(teacher)
    s_all, s_core = param_counts(student)
    print(
        f"\n1. encoder: {a.sentences} held-out news sentences (lee_background.cor), hf_encoder "
        f"batch {a.batch_size}, max_len {a.max_len}, mean pooling, sorted by length, "
        f"{cores} threads, median over {a.encoder_reps} interleaved reps of the best of 3 calls, "
        "tokenization included; pooler dropped from both (mean pooling never reads it)"
    )
    print(
        f"{'':<54} {'params':>8} {'w/o token emb':>18} {'sent/s fp32':>12} "
        f"{'sent/s bf16 autocast':>20}"
    )
    rows = [
        ("teacher all-MiniLM-L6-v2, 6 layers", t_all, t_core, "teacher"),
        (what, s_all, s_core, "student"),
    ]
    for label, n_all, n_core, key in rows:
        cells = [
            f"{speed[key, p][0]:.0f}" + ("~" if speed[key, p][1] else "") for p in ("fp32", "bf16")
        ]
        print(
            f"{label[:54]:<54} {n_all / 1e6:>7.2f}M {n_core / 1e6:>17.2f}M {cells[0]:>12} "
            f"{cells[1]:>20}"
        )
    fp32 = speed["student", "fp32"][0] / speed["teacher", "fp32"][0]
    bf16 = speed["student", "bf16"][0] / speed["teacher", "bf16"][0]
    print(
        f"{'student / teacher':<54} {s_all / t_all:>8.3f} {s_core / t_core:>18.3f} "
        f"{fp32:>11.2f}x {bf16:>19.2f}x"
    )
    print(
        f"  bf16 autocast / fp32: teacher "
        f"{speed['teacher', 'bf16'][0] / speed['teacher', 'fp32'][0]:.2f}x, student "
        f"{speed['student', 'bf16'][0] / speed['student', 'fp32'][0]:.2f}x;  "
        f"~ : a rep kept > {NOISY_CORES} cores of foreign load"
    )
    print(f"  spread over the reps (min-max sentences/s): {spread}")
    print("\n   published, beside ours (student / teacher):")
    print(f"   {'':<31} {'params':>7} {'speed':>6}  {'quality':<32} setting")
    for name, params, fast, quality, setting in PUBLISHED:
        print(f"   {name:<31} {params:>7.3f} {fast:>5.1f}x  {quality:<32} {setting}")
    print(
        f"   {'ours (MiniLM-L6 -> 2 layers)':<31} {s_all / t_all:>7.3f} {fp32:>5.1f}x  "
        f"{'see the quality rows' if a.student else '(not trained: --student)':<32} "
        f"2 layers x 384, from all-MiniLM-L6-v2 (22.7M)"
    )
    print(
        "   the difference: they distil BERT-base (110M, 12 layers x 768) and score GLUE "
        "(fine-tuned tasks), their speed on their own hardware and batch sizes; we distil "
        "MiniLM-L6 (22.7M, already distilled, half its parameters the 30522-word token "
        "embedding, which a 2-layer student keeps whole) into 2 layers and score sentence "
        "and word similarity with no fine-tuning. Token embeddings are a lookup, so the "
        "per-token weights (second column) are what speed follows."
    )


def print_quality(report: dict | None, *, max_len: int) -> None:
    if report is None:
        print("   quality: pass --student RUN_DIR (a trained configs/distill-minilm.toml run)")
        return
    from scaletrain.distill.evaluate import SCORE_KEYS

    print(
        f"\n   quality (encoder_report at max_len {max_len}; `scaletrain eval RUN_DIR --teacher "
        "all-MiniLM-L6-v2` scores the same way, max_len 128 by default):"
    )
    print(f"   {'benchmark':<14} {'student':>8} {'teacher':>8} {'ratio':>6}")
    for key, score in SCORE_KEYS.items():
        print(
            f"   {key:<14} {report[key][score]:>8.4f} {report['teacher'][key][score]:>8.4f} "
            f"{report['ratio'][key]:>6.3f}"
        )
    print(
        f"   {'cosine held out':<14} {report['cosine_held_out']:>8.4f} (student vs teacher, "
        "300 news sentences)"
    )


# ----------------------------------------------------------------- 2. the cache's speed-up


def cli(args: list[str], *, timeout: float = 1800) -> tuple[str, float]:
    """Run `scaletrain ARGS`; (its stdout, seconds the whole command took)."""
    cmd = [str(BIN / "scaletrain"), *map(str, args)]
    started = time.perf_counter()
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    if done.returncode != 0:
        raise SystemExit(
            f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-2000:]}\n"
            f"{done.stderr[-4000:]}"
        )
    return done.stdout + done.stderr, time.perf_counter() - started


def train_run(config: Path, overrides: list[str], run_dir: Path) -> dict:
    """One `scaletrain train` run; summary.json's numbers and the command's time."""
    _, command_s = cli(
        ["train", config, "--nproc", "2", *overrides, "log.quiet=true", "--run-dir", run_dir]
    )
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "examples_per_s": s["examples_per_s"],
        "wall_s": s["train_time_s"] + s["eval_time_s"],
        "command_s": command_s,
        "final_loss": s["final_loss"],
        "accuracy": s["eval"].get("accuracy"),
        "run_dir": run_dir,
    }


def write_cache(config: Path, overrides: list[str], out: Path) -> dict:
    """`scaletrain distill-cache`; its own write time (teacher + Parquet + fingerprints) and
    the whole command's."""
    text, command_s = cli(["distill-cache", config, out, *overrides])
    m = re.search(r"\((\d+) rows in ([\d.]+) s", text)
    if m is None:
        raise SystemExit(f"distill-cache printed no write time:\n{text[-2000:]}")
    size = sum(f.stat().st_size for f in out.rglob("*.parquet"))
    return {"rows": int(m[1]), "write_s": float(m[2]), "command_s": command_s, "bytes": size}


def compare_cached(
    name: str,
    a: argparse.Namespace,
    *,
    config: Path,
    common: list[str],
    cache: Path,
    write: dict,
    root: Path,
    train_rows: int,
) -> None:
    """Online vs cached runs of one config (they differ in distill.cache alone), interleaved;
    the table.

    Args:
        name: the section's name, for run directories and the table.
        a: the command line (reps, retries).
        config: the TOML config both contenders run.
        common: the overrides both get.
        cache: the cache directory `write_cache` wrote.
        write: what `write_cache` returned (its time and size).
        root: where the run directories go.
        train_rows: rows of the train split (the epoch).
    """
    counter = iter(range(10**6))  # a fresh run directory per run, retries included
    jobs = {
        mode: (
            lambda mode=mode: train_run(
                config,
                common + ([f"distill.cache={cache}"] if mode == "cached" else []),
                root / f"{name}-{mode}-{next(counter)}",
            )
        )
        for mode in ("online", "cached")
    }

    def line(rep: int, mode: str, r: dict) -> str:
        return (
            f"{name} {mode:<6} {r['examples_per_s']:>8.0f} ex/s, train {r['wall_s']:.1f} s, "
            f"command {r['command_s']:.1f} s"
        )

    results = interleave(jobs, reps=a.reps, retries=a.retries, line=line)
    print_cache_table(
        name,
        results,
        cache_info=json.loads((cache / "cache.json").read_text()),
        write=write,
        train_rows=train_rows,
    )


def print_cache_table(
    name: str, results: dict, *, cache_info: dict, write: dict, train_rows: int
) -> None:
    on, off = (median(results[m], "examples_per_s") for m in ("online", "cached"))
    print(
        f"\n   {name}: {'':<8} {'ex/s':>8} {'per rep':<26} {'epoch s':>8} {'train s':>8} "
        f"{'command s':>9} {'final loss':>11}"
    )
    for mode, speed in (("online", on), ("cached", off)):
        runs = results[mode]
        reps = " ".join(f"{r['examples_per_s']:.0f}" + ("~" if r["noisy"] else "") for r in runs)
        losses = {round(r["final_loss"], 7) for r in runs}
        print(
            f"   {'':<{len(name) + 1}} {mode:<8} {speed:>8.0f} {reps:<26} "
            f"{train_rows / speed:>8.2f} {median(runs, 'wall_s'):>8.1f} "
            f"{median(runs, 'command_s'):>9.1f} {runs[0]['final_loss']:>11.7f}"
            + ("" if len(losses) == 1 else "*")
        )
    saved = train_rows / on - train_rows / off
    amortise = f"after {write['write_s'] / saved:.1f} epochs" if saved > 0 else "never (not faster)"
    print(
        f"   {'':<{len(name) + 1}} cached / online: {off / on:.2f}x examples/s; epoch "
        f"({train_rows} rows) {train_rows / on:.2f} s -> {train_rows / off:.2f} s"
    )
    print(
        f"   {'':<{len(name) + 1}} cache write: {write['write_s']:.1f} s for {write['rows']} "
        f"rows (train + eval; command {write['command_s']:.1f} s), "
        f"{write['bytes'] / 2**20:.0f} MiB; amortised {amortise}"
    )
    print(
        f"   {'':<{len(name) + 1}} cache holds {', '.join(cache_info['outputs'])} in "
        f"{cache_info['teacher_dtype']}; ~ : noisy run, * : final loss differed between reps"
    )
    diffs = config_differences({m: {"run_dir": rs[0]["run_dir"]} for m, rs in results.items()})
    print(
        f"   {'':<{len(name) + 1}} differences in the resolved configs: "
        + "; ".join(
            f"{k}: " + ", ".join(f"{m}={v}" for m, v in vals.items()) for k, vals in diffs.items()
        )
    )


def describe_teacher(run_dir: Path) -> str:
    """'mlp base, dropout 0.5' from a teacher run's config.toml."""
    from scaletrain.config import load_config

    m = load_config(run_dir / "config.toml").model
    return f"{m.name} {m.size}, dropout {m.dropout:g} ({run_dir.name})"


def mnist_section(a: argparse.Namespace, root: Path) -> None:
    """The MNIST teacher (trained or given), its cache, online vs cached students."""
    from scaletrain.config import load_config

    config = CONFIGS / "distill-mnist.toml"
    with heavy_lock("MNIST cache"):
        teacher = a.mnist_teacher
        if teacher is None:
            teacher = root / "mnist-teacher"
            r = train_run(
                CONFIGS / "distill-mnist-teacher.toml",
                [*TEACHER_MODELS[a.mnist_teacher_model], f"train.steps={a.mnist_teacher_steps}"],
                teacher,
            )
            print(
                f"  MNIST teacher trained: {a.mnist_teacher_steps} steps, accuracy "
                f"{r['accuracy']:.4f} (command {r['command_s']:.0f} s)",
                flush=True,
            )
        described = describe_teacher(teacher)
        common = [f"distill.teacher={teacher}", f"train.steps={a.mnist_steps}"]
        cache = root / "mnist-cache"
        write = write_cache(config, common, cache)
        c = load_config(config, common)
        print(
            f"\n2a. MNIST: configs/distill-mnist.toml ({c.model.name} {c.model.size}, T "
            f"{c.distill.temperature:g}, alpha {c.distill.alpha:g}, dp {c.parallel.dp} on "
            f"{len(os.sched_getaffinity(0))} cores, train.threads {c.train.threads}: cores / "
            f"ranks), {a.mnist_steps} steps x {c.train.global_batch} examples, teacher "
            f"{described} online vs its logits from the cache (distill-cache: one process, "
            "every core)",
            flush=True,
        )
        compare_cached(
            "mnist",
            a,
            config=config,
            common=common,
            cache=cache,
            write=write,
            root=root,
            train_rows=MNIST_TRAIN_ROWS,
        )


def minilm_section(a: argparse.Namespace, root: Path) -> None:
    """The MiniLM recipe at small scale: its cache, online vs cached students."""
    from scaletrain.config import load_config

    config = CONFIGS / "distill-minilm.toml"
    common = [
        "distill.attention_weight=0.0",
        "precision.mode=bf16-mixed",
        f"train.steps={a.minilm_steps}",
        f"data.seq_len={a.minilm_seq_len}",
        'data.kwargs.corpora=["words"]',
        f"data.kwargs.words={a.minilm_words}",
    ]
    with heavy_lock("MiniLM cache"):
        cache = root / "minilm-cache"
        write = write_cache(config, common, cache)
        rows = json.loads((cache / "cache.json").read_text())["splits"]["train"]["rows"]
        c = load_config(config, common)
        print(
            f"\n2b. MiniLM: configs/distill-minilm.toml with attention_weight 0 (cosine "
            f"{c.distill.cosine_weight:g} + hidden {c.distill.hidden_weight:g}, layer map "
            f"{c.distill.layer_map}), bf16-mixed (teacher bf16), {a.minilm_steps} steps x "
            f"{c.train.global_batch}, dp {c.parallel.dp}, data: {a.minilm_words} frequent words "
            f"alone at seq_len {a.minilm_seq_len} ({rows} train rows); the cached run still "
            f"loads the teacher to copy layers {c.distill.init_layers}, but never runs it",
            flush=True,
        )
        compare_cached(
            "minilm",
            a,
            config=config,
            common=common,
            cache=cache,
            write=write,
            root=root,
            train_rows=rows,
        )


def main() -> None:
    a = parse()
    sections = a.sections.split(",")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = a.keep or Path(tmp)
        if a.keep and a.keep.exists() and any(a.keep.iterdir()):
            raise SystemExit(f"--keep {a.keep}: not empty (a cache is never overwritten)")
        root.mkdir(parents=True, exist_ok=True)
        if "encoder" in sections:
            encoder_section(a)
        if "mnist" in sections:
            mnist_section(a, root)
        if "minilm" in sections:
            minilm_section(a, root)
    print(
        f"\nbenchmark wall time: {time.perf_counter() - started:.0f} s; command: "
        f"{' '.join([Path(sys.executable).name, *sys.argv])}"
    )


if __name__ == "__main__":
    main()
