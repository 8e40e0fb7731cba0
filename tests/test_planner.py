"""The planner (issue 20): its FLOP counter against torch's, its byte counts against what
runs log, its candidates against the launcher's checks, and `scaletrain plan`'s output.

The model-parallel layouts' bytes are checked where their runs already are
(test_model_parallel_parity.py::test_the_planner_predicts_the_logged_bytes: FSDP ZeRO-3,
tp with and without SP, pp gpipe / 1f1b / interleaved / zero-bubble, offload, activation
checkpointing, HSDP, dp_shard x tp, pp x dp_shard, pp x tp, accumulation; fp64). This file
adds what that matrix lacks: DDP, ZeRO-2, fp32 and bf16-mixed, SGD, each a 2-rank run in the
session's pool; test_distill_fsdp.py checks a distillation run's (student, projections).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scaletrain.config import load_config
from scaletrain.launch.resolve import resolve
from scaletrain.models.flops import traced_flops, train_flops, transformer_flops, transformer_shape
from scaletrain.models.gpt import GPT, GPT_SHAPES

from harness import Case, assert_planner_bytes_match

ROOT = Path(__file__).resolve().parent.parent


def _flop_counter_mode(model, inputs) -> int:
    """torch's FlopCounterMode over one forward and backward, with the model and inputs on
    the meta device. On meta, scaled-dot-product attention runs as its math decomposition,
    which torch counts; on a CPU it runs `_scaled_dot_product_flash_attention_for_cpu`, for
    which torch 2.13's counter has no formula (CUDA's flash and efficient kernels have one),
    so a CPU count leaves attention out (`test_torch_counts_no_attention_on_a_cpu`)."""
    model, inputs = model.to("meta"), inputs.to("meta")
    with FlopCounterMode(display=False) as counter:
        out = model(inputs)
        out = getattr(out, "logits", out)
        out.sum().backward()
    return counter.get_total_flops()


def test_torch_counts_no_attention_on_a_cpu():
    """Why the comparison runs on meta: on real CPU tensors FlopCounterMode misses exactly
    the attention products (4 B T^2 C per layer forward, twice that backward)."""
    model = GPT(vocab_size=256, block_size=48, shape=GPT_SHAPES["tiny"])
    inputs = torch.randint(0, 256, (3, 48))
    with FlopCounterMode(display=False) as counter:
        model(inputs).sum().backward()
    attention = 3 * 4 * 3 * 48 * 48 * 64 * GPT_SHAPES["tiny"].n_layer
    assert counter.get_total_flops() == train_flops(model, inputs) - attention


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_the_closed_form_counts_the_gpt_as_flop_counter_mode_does(size):
    model = GPT(vocab_size=256, block_size=48, shape=GPT_SHAPES[size])
    inputs = torch.randint(0, 256, (3, 48))
    shape = transformer_shape(model)
    assert shape is not None and shape.layers == GPT_SHAPES[size].n_layer
    assert train_flops(model, inputs) == transformer_flops(shape, batch=3, seq=48)
    assert traced_flops(model, inputs) == transformer_flops(shape, batch=3, seq=48)
    assert transformer_flops(shape, batch=3, seq=48) == _flop_counter_mode(model, inputs)


def test_the_closed_form_counts_an_hf_llama_as_flop_counter_mode_does():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=176,  # a gated MLP of its own width
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    inputs = torch.randint(0, 300, (2, 20))
    shape = transformer_shape(model)
    assert shape is not None and shape.layers == 3 and shape.attention_width == 64
    assert transformer_flops(shape, batch=2, seq=20) == _flop_counter_mode(model, inputs)


def test_the_closed_form_is_narayanans_for_a_gpt():
    """Narayanan et al. 2021 (eq. 3 without recomputation): 72 B s l h^2 (1 + s/6h + V/12lh)
    for a GPT with a 4h MLP and an untied head of V; with full recomputation 96 (...)."""
    b, s, l, h, v = 2, 64, 4, 128, 256  # noqa: E741  the paper's names
    model = GPT(vocab_size=v, block_size=s, shape=GPT_SHAPES["small"])
    shape = transformer_shape(model)
    paper = 72 * b * s * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))
    assert transformer_flops(shape, batch=b, seq=s) == pytest.approx(paper, rel=1e-12)
    full = transformer_flops(shape, batch=b, seq=s, recomputed_blocks=l)
    paper_full = 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    assert full == pytest.approx(paper_full, rel=1e-12)


# ----------------------------------------------------------------- bytes, from runs

CONFIG = """
[model]
name = "gpt"
size = "tiny"
[train]
steps = 2
seed = 3
global_batch = 8
micro_batch = 2
eval_examples = 8
[data]
source = "wikitext"
seq_len = 16
[log]
every = 1
quiet = true
"""

# name -> (config, overrides): what the model-parallel parity matrix does not run
RUNS = {
    "ddp-fp32": (CONFIG, ["parallel.dp_replicate=2"]),
    "zero2-bf16": (
        CONFIG,
        [
            "parallel.dp_shard=2",
            "parallel.reshard_after_forward=false",
            "precision.mode=bf16-mixed",
        ],
    ),
    "zero3-sgd": (CONFIG, ["parallel.dp_shard=2", "optim.name=sgd"]),
}


@pytest.fixture(scope="module")
def runs(trained):
    cases = {name: Case.of(text, *overrides) for name, (text, overrides) in RUNS.items()}
    return trained(cases, world_size=2)


@pytest.mark.parametrize("name", list(RUNS))
def test_predicted_bytes_are_the_logged_bytes(runs, name):
    run_dir = runs[name].run_dir
    assert (run_dir / "summary.json").exists(), runs[name].output[-3000:]
    assert_planner_bytes_match(run_dir, world_size=2)


# ------------------------------------------------------------ the plan and the MFU

PLAN_CONFIG = """
[model]
name = "gpt"
size = "tiny"         # 2 heads: tp = 4 cannot split them, the launcher refuses it
[train]
global_batch = 8
micro_batch = 4
[data]
source = "synthetic-text"
seq_len = 16
"""


def test_plan_json_ranks_the_accepted_layouts_with_the_pick_first(tmp_path, capsys):
    from scaletrain.cli import main

    cfg = tmp_path / "cfg.toml"
    cfg.write_text(PLAN_CONFIG)
    assert main(["plan", str(cfg), "--world", "4", "--hardware", "h100", "--json"]) == 0
    preds = json.loads(capsys.readouterr().out)
    layouts = [p["layout"] for p in preds]
    assert len({json.dumps(x, sort_keys=True) for x in layouts}) == len(layouts) > 20
    for p in preds:
        assert set(p) >= {"layout", "fits", "memory_bytes", "comm_bytes", "step_time_s", "mfu"}
        assert set(p["memory_bytes"]) >= {"params", "grads", "optim", "activations", "peak"}
        assert p["layout"]["parallel.tp"] != 4  # refused by the launcher: not a candidate
        lay = p["layout"]
        assert (
            lay["parallel.pp"]
            * lay["parallel.dp_replicate"]
            * lay["parallel.dp_shard"]
            * lay["parallel.tp"]
            == 4
        )
    fitting = [p["step_time_s"] for p in preds if p["fits"]]
    assert preds[0]["fits"] and fitting == sorted(fitting)
    # every candidate is a config the launcher accepts as it is
    for lay in layouts[:10]:
        items = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in lay.items()]
        config = load_config(cfg, [*items, "parallel.dp=-1"])
        resolve(config, world_size=4)
    capsys.readouterr()
    assert main(["plan", str(cfg), "--world", "4", "--hardware", str(tmp_path / "x.toml")]) == 2
    err = capsys.readouterr().err
    assert "is neither a built-in (a100-sxm4-40gb, a100-sxm4-80gb, " in err and "nor a file" in err


def test_a_run_logs_its_model_flops_and_mfu_against_the_profile(tmp_path, monkeypatch):
    from scaletrain.commands.api import train
    from scaletrain.runtime.hardware import BUILTIN

    monkeypatch.setenv("SCALETRAIN_HARDWARE", "h100")
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(PLAN_CONFIG)
    summary = train(
        cfg,
        overrides=["train.steps=2", "log.every=1", "log.quiet=true", "train.eval_examples=8"],
        run_dir=tmp_path / "run",
        nproc=1,
    )
    model = GPT(vocab_size=256, block_size=16, shape=GPT_SHAPES["tiny"])
    per_example = train_flops(model, torch.zeros(1, 16, dtype=torch.long))
    for r in records_of(summary["run_dir"]):
        assert r["model_flops_per_s"] == pytest.approx(per_example * r["examples_per_s"], rel=1e-12)
        assert r["mfu"] == pytest.approx(
            r["model_flops_per_s"] / BUILTIN["h100"].flops["fp32"], rel=1e-12
        )


def records_of(run_dir):
    from harness import records

    return records(Path(run_dir))


SMALL_GPU = """
name = "small-gpu"
memory_bytes = 70_000_000
memory_bw = 1e12
[flops]
fp32 = 1e14
[intra.2]
bus_bw = 1e11
latency_s = 1e-5
"""

HF_CONFIG = """
[model]
name = "hf"
hf_config = "LlamaConfig"
kwargs = { vocab_size = 256, hidden_size = 256, intermediate_size = 688, num_hidden_layers = 6, num_attention_heads = 4, num_key_value_heads = 2 }
[train]
global_batch = 4
micro_batch = 2
[data]
source = "synthetic-text"
seq_len = 16
"""


def test_train_refuses_a_layout_predicted_not_to_fit(tmp_path, monkeypatch):
    """A 4.5M-parameter Llama with AdamW holds 72 MB of states on one device of 70 MB,
    plus activations; on one rank the planner predicts more than fits, sharded over two it
    fits. The refusal names the numbers; plan_check=False (--no-plan-check) launches."""
    from scaletrain.commands.api import prepare_run
    from scaletrain.errors import ConfigError
    from scaletrain.launch.agent import LaunchSpec, validate_spec

    profile = tmp_path / "gpu.toml"
    profile.write_text(SMALL_GPU)
    monkeypatch.setenv("SCALETRAIN_HARDWARE", str(profile))
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(HF_CONFIG)
    one = validate_spec(LaunchSpec(nproc=1))
    config = load_config(cfg, ["train.micro_batch=4"])
    with pytest.raises(
        ConfigError, match=r"predicted to need [\d.]+ MiB per rank \(parameters 17.1 MiB"
    ):
        prepare_run(config, spec=one, run_dir=tmp_path / "a", resume=False)
    prepare_run(config, spec=one, run_dir=tmp_path / "b", resume=False, plan_check=False)
    two = validate_spec(LaunchSpec(nproc=2))
    sharded = load_config(cfg, ["parallel.dp_shard=2", "train.micro_batch=2"])
    prepare_run(sharded, spec=two, run_dir=tmp_path / "c", resume=False)


def test_train_plan_picks_the_first_layout_and_trains_it(tmp_path, monkeypatch, capsys):
    from scaletrain.cli import main

    monkeypatch.setenv("SCALETRAIN_HARDWARE", "h100")
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(PLAN_CONFIG)
    args = ["--world", "1", "--hardware", "h100", "--json"]
    assert main(["plan", str(cfg), "train.steps=2", *args]) == 0
    best = json.loads(capsys.readouterr().out)[0]["layout"]
    run = tmp_path / "run"
    code = main(
        ["train", str(cfg), "train.steps=2", "log.quiet=true", "--plan", "--run-dir", str(run)]
    )
    assert code == 0
    assert "scaletrain: plan: pp1 rep1 shard1 tp1" in capsys.readouterr().err
    stored = load_config(run / "config.toml")
    assert stored.train.micro_batch == best["train.micro_batch"]
    assert stored.parallel.activation_checkpointing == best["parallel.activation_checkpointing"]


def test_the_peak_is_every_ranks(monkeypatch, tmp_path):
    """MFU's denominator: a GPU profile's peak times the world; a CPU profile's per-core
    rate times the cores each rank gets (the node's cores shared by its ranks)."""
    from scaletrain.data.sources import Batch
    from scaletrain.precision import make_precision
    from scaletrain.runtime.hardware import BUILTIN
    from scaletrain.training.progress import model_flops

    model = GPT(vocab_size=256, block_size=16, shape=GPT_SHAPES["tiny"])
    one = torch.zeros(1, 16, dtype=torch.long)
    example = Batch(inputs=one, targets=one, count=16, tokens=16)
    fp32 = make_precision("fp32", device_type="cpu")
    monkeypatch.setenv("SCALETRAIN_HARDWARE", "h100")
    got = model_flops(model, example, precision=fp32, world_size=4, device_type="cpu")
    assert got.per_example == train_flops(model, one)
    assert got.peak == 4 * BUILTIN["h100"].flops["fp32"]
    cpu = tmp_path / "cpu.toml"
    cpu.write_text(
        'name = "c"\nmemory_bytes = 1\nmemory_bw = 1.0\ncores = 2\n[flops]\nfp32 = 1e10\n'
    )
    monkeypatch.setenv("SCALETRAIN_HARDWARE", str(cpu))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 4 ranks on 2 cores: half a core each
    assert model_flops(model, example, precision=fp32, world_size=4, device_type="cpu").peak == 2e10
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # alone: both cores
    assert model_flops(model, example, precision=fp32, world_size=1, device_type="cpu").peak == 2e10


def test_a_profile_round_trips_and_the_collectives_fit_their_line(tmp_path):
    from scaletrain.planner.calibrate import _fit
    from scaletrain.runtime.hardware import Link, Profile, load_profile, profile_toml

    # t = 200 us + bytes / 1 GB/s, timed at four sizes; the second smallest hiccuped (a
    # scheduler's 5 ms): the latency is the fastest of the three smallest
    sizes = (4096, 16384, 2**20, 2**26)
    points = [(n, 200e-6 + n / 1e9 + (5e-3 if n == 16384 else 0)) for n in sizes]
    link = _fit(points)
    assert link.latency_s == pytest.approx(200e-6 + 4096 / 1e9)
    assert link.bus_bw == pytest.approx(2**26 / (2**26 / 1e9 - 4096 / 1e9), rel=1e-9)
    # a first look at the three smallest all slow (gloo's 2-4 ms mode), a second look at
    # them after the largest: each size at its fastest look
    slow_look = [(n, 200e-6 + n / 1e9 + (3e-3 if n < 2**26 else 0)) for n in sizes]
    again = [(n, 200e-6 + n / 1e9) for n in sizes if n < 2**26]
    assert _fit(slow_look + again) == link
    profile = Profile(
        name="m",
        flops={"fp32": 1e11, "bf16": 4e11},
        memory_bytes=2**34,
        memory_bw=1e10,
        intra={2: link, 4: Link(bus_bw=5e8, latency_s=3e-4, fsdp_call_s=2e-3, tp_call_s=4e-3)},
        cores=2,
        op_s=6e-6,
        byte_s=3e-10,
        rss_ratio=1.4,
    )
    path = tmp_path / "p.toml"
    path.write_text(profile_toml(profile))
    assert load_profile(str(path)) == profile
    assert profile.link(3) == profile.intra[2] and profile.link(8) == profile.intra[4]


def test_counting_flops_leaves_the_model_as_it_was():
    """The trace runs on a meta copy: a meta-built model (the trainer counts before
    materialising it) gets no gradient from it, a real one keeps its values."""
    from scaletrain.data.sources import TaskSpec
    from scaletrain.models import build_model

    task = TaskSpec(kind="classification", input_shape=(64,), num_classes=10)
    for meta in (True, False):
        model = build_model("mlp", size="small", task=task, meta=meta)
        before = {n: p.clone() for n, p in model.named_parameters()}
        assert traced_flops(model, torch.zeros(1, 64)) > 0
        assert all(p.grad is None for p in model.parameters())
        for n, p in model.named_parameters():
            assert p.is_meta == meta and (meta or torch.equal(p, before[n]))


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_the_layer_count_is_flop_counter_modes_for_the_mlp_and_cnn(name):
    from scaletrain.data.sources import TaskSpec
    from scaletrain.models import build_model
    from scaletrain.models.flops import layer_flops

    shape = (64,) if name == "mlp" else (1, 28, 28)
    task = TaskSpec(kind="classification", input_shape=shape, num_classes=10)
    model = build_model(name, size="small", task=task)
    inputs = torch.zeros(3, *shape)
    assert layer_flops(model, inputs) == train_flops(model, inputs) == traced_flops(model, inputs)


def test_the_step_cost_fit_is_least_squares_over_every_micro_batch_and_never_negative():
    """op_s and byte_s are fitted over the four micro-batches' steps by least squares: one
    slow step moves them by its share, not (as a line through two points did) all of it."""
    import numpy as np

    from scaletrain.planner.reference import _nonneg_fit, reference_batches

    assert reference_batches({"train": {"micro_batch": 8}}) == (2, 4, 8, 16)
    assert reference_batches({"train": {"micro_batch": 1}}) == (1, 2)
    # t = ops x 10 us + bytes x 0.5 ns: exact points give back the line
    exact = [
        (1000 + 10 * k, w, (1000 + 10 * k) * 1e-5 + w * 5e-10)
        for k, w in enumerate((2e6, 4e6, 8e6, 16e6))
    ]
    assert _nonneg_fit(exact) == (pytest.approx(1e-5), pytest.approx(5e-10))
    # the smallest micro-batch's step 3 ms slow: the least-squares solution over all four
    noisy = [(x, y, t + (3e-3 if i == 0 else 0.0)) for i, (x, y, t) in enumerate(exact)]
    a = np.array([(x, y) for x, y, _ in noisy])
    best = np.linalg.lstsq(a, np.array([t for *_, t in noisy]), rcond=None)[0]
    assert _nonneg_fit(noisy) == (
        pytest.approx(best[0], rel=1e-9),
        pytest.approx(best[1], rel=1e-9),
    )
    # one point (a sharded probe without its second run): all of it on the second term
    assert _nonneg_fit([(1.0, 15, 0.03)]) == (0.0, pytest.approx(0.002))
    # the exact solution would need a negative byte cost: the op cost alone is fitted
    p, q = _nonneg_fit([(1000, 2e6, 0.020), (1200, 9e6, 0.021)])
    assert q == 0.0 and p == pytest.approx((1000 * 0.020 + 1200 * 0.021) / (1000**2 + 1200**2))


def test_the_reference_steps_run_side_by_side_as_ranks_each_begun_together(monkeypatch):
    """calibrate's reference runs as ranks do: started side by side by torch's elastic
    agent (calibrate.launch) into one gloo group, where each step waits at a barrier of
    all of them, so that every step begins together; a process alone waits at none."""
    import torch.distributed as dist

    from scaletrain.planner.calibrate import launch
    from scaletrain.planner.reference import reference_rank, step_worker
    from scaletrain.planner.trace import fake_world

    got = launch(2, reference_rank, RAW, (2,), 3)
    assert sorted(got) == [0, 1] and all(r["step_s"][2] > 0 for r in got.values())

    waits = []
    barrier = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: waits.append(1) or barrier(*a, **k))
    threads = torch.get_num_threads()
    try:
        with fake_world(2, 0):
            step_worker(RAW, (1, 2), steps=3)
        assert len(waits) == 6
        step_worker(RAW, (1, 2), steps=3)
        assert len(waits) == 6
    finally:
        torch.set_num_threads(threads)


def test_the_reference_takes_its_micro_batches_in_turn_so_a_slow_minute_falls_on_each(
    monkeypatch,
):
    """One process times every micro-batch, a step at each per round (round robin), not
    all of one micro-batch's steps and then the next's: a minute in which the machine runs
    slow lands on every micro-batch alike; a median step comes back for each."""
    from scaletrain.planner import reference
    from scaletrain.planner.reference import step_worker

    order = []
    real = reference.forward
    monkeypatch.setattr(
        reference, "forward", lambda m, b, p: order.append(len(b.inputs)) or real(m, b, p)
    )

    threads = torch.get_num_threads()
    try:
        got = step_worker(RAW, (1, 2, 4), steps=4)
    finally:
        torch.set_num_threads(threads)
    assert order == [1, 2, 4] * 4
    assert sorted(got["step_s"]) == [1, 2, 4] and all(v > 0 for v in got["step_s"].values())


def test_a_reference_process_waits_out_the_slowest_build_and_step_up_to_its_own_bound(
    monkeypatch,
):
    """The reference's gloo group lets a barrier wait STEP_WAIT_S (600 s), not the 120 s of
    calibrate's other groups: it waits out the slowest process's model build and then its
    steps, minutes for a large model on a CPU."""
    import contextlib

    import scaletrain.planner.reference as ref

    seen = []
    monkeypatch.setattr(
        ref,
        "gloo_group",
        lambda timeout_s=120.0: seen.append(timeout_s) or contextlib.nullcontext(),
    )
    threads = torch.get_num_threads()
    try:
        assert ref.reference_rank(RAW, (2,), 3)["step_s"][2] > 0
    finally:
        torch.set_num_threads(threads)
    assert seen == [ref.STEP_WAIT_S] and ref.STEP_WAIT_S == 600.0


def test_the_reference_step_is_the_slowest_of_the_processes_side_by_side(monkeypatch):
    """step_costs runs the reference's micro-batches in one launch of `concurrent`
    processes at once and fits each micro-batch's slowest step (a synchronous step waits
    for it; rank 1 is the slower at one micro-batch, rank 0 at the rest): the same fit as
    one process alone at that time."""
    import scaletrain.planner.reference as ref

    seen = []

    def together(n, fn, data, batches):
        seen.append((fn, batches, n))
        return {
            0: {"step_s": {mb: 0.1 * mb - (0.07 if mb == 2 else 0.0) for mb in batches}},
            1: {"step_s": {mb: 0.1 * mb if mb == 2 else 0.05 * mb for mb in batches}},
        }

    def alone(n, fn, data, batches):
        return {0: {"step_s": {mb: 0.1 * mb for mb in batches}}}

    def fit(concurrent, launch):
        flops = {"fp32": 1e10, "bf16": 1e10, "fp64": 5e9}
        return ref.step_costs(
            RAW, flops=flops, memory_bw=1e10, concurrent=concurrent, launch=launch, say=print
        )

    side_by_side = fit(2, together)
    assert seen == [(ref.reference_rank, (1, 2, 4, 8), 2)]
    assert side_by_side == fit(1, alone)
    assert side_by_side["op_s"] > 0 or side_by_side["byte_s"] > 0


def test_a_reference_step_runs_under_the_heap_policy_the_run_would_apply(monkeypatch):
    """The reference's steps are timed under the run's CPU heap policy (train.allocator),
    chosen by the model's size as the trainer chooses it: glibc's defaults map and unmap
    every large block each step, which a run under `retain` never pays."""
    from scaletrain.planner import reference
    from scaletrain.planner.reference import step_worker

    applied = []
    monkeypatch.setattr(
        reference, "configure_allocator", lambda mode, **k: applied.append((mode, k)) or mode
    )
    threads = torch.get_num_threads()
    try:
        got = step_worker(RAW | {"train": {**RAW["train"], "allocator": "retain"}}, (2,), steps=3)
    finally:
        torch.set_num_threads(threads)
    assert got["step_s"][2] > 0
    ((mode, kwargs),) = applied
    assert mode == "retain" and kwargs["device_type"] == "cpu" and kwargs["model_bytes"] > 0


RAW = {
    "model": {"name": "gpt", "size": "tiny"},
    "data": {"source": "wikitext", "seq_len": 32},
    "train": {"micro_batch": 4, "global_batch": 8},
}


def _configured(config, profile, *, world_size: int = 1):
    from scaletrain.planner import predict_configured

    return predict_configured(config, world_size=world_size, profile=profile)


def test_a_cpu_profile_adds_the_calibrated_resident_slack_to_the_peak():
    """runtime = the larger of (rss_ratio - 1) x what a step adds over the parameters and
    what FSDP2 or DTensor add once settled; a GPU profile (and a CPU one
    without the fit) adds nothing."""
    import dataclasses

    from scaletrain.config import validate_config
    from scaletrain.runtime.hardware import BUILTIN, Link

    config = validate_config(RAW)
    gpu = BUILTIN["h100"]
    cpu = dataclasses.replace(gpu, name="cpu", cores=2, rss_ratio=1.5)
    bare, slack = _configured(config, gpu).memory_bytes, _configured(config, cpu).memory_bytes
    assert bare["runtime"] == 0
    live = bare["peak"] - bare["params"]
    assert slack["runtime"] == int(0.5 * live)
    assert slack["peak"] == bare["peak"] + slack["runtime"]

    # FSDP2 adds its first use, a fixed part per rank for the world size, as calibrated; the
    # larger of it and the slack, not their sum (one free heap serves both). Tensor
    # parallelism pays the slack alone: DTensor's own, measured on GPT tiny (2.3x), put the
    # tp ranks of models calibrate never ran 1.6-2.7x over (BENCHMARKS.md).
    link = Link(bus_bw=1e9, latency_s=1e-4, fsdp_rss=70_000_000)
    link4 = dataclasses.replace(link, fsdp_rss=130_000_000)
    cpu = dataclasses.replace(cpu, intra={2: link, 4: link4})
    cases = (({"dp_shard": 2}, 2, 70e6), ({"tp": 2}, 2, 0), ({"dp_shard": 2, "tp": 2}, 4, 130e6))
    for parallel, world, first_use in cases:
        shaped = validate_config({**RAW, "parallel": parallel})
        plain = _configured(shaped, gpu, world_size=world)
        paid = _configured(shaped, cpu, world_size=world)
        live = plain.memory_bytes["peak"] - plain.memory_bytes["params"]
        assert paid.memory_bytes["runtime"] == int(max(first_use, 0.5 * live))
        # a slack larger than the first use is paid alone
        big = dataclasses.replace(cpu, rss_ratio=1.0 + 2 * first_use / live)
        slack = _configured(shaped, big, world_size=world)
        assert slack.memory_bytes["runtime"] == int(2 * first_use / live * live)
    assert first_use > 0.5 * live  # the first use is the larger at 4 ranks


def test_an_hf_decoder_under_full_checkpointing_is_traced_with_its_keyword_inputs():
    """An HF decoder layer takes its rotary tables by keyword: the recomputation pass calls
    the checkpointed block with every argument it got (it raised a TypeError when it passed
    the hidden states alone)."""
    from scaletrain.config import load_config
    from scaletrain.planner import build_for_plan
    from scaletrain.planner.trace import traced_activations

    config = load_config(
        ROOT / "configs" / "hf-llama.toml", ["parallel.activation_checkpointing=full"]
    )
    dataset, _ = build_for_plan(config)
    acts = traced_activations(config, dataset=dataset, examples=2, tp=1)
    plain = traced_activations(
        load_config(ROOT / "configs" / "hf-llama.toml"), dataset=dataset, examples=2, tp=1
    )
    assert 0 < acts.recompute < plain.saved
    assert acts.saved < plain.saved


def test_calibrate_times_gloo_and_fsdp2s_first_use_on_fresh_ranks():
    """Two ranks forked from calibrate's preloaded server by torch's elastic agent: every
    rank runs the same count of each collective (a time budget per size once let ranks stop
    apart and hang), the three smallest looked at again. FSDP2's first use, on ranks spawned
    as a run's are, adds resident bytes."""
    from scaletrain.planner.calibrate import measure_first_use, measure_link

    link, got = measure_link(2, sizes=(4096, 16384, 65536))
    # each size timed, then the three smallest a second time (gloo's slow mode takes a look)
    assert sorted(n for n, _ in got["all_reduce"]) == sorted(2 * [4096, 16384, 65536])
    assert link.bus_bw > 0 and link.latency_s > 0
    assert measure_first_use() > 0


def test_fsdp2s_first_use_is_measured_on_spawned_ranks(monkeypatch):
    """A rank forked from calibrate's preloaded server already holds what FSDP2 loads on
    first use (7 MiB measured where a spawned rank, as a run's, showed 32: BENCHMARKS.md),
    so the first use alone is measured on spawned ranks; the largest rank's is kept."""
    from scaletrain.planner import calibrate as cal

    seen = []
    monkeypatch.setattr(
        cal, "launch", lambda world, fn, **kw: seen.append((world, fn, kw)) or {0: 5, 1: 7}
    )
    assert cal.measure_first_use() == 7
    assert seen == [(2, cal.reference.first_use_worker, {"start_method": "spawn"})]


def test_planning_leaves_the_process_excepthook_as_it_found_it():
    """torch's init_process_group wraps sys.excepthook with a "[rankN]: " prefix and never
    unwraps it: every fake group the planner opened added one more to the launcher's
    tracebacks."""
    import sys

    from scaletrain.planner.trace import fake_world

    hook = sys.excepthook
    with fake_world(2, 0):
        assert sys.excepthook is not hook  # torch's wrapper, while the group is open
    assert sys.excepthook is hook


def test_a_pipeline_bubble_on_shared_cores_lends_them_to_the_other_ranks():
    """With ranks to spare for every core, a pipeline's bubble stretches the step; with more
    ranks than cores, a waiting stage's core serves the other ranks, and the step is the
    longer of the shared cores' work and the critical path (base pp2 x ZeRO-3 at world 4
    on 2 cores was predicted 1.30x its measured time with the bubble on top)."""
    import dataclasses

    from scaletrain.config import validate_config
    from scaletrain.runtime.hardware import BUILTIN

    config = validate_config(
        {
            **RAW,
            "train": {"micro_batch": 2, "global_batch": 8},
            "parallel": {"pp": 2, "dp_shard": 2},
        }
    )

    def planned(cores):
        profile = dataclasses.replace(BUILTIN["h100"], name="cpu", cores=cores, overlap=False)
        return _configured(config, profile, world_size=4)

    spare, shared = planned(8), planned(2)
    assert "configured" in spare.notes and "configured" in shared.notes
    assert spare.terms.bubble == shared.terms.bubble > 0
    busy = spare.terms.compute_s + spare.terms.comm_s
    assert spare.step_time_s == pytest.approx(
        busy * (1 + spare.terms.bubble) + spare.terms.optimizer_s
    )
    # 4 ranks on 2 cores take turns (compute twice as long); the bubble (<= 1) hides in them
    busy = shared.terms.compute_s + shared.terms.comm_s
    assert shared.terms.bubble <= 1
    assert shared.step_time_s == pytest.approx(busy + shared.terms.optimizer_s)


def _cpu_profile(*, fsdp_call_s=0.0, tp_call_s=0.0):
    """A 2-core CPU profile as calibrate has it before its sharded probes."""
    from scaletrain.runtime.hardware import Link, Profile

    link = Link(
        bus_bw=1e9,
        latency_s=1e-4,
        fsdp_call_s=fsdp_call_s,
        tp_call_s=tp_call_s,
        fsdp_rss=10**6,
    )
    return Profile(
        name="cpu",
        flops={"fp32": 1e10, "bf16": 1e10, "fp64": 5e9},
        memory_bytes=2**34,
        memory_bw=1e10,
        intra={2: link},
        cores=2,
        op_s=1e-5,
        byte_s=1e-10,
    )


def _four_rank_profile():
    """_cpu_profile with a link for 4 ranks (on its 2 cores) whose FSDP and tensor-parallel
    calls cost more over the whole world than in groups of 2."""
    import dataclasses

    from scaletrain.runtime.hardware import Link

    base = _cpu_profile()
    link4 = Link(
        bus_bw=5e8,
        latency_s=3e-4,
        fsdp_call_s=0.05,
        tp_call_s=0.07,
        fsdp_pair_call_s=0.03,
        tp_pair_call_s=0.04,
    )
    return dataclasses.replace(base, intra={**base.intra, 4: link4}, devices_per_node=4)


def _probe_rows(run_dir, rows) -> None:
    import json

    (Path(run_dir) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _quiet_probes(launch, profile, **kw):
    from scaletrain.planner.reference import sharded_probes

    return sharded_probes(RAW, launch=launch, profile=profile, say=lambda *_: None, **kw)


def test_each_sharded_kind_is_probed_at_three_call_counts_on_2_ranks(tmp_path):
    """sharded_probes trains the configured model under dp_shard = 2 and tp = 2 (here a
    stand-in launcher writes the run's metrics), each for `timed_steps` steps in 1, 2 and 4
    micro-batches a step (LOOKS). No resident memory is read off them: every field is a
    cost."""
    from scaletrain.planner.reference import sharded_worker

    calls = []

    def launch(world, fn, data, parallel, steps, accumulation, run_dir):
        calls.append((world, fn, parallel, steps, accumulation))
        row = {"kind": "train", "window_peak_above_baseline_bytes": 2**30, "step_time_s": 1.0}
        _probe_rows(run_dir, [row] * 3)

    fields, _ = _quiet_probes(launch, _cpu_profile(), timed_steps=30)
    assert calls == [
        (2, sharded_worker, parallel, 30, accumulation)
        for parallel in ({"dp_shard": 2}, {"tp": 2})
        for accumulation in (1, 2, 4)
    ]
    assert set(fields) == {"fsdp_step_s", "tp_step_s"}


def test_a_probe_with_accumulation_takes_the_same_examples_in_twice_the_calls():
    from scaletrain.planner import predict_configured
    from scaletrain.planner.reference import probe_parallel, sharded_config

    assert probe_parallel("fsdp", world=4, group=2) == {"dp_shard": 2, "dp_replicate": 2}
    assert probe_parallel("fsdp", world=4, group=4) == {"dp_shard": 4}
    assert probe_parallel("tp", world=4, group=2) == {"tp": 2, "pp": 2}
    once = sharded_config(RAW, {"dp_shard": 2}, steps=40)
    twice = sharded_config(RAW, {"dp_shard": 2}, steps=40, accumulation=2)
    assert (once.train.micro_batch, once.train.global_batch) == (4, 8)
    assert (twice.train.micro_batch, twice.train.global_batch) == (2, 8)
    profile = _cpu_profile()
    calls = [predict_configured(c, world_size=2, profile=profile) for c in (once, twice)]
    assert calls[1].calls(dim="dp_shard") == 2 * calls[0].calls(dim="dp_shard") == 18


def test_calibrate_splits_the_sharded_excess_into_a_cost_per_step_and_per_call():
    """The probes' logged step time (the median of the run's second half: a fresh rank's
    first ~15 steps run slow), less the planner's step with no per-step or per-call cost (the Linear stack's
    is not charged), at 1, 2 and 4 times the calls (micro-batches a step), is fitted to a
    cost per step plus one per call: FSDP's 3 calls per unit (2 blocks and the root: gather
    in forward and in backward, reduce-scatter), tensor parallelism's 4 per block
    (sequence parallel: an all-gather and a reduce-scatter each way)."""
    from scaletrain.planner import predict_configured
    from scaletrain.planner.reference import probe_parallel, sharded_config

    profile = _cpu_profile(fsdp_call_s=0.5, tp_call_s=0.5)  # the stack's, not to be charged
    bare = _cpu_profile(fsdp_call_s=1e-12, tp_call_s=1e-12)
    per_step, per_call = 0.25, 0.01

    def launch(world, fn, data, parallel, steps, accumulation, run_dir):
        kind = "tp" if "tp" in parallel else "fsdp"
        config = sharded_config(data, parallel, steps=steps, accumulation=accumulation)
        pred = predict_configured(config, world_size=world, profile=bare)
        calls = pred.calls(dim={"fsdp": "dp_shard", "tp": "tp"}[kind])
        step_s = pred.step_time_s + per_step + per_call * calls
        # the first half warms up (its steps slow): the second half's median is step_s
        times = (100.0, 3 * step_s, 0.9 * step_s, 1.1 * step_s)
        rows = [
            {"kind": "train", "window_peak_above_baseline_bytes": 0, "step_time_s": t}
            for t in times
        ]
        _probe_rows(run_dir, rows)

    fields, links = _quiet_probes(launch, profile, timed_steps=40)
    for kind, calls in (("fsdp", 9), ("tp", 16)):
        config = sharded_config(RAW, probe_parallel(kind, world=2, group=2), steps=40)
        assert predict_configured(config, world_size=2, profile=bare).calls() == calls
        assert fields[f"{kind}_step_s"] == pytest.approx(per_step, rel=1e-6)
        assert links[2][f"{kind}_call_s"] == pytest.approx(per_call, rel=1e-6)


def test_calibrate_fits_each_sharded_cost_to_three_call_counts_by_least_squares():
    """Each kind's fit takes the probes' excess at 1, 2 and 4 micro-batches a step (once,
    twice and 4 times the calls; the settled probe is the first) by least squares: a look
    off the line (here the 4 micro-batches', 40 ms) moves the fit by its share, where two
    points put all of one look's error into the cost per step. Calibrate says every look."""
    import numpy as np

    from scaletrain.planner import predict_configured
    from scaletrain.planner.reference import SHARDED_DIM, sharded_config, sharded_probes

    bare = _cpu_profile(fsdp_call_s=1e-12, tp_call_s=1e-12)
    per_step, per_call = 0.25, 0.01
    off = {1: 0.0, 2: 0.0, 4: 0.04}  # micro-batches a step -> the look's error
    excess = {"fsdp": {}, "tp": {}}

    def launch(world, fn, data, parallel, steps, accumulation, run_dir):
        kind = "tp" if "tp" in parallel else "fsdp"
        config = sharded_config(data, parallel, steps=steps, accumulation=accumulation)
        pred = predict_configured(config, world_size=world, profile=bare)
        calls = pred.calls(dim=SHARDED_DIM[kind])
        beyond = per_step + per_call * calls + off[accumulation]
        excess[kind][accumulation] = (calls, beyond)
        rows = [
            {"kind": "train", "window_peak_above_baseline_bytes": 0, "step_time_s": t}
            for t in (100.0, pred.step_time_s + beyond, pred.step_time_s + beyond)
        ]
        _probe_rows(run_dir, rows)

    said = []
    fields, links = sharded_probes(
        RAW, launch=launch, profile=_cpu_profile(), timed_steps=30, say=said.append
    )
    for kind in ("fsdp", "tp"):
        calls, beyond = zip(*(excess[kind][a] for a in (1, 2, 4)), strict=True)
        assert [s for s in said if s.startswith(f"{kind} on 2 ranks: ")] == [
            f"{kind} on 2 ranks: "
            + ", ".join(
                f"{e * 1e3:.1f} ms beyond the plan with {c} calls"
                for e, c in zip(beyond, calls, strict=True)
            )
            + "; fitted: "
            + f"{fields[f'{kind}_step_s'] * 1e3:.1f} ms a step + "
            + f"{links[2][f'{kind}_call_s'] * 1e6:.0f} us a call"
        ]
        assert calls[1] == 2 * calls[0] and calls[2] == 4 * calls[0]
        fit = np.linalg.lstsq(np.c_[np.ones(3), calls], np.array(beyond), rcond=None)[0]
        assert 0 < fit[0] < per_step and fit[1] > per_call  # the 4 micro-batches' look counted
        assert fields[f"{kind}_step_s"] == pytest.approx(fit[0], rel=1e-9)
        assert links[2][f"{kind}_call_s"] == pytest.approx(fit[1], rel=1e-9)


def test_calibrate_fits_groups_of_2_on_larger_worlds_their_own_cost_per_step_and_per_call():
    """On 4 ranks (2 cores), the probes time FSDP in groups of 2 (HSDP) and tensor
    parallelism in groups of 2 (with pipeline stages, each holding half the parameters and
    paying half the cost per step), each in 1 and 4 micro-batches (WIDE_LOOKS: 1 and 4 x
    the calls), fitted to the pair's own cost per step and per call: on 4 ranks of 2 cores
    these are not the 2-rank ones. FSDP over all 4 ranks: its cost per call beside the
    2-rank cost per step; tp over all 4 is refused (GPT tiny's 2 heads) and fits none."""
    import dataclasses

    from scaletrain.planner import predict_configured
    from scaletrain.planner.reference import SHARDED_DIM, sharded_config, sharded_probes
    from scaletrain.runtime.hardware import Link

    base = _cpu_profile()
    link4 = Link(bus_bw=5e8, latency_s=3e-4)
    profile = dataclasses.replace(base, intra={**base.intra, 4: link4}, devices_per_node=4)
    bare = dataclasses.replace(
        profile,
        intra={
            w: dataclasses.replace(link, fsdp_call_s=1e-12, tp_call_s=1e-12)
            for w, link in profile.intra.items()
        },
    )
    # (world, group) -> the cost per step (the whole model's) and per call
    per_step = {(2, 2): 0.25, (4, 2): 0.1, (4, 4): 0.25}
    cost = {(2, 2): 0.01, (4, 2): 0.03, (4, 4): 0.05}
    launched = []

    def launch(world, fn, data, parallel, steps, accumulation, run_dir):
        kind = "tp" if "tp" in parallel else "fsdp"
        group = parallel[SHARDED_DIM[kind]]
        launched.append((world, parallel, accumulation))
        config = sharded_config(data, parallel, steps=steps, accumulation=accumulation)
        pred = predict_configured(config, world_size=world, profile=bare)
        calls = pred.calls(dim=SHARDED_DIM[kind])
        stage = 1 / parallel.get("pp", 1)  # a pipeline stage's share of the cost per step
        step_s = pred.step_time_s + per_step[world, group] * stage + cost[world, group] * calls
        rows = [{"kind": "train", "window_peak_above_baseline_bytes": 0, "step_time_s": step_s}] * 3
        _probe_rows(run_dir, rows)

    # micro-batches of 8: tp x pp's 4 micro-batches of 2 split into the pipeline's 2 chunks
    eight = RAW | {"train": {"micro_batch": 8, "global_batch": 16}}
    fields, links = sharded_probes(
        eight, launch=launch, profile=profile, worlds=(2, 4), say=lambda *_: None
    )
    hsdp = {"dp_shard": 2, "dp_replicate": 2}
    assert [a for w, par, a in launched if par == hsdp] == [1, 4]
    assert [a for w, par, a in launched if par == {"tp": 2, "pp": 2}] == [1, 4]
    assert (4, {"dp_shard": 4}, 1) in launched
    assert fields["fsdp_step_s"] == pytest.approx(0.25, rel=1e-6)
    for kind in ("fsdp", "tp"):
        assert links[4][f"{kind}_pair_step_s"] == pytest.approx(0.1, rel=1e-6)
        assert links[4][f"{kind}_pair_call_s"] == pytest.approx(0.03, rel=1e-6)
    assert links[4]["fsdp_call_s"] == pytest.approx(0.05, rel=1e-6)
    assert links[4]["tp_call_s"] == links[4]["tp_pair_call_s"]  # no tp over all 4: the pair's


def test_a_probe_whose_rank_dies_fits_nothing_and_calibrate_goes_on():
    """A rank that dies in a probe (GPT base's tp 2 x pp 2 at 2 micro-batches once took a
    SIGSEGV in gloo's reduce-scatter) costs that probe's fit, not the calibrate: the other
    probes still run and fit, and one line names the probe, the rank and its signal."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from scaletrain.planner.reference import sharded_probes

    launched, said = [], []

    def launch(world, fn, data, parallel, steps, accumulation, run_dir):
        launched.append((world, parallel, accumulation))
        if parallel == {"tp": 2} and accumulation == 1:
            failure = ProcessFailure(local_rank=1, pid=123, exitcode=-11, error_file="")
            raise ChildFailedError(name="sharded_worker", failures={1: failure})
        rows = [{"kind": "train", "window_peak_above_baseline_bytes": 0, "step_time_s": 9.0}] * 3
        _probe_rows(run_dir, rows)

    fields, links = sharded_probes(RAW, launch=launch, profile=_cpu_profile(), say=said.append)
    assert launched == [(2, par, a) for par in ({"dp_shard": 2}, {"tp": 2}) for a in (1, 2, 4)]
    assert fields["fsdp_step_s"] + links[2]["fsdp_call_s"] > 0  # FSDP's probes still fitted
    assert fields["tp_step_s"] + links[2]["tp_call_s"] > 0  # so are tp's other two
    said_tp = [s for s in said if s.startswith("tp on 2 ranks: ")]
    assert len(said_tp) == 1 and said_tp[0].count("beyond the plan") == 2
    assert [s for s in said if "failed" in s] == [
        "{'tp': 2} on 2 ranks: not measured, a rank failed "
        "(rank 1: Signal 11 (SIGSEGV) received by PID 123)"
    ]


def test_the_planner_charges_a_group_smaller_than_the_world_its_pair_cost_and_the_step_cost_once():
    """A group of 2 among 4 ranks pays calibrate's pair cost per call, a group of all 4 the
    whole world's; FSDP2's and DTensor's cost per step is paid once (the larger), at the
    stage's share: the pair's own where its calls are the pair's, else the 2-rank one."""
    import dataclasses

    from scaletrain.config import validate_config

    profile = _four_rank_profile()
    link4 = profile.intra[4]
    stepped4 = dataclasses.replace(link4, fsdp_pair_step_s=0.1, tp_pair_step_s=0.16)
    costly = dataclasses.replace(
        profile, fsdp_step_s=0.2, tp_step_s=0.3, intra={**profile.intra, 4: stepped4}
    )
    no_calls = dataclasses.replace(
        link4, fsdp_call_s=1e-12, tp_call_s=1e-12, fsdp_pair_call_s=0.0, tp_pair_call_s=0.0
    )
    free = dataclasses.replace(profile, intra={**profile.intra, 4: no_calls})

    def planned(parallel, prof):
        config = validate_config(
            {**RAW, "train": {"micro_batch": 4, "global_batch": 16}, "parallel": parallel}
        )
        return _configured(config, prof, world_size=4)

    for parallel, fsdp, tp, step in (
        ({"dp_shard": 4}, 0.05, 0.0, 0.2),
        ({"dp_shard": 2, "dp_replicate": 2}, 0.03, 0.0, 0.1),
        ({"dp_shard": 2, "tp": 2}, 0.03, 0.04, 0.16),
        ({"pp": 2, "tp": 2}, 0.0, 0.04, 0.08),
    ):
        pred, bare = planned(parallel, profile), planned(parallel, free)
        shard, tensor = pred.calls(dim="dp_shard"), pred.calls(dim="tp")
        extra = fsdp * shard + tp * tensor
        expected_calls = 1e-12 * (shard + tensor)
        assert pred.terms.comm_s - bare.terms.comm_s == pytest.approx(
            extra - expected_calls, rel=1e-9
        )
        # the stage's share of it, not stretched by 4 ranks' turns on 2 cores
        assert planned(parallel, costly).terms.comm_s - pred.terms.comm_s == pytest.approx(
            step, rel=1e-9
        )


def _stubbed_calibrate(monkeypatch, links, *, load=None):
    """planner.calibrate with every measurement stubbed: 1e10 FLOP/s and bytes/s, a link of
    1 GB/s and 100 us per world size, the probes' `links`; the machine's foreign load
    `load` (default: quiet) at every look."""
    from scaletrain.planner import calibrate as cal
    from scaletrain.runtime.hardware import Link
    from scaletrain.runtime.load import Load

    load = load or Load(foreign_cores=0.0, steal_cores=0.0, wall_s=1.0)
    monkeypatch.setattr(cal, "matmul_rate", lambda dtype: 1e10)
    monkeypatch.setattr(cal, "memory_bandwidth", lambda: 1e10)
    monkeypatch.setattr(cal.reference, "step_costs", lambda *a, **k: {"op_s": 0.0, "byte_s": 0.0})
    monkeypatch.setattr(cal.os, "sched_getaffinity", lambda pid: {0, 1})
    link = Link(bus_bw=1e9, latency_s=1e-4)
    monkeypatch.setattr(cal, "measure_link", lambda world: (link, {}))
    monkeypatch.setattr(cal, "measure_first_use", lambda: 5)
    fields = {"fsdp_step_s": 0.02, "tp_step_s": 0.03}
    monkeypatch.setattr(cal.reference, "sharded_probes", lambda *a, **k: (dict(fields), links))
    monkeypatch.setattr(cal.reference, "slack_probe", lambda *a, **k: {"rss_ratio": 1.25})
    if load == "real":  # the machine's own, runtime/load.py
        return cal
    monkeypatch.setattr(cal, "foreign_load", lambda seconds=1.0: load)
    monkeypatch.setattr(cal, "wait_quiet", lambda **k: load)

    class Meter:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.load = load

    monkeypatch.setattr(cal, "Meter", Meter)
    return cal


def test_calibrate_puts_each_probed_cost_per_call_on_its_own_link(monkeypatch):
    """calibrate puts each probed cost on the link of the world size it was measured on."""
    links = {
        2: {"fsdp_call_s": 7e-3, "tp_call_s": 8e-3},
        4: {"fsdp_call_s": 9e-3, "tp_call_s": 5e-3},
    }
    links[4] |= {"fsdp_pair_call_s": 6e-3, "tp_pair_call_s": 5e-3}
    cal = _stubbed_calibrate(monkeypatch, links)
    said = []
    got = cal.calibrate(worlds=[2, 4], name="t", busy="refuse", say=said.append)
    assert (got.rss_ratio, got.fsdp_step_s, got.tp_step_s) == (1.25, 0.02, 0.03)
    assert (got.intra[2].fsdp_call_s, got.intra[2].tp_call_s) == (7e-3, 8e-3)
    assert (got.intra[4].fsdp_call_s, got.intra[4].tp_call_s) == (9e-3, 5e-3)
    assert (got.intra[4].fsdp_pair_call_s, got.intra[4].tp_pair_call_s) == (6e-3, 5e-3)
    assert got.intra[2].fsdp_rss == 5 and got.foreign_cores == 0.0
    assert not [line for line in said if "busy" in line]


def test_calibrate_refuses_to_measure_beside_a_cpu_bound_job(monkeypatch):
    """A real CPU-bound job beside calibrate (a process outside its tree: its parent has
    exited) is seen by the machine's own load meter, and `--busy refuse` measures nothing."""
    import os
    import signal
    import subprocess
    import sys

    from scaletrain.planner.calibrate import BusyMachine

    cal = _stubbed_calibrate(monkeypatch, {}, load="real")
    # the burner double-forks out of this tree, says its pid once burning, stops by itself
    burn = "import time\nend = time.time() + 60\nwhile time.time() < end: pass\n"
    spawn = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {burn!r}], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\n"
    )
    pid = int(
        subprocess.run(
            [sys.executable, "-c", spawn], capture_output=True, timeout=30, check=True, text=True
        ).stdout
    )
    try:
        with pytest.raises(BusyMachine, match="busy outside this run .* before calibrate began"):
            cal.calibrate(worlds=[2], name="t", busy="refuse", say=print)
    finally:
        os.kill(pid, signal.SIGKILL)


def test_calibrate_beside_a_busy_machine_says_so_and_marks_or_refuses_the_profile(monkeypatch):
    """A profile timed beside another job predicts every layout too slow: calibrate says so
    and records the load in the profile (what `scaletrain plan` warns of), or under
    --busy refuse raises before measuring and writes nothing."""
    from scaletrain.planner.calibrate import BusyMachine
    from scaletrain.runtime.load import Load

    busy = Load(foreign_cores=1.0, steal_cores=0.0, wall_s=1.0)
    cal = _stubbed_calibrate(monkeypatch, {}, load=busy)
    said = []
    got = cal.calibrate(worlds=[2], name="t", busy="warn", say=said.append)
    assert got.foreign_cores == 1.0
    warned = [line for line in said if line.startswith("warning:")]
    assert len(warned) == 2 and all("1.0 cores busy outside this run" in w for w in warned)
    with pytest.raises(BusyMachine, match="before calibrate began"):
        cal.calibrate(worlds=[2], name="t", busy="refuse", say=said.append)
    waited = []
    monkeypatch.setattr(cal, "wait_quiet", lambda **k: waited.append(k) or busy)
    cal.calibrate(worlds=[2], name="t", busy="wait", say=said.append)
    assert waited == [{"limit_s": cal.QUIET_WAIT_S}]


def test_calibrate_reads_the_resident_slack_off_a_ddp_probes_settled_peak():
    """slack_probe trains the configured model on 2 ranks under DDP (here a stand-in
    launcher writes the run's metrics) and divides the settled peak above baseline, plus
    the gradients DDP's buckets put in the baseline at set-up, by the planner's live bytes:
    a peak of exactly the live bytes beyond the baseline is a ratio of 1, and each further
    byte adds 1 / live; never below 1."""
    from scaletrain.planner import predict_configured
    from scaletrain.planner.reference import sharded_config, sharded_worker, slack_probe

    launched = []

    def measured(peak):
        def launch(world, fn, data, parallel, steps, accumulation, run_dir):
            launched.append((world, fn, parallel, steps, accumulation))
            rows = [
                {"kind": "train", "window_peak_above_baseline_bytes": p, "step_time_s": 1.0}
                for p in (peak // 2, peak)
            ]
            _probe_rows(run_dir, rows)

        return slack_probe(RAW, launch=launch, profile=_cpu_profile(), steps=20, say=print)

    config = sharded_config(RAW, {"dp_replicate": 2}, steps=20)
    memory = predict_configured(config, world_size=2, profile=_cpu_profile()).memory_bytes
    live = memory["grads"] + memory["optim"] + memory["activations"] + memory["buffers"]
    beyond = live - memory["grads"]  # what a step adds above the baseline
    assert measured(beyond) == {"rss_ratio": pytest.approx(1.0)}
    assert launched == [(2, sharded_worker, {"dp_replicate": 2}, 20, 1)]
    assert measured(beyond + live // 2)["rss_ratio"] == pytest.approx(1.5, rel=1e-6)
    assert measured(0)["rss_ratio"] == 1.0


def test_calibrate_skips_a_sharded_probe_the_model_cannot_run(tmp_path):
    """A CNN has no tensor-parallel plan: calibrate's tp = 2 probe is refused by the
    launcher's own checks before any rank starts (it was launched, and its ranks failed),
    it fits no cost, and the FSDP probes still run."""
    from scaletrain.planner.reference import sharded_probes

    launched, said = [], []

    def launch(world, fn, data, parallel, steps, accumulation, run_dir):
        launched.append(parallel)
        row = {"kind": "train", "window_peak_above_baseline_bytes": 0, "step_time_s": 1.0}
        _probe_rows(run_dir, [row])

    cnn = {
        "model": {"name": "cnn", "size": "tiny"},
        "data": {"source": "digits"},
        "train": {"micro_batch": 8, "global_batch": 16},
    }
    fields, links = sharded_probes(cnn, launch=launch, profile=_cpu_profile(), say=said.append)
    assert launched == [{"dp_shard": 2}] * 3  # 1, 2 and 4 micro-batches
    assert "tp_step_s" not in fields and links[2]["fsdp_call_s"] >= 0.0
    assert "not measured" in said[-1] and "tensor-parallel plan" in said[-1]


def test_op_checkpointing_is_traced_with_the_matmul_outputs_its_policy_keeps():
    """Under "op" checkpointing torch's selective checkpoint holds what its policy keeps
    itself, where no saved-tensor hook sees them: the trace counts them as they are made.
    On the tiny GPT (2 blocks, B 4, T 32, C 64, 2 heads, fp32) that is, per block, the 1st,
    3rd and 5th of its 6 matrix products (q, v, the MLP's 4C-wide fc) and attention's output
    and log-sum-exp, on top of what full checkpointing keeps."""
    from scaletrain.config import validate_config
    from scaletrain.planner import build_for_plan
    from scaletrain.planner.trace import traced_activations

    def traced(mode):
        config = validate_config({**RAW, "parallel": {"activation_checkpointing": mode}})
        dataset, _ = build_for_plan(config)
        return traced_activations(config, dataset=dataset, examples=4, tp=1)

    none, full, op = traced("none"), traced("full"), traced("op")
    B, T, C, H, blocks = 4, 32, 64, 2, 2
    per_block = B * T * (C + C + 4 * C + C) * 4 + B * H * T * 4
    assert op.saved - full.saved == blocks * per_block
    assert full.saved < op.saved < none.saved


LLAMA_TINY = {  # 7 matrix products a block: q, k, v, o, gate, up, down
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_op_checkpointings_matmuls_run_again_are_flop_counter_modes(model):
    """The FLOPs "op" checkpointing adds to a step (the matrix products its policy does not
    keep, multiplied again in backward) are what torch's FlopCounterMode counts beyond the
    same step without checkpointing: on the GPT its k and attention projection (the MLP's
    projection, last, is never needed again: torch's recomputation stops before it), on a
    Llama its k, attention projection and MLP up projection."""
    from scaletrain.config import validate_config
    from scaletrain.models.protocol import model_spec
    from scaletrain.parallel.checkpointing import apply_activation_checkpointing
    from scaletrain.planner import build_for_plan
    from scaletrain.planner.trace import traced_activations

    raw = {**RAW, "parallel": {"activation_checkpointing": "op"}}
    if model == "llama":
        raw["model"] = {"name": "hf", "hf_config": "LlamaConfig", "kwargs": LLAMA_TINY}
    config = validate_config(raw)
    dataset, net = build_for_plan(config)
    acts = traced_activations(config, dataset=dataset, examples=4, tp=1)
    inputs = dataset.get(torch.arange(4)).inputs
    # on the CPU, where attention is one op as in the trace (on meta it is a decomposition
    # of matrix products, which the policy would count); its values do not matter
    net = net.to_empty(device="cpu").requires_grad_(True)

    def counted(model) -> int:
        with FlopCounterMode(display=False) as counter:
            out = model(inputs)
            getattr(out, "logits", out).sum().backward()
        return counter.get_total_flops()

    plain = counted(net)
    wrapped = apply_activation_checkpointing(net, blocks_path=model_spec(net).blocks, mode="op")
    assert acts.again_flops > 0
    assert counted(wrapped) - plain == acts.again_flops


def test_checkpointing_counts_what_backward_runs_again():
    """The step's cost beyond the matmuls counts the ops a checkpointed block runs again in
    backward: none without checkpointing, the block's forward under "full", and under "op"
    the same less what its policy keeps: per block of the tiny GPT 7 kept outputs (q, k, v,
    attention and its log-sum-exp from one op, the projection, fc, its projection: 6 ops)
    whose bytes are exactly what "op" saves beyond "full"."""
    from scaletrain.config import validate_config
    from scaletrain.planner import build_for_plan
    from scaletrain.planner.trace import traced_activations

    def traced(mode):
        config = validate_config({**RAW, "parallel": {"activation_checkpointing": mode}})
        dataset, _ = build_for_plan(config)
        return traced_activations(config, dataset=dataset, examples=4, tp=1)

    none, full, op = traced("none"), traced("full"), traced("op")
    assert (none.again_ops, none.again_written) == (0, 0)
    assert 0 < op.again_ops < full.again_ops < none.ops
    assert full.again_written - op.again_written == op.saved - full.saved
    assert (full.ops, full.written) == (none.ops, none.written)

    # and the step's prediction pays their forward (a third of an op's cost, backward
    # included): one process, 2 micro-batches of 4
    import dataclasses

    from scaletrain.planner.predict import RECOMPUTED_SHARE
    from scaletrain.runtime.hardware import BUILTIN

    bare = dataclasses.replace(BUILTIN["h100"], op_s=0.0, byte_s=0.0)
    for mode, acts in (("none", none), ("full", full), ("op", op)):
        config = validate_config({**RAW, "parallel": {"activation_checkpointing": mode}})

        def compute_s(profile, config=config):
            return _configured(config, profile).terms.compute_s

        per_op = compute_s(dataclasses.replace(bare, op_s=1e-3)) - compute_s(bare)
        assert per_op == pytest.approx(2e-3 * (acts.ops + RECOMPUTED_SHARE * acts.again_ops))
        per_byte = compute_s(dataclasses.replace(bare, byte_s=1e-9)) - compute_s(bare)
        expected = 2e-9 * (acts.written + RECOMPUTED_SHARE * acts.again_written)
        assert per_byte == pytest.approx(expected)

    # and the matmuls "op" runs again: their FLOPs at the profile's matmul rate, per chunk
    def matmul_s(mode):
        config = validate_config({**RAW, "parallel": {"activation_checkpointing": mode}})
        return _configured(config, bare).terms.compute_s

    rate = bare.peak("fp32", ranks_per_node=1) * bare.matmul_efficiency
    assert op.again_flops > 0
    assert matmul_s("op") - matmul_s("none") == pytest.approx(2 * op.again_flops / rate)


def test_auto_precision_is_planned_as_the_run_on_the_profiles_hardware_decides(monkeypatch):
    """precision.mode = "auto" runs bf16-mixed on a GPU of compute capability >= 8.0 and on a
    CPU with avx512_bf16 or AMX, else fp32: the plan predicts what will run (it planned fp32
    for "auto" everywhere, so a bf16 CPU's calibrate fitted nothing beyond the matmuls)."""
    import dataclasses

    import scaletrain.planner
    from scaletrain import precision
    from scaletrain.config import validate_config
    from scaletrain.runtime.hardware import BUILTIN

    def planned(mode, profile):
        pred = _configured(validate_config({**RAW, "precision": {"mode": mode}}), profile)
        return pred.step_time_s, pred.memory_bytes

    gpu = BUILTIN["h100"]
    assert planned("auto", gpu) == planned("bf16-mixed", gpu) != planned("fp32", gpu)
    cpu = dataclasses.replace(gpu, name="cpu", cores=2)
    for bf16, mode in ((True, "bf16-mixed"), (False, "fp32")):
        hw = precision.Hardware("cpu", avx512_bf16=bf16)
        monkeypatch.setattr(scaletrain.planner, "detect_hardware", lambda device_type, hw=hw: hw)
        assert planned("auto", cpu) == planned(mode, cpu)


def test_the_configured_layout_alone_is_planned_or_refused_never_replaced():
    """Asked for the configured layout alone, the planner predicts it or raises the
    launcher's error; it planned the first accepted other layout in its place (DDP x TP
    is refused: it returned dp_shard x tp's prediction as the configured one's)."""
    from scaletrain.config import validate_config
    from scaletrain.errors import UserError
    from scaletrain.runtime.hardware import BUILTIN

    refused = validate_config({**RAW, "parallel": {"dp_replicate": 2, "tp": 2}})
    with pytest.raises(UserError, match="dp_replicate = 2 with tp = 2"):
        _configured(refused, BUILTIN["h100"], world_size=4)
    accepted = validate_config({**RAW, "parallel": {"dp_shard": 2, "tp": 2}})
    pred = _configured(accepted, BUILTIN["h100"], world_size=4)
    assert "configured" in pred.notes
    assert pred.layout["parallel.dp_shard"] == 2 and pred.layout["parallel.tp"] == 2


def test_the_trace_counts_the_bytes_an_op_writes_to_new_storage_by_its_local_shard():
    """The cost beyond the matmuls is per byte written: a view or alias writes nothing (the
    trace counted every `t()` and `view` of a weight, GPT-3's 175B over 7x its real
    traffic), and a tensor-parallel DTensor writes its local shard (this mode sees DTensor's
    ops at their global shapes)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from scaletrain.planner.trace import _OpCounter, fake_world

    counter = _OpCounter(keeps_ops=False)
    x = torch.ones(64, 32)
    with counter:
        x.view(2048), x.t(), x.detach(), x + 1
    assert (counter.ops, counter.written) == (4, 64 * 32 * 4)

    with fake_world(2, 0):
        mesh = init_device_mesh("cpu", (2,))
        d = DTensor.from_local(torch.ones(4, 32), mesh, [Shard(0)])
        counter = _OpCounter(keeps_ops=False)
        with counter:
            y = d * 2
        assert y.shape == (8, 32) and counter.written == 4 * 32 * 4


def test_a_group_spans_nodes_by_where_the_mesh_puts_its_ranks():
    """Ranks are row-major over (pp, dp_replicate, dp_shard, tp): on nodes of 8, tensor
    parallel 8 stays inside a node (NVLink) while its data-parallel and pipeline peers are
    8 ranks apart, on other nodes (InfiniBand). Every group of a world over 8 was priced at
    the inter-node link: Megatron's GPT-3 175B was planned with 8.5x its communication time."""
    from scaletrain.parallel.layout import ParallelLayout
    from scaletrain.planner.predict import spans_nodes

    megatron = ParallelLayout(pp=16, dp_replicate=1, dp_shard=8, tp=8)
    assert [spans_nodes(megatron, d, 8) for d in ("tp", "dp_shard", "pp")] == [False, True, True]
    small = ParallelLayout(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    spans = [spans_nodes(small, d, 8) for d in ("tp", "dp_shard", "dp_replicate", "pp")]
    assert spans == [False, False, False, True]


def test_the_configured_pipeline_chunks_are_planned():
    """parallel.pp_microbatches splits each micro-batch into that many chunks: the bubble is
    (p - 1) / chunks. The configured layout was planned with the default (pp chunks)."""
    from scaletrain.config import validate_config
    from scaletrain.runtime.hardware import BUILTIN

    for chunks, bubble in ((0, 1 / 2), (4, 1 / 4)):
        parallel = {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": chunks}
        config = validate_config({**RAW, "parallel": parallel})
        pred = _configured(config, BUILTIN["h100"], world_size=2)
        assert "configured" in pred.notes and pred.terms.bubble == bubble


def test_tensor_parallel_collectives_are_called_per_pipeline_chunk():
    """Each chunk of a micro-batch runs its stage's blocks on its own, so a tensor-parallel
    block's collectives (sequence parallel: an all-gather and a reduce-scatter in forward,
    the same in backward) are called once per chunk, for the same bytes in all. They were
    counted once per micro-batch: GPT small's pp 2 x tp 2 was predicted 29% fast."""
    from scaletrain.config import validate_config
    from scaletrain.runtime.hardware import BUILTIN

    def planned(chunks):
        parallel = {"pp": 2, "tp": 2, "pp_schedule": "1f1b", "pp_microbatches": chunks}
        config = validate_config({**RAW, "parallel": parallel})
        return _configured(config, BUILTIN["h100"], world_size=4)

    two, four = planned(2), planned(4)
    blocks, micro_batches = 2 // 2, 8 // 4  # the tiny GPT's 2 blocks over 2 stages; 8 / 4
    for pred, chunks in ((two, 2), (four, 4)):
        assert pred.calls(name="all_gather") == pred.calls(name="reduce_scatter")
        assert pred.calls(name="all_gather") == 4 * blocks * micro_batches * chunks
    assert two.comm_bytes["all_gather"] == four.comm_bytes["all_gather"]


def test_a_gpu_times_its_matmuls_at_the_achievable_rate_and_reports_mfu_against_the_peak():
    """A built-in GPU profile times matmuls at the part's measured Maximum Achievable Matmul
    FLOPS (its share of the datasheet peak) while MFU stays against the datasheet peak, as
    torchtitan and Megatron-LM report it: every matmul was planned at the datasheet rate."""
    import dataclasses

    from scaletrain.config import validate_config
    from scaletrain.runtime.hardware import BUILTIN

    config = validate_config(RAW)
    h100 = dataclasses.replace(BUILTIN["h100"], op_s=0.0, byte_s=0.0)
    datasheet = dataclasses.replace(h100, matmul_efficiency=1.0)
    real, ideal = _configured(config, h100), _configured(config, datasheet)
    assert h100.matmul_efficiency == pytest.approx(794.5 / 989.5)  # 1979 with sparsity / 2
    assert real.terms.compute_s == pytest.approx(
        ideal.terms.compute_s / h100.matmul_efficiency, rel=1e-12
    )
    # the same model FLOPs over the same peak: MFU x step time does not move
    assert real.mfu * real.step_time_s == pytest.approx(ideal.mfu * ideal.step_time_s, rel=1e-12)
    assert real.mfu < ideal.mfu


def test_calibrate_fits_no_cost_per_call_to_a_probe_with_no_calls_planned(monkeypatch):
    """A model with a TP plan whose blocks the planner cannot see has no tensor-parallel
    collectives planned: its probe fits no cost per call (it divided by zero)."""
    import types

    from scaletrain.planner import reference
    from scaletrain.planner.reference import sharded_probes

    def planned(config, *, world_size, profile):
        memory = {"peak": 2 * 10**6, "params": 10**6, "runtime": 0}
        return types.SimpleNamespace(memory_bytes=memory, calls=lambda dim: 0, step_time_s=0.5)

    monkeypatch.setattr(reference, "predict_configured", planned)

    def launch(world, fn, *args):
        row = {"kind": "train", "window_peak_above_baseline_bytes": 0, "step_time_s": 1.0}
        _probe_rows(args[-1], [row])

    fields, links = sharded_probes(
        RAW, launch=launch, profile=_cpu_profile(), worlds=(2, 4), say=print
    )
    assert fields == {} and links == {2: {}, 4: {}}


def test_a_hand_edited_profile_is_refused_with_what_was_wrong(tmp_path):
    """A profile that is not TOML, has a value that is not a number, or a matmul efficiency
    outside (0, 1] is refused as the user's mistake (a ProfileError naming the file and the
    key), not a ValueError or TOMLDecodeError traceback."""
    from scaletrain.runtime.hardware import BUILTIN, ProfileError, load_profile, profile_toml

    good = profile_toml(BUILTIN["a100"])
    cases = {
        "broken.toml": ("name = [", "not valid TOML"),
        "word.toml": (good.replace("op_s = 0.0", 'op_s = "fast"'), "missing or wrong key"),
    }
    over = good.replace(
        f"matmul_efficiency = {BUILTIN['a100'].matmul_efficiency}", "matmul_efficiency = 1.5"
    )
    cases["over.toml"] = (over, "matmul_efficiency: Input should be less than or equal to 1")
    for name, (text, says) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ProfileError, match=says):
            load_profile(str(path))
    path = tmp_path / "good.toml"
    path.write_text(good)
    assert load_profile(str(path)).matmul_efficiency == BUILTIN["a100"].matmul_efficiency


# ------------------------------------------------------- issue 44: the planner's inputs


def test_a_users_own_large_model_is_planned_from_the_users_code(tmp_path, monkeypatch):
    """`scaletrain.train(model=fn)` with fn defined inside a function: the fit check builds
    the model from fn. It built it from the name the config records for fn, which nothing
    can import ("has no attribute '...<locals>.make'"), and refused a model it could plan."""
    import scaletrain

    profile = tmp_path / "gpu.toml"
    profile.write_text(SMALL_GPU)
    monkeypatch.setenv("SCALETRAIN_HARDWARE", str(profile))

    def make(task, **kwargs):  # 8.4M parameters: 134 MB of states, over the 70 MB device
        width = 16384
        return torch.nn.Sequential(
            torch.nn.Embedding(task.num_classes, width), torch.nn.Linear(width, task.num_classes)
        )

    config = {
        "train": {"global_batch": 2, "micro_batch": 2},
        "data": {"source": "synthetic-text", "seq_len": 8},
    }
    with pytest.raises(scaletrain.ConfigError, match=r"predicted to need .* per rank"):
        scaletrain.train(config, model=make, run_dir=tmp_path / "run", nproc=1)
    assert not (tmp_path / "run").exists()


def _cpu_plan(world: int, *, devices_per_node: int, memory_bytes: int = 2**40, **kw):
    import dataclasses

    from scaletrain.config import validate_config
    from scaletrain.planner import plan_layouts

    profile = dataclasses.replace(
        _four_rank_profile(), devices_per_node=devices_per_node, memory_bytes=memory_bytes
    )
    config = validate_config({**RAW, "train": {"micro_batch": 2, "global_batch": 8}})
    return plan_layouts(config, world_size=world, profile=profile, **kw)


def test_a_cpu_plan_shares_the_cores_among_the_ranks_launched_not_the_calibrated_worlds():
    """A CPU profile's devices_per_node is the largest world calibrate timed, not how many
    ranks the launch puts on this machine: 4 ranks on a profile calibrated up to 2 were
    each given a whole core of the 2 (planned as if 2 ran here). The ranks per node are the
    launch's: all of the world's on this machine unless given."""

    def steps(preds):
        return {json.dumps(p.layout, sort_keys=True): p.terms.compute_s for p in preds}

    up_to_2 = steps(_cpu_plan(4, devices_per_node=2, only_configured=True))
    up_to_4 = steps(_cpu_plan(4, devices_per_node=4, only_configured=True))
    assert up_to_2 == pytest.approx(up_to_4, rel=1e-12)
    # passed explicitly: 2 of the 4 ranks on each of 2 nodes have a core each
    two_nodes = steps(_cpu_plan(4, devices_per_node=4, ranks_per_node=2, only_configured=True))
    assert two_nodes.keys() == up_to_4.keys()
    assert all(two_nodes[k] == pytest.approx(up_to_4[k] / 2, rel=1e-9) for k in up_to_4)


def test_plan_and_train_plan_give_a_rank_the_same_share_of_a_cpus_memory(
    tmp_path, monkeypatch, capsys
):
    """`scaletrain plan --world 4` gave each rank the whole machine's memory where `train
    --plan` gave it a quarter (23.5 GiB against 5.9 GiB): one function decides both (here
    on 2 ranks, half each)."""
    import dataclasses

    from scaletrain.cli import main
    from scaletrain.errors import ConfigError
    from scaletrain.planner import pick_layout
    from scaletrain.runtime.hardware import profile_toml

    smallest = min(p.memory_bytes["peak"] for p in _cpu_plan(2, devices_per_node=2))
    machine = 3 * smallest // 2  # the whole machine holds a layout; half of it none
    profile = dataclasses.replace(_four_rank_profile(), memory_bytes=machine)
    path = tmp_path / "cpu.toml"
    path.write_text(profile_toml(profile))
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(
        '[model]\nname = "gpt"\nsize = "tiny"\n[data]\nsource = "wikitext"\nseq_len = 32\n'
        "[train]\nmicro_batch = 2\nglobal_batch = 8\n"
    )
    assert main(["plan", str(cfg), "--world", "2", "--hardware", str(path), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned and not any(p["fits"] for p in planned)
    assert main(["plan", str(cfg), "--world", "2", "--nproc", "3", "--hardware", str(path)]) == 2
    assert "--nproc 3: ranks per node, from 1 to --world (2)" in capsys.readouterr().err
    monkeypatch.setenv("SCALETRAIN_HARDWARE", str(path))
    with pytest.raises(ConfigError, match=f"fit in {machine // 2 / 2**20:.1f} MiB per rank"):
        pick_layout(load_config(cfg), world_size=2, ranks_per_node=2)


def test_the_plan_table_prints_a_gpus_step_in_milliseconds_to_four_figures():
    """Every `step s` of a GPU plan printed 0.000 (its JSON: 0.000138)."""
    from scaletrain.commands.plan import format_table
    from scaletrain.planner.predict import Prediction

    layout = {
        "parallel.pp": 1,
        "parallel.dp_replicate": 1,
        "parallel.dp_shard": 1,
        "parallel.tp": 1,
        "train.micro_batch": 4,
        "parallel.activation_checkpointing": "none",
    }
    memory = dict.fromkeys(("params", "grads", "optim", "activations", "peak"), 2**20)

    def row(step_s):
        pred = Prediction(layout, True, memory, {"all_reduce": 0}, step_s, 0.4, terms=None)
        return format_table([pred]).splitlines()

    head, line, _ = row(0.000138)
    assert "step ms" in head and " 0.1380 " in line
    assert " 1235 " in row(1.23456)[1] and " 12.35 " in row(0.0123456)[1]


def test_plan_warns_when_the_profile_was_taken_on_a_busy_machine(tmp_path, capsys):
    """A profile taken while other work ran predicts every step too slow: `scaletrain plan`
    says so in one line."""
    import dataclasses

    from scaletrain.cli import main
    from scaletrain.runtime.hardware import profile_toml

    cfg = tmp_path / "cfg.toml"
    cfg.write_text(PLAN_CONFIG)
    out = tmp_path / "p.toml"

    def warnings(profile):
        out.write_text(profile_toml(profile))
        capsys.readouterr()
        assert main(["plan", str(cfg), "--world", "1", "--hardware", str(out)]) == 0
        # (how busy the machine is now is said too, where it is: not this test's)
        return [x for x in capsys.readouterr().err.splitlines() if "calibrated while" in x]

    assert warnings(_four_rank_profile()) == []
    (busy,) = warnings(dataclasses.replace(_four_rank_profile(), foreign_cores=1.2))
    assert "calibrated while 1.2 cores were busy" in busy


def test_plan_warns_when_the_machine_is_busier_than_at_calibrate():
    """`busier_than_calibrated` compares the foreign load while plan ran with the one the
    profile recorded: more than half a core beyond calibrate's is said, a quiet moment is not."""
    import dataclasses

    from scaletrain.commands.plan import busier_than_calibrated
    from scaletrain.runtime.load import Load

    profile = _four_rank_profile()
    quiet, busy = (Load(foreign_cores=c, steal_cores=0.0, wall_s=2.0) for c in (0.02, 1.0))
    assert busier_than_calibrated(profile, quiet) is None
    said = busier_than_calibrated(profile, busy)
    assert "busier now (1.0 cores busy outside this run" in said
    calibrated_busy = dataclasses.replace(profile, foreign_cores=0.95)
    assert "calibrated while" in busier_than_calibrated(calibrated_busy, busy)


def test_calibrate_replaces_its_profile_whole_or_leaves_the_old_one(tmp_path, monkeypatch):
    """The profile is written to a temporary name beside it and renamed over it: a crash
    while writing leaves the old profile whole (it was written in place)."""
    import os

    import scaletrain.planner.calibrate as calibrate
    from scaletrain.commands.plan import cmd_calibrate

    monkeypatch.setattr(calibrate, "calibrate", lambda **kw: _cpu_profile())
    out = tmp_path / "hardware.toml"
    out.write_text("the old profile")

    def crash(src, dst):
        raise OSError("the machine went down")

    monkeypatch.setattr(os, "replace", crash)
    args = types.SimpleNamespace(world="2", out=out, busy="warn")
    with pytest.raises(OSError, match="went down"):
        cmd_calibrate(args)
    assert out.read_text() == "the old profile"
    assert [p.name for p in tmp_path.iterdir()] == ["hardware.toml"]  # no temporary left
    monkeypatch.undo()
    monkeypatch.setattr(calibrate, "calibrate", lambda **kw: _cpu_profile())
    assert cmd_calibrate(args) == 0
    assert "the old profile" not in out.read_text()
