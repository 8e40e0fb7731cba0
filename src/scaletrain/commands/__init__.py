"""The commands a user runs: one module per `scaletrain` subcommand, the Python API (api),
the checks that need the model built before launch (prelaunch) and a rank's entry (worker)."""
