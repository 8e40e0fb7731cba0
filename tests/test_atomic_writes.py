"""What a run or a command writes replaces the old file only once it is whole: a crash
mid-write (a save that raises after writing part of its file) leaves the earlier file or
directory as it was, and no partial one behind, for `scaletrain export`, the run's
model.safetensors and its hf-model/ directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import scaletrain.training.finish as finish
from scaletrain.checkpoint import Checkpointer, TrainState
from scaletrain.checkpoint.files import export_weights, list_checkpoints
from scaletrain.config import Config
from scaletrain.data.sources import TaskSpec
from scaletrain.models import build_model
from scaletrain.precision import make_precision
from scaletrain.runtime import written_atomically
from scaletrain.training.optim import build_optimizer, build_scheduler

TASK = TaskSpec("classification", (1, 8, 8), 10)


class Crash(RuntimeError):
    pass


def _crashing(path_arg: int):
    """A stand-in for a save function: writes a few bytes where it was told, then raises."""

    def save(*args, **kwargs):
        target = Path(args[path_arg])
        if target.suffix or not target.exists():  # a file, or a directory it creates
            target.parent.mkdir(parents=True, exist_ok=True)
            (target if target.suffix else target.with_suffix(".part")).write_bytes(b"half")
        raise Crash("the disk filled up")

    return save


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_written_atomically_replaces_a_file_and_a_directory_only_when_done(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("old")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("old")
    before = _tree(tmp_path)
    for name in ("f", "d"):
        with pytest.raises(Crash), written_atomically(tmp_path / name) as tmp:
            if name == "d":
                tmp.mkdir()
                (tmp / "x").write_text("new, half")
            else:
                tmp.write_text("new, half")
            raise Crash
    assert _tree(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]
    with written_atomically(tmp_path / "d") as tmp:
        tmp.mkdir()
        (tmp / "y").write_text("new")
    assert _tree(tmp_path / "d") == {"y": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]


def test_a_crashed_export_leaves_the_earlier_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = build_model("mlp", size="tiny", task=TASK)
    opt = build_optimizer(
        model, name="sgd", lr=0.1, weight_decay=0.0, betas=(0.9, 0.999), momentum=0.0
    )
    sched = build_scheduler(opt, warmup_steps=0, total_steps=1, schedule="constant", min_lr_ratio=1)
    state = TrainState(model, opt, sched, make_precision("fp32", device_type="cpu"))
    Checkpointer(tmp_path / "ckpt", keep=1, async_save=False, config_toml="").save(state)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"the earlier export")
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", _crashing(1))
    with pytest.raises(Crash):
        export_weights(list_checkpoints(tmp_path / "ckpt")[-1], out)
    assert out.read_bytes() == b"the earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out.safetensors"]


@pytest.mark.parametrize("name", ["mlp", "hf"])
def test_a_crashed_final_save_leaves_the_earlier_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    if name == "hf":
        pytest.importorskip("transformers")
        config = Config.model_validate(
            {
                "model": {
                    "name": "hf",
                    "hf_config": "LlamaConfig",
                    "kwargs": {
                        "vocab_size": 256,
                        "hidden_size": 16,
                        "intermediate_size": 32,
                        "num_hidden_layers": 1,
                        "num_attention_heads": 2,
                        "max_position_embeddings": 64,
                    },
                },
                "data": {"source": "synthetic-text"},
            }
        )
        model = build_model(
            "hf",
            size="tiny",
            task=TaskSpec("lm", (32,), 256),
            **config.model.model_dump(include={"hf_config", "kwargs"}),
        )
    else:
        config = Config.model_validate({"model": {"name": "mlp"}, "data": {"source": "digits"}})
        model = build_model("mlp", size="tiny", task=TASK)
    run = tmp_path / "run"
    run.mkdir()
    finish.write_weights(run, model=model, weights=None, config=config)
    before = _tree(run)
    assert "model.safetensors" in before and (name != "hf" or "hf-model/config.json" in before)

    monkeypatch.setattr(finish, "save_model", _crashing(1))
    if name == "hf":  # the file goes through; the directory's save crashes
        monkeypatch.undo()
        monkeypatch.setattr(type(model), "save_pretrained", _crashing(1))
    with pytest.raises(Crash):
        finish.write_weights(run, model=model, weights=None, config=config)
    if name == "hf":  # model.safetensors was written again (safetensors orders its metadata
        # as it likes): the directory is the earlier one, whole
        before = {k: v for k, v in before.items() if k.startswith("hf-model/")}
        assert sorted(p.name for p in run.iterdir()) == ["hf-model", "model.safetensors"]
    got = _tree(run if name != "hf" else run / "hf-model")
    if name == "hf":
        got = {f"hf-model/{k}": v for k, v in got.items()}
    assert got == before  # the whole earlier file or directory; nothing partial beside
