"""Checkpoint policies: the optimal one (``coci``) and the baselines, behind one Protocol."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from coci_core.errors import ConfigError
from coci_core.knobs import MAX_GRID_POINTS
from coci_core.planner.checks import check_int, check_positive
from coci_core.planner.model import NoTermination
from coci_core.planner.optimize import (
    IntArray,
    Problem,
    daly_interval_s,
    young_interval_s,
)
from coci_core.planner.solvers import closed_form_schedule, dp_schedule, uniform_schedule

__all__ = [
    "POLICIES",
    "CheckFreq",
    "Coci",
    "CociPaper",
    "Daly",
    "Epoch",
    "EveryNSeconds",
    "EveryNSteps",
    "PlanContext",
    "SavePolicy",
    "Young",
    "make_policy",
]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, kw_only=True, eq=False)
class PlanContext:
    """What a policy may look at besides the cost problem.

    Attributes:
        loss_steps: steps of the observed (finite) losses, if any.
        loss_values: the observed losses.
        value_is_flat: whether the value density is flat (no trusted loss curve).
        max_interval_steps: an upper bound on any interval (from every_n_steps/seconds caps).
    """

    loss_steps: FloatArray | None = None
    loss_values: FloatArray | None = None
    value_is_flat: bool = True
    max_interval_steps: int | None = None


@runtime_checkable
class SavePolicy(Protocol):
    """Decides the checkpoint steps of a plan.

    Called as: 1) (rank 0, on each re-plan) ``plan(problem, context=...)``; the returned steps
    are shared with every rank. Must be pure and fast (< 0.5 s for 50k steps).
    """

    @property
    def name(self) -> str:
        """The policy's registry name."""
        ...

    def plan(self, problem: Problem, *, context: PlanContext) -> IntArray:
        """Return sorted checkpoint steps in ``(problem.start_step, problem.end_step)``."""
        ...


def _mean_rate(pb: Problem) -> float:
    return pb.mean_rate(pb.start_step, pb.end_step)


def _cap(interval_steps: float, context: PlanContext) -> float:
    if context.max_interval_steps is not None:
        return min(interval_steps, float(context.max_interval_steps))
    return interval_steps


class _ClassicInterval:
    """A uniform schedule at a closed-form interval of the stall and the MTBF (capped)."""

    _interval_s: Callable[[float, float], float]

    def plan(self, problem: Problem, *, context: PlanContext) -> IntArray:
        """Uniform schedule at the policy's interval."""
        t = type(self)._interval_s(problem.stall_s, 1.0 / _mean_rate(problem))
        return uniform_schedule(problem, _cap(t / problem.step_time_s, context))


@dataclass(frozen=True, kw_only=True)
class Young(_ClassicInterval):
    """Uniform interval ``sqrt(2 s M)`` (Young 1974)."""

    name: str = "young"
    _interval_s = staticmethod(young_interval_s)


@dataclass(frozen=True, kw_only=True)
class Daly(_ClassicInterval):
    """Uniform interval from Daly's higher-order formula (Daly 2006, eq. 37)."""

    name: str = "daly"
    _interval_s = staticmethod(daly_interval_s)


@dataclass(frozen=True, kw_only=True)
class CheckFreq:
    """CheckFreq (FAST'21): hide the persist behind compute, then grow until overhead <= bound.

    ``k = max(ceil((t_f - stall) / t_i), 1)`` with ``t_f = stall + persist``; while the stall
    overhead exceeds ``overhead_bound`` (paper 3.5%, code 5%), ``k += 2``. Failure-rate-blind.
    """

    overhead_bound: float = 0.05
    name: str = "checkfreq"

    def __post_init__(self) -> None:
        check_positive("overhead_bound", self.overhead_bound)

    def plan(self, problem: Problem, *, context: PlanContext) -> IntArray:
        """Uniform schedule at CheckFreq's interval."""
        tau, s, p = problem.step_time_s, problem.stall_s, problem.persist_s
        k = max(math.ceil(((s + p) - s) / tau - 1e-9), 1)
        while (s + max(0.0, p - k * tau)) / (k * tau) > self.overhead_bound:
            k += 2
        return uniform_schedule(problem, float(k))


@dataclass(frozen=True, kw_only=True)
class EveryNSteps:
    """A checkpoint every ``every_n_steps`` steps (aligned to multiples of it)."""

    every_n_steps: int
    name: str = "every_n_steps"

    def __post_init__(self) -> None:
        check_int("every_n_steps", self.every_n_steps, minimum=1)

    def plan(self, problem: Problem, *, context: PlanContext) -> IntArray:
        """Multiples of ``every_n_steps`` inside the horizon."""
        n = self.every_n_steps
        first = (problem.start_step // n + 1) * n
        return np.arange(first, problem.end_step, n, dtype=np.int64)


@dataclass(frozen=True, kw_only=True)
class EveryNSeconds:
    """A checkpoint every ``every_n_seconds`` of compute (converted with the step time)."""

    every_n_seconds: float
    name: str = "every_n_seconds"

    def __post_init__(self) -> None:
        check_positive("every_n_seconds", self.every_n_seconds)

    def plan(self, problem: Problem, *, context: PlanContext) -> IntArray:
        """Uniform schedule of ``every_n_seconds / step_time_s`` steps."""
        return uniform_schedule(problem, self.every_n_seconds / problem.step_time_s)


@dataclass(frozen=True, kw_only=True)
class Epoch:
    """A checkpoint at each epoch boundary."""

    steps_per_epoch: int
    name: str = "epoch"

    def __post_init__(self) -> None:
        check_int("steps_per_epoch", self.steps_per_epoch, minimum=1)

    def plan(self, problem: Problem, *, context: PlanContext) -> IntArray:
        """Multiples of ``steps_per_epoch`` inside the horizon."""
        return EveryNSteps(every_n_steps=self.steps_per_epoch).plan(problem, context=context)


@dataclass(frozen=True, kw_only=True)
class CociPaper:
    """The published COCI rule, reproduced to show its flaws (do not use it to protect a job).

    As described in background.md §1.3: fit ``loss(t) = exp(theta1·t + theta2)`` against wall-clock
    time in ``time_unit_s`` units on the first ``min_iterations`` iterations (scipy
    ``curve_fit`` from its default start), then place checkpoints at equal drops of the fitted
    loss; the number of checkpoints is Young's count over the horizon (our reconstruction: the
    paper's own budget is not public). The rule depends on the time unit and, if the fit gives
    ``theta1 >= 0`` (noisy early loss), places no checkpoint at all.
    """

    time_unit_s: float = 60.0
    min_iterations: int = 50
    name: str = "coci_paper"

    def __post_init__(self) -> None:
        check_positive("time_unit_s", self.time_unit_s)
        check_int("min_iterations", self.min_iterations, minimum=2)

    def plan(self, problem: Problem, *, context: PlanContext) -> IntArray:
        """Equal drops of the fitted exponential (possibly no checkpoint)."""
        from scipy.optimize import curve_fit

        if context.loss_steps is None or context.loss_values is None:
            return np.zeros(0, dtype=np.int64)
        ks, ls = context.loss_steps, context.loss_values
        first = ks.min() if ks.size else 0
        mask = ks < first + self.min_iterations
        if mask.sum() < 3:
            return np.zeros(0, dtype=np.int64)
        t = ks[mask] * problem.step_time_s / self.time_unit_s

        def model(x: FloatArray, th1: float, th2: float) -> FloatArray:
            return np.asarray(np.exp(th1 * x + th2))

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                (th1, th2), _ = curve_fit(model, t, ls[mask], maxfev=2000)
        except (RuntimeError, ValueError, OverflowError):
            return np.zeros(0, dtype=np.int64)
        if not (math.isfinite(th1) and math.isfinite(th2)) or th1 >= 0:
            return np.zeros(0, dtype=np.int64)
        horizon_s = problem.horizon_steps * problem.step_time_s
        count = int(horizon_s / young_interval_s(problem.stall_s, 1.0 / _mean_rate(problem)))
        t0 = problem.start_step * problem.step_time_s / self.time_unit_s
        t1 = problem.end_step * problem.step_time_s / self.time_unit_s
        l0, l1 = math.exp(th1 * t0 + th2), math.exp(th1 * t1 + th2)
        levels = l0 - (l0 - l1) * np.arange(1, count + 1) / (count + 1)
        times = (np.log(levels) - th2) / th1
        steps = times * self.time_unit_s / problem.step_time_s
        steps = steps[np.isfinite(steps)]
        arr = np.unique(np.round(steps).astype(np.int64))
        return arr[(arr > problem.start_step) & (arr < problem.end_step)]


@dataclass(frozen=True, kw_only=True)
class Coci:
    """The optimal schedule for the problem's objective (convergence-aware by default).

    Falls back to Daly's uniform interval when it is optimal to first order: an objective that
    is wall-clock time times a constant once the value is flat (no trusted loss curve) or
    unused (``time``; see :meth:`~coci_core.planner.objectives.Objective.plans_as_time`), with
    no termination model and a constant failure rate. Otherwise a dynamic programme over at most
    ``grid_points`` candidates (``method="dp"``) or the closed form (``method="closed_form"``).
    """

    method: str = "dp"
    grid_points: int = 1500
    name: str = "coci"

    def __post_init__(self) -> None:
        if self.method not in ("dp", "closed_form"):
            raise ConfigError(f"'method' must be 'dp' or 'closed_form': {self.method!r}")
        check_int("grid_points", self.grid_points, minimum=2, maximum=MAX_GRID_POINTS)

    def plan(self, problem: Problem, *, context: PlanContext) -> IntArray:
        """Daly when that is optimal, else the DP or the closed form."""
        simple = isinstance(problem.termination, NoTermination) and problem.failure.is_constant
        if simple and problem.goal.plans_as_time(context.value_is_flat):
            return Daly().plan(problem, context=context)
        if self.method == "closed_form":
            return closed_form_schedule(problem, max_interval_steps=context.max_interval_steps)
        return dp_schedule(
            problem, grid_points=self.grid_points, max_interval_steps=context.max_interval_steps
        )


POLICIES: dict[str, Callable[..., SavePolicy]] = {
    "coci": Coci,
    "young": Young,
    "daly": Daly,
    "checkfreq": CheckFreq,
    "every_n_steps": EveryNSteps,
    "every_n_seconds": EveryNSeconds,
    "epoch": Epoch,
    "coci_paper": CociPaper,
}


def make_policy(name: str, **options: Any) -> SavePolicy:
    """Build the named policy; unknown names or options raise ConfigError."""
    if not isinstance(name, str) or name not in POLICIES:
        raise ConfigError(f"'policy' must be one of {', '.join(POLICIES)}: {name!r:.100}")
    try:
        return POLICIES[name](**options)
    except TypeError as e:
        raise ConfigError(f"bad options for policy {name!r}: {e}") from e
