"""Failure and early-termination models: when a job stops, by accident or on purpose."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from coci_core.errors import ConfigError
from coci_core.knobs import MAX_NODES
from coci_core.planner.checks import check_int, check_nonnegative, check_positive

__all__ = [
    "DEFAULT_MTBF_S",
    "AshaRungs",
    "FailureModel",
    "NoTermination",
    "StopDistribution",
    "SurvivalFunction",
    "Termination",
    "UniformKill",
    "alive_at",
    "describe_termination",
    "estimate_mtbf_s",
    "nodes_at",
]

FloatArray = npt.NDArray[np.float64]

_MIN_RATE, _MAX_RATE = 1e-100, 1e100  # failures per second

#: MTBF assumed for the whole job when the user gives none and the run has no restart history.
DEFAULT_MTBF_S = 24 * 3600.0


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """Poisson failures: ``rate = nodes(step) / mtbf_s``.

    Args:
        mtbf_s: mean time between failures of one node, in seconds.
        nodes: the number of nodes, or a callable giving it for a step (the world size may change
            over time, e.g. under a quality-driven scheduler).
    """

    mtbf_s: float
    nodes: int | Callable[[int], float] = 1

    def __post_init__(self) -> None:
        check_positive("mtbf_s", self.mtbf_s)
        if not callable(self.nodes):
            check_int("nodes", self.nodes, minimum=1, maximum=MAX_NODES)

    def rate_per_s(self, steps: npt.ArrayLike) -> FloatArray:
        """Return the failure rate (1/s) at each of ``steps``."""
        ks = np.asarray(steps, dtype=np.int64)
        if callable(self.nodes):
            counts = np.array([nodes_at(self.nodes, int(k)) for k in ks], dtype=np.float64)
        else:
            counts = np.full(ks.shape, float(self.nodes))
        # bounded: the extremes of MTBF and node count (1e308 s, 1e-300 nodes) plan the same
        # (never, every step) and their sums and reciprocals stay finite
        with np.errstate(over="ignore", under="ignore"):
            return np.clip(counts / self.mtbf_s, _MIN_RATE, _MAX_RATE)

    @property
    def is_constant(self) -> bool:
        """Whether the rate is the same at every step."""
        return not callable(self.nodes)


def nodes_at(nodes: Callable[[int], float], step: int) -> float:
    """``nodes(step)``, checked: a real number in (0, MAX_NODES].

    Raises:
        ConfigError: naming ``nodes``, the step and what it gave (or raised).
    """
    try:
        value = nodes(step)
    except Exception as e:
        raise ConfigError(f"'nodes' raised {type(e).__name__} at step {step}: {e}") from e
    try:
        if isinstance(value, (bool, str, bytes)):  # float("4") would read a string
            raise TypeError
        count = float(value)  # a number, or what converts (a 0-d tensor)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"'nodes' must return numbers: {value!r:.100} at step {step}") from None
    if not 0 < count <= MAX_NODES:  # also NaN
        raise ConfigError(
            f"'nodes' must return numbers in (0, {MAX_NODES:,}]: {value!r:.100} at step {step}"
        )
    return count


def estimate_mtbf_s(
    *, failures: int, elapsed_s: float, prior_mtbf_s: float = DEFAULT_MTBF_S
) -> float:
    """Estimate the job's MTBF from its own restart history.

    A Gamma prior worth one failure at ``prior_mtbf_s``: ``(elapsed + prior) / (failures + 1)``.
    With no history it returns the prior; each observed failure pulls it toward
    ``elapsed_s / failures``.
    """
    check_nonnegative("elapsed_s", elapsed_s)
    check_positive("prior_mtbf_s", prior_mtbf_s)
    n = check_int("failures", failures, minimum=0)
    return (elapsed_s + prior_mtbf_s) / (n + 1)


@runtime_checkable
class Termination(Protocol):
    """When a job is stopped on purpose (early stopping, a hyper-parameter search).

    Called as: 1) ``atoms(start, end)`` by the cost model and the simulator;
    2) ``survival(steps)`` by the optimizer. Both are pure.
    """

    def atoms(self, start_step: int, end_step: int) -> tuple[FloatArray, FloatArray]:
        """Return kill steps in ``(start, end]`` and their probabilities (``end`` = survives)."""
        ...

    def survival(self, steps: npt.ArrayLike) -> FloatArray:
        """Return P(the job is still running at each step), conditioned on running at start."""
        ...

    def to_dict(self) -> dict[str, object]:
        """Describe the model as JSON-compatible data."""
        ...


def _atoms_from_survival(
    survival: FloatArray, steps: FloatArray, end_step: int
) -> tuple[FloatArray, FloatArray]:
    probs = -np.diff(np.concatenate([[1.0], survival]))
    keep = probs > 1e-12
    kill_steps = np.concatenate([steps[keep], [float(end_step)]])
    kill_probs = np.concatenate([probs[keep], [float(survival[-1]) if len(survival) else 1.0]])
    return kill_steps, kill_probs


@dataclass(frozen=True, kw_only=True)
class NoTermination:
    """The job runs to its last step unless it fails."""

    def atoms(self, start_step: int, end_step: int) -> tuple[FloatArray, FloatArray]:
        """Return the single atom ``end_step`` with probability 1."""
        return np.array([float(end_step)]), np.array([1.0])

    def survival(self, steps: npt.ArrayLike) -> FloatArray:
        """Return ones."""
        return np.ones(np.shape(steps), dtype=np.float64)

    def to_dict(self) -> dict[str, object]:
        """Describe the model as JSON-compatible data."""
        return {"kind": "none"}


@dataclass(frozen=True, kw_only=True)
class AshaRungs:
    """Successive halving: at each rung step a job continues with probability 1/reduction_factor.

    Args:
        rung_steps: the steps at which the job is evaluated and may be stopped.
        reduction_factor: ASHA's eta (> 1); 1 - 1/eta of the jobs reaching a rung stop there.
    """

    rung_steps: tuple[int, ...]
    reduction_factor: float = 3.0

    def __post_init__(self) -> None:
        if self.reduction_factor <= 1 or not math.isfinite(self.reduction_factor):
            raise ConfigError(f"'reduction_factor' must be > 1: {self.reduction_factor!r}")
        if not self.rung_steps:
            raise ConfigError(f"'rung_steps' must not be empty: {self.rung_steps!r}")
        for r in self.rung_steps:
            check_int("rung_steps", r, minimum=1)
        if list(self.rung_steps) != sorted(set(self.rung_steps)):
            raise ConfigError(f"'rung_steps' must be strictly increasing: {self.rung_steps!r}")

    @classmethod
    def geometric(
        cls, *, min_steps: int, reduction_factor: float = 3.0, max_steps: int
    ) -> AshaRungs:
        """Rungs at ``min_steps * eta**i`` below ``max_steps``."""
        check_int("min_steps", min_steps, minimum=1)
        rungs: list[int] = []
        r = float(min_steps)
        while r < max_steps:
            rungs.append(round(r))
            r *= reduction_factor
        return cls(rung_steps=tuple(rungs), reduction_factor=reduction_factor)

    def survival(self, steps: npt.ArrayLike) -> FloatArray:
        """P(running at step k): (1/eta) ** (number of rungs strictly before k)."""
        ks = np.asarray(steps, dtype=np.float64)
        passed = np.searchsorted(np.asarray(self.rung_steps, dtype=np.float64), ks, side="left")
        return np.asarray(self.reduction_factor ** (-passed.astype(np.float64)))

    def atoms(self, start_step: int, end_step: int) -> tuple[FloatArray, FloatArray]:
        """Kill steps are the rungs in ``(start, end)``."""
        rungs = np.array([r for r in self.rung_steps if start_step < r < end_step], np.float64)
        surv_start = float(self.survival(np.array([start_step + 1]))[0])
        surv = self.survival(rungs + 1) / surv_start
        return _atoms_from_survival(surv, rungs, end_step)

    def to_dict(self) -> dict[str, object]:
        """Describe the model as JSON-compatible data."""
        return {
            "kind": "asha",
            "rung_steps": list(self.rung_steps),
            "reduction_factor": self.reduction_factor,
        }


@dataclass(frozen=True, kw_only=True)
class UniformKill:
    """With ``probability`` the job is killed at a uniformly random step in ``[start, end)``."""

    start_step: int
    end_step: int
    probability: float
    atoms_count: int = field(default=32)

    def __post_init__(self) -> None:
        check_int("start_step", self.start_step, minimum=0)
        check_int("end_step", self.end_step, minimum=self.start_step + 1)
        if not 0 <= self.probability <= 1:
            raise ConfigError(f"'probability' must be in [0, 1]: {self.probability!r}")
        check_int("atoms_count", self.atoms_count, minimum=1)

    def survival(self, steps: npt.ArrayLike) -> FloatArray:
        """P(not killed before step k)."""
        ks = np.asarray(steps, dtype=np.float64)
        frac = np.clip((ks - self.start_step) / (self.end_step - self.start_step), 0.0, 1.0)
        return np.asarray(1.0 - self.probability * frac)

    def atoms(self, start_step: int, end_step: int) -> tuple[FloatArray, FloatArray]:
        """Discretise the window into ``atoms_count`` equal-probability kill steps."""
        return _discretise(self, start_step, end_step, self.atoms_count)

    def to_dict(self) -> dict[str, object]:
        """Describe the model as JSON-compatible data."""
        return {
            "kind": "uniform",
            "start_step": self.start_step,
            "end_step": self.end_step,
            "probability": self.probability,
        }


@dataclass(frozen=True, kw_only=True)
class SurvivalFunction:
    """A user survival function ``S(step)`` (non-increasing, S(start) = 1)."""

    fn: Callable[[int], float]
    atoms_count: int = 32

    def survival(self, steps: npt.ArrayLike) -> FloatArray:
        """Evaluate the user function, clipped to [0, 1] and made non-increasing."""
        ks = np.atleast_1d(np.asarray(steps, dtype=np.float64))
        vals = np.array([float(self.fn(int(k))) for k in ks], dtype=np.float64)
        if not np.all(np.isfinite(vals)):
            raise ConfigError("'termination' survival function returned a non-finite value")
        vals = np.clip(vals, 0.0, 1.0)
        order = np.argsort(ks)
        vals[order] = np.minimum.accumulate(vals[order])
        return vals.reshape(np.shape(steps)) if np.ndim(steps) else vals[:1]

    def atoms(self, start_step: int, end_step: int) -> tuple[FloatArray, FloatArray]:
        """Discretise into at most ``atoms_count`` kill steps."""
        return _discretise(self, start_step, end_step, self.atoms_count)

    def to_dict(self) -> dict[str, object]:
        """Describe the model as JSON-compatible data (the function itself is not stored)."""
        return {"kind": "survival_function"}


@dataclass(frozen=True, kw_only=True)
class StopDistribution:
    """A job stops at one of ``steps`` with the given probabilities, else runs to its end.

    The stopping probabilities are unconditional (seen from the job's first step); the
    planner conditions them on the step it plans from. Made by the estimators of
    :mod:`coci_core.hpo` (a study's history, Lightning's ``EarlyStopping``).

    Args:
        steps: the steps a job may stop after (strictly increasing, >= 1).
        probabilities: P(the job stops right after each step), each >= 0, summing to <= 1.
        source: what the distribution was estimated from (shown by ``explain()``).
    """

    steps: tuple[int, ...]
    probabilities: tuple[float, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.steps) != len(self.probabilities):
            raise ConfigError(
                f"'steps' and 'probabilities' must have the same length: {len(self.steps)} "
                f"and {len(self.probabilities)}"
            )
        for k in self.steps:
            check_int("steps", k, minimum=1)
        if list(self.steps) != sorted(set(self.steps)):
            raise ConfigError(f"'steps' must be strictly increasing: {self.steps!r}")
        probs = np.asarray(self.probabilities, dtype=np.float64)
        if not np.all(np.isfinite(probs)) or np.any(probs < 0) or probs.sum() > 1 + 1e-9:
            raise ConfigError(
                f"'probabilities' must be finite, >= 0 and sum to <= 1: {self.probabilities!r}"
            )

    @classmethod
    def from_survival(
        cls, steps: Sequence[int], survival: npt.ArrayLike, *, source: str = ""
    ) -> StopDistribution:
        """From ``S(steps[i] + 1)``, P(still running after ``steps[i]``), non-increasing."""
        surv = np.clip(np.asarray(survival, dtype=np.float64), 0.0, 1.0)
        surv = np.minimum.accumulate(surv) if surv.size else surv
        probs = -np.diff(np.concatenate([[1.0], surv]))
        keep = probs > 1e-12
        return cls(
            steps=tuple(int(k) for k, ok in zip(steps, keep, strict=True) if ok),
            probabilities=tuple(float(p) for p in probs[keep]),
            source=source,
        )

    @property
    def stop_probability(self) -> float:
        """P(the job stops before its end)."""
        return float(sum(self.probabilities))

    def survival(self, steps: npt.ArrayLike) -> FloatArray:
        """P(running at step k): 1 minus the stopping probability of the steps before k."""
        ks = np.asarray(steps, dtype=np.float64)
        cum = np.concatenate([[0.0], np.cumsum(self.probabilities)])
        before = np.searchsorted(np.asarray(self.steps, dtype=np.float64), ks, side="left")
        return np.asarray(np.clip(1.0 - cum[before], 0.0, 1.0))

    def atoms(self, start_step: int, end_step: int) -> tuple[FloatArray, FloatArray]:
        """The stop steps in ``(start, end)``, conditioned on running after ``start``."""
        inside = np.array([k for k in self.steps if start_step < k < end_step], np.float64)
        base = float(self.survival(np.array([start_step + 1]))[0])
        if base <= 0:
            return np.array([float(end_step)]), np.array([1.0])
        return _atoms_from_survival(self.survival(inside + 1) / base, inside, end_step)

    def to_dict(self) -> dict[str, object]:
        """Describe the model as JSON-compatible data."""
        return {
            "kind": "stops",
            "steps": list(self.steps),
            "probabilities": list(self.probabilities),
            "source": self.source,
        }


def describe_termination(model: Termination) -> str:
    """One phrase on a termination model, for ``explain()`` and telemetry."""
    kind = model.to_dict().get("kind")
    if isinstance(model, StopDistribution):
        return f"{model.source or 'stop distribution'} (P(stop) {model.stop_probability:.0%})"
    if isinstance(model, AshaRungs):
        return f"ASHA rungs at steps {list(model.rung_steps)} (eta {model.reduction_factor:g})"
    return str(kind)


def _discretise(
    model: Termination, start_step: int, end_step: int, count: int
) -> tuple[FloatArray, FloatArray]:
    edges = np.unique(np.linspace(start_step, end_step, count + 1).round())
    surv = model.survival(edges)
    base = float(surv[0]) if surv[0] > 0 else 1.0
    surv = np.clip(surv / base, 0.0, 1.0)
    # the kill mass between two edges is placed at the middle of the interval
    mids = np.floor((edges[:-1] + edges[1:]) / 2.0)
    probs = surv[:-1] - surv[1:]
    keep = (probs > 1e-12) & (mids > start_step) & (mids < end_step)
    return (
        np.concatenate([mids[keep], [float(end_step)]]),
        np.concatenate([probs[keep], [float(surv[-1])]]),
    )


@dataclass(frozen=True, kw_only=True)
class _AliveAt:
    """A termination model conditioned on the job running at ``step``."""

    model: Termination
    step: int
    atoms_count: int = 32

    def survival(self, steps: npt.ArrayLike) -> FloatArray:
        """P(running at each step), given running at ``step``."""
        ks = np.maximum(np.asarray(steps, dtype=np.float64), float(self.step))
        base = float(self.model.survival(np.array([float(self.step)]))[0])
        if base <= 0:
            return np.ones(np.shape(steps), dtype=np.float64)
        return np.asarray(np.clip(self.model.survival(ks) / base, 0.0, 1.0))

    def atoms(self, start_step: int, end_step: int) -> tuple[FloatArray, FloatArray]:
        """Discretised into at most ``atoms_count`` kill steps."""
        return _discretise(self, start_step, end_step, self.atoms_count)

    def to_dict(self) -> dict[str, object]:
        """The model's description, with the step it is conditioned on."""
        return {**self.model.to_dict(), "alive_at": self.step}


def alive_at(model: Termination, step: int) -> Termination:
    """``model`` given that the job is running at ``step``: no stop before it can come any
    more (the planner plans from the newest checkpoint, which may be steps behind the job)."""
    if isinstance(model, NoTermination):
        return model
    if isinstance(model, AshaRungs):
        # each rung passes independently: the rungs still ahead, as they were
        ahead = tuple(r for r in model.rung_steps if r >= step)
        if not ahead:
            return NoTermination()
        return AshaRungs(rung_steps=ahead, reduction_factor=model.reduction_factor)
    if isinstance(model, StopDistribution):
        base = float(model.survival(np.array([float(step)]))[0])
        kept = [(k, p) for k, p in zip(model.steps, model.probabilities, strict=True) if k >= step]
        if base <= 0 or not kept:
            return NoTermination()
        return StopDistribution(
            steps=tuple(k for k, _ in kept),
            probabilities=tuple(min(1.0, p / base) for _, p in kept),
            source=model.source,
        )
    return _AliveAt(model=model, step=int(step))


def make_termination(spec: Termination | Sequence[int] | None) -> Termination:
    """Normalise the ``termination`` argument (None, a model, or ASHA rung steps)."""
    if spec is None:
        return NoTermination()
    if isinstance(spec, Termination):
        return spec
    if isinstance(spec, (list, tuple)):
        return AshaRungs(rung_steps=tuple(check_int("termination", s, minimum=0) for s in spec))
    raise ConfigError(
        f"'termination' must be None, a Termination model or a list of rung steps: {spec!r}"
    )
