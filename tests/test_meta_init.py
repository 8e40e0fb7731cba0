"""Meta-device init: every layout's initial weights are one process's, bit for bit.

Each rank builds the model on the meta device, applies its layout (pipeline split, TP,
FSDP) to shapes only, then allocates its own shards and fills them by models/init.py's
module rule: every module drawn in full on the CPU from a seed of (train.seed, its name),
each rank keeping its slice. So the gathered weights cannot depend on the layout.

The runs are init-only (`train.steps = 0`: the initial weights evaluated and written to
RUN_DIR/model.safetensors, gathered to rank 0 a tensor at a time), float64, in the
session's pools of ranks (conftest's `trained`), and compared with one process's run with
a difference of exactly 0.0: dp_shard, tp, pp (interleaved: two stages a rank), the 2-D
compositions dp_shard x tp and pp x dp_shard, and HSDP for the built-in GPT; dp_shard, tp
and dp_shard x tp for a tiny Hugging Face Llama (which scaletrain does not pipeline:
compose.check_model_fits refuses it).

The negative control (`test_per_rank_dtensor_init_differs`): what the module rule replaces,
seeding and drawing into each rank's DTensor shard, gives every rank the same values on a
CPU and so weights no single process would have. It runs in this process as each rank in
turn over a fake process group (no peers needed: a shard's values are local).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from scaletrain.data.sources import TaskSpec
from scaletrain.models import build_model
from scaletrain.models.init import (
    ModelInitError,
    copy_slice,
    draw,
    init_plan,
    materialize,
    module_seed,
    undeclared,
)

from harness import Case, load_weights, max_abs_diff

SEED = 11


# Init-only runs (train.steps = 0), fp64, of either model.
INIT_ONLY = """
[data]
source = "wikitext"
seq_len = 32
[train]
steps = 0
seed = 11
global_batch = 16
micro_batch = 4
eval_examples = 8
[log]
quiet = true
[precision]
mode = "fp64"
"""

GPT = (
    """
[model]
name = "gpt"
size = "small"        # 4 blocks, 4 heads: tp=2 splits heads, pp=2 gets two blocks a stage
"""
    + INIT_ONLY
)

LLAMA = (
    """
[model]
name = "hf"
hf_config = "LlamaConfig"
[model.kwargs]
vocab_size = 256
hidden_size = 64
intermediate_size = 96
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 64
"""
    + INIT_ONLY
)

MODELS = {"gpt": GPT, "llama": LLAMA}

# world size -> layout name -> (overrides, the models it applies to)
LAYOUTS: dict[int, dict[str, tuple[list[str], tuple[str, ...]]]] = {
    1: {"one-process": ([], ("gpt", "llama"))},
    2: {
        "dp_shard2": (["parallel.dp_shard=2"], ("gpt", "llama")),
        "tp2": (["parallel.tp=2"], ("gpt", "llama")),
        "pp2-interleaved": (  # two stages a rank: the skeleton module holds both
            ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b"],
            ("gpt",),
        ),
    },
    4: {
        "dp_shard2xtp2": (["parallel.dp_shard=2", "parallel.tp=2"], ("gpt", "llama")),
        "pp2xdp_shard2": (["parallel.pp=2", "parallel.dp_shard=2"], ("gpt",)),
        "dp_replicate2xdp_shard2": (["parallel.dp_replicate=2", "parallel.dp_shard=2"], ("gpt",)),
    },
}

CASES = [
    (world, layout, model)
    for world, layouts in LAYOUTS.items()
    if world > 1
    for layout, (_, models) in layouts.items()
    for model in models
]


@pytest.fixture(scope="module")
def runs(trained):
    """(layout, model) -> its run directory; one job per world size, run on first use."""

    class Lazy(dict):
        def __missing__(self, key):
            world = next(w for w, layouts in LAYOUTS.items() if key[0] in layouts)
            got = trained(
                {
                    f"{layout}-{model}": Case.of(MODELS[model], *overrides)
                    for layout, (overrides, models) in LAYOUTS[world].items()
                    for model in models
                },
                world_size=world,
            )
            for name, result in got.items():
                layout, _, model = name.rpartition("-")
                self[(layout, model)] = result.run_dir
            return self[key]

    return Lazy()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "layout", "model"), CASES, ids=[f"{m}-{lay}" for _, lay, m in CASES]
)
def test_initial_weights_equal_one_process_bit_for_bit(runs, world, layout, model) -> None:
    got = load_weights(runs[(layout, model)])
    want = load_weights(runs[("one-process", model)])
    assert got.keys() == want.keys()
    assert all(got[k].shape == want[k].shape for k in want)
    assert max_abs_diff(got, want) == 0.0


@pytest.mark.slow
def test_an_init_only_run_saves_the_model_as_built(runs) -> None:
    """steps = 0 writes the weights `build_model` draws in one process (cast to fp64), so
    the comparison above is of initial weights, not of something trained."""
    built = build_model("gpt", size="small", task=TaskSpec("lm", (32,), 256), seed=SEED)
    saved = load_weights(runs[("one-process", "gpt")])
    assert max_abs_diff(saved, {k: v.double() for k, v in built.state_dict().items()}) == 0.0
    other = build_model("gpt", size="small", task=TaskSpec("lm", (32,), 256), seed=SEED + 1)
    assert max_abs_diff(saved, {k: v.double() for k, v in other.state_dict().items()}) > 0.01


# ------------------------------------------------------------ the rule, without processes


class Declared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))

    def init_module(self, name: str, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        else:
            nn.init.ones_(module.scale)


class Undeclared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)


def test_module_draws_depend_on_the_seed_and_the_name_only() -> None:
    assert module_seed(1, "a") == module_seed(1, "a")
    assert len({module_seed(1, "a"), module_seed(1, "b"), module_seed(2, "a")}) == 3
    with torch.device("meta"):
        model = Declared()
    plan = init_plan(model)
    torch.manual_seed(0)  # the global stream is neither read nor advanced
    before = torch.get_rng_state()
    one = draw("a", model.a, init=plan["a"], seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    again = draw("a", model.b, init=plan["b"], seed=1)  # another module, the same name
    assert torch.equal(one["weight"], again["weight"])
    assert not torch.equal(one["weight"], draw("b", model.b, init=plan["b"], seed=1)["weight"])
    assert model.a.weight.is_meta  # the module's own tensors were put back


def test_a_module_no_initialiser_covers_is_named() -> None:
    assert init_plan(Undeclared()) is None
    assert undeclared(Undeclared()) == ["a"]
    assert undeclared(Declared()) == []


def test_an_initialiser_that_leaves_a_tensor_unset_is_refused() -> None:
    class Forgetful(Declared):
        def init_module(self, name: str, module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.weight)  # the bias is left unset
            else:
                nn.init.ones_(module.scale)

    with torch.device("meta"):
        model = Forgetful()
    with pytest.raises(ModelInitError, match="'a' .* left bias unset"):
        materialize([model], plan=init_plan(model), seed=0, device=torch.device("cpu"))


class Positions(Declared):
    """Integer and bool buffers, which the stand-ins cannot mark as unset with NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("positions", torch.arange(8))
        self.register_buffer("mask", torch.ones(8, dtype=torch.bool))


def test_an_initialiser_that_leaves_an_integer_or_bool_buffer_unset_is_refused() -> None:
    with torch.device("meta"):
        model = Positions()  # Declared's init_module sets `scale` only
    with pytest.raises(ModelInitError, match=r"'\(root\)' .* left positions, mask unset"):
        materialize([model], plan=init_plan(model), seed=0, device=torch.device("cpu"))


def test_integer_and_bool_buffers_an_initialiser_sets_hold_their_values() -> None:
    class Restores(Positions):
        def init_module(self, name: str, module: nn.Module) -> None:
            super().init_module(name, module)
            if module is self:
                module.positions.copy_(torch.arange(8))
                module.mask.fill_(True)

    built = Restores()
    with torch.device("meta"):
        model = Restores()
    materialize([model], plan=init_plan(model), seed=0, device=torch.device("cpu"))
    assert torch.equal(model.positions, built.positions) and model.positions.dtype == torch.int64
    assert torch.equal(model.mask, built.mask)


class ReadsItsValues(Declared):
    """Declares an initialiser, yet reads a tensor's value in __init__ (fails on meta)."""

    def __init__(self) -> None:
        super().__init__()
        self.width = int(torch.ones(1).sum().item())


def test_a_model_declaring_an_initialiser_that_fails_on_meta_shows_where() -> None:
    from scaletrain.user_code import UserCodeError

    task = TaskSpec("classification", (1, 8, 8), 10)
    with pytest.raises(UserCodeError) as e:
        build_model("mine", size="tiny", task=task, factory=lambda task: ReadsItsValues())
    message = str(e.value)
    assert "meta" in message and "init_module" in message, message
    assert f"{Path(__file__).name}:" in message  # the line of __init__ that failed
    assert "item()" in message or "meta tensors" in message, message

    # Without an initialiser the model never asked for meta: built whole, no error.
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, int(torch.ones(1).sum().item()))

    assert not build_model(
        "plain", size="tiny", task=task, factory=lambda task: Plain()
    ).a.weight.is_meta


def test_tied_parameters_stay_tied() -> None:
    class Tied(Declared):
        def __init__(self) -> None:
            super().__init__()
            self.b.weight = self.a.weight

    with torch.device("meta"):
        model = Tied()
    materialize([model], plan=init_plan(model), seed=0, device=torch.device("cpu"))
    assert model.b.weight is model.a.weight
    assert not model.a.weight.isnan().any()


@pytest.mark.filterwarnings("ignore:DTensor random operators:UserWarning")  # the point here
def test_per_rank_dtensor_init_differs() -> None:
    """Seeding and drawing into each rank's shard (DTensor's own init, what torch offers on
    a CPU) gives both ranks the same values: the gathered weight is no process's draw. The
    module rule's slices, taken the same way, are one process's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    with torch.device("meta"):
        layer = nn.Linear(8, 6)
    whole = draw("w", layer, init=lambda n, m: m.reset_parameters(), seed=SEED)["weight"]
    torch.manual_seed(SEED)
    one_process = nn.init.normal_(torch.empty(6, 8), std=0.02)
    per_rank, by_rule = [], []
    for rank in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            mesh = init_device_mesh("cpu", (2,))
            shard = distribute_tensor(torch.empty(6, 8), mesh, [Shard(0)], src_data_rank=None)
            torch.manual_seed(SEED)
            nn.init.normal_(shard, std=0.02)  # DTensor's per-rank draw
            per_rank.append(shard.to_local().clone())
            target = distribute_tensor(torch.empty(6, 8), mesh, [Shard(0)], src_data_rank=None)
            copy_slice(target, whole)
            by_rule.append(target.to_local().clone())
        finally:
            dist.destroy_process_group()
    assert torch.equal(per_rank[0], per_rank[1])  # the same values in both shards
    assert not torch.equal(torch.cat(per_rank), one_process)
    assert torch.equal(torch.cat(by_rule), whole)


# ------------------------------------------------- a pretrained directory, read in slices

FINE_TUNE = """
[model]
name = "hf"
path = "{path}"
[data]
source = "wikitext"
seq_len = 32
[optim]
lr = 1e-3
[train]
steps = 2
seed = 11
global_batch = 16
micro_batch = 4
eval_examples = 8
[log]
every = 1
[precision]
mode = "fp64"
"""


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> tuple[str, int]:
    """A tiny Llama saved by transformers as two safetensors shards and their index; the
    directory and its weights' bytes."""
    import json

    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("sharded-llama")
    model.save_pretrained(out, max_shard_size="200KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2  # two shards, as the issue asks
    return str(out), sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.slow
def test_a_sharded_directory_fine_tunes_each_rank_reading_its_slices(trained, sharded_dir):
    """dp_shard=2 fine-tunes the two-shard directory with each rank reading only its slices
    (rank 0 reports the bytes it read: about half of the weights), and ends where one
    process that read the directory whole ends (fp64, 1e-9)."""
    import re

    path, total = sharded_dir
    config = FINE_TUNE.format(path=path)
    # The reference loads the directory whole (from_pretrained: model.meta_init = false).
    whole = trained({"whole": Case.of(config, "model.meta_init=false")}, world_size=1)["whole"]
    two = trained({"two": Case.of(config, "parallel.dp_shard=2")}, world_size=2)["two"]
    assert max_abs_diff(load_weights(two.run_dir), load_weights(whole.run_dir)) < 1e-9
    said = re.search(r"([\d,.]+) MiB of weights read", two.stderr[0])
    assert said, two.stderr[0][-2000:]
    read = {"two": float(said.group(1).replace(",", "")) * 2**20}
    assert read["two"] > 0.4 * total, (read, total)  # rank 0 read its half of every tensor
    assert read["two"] < 0.6 * total, (read, total)  # rank 0: its half, not the whole


def test_the_launcher_checks_a_big_model_on_the_meta_device(monkeypatch) -> None:
    """Above CHECK_ON_META_BYTES the launcher's check builds the model once, on meta, and
    runs it there (no weights allocated or drawn); below it, on real weights."""
    import tomllib

    from scaletrain.config import Config
    from scaletrain.models.init import is_meta
    from scaletrain.training import assemble

    built = []
    real_build = assemble.build_net

    def spy(*args, **kwargs):
        model = real_build(*args, **kwargs)
        built.append(is_meta(model))
        return model

    monkeypatch.setattr(assemble, "build_net", spy)
    config = Config.model_validate(tomllib.loads(LLAMA))
    assemble.check_user_code(config)
    assert built == [True, False]  # small: the meta build, then the real one
    built.clear()
    monkeypatch.setattr(assemble, "CHECK_ON_META_BYTES", 0)
    assemble.check_user_code(config)
    assert built == [True]
