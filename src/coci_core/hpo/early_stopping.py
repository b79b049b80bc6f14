"""Early stopping on a patience rule, as a termination hazard for the planner.

The model: at each validation the monitored metric improves (by more than ``min_delta``)
with probability ``p``, independently; a run stops at the first validation where its count of
validations without improvement reaches ``patience``. From the current count ``wait`` this is
a small Markov chain over ``wait = 0 .. patience - 1``; its absorption probabilities at each
coming validation are the stopping probabilities handed to the planner. ``p`` is estimated from
the run's recent validations (see :func:`improvement_probability`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coci_core.errors import ConfigError
from coci_core.planner._checks import check_int
from coci_core.planner.model import StopDistribution

__all__ = ["improvement_probability", "patience_stops"]


def improvement_probability(improved: Sequence[bool], *, window: int) -> float:
    """P(a validation improves the metric): the share of the last ``window`` validations
    that did, with a uniform Beta(1, 1) prior (``(improvements + 1) / (n + 2)``)."""
    check_int("window", window, minimum=1)
    recent = list(improved)[-window:]
    return (sum(bool(x) for x in recent) + 1.0) / (len(recent) + 2.0)


def patience_stops(
    *,
    patience: int,
    wait_count: int,
    improve_probability: float,
    validation_steps: Sequence[int],
    source: str = "",
) -> StopDistribution:
    """The stopping probabilities of a patience rule at the coming validations.

    Args:
        patience: validations without improvement that stop the run.
        wait_count: validations without improvement so far.
        improve_probability: P(a validation improves the metric).
        validation_steps: the training steps of the coming validations, increasing.
        source: what the distribution describes (for ``explain()``).
    """
    check_int("patience", patience, minimum=1)
    wait = min(check_int("wait_count", wait_count, minimum=0), patience - 1)
    p = float(improve_probability)
    if not 0 <= p <= 1:
        raise ConfigError(f"'improve_probability' must be in [0, 1]: {improve_probability!r}")
    state = np.zeros(patience)
    state[wait] = 1.0
    steps: list[int] = []
    probs: list[float] = []
    for k in validation_steps:
        stop = float(state[-1]) * (1 - p)  # the last wait state, not improving: stops
        moved = np.empty(patience)
        moved[0] = p * float(state.sum())
        moved[1:] = (1 - p) * state[:-1]
        state = moved
        if stop > 1e-12:
            steps.append(int(k))
            probs.append(stop)
        if state.sum() < 1e-9:
            break
    return StopDistribution(steps=tuple(steps), probabilities=tuple(probs), source=source)
