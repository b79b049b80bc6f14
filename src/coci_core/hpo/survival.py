"""Survival of a run, estimated from how earlier runs ended (Kaplan-Meier)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from coci_core.errors import ConfigError
from coci_core.planner.checks import check_int
from coci_core.planner.model import (
    AshaRungs,
    FloatArray,
    NoTermination,
    StopDistribution,
    Termination,
    _discretise,
)

__all__ = ["StoppedRun", "combine_terminations", "kaplan_meier"]


@dataclass(frozen=True)
class StoppedRun:
    """How far an earlier run got: ``step`` (training steps), and whether it was stopped
    there on purpose (``stopped``: pruned, early-stopped) or is censored there (it completed,
    or is still running: it got at least that far); ``weight``: how much it counts in an
    estimate (1: like every other run)."""

    step: int
    stopped: bool
    weight: float = 1.0


def kaplan_meier(runs: Iterable[StoppedRun], *, source: str = "") -> StopDistribution:
    """The Kaplan-Meier estimate of when a new run is stopped, from earlier runs.

    ``S(k) = prod over stop steps t < k of (1 - d_t / n_t)``, with ``d_t`` the runs stopped at
    ``t`` and ``n_t`` the runs that reached ``t`` (stopped or censored at or after it). A
    completed run is censored at its last step: beyond it the estimate keeps its last value.
    Runs count by their ``weight`` (the weighted estimate; a weight of 0 leaves a run out).
    """
    items = []
    for r in runs:
        w = float(r.weight)
        if not np.isfinite(w) or w < 0:
            raise ConfigError(f"'weight' must be finite and >= 0: {r.weight!r}")
        if w > 0:
            items.append((check_int("step", r.step, minimum=1), bool(r.stopped), w))
    if not items:
        return StopDistribution(steps=(), probabilities=(), source=source)
    steps = np.array([s for s, _, _ in items], dtype=np.int64)
    stopped = np.array([e for _, e, _ in items], dtype=bool)
    weights = np.array([w for _, _, w in items], dtype=np.float64)
    times = np.unique(steps[stopped])
    surv, out = 1.0, []
    for t in times:
        at_risk = float(np.sum(weights[steps >= t]))
        deaths = float(np.sum(weights[(steps == t) & stopped]))
        surv *= 1.0 - deaths / at_risk
        out.append(surv)
    return StopDistribution.from_survival([int(t) for t in times], out, source=source)


def _jumps(model: Termination) -> tuple[int, ...] | None:
    """The steps after which a discrete model's survival drops (None: not discrete)."""
    if isinstance(model, StopDistribution):
        return model.steps
    if isinstance(model, AshaRungs):
        return model.rung_steps
    if isinstance(model, NoTermination):
        return ()
    return None


@dataclass(frozen=True, kw_only=True)
class _Product:
    """Independent stopping causes: the survival is the product of the models' survivals."""

    models: tuple[Termination, ...]
    atoms_count: int = 64

    def survival(self, steps: npt.ArrayLike) -> FloatArray:
        """The product of the models' survivals."""
        out: FloatArray = np.ones(np.shape(steps), dtype=np.float64)
        for m in self.models:
            out = out * m.survival(steps)
        return out

    def atoms(self, start_step: int, end_step: int) -> tuple[FloatArray, FloatArray]:
        """Discretised into ``atoms_count`` kill steps."""
        return _discretise(self, start_step, end_step, self.atoms_count)

    def to_dict(self) -> dict[str, object]:
        """Describe the model as JSON-compatible data."""
        return {"kind": "product", "models": [m.to_dict() for m in self.models]}


def combine_terminations(models: Sequence[Termination], *, source: str = "") -> Termination:
    """Several independent reasons to stop (a pruner and ``EarlyStopping``): survival is the
    product. Discrete models (stop distributions, ASHA rungs) combine exactly into a
    :class:`~coci_core.planner.StopDistribution`; others into a discretised product."""
    active = [m for m in models if not isinstance(m, NoTermination)]
    if not active:
        return NoTermination()
    if len(active) == 1:
        return active[0]
    jumps = [_jumps(m) for m in active]
    if any(j is None for j in jumps):
        return _Product(models=tuple(active))
    steps = sorted({k for j in jumps for k in (j or ())})
    after = np.array(steps, dtype=np.float64) + 1
    surv = np.ones(len(steps))
    for m in active:
        surv = surv * m.survival(after)
    sources = [getattr(m, "source", "") or str(m.to_dict().get("kind")) for m in active]
    return StopDistribution.from_survival(steps, surv, source=source or " and ".join(sources))
