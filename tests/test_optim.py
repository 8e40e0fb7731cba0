"""Optimizers: fused and foreach compute the same AdamW and SGD updates (float64, 1e-12),
`auto` picks fused where torch has fused kernels; every optimizer torch ships builds by name
with its keyword arguments, the mistakes are refused naming the key, Muon takes the hidden
matrices and AdamW the rest, and each schedule gives its exact multipliers."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from scaletrain.data.sources import TaskSpec
from scaletrain.models import build_model
from scaletrain.training.optim import build_optimizer, fused_supported, resolve_impl

TASK = TaskSpec(kind="classification", input_shape=(1, 8, 8), num_classes=10)


def _train(impl: str, name: str, steps: int = 6) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model = build_model("mlp", size="small", task=TASK).double()
    opt = build_optimizer(
        model, name=name, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), momentum=0.9, impl=impl
    )
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(16, 1, 8, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, 10, (16,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_matches_foreach(name: str) -> None:
    fused, foreach = _train("fused", name), _train("foreach", name)
    initial = _train("foreach", name, steps=0)
    diff = max(float((fused[k] - foreach[k]).abs().max()) for k in fused)
    moved = max(float((foreach[k] - initial[k]).abs().max()) for k in fused)
    assert diff < 1e-12 and moved > 1e-3, (diff, moved)


def test_auto_picks_fused_on_cpu_and_the_kernels_are_used() -> None:
    model = build_model("mlp", size="tiny", task=TASK)
    params = list(model.parameters())
    assert fused_supported(params)[0] and resolve_impl("auto", params) == "fused"
    opt = build_optimizer(
        model,
        name="adamw",
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        momentum=0.0,
        impl="auto",
    )
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    opt = build_optimizer(
        model,
        name="adamw",
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        momentum=0.0,
        impl="foreach",
    )
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("turbo", params)


# --------------------------------------------------------------- optimizers by name


def test_every_optimizer_torch_ships_builds_and_steps() -> None:
    """Each name config accepts (read from torch.optim) builds with [optim]'s values passed
    where its constructor takes them, and steps; the two torch cannot drive are refused."""
    from scaletrain.config import REFUSED_OPTIMIZERS, optimizer_names

    names = [n for n in optimizer_names() if n not in REFUSED_OPTIMIZERS]
    assert {"adamw", "adam", "sgd", "nadam", "radam", "adafactor", "muon", "rmsprop"} <= set(names)
    assert set(REFUSED_OPTIMIZERS) <= set(optimizer_names())
    for name in names:
        torch.manual_seed(0)
        model = build_model("mlp", size="small", task=TASK)
        before = [p.detach().clone() for p in model.parameters()]
        opt = build_optimizer(
            model, name=name, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), momentum=0.5
        )
        torch.nn.functional.cross_entropy(
            model(torch.randn(4, 1, 8, 8)), torch.arange(4)
        ).backward()
        opt.step()
        moved = max(float((a.detach() - b).abs().max()) for a, b in zip(model.parameters(), before))
        assert moved > 0, name
        group = opt.param_groups[-1]
        if "betas" in group and name != "muon":
            assert tuple(group["betas"]) == (0.9, 0.95), name
        if "momentum" in group:
            assert group["momentum"] == 0.5, name


def test_kwargs_reach_the_constructor_and_kernels_only_where_taken() -> None:
    from scaletrain.training.optim import describe_optimizer

    model = build_model("mlp", size="tiny", task=TASK)
    opt = build_optimizer(
        model,
        name="nadam",
        lr=1e-3,
        weight_decay=0.1,
        betas=(0.8, 0.9),
        momentum=0.9,  # NAdam takes no momentum: not passed
        impl="auto",  # NAdam has no fused kernel: foreach
        kwargs={"momentum_decay": 0.01, "decoupled_weight_decay": True},
    )
    group = opt.defaults
    assert type(opt) is torch.optim.NAdam
    assert group["momentum_decay"] == 0.01 and group["decoupled_weight_decay"] is True
    assert group["betas"] == (0.8, 0.9) and group["weight_decay"] == 0.1
    assert group["foreach"] is True and "momentum" not in group
    assert describe_optimizer(opt) == (
        "optimizer: torch.optim.NAdam(betas=(0.8, 0.9), decoupled_weight_decay=True, "
        "foreach=True, lr=0.001, momentum_decay=0.01, weight_decay=0.1)"
    )
    opt = build_optimizer(
        model, name="adafactor", lr=1e-2, weight_decay=0.0, betas=(0.9, 0.9), momentum=0.0
    )
    assert "betas" not in opt.defaults and opt.defaults["foreach"] is True


def _optim(**values):
    from scaletrain.config import OptimConfig

    return OptimConfig(**values)


@pytest.mark.parametrize(
    "values, expect",
    [
        ({"name": "adam", "kwargs": {"lr": 0.1}}, ("optim.kwargs.lr repeats optim.lr",)),
        ({"name": "sgd", "kwargs": {"betas": [0.9, 0.9]}}, ("optim.kwargs.betas", "optim.betas")),
        ({"name": "adamw", "kwargs": {"fused": True}}, ("optim.kwargs.fused", "optim.impl")),
        (
            {"name": "adamw", "kwargs": {"nesterov": True}},
            ("optim.kwargs.nesterov", "torch.optim.adamw.AdamW", "amsgrad", "eps", "maximize"),
        ),
        ({"name": "muon", "kwargs": {"amsgrad": True}}, ("ns_steps", "adjust_lr_fn")),
        ({"name": "nadam", "impl": "fused"}, ("optim.impl = 'fused'", "auto, foreach")),
        ({"name": "muon", "impl": "fused"}, None),  # the kernels go to its AdamW half
        ({"name": "adam", "kwargs": {"amsgrad": True, "eps": 1e-6}}, None),
    ],
)
def test_check_optimizer_names_the_key_and_what_is_allowed(values: dict, expect) -> None:
    from scaletrain.errors import ConfigError
    from scaletrain.training.optim import check_optimizer

    if expect is None:
        check_optimizer(_optim(**values))
        return
    with pytest.raises(ConfigError) as e:
        check_optimizer(_optim(**values))
    for want in expect:
        assert want in str(e.value), str(e.value)


def test_config_refuses_unknown_and_undrivable_names_and_a_bad_decay_fraction() -> None:
    from scaletrain.config import load_config
    from scaletrain.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, ["optim.name=adamx"])
    assert "optim.name = 'adamx'" in str(e.value) and "'adamax'" in str(e.value)
    assert "'muon'" in str(e.value) and "'lbfgs'" not in str(e.value)
    assert "import path" in str(e.value)
    with pytest.raises(ConfigError, match="closure"):
        load_config(None, ["optim.name=lbfgs"])
    with pytest.raises(ConfigError, match="sparse gradients"):
        load_config(None, ["optim.name=sparseadam"])
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match="optim.decay_fraction"):
            load_config(None, [f"optim.decay_fraction={bad}"])
    config = load_config(None, ["optim.name=mypkg.opt:Mine", "optim.schedule=wsd"])
    assert config.optim.name == "mypkg.opt:Mine" and config.optim.decay_fraction == 0.2


def test_an_optimizer_class_by_import_path(tmp_path, monkeypatch) -> None:
    from scaletrain.training.optim import check_optimizer
    from scaletrain.user_code import UserCodeError

    (tmp_path / "myopt.py").write_text(
        "import torch\n"
        "class Halving(torch.optim.SGD):\n"
        "    def __init__(self, params, lr, *, factor=0.5):\n"
        "        super().__init__(params, lr=lr * factor)\n"
        "def helper(params):\n    return params\n"
    )
    monkeypatch.chdir(tmp_path)  # user code imports from the working directory first
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model("mlp", size="tiny", task=TASK)
    opt = build_optimizer(
        model,
        name="myopt:Halving",
        lr=0.2,
        weight_decay=0.0,
        betas=(0.9, 0.99),
        momentum=0.9,
        kwargs={"factor": 0.25},
    )
    assert type(opt).__name__ == "Halving" and opt.param_groups[0]["lr"] == 0.05
    with pytest.raises(Exception, match="takes no argument 'eps'"):
        check_optimizer(_optim(name="myopt:Halving", kwargs={"eps": 1.0}))
    with pytest.raises(UserCodeError, match="not a subclass of torch.optim.Optimizer"):
        check_optimizer(_optim(name="myopt:helper"))
    with pytest.raises(UserCodeError, match="no module named 'nowhere'"):
        check_optimizer(_optim(name="nowhere:Opt"))


# --------------------------------------------------------------- muon's two halves


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest() -> None:
    from scaletrain.models.gpt import GPT, GPT_SHAPES
    from scaletrain.training.optim import describe_optimizer
    from scaletrain.training.optimizers import MuonWithAdamW, hidden_matrices

    gpt = GPT(vocab_size=64, block_size=8, shape=GPT_SHAPES["tiny"])
    hidden = hidden_matrices(gpt)
    assert hidden == {
        f"blocks.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")
    }
    opt = build_optimizer(
        gpt, name="muon", lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), momentum=0.95
    )
    assert isinstance(opt, MuonWithAdamW)
    halves = {
        flag: [p for g in opt.param_groups if g["muon"] is flag for p in g["params"]]
        for flag in (True, False)
    }
    names = {id(p): n for n, p in gpt.named_parameters()}
    assert {names[id(p)] for p in halves[True]} == hidden
    assert {"tok_emb.weight", "pos_emb.weight", "lm_head.weight", "ln_f.weight"} <= {
        names[id(p)] for p in halves[False]
    }
    muon_group = next(g for g in opt.param_groups if g["muon"])
    assert muon_group["adjust_lr_fn"] == "match_rms_adamw" and muon_group["momentum"] == 0.95
    line = describe_optimizer(opt)
    assert "Muon takes 12 hidden-layer matrices" in line and "AdamW the other" in line
    # mlp (no repeated blocks): every Linear but the last (its head)
    mlp = build_model("mlp", size="small", task=TASK)
    linears = [n for n, m in mlp.named_modules() if isinstance(m, torch.nn.Linear)]
    assert hidden_matrices(mlp) == {f"{n}.weight" for n in linears[:-1]}


def test_muon_is_one_optimizer_to_the_schedule_and_its_state_dict() -> None:
    """The LR schedule moves both halves; a state dict saved after two steps and loaded into
    a fresh one continues exactly (the composite's groups and shared state are re-linked)."""
    from scaletrain.models.gpt import GPT, GPT_SHAPES
    from scaletrain.training.optim import build_scheduler

    def fresh():
        torch.manual_seed(0)
        gpt = GPT(vocab_size=64, block_size=8, shape=GPT_SHAPES["tiny"]).double()
        opt = build_optimizer(
            gpt, name="muon", lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), momentum=0.9
        )
        sched = build_scheduler(
            opt, warmup_steps=1, total_steps=4, schedule="linear", min_lr_ratio=0.1
        )
        return gpt, opt, sched

    def step(gpt, opt, sched, i):
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i))
        torch.nn.functional.cross_entropy(gpt(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    gpt, opt, sched = fresh()
    for i in range(2):
        step(gpt, opt, sched, i)
    assert {g["lr"] for g in opt.param_groups} == {1e-2 * (1 - 0.9 * 0.5)}
    saved = (
        copy.deepcopy(opt.state_dict()),  # its tensors are the live state
        sched.state_dict(),
        {k: v.clone() for k, v in gpt.state_dict().items()},
    )
    for i in range(2, 4):
        step(gpt, opt, sched, i)
    gpt2, opt2, sched2 = fresh()
    opt2.load_state_dict(saved[0])
    sched2.load_state_dict(saved[1])
    gpt2.load_state_dict(saved[2])
    for i in range(2, 4):
        step(gpt2, opt2, sched2, i)
    for (n, a), b in zip(gpt.state_dict().items(), gpt2.state_dict().values()):
        assert torch.equal(a, b), n


# --------------------------------------------------------------- schedules


@pytest.mark.parametrize(
    "schedule, expect",
    [
        # warmup 2 of 10 steps: 0.5, 1 at steps 0, 1; then per schedule to min 0.1 at step 9
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        # cosine: progress (step - 2) / 7
        (
            "cosine",
            [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 7)) for k in range(8)],
        ),
        # linear: 1 - 0.9 x (step - 2) / 7
        ("linear", [0.5, 1.0] + [1 - 0.9 * k / 7 for k in range(8)]),
        # wsd, decay_fraction 0.3: the last 3 steps (7, 8, 9) at 1 - 0.9 x (1/3, 2/3, 1)
        ("wsd", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7, 0.4, 0.1]),
    ],
)
def test_lr_multiplier(schedule: str, expect: list[float]) -> None:
    from scaletrain.training.optim import lr_multiplier

    got = [
        lr_multiplier(
            step,
            warmup_steps=2,
            total_steps=10,
            schedule=schedule,
            min_lr_ratio=0.1,
            decay_fraction=0.3,
        )
        for step in range(10)
    ]
    assert got == pytest.approx(expect, abs=1e-12)
    assert got[-1] == pytest.approx(0.1 if schedule != "constant" else 1.0, abs=1e-12)


def test_wsd_decays_over_at_least_one_step_and_all_of_them_at_fraction_one() -> None:
    from scaletrain.training.optim import lr_multiplier

    def curve(fraction: float, total: int) -> list[float]:
        return [
            lr_multiplier(
                s,
                warmup_steps=0,
                total_steps=total,
                schedule="wsd",
                min_lr_ratio=0.0,
                decay_fraction=fraction,
            )
            for s in range(total)
        ]

    assert curve(0.01, 5) == [1.0, 1.0, 1.0, 1.0, 0.0]  # round(0.05) = 0 -> one step
    assert curve(1.0, 4) == pytest.approx([0.75, 0.5, 0.25, 0.0])


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (["optim.name=adamx"], "'adamax'"),
        (["optim.name=lbfgs"], "closure"),
        (["optim.name=radam", "optim.kwargs={nesterov=true}"], "optim.kwargs.nesterov"),
        (["optim.name=adafactor", "optim.kwargs={weight_decay=0.1}"], "optim.weight_decay"),
        (["optim.name=nadam", "optim.impl=fused"], "no fused kernels"),
        (["optim.schedule=wsd", "optim.decay_fraction=0"], "optim.decay_fraction"),
    ],
)
def test_a_mistake_is_refused_before_any_worker_starts(
    overrides: list[str], expect: str, tmp_path, monkeypatch, capsys
) -> None:
    from harness import cli_main, forbid_starting

    forbid_starting(monkeypatch, tmp_path)
    config = tmp_path / "config.toml"
    config.write_text(
        '[model]\nname = "mlp"\n[data]\nsource = "digits"\n'
        "[train]\nsteps = 2\nglobal_batch = 8\nmicro_batch = 4\n"
    )
    code = cli_main(["train", str(config), *overrides])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("scaletrain: error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert expect in lines[0], lines[0]
