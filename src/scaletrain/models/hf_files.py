"""A Hugging Face model directory on disk: which safetensors files are its weights (as
transformers chooses them), where each tensor is in them (for a meta-built model's sliced
reads), and the directory scaletrain writes (config, weights, tokenizer, sentence-transformers'
pooling). Pickle weights are refused, never opened."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from scaletrain.models.init import WeightFiles
from scaletrain.user_code import UserCodeError


class HFModelError(UserCodeError):
    """A Hugging Face directory, config or kwarg that scaletrain cannot train; the message
    names the config key and its value (shown as one line, exit status 2, like any mistake
    in the user's own model)."""


def _import_transformers():
    # The hub reads these once, at its own import: set them before the first import.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError as e:
        raise HFModelError(
            f"model.name = 'hf' needs the transformers package: pip install scaletrain[hf] ({e})"
        ) from e
    # 5.x draws a "Loading weights" bar on stderr for every from_pretrained: noise in every
    # rank's log, and it would break the launcher's one-line refusals.
    transformers.utils.logging.disable_progress_bar()
    return transformers


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


CONVERT_HINT = (
    "convert it once, in a trusted environment, with `AutoModelForCausalLM."
    "from_pretrained(dir).save_pretrained(new_dir)` (transformers 5 writes "
    "safetensors) and point model.path at new_dir, or move the pickle files out"
)


def save_hf(
    model: nn.Module,
    out_dir: Path,
    *,
    state_dict: dict | None = None,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write `model` as a Hugging Face directory (config.json + safetensors) and return it.

    `build_hf_model(path=out_dir, ...)` and `AutoModelForCausalLM.from_pretrained(out_dir)`
    read it back. Under torch.distributed only rank 0 writes (HF's own rule); pass the
    bare, unsharded model, or with a sharded one its gathered full `state_dict`.

    With `tokenizer_dir` (the data's tokenizer: a sentence encoder's, data.source =
    'sentences') the tokenizer is saved beside the weights, and for an encoder (a base
    model, no output head) sentence-transformers' modules.json and mean pooling too: the
    directory is then a whole encoder, loaded as it is by `AutoTokenizer` + `AutoModel` or
    `SentenceTransformer(out_dir)`. Without it, `AutoTokenizer.from_pretrained(out_dir)`
    silently builds an empty 5-token tokenizer from config.json alone.
    """
    out_dir = Path(out_dir)
    if out_dir.is_file():  # save_pretrained only logs this and returns
        raise HFModelError(
            f"cannot save the model to {str(out_dir)!r}: it is a file, not a directory"
        )
    # 5.x always writes safetensors: `safe_serialization` is no longer a parameter (it
    # would fall silently into **kwargs), so the format is checked afterwards instead.
    # The saved config says use_cache = True, as HF's inference expects: the cache is
    # off only for training.
    config = model.config
    use_cache, config.use_cache = config.use_cache, True
    try:
        model.save_pretrained(out_dir, state_dict=state_dict)
    finally:
        config.use_cache = use_cache
    pickles = sorted(p.name for p in out_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles or not any(out_dir.glob("*.safetensors")):
        raise HFModelError(
            f"save_pretrained wrote {pickles or 'no safetensors weights'} in "
            f"{str(out_dir)!r}; scaletrain writes only safetensors"
        )
    if tokenizer_dir is not None:
        _save_tokenizer(model, out_dir, tokenizer_dir)
    return out_dir


def _save_tokenizer(model: nn.Module, out_dir: Path, tokenizer_dir: Path) -> None:
    """The data's tokenizer beside the weights, and for an encoder (no output head)
    sentence-transformers' modules.json and mean pooling: a whole encoder (`save_hf`)."""
    tokenizer = _import_transformers().AutoTokenizer.from_pretrained(
        str(tokenizer_dir), local_files_only=True
    )
    tokenizer.save_pretrained(out_dir)
    if model.get_output_embeddings() is None:  # an encoder: its sentence embedding
        config = model.config
        _save_mean_pooling(
            out_dir,
            width=int(config.hidden_size),
            max_len=min(int(config.max_position_embeddings), int(tokenizer.model_max_length)),
        )


def save_hf_beside(
    model: nn.Module, out_dir: Path, weights: Path, *, tokenizer_dir: Path | None = None
) -> Path:
    """A Hugging Face directory for weights already written whole (a split model's
    model.safetensors, joined from every rank's shards): config.json (and the generation
    config) from `model`, and the file itself, hard-linked (copied where it cannot be)
    as out_dir/model.safetensors. `from_pretrained(out_dir)` reads it as it reads
    save_pretrained's. `tokenizer_dir`: as for `save_hf`."""
    import shutil

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config
    use_cache, config.use_cache = config.use_cache, True  # as save_hf: inference expects it
    try:
        config.save_pretrained(out_dir)
    finally:
        config.use_cache = use_cache
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out_dir)
    target = out_dir / "model.safetensors"
    target.unlink(missing_ok=True)
    try:
        target.hardlink_to(weights)
    except OSError:
        shutil.copyfile(weights, target)
    if tokenizer_dir is not None:
        _save_tokenizer(model, out_dir, tokenizer_dir)
    return out_dir


def _save_mean_pooling(out_dir: Path, *, width: int, max_len: int) -> None:
    """sentence-transformers' description of the encoder: the transformer, then the mean over
    the attention mask, the pooling every distillation loss and `scaletrain eval` use (no
    normalisation: cosines ignore the scale)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (out_dir / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_len, "do_lower_case": False}, indent=2) + "\n"
    )
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": width,
                "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": True,
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
            },
            indent=2,
        )
        + "\n"
    )


def _check_model_dir(path: str) -> Path:
    """The directory holds config.json and safetensors weights (pickle weights alone are refused)."""
    where = f"model.path = {path!r}"
    d = Path(path).expanduser()
    if not d.is_dir():
        raise HFModelError(
            f"{where}: no such directory (a local directory with config.json "
            "and *.safetensors weights; nothing is downloaded)"
        )
    if not (d / "config.json").is_file():
        raise HFModelError(f"{where} has no config.json: {str(d / 'config.json')!r} is missing")
    # Only the top level: that is all from_pretrained reads (an `original/` subfolder of
    # consolidated .pth files, as some Hub repos ship, is never opened). Pickle files next
    # to safetensors weights (a Trainer checkpoint's training_args.bin, optimizer.pt,
    # rng_state.pth) are never opened either: only the safetensors are loaded.
    pickles = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not any(d.glob("*.safetensors")) and not any(d.glob("*.safetensors.index.json")):
        if pickles:
            raise HFModelError(
                f"{where} holds {', '.join(pickles)} instead of safetensors weights: pickle "
                "files can run code when loaded, so scaletrain loads only safetensors; "
                f"{CONVERT_HINT}"
            )
        raise HFModelError(
            f"{where} has no weights: no *.safetensors file (model.safetensors, "
            "or model.safetensors.index.json and its shards)"
        )
    safetensors_files(d, where=where)  # the files from_pretrained reads are all there
    return d


def safetensors_files(d: Path, *, where: str) -> list[Path]:
    """The safetensors files `from_pretrained(d, use_safetensors=True)` reads, chosen as
    transformers chooses them: config.json's `transformers_weights` when it names one,
    else model.safetensors, else the shards model.safetensors.index.json names. Any other
    *.safetensors beside them (an EMA copy, an adapter) is never read.

    Raises:
        HFModelError: none of those exists, or a file they name is missing or outside `d`.
    """
    index_name = "model.safetensors.index.json"
    chosen = _read_json(d / "config.json", where=where).get("transformers_weights")
    if chosen is not None:
        entry = (d / str(chosen)).resolve()
        if not str(chosen).endswith((".safetensors", ".safetensors.index.json")) or (
            entry.parent != d.resolve()
        ):
            raise HFModelError(
                f"{where}: config.json's transformers_weights = {chosen!r} is not a "
                "*.safetensors or *.safetensors.index.json file of the directory itself"
            )
    elif (d / "model.safetensors").is_file():
        entry = d / "model.safetensors"
    else:
        entry = d / index_name
    if not entry.is_file():
        raise HFModelError(
            f"{where} has no {entry.name} (transformers reads model.safetensors, else "
            f"{index_name} and its shards, or the file config.json's transformers_weights "
            "names; other *.safetensors files are not its weights)"
        )
    if not entry.name.endswith(".index.json"):
        return [entry]
    shards = sorted(set(_read_json(entry, where=where).get("weight_map", {}).values()))
    missing = [s for s in shards if not (d / s).is_file() or Path(s).name != s]
    if missing:
        raise HFModelError(
            f"{where}: {entry.name} names shards that are missing: {', '.join(missing)}"
        )
    return [d / s for s in shards]


def weight_files(model: nn.Module, weights_dir: Path, *, where: str) -> WeightFiles:
    """Where each of the model's tensors is in a Hugging Face directory's safetensors (one
    file, or shards named by model.safetensors.index.json), checked against the model's
    shapes without reading a weight: a missing or mis-sized parameter is refused, as
    `_load_pretrained` refuses it (HF would initialise it at random). A name the files
    give without the base model's prefix ("layers.0..." for "model.layers.0...") is found."""
    from safetensors import safe_open

    located = {}
    for file in safetensors_files(weights_dir, where=where):
        with safe_open(str(file), framework="pt") as f:
            located.update(dict.fromkeys(f.keys(), file))
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    files, missing, mismatched = {}, [], []
    tensors = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    for name, tensor in tensors.items():
        key = name if name in located else name.removeprefix(prefix)
        if key not in located:
            if name in dict(model.named_parameters()):
                missing.append(name)
            continue
        with safe_open(str(located[key]), framework="pt") as f:
            shape = tuple(f.get_slice(key).get_shape())
        if shape != tuple(tensor.shape):
            mismatched.append(f"{name} {shape} != {tuple(tensor.shape)}")
        files[name] = (located[key], key)
    for kind, bad in (("missing keys", missing), ("mismatched keys", mismatched)):
        if bad:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise HFModelError(
                f"{where}: the safetensors weights do not fit its config.json ({kind}: "
                f"{shown}); HF would initialise those at random"
            )
    return WeightFiles(files)


def _read_json(file: Path, *, where: str) -> dict[str, Any]:
    try:
        values = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFModelError(f"{where}: {str(file)!r} is not readable JSON ({e})") from e
    if not isinstance(values, dict):
        raise HFModelError(
            f"{where}: {str(file)!r} holds a JSON {type(values).__name__}, not an object"
        )
    return values
