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
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.data.sources import TaskSpec
from scaletrain.models.hf_files import (
    HFModelError,
    _check_model_dir,
    _import_transformers,
    _read_json,
    weight_files,
)
from scaletrain.models.hf_spec import hf_spec

TEXT_SOURCES = "data.source = 'wikitext', 'wikitext-paragraphs', 'synthetic-text', or text shards"


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


# ----------------------------------------------------------------------------- loading


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


# ------------------------------------------------------------------------------- spec
