"""The `scaletrain` command (and `python -m scaletrain`): the CLI behind a guard for Ctrl-C.

The CLI catches Ctrl-C once it runs (the launcher turns it into its one line), but the
first second or two go to importing it (torch, pydantic): a KeyboardInterrupt there, or
anywhere the CLI lets one through, ends with one line and status 130, not a traceback
through `import torch`. This module imports nothing heavy itself, so the guard is in place
before any of that starts.
"""

from __future__ import annotations

import sys

EXIT_SIGINT = 130  # 128 + SIGINT, as a shell reports it


def main() -> int:
    try:
        from scaletrain.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        print("scaletrain: interrupted (SIGINT)", file=sys.stderr)
        return EXIT_SIGINT
