"""Checkpoint directories on disk: a damaged newest checkpoint is moved aside on resume
(`step-N.corrupt-<time>`, kept, reported, never listed or pruned), so the next save of
step N succeeds; an old checkpoint that cannot be pruned is reported with its path and
the error, not ignored."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import scaletrain.checkpoint.files as checkpoint_files
from scaletrain.checkpoint import Checkpointer, TrainState, load
from scaletrain.checkpoint.files import latest_valid, list_checkpoints
from scaletrain.data.sources import TaskSpec
from scaletrain.models import build_model
from scaletrain.precision import make_precision
from scaletrain.training.optim import build_optimizer, build_scheduler


def _state() -> TrainState:
    torch.manual_seed(0)
    model = build_model("mlp", size="tiny", task=TaskSpec("classification", (1, 8, 8), 10))
    opt = build_optimizer(
        model, name="adamw", lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), momentum=0.0
    )
    sched = build_scheduler(
        opt, warmup_steps=0, total_steps=10, schedule="constant", min_lr_ratio=1.0
    )
    return TrainState(model, opt, sched, make_precision("fp32", device_type="cpu"))


def _save(saver: Checkpointer, state: TrainState, step: int) -> None:
    state.step = step
    saver.save(state)


def test_a_damaged_checkpoint_is_moved_aside_and_its_step_saved_again(tmp_path: Path) -> None:
    state, messages = _state(), []
    saver = Checkpointer(tmp_path, keep=2, async_save=False, config_toml="", report=messages.append)
    _save(saver, state, 2)
    _save(saver, state, 4)
    data = next((tmp_path / "step-00000004").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-100])

    reports = []
    found = latest_valid(tmp_path, report=reports.append, quarantine=True)
    assert found.name == "step-00000002"
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("step-00000004.corrupt-")]
    assert len(aside) == 1 and (aside[0] / data.name).is_file()  # kept, as it was
    assert len(reports) == 1 and "step-00000004" in reports[0] and aside[0].name in reports[0]
    assert "truncated" in reports[0]
    load(found, _state())

    _save(saver, state, 4)  # the name is free again: no "Directory not empty"
    _save(saver, state, 6)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000006"]
    assert aside[0].is_dir()  # pruning leaves it alone
    assert messages == []


def test_skipping_without_quarantine_moves_nothing(tmp_path: Path) -> None:
    state = _state()
    saver = Checkpointer(tmp_path, keep=2, async_save=False, config_toml="")
    _save(saver, state, 1)
    (tmp_path / "step-00000001" / "manifest.json").unlink()
    assert latest_valid(tmp_path, report=lambda m: None) is None
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_checkpoint_that_cannot_be_pruned_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    real_rmtree = shutil.rmtree

    def refuse(path, *args, **kwargs):  # e.g. a file another user owns
        if Path(path).name != "step-00000001":
            return real_rmtree(path, *args, **kwargs)
        raise PermissionError(13, "Permission denied", str(path))

    state, messages = _state(), []
    saver = Checkpointer(
        tmp_path, keep=1, async_save=async_save, config_toml="", report=messages.append
    )
    _save(saver, state, 1)
    monkeypatch.setattr(checkpoint_files.shutil, "rmtree", refuse)
    _save(saver, state, 2)
    saver.close()
    assert len(messages) == 1, messages
    assert "could not remove old checkpoint" in messages[0]
    assert str(tmp_path / "step-00000001") in messages[0] and "Permission denied" in messages[0]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001", "step-00000002"]


def test_export_writes_the_model_under_its_own_names_or_a_rename_from_above(tmp_path: Path) -> None:
    """export_weights knows no distillation: a distilled run's caller hands it the student's
    `strip_wrapper` (cli export, distill/teacher.py), a plain export keeps every name."""
    from safetensors.torch import load_file

    from scaletrain.distill.student import strip_wrapper

    state = _state()
    saver = Checkpointer(tmp_path / "ckpt", keep=1, async_save=False, config_toml="", report=print)
    _save(saver, state, 1)
    step = tmp_path / "ckpt" / "step-00000001"
    plain = load_file(checkpoint_files.export_weights(step, tmp_path / "plain.safetensors"))
    expected = state.model.state_dict()
    assert plain.keys() == expected.keys()
    assert all(torch.equal(plain[k], expected[k]) for k in expected)
    renamed = load_file(
        checkpoint_files.export_weights(
            step,
            tmp_path / "renamed.safetensors",
            rename=lambda w: {f"student.{k}": v for k, v in w.items()},
        )
    )
    assert renamed.keys() == {f"student.{k}" for k in expected}
    assert strip_wrapper(renamed).keys() == expected.keys()  # what a distilled run exports


# ------------------------------------------------------------------ a crafted .metadata
#
# Each payload, if executed, creates the file MARK names. Each is a whole pickle (protocol
# 4) whose globals are resolved by the metadata unpickler; the checkpoint's manifest is
# written again over the tampered file, as an attacker would, so only the unpickler stands
# between the payload and the process.


def _str(text: str) -> bytes:  # SHORT_BINUNICODE / BINUNICODE, no memo
    raw = text.encode()
    return (
        b"\x8c" + bytes([len(raw)]) if len(raw) < 256 else b"X" + len(raw).to_bytes(4, "little")
    ) + raw


def _global(module: str, name: str) -> bytes:  # STACK_GLOBAL: find_class(module, name)
    return _str(module) + _str(name) + b"\x93"


def _call(func: bytes, *args: bytes) -> bytes:  # func(*args): MARK args TUPLE REDUCE
    return func + b"(" + b"".join(args) + b"tR"


def _pickle(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


def _gadgets(mark: Path) -> dict[str, bytes]:
    touch = _str(f"touch {mark}")
    code = _str(f"open({str(mark)!r}, 'w').close()")
    evil_save = mark.with_name("evil.pt")  # a torch.save file whose unpickling runs code
    return {
        "dotted name in an allowed module": _call(
            _global("torch.distributed.checkpoint.filesystem", "os.system"), touch
        ),
        "dotted name through pathlib": _call(_global("pathlib", "os.system"), touch),
        "dotted name through torch": _call(_global("torch", "serialization.os.system"), touch),
        "a loader in DCP's own package": _call(
            _global("torch.distributed.checkpoint.format_utils", "torch_save_to_dcp"),
            _str(str(evil_save)),
            _str(str(mark.with_name("out"))),
        ),
        "builtins.getattr chain": _call(
            _call(
                _global("builtins", "getattr"),
                _call(_global("builtins", "__import__"), _str("os")),
                _str("system"),
            ),
            touch,
        ),
        "builtins.eval": _call(_global("builtins", "eval"), code),
        "builtins.exec": _call(_global("builtins", "exec"), code),
        "functools.partial": _call(
            _call(_global("functools", "partial"), _global("os", "system"), touch)
        ),
        "operator.attrgetter": _call(
            _call(_global("operator", "attrgetter"), _str("system")),
            _call(_global("builtins", "__import__"), _str("os")),
        ),
        "subprocess": _call(_global("subprocess", "check_call"), touch, b"\x88"),
        "posix.system": _call(_global("posix", "system"), touch),
        "os.system": _call(_global("os", "system"), touch),
        "torch.load": _call(_global("torch", "load"), _str(str(evil_save))),
        # an allowed class, hostile arguments: a layout name that is none
        "allowed function, hostile argument": _call(
            _global("torch.serialization", "_get_layout"), _str("torch.evil")
        ),
    }


def _tamper(checkpoint: Path, metadata: bytes) -> None:
    """Replace `.metadata` and write the manifest again to match (the attacker's move)."""
    import json

    (checkpoint / ".metadata").write_bytes(metadata)
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": checkpoint_files.file_sha256(p)}
        for p in sorted(checkpoint.iterdir())
        if p.is_file() and p.name != checkpoint_files.MANIFEST
    }
    (checkpoint / checkpoint_files.MANIFEST).write_text(json.dumps({"files": files}))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    _save(Checkpointer(root, keep=1, async_save=False, config_toml="", report=print), _state(), 1)
    return root / "step-00000001"


@pytest.mark.parametrize("gadget", list(_gadgets(Path("/nonexistent/mark"))))
def test_every_known_gadget_in_the_metadata_is_refused(
    saved: Path, tmp_path: Path, gadget: str
) -> None:
    mark = tmp_path / "pwned"
    (tmp_path / "evil.pt").write_bytes(
        _pickle(_call(_global("os", "system"), _str(f"touch {mark}")))
    )
    checkpoint = tmp_path / "step-00000001"
    shutil.copytree(saved, checkpoint)
    _tamper(checkpoint, _pickle(_gadgets(mark)[gadget]))
    with pytest.raises(checkpoint_files.CheckpointError, match="refusing|unreadable"):
        load(checkpoint, _state())  # --resume
    with pytest.raises(checkpoint_files.CheckpointError, match="refusing|unreadable"):
        checkpoint_files.export_weights(checkpoint, tmp_path / "out.safetensors")  # export
    assert not mark.exists(), f"{gadget}: the payload ran"


@pytest.mark.parametrize("where", ["../outside.distcp", "/etc/passwd", "sub/dir.distcp"])
def test_metadata_that_points_outside_its_checkpoint_is_refused(
    saved: Path, tmp_path: Path, where: str
) -> None:
    """The metadata's own classes, hostile values: a storage entry reading a file elsewhere."""
    import pickle

    checkpoint = tmp_path / "step-00000001"
    shutil.copytree(saved, checkpoint)
    metadata = checkpoint_files.read_metadata(checkpoint / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = where
    _tamper(checkpoint, pickle.dumps(metadata, protocol=4))
    with pytest.raises(checkpoint_files.CheckpointError, match="not a file of its own directory"):
        load(checkpoint, _state())


def test_a_real_checkpoint_still_loads_through_the_allowlist(saved: Path) -> None:
    state = _state()
    load(saved, state)
    assert state.step == 1


ONE_PROCESS_SAVES = """
from pathlib import Path
import sys
sys.path.insert(0, sys.argv[1])
from test_checkpoint_files import _state
from scaletrain.checkpoint import Checkpointer, load
from scaletrain.checkpoint.files import export_weights, list_checkpoints

for mode in (True, False):
    saver = Checkpointer(Path(sys.argv[2]) / str(mode), keep=1, async_save=mode, config_toml="")
    state = _state()
    state.step = 1
    saver.save(state)
    saver.close()
    step = list_checkpoints(saver.directory)[-1]
    load(step, _state())
    export_weights(step, step.parent / "out.safetensors")
"""


def test_a_one_process_save_load_and_export_print_nothing(tmp_path: Path) -> None:
    """DCP's "torch.distributed is disabled" warning (each call without a process group,
    an async save's from DCP's own thread) never reaches a one-process run's output."""
    import subprocess
    import sys

    from harness import cli_env

    r = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS_SAVES, str(Path(__file__).parent), str(tmp_path)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == "" and r.stdout == "", r.stderr[-3000:]
