"""`scaletrain distill-cache` and `scaletrain eval`: the distillation subcommands.

distill-cache CONFIG OUT_DIR [overrides]: the teacher of CONFIG's [distill] run once over
its data's train and eval splits, in one process, written as a cache (distill/cache.py);
then `distill.cache = OUT_DIR` trains with no teacher.

eval MODEL [--teacher T]: a sentence encoder (a scaletrain run directory of a "sentences"
student, a Hugging Face directory, or 'all-MiniLM-L6-v2') scored on Lee (Pearson),
WordSim353, SimLex-999, the sentiment and topic probes and, with a teacher, each score's
ratio to the teacher's and the student-teacher cosine on the held-out sentences of each
kind of text (every corpus's, none trained on), printed worst first so that the weakest
figure is the first line read; then the cosine on the held-out news BENCHMARKS.md has
always given, and the student's encode speed over the teacher's (forwards alone,
tokenization timed apart; --no-speed skips it) (distill/evaluate.py).

A CLI-level module (beside cli.py, which registers its parsers): it builds data, model and
loss with training/assemble.py, which sits above distill/, so it cannot live in distill/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from scaletrain.config import ConfigError, given_world, load_config
from scaletrain.launch.resolve import resolve

# The scores `scaletrain eval` prints, in the order printed without a teacher.
SCORE_LINES = ("lee_pearson", "wordsim353", "simlex999", "polarity", "topic")


def add_parsers(sub) -> None:
    cache = sub.add_parser(
        "distill-cache",
        help="write a teacher's outputs over the data to Parquet, for runs with distill.cache",
    )
    cache.add_argument("config", type=Path, metavar="CONFIG.toml")
    cache.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    cache.add_argument("overrides", nargs="*", default=[], metavar="section.key=value")
    ev = sub.add_parser(
        "eval",
        help="score a sentence encoder (Lee, WordSim353, SimLex-999, probes, each kind of "
        "held-out text) against its teacher, worst first",
    )
    ev.add_argument(
        "model",
        metavar="MODEL",
        help="a run directory, a Hugging Face directory, or all-MiniLM-L6-v2",
    )
    ev.add_argument("--teacher", help="the teacher to compare with (e.g. all-MiniLM-L6-v2)")
    ev.add_argument("--max-len", type=int, default=128, help="tokens per text")
    ev.add_argument("--out", type=Path, help="write the scores as JSON here")
    ev.add_argument(
        "--no-speed",
        action="store_true",
        help="skip timing the student against the teacher (it takes 10-60 s)",
    )


def cmd_distill_cache(args: argparse.Namespace) -> int:
    from scaletrain.distill.build import build_distillation, run_teacher_dtype
    from scaletrain.distill.cache import CacheError, write_cache
    from scaletrain.distill.objective import teacher_targets
    from scaletrain.distill.student import n_blocks
    from scaletrain.precision import make_precision
    from scaletrain.runtime import set_threads
    from scaletrain.training.assemble import build_data, build_loss, build_net

    config = load_config(args.config, args.overrides)
    if not config.distill.teacher:
        raise ConfigError("distill-cache runs the teacher: set distill.teacher in the config")
    config = config.model_copy(update={"distill": config.distill.model_copy(update={"cache": ""})})
    resolve(config, world_size=given_world(config))  # the config's own checks
    if (args.out_dir / "cache.json").exists():
        raise CacheError(
            f"OUT_DIR {str(args.out_dir)!r} already holds a cache; choose a new "
            "directory so nothing is overwritten"
        )
    set_threads(len(os.sched_getaffinity(0)))  # one process: every core
    torch.manual_seed(config.train.seed)
    splits = {s: build_data(config, split=s) for s in ("train", "eval")}
    task = splits["train"].spec
    precision = make_precision(config.precision.mode, device_type="cpu")
    student = build_net(config, splits["train"])  # only for the layer map's student side
    hard = None if task.kind == "encode" else build_loss(config, splits["train"])
    kd = build_distillation(config, student, task=task, hard=hard, precision=precision)
    teacher = kd.teacher
    width = getattr(getattr(teacher.module, "config", None), "hidden_size", 0)
    info = {
        "teacher_source": config.distill.teacher,
        "teacher_sha256": teacher.sha256,
        "teacher_dtype": str(run_teacher_dtype(config, precision)).removeprefix("torch."),
        "teacher_layers": n_blocks(teacher.module) if kd.layer_map else 0,
        "teacher_width": int(width or 0),
        "outputs": kd.needs.keys(),
        "data_source": config.data.source,
        "seq_len": config.data.seq_len,
    }
    start = time.perf_counter()
    total = sum(len(ds) for ds in splits.values())
    print(
        f"scaletrain: distill-cache: teacher {config.distill.teacher} over {total} rows "
        f"({', '.join(f'{len(ds)} {s}' for s, ds in splits.items())}) into {args.out_dir}",
        flush=True,
    )
    with _progress(total, quiet=config.log.quiet) as bar:
        written = write_cache(
            args.out_dir,
            splits=splits,
            info=info,
            top_k=config.distill.top_k,
            targets_fn=lambda b: teacher_targets(teacher, b, kd.needs),
            report=bar.write,
            advance=bar.update,
        )
    rows = sum(s["rows"] for s in written["splits"].values())
    wall = time.perf_counter() - start
    print(
        f"scaletrain: teacher-output cache {args.out_dir} ({rows} rows in {wall:.1f} s, "
        f"{rows / wall:.0f} rows/s); train from it with distill.cache={str(args.out_dir)!r}"
    )
    return 0


def _progress(total: int, *, quiet: bool):
    """A rows bar on stderr for a terminal; off in a log (not a tty) or with log.quiet, where
    each split's one line (`write`, on stdout) is all that is printed."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="rows",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
        disable=quiet or not sys.stderr.isatty(),
    )


def _encoder_dir(model: str) -> tuple[Path, Path]:
    """(weights directory, tokenizer directory) of what `scaletrain eval` was given."""
    from scaletrain.distill.teacher import MINILM, packaged_minilm_dir, resolve_tokenizer_dir

    if model == MINILM:
        d = packaged_minilm_dir()
        return d, d
    path = Path(model).expanduser()
    if (path / "config.toml").is_file():  # a scaletrain run: its hf-model and its tokenizer
        config = load_config(path / "config.toml")
        if not (path / "hf-model").is_dir():
            raise ConfigError(
                f"run directory {model!r} has no hf-model/: `scaletrain eval` scores "
                "Hugging Face encoders (model.name = 'hf' on sentences)"
            )
        weights = _safetensors_dir(path / "hf-model", model)
        if _has_tokenizer(weights):  # the trainer saves it beside the weights
            return weights, weights
        return weights, resolve_tokenizer_dir(str(config.data.kwargs.get("tokenizer", MINILM)))
    if (path / "config.json").is_file():
        weights = _safetensors_dir(path, model)
        return weights, weights if _has_tokenizer(weights) else packaged_minilm_dir()
    raise ConfigError(
        f"MODEL {model!r} is neither a scaletrain run directory, a Hugging Face "
        f"directory, nor {MINILM!r}"
    )


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "vocab.txt").is_file()


def _safetensors_dir(path: Path, model: str) -> Path:
    """`path`, which must hold safetensors weights: pickle weights (pytorch_model.bin) are
    refused, never loaded, since unpickling can run code (the README's promise)."""
    from scaletrain.models.hf_files import PICKLE_SUFFIXES

    if any(path.glob("*.safetensors")):
        return path
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    held = f"holds {', '.join(pickles)} instead of" if pickles else "has no"
    raise ConfigError(
        f"MODEL {model!r}: {str(path)!r} {held} safetensors weights; scaletrain "
        "eval loads only *.safetensors (a pickle can run code when loaded): "
        "convert it once, in a trusted environment, with `AutoModel.from_pretrained"
        "(dir).save_pretrained(new_dir)` (transformers 5 writes safetensors)"
    )


def cmd_eval(args: argparse.Namespace) -> int:
    from scaletrain.distill.evaluate import (
        encoder_report,
        held_out_sentences,
        hf_encoder,
        speed_ratio,
    )
    from scaletrain.models.hf_files import _import_transformers

    logging = _import_transformers().utils.logging
    logging.set_verbosity_error()  # the student has no pooler (unused): not worth a warning
    logging.disable_progress_bar()
    model_dir, tok_dir = _encoder_dir(args.model)
    encode = hf_encoder(model_dir, tokenizer_dir=tok_dir, max_len=args.max_len)
    teacher = None
    if args.teacher:
        t_dir, t_tok = _encoder_dir(args.teacher)
        teacher = hf_encoder(t_dir, tokenizer_dir=t_tok, max_len=args.max_len)
    report = encoder_report(encode, teacher=teacher)
    if teacher is not None and not args.no_speed:
        report["speed"] = speed_ratio(encode, teacher, held_out_sentences())
    for line in format_report(report):
        print(line)
    out = args.out or (
        Path(args.model) / "eval.json" if (Path(args.model) / "config.toml").is_file() else None
    )
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"scaletrain: scores in {out}")
    return 0


def format_report(report: dict) -> list[str]:
    """One line per figure. With a teacher: the scores' ratios and the kinds' cosines to
    the teacher, worst first, then the held-out news cosine and the speed; alone, the
    scores in a fixed order."""
    if "teacher" not in report:
        return [f"{key:<12} {_score(report[key]):.4f}" for key in SCORE_LINES]
    ranked = report.get("worst_first") or [(k, report["ratio"][k]) for k in SCORE_LINES]
    lines = ["worst first: each score's ratio to the teacher, each kind's cosine to it"]
    lines += [_figure_line(report, name) for name, _ in ranked]
    if "cosine_held_out" in report:
        lines.append(
            f"{'cosine':<12} {report['cosine_held_out']:.4f} (student-teacher, held-out news)"
        )
    if "speed" in report:
        lines.append(_speed_line(report["speed"]))
    return lines


def _figure_line(report: dict, name: str) -> str:
    """A score with the teacher's and the ratio, or a kind's cosine to the teacher."""
    if name in SCORE_LINES:
        score, teacher = _score(report[name]), _score(report["teacher"][name])
        return f"{name:<12} {score:.4f}   teacher {teacher:.4f}   ratio {report['ratio'][name]:.3f}"
    kind = report["cosine_by_kind"][name]
    return (
        f"{name:<12} {kind['cosine']:.4f}   cosine to the teacher on "
        f"{kind['sentences']} held-out sentences"
    )


def _speed_line(sp: dict) -> str:
    low, high = sp["ci95"]
    return (
        f"{'speed':<12} {sp['student_sentences_per_s']:.0f} sentences/s   teacher "
        f"{sp['teacher_sentences_per_s']:.0f}   ratio {sp['ratio']:.2f} (95% CI "
        f"{low:.2f}-{high:.2f}, {sp['rounds']} rounds; forwards alone, tokenizing "
        f"{sp['tokenize_sentences_per_s']:.0f} sentences/s apart)"
    )


def _score(entry) -> float:
    if isinstance(entry, dict):
        for k in ("pearson", "spearman", "accuracy"):
            if k in entry:
                return float(entry[k])
    return float(entry)


def explain_rows(config) -> dict[str, str]:
    """What `scaletrain explain` says about [distill]: the teacher, the loss, the cache."""
    d = config.distill
    if not (d.teacher or d.cache):
        return {}
    terms = []
    if config.data.source != "sentences":
        terms.append(f"{1 - d.alpha:g} x hard + {d.alpha:g} x T^2 KL (T = {d.temperature:g})")
    for weight, name in (
        (d.hidden_weight, "hidden MSE"),
        (d.attention_weight, "attention MSE"),
        (d.cosine_weight, f"cosine ({d.cosine_on})"),
    ):
        if weight:
            terms.append(f"{weight:g} x {name}")
    return {
        "distillation teacher": (
            f"cached outputs in {d.cache}"
            if d.cache
            else f"{d.teacher} (frozen, replicated per rank, {d.teacher_precision} precision)"
        ),
        "distillation loss": " + ".join(terms) + ", summed per example",
        "student layers": (
            f"initialised from teacher blocks {list(d.init_layers)}"
            if d.init_layers
            else "the student's own initialisation"
        ),
    }
