"""Experiment trackers (log.trackers) with the real libraries, offline, in this process.

One short run on digits (a tiny MLP, log.every = 1, an evaluation every 2 steps) is stopped
after step 2 (train.stop_after) and resumed to step 4 with `resume=True`, through the
Python API in this process (one rank): the trackers see a resume as a user's would. Then:

- MLflow's store (RUN_DIR/mlruns) holds every number of metrics.jsonl at its step, read
  back with MlflowClient.get_metric_history; one run, the same before and after the resume.
- W&B's offline run directories hold them: each run-*.wandb file is read record by record
  (the LevelDB log framing W&B writes, each record decoded with W&B's own protobuf,
  wandb.proto.wandb_internal_pb2.Record: wandb 0.31 ships no Python reader of these files);
  the resumed process wrote the same run id, with steps 3 and 4.
- metrics.csv holds the same rows as metrics.jsonl.
- The config is each tracker's parameters; the report PNG and summary.json are artifacts.
- A tracker whose library is missing is refused before anything starts.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import struct
from pathlib import Path

import pytest

from scaletrain.config import flatten_config, load_config
from scaletrain.records.metrics import read_metrics
from scaletrain.records.trackers import IDS_FILE

from harness import cli_main, config_toml, forbid_starting

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

CONFIG = {
    "model": {"name": "mlp", "size": "tiny"},
    "data": {"source": "digits"},
    "train": {
        "steps": 4,
        "global_batch": 32,
        "micro_batch": 32,
        "eval_every": 2,
        "eval_examples": 64,
        "stop_after": 2,
    },
    "checkpoint": {"every": 2},
    "log": {"every": 1, "quiet": True, "trackers": ["mlflow", "wandb", "csv"]},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of a 4-step run stopped after step 2 and resumed."""
    import scaletrain
    import scaletrain.records.report

    tmp = tmp_path_factory.mktemp("tracked")
    run_dir = tmp / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
            mp.delenv(name, raising=False)
        mp.setenv("WANDB_MODE", "offline")  # whatever the machine has: never the network
        for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            mp.setenv(name, str(tmp / name.lower()))
        # The PNG is not the point here (matplotlib costs seconds): a stub file stands in.
        mp.setattr(
            scaletrain.records.report,
            "write_report",
            lambda runs, out: Path(out).write_bytes(b"png") and Path(out),
        )
        first = scaletrain.train(CONFIG, run_dir=run_dir)
        assert first.get("stopped"), first
        second = scaletrain.train(CONFIG, run_dir=run_dir, resume=True)
        assert second["steps"] == 4, second
    return run_dir


def _numbers(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as <kind>/<field> -> [(step, value)] in file order. A null (a NaN the
    trackers got as NaN, or no value: mfu without a hardware profile) is left out, as
    `_finite` leaves out the trackers' NaNs."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in read_metrics(run_dir):
        for key, value in record.items():
            if key in ("kind", "step") or isinstance(value, (bool, str)) or value is None:
                continue
            out.setdefault(f"{record['kind']}/{key}", []).append((record["step"], float(value)))
    return out


def _finite(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(step, value) for step, value in points if math.isfinite(value)]


def _params(run_dir: Path) -> dict[str, str]:
    config = load_config(run_dir / "config.toml")
    return {
        k: v if isinstance(v, str) else json.dumps(v)
        for k, v in flatten_config(config.model_dump(mode="json")).items()
    }


# --------------------------------------------------------------------------- MLflow


def _mlflow_run(run_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("scaletrain")
    runs = client.search_runs([experiment.experiment_id])
    return client, runs


def test_mlflow_holds_every_metric_at_its_steps(run: Path) -> None:
    client, runs = _mlflow_run(run)
    assert len(runs) == 1, "the resume started a second MLflow run"
    mlflow_run = runs[0]
    assert json.loads((run / IDS_FILE).read_text())["mlflow"] == mlflow_run.info.run_id
    assert mlflow_run.info.run_name == run.name and mlflow_run.info.status == "FINISHED"
    expected = _numbers(run)
    assert {"train/loss", "train/lr", "eval/loss", "eval/accuracy"} <= expected.keys()
    assert set(mlflow_run.data.metrics) == set(expected)
    for key, points in expected.items():
        history = client.get_metric_history(mlflow_run.info.run_id, key)
        assert sorted(_finite([(m.step, m.value) for m in history])) == sorted(points), key
    # Both processes logged into it: steps 1-2 before the stop, 3-4 after the resume.
    assert [s for s, _ in expected["train/loss"]] == [1, 2, 3, 4]


def test_mlflow_holds_the_config_and_the_files(run: Path) -> None:
    client, runs = _mlflow_run(run)
    assert runs[0].data.params == _params(run)
    files = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"report.png", "summary.json", "config.toml"} <= files


# --------------------------------------------------------------------------- W&B


def _wandb_records(path: Path) -> list:
    """The records of a .wandb file: W&B's header, then LevelDB's log format (32 KiB blocks,
    each record a 7-byte header: CRC, length, type: full, first, middle or last part),
    each whole record one wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, part, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last part of one
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def _wandb_runs(run_dir: Path) -> list[dict]:
    """Each offline run directory, oldest first: its run id, config, history, files."""
    runs = []
    for directory in sorted((run_dir / "wandb").glob("offline-run-*")):
        (path,) = directory.glob("run-*.wandb")
        found = {"dir": directory, "id": None, "config": {}, "history": [], "files": set()}
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                found["id"] = record.run.run_id
                found["config"].update({c.key: c.value_json for c in record.run.config.update})
            elif kind == "history":
                # A key with a "/" is stored split (nested_key)
                row = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                found["history"].append(row)
            elif kind == "files":
                found["files"] |= {f.path for f in record.files.files}
        runs.append(found)
    return runs


def test_wandb_offline_run_holds_every_metric_and_continues_after_resume(run: Path) -> None:
    before, after = _wandb_runs(run)
    run_id = json.loads((run / IDS_FILE).read_text())["wandb"]
    assert before["id"] == after["id"] == run_id, "the resume started another W&B run"
    got: dict[str, list[tuple[int, float]]] = {}
    for part in (before, after):
        for row in part["history"]:
            for key, value in row.items():
                if not key.startswith(("train/", "eval/")):
                    continue
                value = math.nan if value in ("NaN", None) else float(value)
                got.setdefault(key, []).append((row["step"], value))
    assert got.keys() == _numbers(run).keys()
    for key, points in _numbers(run).items():
        assert _finite(got[key]) == points, key
    assert {row["step"] for row in after["history"]} == {3, 4}


def test_wandb_holds_the_config_and_the_files(run: Path) -> None:
    before, after = _wandb_runs(run)
    config = {k: json.loads(v) for k, v in before["config"].items() if k != "_wandb"}
    assert {k: _param(v) for k, v in config.items()} == _params(run)
    assert {"report.png", "summary.json", "config.toml"} <= after["files"]
    assert (after["dir"] / "files" / "summary.json").read_bytes() == (
        run / "summary.json"
    ).read_bytes()


def _param(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# --------------------------------------------------------------------------- CSV


def test_csv_equals_metrics_jsonl(run: Path) -> None:
    with (run / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    records = read_metrics(run)
    assert len(rows) == len(records)
    for row, record in zip(rows, records, strict=True):
        cells = {k: v for k, v in row.items() if v != ""}
        want = {k: v for k, v in record.items() if v is not None}
        assert cells.keys() == want.keys(), (cells, want)
        for key, value in want.items():
            if isinstance(value, str):
                assert cells[key] == value
            elif isinstance(value, (dict, list)):
                assert json.loads(cells[key]) == value
            else:
                assert float(cells[key]) == value, key


def test_csv_widens_its_header_and_continues_after_a_partial_row(tmp_path: Path) -> None:
    from scaletrain.records.trackers import CsvTracker

    path = tmp_path / "metrics.csv"
    tracker = CsvTracker(path)
    tracker.log("train", {"step": 1, "loss": 1.0})
    tracker.log("eval", {"step": 1, "accuracy": 0.5, "loss": float("nan")})
    tracker.close(completed=False)
    with path.open("a") as f:
        f.write("train,2,0.")  # killed mid-write
    tracker = CsvTracker(path)
    tracker.log("train", {"step": 2, "loss": 0.5})
    tracker.close(completed=True)
    assert path.read_text().splitlines() == [
        "kind,step,loss,accuracy",
        "train,1,1.0,",
        "eval,1,,0.5",
        "train,2,0.5,",
    ]


# --------------------------------------------------------------------------- refusals


def test_a_missing_tracker_library_is_refused_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    forbid_starting(monkeypatch, tmp_path)
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else found(name, *a)
    )
    cfg = tmp_path / "config.toml"
    cfg.write_text(config_toml(train={"steps": 2}))
    code = cli_main(["train", str(cfg), 'log.trackers=["csv", "mlflow"]'])
    err = capsys.readouterr().err
    assert code == 2, err
    assert (
        "log.trackers includes 'mlflow' but the mlflow library is not installed: "
        "pip install 'scaletrain[mlflow]'" in err
    ), err
    assert "Traceback" not in err
    assert not list(tmp_path.glob("runs/*")), "a run directory was made for a refused run"


def test_wandb_mode_is_online_only_with_an_api_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scaletrain.records.trackers import _wandb_default_mode

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.delenv("NETRC", raising=False)
    assert _wandb_default_mode() == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k3y\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert _wandb_default_mode() == "online"
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k3y")
    assert _wandb_default_mode() == "online"
