"""The user-mistake errors every room may raise, in a leaf that imports nothing of ours.

`ConfigError` is a wrong value, key or combination in the config or on the command line:
the CLI prints its message as one paragraph and exits with status 2, no traceback. It lives
here, not in config.py, so that a technique's own checks (the parallel layout, the
pipeline's schedule, distillation's keys) can raise it without importing the schema above
them; `scaletrain.config.ConfigError` is the same class, re-exported.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake in the config or command line; its message is shown as is."""
