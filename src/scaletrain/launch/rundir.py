"""The run directory: where every run leaves its config, metrics, weights and summary.

    RUN_DIR/config.toml        the resolved config (what actually ran)
    RUN_DIR/metrics.jsonl      one JSON object per logged step or evaluation
    RUN_DIR/model.safetensors  final weights, plain parameter names
    RUN_DIR/summary.json       final loss, eval metric, wall time, throughput
    RUN_DIR/report.png         loss and throughput curves (`scaletrain report`)
    RUN_DIR/checkpoints/step-N sharded checkpoints (torch.distributed.checkpoint), see checkpoint/__init__.py
    RUN_DIR/checkpoints/step-N.corrupt-<time>  a damaged checkpoint, moved aside on resume

Resuming (`--resume`) is checked here, in the launcher, before any process starts: the run
directory must hold a checkpoint, and the new config may differ from the checkpoint's own
config.toml only in keys that leave the training trajectory alone (logging, evaluation,
checkpoint cadence, the launch layout at the same global batch). Any other change is
refused, naming each key with its old and new value, unless `--allow-config-change` says
so on purpose; then it is printed as a warning.
"""

from __future__ import annotations

import json
import math
import time
import tomllib
from pathlib import Path
from typing import Any

from scaletrain.config import Config, ConfigError, config_to_toml, flatten_config, validate_config


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_run_dir(run_dir: Path) -> None:
    """Refuse a directory that already holds a finished or running run: nothing is overwritten."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {str(run_dir)!r} exists and is not a directory")
    taken = [
        f for f in ("metrics.jsonl", "summary.json", "model.safetensors") if (run_dir / f).exists()
    ]
    if taken:
        raise ConfigError(
            f"--run-dir {str(run_dir)!r} already holds a run ({', '.join(taken)}); "
            "choose another --run-dir so nothing is overwritten"
        )


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float (NaN, inf) replaced by None, recursively: JSON has
    no NaN, and a summary.json with one in it is not valid JSON (null says "no value")."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """RUN_DIR/summary.json, valid JSON (a non-finite value is null)."""
    path = run_dir / "summary.json"
    path.write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False) + "\n")
    return path


def finished_run(run_dir: Path | None, config: Config) -> dict[str, Any] | None:
    """The summary of the run in `run_dir` if it has already trained `config.train.steps`
    steps (its summary.json says so), else None.

    A resume of such a run has nothing to do: it is said and nothing is touched (a resume
    with a larger train.steps, under --allow-config-change, continues it instead).
    """
    path = None if run_dir is None else Path(run_dir) / "summary.json"
    if path is None or not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())  # Python reads the NaN older versions wrote
    except (OSError, ValueError):
        return None  # half-written: the checkpoints decide
    if not isinstance(summary, dict) or int(summary.get("steps") or 0) < config.train.steps:
        return None
    return summary


def describe_finished(run_dir: Path, summary: dict[str, Any]) -> str:
    """The line that says a run is complete and that --resume changed nothing."""
    loss = summary.get("final_loss")
    evals = summary.get("eval") or {}
    metric = "".join(f", eval {k} {v:.4g}" for k, v in evals.items() if isinstance(v, float))
    return (
        f"scaletrain: run {run_dir} is complete (step {summary.get('steps')} of "
        f"{summary.get('steps')}, final loss "
        f"{'not finite' if loss is None else format(loss, '.4g')}{metric}): nothing to "
        "resume, nothing changed. To train it further, resume with a larger train.steps "
        "and --allow-config-change; for a new run, give a new --run-dir"
    )


def write_config(run_dir: Path, config: Config) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.toml"
    path.write_text(config_to_toml(config))
    return path


# Keys a resume may change and still continue the same trajectory: what is logged or
# evaluated, checkpoint cadence, how the step is laid out over processes and threads (the
# global batch, fixed separately, is what the gradient is of: rounding may differ, as it
# does between dp=1 and dp=2). Everything else (model.*, data.*, optim.*, precision.*,
# train.steps / global_batch / seed, the comm hook) changes what is trained. A key not
# listed here counts as changing it: a new config field has to be placed on purpose.
RESUME_SAFE_KEYS = frozenset(
    {
        "name",
        "train.micro_batch",
        "train.eval_every",
        "train.eval_examples",
        "train.max_bad_steps",
        "train.threads",
        "train.stop_after",
        "train.compile",
        "train.allocator",
        "parallel.dp",
        "parallel.backend",
        "parallel.bucket_cap_mb",
        "parallel.gradient_as_bucket_view",
        "parallel.timeout_s",
        # The model-parallel layout: DCP reshards parameters and optimizer state by name.
        "parallel.dp_replicate",
        "parallel.dp_shard",
        "parallel.tp",
        "parallel.pp",
        "parallel.pp_schedule",
        "parallel.pp_microbatches",
        "parallel.pp_stages_per_rank",
        "parallel.reshard_after_forward",
        "parallel.activation_checkpointing",
        "parallel.fsdp_offload",
        "parallel.sequence_parallel",
        # Parameter servers: the shards are saved by parameter name, so the server count may
        # change; the rest are how the run behaves from here on.
        "ps.servers",
        "ps.worker_timeout_s",
        "ps.interface",
    }
)
RESUME_SAFE_SECTIONS = ("checkpoint.", "log.")


def check_resumable(
    run_dir: Path | None, config: Config, *, allow_config_change: bool = False
) -> list[str]:
    """`--resume` needs a run directory with a valid checkpoint whose config this one continues.

    Args:
        run_dir: the run directory given with --run-dir.
        config: the config the resumed run will use.
        allow_config_change: let a change that breaks exact resume through (as a warning).

    Returns:
        Warnings to print (the changes `allow_config_change` let through).

    Raises:
        ConfigError: no run directory, no valid checkpoint, or a refused config change.
    """
    from scaletrain.checkpoint.files import latest_valid

    if run_dir is None:
        raise ConfigError("--resume needs --run-dir, the run to continue")
    if not run_dir.is_dir():
        raise ConfigError(
            f"--resume: run directory {str(run_dir)!r} does not exist"
            if not run_dir.exists()
            else f"--resume: {str(run_dir)!r} is not a directory"
        )
    damaged: list[str] = []
    # Sizes only: the workers hash every byte before they load; this is the same choice of
    # checkpoint unless a file was corrupted in place.
    checkpoint = latest_valid(
        run_dir / "checkpoints",
        hashes=False,
        report=lambda m: damaged.append(m.removeprefix("scaletrain: warning: ")),
    )
    if checkpoint is None:
        why = f" ({'; '.join(damaged)})" if damaged else ""
        raise ConfigError(
            f"--resume: {str(run_dir)!r} holds no valid checkpoint to resume "
            f"from{why} (set checkpoint.every or train.stop_after when starting "
            "a run)"
        )
    old = flatten_config(_checkpoint_config(checkpoint / "config.toml"))
    new = flatten_config(config.model_dump(mode="json"))
    changed = [
        key
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key) and _breaks_resume(key, new)
    ]
    if not changed:
        return []
    what = ", ".join(f"{key} ({_show(old, key)} -> {_show(new, key)})" for key in changed)
    if not allow_config_change:
        raise ConfigError(
            f"--resume: the config differs from checkpoint {checkpoint.name}'s in keys an "
            f"exact resume must keep: {what}. Resume with the checkpoint's values (its "
            f"config.toml), or add --allow-config-change to continue with the new ones"
        )
    return [
        f"--allow-config-change: resuming {checkpoint.name} with {what}; the run will "
        "not match an uninterrupted one"
    ]


def resumed_precision(run_dir: Path | None) -> str | None:
    """The precision mode the run in `run_dir` started with (its newest checkpoint's config;
    "auto" where that run resolved it in each worker), or None when it has no checkpoint."""
    from scaletrain.checkpoint.files import latest_valid

    if run_dir is None:
        return None
    checkpoint = latest_valid(Path(run_dir) / "checkpoints", hashes=False, report=lambda m: None)
    if checkpoint is None:
        return None
    return _checkpoint_config(checkpoint / "config.toml").get("precision", {}).get("mode")


def _checkpoint_config(path: Path) -> dict[str, Any]:
    """The checkpoint's config, with today's defaults for keys it predates."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--resume: cannot read {path}: {e}") from None
    try:
        return validate_config(data).model_dump(mode="json")
    except ConfigError:  # written by another version of the schema: compare what is there
        return data


def _breaks_resume(key: str, new: dict[str, Any]) -> bool:
    if key == "parallel.bucket_cap_mb":  # safe, unless the comm hook's state is per bucket
        from scaletrain.parallel.comm_hooks import BUCKET_KEYED_HOOKS

        return new.get("parallel.comm_hook") in BUCKET_KEYED_HOOKS
    return key not in RESUME_SAFE_KEYS and not key.startswith(RESUME_SAFE_SECTIONS)


def _show(values: dict[str, Any], key: str) -> str:
    return repr(values[key]) if key in values else "unset"
