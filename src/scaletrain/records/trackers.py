"""Experiment trackers on rank 0: TensorBoard, MLflow, Weights & Biases and a CSV file.

Each tracker is a small class with the same three methods, fed by `MetricsLogger`
(records/metrics.py) with every record it writes to ``metrics.jsonl``:

* ``log(kind, record)``: one train or eval record (``record["step"]`` is its step);
* ``log_artifact(path)``: a file of the run (the report PNG, ``summary.json``);
* ``close(completed=...)``: the run's end; ``completed`` is False for a stop, a preemption
  or a failure, which MLflow records as KILLED and W&B as a non-zero exit code.

What each receives, and under which names:

* The resolved config as parameters, one per dotted key (``optim.lr``), given at start.
* Every number of every record, at the record's own step. MLflow, W&B and TensorBoard
  name a field ``<kind>/<field>``: an eval record's ``loss`` becomes ``eval/loss`` beside
  the train records' ``train/loss``, so the two never clash. W&B plots them against a
  ``step`` metric of its own (its internal ``_step`` only counts calls). The CSV keeps the
  field names as they are, with a ``kind`` column, one row per record.
* Values are passed as they are: NaN stays NaN (metrics.jsonl writes it as null, and so
  does the CSV, as an empty cell).

A run directory is one run for every tracker. Their run ids are kept in
``RUN_DIR/trackers.json``; a later process on the same directory (``--resume``, an elastic
restart) reopens the same MLflow run and W&B run, so the later steps continue them. Like
metrics.jsonl, they then hold the steps re-run after the last checkpoint twice.

Each tracker's library is imported only when that tracker is asked for: they are optional
extras and slow to import. `check_installed` refuses a missing one before any worker starts.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from scaletrain.errors import ConfigError
from scaletrain.runtime import written_atomically

IDS_FILE = "trackers.json"  # the run ids that a resumed process reopens
CSV_FILE = "metrics.csv"
# Each tracker: the module it needs and the extra that installs it.
LIBRARIES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
    "csv": (None, None),
}


class Tracker(Protocol):
    keeps_files: bool  # log_artifact keeps the file (MLflow, W&B), or does nothing
    label: str  # what and where, for the run's start-up line: "csv (RUN_DIR/metrics.csv)"

    def log(self, kind: str, record: dict[str, Any]) -> None: ...

    def log_artifact(self, path: Path) -> None: ...

    def close(self, *, completed: bool) -> None: ...


def tracker_names(trackers: Iterable[str], *, tensorboard: bool = False) -> list[str]:
    """log.trackers in order without repeats; log.tensorboard = true adds "tensorboard"."""
    names = list(dict.fromkeys(trackers))
    if tensorboard and "tensorboard" not in names:
        names.append("tensorboard")
    return names


def check_installed(names: Iterable[str]) -> None:
    """Refuse a tracker whose library is missing, naming the extra that installs it.

    Raises:
        ConfigError: the first such tracker.
    """
    for name in names:
        module, extra = LIBRARIES[name]
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"log.trackers includes {name!r} but the {module} library is not installed: "
                f"pip install 'scaletrain[{extra}]' (or remove {name!r} from log.trackers)"
            )


def open_trackers(
    names: Sequence[str], run_dir: Path, *, params: dict[str, Any], start_step: int
) -> list[Tracker]:
    """Start (or, with ids in RUN_DIR/trackers.json, reopen) each named tracker.

    Args:
        names: tracker names (`tracker_names`).
        run_dir: the run's directory; its name is the trackers' run name.
        params: the resolved config as dotted keys (`config.flatten_config`).
        start_step: the step this process starts at (TensorBoard hides later events).
    """
    check_installed(names)
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(_open(name, run_dir, params=params, start_step=start_step, ids=ids))
    except BaseException:  # the ones already started end as not completed
        for tracker in opened:
            tracker.close(completed=False)
        raise
    if ids:
        with written_atomically(ids_path) as tmp:
            tmp.write_text(json.dumps(ids, indent=2) + "\n")
    return opened


def _open(
    name: str, run_dir: Path, *, params: dict[str, Any], start_step: int, ids: dict[str, str]
) -> Tracker:
    """One tracker by name; MLflow's and W&B's run ids are read from and written to `ids`."""
    match name:
        case "tensorboard":
            return TensorBoardTracker(run_dir / "tensorboard", start_step=start_step)
        case "csv":
            return CsvTracker(run_dir / CSV_FILE)
        case "mlflow":
            tracker = MlflowTracker(run_dir, params=params, run_id=ids.get("mlflow"))
        case "wandb":
            tracker = WandbTracker(run_dir, params=params, run_id=ids.get("wandb"))
        case _:
            raise ValueError(f"unknown tracker {name!r}")  # config validation lists them
    ids[name] = tracker.run_id
    return tracker


def _numbers(kind: str, record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers as ``<kind>/<field>``; the step and anything not a number left out."""
    return {
        f"{kind}/{key}": float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class TensorBoardTracker:
    """Scalars in RUN_DIR/tensorboard. On resume, `purge_step` hides the events a crashed
    process wrote past its last checkpoint."""

    keeps_files = False

    def __init__(self, log_dir: Path, *, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step or None)
        self.label = f"tensorboard ({log_dir})"

    def log(self, kind: str, record: dict[str, Any]) -> None:
        for key, value in _numbers(kind, record).items():
            self._writer.add_scalar(key, value, global_step=int(record["step"]))

    def log_artifact(self, path: Path) -> None:
        """TensorBoard keeps scalars only."""

    def close(self, *, completed: bool) -> None:
        self._writer.close()


class CsvTracker:
    """RUN_DIR/metrics.csv: one row per record, a ``kind`` column, the fields as named in
    metrics.jsonl. A record that brings a field the header lacks rewrites the file with the
    wider header (the earlier rows get empty cells), as Lightning's CSVLogger does. A
    non-finite number is an empty cell, as it is null in metrics.jsonl; a dict is JSON."""

    keeps_files = False

    def __init__(self, path: Path) -> None:
        self.path = path
        self.label = f"csv ({path})"
        self._rows: list[dict[str, str]] = []
        self._header: list[str] = ["kind", "step"]
        if path.is_file() and path.stat().st_size:  # a resumed run continues the file
            text = path.read_text(encoding="utf-8")
            reader = csv.DictReader(text.splitlines())
            self._rows = list(reader)
            self._header = list(reader.fieldnames or self._header)
            if not text.endswith("\n"):  # killed mid-write: drop the partial row
                self._rows = self._rows[:-1]
                self._rewrite()
        self._file = path.open("a", encoding="utf-8", newline="")
        self._writer = None if not self._rows else self._dict_writer()

    def log(self, kind: str, record: dict[str, Any]) -> None:
        row = {"kind": kind, **{k: _cell(v) for k, v in record.items() if k != "kind"}}
        self._rows.append(row)
        new = [key for key in row if key not in self._header]
        if new or self._writer is None:
            self._header += new
            self._file.close()
            self._rewrite()
            self._file = self.path.open("a", encoding="utf-8", newline="")
            self._writer = self._dict_writer()
            return
        self._writer.writerow(row)
        self._file.flush()

    def log_artifact(self, path: Path) -> None:
        """A CSV file holds rows only."""

    def close(self, *, completed: bool) -> None:
        self._file.close()

    def _dict_writer(self) -> csv.DictWriter:
        return csv.DictWriter(self._file, fieldnames=self._header, restval="")

    def _rewrite(self) -> None:
        with written_atomically(self.path) as tmp, tmp.open("w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._header, restval="")
            writer.writeheader()
            writer.writerows(self._rows)


def _cell(value: Any) -> Any:
    """A CSV cell: a non-finite number or None empty, a dict or list as JSON (the parameter
    servers' per-worker rates), anything else as it is."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return json.dumps(value) if isinstance(value, (dict, list)) else value


class MlflowTracker:
    """An MLflow run, through MlflowClient (no global active run is touched).

    The store is MLFLOW_TRACKING_URI when set, else a file store in RUN_DIR/mlruns. MLflow
    3 refuses file stores unless MLFLOW_ALLOW_FILE_STORE=true: it is set for that default
    store only (a local directory beside the run, readable with `mlflow ui
    --backend-store-uri RUN_DIR/mlruns`). The experiment is MLFLOW_EXPERIMENT_NAME or
    "scaletrain"; the run is named after the run directory. MLflow's parameters cannot
    change once logged: a resumed run adds the keys it lacks, and config.toml is logged as
    an artifact at the end, so a changed config is kept there.
    """

    keeps_files = True

    def __init__(self, run_dir: Path, *, params: dict[str, Any], run_id: str | None) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        self.label = f"mlflow ({uri or run_dir / 'mlruns'})"
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param, RunStatus
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        self.run_id = run_id
        logged: dict[str, str] = {}
        if run_id is not None:
            try:  # the same run continues, unless this store does not hold it
                logged = self._client.get_run(run_id).data.params
                self._client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            except MlflowException as e:  # MLFLOW_TRACKING_URI now names another store
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                self.run_id = None
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "scaletrain")
            run = self._client.create_run(_experiment(self._client, name), run_name=run_dir.name)
            self.run_id = run.info.run_id
        params = [Param(k, _param(v)) for k, v in params.items() if k not in logged]
        self._client.log_batch(self.run_id, params=params)

    def log(self, kind: str, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(record["step"])
        metrics = [Metric(k, v, now, step) for k, v in _numbers(kind, record).items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def log_artifact(self, path: Path) -> None:
        self._client.log_artifact(self.run_id, str(path))

    def close(self, *, completed: bool) -> None:
        self._client.set_terminated(self.run_id, "FINISHED" if completed else "KILLED")


def _experiment(client: Any, name: str) -> str:
    """The id of experiment `name`, created if missing."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # another run created it meanwhile
        return client.get_experiment_by_name(name).experiment_id


def _param(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class WandbTracker:
    """A W&B run in RUN_DIR/wandb.

    The mode is WANDB_MODE when set; else online when an API key is configured
    (WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc), else offline: nothing leaves the
    machine until `wandb sync RUN_DIR/wandb/offline-run-*`. The project is WANDB_PROJECT or
    "scaletrain"; the run is named after the run directory. Silent, and it does not capture
    the console (the progress bar and the launcher's log files stay as they are). A run of
    its own in this process (`reinit="create_new"`): a notebook's own W&B run is left alone.
    Files are copied into the run's files directory and saved there (``run.save``).
    """

    keeps_files = True

    def __init__(self, run_dir: Path, *, params: dict[str, Any], run_id: str | None) -> None:
        import wandb

        mode = None if os.environ.get("WANDB_MODE") else _wandb_default_mode()
        self._run = wandb.init(
            dir=str(run_dir),
            project=os.environ.get("WANDB_PROJECT", "scaletrain"),
            name=run_dir.name,
            id=run_id,
            resume="allow" if run_id else None,
            mode=mode,
            config=params,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
        # Plotted against the records' own step: on resume, the re-run steps come again.
        self._run.define_metric("*", step_metric="step", step_sync=True)
        self.run_id = self._run.id
        where, mode = run_dir / "wandb", self._run.settings.mode
        if mode == "offline":
            self.label = f"wandb offline ({where}, for `wandb sync`)"
        else:
            self.label = "wandb disabled" if self._run.disabled else f"wandb ({self._run.url})"

    def log(self, kind: str, record: dict[str, Any]) -> None:
        self._run.log({"step": int(record["step"]), **_numbers(kind, record)})

    def log_artifact(self, path: Path) -> None:
        if self._run.disabled:  # WANDB_MODE=disabled: a run that keeps nothing
            return
        dest = Path(self._run.dir) / path.name
        shutil.copyfile(path, dest)
        self._run.save(str(dest), base_path=self._run.dir, policy="now")

    def close(self, *, completed: bool) -> None:
        self._run.finish(exit_code=0 if completed else 1)


def _wandb_default_mode() -> str:
    """online when an API key is configured, else offline."""
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        found = netrc.netrc().authenticators(host or "api.wandb.ai")
    except (OSError, netrc.NetrcParseError):
        found = None
    return "online" if found else "offline"
