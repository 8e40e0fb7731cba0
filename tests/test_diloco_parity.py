"""DiLoCo is exact where it must be, on gloo in float64 (parallel/diloco.py):

- With H = 1, inner SGD without momentum and an outer SGD step of lr 1 without momentum,
  two islands train the weights and log the losses of DDP within 1e-12. The islands are of
  1 rank (dp), of FSDP (dp_shard=2), tensor parallel (tp=2) and pipeline (pp=2), on packed
  and on ragged data. On ragged data the FedAvg weighting by each island's token count is
  what makes it DDP's gradient; a plain mean of the islands' steps is not.
- With one island, DiLoCo at H = 3 (inner SGD with momentum, outer Nesterov) ends with the
  weights of the algorithm written out below in this process: plain training with the
  inner optimizer, the outer step every 3 steps and at the last.
- A run stopped mid-interval and resumed ends bit-identical to the uninterrupted one, with
  Streaming DiLoCo (2 fragments, an overlapped exchange pending at the stop) and int4
  pseudo-gradients on.
- `comm_bytes_per_step`: an exchange every step sends DDP's bytes (plus the weight); the
  streaming int4 run sends a small fraction of it.

Runs go through the session's pools of ranks (conftest's `trained`), one job per world size.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch

from harness import Case, load_weights, max_abs_diff, records

pytestmark = pytest.mark.slow

TOL = 1e-12
STEPS = 3
CONFIG = f"""
[model]
name = "gpt"
size = "small"        # 4 blocks, 4 heads: tp=2 splits heads, pp=2 stages get 2 blocks each
[data]
seq_len = 32
[optim]
name = "sgd"
lr = 0.5
momentum = 0.0
grad_clip = 0.0       # clipping is per island: DDP clips the global gradient
schedule = "constant"
[train]
steps = {STEPS}
seed = 7
global_batch = 16
micro_batch = 8
eval_examples = 16
[log]
every = 1
quiet = true
[precision]
mode = "fp64"
"""
DATA = {"packed": "data.source=wikitext", "ragged": "data.source=wikitext-paragraphs"}
# H = 1 with plain outer SGD of lr 1: the outer step undoes nothing and adds nothing
AS_DDP = (
    "parallel.strategy=diloco",
    "diloco.sync_every=1",
    "diloco.outer_lr=1.0",
    "diloco.outer_momentum=0.0",
    "diloco.nesterov=false",
)
# name -> (world size, the island's layout)
ISLANDS = {
    "dp": (2, ()),
    "dp_shard2": (4, ("parallel.dp_shard=2", "train.micro_batch=4")),
    "tp2": (4, ("parallel.tp=2",)),
    "pp2": (4, ("parallel.pp=2", "parallel.pp_schedule=1f1b")),
}

# Streaming DiLoCo, int4, an overlapped exchange: stopped at 6 of 10, resumed.
STREAM_STEPS, STOP = 10, 6
STREAMING = (
    "data.source=wikitext-paragraphs",
    "parallel.strategy=diloco",
    "parallel.dp_replicate=2",
    f"train.steps={STREAM_STEPS}",
    "diloco.sync_every=4",
    "diloco.fragments=2",
    "diloco.overlap_steps=1",
    "diloco.quantize=int4",
    "diloco.quantize_block=64",
    "optim.name=adamw",
    "optim.lr=3e-3",
)

# The same streaming run (unquantized: int8/int4 blocks follow each rank's shard, so they
# are the layout's own) under islands of FSDP, stopped and resumed as islands of TP.
RESHARD = tuple(o for o in STREAMING if not o.startswith("diloco.quantize"))
FSDP_ISLANDS, TP_ISLANDS = ("parallel.dp_shard=2", "train.micro_batch=4"), ("parallel.tp=2",)

# One island, H = 3: MLP on digits, inner SGD with momentum, outer Nesterov (the defaults).
ONE_ISLAND_STEPS, H = 7, 3
ONE_ISLAND = f"""
[model]
name = "mlp"
size = "tiny"
[data]
source = "digits"
[optim]
name = "sgd"
lr = 0.1
momentum = 0.9
grad_clip = 0.0
schedule = "constant"
[train]
steps = {ONE_ISLAND_STEPS}
seed = 3
global_batch = 32
micro_batch = 32
eval_examples = 32
[log]
every = 1
quiet = true
[precision]
mode = "fp64"
"""


def _cases() -> dict[int, dict[str, Case]]:
    """Every run of this file, by world size and name."""
    cases: dict[int, dict[str, Case]] = {1: {}, 2: {}, 4: {}}
    for kind, data in DATA.items():
        cases[2][f"ddp-{kind}"] = Case.of(CONFIG, data, "parallel.dp_replicate=2")
        for name, (world, layout) in ISLANDS.items():
            cases[world][f"islands-{name}-{kind}"] = Case.of(
                CONFIG, data, *AS_DDP, "parallel.dp_replicate=2", *layout
            )
    cases[2]["streaming"] = Case.of(CONFIG, *STREAMING)
    cases[2]["streaming-resumed"] = Case(
        CONFIG, ((*STREAMING, f"train.stop_after={STOP}"), STREAMING)
    )
    cases[4]["reshard"] = Case.of(CONFIG, *RESHARD, *FSDP_ISLANDS)
    cases[4]["reshard-resumed"] = Case(
        CONFIG, ((*RESHARD, *FSDP_ISLANDS, f"train.stop_after={STOP}"), (*RESHARD, *TP_ISLANDS))
    )
    cases[1]["one-island-init"] = Case.of(ONE_ISLAND, "train.steps=0")
    cases[1]["one-island"] = Case.of(
        ONE_ISLAND, "parallel.strategy=diloco", f"diloco.sync_every={H}"
    )
    return cases


@pytest.fixture(scope="module")
def runs(trained) -> dict[str, Path]:
    """Run name -> run directory; a world size's runs train (one job in the session's pool)
    when the first of them is asked for, so a selection of tests trains only its worlds."""
    cases = _cases()
    world_of = {name: world for world, named in cases.items() for name in named}

    class Lazy(dict):
        def __missing__(self, name: str) -> Path:
            got = trained(cases[world_of[name]], world_size=world_of[name])
            self.update({n: r.run_dir for n, r in got.items()})
            return self[name]

    return Lazy()


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir)]


@pytest.mark.parametrize("kind", list(DATA))
@pytest.mark.parametrize("island", list(ISLANDS))
def test_h1_islands_equal_ddp(runs: dict, island: str, kind: str) -> None:
    ddp, got = runs[f"ddp-{kind}"], runs[f"islands-{island}-{kind}"]
    cfg = tomllib.loads((got / "config.toml").read_text())
    assert cfg["parallel"]["strategy"] == "diloco" and cfg["parallel"]["dp_replicate"] == 2
    weights = max_abs_diff(load_weights(got), load_weights(ddp))
    losses = max(abs(a - b) for a, b in zip(_losses(got), _losses(ddp), strict=True))
    print(f"{island} ({kind}): max |difference| from DDP: weights {weights:.3g}, loss {losses:.3g}")
    assert weights < TOL and losses < TOL
    assert len(_losses(got)) == STEPS
    # The islands' inner steps see their own data alone: the logged gradient norm is rank
    # 0's island's, not DDP's global one (a gradient sync left on between the islands
    # gives the same weights here, at H = 1 on packed data, but DDP's norm).
    norms = [(a["grad_norm"], b["grad_norm"]) for a, b in zip(records(got), records(ddp))]
    assert all(abs(a - b) > 1e-6 * b for a, b in norms), norms


def test_ragged_islands_count_different_tokens(runs: dict) -> None:
    """The ragged runs are ragged where it matters: the two islands' shares of a step hold
    different numbers of target tokens (else FedAvg's weights would be equal anyway)."""
    from scaletrain.data.sampler import GlobalBatchSampler
    from scaletrain.data.sources import IGNORE_INDEX, load_source

    ds = load_source("wikitext-paragraphs", split="train", seq_len=32)
    counts = [
        [
            int((ds.targets[idx] != IGNORE_INDEX).sum())
            for idx in GlobalBatchSampler(
                len(ds), global_batch=16, micro_batch=8, dp_rank=rank, dp_size=2, seed=7
            ).micro_batches(step)
        ]
        for step in range(STEPS)
        for rank in (0, 1)
    ]
    assert any(counts[2 * s] != counts[2 * s + 1] for s in range(STEPS)), counts


def test_comm_bytes_per_exchange(runs: dict) -> None:
    """H = 1 exchanges every step: on packed data DDP's bytes (the whole fp64 gradient), on
    ragged data those plus the 8-byte weight of each island's token count. Streaming int4 at
    H = 4 sends far less per step (its final sync included)."""
    for kind, weight in (("packed", 0), ("ragged", 8)):
        ddp = [r["comm_bytes_per_step"] for r in records(runs[f"ddp-{kind}"])]
        islands = [r["comm_bytes_per_step"] for r in records(runs[f"islands-dp-{kind}"])]
        assert ddp[0] > 0 and islands == [b + weight for b in ddp], kind
    ddp = [r["comm_bytes_per_step"] for r in records(runs["ddp-packed"])]
    streaming = sum(r["comm_bytes_per_step"] for r in records(runs["streaming"]))
    assert 0 < streaming < ddp[0] * STREAM_STEPS / 4 / 8, (streaming, ddp[0])


def test_resume_mid_interval_with_streaming_and_int4_is_bit_identical(runs: dict) -> None:
    reference, resumed = runs["streaming"], runs["streaming-resumed"]
    a, b = load_weights(reference), load_weights(resumed)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    ref = {r["step"]: r for r in records(reference)}
    got = {r["step"]: r for r in records(resumed)}
    # resumed at STOP, not started again: every step logged once
    assert [r["step"] for r in records(resumed)] == list(range(1, STREAM_STEPS + 1))
    assert sorted(ref) == sorted(got)
    for step in range(STOP + 1, STREAM_STEPS + 1):
        for key in ("loss", "grad_norm", "lr", "comm_bytes_per_step", "examples_seen"):
            assert got[step][key] == ref[step][key], (step, key)
    # the quantized exchange is lossy: the islands trained, the run is not DDP's in disguise
    summary = json.loads((resumed / "summary.json").read_text())
    assert (
        summary["final_loss"] == json.loads((reference / "summary.json").read_text())["final_loss"]
    )


def test_resume_reshards_the_anchors_and_outer_momentum(runs: dict) -> None:
    """Stopped mid-interval under islands of dp_shard=2 (an overlapped exchange pending),
    resumed as islands of tp=2: the anchors, the outer momentum and each island's weights
    and inner optimizer reshard (DTensors by name), and the run ends where the uninterrupted
    one does, to the layouts' summation order."""
    reference, resumed = runs["reshard"], runs["reshard-resumed"]
    cfg = tomllib.loads((resumed / "config.toml").read_text())
    assert (cfg["parallel"]["tp"], cfg["parallel"]["dp_shard"]) == (2, 1)
    # resumed at STOP, not started again: every step logged once
    assert [r["step"] for r in records(resumed)] == list(range(1, STREAM_STEPS + 1))
    assert max_abs_diff(load_weights(resumed), load_weights(reference)) < 1e-9
    assert max(abs(a - b) for a, b in zip(_losses(resumed), _losses(reference))) < 1e-9


def test_one_island_equals_inner_training_plus_the_outer_step(runs: dict) -> None:
    """The algorithm written out in this process, from the run's initial weights: plain
    training with the inner optimizer (torch's SGD with momentum, as the run's), and every
    H steps (and at the last) the outer Nesterov step on the anchor, the parameters set to
    it; the inner optimizer's state is kept."""
    from scaletrain.config import load_config
    from scaletrain.data.sampler import GlobalBatchSampler
    from scaletrain.loss import cross_entropy
    from scaletrain.training.assemble import build_data, build_net

    run_dir = runs["one-island"]
    config = load_config(run_dir / "config.toml")
    ds = build_data(config, split="train")
    model = build_net(config, ds).double()  # precision.mode = fp64
    model.load_state_dict(load_weights(runs["one-island-init"]))
    params = list(model.parameters())
    inner = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    anchor = [p.detach().clone() for p in params]
    momentum = [torch.zeros_like(p) for p in params]
    outer_lr, mu = config.diloco.outer_lr, config.diloco.outer_momentum
    sampler = GlobalBatchSampler(
        len(ds), global_batch=32, micro_batch=32, dp_rank=0, dp_size=1, seed=3
    )
    for step in range(ONE_ISLAND_STEPS):
        batch = ds.get(sampler.micro_batches(step)[0])
        loss, count = cross_entropy(model(batch.inputs.double()), batch)
        (loss / count).backward()
        inner.step()
        inner.zero_grad()
        if (step + 1) % H == 0 or step + 1 == ONE_ISLAND_STEPS:
            with torch.no_grad():
                for p, a, m in zip(params, anchor, momentum):
                    delta = a - p  # the pseudo-gradient
                    m.mul_(mu).add_(delta)
                    a.sub_(outer_lr * (delta + mu * m))  # Nesterov
                    p.copy_(a)
    want = {k: v.detach() for k, v in model.state_dict().items()}
    got = load_weights(run_dir)
    diff = max_abs_diff(got, want)
    print(f"one island, H = {H}: max |difference| from the written-out algorithm {diff:.3g}")
    assert diff < TOL
    plain = max_abs_diff(load_weights(runs["one-island-init"]), want)
    assert plain > 1e-3  # it trained
