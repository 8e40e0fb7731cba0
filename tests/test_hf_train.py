"""Hugging Face models train through scaletrain, offline, with the parity guarantee.

- A tiny `LlamaForCausalLM` built from a config (no weights on disk, no network) trains on
  the Wikipedia bytes with dp=2 and with dp=2 x 2 accumulation micro-batches, ending with
  the weights and losses of one process, in float64 within 1e-9; the padded
  paragraphs source (ragged token counts, -100 targets) as well.
- A local model directory (config.json + safetensors, as the run itself writes it to
  RUN_DIR/hf-model) fine-tunes from its weights.
- A directory holding a pickle `.bin` instead of safetensors is refused by the launcher,
  naming the file, with no traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import load_weights, losses, max_abs_diff, records, run_cli

pytest.importorskip("transformers")

TOL = 1e-9

CONFIG = """
[model]
name = "hf"
hf_config = "LlamaConfig"
[model.kwargs]
vocab_size = 256
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 64
[data]
source = "wikitext"
seq_len = 32
[optim]
lr = 3e-3
warmup_steps = 1
[train]
steps = 3
global_batch = 8
seed = 5
eval_examples = 32
[precision]
mode = "fp64"
[log]
every = 1
quiet = true
"""


def _train(tmp_path: Path, name: str, *, nproc: int, micro_batch: int, extra=()) -> Path:
    config = tmp_path / "hf.toml"
    config.write_text(CONFIG)
    run_dir = tmp_path / name
    result = run_cli(["train", str(config), "--nproc", str(nproc), "--run-dir", str(run_dir),
                      f"parallel.dp={nproc}", f"train.micro_batch={micro_batch}", *extra])
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("source", ["wikitext", "wikitext-paragraphs"])
def test_llama_from_config_dp2_and_accumulation_match_one_process(tmp_path: Path,
                                                                   source: str) -> None:
    extra = [f"data.source={source}"]
    reference = _train(tmp_path, "dp1", nproc=1, micro_batch=8, extra=extra)
    dp2_accum = _train(tmp_path, "dp2-accum", nproc=2, micro_batch=2, extra=extra)
    ref = load_weights(reference)
    assert next(iter(ref.values())).dtype == torch.float64
    assert any(k.startswith("model.layers.1.") for k in ref)  # HF's own names, no wrapper
    assert max_abs_diff(ref, load_weights(dp2_accum)) < TOL
    assert losses(dp2_accum) == pytest.approx(losses(reference), abs=TOL)
    assert records(dp2_accum, "eval")[-1]["perplexity"] == pytest.approx(
        records(reference, "eval")[-1]["perplexity"], rel=1e-9)
    if source == "wikitext":  # packed windows: every target counts
        assert records(reference)[0]["tokens"] == 8 * 32


@pytest.mark.slow
def test_saved_model_directory_fine_tunes_from_its_weights(tmp_path: Path) -> None:
    first = _train(tmp_path, "scratch", nproc=1, micro_batch=8)
    saved = first / "hf-model"
    assert (saved / "config.json").is_file() and list(saved.glob("*.safetensors"))
    assert not [p for p in saved.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
    # A learning rate too small to move the weights: the run starts from the saved ones.
    tuned = _train(tmp_path, "tuned", nproc=1, micro_batch=8,
                   extra=[f"model.path={saved}", "model.hf_config=''", "model.kwargs={}",
                          "optim.lr=1e-12",
                          "optim.warmup_steps=0", "train.steps=1"])
    start = load_weights(first)
    after = load_weights(tuned)
    assert max_abs_diff(start, after) < 1e-9
    # ... and its first loss is the trained model's, far below a fresh model's ~ln 256.
    assert losses(tuned)[0] < losses(first)[0]


def test_directory_with_a_pickle_file_is_refused(tmp_path: Path) -> None:
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama", "vocab_size": 256}')
    torch.save({"w": torch.zeros(1)}, model_dir / "pytorch_model.bin")
    config = tmp_path / "hf.toml"
    config.write_text(CONFIG)
    result = run_cli(["train", str(config), "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                      "parallel.dp=2", "train.micro_batch=4", f"model.path={model_dir}",
                      "model.hf_config=''", "model.kwargs={}"])
    assert result.returncode == 2, result.stderr
    assert "pytorch_model.bin" in result.stderr and "pickle" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "logs").exists()  # refused before any worker started
