"""A user's own package (a small CNN with its own factory, dataset function and loss, written
into the test's temporary directory) trains through the CLI, and its parallel layouts
reproduce one process: dp=2, and dp=2 with accumulation, end with the same weights as a
single process on the whole global batch, in float64 within 1e-9.

Also: a user loss returning (sum, count) gives the built-in loss's gradients exactly, and
the example package in examples/own_model trains as the README says.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from harness import Case, load_weights, losses, max_abs_diff

TOL = 1e-9
REPO = Path(__file__).resolve().parents[1]

PACKAGE = {
    "shapes/__init__.py": "",
    "shapes/nets.py": '''
        import torch
        from torch import nn


        class TinyCNN(nn.Module):
            """conv -> relu -> conv -> relu -> mean pool -> linear."""

            def __init__(self, channels, classes, width):
                super().__init__()
                self.convs = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(),
                                           nn.Conv2d(width, width, 3, padding=1), nn.ReLU())
                self.head = nn.Linear(width, classes)

            def forward(self, x):
                return self.head(self.convs(x).mean(dim=(2, 3)))


        def build(task, width=8):
            return TinyCNN(task.input_shape[0], task.num_classes, width)
    ''',
    "shapes/data.py": '''
        import torch
        from scaletrain import TaskSpec


        class Stripes(torch.utils.data.Dataset):
            """12x12 images: the class is the orientation of the stripes (3), plus noise."""

            def __init__(self, n, seed):
                g = torch.Generator().manual_seed(seed)
                self.labels = torch.randint(0, 3, (n,), generator=g)
                grid = torch.arange(12.0)
                patterns = torch.stack([grid.view(1, 12).expand(12, 12),
                                        grid.view(12, 1).expand(12, 12),
                                        grid.view(12, 1) + grid.view(1, 12)])
                self.images = (torch.sin(patterns[self.labels]) +
                               0.3 * torch.randn(n, 12, 12, generator=g)).unsqueeze(1)

            def __len__(self):
                return len(self.labels)

            def __getitem__(self, i):
                return self.images[i], int(self.labels[i])


        def stripes(split, n=192):
            return Stripes(n, seed=0 if split == "train" else 1), TaskSpec("classification", (1, 12, 12), 3)
    ''',
    "shapes/losses.py": """
        import torch.nn.functional as F


        def summed_ce(output, batch):
            return F.cross_entropy(output, batch.targets, reduction="sum"), len(batch.targets)
    """,
}

CONFIG = """
[model]
name = "shapes.nets:build"
[model.kwargs]
width = 8
[data]
source = "shapes.data:stripes"
[optim]
name = "sgd"
lr = 0.2
grad_clip = 0.0
[train]
steps = 4
global_batch = 32
seed = 3
eval_examples = 64
[precision]
mode = "fp64"
[log]
every = 1
quiet = true
"""


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, body in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    write_package(tmp_path, PACKAGE)
    (tmp_path / "cfg.toml").write_text(CONFIG)
    return tmp_path


@pytest.fixture(scope="module")
def package_dir(tmp_path_factory) -> Path:
    """The user's package, written once for this file's runs (their working directory)."""
    root = tmp_path_factory.mktemp("user-package")
    write_package(root, PACKAGE)
    return root


def _case(*, dp: int, micro_batch: int, extra=()) -> Case:
    return Case.of(CONFIG, f"parallel.dp={dp}", f"train.micro_batch={micro_batch}", *extra)


@pytest.mark.slow
def test_user_package_dp2_and_accumulation_match_one_process(trained, package_dir: Path) -> None:
    """The runs import the package from their working directory, as `scaletrain train` run
    there does; one job per world size (test_example_package_trains_from_its_directory
    takes the launcher's path)."""
    one = trained(
        {
            "dp1": _case(dp=1, micro_batch=32),
            "one-step": _case(dp=1, micro_batch=32, extra=["train.steps=1"]),
        },
        world_size=1,
        cwd=package_dir,
    )
    two = trained(
        {
            "dp2": _case(dp=2, micro_batch=16),
            "dp2-accum": _case(dp=2, micro_batch=4),
            # Sharded: a model without init_module is built whole on every rank (said so).
            "dp_shard2": Case.of(CONFIG, "parallel.dp_shard=2", "train.micro_batch=16"),
        },  # 4 micro-batches each
        world_size=2,
        cwd=package_dir,
    )
    reference = one["dp1"].run_dir
    ref = load_weights(reference)
    assert next(iter(ref.values())).dtype == torch.float64
    for run in (two["dp2"].run_dir, two["dp2-accum"].run_dir, two["dp_shard2"].run_dir):
        assert max_abs_diff(ref, load_weights(run)) < TOL, run.name
        assert losses(run) == pytest.approx(losses(reference), abs=TOL)
    assert "is built whole on every rank" in two["dp_shard2"].stderr[0]
    assert "init_module" in two["dp_shard2"].stderr[0]
    # The steps moved the weights well beyond the tolerance: the comparison has teeth.
    assert max_abs_diff(ref, load_weights(one["one-step"].run_dir)) > 1e-3


def test_user_loss_gives_the_builtin_gradients(user_dir: Path) -> None:
    """One SGD step with the user's (sum, count) loss lands on the built-in loss's weights."""
    sys.path.insert(0, str(user_dir))
    try:
        from shapes.data import stripes
        from shapes.losses import summed_ce
        from shapes.nets import build

        from scaletrain.data.user_source import MapSource
        from scaletrain.loss import cross_entropy
        from scaletrain.precision import make_precision
        from scaletrain.training.optim import build_scheduler
        from scaletrain.training.step import train_step

        dataset, task = stripes("train")
        source = MapSource(dataset, task, label="test")
        micro = [source.get(torch.arange(i, i + 8)) for i in (0, 8)]
        weights = {}
        for name, loss_fn in (("builtin", cross_entropy), ("user", summed_ce)):
            torch.manual_seed(0)
            model = build(task).double()
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            train_step(
                model,
                micro,
                optimizer=opt,
                scheduler=build_scheduler(
                    opt, warmup_steps=0, total_steps=1, schedule="constant", min_lr_ratio=1.0
                ),
                precision=make_precision("fp64", device_type="cpu"),
                grad_clip=0.0,
                dp_size=1,
                ragged_counts=False,
                loss_fn=loss_fn,
            )
            weights[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.manual_seed(0)
        start = build(task).double().state_dict()
        assert max_abs_diff(weights["builtin"], start) > 1e-3  # the step moved them
        assert max_abs_diff(weights["builtin"], weights["user"]) < 1e-12
    finally:
        sys.path.remove(str(user_dir))
        for name in [m for m in sys.modules if m == "shapes" or m.startswith("shapes.")]:
            del sys.modules[name]


@pytest.mark.slow
def test_example_package_trains_from_its_directory(tmp_path: Path) -> None:
    """examples/own_model as the README runs it: `scaletrain train config.toml` from there,
    through the console script (which, unlike `python -m`, does not put the working
    directory on sys.path: scaletrain does, the same way in the launcher and the workers)."""
    example = tmp_path / "own_model"
    shutil.copytree(
        REPO / "examples" / "own_model", example, ignore=shutil.ignore_patterns("__pycache__")
    )
    import subprocess

    from harness import cli_env

    script = Path(sys.executable).with_name("scaletrain")
    result = subprocess.run(
        [
            str(script),
            "train",
            "config.toml",
            "--nproc",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            "train.steps=30",
            "train.eval_every=0",
            "log.quiet=true",
        ],
        cwd=example,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"accuracy"' in summary
    config = (tmp_path / "run" / "config.toml").read_text()
    assert 'name = "digitsnet.model:build"' in config
