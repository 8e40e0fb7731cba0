"""Gradient accumulation is invariant to how the global batch is split: dp x accumulation in
{1x2, 2x2, 1x4} end 5 steps with the same parameters and the same logged losses as one
process on the whole batch, in float64 to 1e-9 (a proof on any CPU); for the MLP (AdamW, and
SGD without clipping, which unlike Adam sees a wrongly scaled gradient) and for the GPT on
padded paragraphs, where target counts differ between micro-batches and ranks. Also: peak
memory falls with accumulation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import load_weights, losses, max_abs_diff, run_workers
from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.data.sources import load_source

TOL = 1e-9

COMMON = """
[optim]
lr = 3e-3
warmup_steps = 1
grad_clip = 1.0
[train]
steps = 5
seed = 11
eval_examples = 32
[log]
every = 1
quiet = true
"""
MLP = '[model]\nname = "mlp"\nsize = "small"\n[data]\nsource = "digits"\n'
CASES = {  # name -> (model and data, global batch, extra overrides)
    "mlp": (MLP, 64, []),
    "mlp-sgd": (MLP, 64, ["optim.name=sgd", "optim.grad_clip=0", "optim.lr=0.5"]),
    "gpt-ragged": ('[model]\nname = "gpt"\nsize = "tiny"\n[data]\n'
                   'source = "wikitext-paragraphs"\nseq_len = 256\n', 16, []),
}
# (dp, accumulation); dp alone (2 x 1) is test_dp_parity's case, not repeated here.
LAYOUTS = [(1, 2), (2, 2), (1, 4)]




def test_padded_paragraphs_really_are_ragged() -> None:
    """Without differing counts the GPT case below would not test the normalisation."""
    data = load_source("wikitext-paragraphs", split="train", seq_len=256)
    sampler = GlobalBatchSampler(len(data), global_batch=16, micro_batch=4, dp_rank=0,
                                 dp_size=1, seed=11)
    counts = {data.get(idx).count for step in range(5) for idx in sampler.micro_batches(step)}
    assert len(counts) > 1, counts


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(CASES))
def test_accumulation_and_dp_match_one_big_batch(tmp_path: Path, model: str) -> None:
    body, batch, extra = CASES[model]
    config = tmp_path / "cfg.toml"
    config.write_text(body + COMMON)

    def run(dp: int, acc: int) -> Path:
        run_dir = tmp_path / f"dp{dp}-acc{acc}"
        run_workers(config, [f"train.global_batch={batch}", f"train.micro_batch={batch // (dp * acc)}",
                             f"parallel.dp={dp}", "precision.mode=fp64", *extra],
                    world_size=dp, run_dir=run_dir)
        return run_dir

    reference = run(1, 1)
    ref_weights, ref_losses = load_weights(reference), losses(reference)
    for dp, acc in LAYOUTS:
        run_dir = run(dp, acc)
        diff = max_abs_diff(load_weights(run_dir), ref_weights)
        assert diff < TOL, f"dp={dp} x acc={acc}: parameters differ by {diff:.3g}"
        assert losses(run_dir) == pytest.approx(ref_losses, rel=TOL), f"dp={dp} x acc={acc}"


@pytest.mark.slow
def test_peak_memory_falls_with_accumulation(tmp_path: Path) -> None:
    """The same global batch of 2048 MNIST images: 1 micro-batch vs 8 (measured peak RSS)."""
    config = tmp_path / "cfg.toml"
    config.write_text('[model]\nname = "cnn"\nsize = "small"\n[data]\nsource = "mnist"\n'
                      '[train]\nsteps = 2\nglobal_batch = 2048\neval_examples = 8\n'
                      '[log]\nevery = 1\nquiet = true\n')
    peaks = {}
    for acc in (1, 8):
        run_dir = tmp_path / f"acc{acc}"
        run_workers(config, [f"train.micro_batch={2048 // acc}", "parallel.dp=1"], world_size=1,
                    run_dir=run_dir)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        peaks[acc] = max(r["peak_mem_bytes"] for r in rows if r["kind"] == "train")
    assert peaks[8] < 0.75 * peaks[1], {k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()}
