"""The one base class of the user's mistakes, in a leaf module every room may import.

A `UserError` is something the user can fix by changing the config, a flag, a path or
their own code; the CLI prints its message as one paragraph (`scaletrain: error: ...`) and
exits with status 2, and a worker does the same in its log. Everything else, a ValueError
from scaletrain's own code included, is a bug of ours and shows its traceback with a
non-2 exit status.

Each room keeps its own error type (ConfigError, LaunchError, UserCodeError, LayoutError,
ShardError, ...) deriving from this one; the CLI and the worker's error path catch only
`UserError`, and a function that turns a lower room's mistake into a config key's message
catches `UserError` too, never a bare ValueError (that would dress our bugs up as the
user's). It stays a ValueError so callers of the Python API who catch ValueError keep
working.
"""

from __future__ import annotations

EXIT_USAGE = 2  # a user's mistake: the message is shown as is, no traceback
EXIT_FAILED = 1  # a run that failed, or a bug of ours (its traceback is shown or logged)


class UserError(ValueError):
    """A mistake of the user's: its message names the key or flag, the value and what is
    allowed, and is shown as is, without a traceback (exit status 2)."""


class ConfigError(UserError):
    """A wrong value, key or combination in the config or on the command line; its message
    is shown as is. It lives in this leaf, not in config.py, so that each room's own checks
    (the parallel layout, the pipeline's schedule, distillation's keys) raise it without
    importing the schema above them; `scaletrain.config.ConfigError` re-exports it."""
