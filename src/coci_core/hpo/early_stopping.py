"""Early stopping on a patience rule, as a termination hazard for the planner.

The model: at each validation the monitored metric improves (by more than ``min_delta``)
with probability ``p``, independently; a run stops at the first validation where its count of
validations without improvement reaches ``patience``. From the current count ``wait`` this is
a small Markov chain over ``wait = 0 .. patience - 1``; its absorption probabilities at each
coming validation are the stopping probabilities handed to the planner. ``p`` is estimated from
the run's recent validations (see :func:`improvement_probability`).

``EarlyStopping`` also stops a run whose metric passes ``stopping_threshold`` (good enough) or
``divergence_threshold`` (diverged): :func:`threshold_stops` gives the probability of that at
each coming validation from the trend of the recent values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from coci_core.errors import ConfigError
from coci_core.planner.checks import check_int
from coci_core.planner.model import StopDistribution

__all__ = ["improvement_probability", "patience_stops", "threshold_stops"]


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


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def threshold_stops(
    values: Sequence[float],
    *,
    mode: str,
    validation_steps: Sequence[int],
    stopping_threshold: float | None = None,
    divergence_threshold: float | None = None,
    window: int = 8,
    source: str = "",
) -> StopDistribution:
    """The probabilities that the monitored value passes a threshold at the coming validations.

    The model: the last ``window`` values lie on a straight line in the validation count, with
    normal scatter about it; the value at the k-th coming validation is normal about the line's
    extension, its spread the scatter's plus the fit's own uncertainty (which grows with k). A
    trend passes a threshold once, so the run has stopped by validation k with probability
    ``max over j <= k`` of P(the value at j is past a threshold). Fewer than three finite values
    give no stop.

    Args:
        values: the monitored values at the validations so far, oldest first.
        mode: ``"min"`` (lower is better) or ``"max"``, as ``EarlyStopping(mode=...)``.
        validation_steps: the training steps of the coming validations, increasing.
        stopping_threshold: stop once the value is better than this (as ``EarlyStopping``).
        divergence_threshold: stop once the value is worse than this.
        window: how many of the latest values the trend is fitted to (>= 3).
        source: what the distribution describes (for ``explain()``).
    """
    if mode not in ("min", "max"):
        raise ConfigError(f"'mode' must be 'min' or 'max': {mode!r}")
    check_int("window", window, minimum=3)
    steps = [int(k) for k in validation_steps]
    ys = np.array([float(v) for v in values], dtype=np.float64)
    ys = ys[np.isfinite(ys)][-window:]
    if ys.size < 3 or (stopping_threshold is None and divergence_threshold is None) or not steps:
        return StopDistribution(steps=(), probabilities=(), source=source)
    sign = 1.0 if mode == "min" else -1.0  # in "min" terms: lower is better
    ys = sign * ys
    good = None if stopping_threshold is None else sign * float(stopping_threshold)
    bad = None if divergence_threshold is None else sign * float(divergence_threshold)
    n = ys.size
    xs = np.arange(n, dtype=np.float64)
    slope, intercept = np.polyfit(xs, ys, 1)
    residual = ys - (slope * xs + intercept)
    scale = max(1.0, float(np.abs(ys).max()))
    sigma = max(float(np.sqrt((residual**2).sum() / (n - 2))), 1e-9 * scale)
    x_mean, sxx = float(xs.mean()), float(((xs - xs.mean()) ** 2).sum())
    passed: list[float] = []
    for k in range(1, len(steps) + 1):
        x = n - 1 + k
        mean = slope * x + intercept
        spread = sigma * math.sqrt(1.0 + 1.0 / n + (x - x_mean) ** 2 / sxx)
        below = 0.0 if good is None else _normal_cdf((good - mean) / spread)
        above = 0.0 if bad is None else 1.0 - _normal_cdf((bad - mean) / spread)
        passed.append(min(1.0, below + above))
    stopped_by = np.maximum.accumulate(np.array(passed))
    return StopDistribution.from_survival(steps, 1.0 - stopped_by, source=source)
