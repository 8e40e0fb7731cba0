"""Data: offline sources held in memory (`sources`), and later samplers, shards and loaders."""
