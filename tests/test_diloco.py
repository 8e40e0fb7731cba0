"""DiLoCo's pieces without a process group (parallel/diloco.py): the quantized payloads'
round-trip error bounds and sizes, the fragments and their staggered schedule, Streaming
DiLoCo's overlapped outer update against a hand-written reference in one process, and the
refusals of bad [diloco] values before any worker starts. The islands' exactness on gloo
is tests/test_diloco_parity.py."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import ConfigError, DiLoCoConfig, load_config
from scaletrain.launch.resolve import resolve
from scaletrain.parallel.diloco import DiLoCo, assign_fragments, check_fragments
from scaletrain.parallel.quantize import decode, encode, payload_bytes

# ------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8", "int4"])
@pytest.mark.parametrize("numel", [1, 127, 128, 1000])
def test_round_trip_error_bounds_and_sizes(fmt: str, numel: int) -> None:
    """decode(encode(x)) is within the format's bound of x, the payload has the size
    payload_bytes says (int4: two codes a byte), and the weight comes back exactly."""
    block = 128
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel), dtype=torch.float64)
    x[: min(numel, 5)] *= 100  # a few large values: the absmax of their block
    payload = encode(x, fmt=fmt, block=block, weight=12345.0)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(numel, fmt, block)
    y, weight = decode(payload, fmt=fmt, block=block, numel=numel, dtype=torch.float64)
    assert weight == 12345.0 and y.shape == x.shape
    err = (y - x).abs()
    if fmt in ("bf16", "fp16"):  # round to nearest: half a unit in the last place
        rel = {"bf16": 2.0**-8, "fp16": 2.0**-11}[fmt]
        assert bool((err <= rel * x.abs()).all()), float((err / x.abs()).max())
        return
    levels = {"int8": 127, "int4": 7}[fmt]
    padded = torch.zeros(-(-numel // block) * block, dtype=torch.float64)
    padded[:numel] = x
    absmax = padded.view(-1, block).abs().amax(dim=1).repeat_interleave(block)[:numel]
    bound = absmax / levels / 2 * (1 + 1e-6)  # half a step, fp32 scale rounding aside
    assert bool((err <= bound).all()), float((err / bound).max())
    codes = -(-numel // block) * block
    body = (codes if fmt == "int8" else codes // 2) + 4 * (codes // block)
    assert payload_bytes(numel, fmt, block) == 8 + -(-body // 8) * 8  # aligned to 8 bytes


def test_int_formats_keep_zero_blocks_and_signs() -> None:
    x = torch.zeros(256, dtype=torch.float64)
    x[128:] = torch.linspace(-1, 1, 128, dtype=torch.float64)
    for fmt in ("int8", "int4"):
        y, _ = decode(
            encode(x, fmt=fmt, block=128, weight=1.0),
            fmt=fmt,
            block=128,
            numel=256,
            dtype=torch.float64,
        )
        assert bool((y[:128] == 0).all())  # an all-zero block: scale 0, no division by it
        assert y[128] == -1 and y[-1] == 1  # the absmax itself is a code exactly
        assert bool((torch.sign(y[128:]) * torch.sign(x[128:]) >= 0).all())


def test_quantized_bytes_fall_with_the_format() -> None:
    n = 1 << 16
    fp32 = 4 * n
    assert payload_bytes(n, "bf16", 128) < fp32 / 2 + 16
    assert payload_bytes(n, "int8", 128) < fp32 / 4 * 1.04  # one fp32 scale per 128 codes
    assert payload_bytes(n, "int4", 128) < fp32 / 8 * 1.07


# ------------------------------------------------------------------------- fragments


def test_fragments_split_the_blocks_in_order() -> None:
    from scaletrain.models.gpt import GPT, GPT_SHAPES

    with torch.device("meta"):
        model = GPT(vocab_size=256, block_size=32, shape=GPT_SHAPES["small"])  # 4 blocks
    frag = assign_fragments(model, blocks="blocks", fragments=2)
    assert frag.keys() == dict(model.named_parameters()).keys()
    by_block = {int(n.split(".")[1]): f for n, f in frag.items() if n.startswith("blocks.")}
    assert by_block == {0: 0, 1: 0, 2: 1, 3: 1}
    assert frag["lm_head.weight"] == 1  # after the blocks: the last fragment
    embeddings = [n for n in frag if not n.startswith(("blocks.", "lm_head", "ln_f"))]
    assert embeddings and all(frag[n] == 0 for n in embeddings)
    assert set(assign_fragments(model, blocks="blocks", fragments=1).values()) == {0}
    with pytest.raises(ConfigError, match=r"4 repeated blocks.*allowed: \[1, 2, 4\]"):
        assign_fragments(model, blocks="blocks", fragments=3)
    with pytest.raises(ConfigError, match="no repeated blocks"):
        check_fragments(0, 2, model_label="model.name = 'mine'")


def test_staggered_schedule() -> None:
    keys = DiLoCoConfig(sync_every=4, fragments=2)
    p = torch.nn.Parameter(torch.zeros(2))
    d = DiLoCo([("w", p)], keys, fragment_of={"w": 0}, group=None, island=0, islands=1)
    at = {f: [t for t in range(1, 13) if d.syncs_at(f, t)] for f in (0, 1)}
    assert at == {0: [4, 8, 12], 1: [2, 6, 10]}


# ------------------------------------------- streaming with overlap, one process, by hand


def _reference(steps, *, h, f, tau, alpha, lr, mu, grads, frag):
    """Streaming DiLoCo written out for one island: per fragment an anchor and a momentum;
    at its sync the Nesterov outer step; its result copied in (tau = 0) or mixed in tau
    steps later; the last step syncs everything at once."""
    theta = {"w": torch.ones(3, dtype=torch.float64), "b": torch.full((2,), 2.0).double()}
    anchor = {k: v.clone() for k, v in theta.items()}
    m = {k: torch.zeros_like(v) for k, v in theta.items()}
    due = {}
    for t in range(1, steps + 1):
        for k in theta:  # the inner step: SGD on a step-dependent gradient
            theta[k] = theta[k] - 0.1 * grads(t, k, theta[k])
        last = t == steps
        for g, when in sorted(due.items()):
            if last or when == t:
                for k in (k for k in theta if frag[k] == g):
                    theta[k] = alpha * theta[k] + (1 - alpha) * anchor[k]
                del due[g]
        for g in range(f):
            if not (last or (t - g * h // f) % h == 0):
                continue
            for k in (k for k in theta if frag[k] == g):
                delta = anchor[k] - theta[k]
                m[k] = mu * m[k] + delta
                anchor[k] = anchor[k] - lr * (delta + mu * m[k])
                if tau == 0 or last:
                    theta[k] = anchor[k].clone()
            if tau and not last:
                due[g] = t + tau
    return theta


@pytest.mark.parametrize(
    "fragments, tau, quantize", [(1, 0, "none"), (2, 0, "none"), (2, 1, "none"), (2, 1, "int8")]
)
def test_streaming_outer_updates_match_the_hand_reference(fragments, tau, quantize) -> None:
    """The schedule, the per-fragment outer Nesterov step and the overlapped mix, in one
    process (one island: the exchange is the island's own pseudo-gradient). int8 changes
    what the outer step reads, so it must not match exactly (the check is sharp)."""

    def grads(t, k, value):
        return torch.sin(value * t + (1.0 if k == "w" else 2.0))

    keys = DiLoCoConfig(
        sync_every=4, fragments=fragments, overlap_steps=tau, quantize=quantize, outer_lr=0.7
    )
    params = {
        "w": torch.nn.Parameter(torch.ones(3, dtype=torch.float64)),
        "b": torch.nn.Parameter(torch.full((2,), 2.0, dtype=torch.float64)),
    }
    frag = {"w": 0, "b": fragments - 1}
    d = DiLoCo(list(params.items()), keys, fragment_of=frag, group=None, island=0, islands=1)
    steps = 11
    for t in range(1, steps + 1):
        with torch.no_grad():
            for k, p in params.items():
                p -= 0.1 * grads(t, k, p)
        d.step(count=7, last=t == steps)
    want = _reference(
        steps, h=4, f=fragments, tau=tau, alpha=0.5, lr=0.7, mu=0.9, grads=grads, frag=frag
    )
    diff = max(float((params[k].detach() - want[k]).abs().max()) for k in params)
    if quantize == "none":
        assert diff < 1e-12, diff
    else:  # close, not equal
        assert 1e-12 < diff < 1e-2, diff


def test_state_dict_round_trip_mid_overlap() -> None:
    """A save while an outer update is pending settles it early; loading the state into a
    fresh DiLoCo and continuing gives the bits of the uninterrupted one."""

    def run(stop_at=None):
        keys = DiLoCoConfig(sync_every=4, fragments=2, overlap_steps=1, quantize="int4")
        p = torch.nn.Parameter(torch.linspace(-1, 1, 300, dtype=torch.float64))
        q = torch.nn.Parameter(torch.linspace(2, 3, 7, dtype=torch.float64))

        def make():
            return DiLoCo(
                [("p", p), ("q", q)],
                keys,
                fragment_of={"p": 0, "q": 1},
                group=None,
                island=0,
                islands=1,
            )

        d = make()
        for t in range(1, 13):
            with torch.no_grad():
                p.mul_(0.97).add_(0.01 * t)
                q.mul_(1.01).sub_(0.02)
            d.step(count=t, last=t == 12)
            if t == stop_at:
                state = d.state_dict()
                assert int(state["due"][0]) == t + 1 or int(state["due"][1]) == t + 1
                d = make()  # a fresh one, as after a restart
                d.load_state_dict(state)
        return torch.cat([p.detach(), q.detach()])

    # H = 4, 2 fragments: fragment 0 starts at 4 and 8, fragment 1 at 2, 6 and 10; tau = 1
    assert torch.equal(run(stop_at=4), run())
    assert torch.equal(run(stop_at=6), run())


# ------------------------------------------------------------------------- refusals


def _resolve(*overrides: str, world: int = 2):
    base = ["model.name=mlp", "data.source=digits", "train.micro_batch=8"]
    config = load_config(None, [*base, *overrides])
    return resolve(config, world_size=world)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["diloco.outer_momentum=0.0"], "diloco.nesterov = true needs diloco.outer_momentum"),
        (["diloco.fragments=3"], "diloco.sync_every = 50 must be a multiple of diloco.fragments"),
        (
            ["diloco.fragments=5", "diloco.overlap_steps=10"],
            "diloco.overlap_steps = 10 must be below",
        ),
        (["diloco.quantize_block=127"], "must be even"),
        (["parallel.comm_hook=fp16"], "compress those with diloco.quantize"),
    ],
)
def test_bad_diloco_values_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _resolve("parallel.strategy=diloco", *overrides)


def test_diloco_keys_need_the_strategy_and_layouts_compose() -> None:
    with pytest.raises(ConfigError, match="diloco.sync_every is only read with"):
        _resolve("diloco.sync_every=10")
    with pytest.raises(ConfigError, match="fp16-mixed"):
        _resolve(
            "parallel.strategy=diloco",
            "parallel.dp_replicate=2",
            "parallel.dp_shard=2",
            "precision.mode=fp16-mixed",
            world=4,
        )
    # DDP does not compose with tp or pp; islands do (dp_replicate x tp)
    with pytest.raises(ConfigError, match="DDP replicates whole models"):
        _resolve("parallel.dp_replicate=2", "parallel.tp=2", world=4)
    gpt = ["model.name=gpt", "data.source=synthetic-text"]
    derived = _resolve(
        *gpt, "parallel.strategy=diloco", "parallel.dp_replicate=2", "parallel.tp=2", world=4
    )
    assert (derived.layout.dp_replicate, derived.layout.tp) == (2, 2)
    one = _resolve("parallel.strategy=diloco", world=1)
    assert any("one island" in w for w in one.warnings)
