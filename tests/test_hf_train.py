"""Hugging Face models train through scaletrain, offline, with the parity guarantee.

- A tiny `LlamaForCausalLM` built from a config (no weights on disk, no network) trains on
  the Wikipedia bytes with dp=2 and with dp=2 x 2 accumulation micro-batches, ending with
  the weights and losses of one process, in float64 within 1e-9; the padded
  paragraphs source (ragged token counts, -100 targets) as well.
- A local model directory (config.json + safetensors, as the run itself writes it to
  RUN_DIR/hf-model) fine-tunes from its weights.
- A directory holding a pickle `.bin` instead of safetensors is refused by the launcher,
  naming the file, with no traceback.

The trainings run in one job per world size (harness.run_job).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import (
    Case,
    cli_main,
    forbid_starting,
    load_weights,
    losses,
    max_abs_diff,
    records,
)

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


SOURCES = ("wikitext", "wikitext-paragraphs")


def _case(*, dp: int, micro_batch: int, extra=()) -> Case:
    return Case.of(CONFIG, f"parallel.dp={dp}", f"train.micro_batch={micro_batch}", *extra)


@pytest.fixture(scope="module")
def runs(trained) -> dict[tuple[str, int], Path]:
    """{(source, dp): run}: one process on the whole batch, and dp=2 x 2 micro-batches,
    one job per world size."""
    out = {}
    for dp, micro in ((1, 8), (2, 2)):
        got = trained(
            {s: _case(dp=dp, micro_batch=micro, extra=[f"data.source={s}"]) for s in SOURCES},
            world_size=dp,
        )
        out |= {(s, dp): got[s].run_dir for s in SOURCES}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_llama_from_config_dp2_and_accumulation_match_one_process(runs: dict, source: str) -> None:
    reference, dp2_accum = runs[(source, 1)], runs[(source, 2)]
    ref = load_weights(reference)
    assert next(iter(ref.values())).dtype == torch.float64
    assert any(k.startswith("model.layers.1.") for k in ref)  # HF's own names, no wrapper
    assert max_abs_diff(ref, load_weights(dp2_accum)) < TOL
    assert losses(dp2_accum) == pytest.approx(losses(reference), abs=TOL)
    assert records(dp2_accum, "eval")[-1]["perplexity"] == pytest.approx(
        records(reference, "eval")[-1]["perplexity"], rel=1e-9
    )
    if source == "wikitext":  # packed windows: every target counts
        assert records(reference)[0]["tokens"] == 8 * 32


@pytest.mark.slow
def test_saved_model_directory_fine_tunes_from_its_weights(runs: dict, trained) -> None:
    first = runs[("wikitext", 1)]
    saved = first / "hf-model"
    assert (saved / "config.json").is_file() and list(saved.glob("*.safetensors"))
    assert not [p for p in saved.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
    # A learning rate too small to move the weights: the run starts from the saved ones.
    tuned = trained(
        {
            "tuned": _case(
                dp=1,
                micro_batch=8,
                extra=[
                    f"model.path={saved}",
                    "model.hf_config=''",
                    "model.kwargs={}",
                    "optim.lr=1e-12",
                    "optim.warmup_steps=0",
                    "train.steps=1",
                ],
            )
        },
        world_size=1,
    )["tuned"].run_dir
    start = load_weights(first)
    after = load_weights(tuned)
    assert max_abs_diff(start, after) < 1e-9
    # ... and its first loss is the trained model's, far below a fresh model's ~ln 256.
    assert losses(tuned)[0] < losses(first)[0]


def test_directory_with_a_pickle_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process, with the launcher and the worker replaced by functions that fail the
    test (harness.forbid_starting): the launcher's checks refuse it."""
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama", "vocab_size": 256}')
    torch.save({"w": torch.zeros(1)}, model_dir / "pytorch_model.bin")
    config = tmp_path / "hf.toml"
    config.write_text(CONFIG)
    forbid_starting(monkeypatch, tmp_path)
    code = cli_main(
        [
            "train",
            str(config),
            "--nproc",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            "parallel.dp=2",
            "train.micro_batch=4",
            f"model.path={model_dir}",
            "model.hf_config=''",
            "model.kwargs={}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: "), err
    assert "pytorch_model.bin" in err and "pickle" in err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "logs").exists()  # refused before any worker started
