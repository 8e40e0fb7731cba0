"""The Python API: `scaletrain.train(config, model=..., data=..., loss=...)`.

For notebooks, scripts and `torchrun my_script.py`. It takes the path the command line
takes (`prepare_run` is shared with `scaletrain train`): the config is validated and
resolved, the data are checked, the user's code is built once before any worker starts,
the run directory is checked, and the run directory written is the CLI's.

Three ways it runs:
- Under torchrun (or any elastic agent) every rank calls it: it joins the world as that
  rank and trains in this process; callables need not be importable. Every rank gets the
  summary. The process group it created is destroyed before it returns.
- Called plainly with one process: it trains right here.
- Called plainly with more (the [parallel] degrees' product > 1, or `nproc`): it launches the workers
  through torchrun's elastic agent, as the CLI does. Each worker imports the model, data
  and loss by name, so a callable must be a module-level function of an importable module
  (not a lambda, a local function or something defined in `__main__`); it is refused
  before anything starts, with where to move it. The directory its module was imported
  from is added to the workers' PYTHONPATH.

Mistakes raise exceptions (ConfigError, UserCodeError, LaunchError, ...: each a
`scaletrain.errors.UserError`, a ValueError, whose message is the CLI's one paragraph); any
other exception is a bug of ours; a failed multi-process run raises `TrainingFailed` naming
the logs. `resume=True` on a run that has already finished trains nothing and returns its
summary with "complete": True.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletrain.config import (
    Config,
    ConfigError,
    config_to_toml,
    given_world,
    load_config,
    validate_config,
)
from scaletrain.launch.agent import LaunchSpec, under_elastic_agent, validate_spec
from scaletrain.launch.resolve import Derived, resolve

if TYPE_CHECKING:
    from scaletrain.training.auto_precision import AutoChoice


class TrainingFailed(RuntimeError):
    """A launched run ended with a failure; the message names the rank logs."""


@dataclass(frozen=True)
class Prepared:
    """What `prepare_run` checked and derived, for the launch."""

    derived: Derived
    run_dir: Path
    warnings: tuple[str, ...]  # resume warnings (keys changed under --allow-config-change)
    complete: dict | None = None  # --resume of a run that has finished: its summary
    config: Config | None = None  # what the workers run: precision.mode "auto" resolved
    auto: AutoChoice | None = None  # how "auto" was resolved (None: not asked for)


def prepare_run(
    config: Config,
    *,
    spec: LaunchSpec,
    run_dir: Path | None,
    resume: bool,
    allow_config_change: bool = False,
    code: Any = None,
    plan_check: bool = True,
) -> Prepared:
    """Every check that needs no worker, in the order the CLI and the API both run them.

    Args:
        config: the validated config.
        spec: the launcher flags (validated).
        run_dir: the run directory asked for, or None for runs/<name>-<time>.
        resume: continue the run in run_dir from its newest valid checkpoint.
        allow_config_change: with resume, accept keys that change the run (warned).
        code: the API's callables (`UserCode`), or None.
        plan_check: refuse a layout the planner predicts not to fit (planner.check_fits).

    Raises:
        ConfigError, UserCodeError: a mistake, before anything starts.
    """
    from scaletrain.commands.prelaunch import check_layout_fits
    from scaletrain.launch.rundir import (
        check_resumable,
        check_run_dir,
        default_run_dir,
        finished_run,
        resumed_precision,
    )
    from scaletrain.records.trackers import check_installed, tracker_names
    from scaletrain.training.assemble import NO_CODE, brings_own_code, check_user_code
    from scaletrain.training.auto_precision import resolve_auto
    from scaletrain.training.optim import check_optimizer

    if allow_config_change and not resume:
        raise ConfigError(
            "--allow-config-change only applies with --resume (it lets a resumed "
            "run continue with a changed config); add --resume or drop it"
        )
    derived = resolve(config, world_size=spec.world_size, nproc_per_node=spec.nproc)
    # log.trackers: a missing library would fail rank 0 only after the workers started
    check_installed(tracker_names(config.log.trackers, tensorboard=config.log.tensorboard))
    if resume and (done := finished_run(run_dir, config)) is not None:
        return Prepared(derived=derived, run_dir=Path(run_dir), warnings=(), complete=done)
    if derived.ps is not None:
        from scaletrain.ps.connect import interface_address

        interface_address(config.ps.interface)  # refused here if this machine lacks it
    if derived.ps is not None and spec.max_nodes > 1 and config.ps.interface == "lo":
        raise ConfigError(
            f"ps.interface = 'lo' (loopback) cannot reach servers on other "
            f"machines (--nnodes {spec.nnodes}): set ps.interface to the network "
            "interface the nodes reach each other on (e.g. ps.interface=eth0)"
        )
    preflight_data(config)
    check_optimizer(config.optim)  # its class imports; optim.kwargs and optim.impl fit it
    code = code or NO_CODE
    if brings_own_code(config, code) and not spec.in_process:
        # Workers would each fail the same way: build it once here, before they start.
        check_user_code(config, code)
    check_layout_fits(config, derived, code)  # tp, pp, activation checkpointing vs the model
    if plan_check and derived.ps is None:  # a model that can outgrow a rank: will it fit?
        from scaletrain.planner import check_fits

        check_fits(config, world_size=spec.world_size, ranks_per_node=spec.nproc, code=code)
    # precision.mode = "auto": measured here, once, for every worker (training/auto_precision.py)
    config, auto = resolve_auto(
        config, derived, code=code, resumed_mode=resumed_precision(run_dir) if resume else None
    )
    warnings: tuple[str, ...] = ()
    if resume:  # before any process starts, and before config.toml is rewritten
        warnings = tuple(check_resumable(run_dir, config, allow_config_change=allow_config_change))
    else:
        run_dir = run_dir or default_run_dir(config.name)
        check_run_dir(run_dir)
    return Prepared(
        derived=derived, run_dir=Path(run_dir), warnings=warnings, config=config, auto=auto
    )


def preflight_data(config: Config) -> None:
    """Data checks that need no process (data.path, the model against the data's task):
    refused as a ConfigError before anything starts; a usable oddity is one note line."""
    from scaletrain.data.preflight import DataCheckError, check_data

    d = config.data
    try:
        note = check_data(
            source=d.source, path=d.path, seq_len=d.seq_len, model_name=config.model.name
        )
    except DataCheckError as e:  # a user mistake like a bad config value: same exit
        raise ConfigError(str(e)) from e
    if note:
        print(f"scaletrain: note: {note}", file=sys.stderr)


def train(
    config: str | Path | dict | Config,
    *,
    model: Callable | str | None = None,
    data: Callable | str | None = None,
    loss: Callable | str | None = None,
    overrides: Sequence[str] = (),
    run_dir: str | Path | None = None,
    nproc: int | None = None,
    resume: bool = False,
    debug: bool = False,
) -> dict:
    """Train from a config; return the summary (final loss, eval metrics, run directory).

    Args:
        config: a TOML path, a dict of sections ({"train": {"steps": 100}, ...}) or a Config.
        model: a factory `model(task, **model.kwargs) -> nn.Module`, or an import path.
        data: a function `data(split, **data.kwargs) -> (dataset, task)`, or an import path.
        loss: a function `loss(output, batch) -> (summed loss, count)`, or an import path.
        overrides: `section.key=value` strings applied over the config.
        run_dir: the run directory (default runs/<name>-<time>).
        nproc: processes on this machine (default: the product of the [parallel] degrees).
        resume: continue the run in run_dir from its newest valid checkpoint.
        debug: show every rank's output on the console (multi-process runs).

    Returns:
        summary.json's content plus "run_dir".

    Raises:
        ConfigError, UserCodeError, LaunchError: a mistake, before training starts.
        TrainingFailed: a launched run failed (the message names the logs).
    """
    from scaletrain.training.assemble import UserCode

    parsed = _to_config(config, overrides)
    code = UserCode(
        **{k: v for k, v in (("model", model), ("data", data), ("loss", loss)) if callable(v)}
    )
    parsed = _with_names(parsed, model=model, data=data, loss=loss)
    if under_elastic_agent():
        if parsed.parallel.strategy == "ps":  # its ranks are supervised role processes
            raise ConfigError(
                "parallel.strategy = 'ps' from inside torchrun is not supported by "
                "the Python API: call scaletrain.train() plainly (it launches the "
                "servers and workers) or run `torchrun -m scaletrain train ...`"
            )
        return _train_as_rank(parsed, run_dir=Path(run_dir) if run_dir else None, code=code)
    spec = validate_spec(LaunchSpec(nproc=nproc or given_world(parsed)))
    prepared = prepare_run(
        parsed, spec=spec, run_dir=Path(run_dir) if run_dir else None, resume=resume, code=code
    )
    for warning in (*prepared.warnings,):
        print(f"scaletrain: warning: {warning}", file=sys.stderr)
    if prepared.complete is not None:  # --resume of a finished run: say so, touch nothing
        from scaletrain.launch.rundir import describe_finished

        print(describe_finished(prepared.run_dir, prepared.complete), file=sys.stderr)
        return {**prepared.complete, "run_dir": str(prepared.run_dir), "complete": True}
    if prepared.auto is not None:
        from scaletrain.training.auto_precision import describe_auto

        print(f"scaletrain: {describe_auto(prepared.auto)}", file=sys.stderr)
    if spec.in_process:
        summary = _train_here(prepared.config, prepared.run_dir, code=code)
    else:
        summary = _launch(prepared.config, spec, prepared, code=code, debug=debug)
    return {**summary, "run_dir": str(prepared.run_dir)}


def _to_config(config: str | Path | dict | Config, overrides: Sequence[str]) -> Config:
    if isinstance(config, (str, Path)):
        return load_config(Path(config), list(overrides))
    if isinstance(config, Config):
        data = config.model_dump(mode="json")
    elif isinstance(config, dict):
        data = copy.deepcopy(config)
    else:
        raise ConfigError(
            f"config is a {type(config).__name__}; give a TOML path, a dict of "
            "sections or a scaletrain Config"
        )
    from scaletrain.config import apply_overrides

    return validate_config(apply_overrides(data, list(overrides)))


def _with_names(config: Config, **given: Callable | str | None) -> Config:
    """Record each callable in the config by its import path (what config.toml stores and the
    workers import), and each string as the key's value."""
    from scaletrain.user_code import UserCodeError, import_path_of

    keys = {"model": ("model", "name"), "data": ("data", "source"), "loss": ("train", "loss")}
    data = config.model_dump(mode="json")
    for what, value in given.items():
        if value is None:
            continue
        section, key = keys[what]
        if callable(value):
            try:
                value = import_path_of(value, key=f"{section}.{key}")
            except UserCodeError:  # not importable: fine in this process, refused for workers
                value = _label(value)
        data[section][key] = value
    return validate_config(data)


def _label(fn: Callable) -> str:
    """A valid import-path-shaped name for a callable that has none (recorded, not imported)."""
    module = getattr(fn, "__module__", None) or "__main__"
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    clean = ".".join(part.strip("<>") or "fn" for part in name.split("."))
    return f"{module}:{clean}"


def _run_rank(config: Config, *, run_dir: Path | None, code) -> dict | None:
    """The trainer as this process's rank, with SIGTERM handled as the CLI's workers do."""
    from scaletrain.training import signals
    from scaletrain.training.trainer import train as train_rank

    with signals.installed(save_on_term=config.checkpoint.every > 0):
        summary = train_rank(config, run_dir=run_dir, code=code)
        signals.drain()
    return summary


def _train_as_rank(config: Config, *, run_dir: Path | None, code) -> dict:
    """Under torchrun: this process is one rank; every rank gets the summary."""
    import torch.distributed as dist

    from scaletrain.runtime import broadcast_object

    owned = not dist.is_initialized()  # a group the caller made is theirs to destroy
    try:
        summary = broadcast_object(_run_rank(config, run_dir=run_dir, code=code))
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
    if summary is None:  # a planned stop (train.stop_after): no summary yet
        return {"stopped": True, "run_dir": str(run_dir or "")}
    return {**summary, "run_dir": summary.get("run_dir", str(run_dir or ""))}


def _train_here(config: Config, run_dir: Path, *, code) -> dict:
    import signal

    from scaletrain.launch.agent import Interrupted
    from scaletrain.training import signals

    try:
        summary = _run_rank(config, run_dir=run_dir, code=code)
    except signals.Terminated:
        raise Interrupted(signal.SIGTERM) from None
    if summary is None:  # a planned stop (train.stop_after): no summary yet
        return {"stopped": True}
    return summary


def _launch(config: Config, spec: LaunchSpec, prepared: Prepared, *, code, debug: bool) -> dict:
    """Workers through the elastic agent; they read the config from a TOML file and import
    the user's code by the paths recorded in it."""
    from scaletrain.launch.agent import launch
    from scaletrain.user_code import import_path_of, pythonpath_for

    roots = []
    for key, fn in (
        ("model.name", code.model),
        ("data.source", code.data),
        ("train.loss", code.loss),
    ):
        if fn is not None:
            import_path_of(fn, key=key)  # raises, naming where to move it
            if (root := pythonpath_for(fn)) and root not in roots:
                roots.append(root)
    old_path = os.environ.get("PYTHONPATH")
    if roots:
        os.environ["PYTHONPATH"] = os.pathsep.join([*roots, *([old_path] if old_path else [])])
    with tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="scaletrain-", delete=False) as f:
        f.write(config_to_toml(config))
    try:
        code_ = launch(
            spec,
            ["train", f.name, "--run-dir", str(prepared.run_dir)],
            threads=prepared.derived.threads,
            run_dir=prepared.run_dir,
            debug=debug,
            stall_s=config.parallel.timeout_s,
        )
    finally:
        os.unlink(f.name)
        if roots:
            if old_path is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old_path
    summary_file = prepared.run_dir / "summary.json"
    if code_ != 0:
        raise TrainingFailed(
            f"training failed (exit status {code_}); each rank's output is in "
            f"{prepared.run_dir / 'logs'}"
        )
    if not summary_file.is_file():
        return {"stopped": True}
    return json.loads(summary_file.read_text())
