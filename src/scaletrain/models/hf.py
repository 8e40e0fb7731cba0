"""Hugging Face causal language models (`model.name = 'hf'`), offline and safetensors-only.

Two ways in, one model out:
- `model.path`: fine-tune a local directory (config.json + `*.safetensors` weights, one file
  or an index and its shards). A directory whose weights are pickle files (`.bin`, `.pt`)
  is refused: `torch.load` of a pickle can run arbitrary code, so scaletrain never opens
  one (pickles next to safetensors weights, as in a Trainer checkpoint, are left unread).
- `model.hf_config`: train from scratch from a local config.json or a transformers config
  class name ("LlamaConfig"), with `model.kwargs` as its arguments (or overrides of the
  JSON). The weights come from `_init_weights`, drawn from the global torch RNG that the
  trainer seeds, so every rank (and every process with that seed) builds the same weights.

Nothing is downloaded: HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are set before transformers is
first imported, every call passes `local_files_only=True` and `trust_remote_code=False` (a
config that needs the Hub's custom code is refused, never executed). transformers is
imported inside the functions: it costs seconds, and `import scaletrain` must stay cheap.

The model is returned as HF builds it, not wrapped, so its state_dict keys (and
checkpoints) are HF's own, and `save_hf` writes a directory `from_pretrained` reads back.

The label shift happens once, in the data. scaletrain calls the model positionally,
`model(input_ids)` with input_ids (B, T) int64, and never passes `labels=`, so HF's internal
shift (logits[:, :-1] against labels[:, 1:]) is never applied. The loss
(`loss.cross_entropy`, through `protocol.output_logits`) reads `.logits` (B, T, V) and
compares logits[:, t] with targets[:, t], which the text sources have ALREADY shifted
(targets[:, t] is the token after inputs[:, t]; -100 = no loss). On a window w of T + 1
tokens this is exactly HF's `model(w, labels=w).loss` times the target count, because
attention is causal (tests/test_models_hf.py checks it).

What the techniques need (`hf_spec`) comes from HF's own metadata: `_no_split_modules`
names the block class (FSDP's unit), `config.base_model_tp_plan` the Megatron split and
`config.base_model_pp_plan` the pipeline order; nothing is hand-written per architecture.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.data.sources import TaskSpec
from scaletrain.models.init import WeightFiles
from scaletrain.models.spec import TP_STYLES, ModelSpec, PipelineSplit, check_spec
from scaletrain.user_code import UserCodeError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
CONVERT_HINT = (
    "convert it once, in a trusted environment, with `AutoModelForCausalLM."
    "from_pretrained(dir).save_pretrained(new_dir)` (transformers 5 writes "
    "safetensors) and point model.path at new_dir, or move the pickle files out"
)
TEXT_SOURCES = "data.source = 'wikitext', 'wikitext-paragraphs', 'synthetic-text', or text shards"


class HFModelError(UserCodeError):
    """A Hugging Face directory, config or kwarg that scaletrain cannot train; the message
    names the config key and its value (shown as one line, exit status 2, like any mistake
    in the user's own model)."""


def build_hf_model(
    *,
    path: str,
    hf_config: str,
    kwargs: dict[str, Any],
    task: TaskSpec,
    dtype: torch.dtype = torch.float32,
    meta: bool = False,
) -> nn.Module:
    """A causal LM for `task`: loaded from a local directory, or built from a config.

    Args:
        path: `model.path`, a local directory to fine-tune ("" when building from a config).
        hf_config: `model.hf_config`, a config.json file or a config class name ("" with path).
        kwargs: `model.kwargs`, the config's arguments (or overrides of the JSON's keys).
        task: the data's TaskSpec: kind "lm", vocabulary task.num_classes, sequence length
            task.input_shape[0].
        dtype: the parameters' dtype (the master weights': float32, or float64 for the
            fp64 precision mode), whatever the checkpoint or config.json says.
        meta: with `path`, build the model from its config.json on the current (meta)
            device and read no weights: `scaletrain_weights` names where each tensor is,
            and models/init.materialize reads each rank's slices once the layout has split
            the model.

    Returns:
        The HF model in `dtype` and train mode, `config.use_cache = False`, with
        `scaletrain_spec` set.

    Raises:
        HFModelError: transformers missing, a bad directory, config or kwarg, a model that
            is no causal LM, or one too small for the data's vocabulary or sequence length.
    """
    if bool(path) == bool(hf_config):
        raise HFModelError(
            "model.name = 'hf' needs exactly one of model.path (a local model "
            "directory) and model.hf_config (a config.json or a config class); "
            f"got path = {path!r}, hf_config = {hf_config!r}"
        )
    if path and kwargs:
        raise HFModelError(
            f"model.kwargs = {kwargs!r} is only read with model.hf_config; a "
            "model directory (model.path) brings its own config.json"
        )
    if task.kind not in ("lm", "encode"):
        raise HFModelError(
            "model.name = 'hf' trains causal language models on text (data kind 'lm'); the "
            f"data are {task.kind!r} (input shape {task.input_shape}). Choose a text source "
            f"({TEXT_SOURCES}), or a built-in model (mlp, cnn) for these data"
        )
    transformers = _import_transformers()
    if path:
        weights_dir = _check_model_dir(path)
        config = _call(
            f"model.path = {path!r}",
            lambda: transformers.AutoConfig.from_pretrained(
                str(weights_dir), local_files_only=True, trust_remote_code=False
            ),
        )
        origin = _Origin(f"model.path = {path!r} (its config.json)", {}, pretrained=True)
    else:
        config = _config_from(hf_config, kwargs, transformers)
        origin = _Origin(f"model.hf_config = {hf_config!r}", kwargs, pretrained=False)
    # Refuse before any weight is allocated or read: a mismatch should cost no time.
    if task.kind == "lm":
        _check_causal_lm(config, origin)
    _check_fits_task(config, task, origin)
    # Sentences for an encoder (data kind "encode", a distillation student): the base model,
    # whose output is the hidden states (no head).
    auto = transformers.AutoModelForCausalLM if task.kind == "lm" else transformers.AutoModel
    # dtype explicitly (float32, or float64 for precision fp64, so that float64 weights load
    # unrounded): in 5.x from_pretrained defaults to the checkpoint's dtype ("auto") and
    # from_config honours config.dtype, often bfloat16 in a real config.json; scaletrain
    # keeps fp32 master weights and casts in its precision policy. (5.x renamed torch_dtype
    # to dtype; the old name still works but warns.)
    if path and meta:  # the shapes now, each rank's slices of the weights later
        model = _call(
            f"model.path = {path!r}",
            lambda: auto.from_config(config, trust_remote_code=False, dtype=dtype),
        )
        model.scaletrain_weights = weight_files(  # models/init.WEIGHTS_ATTR
            model, weights_dir, where=f"model.path = {path!r}"
        )
    elif path:
        model = _load_pretrained(
            auto, weights_dir, config=config, where=f"model.path = {path!r}", dtype=dtype
        )
    else:
        model = _call(
            f"model.hf_config = {hf_config!r}",
            lambda: auto.from_config(config, trust_remote_code=False, dtype=dtype),
        )
    # Training never reuses past keys and values; a KV cache only costs memory. Attention
    # stays at HF's default ("sdpa"), which runs forward and backward in float64 on CPU, so
    # the parity tests need no "eager" fallback.
    model.config.use_cache = False
    model.train()  # from_pretrained returns eval mode; a built model starts in train mode
    model.scaletrain_spec = hf_spec(model)
    return model


def hf_spec(model: nn.Module) -> ModelSpec:
    """The ModelSpec derived from a PreTrainedModel's own metadata (source "hugging-face").

    blocks: the ModuleList whose children's class is in `model._no_split_modules`;
    tp_plan: `config.base_model_tp_plan`'s colwise/rowwise entries, prefixed by the base
    model's path; pipeline: `config.base_model_pp_plan`'s order around the blocks, plus the
    output head. A field whose metadata is missing is None.
    """
    base = _base_model_path(model)
    spec = ModelSpec(
        blocks=_hf_blocks(model),
        tp_plan=_hf_tp_plan(model, base),
        pipeline=_hf_pipeline(model, base),
        source="hugging-face",
    )
    check_spec(model, spec)
    return spec


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


# ----------------------------------------------------------------------------- loading


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


def _load_pretrained(
    auto, weights_dir: Path, *, config: Any, where: str, dtype: torch.dtype
) -> nn.Module:
    """from_pretrained, refusing a checkpoint that lacks or mis-sizes some weights: HF only
    warns and initialises those at random, which would fine-tune a partly untrained model."""
    model, info = _call(
        where,
        lambda: auto.from_pretrained(
            str(weights_dir),
            config=config,
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            dtype=dtype,
            output_loading_info=True,
        ),
    )
    for kind in ("missing_keys", "mismatched_keys"):
        bad = sorted(map(str, info.get(kind) or ()))
        if bad:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise HFModelError(
                f"{where}: the safetensors weights do not fit its config.json "
                f"({kind.replace('_', ' ')}: {shown}); HF would initialise "
                "those at random"
            )
    return model


def _config_from(hf_config: str, kwargs: dict[str, Any], transformers) -> Any:
    """A config from a JSON file (kwargs override its keys) or a class name (kwargs are its
    arguments); a kwarg the class rejects or does not know is refused."""
    where = f"model.hf_config = {hf_config!r}"
    file = Path(hf_config).expanduser()
    if file.is_dir():
        file = file / "config.json"
    if file.is_file() or hf_config.endswith(".json") or os.sep in hf_config:
        if not file.is_file():
            raise HFModelError(
                f"{where}: no such file (a local config.json, or a transformers "
                "config class such as 'LlamaConfig')"
            )
        values = _read_json(file, where=where)
        model_type = values.get("model_type")
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

        if model_type not in CONFIG_MAPPING_NAMES:
            close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING_NAMES), n=3)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise HFModelError(
                f"{where} has model_type = {model_type!r}, which transformers "
                f"{transformers.__version__} does not know (a config.json names "
                f'its architecture in "model_type"){hint}'
            )
        if "auto_map" in values:
            raise HFModelError(
                f'{where} needs custom code from the Hub ("auto_map"); '
                "scaletrain never runs remote code (trust_remote_code=False)"
            )
        cls = CONFIG_MAPPING[model_type]
        # One dict, one constructor: the kwargs land exactly as the JSON's keys do.
        config = _call(where, lambda: cls.from_dict({**values, **kwargs}), given=kwargs)
    else:
        cls = _config_class(hf_config, transformers)
        config = _call(where, lambda: cls(**kwargs), given=kwargs)
    _check_kwargs_known(config, kwargs)
    return config


def _config_class(name: str, transformers) -> type:
    where = f"model.hf_config = {name!r}"
    obj = getattr(transformers, name, None) if name.isidentifier() else None
    if isinstance(obj, type) and issubclass(obj, transformers.PreTrainedConfig):
        return obj
    if obj is not None:  # GenerationConfig, BitsAndBytesConfig: not an architecture
        kind = "class" if isinstance(obj, type) else type(obj).__name__
        raise HFModelError(
            f"{where} is a transformers {kind} but not a model config (a "
            "PreTrainedConfig such as 'LlamaConfig')"
        )
    names = [n for n in dir(transformers) if n.endswith("Config")]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.7)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise HFModelError(
        f"{where} is neither a local config.json nor a transformers model "
        f"config class (e.g. 'LlamaConfig', 'GPT2Config'){hint}"
    )


def _check_kwargs_known(config: Any, kwargs: dict[str, Any]) -> None:
    """Refuse a kwarg that only lands as a stray attribute (a typo: `num_hidden_layer`).

    HF configs store unknown keyword arguments as attributes and no model reads them, so a
    misspelt size would silently train the default. A key is known when it is a field of
    the config dataclass, an alias in its attribute_map, or was consumed by the config
    (a legacy name such as `rope_theta` that it folds into another field).
    """
    if not dataclasses.is_dataclass(config):
        return
    known = {f.name for f in dataclasses.fields(config)} | set(type(config).attribute_map)
    for key in kwargs:
        if key in known or key not in vars(config):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.7)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise HFModelError(
            f"model.kwargs.{key} = {kwargs[key]!r} is not a field of {type(config).__name__}, "
            f"which would keep it as a stray attribute and train its default instead{hint} (a "
            "key that some modeling code reads although it is no field can be set in a "
            "config.json given as model.hf_config)"
        )


def _check_causal_lm(config: Any, origin: _Origin) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HFModelError(
            f"{origin.where} is a {type(config).__name__} (model_type {config.model_type!r}), "
            "which has no causal-LM class in transformers (AutoModelForCausalLM); "
            "model.name = 'hf' trains decoder-only language models such as LlamaConfig, "
            "GPT2Config, Qwen2Config"
        )


def _check_fits_task(config: Any, task: TaskSpec, origin: _Origin) -> None:
    """The vocabulary covers every target id and the positions cover the sequence."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if vocab is not None and vocab < task.num_classes:
        raise HFModelError(
            f"{origin.value(config, 'vocab_size', vocab)}, fewer output logits than the data's "
            f"{task.num_classes} token ids (task.num_classes: byte-level text has 256): "
            f"{origin.fix(config, 'vocab_size', f'>= {task.num_classes}')}"
        )
    positions = getattr(text, "max_position_embeddings", None)
    seq_len = task.input_shape[0]
    if isinstance(positions, int) and positions < seq_len:
        raise HFModelError(
            f"{origin.value(config, 'max_position_embeddings', positions)}, fewer positions "
            f"than the data's sequence length {seq_len} (data.seq_len): "
            f"{origin.fix(config, 'max_position_embeddings', f'>= {seq_len}', seq_len=True)}"
        )


@dataclasses.dataclass(frozen=True)
class _Origin:
    """Where a config came from, so that a message names the key the user can change."""

    where: str  # "model.path = '...' (its config.json)" or "model.hf_config = '...'"
    kwargs: dict[str, Any]  # model.kwargs (empty with model.path)
    pretrained: bool  # model.path: the sizes come with the weights and cannot change

    def _given(self, config: Any, key: str) -> str | None:
        alias = type(config).attribute_map.get(key)  # GPT2: max_position_embeddings = n_positions
        return next((k for k in (key, alias) if k in self.kwargs), None)

    def value(self, config: Any, key: str, value: Any) -> str:
        given = self._given(config, key)
        if given is not None:
            return f"model.kwargs.{given} = {self.kwargs[given]!r}"
        return f"{self.where} has {key} = {value!r}"

    def fix(self, config: Any, key: str, bound: str, *, seq_len: bool = False) -> str:
        or_seq = " or lower data.seq_len" if seq_len else ""
        if self.pretrained:
            return f"a pretrained model's size is fixed: choose a model that fits{or_seq}"
        return f"set model.kwargs.{self._given(config, key) or key} {bound}{or_seq}"


def _call(where: str, thunk: Callable[[], Any], *, given: dict[str, Any] | None = None) -> Any:
    """Run a transformers constructor or loader; its complaint becomes an HFModelError."""
    errors: tuple[type[BaseException], ...] = (TypeError, ValueError, OSError, KeyError)
    try:
        from huggingface_hub.errors import StrictDataclassError  # 5.x's config validation

        errors += (StrictDataclassError,)
    except ImportError:
        pass
    try:
        return thunk()
    except HFModelError:
        raise
    except errors as e:
        with_kwargs = f" with model.kwargs = {given!r}" if given else ""
        raise HFModelError(
            f"{where}{with_kwargs}: transformers refused it: {type(e).__name__}: {e}"
        ) from e


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


# ------------------------------------------------------------------------------- spec


def _base_model_path(model: nn.Module) -> str:
    """The base model's module path ("model" for LlamaForCausalLM); "" if it is the model."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    return prefix if isinstance(base, nn.Module) and base is not model else ""


def _join(base: str, name: str) -> str:
    return f"{base}.{name}" if base else name


def _hf_blocks(model: nn.Module) -> str | None:
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in model.named_modules():  # shallowest first
        children = list(module.children())
        if (
            isinstance(module, nn.ModuleList)
            and children
            and all(type(c).__name__ in block_classes for c in children)
        ):
            return name
    return None


def _hf_tp_plan(model: nn.Module, base: str) -> dict[str, str] | None:
    """HF's plan, relative to the base model ("layers.*.self_attn.q_proj"), as fnmatch
    patterns of the full model. HF's "*" stands for a layer index; fnmatch's "*" matches
    it too. Only plain "colwise" and "rowwise" are kept: HF's other styles
    ("embedding_rowwise", "colwise_gather_output", "packed_colwise", "local_*", expert and
    sequence-parallel styles) have no counterpart in scaletrain's TP, and an entry that
    matches anything but nn.Linear (fused expert parameters) is dropped too, so the plan
    check_spec sees is one scaletrain can apply."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not plan:
        return None
    modules = dict(model.named_modules())
    out = {}
    for key, style in plan.items():
        pattern = _join(base, key)
        matched = [m for n, m in modules.items() if fnmatch.fnmatchcase(n, pattern)]
        if style in TP_STYLES and matched and all(isinstance(m, nn.Linear) for m in matched):
            out[pattern] = style
    return out or None


def _hf_pipeline(model: nn.Module, base: str) -> PipelineSplit | None:
    """`base_model_pp_plan` lists the base model's children in forward order (embed_tokens,
    layers, norm); the blocks are the ModuleList among them. The base model's children the
    plan leaves out (rotary_emb: the position embeddings every layer is handed) go with the
    first modules, and the output head (lm_head) closes the last."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    if not plan:
        return None
    modules = dict(model.named_modules())
    names = [_join(base, key) for key in plan]
    blocks = [n for n in names if isinstance(modules.get(n), nn.ModuleList)]
    if len(blocks) != 1 or not all(n in modules for n in names):
        return None
    at = names.index(blocks[0])
    base_module = modules[base]
    unplanned = [
        _join(base, n) for n, _ in base_module.named_children() if _join(base, n) not in names
    ]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = [n for n, m in modules.items() if head is not None and m is head][:1]
    return PipelineSplit(
        first=tuple(names[:at] + unplanned),
        blocks=blocks[0],
        last=tuple(names[at + 1 :] + head_name),
    )
