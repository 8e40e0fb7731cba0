"""The user's own model, data and loss, named by import path: bad input is refused with the
path named, in one line, with no traceback (user_code.py, training/assemble.py).

Each CLI case writes a small user package (`ucpkg`) into the test's temporary directory
and runs `scaletrain train cfg.toml` there, as a user would, with one key changed to a
faulty function. The contract checked for every case: exit status 2, one line
`scaletrain: error: ...` on stderr naming the config key's import path and what is wrong,
no "Traceback". With `--nproc 2` the launcher must refuse before any worker starts
(`api.prepare_run` -> `assemble.check_user_code`), so RUN_DIR/logs (where the workers'
output goes) must not exist; a few cases run in one process, where the trainer itself
meets the mistake.

The CLI cases call `scaletrain.cli.main` in this process (as test_cli_errors.py does), in
the package's directory with sys.path and sys.modules restored after (`imported`), with
the launcher replaced by a function that fails the test (`harness.forbid_starting`); a
`--nproc 2` case forbids the worker too, a `--nproc 1` case lets the trainer run here,
as the CLI runs it (`_run_worker(..., exit_process=False)`). Two cases stay real
`python -m scaletrain` processes (slow): one `--nproc 2` refusal, for the contract as a
user's shell sees it (the interpreter's own start, imports from the working directory,
anything torch prints to stderr), and the good package training in a real process
(the control: what the cases refuse is the one key changed, not the setup).

The unit tests below them need no subprocess: `load_object`, `import_path_of`,
`check_summed` (a summed loss passes, a mean fails: the check can fail for the defect it
is for) and the config's refusals of model keys.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import scaletrain.cli
import scaletrain.commands.train

from harness import cli_main, forbid_starting, run_cli

PKG = "ucpkg"

FILES = {
    "ucpkg/__init__.py": "",
    "ucpkg/model.py": """
        import math

        from torch import nn

        NOT_CALLABLE = 3


        def build(task, *, width=8):
            return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(task.input_shape), width),
                                 nn.Tanh(), nn.Linear(width, task.num_classes))
    """,
    "ucpkg/data.py": '''
        import torch


        class Blobs:
            """Gaussian blobs: item i is (inputs (dim,) float, class id)."""

            def __init__(self, n, dim, classes, seed, bad_last=False):
                g = torch.Generator().manual_seed(seed)
                self.y = torch.randint(0, classes, (n,), generator=g)
                centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(9))
                self.x = centres[self.y] + 0.5 * torch.randn(n, dim, generator=g)
                self.bad_last = bad_last

            def __len__(self):
                return len(self.y)

            def __getitem__(self, i):
                if self.bad_last and i == len(self) - 1:
                    return torch.zeros(5), int(self.y[i])  # the task says (4,)
                return self.x[i], int(self.y[i])


        def task(dim=4, classes=3):
            return {"kind": "classification", "input_shape": (dim,), "num_classes": classes}


        def blobs(split, *, n=16, dim=4):
            return Blobs(n, dim, 3, seed=0 if split == "train" else 1), task(dim)
    ''',
    "ucpkg/loss.py": """
        import torch.nn.functional as F


        def summed(output, batch):
            return F.cross_entropy(output, batch.targets, reduction="sum"), batch.targets.shape[0]


        def mean(output, batch):
            return F.cross_entropy(output, batch.targets, reduction="mean"), batch.targets.shape[0]


        def wrong_count(output, batch):
            loss = F.cross_entropy(output, batch.targets, reduction="sum")
            return loss, batch.targets.shape[0] + 1
    """,
    "ucpkg/bad.py": """
        from torch import nn

        from ucpkg.data import Blobs, task


        def raises(task, *, width=8):
            raise ValueError("width must be even")  # MARK raises


        def returns_dict(task):
            return {"weight": 1}


        def noargs():
            return nn.Linear(4, 3)


        class Ten(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(10, 3)

            def forward(self, x):
                return self.lin(x)  # MARK forward


        def ten_inputs(task):
            return Ten()


        def six_features(split):
            return Blobs(8, 6, 3, seed=0), task(dim=6)


        def wrong_last_item(split):
            return Blobs(8, 4, 3, seed=0, bad_last=True), task(dim=4)


        def alone(split):
            return Blobs(8, 4, 3, seed=0)
    """,
    "ucpkg/boom.py": """
        import torch
        raise RuntimeError("boom")  # MARK boom


        def build(task):
            return torch.nn.Linear(4, 3)
    """,
    "ucpkg/needs_dep.py": """
        import nosuchdep_for_scaletrain_tests


        def build(task):
            return None
    """,
}

CONFIG = """\
name = "user-code"
[model]
name = "ucpkg.model:build"
[data]
source = "ucpkg.data:blobs"
[train]
loss = "ucpkg.loss:summed"
steps = 2
global_batch = 8
micro_batch = 4
eval_examples = 8
[optim]
name = "sgd"
lr = 0.1
[precision]
mode = "fp64"
[log]
quiet = true
"""


def write_package(root: Path) -> None:
    for name, body in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body).lstrip("\n"))
    (root / "cfg.toml").write_text(CONFIG)


def line_of(root: Path, file: str, mark: str) -> str:
    """`ROOT/FILE:N`, the line of FILE holding `# MARK mark`."""
    lines = (root / file).read_text().splitlines()
    n = next(i for i, line in enumerate(lines, 1) if f"# MARK {mark}" in line)
    return f"{root / file}:{n}"


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    write_package(tmp_path)
    return tmp_path


@pytest.fixture
def imported(user_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """The package importable in this process; sys.path and sys.modules restored after."""
    monkeypatch.syspath_prepend(str(user_dir))  # restores the whole of sys.path on undo
    monkeypatch.chdir(user_dir)
    importlib.invalidate_caches()
    yield user_dir
    for name in [m for m in sys.modules if m == PKG or m.startswith(PKG + ".")]:
        del sys.modules[name]


def train_argv(
    run_dir: Path, overrides: tuple[str, ...], nproc: int, flags: tuple[str, ...] = ()
) -> list[str]:
    """`train cfg.toml OVERRIDES --run-dir RUN_DIR FLAGS [--nproc N]`."""
    args = ["train", "cfg.toml", *overrides, "--run-dir", str(run_dir), *flags]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    return args


def check_refused(code: int, out: str, err: str, run_dir: Path, nproc: int) -> str:
    """The one-line refusal before anything started; return the error line."""
    assert code == 2, f"exit {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if "scaletrain: error:" in line]
    assert len(errors) == 1, err[-3000:]
    assert "done in" not in out
    if nproc > 1:  # refused in the launcher: no worker ever started or wrote its log
        assert not (run_dir / "logs").exists(), sorted(p.name for p in run_dir.iterdir())
        assert not (run_dir / "metrics.jsonl").exists()
    return errors[0]


def refuse_in_a_process(user_dir: Path, *overrides: str, nproc: int = 2) -> str:
    """Run `scaletrain train cfg.toml OVERRIDES` as a real process in user_dir; check the
    one-line refusal before anything started and return the error line."""
    run_dir = user_dir / "run"
    r = run_cli(train_argv(run_dir, overrides, nproc), cwd=user_dir, timeout=120)
    return check_refused(r.returncode, r.stdout, r.stderr, run_dir, nproc)


@pytest.fixture
def cli_here(imported: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """`scaletrain train cfg.toml ...` in this process, in the package's directory:
    run(*overrides, nproc=, flags=) -> (status, stdout, stderr). No launcher may start; with
    nproc > 1 no worker either (the launcher must refuse), with nproc = 1 the trainer runs
    here as the CLI runs it. Torch's thread count and OMP_NUM_THREADS (the trainer sets
    both) are put back after."""
    run_worker = scaletrain.commands.train.run_worker
    forbid_starting(monkeypatch, imported)
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")

    def run(*overrides: str, nproc: int = 2, flags: tuple[str, ...] = ()) -> tuple[int, str, str]:
        if nproc == 1:  # one process: cli.cmd_train trains right here (spec.in_process)
            monkeypatch.setattr(scaletrain.commands.train, "run_worker", run_worker)
        capsys.readouterr()
        code = cli_main(train_argv(imported / "run", overrides, nproc, flags))
        out, err = capsys.readouterr()
        return code, out, err

    try:
        yield run
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp


@pytest.fixture
def refuse(cli_here, imported: Path):
    """refuse(*overrides, nproc=2): `scaletrain train cfg.toml OVERRIDES` in this process;
    check the one-line refusal before anything started and return the error line."""

    def run(*overrides: str, nproc: int = 2) -> str:
        code, out, err = cli_here(*overrides, nproc=nproc)
        return check_refused(code, out, err, imported / "run", nproc)

    return run


# --------------------------------------------------------------------------- the CLI


def test_module_that_does_not_exist(user_dir: Path, refuse) -> None:
    line = refuse("model.name=ucpkg.nosuch:build")
    assert "model.name = 'ucpkg.nosuch:build'" in line
    assert "no module named 'ucpkg.nosuch'" in line
    assert f"searched the working directory {user_dir}" in line


def test_package_that_does_not_exist(user_dir: Path, refuse) -> None:
    """A missing top-level package is named as such (not the module path)."""
    line = refuse("data.source=nosuchpkg.data:blobs")
    assert "data.source = 'nosuchpkg.data:blobs'" in line
    assert "no module named 'nosuchpkg'" in line
    assert "searched the working directory" in line


def test_module_that_raises_while_importing(user_dir: Path, refuse) -> None:
    line = refuse("model.name=ucpkg.boom:build")
    assert "model.name = 'ucpkg.boom:build'" in line
    assert "importing 'ucpkg.boom' failed" in line
    assert "RuntimeError: boom" in line
    assert line_of(user_dir, "ucpkg/boom.py", "boom") in line


def test_attribute_the_module_lacks(user_dir: Path, refuse) -> None:
    line = refuse("train.loss=ucpkg.loss:sumed")
    assert "train.loss = 'ucpkg.loss:sumed'" in line
    assert "has no attribute 'sumed'" in line
    assert str(user_dir / "ucpkg" / "loss.py") in line
    assert "summed" in line.split("its callables:")[1]  # what is there, to choose from


def test_factory_that_raises(user_dir: Path, refuse) -> None:
    line = refuse("model.name=ucpkg.bad:raises")
    assert "model.name = 'ucpkg.bad:raises' raised ValueError: width must be even" in line
    assert line_of(user_dir, "ucpkg/bad.py", "raises") in line


def test_factory_that_raises_in_one_process(user_dir: Path, refuse) -> None:
    """No launcher: the trainer builds the model and meets the same mistake."""
    line = refuse("model.name=ucpkg.bad:raises", nproc=1)
    assert "model.name = 'ucpkg.bad:raises' raised ValueError: width must be even" in line
    assert line_of(user_dir, "ucpkg/bad.py", "raises") in line


def test_factory_that_returns_no_module(user_dir: Path, refuse) -> None:
    line = refuse("model.name=ucpkg.bad:returns_dict")
    assert "model.name = 'ucpkg.bad:returns_dict' returned a dict" in line
    assert "not a torch.nn.Module" in line


def test_factory_whose_signature_does_not_fit(user_dir: Path, refuse) -> None:
    line = refuse("model.name=ucpkg.bad:noargs")
    assert "model.name = 'ucpkg.bad:noargs' cannot be called as scaletrain calls it" in line
    assert "noargs() takes 0 positional arguments but 1 was given" in line


@pytest.mark.slow  # a real `python -m scaletrain` process (~4 s)
def test_data_that_do_not_fit_the_model(user_dir: Path) -> None:
    """The task says 6 features (and the items have 6), the model's Linear takes 10: the
    launcher's one forward fails, naming both keys and the user's line."""
    line = refuse_in_a_process(
        user_dir, "model.name=ucpkg.bad:ten_inputs", "data.source=ucpkg.bad:six_features"
    )
    assert (
        "model.name = 'ucpkg.bad:ten_inputs' cannot run on data.source = 'ucpkg.bad:six_features'"
    ) in line
    assert "a batch of inputs (2, 6)" in line
    assert "RuntimeError" in line
    assert line_of(user_dir, "ucpkg/bad.py", "forward") in line


def test_data_that_do_not_fit_the_model_in_one_process(user_dir: Path, refuse) -> None:
    line = refuse("model.name=ucpkg.bad:ten_inputs", "data.source=ucpkg.bad:six_features", nproc=1)
    assert "model.name = 'ucpkg.bad:ten_inputs'" in line
    assert "data.source = 'ucpkg.bad:six_features'" in line


def test_item_that_does_not_fit_its_own_task(user_dir: Path, refuse) -> None:
    line = refuse("data.source=ucpkg.bad:wrong_last_item")
    assert "data.source = 'ucpkg.bad:wrong_last_item' (split 'train')" in line
    assert "item 7 has inputs of shape (5,), but the task says input_shape = (4,)" in line


def test_data_function_that_returns_a_dataset_alone(user_dir: Path, refuse) -> None:
    line = refuse("data.source=ucpkg.bad:alone")
    assert "data.source = 'ucpkg.bad:alone'" in line
    assert "returned a Blobs; a data function returns (dataset, task)" in line


def test_loss_that_returns_a_mean(user_dir: Path, refuse) -> None:
    line = refuse("train.loss=ucpkg.loss:mean")
    assert "train.loss = 'ucpkg.loss:mean' must return the loss summed over the batch" in line
    assert "it looks like a mean" in line
    assert "reduction='sum'" in line


def test_loss_that_returns_a_mean_in_one_process(user_dir: Path, refuse) -> None:
    """The trainer checks the loss on its first micro-batch before step 1."""
    line = refuse("train.loss=ucpkg.loss:mean", nproc=1)
    assert "train.loss = 'ucpkg.loss:mean'" in line
    assert "it looks like a mean" in line
    assert not (user_dir / "run" / "metrics.jsonl").exists()  # no step ran


def test_loss_that_returns_the_wrong_count(user_dir: Path, refuse) -> None:
    line = refuse("train.loss=ucpkg.loss:wrong_count")
    assert "train.loss = 'ucpkg.loss:wrong_count'" in line
    m = re.search(r"returned count (\d+) for a micro-batch whose loss normaliser is (\d+)", line)
    assert m, line
    assert int(m.group(1)) == int(m.group(2)) + 1  # both counts named: the loss's and the batch's


@pytest.mark.slow  # a real `python -m scaletrain` process that trains (~4 s)
def test_summed_loss_is_accepted(user_dir: Path) -> None:
    """The good package trains through the same launcher checks (the control for the cases
    above: what they refuse is the one key changed, not the setup)."""
    run_dir = user_dir / "run"
    r = run_cli(["train", "cfg.toml", "--run-dir", str(run_dir)], cwd=user_dir, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run_dir / "model.safetensors").is_file()


@pytest.mark.parametrize("nproc", [1, 2])
def test_debug_shows_the_traceback(user_dir: Path, cli_here, nproc: int) -> None:
    """--debug is the escape hatch: the user's own frames, then the same one line, status 2
    (in one process the trainer meets the error; with two the launcher does)."""
    run_dir = user_dir / "run"
    code, _, err = cli_here("model.name=ucpkg.bad:raises", nproc=nproc, flags=("--debug",))
    assert code == 2, err[-3000:]
    assert "Traceback (most recent call last)" in err
    file, line = line_of(user_dir, "ucpkg/bad.py", "raises").rsplit(":", 1)
    assert f'File "{file}", line {line}, in raises' in err  # the user's frame
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("scaletrain: error: model.name = 'ucpkg.bad:raises' raised ValueError")
    )
    if nproc > 1:
        assert not (run_dir / "logs").exists()


# --------------------------------------------------------------------------- load_object


def test_load_object_imports_module_attributes(imported: Path) -> None:
    from scaletrain.user_code import load_object

    build = load_object("ucpkg.model:build", key="model.name")
    assert build is sys.modules["ucpkg.model"].build
    blobs_cls = load_object("ucpkg.data:Blobs", key="data.source")  # a class is callable too
    assert blobs_cls.__name__ == "Blobs"
    assert load_object("ucpkg.bad:Ten.forward", key="model.name").__name__ == "forward"


@pytest.mark.parametrize(
    "path, expect",
    [
        ("ucpkg.model", "is not an import path: write 'package.module:function'"),
        ("ucpkg/model.py:build", "is not an import path"),
        ("ucpkg.model:NOT_CALLABLE", "is a int, not a function or class to call"),
        ("ucpkg.model:nope", "module 'ucpkg.model' ("),
        ("ucpkg.nosuch:build", "no module named 'ucpkg.nosuch' (searched the working directory"),
        ("ucpkg.boom:build", "importing 'ucpkg.boom' failed: RuntimeError: boom (at "),
        # A dependency the module imports is missing: that module is named, not the path's.
        (
            "ucpkg.needs_dep:build",
            "importing 'ucpkg.needs_dep' failed: ModuleNotFoundError: No module "
            "named 'nosuchdep_for_scaletrain_tests' (at ",
        ),
    ],
)
def test_load_object_refuses(imported: Path, path: str, expect: str) -> None:
    from scaletrain.user_code import UserCodeError, load_object

    with pytest.raises(UserCodeError) as e:
        load_object(path, key="model.name")
    message = str(e.value)
    assert message.startswith(f"model.name = {path!r}"), message
    assert expect in message, message
    assert "\n" not in message


def test_load_object_searches_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `python -m` does for the workers, a console script finds the user's package in
    the working directory, with nothing on PYTHONPATH."""
    from scaletrain.user_code import load_object

    pkg = tmp_path / "cwdpkg_for_tests"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text("def f():\n    return 42\n")
    monkeypatch.chdir(tmp_path)
    # Not on sys.path yet (restored after): only the working directory can find it.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    importlib.invalidate_caches()
    try:
        assert load_object("cwdpkg_for_tests.m:f", key="model.name")() == 42
    finally:
        for name in [m for m in sys.modules if m.startswith("cwdpkg_for_tests")]:
            del sys.modules[name]


def test_call_tells_a_signature_mismatch_from_a_type_error_inside(imported: Path) -> None:
    """A TypeError from binding the arguments is the signature; one raised inside the
    user's function is the user's error, with their line."""
    from scaletrain.user_code import UserCodeError, call

    def inside(task):
        return len(task)  # TypeError: object of type 'int' has no len()

    with pytest.raises(UserCodeError, match="cannot be called as scaletrain calls it"):
        call(lambda: None, 1, key="model.name", path="m:f")
    with pytest.raises(UserCodeError) as e:
        call(inside, 1, key="model.name", path="m:f")
    assert "raised TypeError: object of type 'int' has no len()" in str(e.value)
    assert f"{__file__}:" in str(e.value)
    assert "cannot be called" not in str(e.value)


def test_describe_error_names_a_user_file_under_a_directory_called_scaletrain(
    tmp_path: Path,
) -> None:
    from scaletrain.user_code import describe_error

    user_file = tmp_path / "scaletrain" / "myproject" / "model.py"
    user_file.parent.mkdir(parents=True)
    user_file.write_text("def build(task):\n    raise ValueError('bad width')\n")
    namespace: dict = {}
    exec(compile(user_file.read_text(), str(user_file), "exec"), namespace)
    try:
        namespace["build"](None)
    except ValueError as e:
        assert f"(at {user_file}:2)" in describe_error(e)


# --------------------------------------------------------------------------- import_path_of


def module_level(task):
    return task


def test_import_path_of_round_trips_a_module_level_function(imported: Path) -> None:
    from scaletrain.user_code import import_path_of, load_object

    build = importlib.import_module("ucpkg.model").build
    path = import_path_of(build, key="model.name")
    assert path == "ucpkg.model:build"
    assert load_object(path, key="model.name") is build
    assert import_path_of(module_level, key="model.name") == f"{__name__}:module_level"


def test_import_path_of_refuses_what_workers_cannot_import() -> None:
    from scaletrain.user_code import UserCodeError, import_path_of

    def nested(task):
        return task

    with pytest.raises(UserCodeError) as e:
        import_path_of(lambda task: task, key="model.name")
    assert "model.name: " in str(e.value) and "lambda" in str(e.value)
    with pytest.raises(UserCodeError) as e:
        import_path_of(nested, key="data.source")
    assert "defined inside another" in str(e.value)
    assert "nested" in str(e.value)

    def in_main(task):
        return task

    in_main.__module__, in_main.__qualname__ = "__main__", "in_main"
    with pytest.raises(UserCodeError) as e:
        import_path_of(in_main, key="train.loss")
    message = str(e.value)
    assert "train.loss: in_main is defined in __main__" in message
    assert "loss=in_main" in message and "train.loss = 'mycode:in_main'" in message


def test_import_path_of_refuses_a_shadowed_name(imported: Path) -> None:
    """A function whose module-level name now means another object is not what workers get."""
    from scaletrain.user_code import UserCodeError, import_path_of

    model = importlib.import_module("ucpkg.model")
    original = model.build
    try:
        model.build = lambda task: None
        with pytest.raises(UserCodeError, match="gives a different object"):
            import_path_of(original, key="model.name")
    finally:
        model.build = original


# --------------------------------------------------------------------------- the loss check


def _check(loss_fn, *, dtype=torch.float64, n: int = 6) -> None:
    from scaletrain.data.sources import Batch
    from scaletrain.loss import check_summed

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(dtype)
    batch = Batch(
        inputs=torch.randn(n, 4, dtype=dtype), targets=torch.randint(0, 3, (n,)), count=n, tokens=0
    )
    check_summed(
        loss_fn,
        model,
        batch,
        task_kind="classification",
        forward=lambda net, b: net(b.inputs),
        label="train.loss = 'm:f'",
    )


def _ce(reduction: str, extra: int = 0):
    def loss(output, batch):
        return (
            torch.nn.functional.cross_entropy(output, batch.targets, reduction=reduction),
            batch.targets.shape[0] + extra,
        )

    return loss


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_check_summed_accepts_a_sum(dtype: torch.dtype) -> None:
    _check(_ce("sum"), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_check_summed_refuses_a_mean(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="it looks like a mean") as e:
        _check(_ce("mean"), dtype=dtype)
    assert "train.loss = 'm:f' must return the loss summed over the batch" in str(e.value)


def test_check_summed_refuses_a_wrong_count_and_a_non_scalar() -> None:
    with pytest.raises(
        ValueError, match="returned count 7 for a micro-batch whose loss normaliser is 6"
    ):
        _check(_ce("sum", extra=1))
    with pytest.raises(ValueError, match=r"returned a loss of shape \(6,\)"):
        _check(_ce("none"))
    with pytest.raises(ValueError, match="a loss returns a tuple"):
        _check(lambda output, batch: output.sum())


def test_check_summed_restores_the_training_mode() -> None:
    from scaletrain.data.sources import Batch
    from scaletrain.loss import check_summed

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5)).double()
    model.train()
    batch = Batch(
        inputs=torch.randn(4, 4, dtype=torch.float64),
        targets=torch.randint(0, 3, (4,)),
        count=4,
        tokens=0,
    )
    # Dropout on would make the halves differ from the whole: it passes only in eval mode.
    check_summed(
        _ce("sum"),
        model,
        batch,
        task_kind="classification",
        forward=lambda net, b: net(b.inputs),
        label="x",
    )
    assert model.training


# --------------------------------------------------------------------------- config keys


def test_misspelt_model_name_gets_a_did_you_mean() -> None:
    from scaletrain.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name=gtp"])
    message = str(e.value)
    assert "model.name" in message
    assert "did you mean 'gpt'?" in message
    assert "import path 'package.module:function'" in message


def test_model_kwargs_with_a_builtin_model_is_refused() -> None:
    from scaletrain.config import ConfigError, load_config
    from scaletrain.launch.resolve import resolve

    config = load_config(None, ["model.name=mlp", "data.source=digits", "model.kwargs={width=3}"])
    with pytest.raises(
        ConfigError,
        match=r"model.kwargs = \{'width': 3\} is only read by "
        r"model.name = 'hf' or an import path",
    ):
        resolve(config, world_size=1)


def test_data_kwargs_with_a_builtin_source_is_refused() -> None:
    from scaletrain.config import ConfigError, load_config
    from scaletrain.launch.resolve import resolve

    config = load_config(None, ["model.name=mlp", "data.source=digits", "data.kwargs={n=3}"])
    with pytest.raises(ConfigError, match="data.kwargs = .* is only read by a data function"):
        resolve(config, world_size=1)


def test_hf_model_needs_a_path_or_a_config() -> None:
    from scaletrain.config import ConfigError, load_config
    from scaletrain.launch.resolve import resolve

    config = load_config(None, ["model.name=hf", "data.source=synthetic-text"])
    with pytest.raises(ConfigError) as e:
        resolve(config, world_size=1)
    message = str(e.value)
    assert "model.name = 'hf' needs exactly one of model.path" in message
    assert "model.hf_config" in message
    assert "path = '', hf_config = ''" in message


def test_the_hint_for_a_main_callable_names_forms_that_are_accepted() -> None:
    """The hint used to say `name=mycode.build`, which is neither the API's argument nor an
    import path (refused as one). It names `model=build` (imported from mycode) and the
    config's `model.name = 'mycode:build'`, and that import path is accepted."""
    from scaletrain.config import validate_config
    from scaletrain.user_code import UserCodeError, import_path_of, is_import_path

    def build(task):
        return task

    build.__module__, build.__qualname__ = "__main__", "build"
    with pytest.raises(UserCodeError) as caught:
        import_path_of(build, key="model.name")
    message = str(caught.value)
    assert "name=mycode.build" not in message
    assert "from mycode import build" in message and "model=build" in message, message
    assert "model.name = 'mycode:build'" in message, message
    assert is_import_path("mycode:build")
    assert validate_config({"model": {"name": "mycode:build"}}).model.name == "mycode:build"
