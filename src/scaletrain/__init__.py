"""scaletrain: the techniques of large-scale training for PyTorch, composable from one config file.

The Python API (imported on first use, so `import scaletrain` stays cheap for the CLI):

    import scaletrain
    summary = scaletrain.train("configs/default.toml", model=my_factory, overrides=["train.steps=50"])

`TaskSpec` (what a dataset asks of a model), `Batch` (what a loss receives) and `ModelSpec` /
`PipelineSplit` (what a model declares to FSDP, tensor and pipeline parallelism) are the
types a user's factory, data function and loss meet.
"""

from scaletrain.version import __version__ as __version__  # re-exported

_LAZY = {
    "train": ("scaletrain.commands.api", "train"),
    "TrainingFailed": ("scaletrain.commands.api", "TrainingFailed"),
    "TaskSpec": ("scaletrain.data.sources", "TaskSpec"),
    "Batch": ("scaletrain.data.sources", "Batch"),
    "ModelSpec": ("scaletrain.models.protocol", "ModelSpec"),
    "PipelineSplit": ("scaletrain.models.protocol", "PipelineSplit"),
    "Config": ("scaletrain.config", "Config"),
    "ConfigError": ("scaletrain.errors", "ConfigError"),
    "UserCodeError": ("scaletrain.user_code", "UserCodeError"),
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'scaletrain' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # found once; later lookups do not come here
    return value
