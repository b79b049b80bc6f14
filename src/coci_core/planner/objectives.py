"""Planner objectives: what a plan minimises, one object per name, behind one registry.

An objective is a figure of a :class:`CostBreakdown` (:meth:`Objective.cost`): the solvers
minimise exactly that figure. It must be a weighted sum of the breakdown's fields with weights
>= 0 (every built-in one is); :attr:`Objective.weights` reads the weights off ``cost`` and the
solvers, the ``coci`` policy and re-planning use nothing else. Users name an objective with a
string (``objective="time"``); :func:`make_objective` turns the name into its object, and
:data:`OBJECTIVES` is the one list of names (the ``coci`` command and the TensorBoard tab read
the names and descriptions from it).

This module imports neither numpy nor the rest of the planner, so that the command line can
list the objectives at once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, ClassVar

from coci_core.errors import ConfigError

__all__ = [
    "FIELDS",
    "OBJECTIVES",
    "ConvergenceObjective",
    "CostBreakdown",
    "Objective",
    "ProgressObjective",
    "TimeObjective",
    "make_objective",
    "register_objective",
]


@dataclass(frozen=True, kw_only=True)
class CostBreakdown:
    """Expected overhead of one schedule, by kind; ``*_value_s`` are weighted by value density.

    ``wall_s`` is the wall-clock overhead; ``convergence_s`` weights lost compute by value;
    ``progress_s`` weights everything by value. ``convergence_excl_restart_s`` leaves out the
    restart time, which no schedule can change. ``failures`` is the expected number of failures.
    """

    stall_s: float
    lost_compute_s: float
    lost_stall_s: float
    restart_s: float
    failures: float
    stall_value_s: float
    lost_compute_value_s: float
    lost_stall_value_s: float
    restart_value_s: float

    @classmethod
    def from_vector(cls, vec: Iterable[Any]) -> CostBreakdown:
        """Build from the internal component vector (in the order of :data:`FIELDS`)."""
        return cls(**{name: float(x) for name, x in zip(FIELDS, vec, strict=True)})

    @property
    def wall_s(self) -> float:
        """Wall-clock overhead: stall + lost work + restart."""
        return self.stall_s + self.lost_compute_s + self.lost_stall_s + self.restart_s

    @property
    def convergence_s(self) -> float:
        """Lost compute weighted by value; stall and restart unweighted."""
        return self.stall_s + self.lost_compute_value_s + self.lost_stall_s + self.restart_s

    @property
    def convergence_excl_restart_s(self) -> float:
        """:attr:`convergence_s` without the restart time."""
        return self.convergence_s - self.restart_s

    @property
    def progress_s(self) -> float:
        """Everything weighted by value density."""
        return (
            self.stall_value_s
            + self.lost_compute_value_s
            + self.lost_stall_value_s
            + self.restart_value_s
        )

    def objective(self, name: str) -> float:
        """The figure the named objective minimises."""
        return make_objective(name).cost(self)


#: The fields of a :class:`CostBreakdown`, in the order of its internal vector.
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(CostBreakdown))

# a breakdown with no two fields alike, to check that cost() is a weighted sum
_PROBE = tuple(1.0 + 0.37 * i + 0.011 * i * i for i in range(len(FIELDS)))


class Objective(ABC):
    """What a plan minimises: :meth:`cost`, a weighted sum of a :class:`CostBreakdown`'s fields.

    A subclass sets ``name`` and ``description`` and writes ``cost``; it registers an instance
    with :func:`register_objective`. The solvers minimise ``cost`` through :attr:`weights`.

    Attributes:
        name: the registry name users pass as ``objective``.
        description: what it counts, in one line (the ``coci`` command's help, the
            TensorBoard tab).
        early_profile_save: ``coci`` takes a save early, before any is measured, to measure the
            stall and persist, then re-plans (not under ``progress``, where an early stall is
            weighted by the high early value and costs more than it teaches).
        unplanned_profile_save: ``coci`` takes that early save only when the plan made with
            the assumed cost has no save before the horizon's end (otherwise the first planned
            save measures the cost, and an extra one would cost more than it teaches).
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    early_profile_save: ClassVar[bool] = False
    unplanned_profile_save: ClassVar[bool] = False

    @abstractmethod
    def cost(self, breakdown: CostBreakdown) -> float:
        """The figure of ``breakdown`` this objective minimises: a sum of its fields, each
        times a constant weight >= 0."""

    @cached_property
    def weights(self) -> CostBreakdown:
        """The weight of each field in :meth:`cost` (read off ``cost`` once, and checked).

        Raises:
            ConfigError: ``cost`` is not a weighted sum of the fields with weights >= 0, not
                all 0.
        """
        zero = [0.0] * len(FIELDS)
        base = self._cost_of(zero)
        found = []
        for i in range(len(FIELDS)):
            unit = list(zero)
            unit[i] = 1.0
            found.append(self._cost_of(unit) - base)
        expected = sum(w * x for w, x in zip(found, _PROBE, strict=True))
        probe = self._cost_of(_PROBE)
        linear = base == 0.0 and math.isclose(probe, expected, rel_tol=1e-9, abs_tol=1e-12)
        if not linear or min(found) < 0 or not any(found):
            raise ConfigError(
                f"objective {self.name!r}: cost() must be a sum of CostBreakdown fields times "
                "constant weights >= 0 (not all 0), which is what the solvers minimise; "
                f"found weights {dict(zip(FIELDS, found, strict=True))} and cost(0) = {base}"
            )
        return CostBreakdown.from_vector(found)

    def _cost_of(self, vec: Iterable[float]) -> float:
        value = self.cost(CostBreakdown.from_vector(vec))
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ConfigError(f"objective {self.name!r}: cost() must return a finite number")
        return float(value)

    @property
    def lost_work_by_value(self) -> bool:
        """Whether lost compute is weighted by the value density."""
        return self.weights.lost_compute_value_s > 0

    @property
    def stall_by_value(self) -> bool:
        """Whether stalls, lost stalls or restarts are weighted by the value density."""
        w = self.weights
        return w.stall_value_s > 0 or w.lost_stall_value_s > 0 or w.restart_value_s > 0

    @property
    def uses_value(self) -> bool:
        """Whether the value density (hence a fitted loss curve) changes the plan."""
        return self.lost_work_by_value or self.stall_by_value

    def plans_as_time(self, value_is_flat: bool) -> bool:
        """Whether this objective is wall-clock time times a constant when the value density is
        flat (``value_is_flat``) or unused: then Daly's interval is its optimum to first order
        (with no termination model and a constant failure rate)."""
        if self.uses_value and not value_is_flat:
            return False
        w = self.weights
        stall = w.stall_s + w.stall_value_s
        lost = w.lost_compute_s + w.lost_compute_value_s
        lost_stall = w.lost_stall_s + w.lost_stall_value_s
        restart = w.restart_s + w.restart_value_s
        return w.failures == 0 and stall > 0 and stall == lost == lost_stall == restart

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TimeObjective(Objective):
    """Wall-clock overhead (``wall_s``): every step counts alike, as for Young and Daly."""

    name = "time"
    description = "wall-clock time lost to saves, failures and restarts"
    unplanned_profile_save = True

    def cost(self, breakdown: CostBreakdown) -> float:
        return breakdown.wall_s


class ConvergenceObjective(Objective):
    """Lost compute weighted by its value toward convergence, stall and restart unweighted
    (``convergence_s``)."""

    name = "convergence"
    description = "lost work weighted by how much it lowers the loss, plus stalls and restarts"
    early_profile_save = True

    def cost(self, breakdown: CostBreakdown) -> float:
        return breakdown.convergence_s


class ProgressObjective(Objective):
    """Everything weighted by value (``progress_s``): an early stall costs as much progress as
    early work."""

    name = "progress"
    description = "stalls, lost work and restarts, all weighted by how much they lower the loss"

    def cost(self, breakdown: CostBreakdown) -> float:
        return breakdown.progress_s


#: The objectives by name: the one list (the ``coci`` command and the TensorBoard tab read
#: their names and descriptions here). Add one with :func:`register_objective`.
OBJECTIVES: dict[str, Objective] = {
    o.name: o for o in (TimeObjective(), ConvergenceObjective(), ProgressObjective())
}


def register_objective(objective: Objective) -> None:
    """Make ``objective`` plannable by its name (``Planner(objective=...)``,
    ``plan_schedule``, the adapters' ``objective`` option); registering a name again replaces
    it.

    Raises:
        ConfigError: ``objective`` is not an :class:`Objective` instance, its name is not a
            non-empty string, or its ``cost`` is not a weighted sum (see :attr:`~Objective.
            weights`).
    """
    if not isinstance(objective, Objective):
        raise ConfigError(f"not an Objective instance: {objective!r}")
    name = getattr(objective, "name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"an objective's name must be a non-empty string: {name!r}")
    objective.weights  # noqa: B018  (checked now, not at the first plan)
    OBJECTIVES[name] = objective


def make_objective(name: Any) -> Objective:
    """The objective named ``name``; unknown names raise ConfigError naming the allowed ones."""
    if not isinstance(name, str) or name not in OBJECTIVES:
        raise ConfigError(f"'objective' must be one of {', '.join(OBJECTIVES)}: {name!r}")
    return OBJECTIVES[name]
