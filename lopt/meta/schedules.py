"""Learning-rate schedules of inner runs: one table, used by ``lopt meta-eval --schedule`` (lopt.meta.evaluate)
and by meta-training's ``inner_schedule`` (lopt.meta.estimators, lopt.meta.trainer).

A schedule is a multiplier of the optimizer's lr at step ``t`` (0 .. horizon - 1) of a run of ``horizon`` steps;
its docstring says what it is (meta-eval's report quotes it). This module imports nothing of lopt, so every
module of lopt.meta can import it.
"""

from __future__ import annotations

import math

import torch


def _constant(t, horizon):
    """1: the lr as given at every step."""
    return 1.0


def _cosine(t, horizon):
    """½(1 + cos(π t / horizon)), from 1 at t = 0 toward 0 at t = horizon (torch's CosineAnnealingLR(T_max=horizon,
    eta_min=0))."""
    return 0.5 * (1.0 + math.cos(math.pi * t / horizon))


# The lr schedules: name -> the multiplier of the lr at step t (0 .. horizon - 1) of a run of ``horizon`` steps,
# documented by its docstring (meta-eval's report header quotes it). In lopt meta-eval, "constant" is heldout-v1's
# frozen protocol and the others are variants, reported beside it and never instead.
SCHEDULES = {"constant": _constant, "cosine": _cosine}


def multipliers(name: str, positions, lengths, steps: int) -> torch.Tensor:
    """The (steps, N) float32 matrix ``SCHEDULES[name](positions[j] + t, lengths[j])`` for t = 0 .. steps - 1: the lr
    multipliers of N runs, run j at step ``positions[j]`` of its ``lengths[j]`` steps when the matrix's first row
    applies. Formed on the host (one Python call per entry)."""
    schedule = SCHEDULES[name]
    return torch.tensor([[schedule(p + t, n) for p, n in zip(positions, lengths)] for t in range(steps)],
                        dtype=torch.float32).reshape(steps, len(positions))
