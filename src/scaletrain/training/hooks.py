"""Hooks the loop calls after each step: things that are not training, kept out of it.

`step_hooks` turns the config into the trainer's `after_step` hooks. The one there is now
is the benchmarks' straggler (bench/ps.py compares DDP with parameter servers under a slow
worker): with `ps.slow_worker = R` under parallel.strategy = 'collective', data-parallel
rank R sleeps (ps.slow_factor - 1) x its step's compute time after every step, so the
other ranks wait for it at the next collective, as they would for a slower machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from scaletrain.config import Config

StepHook = Callable[[int, float], None]  # (step, seconds its train_step took)


def step_hooks(config: Config, *, dp_rank: int) -> tuple[StepHook, ...]:
    """The hooks this rank runs after each step (none unless a knob asks for one)."""
    ps = config.ps
    if ps.slow_worker == dp_rank and ps.slow_factor > 1:
        return (straggler(ps.slow_factor),)
    return ()


def straggler(factor: float) -> StepHook:
    """Make this rank `factor` times slower: sleep (factor - 1) x each step's time."""

    def slow_down(step: int, seconds: float) -> None:
        time.sleep((factor - 1) * seconds)

    return slow_down
