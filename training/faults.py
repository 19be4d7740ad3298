"""Faults injected on purpose, to test failure handling: ``fail_nan_at_step`` and ``debug_step_sleep_s``.

The training loop calls :class:`FaultInjector` around each step; the step itself knows no debug setting.
Both settings are off unless a test's RUN.json sets them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from training.config import RunConfig
from training.runtime import DistEnv

# Called with the losses of one step (the trained model's first), between the forward and the NaN check.
LossHook = Callable[[list[Any]], None]


def nan_loss(losses: list[Any]) -> None:
    """Make the trained model's loss NaN (its per-head losses and the other parts' losses stay as they are)."""
    losses[0] = losses[0] * math.nan


class FaultInjector:
    """The debug faults of a run, for the training loop to call around each step.

    - ``fail_nan_at_step``: the trained model's loss becomes NaN at that step on the last rank only, so the
      NaN check, on losses all-reduced over the ranks, must stop every rank (exit code 76).
    - ``debug_step_sleep_s``: a sleep after every step, so a test can kill a rank in the middle of a run.
    """

    def __init__(self, config: RunConfig, env: DistEnv) -> None:
        self.nan_at_step = config.fail_nan_at_step
        self.sleep_s = config.debug_step_sleep_s
        self.last_rank = env.rank == env.world_size - 1

    def loss_hook(self, step: int) -> LossHook | None:
        """What to do to the losses of ``step`` before they are checked, if anything."""
        if self.nan_at_step is not None and step == self.nan_at_step and self.last_rank:
            return nan_loss
        return None

    def after_step(self) -> None:
        if self.sleep_s:
            time.sleep(self.sleep_s)
