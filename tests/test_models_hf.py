"""models/hf.py: Hugging Face causal LMs, offline and safetensors-only, on tiny configs.

What is proved: the spec derived from HF metadata (blocks, TP targets, pipeline split);
building from a class name and from a config.json; weights that depend only on the seed,
in another process too; save_hf -> build from the directory round-trips exactly; pickle
and malformed directories are refused; scaletrain's already-shifted targets give HF's own
causal-LM loss (the label shift is applied once); every user mistake is an HFModelError
naming its key; float64 runs forward and backward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from scaletrain.data.sources import IGNORE_INDEX, Batch, TaskSpec, target_count  # noqa: E402
from scaletrain.loss import cross_entropy  # noqa: E402
from scaletrain.models.hf import HFModelError, build_hf_model, hf_spec  # noqa: E402
from scaletrain.models.hf_files import save_hf  # noqa: E402
from scaletrain.models.protocol import check_spec, model_spec, tp_targets  # noqa: E402

TINY = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TASK = TaskSpec("lm", (32,), 256)


def build(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return build_hf_model(path="", hf_config="LlamaConfig", kwargs={**TINY, **overrides}, task=TASK)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def write_llama_json(path: Path, **overrides) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(**{**TINY, **overrides}).to_json_file(str(path))
    return path


# ---------------------------------------------------------------------- build and spec


def test_build_from_class_name_and_spec():
    model = build()
    assert type(model).__name__ == "LlamaForCausalLM"  # HF's model itself, not wrapped
    assert next(iter(model.state_dict())) == "model.embed_tokens.weight"  # HF's keys
    assert model.config.use_cache is False and model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())

    spec = model.scaletrain_spec
    assert spec == hf_spec(model) and spec.source == "hugging-face"
    check_spec(model, spec)
    assert spec.blocks == "model.layers" and len(model.get_submodule(spec.blocks)) == 2
    expected = {
        f"model.layers.{i}.{name}": style
        for i in range(2)
        for name, style in [
            ("self_attn.q_proj", "colwise"),
            ("self_attn.k_proj", "colwise"),
            ("self_attn.v_proj", "colwise"),
            ("self_attn.o_proj", "rowwise"),
            ("mlp.gate_proj", "colwise"),
            ("mlp.up_proj", "colwise"),
            ("mlp.down_proj", "rowwise"),
        ]
    }
    assert tp_targets(model, spec) == expected  # HF's embedding/gather styles are dropped
    assert spec.pipeline is not None
    assert spec.pipeline.first == ("model.embed_tokens", "model.rotary_emb")
    assert spec.pipeline.blocks == "model.layers"
    assert spec.pipeline.last == ("model.norm", "lm_head")

    # The protocol derives the same spec for an HF model that carries none.
    del model.scaletrain_spec
    assert model_spec(model) == spec


def test_build_from_config_json_with_override(tmp_path):
    # A real config.json often says bfloat16; scaletrain keeps fp32 master weights anyway.
    file = write_llama_json(tmp_path / "config.json", dtype="bfloat16")
    torch.manual_seed(0)
    model = build_hf_model(path="", hf_config=str(file), kwargs={"num_hidden_layers": 3}, task=TASK)
    assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3
    assert model.config.hidden_size == 32  # the JSON's own keys stay
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.scaletrain_spec.blocks == "model.layers"
    # Same config, same seed: the file path and the class name build the same model.
    torch.manual_seed(1)
    from_file = build_hf_model(path="", hf_config=str(file), kwargs={}, task=TASK)
    assert same_weights(from_file, build(seed=1))


def test_weights_depend_only_on_the_seed():
    assert same_weights(build(seed=3), build(seed=3))
    assert not same_weights(build(seed=3), build(seed=4))


@pytest.mark.slow  # a second interpreter imports torch and transformers: ~8 s on 2 cores
def test_same_seed_in_another_process_builds_the_same_weights(tmp_path):
    """Another interpreter (another hash seed: set iteration order differs) builds the
    weights bit for bit, as every rank of a launch must."""
    out = tmp_path / "child.safetensors"
    code = (
        "import json, sys, torch; from safetensors.torch import save_file; "
        "from scaletrain.data.sources import TaskSpec; "
        "from scaletrain.models.hf import build_hf_model; torch.manual_seed(5); "
        "m = build_hf_model(path='', hf_config='LlamaConfig', kwargs=json.loads(sys.argv[1]), "
        "task=TaskSpec('lm', (32,), 256)); "
        "save_file({k: v.contiguous() for k, v in m.state_dict().items()}, sys.argv[2])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run(
        [sys.executable, "-c", code, json.dumps(TINY), str(out)], check=True, env=env, timeout=120
    )
    child, here = load_file(str(out)), build(seed=5).state_dict()
    assert child.keys() == here.keys() and all(torch.equal(child[k], here[k]) for k in here)


def test_import_does_not_import_transformers():
    code = "import sys, scaletrain.models.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------- save and load


def test_save_then_load_round_trips(tmp_path):
    model = build(seed=2)
    out = save_hf(model, tmp_path / "export")
    files = sorted(p.name for p in out.iterdir())
    weights = [f for f in files if not f.endswith(".json")]
    assert weights and all(f.endswith(".safetensors") for f in weights), files
    # The export is inference-ready (use_cache on); training keeps it off.
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False

    loaded = build_hf_model(path=str(out), hf_config="", kwargs={}, task=TASK)
    assert same_weights(loaded, model)
    assert loaded.training and loaded.config.use_cache is False
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert loaded.scaletrain_spec == model.scaletrain_spec


def test_pickle_weights_are_refused(tmp_path):
    model = build()
    model.config.to_json_file(str(tmp_path / "config.json"))
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(HFModelError, match=r"pytorch_model\.bin.*pickle") as e:
        build_hf_model(path=str(tmp_path), hf_config="", kwargs={}, task=TASK)
    assert "model.path" in str(e.value) and "save_pretrained(new_dir)" in str(e.value)

    # Safetensors next to pickles (a Trainer checkpoint's training_args.bin, optimizer.pt):
    # the safetensors load, the pickles are never opened (one that would fail to unpickle
    # proves it).
    save_hf(model, tmp_path / "both")
    (tmp_path / "both" / "training_args.bin").write_bytes(b"not a pickle at all")
    loaded = build_hf_model(path=str(tmp_path / "both"), hf_config="", kwargs={}, task=TASK)
    assert same_weights(loaded, model)


def test_malformed_directories_are_refused(tmp_path):
    def load(d):
        return build_hf_model(path=str(d), hf_config="", kwargs={}, task=TASK)

    with pytest.raises(HFModelError, match="no such directory"):
        load(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFModelError, match="no config.json"):
        load(tmp_path / "empty")
    write_llama_json(tmp_path / "empty" / "config.json")
    with pytest.raises(HFModelError, match=r"no weights: no \*\.safetensors"):
        load(tmp_path / "empty")

    # A sharded index naming a shard that is not there (and no model.safetensors, which
    # transformers would read instead of the index).
    good = save_hf(build(), tmp_path / "sharded")
    (good / "model.safetensors").unlink()
    (good / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(HFModelError, match="model-00002-of-00002.safetensors"):
        load(good)

    # Weights missing from the file: HF would only warn and initialise them at random.
    partial = save_hf(build(), tmp_path / "partial")
    tensors = load_file(str(partial / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFModelError, match=r"missing keys: model\.norm\.weight"):
        load(partial)


@pytest.mark.parametrize("layout", ["one file", "sharded"])
def test_the_weights_read_are_those_from_pretrained_reads(tmp_path, layout):
    """Another safetensors file beside the weights (an EMA copy, perturbed) is not read:
    the whole load and the meta build (each rank's slices located in the files) hold
    `from_pretrained`'s bits. The copy sorts after model.safetensors and before its shards'
    names would, so a glob that lets a later file win reads it either way."""
    from transformers import AutoModelForCausalLM

    from scaletrain.models.init import init_plan, materialize

    d = save_hf(build(seed=3), tmp_path / "model")
    state = load_file(str(d / "model.safetensors"))
    if layout == "sharded":  # two shards and their index, as save_pretrained writes them
        (d / "model.safetensors").unlink()
        names = sorted(state)
        halves = {
            "model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2],
        }
        for file, keys in halves.items():
            save_file({k: state[k] for k in keys}, str(d / file), metadata={"format": "pt"})
        weight_map = {k: file for file, keys in halves.items() for k in keys}
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    ema = {k: v + 1.0 for k, v in state.items()}
    for name in ("model_ema.safetensors", "zz-ema.safetensors"):
        save_file(ema, str(d / name), metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(
        str(d), local_files_only=True, dtype=torch.float32
    )

    whole = build_hf_model(path=str(d), hf_config="", kwargs={}, task=TASK)
    with torch.device("meta"):
        meta = build_hf_model(path=str(d), hf_config="", kwargs={}, task=TASK, meta=True)
    materialize(
        [meta],
        plan=init_plan(meta),
        seed=0,
        device=torch.device("cpu"),
        weights=meta.scaletrain_weights,
    )

    assert same_weights(whole, reference)
    assert same_weights(meta, reference)


# ------------------------------------------------------------------- label shift


def shift_case(model, *, pad: bool, shifted: bool = True):
    """scaletrain's loss per target (already-shifted targets, no labels=) and HF's own
    causal-LM loss on the full window (labels=, HF shifts), for one window w (B, T + 1)."""
    B, T = 3, 16
    w = torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(0))
    inputs = w[:, :-1]
    targets = (w[:, 1:] if shifted else w[:, :-1]).clone()  # targets[:, t] follows inputs[:, t]
    labels = w.clone()  # HF's form: labels[:, t + 1] is the target of position t
    if pad:  # the last 3 targets of row 0 carry no loss, in both forms
        targets[0, -3:] = IGNORE_INDEX
        labels[0, -3:] = IGNORE_INDEX
    count = target_count("lm", targets)
    assert count == B * T - (3 if pad else 0)
    batch = Batch(inputs=inputs, targets=targets, count=count, tokens=B * T)
    with torch.no_grad():
        loss_sum, n = cross_entropy(model(inputs), batch)  # positional call, as the step does
        hf_loss = model(w, labels=labels).loss
    return loss_sum / n, hf_loss


def sharpened_fp64_model():
    """A float64 model whose logits are far from uniform, so that predicting the wrong
    position changes the loss by O(1) (a fresh model's near-uniform logits give about
    ln 256 for any target)."""
    model = build().double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
    return model


def test_causal_window_logits_are_exact_in_float64():
    """The T-token forward scaletrain runs equals the first T positions of HF's T + 1
    window, to float64 rounding: attention is causal, so the extra token changes nothing."""
    model = sharpened_fp64_model()
    w = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        short, full = model(w[:, :-1]).logits, model(w).logits  # (B, T, V), (B, T + 1, V)
    assert short.dtype == torch.float64 and short.shape == (3, 16, 256)
    torch.testing.assert_close(short, full[:, :-1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("pad", [False, True], ids=["dense", "padded"])
def test_shifted_targets_give_hf_causal_lm_loss(pad):
    """scaletrain's sum / count equals HF's `model(w, labels=w).loss`. HF's loss upcasts
    with `logits.float()`, which DOWN-casts float64 logits to float32, so the comparison
    holds to float32 rounding (rtol 1e-6) and not to 1e-12; the exact float64 part is the
    logits test above. The tolerance is fine enough to fail: unshifted targets are off by
    far more."""
    model = sharpened_fp64_model()
    ours, theirs = shift_case(model, pad=pad)
    assert theirs.dtype == torch.float32  # HF's upcast (see the docstring)
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-6, atol=0)
    wrong, _ = shift_case(model, pad=pad, shifted=False)  # targets = inputs
    assert abs(float(wrong) - float(theirs)) > 1e3 * 1e-6 * float(theirs)


# ------------------------------------------------------------------------ refusals


def test_refuses_non_text_data():
    task = TaskSpec("classification", (1, 28, 28), 10)
    with pytest.raises(HFModelError, match=r"data kind 'lm'.*'classification'"):
        build_hf_model(path="", hf_config="LlamaConfig", kwargs=TINY, task=task)


def test_refuses_small_vocabulary_and_few_positions(tmp_path):
    with pytest.raises(HFModelError, match=r"model\.kwargs\.vocab_size = 100.*256"):
        build(vocab_size=100)
    with pytest.raises(
        HFModelError, match=r"model\.kwargs\.max_position_embeddings = 16.*length 32"
    ):
        build(max_position_embeddings=16)
    # A value from a JSON file names the file; an alias (GPT-2's n_positions) names the alias.
    file = write_llama_json(tmp_path / "c.json", vocab_size=100)
    with pytest.raises(HFModelError, match=r"model\.hf_config = '.*c\.json' has vocab_size = 100"):
        build_hf_model(path="", hf_config=str(file), kwargs={}, task=TASK)
    # A pretrained directory's sizes come with its weights: the message says so.
    saved = save_hf(build(), tmp_path / "saved")
    with pytest.raises(HFModelError, match=r"(?s)model\.path = .*has vocab_size = 256.*fixed"):
        build_hf_model(path=str(saved), hf_config="", kwargs={}, task=TaskSpec("lm", (32,), 300))
    with pytest.raises(HFModelError, match=r"model\.kwargs\.n_positions = 16"):
        build_hf_model(
            path="",
            hf_config="GPT2Config",
            task=TASK,
            kwargs=dict(vocab_size=256, n_embd=32, n_layer=1, n_head=4, n_positions=16),
        )


def test_refuses_unknown_class_with_did_you_mean():
    with pytest.raises(HFModelError, match=r"'LlamaConfg'.*did you mean 'LlamaConfig'"):
        build_hf_model(path="", hf_config="LlamaConfg", kwargs=TINY, task=TASK)
    with pytest.raises(HFModelError, match="not a model config"):
        build_hf_model(path="", hf_config="GenerationConfig", kwargs={}, task=TASK)


def test_refuses_bad_kwargs():
    # One the config class rejects (its validator), and one it would silently keep (a typo).
    with pytest.raises(
        HFModelError, match=r"(?s)model\.hf_config = 'LlamaConfig'.*attention heads"
    ):
        build(num_attention_heads=5)
    with pytest.raises(HFModelError, match=r"(?s)hidden_size.*expected int"):
        build(hidden_size="wide")
    with pytest.raises(
        HFModelError, match=r"model\.kwargs\.num_hidden_layer = 3.*did you mean 'num_hidden_layers'"
    ):
        build(num_hidden_layer=3)


def test_refuses_configs_without_a_causal_lm(tmp_path):
    with pytest.raises(HFModelError, match=r"model_type 't5'.*no causal-LM class"):
        build_hf_model(path="", hf_config="T5Config", kwargs={}, task=TASK)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "lama", "vocab_size": 256}))
    with pytest.raises(HFModelError, match=r"model_type = 'lama'.*did you mean 'llama'"):
        build_hf_model(path="", hf_config=str(bad), kwargs={}, task=TASK)
    with pytest.raises(HFModelError, match="no such file"):
        build_hf_model(path="", hf_config=str(tmp_path / "absent.json"), kwargs={}, task=TASK)


def test_refuses_path_and_config_together_and_kwargs_with_path(tmp_path):
    with pytest.raises(HFModelError, match="exactly one of model.path"):
        build_hf_model(path=str(tmp_path), hf_config="LlamaConfig", kwargs={}, task=TASK)
    with pytest.raises(HFModelError, match="only read with model.hf_config"):
        build_hf_model(path=str(tmp_path), hf_config="", kwargs={"x": 1}, task=TASK)


def test_missing_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(HFModelError, match=r"pip install scaletrain\[hf\]"):
        build(seed=0)


def test_offline_environment_is_set():
    build()
    assert os.environ["HF_HUB_OFFLINE"] and os.environ["TRANSFORMERS_OFFLINE"]


# ------------------------------------------------------------------------- float64


def test_float64_forward_and_backward():
    model = build().double()
    x = torch.randint(0, 256, (2, 32))
    logits = model(x).logits  # (B, T, V), default (sdpa) attention
    assert logits.dtype == torch.float64 and logits.shape == (2, 32, 256)
    loss, n = cross_entropy(model(x), Batch(inputs=x, targets=x.roll(-1, 1), count=64, tokens=64))
    (loss / n).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float64 for g in grads)
    assert all(torch.isfinite(g).all() for g in grads)
