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


class UserError(ValueError):
    """A mistake of the user's: its message names the key or flag, the value and what is
    allowed, and is shown as is, without a traceback (exit status 2)."""
