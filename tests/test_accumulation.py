"""Gradient accumulation is invariant to how the global batch is split: dp x accumulation in
{1x2, 2x2, 1x4} end 5 steps with the same parameters and the same logged losses as one
process on the whole batch, in float64 to 1e-9 (a proof on any CPU); for the MLP (AdamW, and
SGD without clipping, which unlike Adam sees a wrongly scaled gradient) and for the GPT on
padded paragraphs, where target counts differ between micro-batches and ranks. Also: peak
memory falls with accumulation.

The runs train in one job per world size (harness.run_job); the single-process references
come from `trained`'s session cache, shared with test_dp_parity."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletrain.data.sampler import GlobalBatchSampler
from scaletrain.data.sources import load_source

from harness import Case, load_weights, losses, max_abs_diff, parity_case, records, run_job

TOL = 1e-9
MODELS = ("gpt-ragged", "mlp", "mlp-sgd")  # harness.PARITY_MODELS
# (dp, accumulation); dp alone (2 x 1, 4 x 1) is test_dp_parity's case, not repeated here.
LAYOUTS = [(1, 2), (2, 2), (1, 4)]


def test_padded_paragraphs_really_are_ragged() -> None:
    """Without differing counts the GPT case below would not test the normalisation."""
    data = load_source("wikitext-paragraphs", split="train", seq_len=64)  # PARITY_MODELS
    sampler = GlobalBatchSampler(
        len(data), global_batch=16, micro_batch=4, dp_rank=0, dp_size=1, seed=7
    )  # harness.PARITY_COMMON's seed
    counts = {data.get(idx).count for step in range(5) for idx in sampler.micro_batches(step)}
    assert len(counts) > 1, counts


@pytest.fixture(scope="module")
def runs(trained) -> dict:
    """{(model, dp, acc): run directory}: one job per world size; the references (1 x 1)
    are the session's, shared with test_dp_parity."""
    out = {}
    for world in (1, 2):
        keys = [(m, dp, acc) for m in MODELS for dp, acc in [(1, 1), *LAYOUTS] if dp == world]
        got = trained(
            {f"{m}-dp{dp}-acc{acc}": parity_case(m, dp=dp, acc=acc) for m, dp, acc in keys},
            world_size=world,
        )
        out |= {(m, dp, acc): got[f"{m}-dp{dp}-acc{acc}"].run_dir for m, dp, acc in keys}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dp, acc", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_accumulation_and_dp_match_one_big_batch(runs: dict, model: str, dp: int, acc: int) -> None:
    reference = runs[(model, 1, 1)]
    ref_weights, ref_losses = load_weights(reference), losses(reference)
    run_dir = runs[(model, dp, acc)]
    diff = max_abs_diff(load_weights(run_dir), ref_weights)
    assert diff < TOL, f"dp={dp} x acc={acc}: parameters differ by {diff:.3g}"
    assert losses(run_dir) == pytest.approx(ref_losses, rel=TOL), f"dp={dp} x acc={acc}"


@pytest.mark.slow
def test_peak_memory_falls_with_accumulation(tmp_path: Path) -> None:
    """The same global batch of 2048 MNIST images: 1 micro-batch vs 8 (measured peak RSS).

    One step of each, in one process (one job): 8 micro-batches first, so its peak is the
    process's own; the lifetime peak of the 1-micro-batch run after it can only be as high
    or higher, so if accumulation did not lower the peak the two would be equal and fail."""
    config = (
        '[model]\nname = "cnn"\nsize = "small"\n[data]\nsource = "mnist"\n'
        "[train]\nsteps = 1\nglobal_batch = 2048\neval_examples = 8\n"
        "[log]\nevery = 1\nquiet = true\n"
    )
    got = run_job(
        {
            f"acc{acc}": Case.of(config, f"train.micro_batch={2048 // acc}", "parallel.dp=1")
            for acc in (8, 1)
        },
        world_size=1,
        root=tmp_path,
    )
    peaks = {
        acc: max(r["peak_mem_bytes"] for r in records(got[f"acc{acc}"].run_dir)) for acc in (1, 8)
    }
    assert peaks[8] < 0.75 * peaks[1], {k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()}
