"""The Python API, `scaletrain.train(config, model=..., data=..., loss=...)` (commands/api.py).

What it promises, each measured here against an in-process reference run in float64:
- in one process it trains right here and writes the run directory the CLI writes, with
  the callables recorded in config.toml by their import paths;
- a TOML path, a dict and a Config object are the same config (the same final weights);
- with two processes (nproc=2 or parallel.dp=2) it launches workers through the elastic
  agent, which import the callables by name from the directory their module came from,
  and end on the reference's weights; a callable the workers cannot import (defined in
  `__main__`, a lambda) is refused before any worker starts;
- under torchrun every rank calls it, with callables defined in the script itself, and
  every rank gets the same summary;
- a bad config value raises ConfigError naming the key, before anything runs.

The user's package (`apipkg`: a factory, a data function, a summed loss) is written once
per module into a pytest temporary directory and put on sys.path for the in-process
tests (both undone at the end). The multi-process runs go through driver scripts in a
subprocess with a timeout: the launcher installs signal handlers, and torchrun is a
process of its own. The refusal of a callable the workers cannot import needs no process:
it runs in this process with the launcher and the worker replaced by functions that fail
the test (harness.forbid_starting), the `__main__` function made by exec in a namespace
named `__main__`, as a script's functions are.
"""

from __future__ import annotations

import copy
import importlib
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import scaletrain
from scaletrain.commands.api import train as api_train  # = scaletrain.train

from harness import cli_env, forbid_starting, load_weights, losses, max_abs_diff, run_cli

TOL = 1e-9
PKG = "apipkg"

FILES = {
    "apipkg/__init__.py": "",
    "apipkg/model.py": """
        import math

        from torch import nn


        def build(task, *, width=8):
            return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(task.input_shape), width),
                                 nn.Tanh(), nn.Linear(width, task.num_classes))
    """,
    "apipkg/data.py": '''
        import torch


        class Blobs:
            """Gaussian blobs: item i is (inputs (dim,) float, class id)."""

            def __init__(self, n, dim, classes, seed):
                g = torch.Generator().manual_seed(seed)
                self.y = torch.randint(0, classes, (n,), generator=g)
                centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(9))
                self.x = centres[self.y] + 0.7 * torch.randn(n, dim, generator=g)

            def __len__(self):
                return len(self.y)

            def __getitem__(self, i):
                return self.x[i], int(self.y[i])


        def blobs(split, *, n=48, dim=4):
            task = {"kind": "classification", "input_shape": (dim,), "num_classes": 3}
            return Blobs(n, dim, 3, seed=0 if split == "train" else 1), task
    ''',
    "apipkg/loss.py": """
        import torch.nn.functional as F


        def summed(output, batch):
            return F.cross_entropy(output, batch.targets, reduction="sum"), batch.targets.shape[0]


        def mean(output, batch):
            return F.cross_entropy(output, batch.targets, reduction="mean"), batch.targets.shape[0]
    """,
}

# The run, without the three names (the callables give them). global_batch 8 = 2 micro-
# batches of 4 in one process, or one micro-batch of 4 on each of 2 ranks.
CONFIG = {
    "name": "api-test",
    "model": {"kwargs": {"width": 8}},
    "data": {"kwargs": {"n": 48}},
    "train": {
        "steps": 5,
        "global_batch": 8,
        "micro_batch": 4,
        "seed": 1,
        "eval_examples": 16,
        "allocator": "system",
    },
    "optim": {"name": "sgd", "lr": 0.3, "warmup_steps": 0},
    "precision": {"mode": "fp64"},
    "log": {"every": 1, "quiet": True},
}
NAMES = {
    "model": {"name": "apipkg.model:build"},
    "data": {"source": "apipkg.data:blobs"},
    "train": {"loss": "apipkg.loss:summed"},
}


def with_names(config: dict) -> dict:
    """CONFIG with the three import paths, as a CLI user writes it."""
    out = copy.deepcopy(config)
    for section, values in NAMES.items():
        out[section].update(values)
    return out


def to_toml(config: dict) -> str:
    import tomli_w

    return tomli_w.dumps(config)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory):
    """The user's package, imported in this process; sys.path and sys.modules restored after."""
    root = tmp_path_factory.mktemp("user")
    for name, body in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body).lstrip("\n"))
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        yield SimpleNamespace(
            root=root,
            build=importlib.import_module("apipkg.model").build,
            blobs=importlib.import_module("apipkg.data").blobs,
            summed=importlib.import_module("apipkg.loss").summed,
            mean=importlib.import_module("apipkg.loss").mean,
        )
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == PKG or m.startswith(PKG + ".")]:
            del sys.modules[name]


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """An in-process run sets torch's thread count for this process: put it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def train_here(pkg, run_dir: Path, config=CONFIG, **kwargs) -> dict:
    kwargs = {"model": pkg.build, "data": pkg.blobs, "loss": pkg.summed, **kwargs}
    return api_train(config, run_dir=run_dir, **kwargs)


@pytest.fixture(scope="module")
def reference(pkg, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, the whole global batch: the run every layout must reproduce."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    train_here(pkg, run_dir)
    one_step = tmp_path_factory.mktemp("ref") / "one-step"
    train_here(pkg, one_step, overrides=["train.steps=1"])
    # The steps moved the weights far beyond the tolerance: the comparisons have teeth.
    assert max_abs_diff(load_weights(run_dir), load_weights(one_step)) > 1e-3
    assert next(iter(load_weights(run_dir).values())).dtype == torch.float64
    return run_dir


# --------------------------------------------------------------------------- one process


def test_scaletrain_train_stays_the_function() -> None:
    """The trainer's package is scaletrain.training: importing it leaves scaletrain.train
    the API's function (a subpackage named `train` would replace it as an attribute)."""
    import scaletrain.training.step  # noqa: F401  what every call of the API imports

    assert scaletrain.train is api_train


@pytest.mark.slow  # a fresh interpreter
def test_scaletrain_train_can_be_called_twice_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """A notebook's second call, in a fresh process: the first is refused (bad value), the
    second must raise the same ConfigError, not TypeError."""
    script = (
        "import scaletrain\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        scaletrain.train({'train': {'steps': -1}})\n"
        "    except Exception as e:\n"
        "        print(type(e).__name__)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ConfigError", "ConfigError"], r.stdout


@pytest.mark.slow  # the CLI run to compare with is a subprocess
def test_in_process_run_writes_what_the_cli_writes(pkg, reference: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "a"
    summary = train_here(pkg, run_dir, overrides=["train.eval_examples=12"])
    assert summary["run_dir"] == str(run_dir)
    assert isinstance(summary["final_loss"], float)
    assert 0.0 <= summary["eval"]["accuracy"] <= 1.0
    assert json.loads((run_dir / "summary.json").read_text())["final_loss"] == summary["final_loss"]
    recorded = tomllib.loads((run_dir / "config.toml").read_text())
    assert recorded["model"]["name"] == "apipkg.model:build"
    assert recorded["data"]["source"] == "apipkg.data:blobs"
    assert recorded["train"]["loss"] == "apipkg.loss:summed"
    assert recorded["train"]["eval_examples"] == 12  # the override applied
    assert max_abs_diff(load_weights(reference), load_weights(run_dir)) < 1e-12

    # The same job through the CLI, with the import paths written in the TOML.
    (pkg.root / "cli.toml").write_text(to_toml(with_names(CONFIG)))
    cli_dir = tmp_path / "cli"
    r = run_cli(
        ["train", "cli.toml", "--run-dir", str(cli_dir), "train.eval_examples=12"],
        cwd=pkg.root,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    api_files = {p.name for p in run_dir.iterdir()}
    cli_files = {p.name for p in cli_dir.iterdir()}
    assert api_files == {"config.toml", "metrics.jsonl", "model.safetensors", "summary.json"}
    # Only the CLI draws report.png (cli._print_outcome); the rest is the same set of files.
    assert cli_files == api_files | {"report.png"}
    assert tomllib.loads((cli_dir / "config.toml").read_text()) == recorded
    assert max_abs_diff(load_weights(cli_dir), load_weights(run_dir)) < TOL
    assert losses(cli_dir) == pytest.approx(losses(run_dir), abs=TOL)


def test_config_as_path_dict_or_config_object_trains_the_same(
    pkg, reference: Path, tmp_path: Path
) -> None:
    from scaletrain.config import load_config

    snapshot = json.dumps(CONFIG, sort_keys=True)
    path = tmp_path / "cfg.toml"
    path.write_text(to_toml(CONFIG))
    ref = load_weights(reference)
    forms = {"path": str(path), "Path": path, "dict": CONFIG, "Config": load_config(path)}
    for form, config in forms.items():
        summary = train_here(pkg, tmp_path / form, config=config)
        assert max_abs_diff(ref, load_weights(tmp_path / form)) < 1e-12, form
        assert summary["run_dir"] == str(tmp_path / form)
    # Import paths as strings instead of callables: the same run again.
    strings = {
        "model": "apipkg.model:build",
        "data": "apipkg.data:blobs",
        "loss": "apipkg.loss:summed",
    }
    train_here(pkg, tmp_path / "strings", **strings)
    assert max_abs_diff(ref, load_weights(tmp_path / "strings")) < 1e-12
    assert json.dumps(CONFIG, sort_keys=True) == snapshot  # the caller's dict is not changed


def test_mean_loss_is_refused_in_process(pkg, tmp_path: Path) -> None:
    with pytest.raises(scaletrain.UserCodeError) as e:
        train_here(pkg, tmp_path / "run", loss=pkg.mean)
    assert "train.loss = 'apipkg.loss:mean'" in str(e.value)
    assert "it looks like a mean" in str(e.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- mistakes


def test_bad_config_value_raises_config_error_naming_the_key(pkg, tmp_path: Path) -> None:
    bad = copy.deepcopy(CONFIG)
    bad["train"]["steps"] = -1
    with pytest.raises(scaletrain.ConfigError, match="train.steps") as e:
        train_here(pkg, tmp_path / "run", config=bad)
    assert "-1" in str(e.value)
    with pytest.raises(scaletrain.ConfigError, match="did you mean 'train.steps'"):
        train_here(pkg, tmp_path / "run", overrides=["train.stepz=3"])
    with pytest.raises(scaletrain.ConfigError, match=r"train.global_batch = 8 must be divisible"):
        train_here(pkg, tmp_path / "run", overrides=["train.micro_batch=3"])
    with pytest.raises(scaletrain.ConfigError, match="config is a int"):
        api_train(42, model=pkg.build, data=pkg.blobs, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing ran
    assert issubclass(scaletrain.ConfigError, ValueError)


def test_a_finished_run_directory_is_not_overwritten(pkg, reference: Path) -> None:
    before = (reference / "model.safetensors").read_bytes()
    with pytest.raises(scaletrain.ConfigError, match="already holds a run"):
        train_here(pkg, reference)
    assert (reference / "model.safetensors").read_bytes() == before


# --------------------------------------------------------------------------- two processes

DRIVER = """
import json
import sys

sys.path.insert(0, {root!r})  # where the user's package is; the workers get it on PYTHONPATH

import scaletrain
from apipkg.data import blobs
from apipkg.loss import summed
from apipkg.model import build


def main_build(task, **kwargs):  # defined in __main__: the workers cannot import it
    return build(task, **kwargs)


mode, config_file, run_dir = sys.argv[1:]
config = json.loads(open(config_file).read())
models = {{"module": build, "main": main_build, "lambda": lambda task, **kw: build(task, **kw)}}
model = models[mode]
try:
    summary = scaletrain.train(config, model=model, data=blobs, loss=summed, run_dir=run_dir,
                               **({{"nproc": 2}} if mode != "lambda" else {{}}))
except scaletrain.UserCodeError as e:
    print("ERROR " + json.dumps({{"type": type(e).__name__, "message": str(e)}}), flush=True)
    sys.exit(3)
print("SUMMARY " + json.dumps(summary), flush=True)
"""


def run_driver(
    pkg, tmp_path: Path, mode: str, config: dict
) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the driver in tmp_path (not the package's directory: the workers find the package
    only through the PYTHONPATH the API gives them); return its last tagged line."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(root=str(pkg.root)))
    config_file = tmp_path / f"{mode}.json"
    config_file.write_text(json.dumps(config))
    r = subprocess.run(
        [sys.executable, str(driver), mode, str(config_file), str(tmp_path / mode)],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    tagged = [line for line in r.stdout.splitlines() if line.startswith(("SUMMARY ", "ERROR "))]
    assert tagged, f"exit {r.returncode}\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-3000:]}"
    tag, body = tagged[-1].split(" ", 1)
    return r, {"tag": tag, **json.loads(body)}


@pytest.mark.slow
def test_two_processes_through_the_elastic_agent_match_one(
    pkg, reference: Path, tmp_path: Path
) -> None:
    r, out = run_driver(pkg, tmp_path, "module", CONFIG)
    assert r.returncode == 0 and out["tag"] == "SUMMARY", r.stderr[-3000:]
    run_dir = tmp_path / "module"
    assert out["run_dir"] == str(run_dir)
    assert (run_dir / "logs").is_dir()  # it went through the launcher: one log per rank
    assert sorted(p.name for p in (run_dir / "logs").glob("rank-*.log")) == [
        "rank-0.log",
        "rank-1.log",
    ]
    assert out["final_loss"] == pytest.approx(
        json.loads((reference / "summary.json").read_text())["final_loss"], abs=TOL
    )
    assert max_abs_diff(load_weights(reference), load_weights(run_dir)) < TOL
    assert (
        tomllib.loads((run_dir / "config.toml").read_text())["model"]["name"]
        == "apipkg.model:build"
    )


def defined_in_main(build):
    """`main_build`, defined in `__main__` as a script or a notebook defines it: a function
    whose globals are a `__main__` module's (the driver's `main_build`, in this process)."""
    namespace = {"__name__": "__main__", "build": build}
    exec(
        "def main_build(task, **kwargs):\n    return build(task, **kwargs)\n",
        namespace,
    )
    return namespace["main_build"]


@pytest.mark.parametrize(
    "mode, expect", [("main", "main_build is defined in __main__"), ("lambda", "a lambda")]
)
def test_a_callable_workers_cannot_import_is_refused_before_they_start(
    pkg,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    mode: str,
    expect: str,
) -> None:
    """In this process, with the launcher and the worker replaced by functions that fail
    the test (harness.forbid_starting): the API refuses before it would launch."""
    # "main" asks for nproc=2; "lambda" for parallel.dp=2 (the API infers nproc from it).
    config = copy.deepcopy(CONFIG)
    if mode == "lambda":
        config["parallel"] = {"dp": 2}
    models = {
        "main": defined_in_main(pkg.build),
        "lambda": lambda task, **kw: pkg.build(task, **kw),
    }
    assert models["main"].__module__ == "__main__"
    forbid_starting(monkeypatch, tmp_path)
    run_dir = tmp_path / mode
    with pytest.raises(scaletrain.UserCodeError) as caught:
        api_train(
            config,
            model=models[mode],
            data=pkg.blobs,
            loss=pkg.summed,
            run_dir=run_dir,
            **({"nproc": 2} if mode != "lambda" else {}),
        )
    message = str(caught.value)
    assert type(caught.value).__name__ == "UserCodeError"
    assert message.startswith("model.name: ")
    assert expect in message
    if mode == "main":
        assert "move it into a module" in message
    assert "Traceback" not in capsys.readouterr().err
    assert not (run_dir / "logs").exists()  # no worker started
    assert not (run_dir / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- torchrun

TORCHRUN_DRIVER = """
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import scaletrain

# Everything in __main__: allowed under torchrun, where every rank runs this script.


class Blobs:
    def __init__(self, n, dim, classes, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, classes, (n,), generator=g)
        centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(9))
        self.x = centres[self.y] + 0.7 * torch.randn(n, dim, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def blobs(split, *, n=48, dim=4):
    task = {"kind": "classification", "input_shape": (dim,), "num_classes": 3}
    return Blobs(n, dim, 3, seed=0 if split == "train" else 1), task


def build(task, *, width=8):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(task.input_shape), width),
                         nn.Tanh(), nn.Linear(width, task.num_classes))


def summed(output, batch):
    return F.cross_entropy(output, batch.targets, reduction="sum"), batch.targets.shape[0]


config_file, run_dir, out_dir = sys.argv[1:]
summary = scaletrain.train(json.loads(open(config_file).read()), model=build, data=blobs,
                           loss=summed, run_dir=run_dir)
# A file per rank: the ranks share torchrun's stdout, where their lines could interleave.
with open(os.path.join(out_dir, f"summary-{os.environ['RANK']}.json"), "w") as f:
    json.dump(summary, f)
"""


@pytest.mark.slow
def test_every_rank_calls_it_under_torchrun(reference: Path, tmp_path: Path) -> None:
    driver = tmp_path / "driver.py"
    driver.write_text(TORCHRUN_DRIVER)
    (tmp_path / "cfg.json").write_text(json.dumps(CONFIG))
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        "--rdzv-id",
        "t",
        str(driver),
        str(tmp_path / "cfg.json"),
        str(run_dir),
        str(tmp_path),
    ]
    try:
        r = subprocess.run(
            cmd, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"torchrun did not finish:\n{(e.stderr or b'')[-3000:]}") from None
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = {
        int(p.stem.split("-")[1]): json.loads(p.read_text())
        for p in tmp_path.glob("summary-*.json")
    }
    assert sorted(summaries) == [0, 1], r.stderr[-3000:]
    assert summaries[0] == summaries[1]  # every rank gets rank 0's summary
    assert summaries[0]["run_dir"] == str(run_dir)
    ref_summary = json.loads((reference / "summary.json").read_text())
    assert summaries[0]["final_loss"] == pytest.approx(ref_summary["final_loss"], abs=TOL)
    assert max_abs_diff(load_weights(reference), load_weights(run_dir)) < TOL
    # Names of callables from __main__ are recorded as labels, not imported.
    assert tomllib.loads((run_dir / "config.toml").read_text())["model"]["name"] == "__main__:build"
