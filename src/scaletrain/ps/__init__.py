"""Asynchronous training with parameter servers (parallel.strategy = "ps"): see run.py."""
